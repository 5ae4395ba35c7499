"""Realisation-level privacy filter (TVC), for Gaussian releases in local trust.

The unit tracks the *realised* privacy loss of its own transcript against the null
element (privacy.md §6). For a clipped contribution v and the release y = v + xi
(xi the unit's own noise, known to the client), the realised loss is

    l_t = (2 <v + xi, v> - ||v||^2) / (2 sigma^2),   ~ N(mu_t^2/2, mu_t^2) under the unit's data.

With L_{i-1} = sum_{t<i} l_t, a cap mu_max on any request's sensitivity and
z(p) = Phi^{-1}(1 - p), the unit, holding request i (mu_i known) and before looking
at y_i, decides whether it will accept request i+1:

    continue iff |L_{i-1}| <= epsilon - mu_max^2/2 - mu_max z(delta_tilde) - mu_i^2/2 - mu_i z(theta)

and it releases y_i either way (TVC Alg. 1). It answers at most N requests. With
delta_tilde + theta (1 - delta_tilde) N <= delta the transcript is (epsilon, delta)-DP
(TVC Thm 1). For i.i.d. requests of sensitivity mu this is TVC Prop. 1:
kappa = epsilon - mu^2 - mu (z(delta_tilde) + z(theta)).

The first request is accepted by the same rule with L_0 = 0 and no current request
(mu_0 = 0): epsilon - mu_max^2/2 - mu_max z(delta_tilde) >= 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray
from scipy import optimize, special

from protocol.validate import PrivacyParameterError, open_unit, positive, positive_int


def upper_quantile(p: float) -> float:
    """z(p) = Phi^{-1}(1 - p), the upper-tail Gaussian quantile."""
    return float(-special.ndtri(p))


def theta_for(*, delta: float, delta_tilde: float, max_rounds: int) -> float:
    """theta(delta_tilde) = (delta - delta_tilde) / (N (1 - delta_tilde)): the largest theta the budget allows."""
    return (delta - delta_tilde) / (max_rounds * (1.0 - delta_tilde))


def choose_split(*, delta: float, max_rounds: int) -> tuple[float, float]:
    """(delta_tilde, theta) minimising z(delta_tilde) + z(theta(delta_tilde)) for N rounds (privacy.md §6)."""
    delta = open_unit("delta", delta)
    n = positive_int("max_rounds", max_rounds)

    def objective(log_frac: float) -> float:
        dt = delta * special.expit(log_frac)
        return upper_quantile(dt) + upper_quantile(theta_for(delta=delta, delta_tilde=dt, max_rounds=n))

    grid = np.linspace(-30.0, 30.0, 601)
    values = np.array([objective(x) for x in grid])
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = optimize.minimize_scalar(objective, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
    best = float(res.x) if res.fun <= values[i] else float(grid[i])
    dt = delta * float(special.expit(best))
    return dt, theta_for(delta=delta, delta_tilde=dt, max_rounds=n)


@dataclass(frozen=True)
class RealisationFilter:
    """TVC's realisation-level filter: (epsilon, delta), at most ``max_rounds`` requests, cap ``mu_max``."""

    epsilon: float
    delta: float
    max_rounds: int
    mu_max: float
    delta_tilde: float
    theta: float

    def __post_init__(self) -> None:
        positive("epsilon", self.epsilon)
        open_unit("delta", self.delta)
        positive_int("max_rounds", self.max_rounds)
        positive("mu_max", self.mu_max)
        open_unit("delta_tilde", self.delta_tilde)
        open_unit("theta", self.theta)
        spent = self.delta_tilde + self.theta * (1.0 - self.delta_tilde) * self.max_rounds
        if spent > self.delta * (1.0 + 1e-12):
            raise PrivacyParameterError(
                f"(delta_tilde, theta): expected delta_tilde + theta (1 - delta_tilde) N <= delta = {self.delta!r}, "
                f"got {spent!r}"
            )

    @classmethod
    def create(cls, *, epsilon: float, delta: float, max_rounds: int, mu_max: float) -> RealisationFilter:
        """The filter with (delta_tilde, theta) chosen by :func:`choose_split`."""
        dt, theta = choose_split(delta=delta, max_rounds=max_rounds)
        return cls(epsilon=epsilon, delta=delta, max_rounds=max_rounds, mu_max=mu_max, delta_tilde=dt, theta=theta)

    def margin(self, mu: NDArray[np.float64] | float) -> NDArray[np.float64]:
        """The right-hand side of the continue rule for a current request of sensitivity ``mu``."""
        mu_arr = np.asarray(mu, dtype=np.float64)
        z_dt = upper_quantile(self.delta_tilde)
        z_th = upper_quantile(self.theta)
        head = self.epsilon - 0.5 * self.mu_max**2 - self.mu_max * z_dt
        return np.asarray(head - 0.5 * mu_arr**2 - mu_arr * z_th, dtype=np.float64)

    def kappa(self, *, mu: float) -> float:
        """TVC Prop. 1: the threshold on |L| for i.i.d. requests of sensitivity ``mu`` (= mu_max)."""
        return float(self.margin(mu))

    def describe(self) -> dict[str, object]:
        return {
            "filter": "realisation",
            "epsilon": self.epsilon,
            "delta": self.delta,
            "max_rounds": self.max_rounds,
            "mu_max": self.mu_max,
            "delta_tilde": self.delta_tilde,
            "theta": self.theta,
        }


