"""Mechanism-level privacy filters, for comparison experiments (privacy.md §5).

These charge every round its worst-case parameters, whoever the unit is. Each is a
pure predicate over the history of per-round parameters, "may the rounds so far
(including the one about to run) be released?", checked before the release; the
filter halts at the first round for which it is false and stays halted.

- additive (basic composition): sum eps_t <= epsilon and sum delta_t <= delta.
- RRUV (Thm 5.1, as stated in FZ Sec. 4.3 for pure eps_t-DP rounds): continue while
  1/2 sum eps_t (e^{eps_t} - 1) + sqrt(2 (sum eps_t^2 + H)(1 + 1/2 log(1 + sum eps_t^2 / H)) log(1/delta))
  <= epsilon, with H = epsilon^2 / (28.04 log(1/delta)).
- FZ's DP filter (Thm 4.8): continue while 1/2 sum eps_t^2 <= B*, B* = BS rho budget.
- RDP at one order fixed in advance (FZ Thm 4.3): continue while sum RDP_t(alpha) <= B_alpha.

Rounds that are (eps_t, delta_t)-DP with delta_t > 0 enter RRUV and FZ's DP filter
through their eps_t only; their delta_t must then be budgeted separately
(sum delta_t <= delta_rounds, total delta = delta + delta_rounds), which
:func:`split_approx_rounds_allowed` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from protocol.conversions import RdpConversion, rdp_budget, rho_budget
from protocol.validate import PrivacyParameterError, open_unit, order_above_one, positive


def _epsilons(name: str, values: Sequence[float]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise PrivacyParameterError(f"{name}: expected finite per-round values >= 0")
    return arr


def additive_allows(*, epsilons: Sequence[float], deltas: Sequence[float], epsilon: float, delta: float) -> bool:
    """Basic composition: sum eps_t <= epsilon and sum delta_t <= delta."""
    eps = _epsilons("epsilons", epsilons)
    dels = _epsilons("deltas", deltas)
    if eps.size != dels.size:
        raise PrivacyParameterError(f"deltas: expected {eps.size} values (one per round), got {dels.size}")
    return bool(eps.sum() <= positive("epsilon", epsilon) and dels.sum() <= open_unit("delta", delta))


def rruv_bound(*, epsilons: Sequence[float], epsilon: float, delta: float) -> float:
    """The left-hand side of RRUV's filter condition (FZ Sec. 4.3 statement of RRUV Thm 5.1)."""
    eps = _epsilons("epsilons", epsilons)
    eps_g = positive("epsilon", epsilon)
    log_inv = math.log(1.0 / open_unit("delta", delta))
    h = eps_g**2 / (28.04 * log_inv)
    sq = float(np.sum(eps**2))
    first = 0.5 * float(np.sum(eps * np.expm1(eps)))
    second = math.sqrt(2.0 * (sq + h) * (1.0 + 0.5 * math.log1p(sq / h)) * log_inv)
    return first + second


def rruv_allows(*, epsilons: Sequence[float], epsilon: float, delta: float) -> bool:
    """RRUV's filter: continue while :func:`rruv_bound` <= epsilon."""
    return rruv_bound(epsilons=epsilons, epsilon=epsilon, delta=delta) <= epsilon


def fz_dp_allows(*, epsilons: Sequence[float], epsilon: float, delta: float) -> bool:
    """FZ Thm 4.8: continue while 1/2 sum eps_t^2 <= B*, B* = (sqrt(log(1/delta) + epsilon) - sqrt(log(1/delta)))^2."""
    eps = _epsilons("epsilons", epsilons)
    return bool(0.5 * float(np.sum(eps**2)) <= rho_budget(epsilon=epsilon, delta=delta, conversion="bs"))


def pure_dp_rdp(*, epsilon_round: float, order: float) -> float:
    """RDP at ``order`` of an eps-DP round: min(eps, alpha eps^2/2) (Mironov 2017 Prop. 3; BS Prop. 3.3)."""
    eps = float(epsilon_round)
    if not math.isfinite(eps) or eps < 0:
        raise PrivacyParameterError(f"epsilon_round: expected a finite number >= 0, got {epsilon_round!r}")
    return min(eps, 0.5 * order_above_one("order", order) * eps * eps)


def rdp_allows(
    *, rdps: Sequence[float], order: float, epsilon: float, delta: float, conversion: RdpConversion = "improved"
) -> bool:
    """FZ's Rényi filter at one order fixed in advance: sum of per-round RDP at ``order`` <= B_alpha."""
    values = _epsilons("rdps", rdps)
    return bool(float(values.sum()) <= rdp_budget(epsilon=epsilon, delta=delta, order=order, conversion=conversion))


def rounds_allowed(allows: Callable[[int], bool], *, limit: int = 10_000_000) -> int:
    """The number of identical rounds a monotone filter admits: the largest k with ``allows(k)``.

    ``allows(k)`` must say whether k identical rounds may all be released; every filter
    here is monotone in k (each round adds a non-negative amount), so an exponential
    then binary search finds the first refusal.
    """
    if not allows(1):
        return 0
    hi = 1
    while allows(hi * 2):
        hi *= 2
        if hi > limit:
            raise PrivacyParameterError(f"rounds: the filter admits more than {limit} rounds; is the cost zero?")
    lo, hi = hi, hi * 2  # allows(lo), not allows(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if allows(mid):
            lo = mid
        else:
            hi = mid
    return lo


def split_approx_rounds_allowed(allows_eps: Callable[[int], bool], *, delta_round: float, delta_rounds: float) -> int:
    """Rounds allowed when each round is (eps_t, delta_round)-DP: the eps filter, capped by sum delta_t."""
    by_eps = rounds_allowed(allows_eps)
    by_delta = math.floor(delta_rounds / positive("delta_round", delta_round) * (1 + 1e-12))
    return min(by_eps, by_delta)
