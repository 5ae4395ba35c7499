"""How many identical rounds each filter admits: the accounting behind the comparison presets.

Mechanism-level filters (privacy.md §5) charge every round its worst-case parameters, so for
identical rounds the round at which they halt is a number, computed here from the filters'
own predicates (:mod:`protocol.mechanism_filters`) and thresholds (:mod:`protocol.filters`).

Two kinds of rounds:

- pure eps_t-DP rounds (FZ Sec. 4.3): RRUV and FZ's DP filter (Thm 4.8) take eps_t directly;
  the GDP filter takes the GDP parameter of an eps_t-DP mechanism (:func:`pure_dp_gdp_mu`).
- Gaussian rounds of sensitivity mu = C / sigma (TVC Fig. 2; FZ Sec. 4.3 on a sigma grid):
  the GDP, zCDP and Rényi filters price them exactly as the clients do (privacy.md §3). The
  additive filter and RRUV need an (eps_t, delta_t) pair per round; a Gaussian round is
  (eps_t, delta_GDP(mu, eps_t))-DP for every eps_t >= 0 (DRS Cor. 2.13). The pair is the same
  every round and is chosen to admit the most rounds (:func:`gaussian_additive_rounds`,
  :func:`gaussian_rruv_rounds`); its delta_t is budgeted by :func:`split_approx_rounds_allowed`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from scipy import special

from protocol.conversions import gdp_delta, gdp_epsilon, mu_budget, rho_budget
from protocol.filters import GaussianFilter, rounds_within
from protocol.mechanism_filters import (
    additive_allows,
    fz_dp_allows,
    rounds_allowed,
    rruv_allows,
    split_approx_rounds_allowed,
)
from protocol.validate import PrivacyParameterError, open_unit, positive

# Fractions of delta given to RRUV's own eps-filter; the rest budgets sum delta_t. A grid:
# the best fraction is reported with the rounds it admits.
RRUV_DELTA_FRACTIONS: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 20))

# eps_t is computed for a delta_t target shrunk by this relative margin, so that the root
# finder's tolerance can never put k delta_t above the budget.
_DELTA_MARGIN = 1e-9


def pure_dp_gdp_mu(*, epsilon_round: float) -> float:
    """The smallest mu for which every eps-DP mechanism is mu-GDP: mu = 2 Phi^{-1}(e^eps / (1 + e^eps)).

    Derivation (written here because no conversion in privacy.md covers it). An eps-DP
    mechanism is f_{eps,0}-DP (DRS Sec. 2, the characterisation of Wasserman & Zhou 2010),
    f_{eps,0}(a) = max(0, 1 - e^eps a, e^-eps (1 - a)): two segments meeting at the corner
    a* = 1 / (1 + e^eps), where f_{eps,0}(a*) = a*. The Gaussian trade-off
    G_mu(a) = Phi(Phi^{-1}(1 - a) - mu) (DRS Def. of GDP) is convex, equals f_{eps,0} at a = 0 and
    a = 1, and crosses the diagonal at a = Phi(-mu/2) (G_mu(a) - a is decreasing). A convex
    function lies under its chords, so G_mu <= f_{eps,0} on [0, a*] and on [a*, 1] as soon as
    G_mu(a*) <= a*, that is a* >= Phi(-mu/2); below that mu it fails at a*. Randomised response
    attains f_{eps,0}, so no smaller mu holds for every eps-DP mechanism. (Liu, Sun, Jiang & Kong,
    NeurIPS 2022, show in general that eps-DP mechanisms are GDP.) By Blackwell's theorem
    (DRS) this is the GDP of Smith & Thakurta's definition, whose filter sum mu_t^2 <= mu_B^2 is
    valid for adaptively chosen mu_t-GDP mechanisms (ST), Gaussian or not.
    """
    eps = float(epsilon_round)
    if not math.isfinite(eps) or eps <= 0:
        raise PrivacyParameterError(f"epsilon_round: expected a finite number > 0, got {epsilon_round!r}")
    # 2 Phi^{-1}(e^eps/(1+e^eps)) = -2 Phi^{-1}(1/(1+e^eps)) = -2 Phi^{-1}(expit(-eps)), stable for large eps.
    return float(-2.0 * special.ndtri(special.expit(-eps)))


@dataclass(frozen=True)
class ApproxRounds:
    """k identical (eps_t, delta_t)-DP rounds an (epsilon, delta) filter admits, and the pair that does it.

    ``delta_filter`` is the part of delta the eps-filter itself runs at (RRUV; 0 for the
    additive filter) and ``delta_rounds`` the part that budgets sum delta_t; they add up to delta.
    With ``rounds`` = 0 no pair admits even one round and the pair fields are NaN.
    """

    rounds: int
    epsilon_round: float
    delta_round: float
    delta_filter: float
    delta_rounds: float

    def describe(self) -> dict[str, float | int | None]:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "rounds": self.rounds,
            "epsilon_round": finite(self.epsilon_round),
            "delta_round": finite(self.delta_round),
            "delta_filter": finite(self.delta_filter),
            "delta_rounds": finite(self.delta_rounds),
        }


_NONE = ApproxRounds(0, math.nan, math.nan, math.nan, math.nan)


def _same(k: int, value: float) -> Sequence[float]:
    """k identical per-round values, as an array (the filters read them through ``np.asarray``)."""
    return cast("Sequence[float]", np.full(k, value))


def _epsilon_for(mu: float, delta_round: float) -> float:
    """The smallest eps_t whose delta_GDP(mu, eps_t) is at most ``delta_round`` (with the margin)."""
    return gdp_epsilon(mu=mu, delta=delta_round * (1.0 - _DELTA_MARGIN))


def gaussian_additive_rounds(*, mu: float, epsilon: float, delta: float) -> ApproxRounds:
    """Basic composition of Gaussian rounds: the largest k with k delta_GDP(mu, epsilon / k) <= delta.

    Rule: the same pair every round. For k rounds sum eps_t <= epsilon forces eps_t <= epsilon / k,
    and delta_GDP(mu, .) decreases (DRS Cor. 2.13), so eps_t = epsilon / k is the best choice
    among identical pairs; k is admitted iff k delta_GDP(mu, epsilon / k) <= delta. (eps_t carries a
    relative margin of 1e-12 so that rounding in the sum cannot exceed epsilon.)
    """
    mu = positive("mu", mu)
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)

    def pair(k: int) -> tuple[float, float]:
        eps_t = epsilon / k * (1.0 - 1e-12)
        return eps_t, gdp_delta(mu=mu, epsilon=eps_t)

    def allows(k: int) -> bool:
        eps_t, delta_t = pair(k)
        return additive_allows(epsilons=_same(k, eps_t), deltas=_same(k, delta_t), epsilon=epsilon, delta=delta)

    k = rounds_allowed(allows)
    if k == 0:
        return _NONE
    eps_t, delta_t = pair(k)
    return ApproxRounds(k, eps_t, delta_t, 0.0, delta)


def gaussian_rruv_rounds(
    *, mu: float, epsilon: float, delta: float, fractions: Sequence[float] = RRUV_DELTA_FRACTIONS
) -> ApproxRounds:
    """RRUV over Gaussian rounds: the most identical rounds over eps_t and the delta split.

    delta = delta_filter + delta_rounds: RRUV's condition (privacy.md §5, FZ Sec. 4.3) runs at
    delta_filter = f delta, and sum delta_t <= delta_rounds (:func:`split_approx_rounds_allowed`).
    For k rounds and a fraction f the best eps_t is the smallest one with
    k delta_GDP(mu, eps_t) <= delta_rounds (RRUV's bound grows with eps_t); k is admitted iff RRUV
    allows k rounds at that eps_t. The result is the best k over the grid ``fractions``.
    """
    mu = positive("mu", mu)
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)
    best = _NONE
    for f in fractions:
        if not 0.0 < f < 1.0:
            raise PrivacyParameterError(f"fractions: expected values in (0, 1), got {f!r}")
        delta_filter, delta_rounds = f * delta, (1.0 - f) * delta

        def feasible(k: int, delta_filter: float = delta_filter, delta_rounds: float = delta_rounds) -> bool:
            eps_t = _epsilon_for(mu, delta_rounds / k)
            return rruv_allows(epsilons=_same(k, eps_t), epsilon=epsilon, delta=delta_filter)

        k = rounds_allowed(feasible)
        if k <= best.rounds:
            continue
        eps_t = _epsilon_for(mu, delta_rounds / k)
        delta_t = gdp_delta(mu=mu, epsilon=eps_t)

        # The same count through the filter's own approximate-DP rule: the eps-filter, capped by sum delta_t.
        def allows_eps(j: int, e: float = eps_t, d: float = delta_filter) -> bool:
            return rruv_allows(epsilons=_same(j, e), epsilon=epsilon, delta=d)

        checked = split_approx_rounds_allowed(allows_eps, delta_round=delta_t, delta_rounds=delta_rounds)
        if checked < k:
            raise AssertionError(f"RRUV split: {k} rounds found but the filter admits {checked} (internal error)")
        best = ApproxRounds(k, eps_t, delta_t, delta_filter, delta_rounds)
    return best


def pure_rounds(*, epsilon_round: float, epsilon: float, delta: float) -> dict[str, int | float]:
    """Rounds of eps_t-DP each filter admits at target (epsilon, delta) (FZ Sec. 4.3 comparison).

    - ``rruv``: RRUV's condition at delta (pure rounds need no delta split);
    - ``fz``: FZ Thm 4.8, 1/2 sum eps_t^2 <= B* (BS conversion);
    - ``gdp``: sum mu_t^2 <= mu_B^2 with mu_t = :func:`pure_dp_gdp_mu` (ST filter; DRS).
    """
    eps_t = positive("epsilon_round", epsilon_round)
    rruv = rounds_allowed(lambda k: rruv_allows(epsilons=_same(k, eps_t), epsilon=epsilon, delta=delta))
    fz = rounds_allowed(lambda k: fz_dp_allows(epsilons=_same(k, eps_t), epsilon=epsilon, delta=delta))
    mu_t = pure_dp_gdp_mu(epsilon_round=eps_t)
    gdp = rounds_within(mu_budget(epsilon=epsilon, delta=delta) ** 2, mu_t**2)
    return {"epsilon_round": eps_t, "gdp_mu_round": mu_t, "rruv": rruv, "fz": fz, "gdp": gdp}


def gaussian_rounds(
    *, noise_std: float, l2_clip: float, epsilon: float, delta: float, additive: bool = False, rdp: bool = False
) -> dict[str, object]:
    """Full-norm Gaussian rounds (mu = C / sigma) each filter admits at target (epsilon, delta).

    - ``gdp``: the GDP filter, floor(mu_B^2 / mu^2) as the clients count it (privacy.md §3);
    - ``fz``: FZ's filter with Thm 4.8's budget, 1/2 sum mu_t^2 <= B* (a Gaussian round is
      mu^2/2-zCDP, BS Prop. 1.6; FZ Remark 4.4): the zCDP filter with the BS conversion;
    - ``rruv``: :func:`gaussian_rruv_rounds`;
    - optionally ``additive`` (:func:`gaussian_additive_rounds`) and ``rdp`` (the Rényi filter at
      the best order fixed in advance, FZ Thm 4.3).
    """
    sigma = positive("noise_std", noise_std)
    clip = positive("l2_clip", l2_clip)
    mu = clip / sigma
    gdp = GaussianFilter.gdp(epsilon=epsilon, delta=delta)
    zcdp_bs = GaussianFilter.zcdp(epsilon=epsilon, delta=delta, conversion="bs")
    out: dict[str, object] = {
        "noise_std": sigma,
        "mu_round": mu,
        "gdp": gdp.full_norm_rounds(noise_std=sigma, l2_clip=clip),
        "fz": zcdp_bs.full_norm_rounds(noise_std=sigma, l2_clip=clip),
        "rruv": gaussian_rruv_rounds(mu=mu, epsilon=epsilon, delta=delta).describe(),
        "budgets": {
            "mu_budget": math.sqrt(gdp.threshold),
            "rho_budget_bs": rho_budget(epsilon=epsilon, delta=delta, conversion="bs"),
        },
    }
    if additive:
        out["additive"] = gaussian_additive_rounds(mu=mu, epsilon=epsilon, delta=delta).describe()
    if rdp:
        renyi = GaussianFilter.renyi(epsilon=epsilon, delta=delta)
        out["rdp"] = {"rounds": renyi.full_norm_rounds(noise_std=sigma, l2_clip=clip), "order": renyi.orders[0]}
    return out


__all__ = [
    "RRUV_DELTA_FRACTIONS",
    "ApproxRounds",
    "gaussian_additive_rounds",
    "gaussian_rounds",
    "gaussian_rruv_rounds",
    "pure_dp_gdp_mu",
    "pure_rounds",
]