@dataclass(frozen=True, eq=False)
class RealisationState:
    """Per unit: realised loss L, whether it accepts the next request, requests answered."""

    loss: NDArray[np.float64] = field(repr=False)
    accepting: NDArray[np.bool_] = field(repr=False)
    answered: int = 0

    def __post_init__(self) -> None:
        loss = np.array(self.loss, dtype=np.float64).reshape(-1)
        accepting = np.array(self.accepting, dtype=np.bool_).reshape(-1)
        if loss.shape != accepting.shape:
            raise PrivacyParameterError(f"state: loss has {loss.size} units but accepting has {accepting.size}")
        if not np.all(np.isfinite(loss)):
            raise PrivacyParameterError("state.loss: expected finite values")
        loss.setflags(write=False)
        accepting.setflags(write=False)
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "accepting", accepting)

    @classmethod
    def fresh(cls, filt: RealisationFilter, n_units: int) -> RealisationState:
        """Before any request: a unit accepts the first iff the worst single request fits (mu_0 = 0)."""
        n = positive_int("n_units", n_units)
        first = bool(filt.margin(0.0) >= 0.0)
        return cls(loss=np.zeros(n), accepting=np.full(n, first))

    @property
    def stopped(self) -> NDArray[np.bool_]:
        return ~self.accepting


def realised_loss(
    *, contribution: NDArray[np.floating], noise: NDArray[np.floating], noise_std: float
) -> NDArray[np.float64]:
    """l = (2 <v + xi, v> - ||v||^2) / (2 sigma^2) per unit (rows of ``contribution``), xi the released noise.

    ``noise`` is the noise the unit's part of the release carries: one vector shared by
    all rows (record units under one client's noise) or one row per unit.
    """
    sigma = positive("noise_std", noise_std)
    v = np.asarray(contribution, dtype=np.float64)
    if v.ndim != 2:
        raise PrivacyParameterError(f"contribution: expected a (units, dim) array, got shape {v.shape}")
    xi = np.asarray(noise, dtype=np.float64)
    if xi.shape not in (v.shape[1:], v.shape):
        raise PrivacyParameterError(f"noise: expected shape {v.shape[1:]} or {v.shape}, got {xi.shape}")
    cross = v @ xi if xi.ndim == 1 else np.einsum("ij,ij->i", v, xi)
    sq = np.einsum("ij,ij->i", v, v)
    return np.asarray((sq + 2.0 * cross) / (2.0 * sigma * sigma), dtype=np.float64)


@dataclass(frozen=True, eq=False)
class RealisationStep:
    """The decision for one request: who takes part now, and who will accept the next one."""

    participating: NDArray[np.bool_] = field(repr=False)
    accept_next: NDArray[np.bool_] = field(repr=False)


def decide(filt: RealisationFilter, state: RealisationState, *, mu: NDArray[np.floating]) -> RealisationStep:
    """Before looking at y_i: units that accepted request i take part; each decides on request i+1.

    ``mu`` is each unit's sensitivity in this request (clipped norm / sigma), at most
    ``mu_max``: a larger one is an error, since the rule's worst case would not hold.
    """
    mu_arr = np.asarray(mu, dtype=np.float64).reshape(-1)
    if mu_arr.size != state.loss.size:
        raise PrivacyParameterError(f"mu: expected {state.loss.size} sensitivities (one per unit), got {mu_arr.size}")
    if not np.all(np.isfinite(mu_arr)) or np.any(mu_arr < 0):
        raise PrivacyParameterError("mu: expected finite sensitivities >= 0")
    if np.any(mu_arr > filt.mu_max * (1.0 + 1e-12)):
        raise PrivacyParameterError(
            f"mu: expected sensitivities <= mu_max = {filt.mu_max!r}, got {float(mu_arr.max())!r}"
        )
    participating = state.accepting.copy()
    if state.answered >= filt.max_rounds:
        participating[:] = False
    room = np.abs(state.loss) <= filt.margin(mu_arr)
    more = state.answered + 1 < filt.max_rounds
    accept_next = participating & room & more
    return RealisationStep(participating=participating, accept_next=accept_next)


def advance(state: RealisationState, step: RealisationStep, *, losses: NDArray[np.floating]) -> RealisationState:
    """Fold request i's realised losses (0 for units that did not take part) into the state."""
    loss = np.asarray(losses, dtype=np.float64).reshape(-1)
    if loss.size != state.loss.size:
        raise PrivacyParameterError(f"losses: expected {state.loss.size} values, got {loss.size}")
    if np.any((loss != 0.0) & ~step.participating):
        raise PrivacyParameterError("losses: a unit that did not take part cannot carry a realised loss")
    return RealisationState(
        loss=state.loss + loss, accepting=step.accept_next & state.accepting, answered=state.answered + 1
    )


__all__ = [
    "RealisationFilter",
    "RealisationState",
    "RealisationStep",
    "advance",
    "choose_split",
    "decide",
    "realised_loss",
    "theta_for",
    "upper_quantile",
]
