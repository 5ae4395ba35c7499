"""Release records and the individual cost of a Gaussian release.

A release record says what left the machine for a set of units: its kind, the
round id, the noise std and each unit's clipped L2 norm. Pricing is separate
(house style, after dp_accounting's events and accountants): for a unit whose
clipped contribution has norm ||v||, released with N(0, noise_std^2 I) noise,
mu = ||v|| / noise_std and the individual cost is (privacy.md §2; FZ Ex. 2.6-2.7,
Cor. 4.7; KTH):

- Rényi DP of order alpha: alpha mu^2 / 2
- zCDP: mu^2 / 2
- Gaussian DP: mu  (composes as sqrt(sum mu_t^2), ST)

Every Gaussian filter is therefore a threshold on one number per unit, the spent
squared budget S = sum_t mu_t^2; :func:`squared_sensitivity` is that increment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from protocol.validate import PrivacyParameterError, order_above_one, positive, positive_int

ReleaseKind = Literal["gradient", "indicator", "count", "monitor", "metric"]
RELEASE_KINDS: tuple[str, ...] = ("gradient", "indicator", "count", "monitor", "metric")


def _readonly_norms(values: object) -> NDArray[np.float64]:
    arr = np.array(values, dtype=np.float64, copy=True).reshape(-1)
    if not np.all(np.isfinite(arr)):
        raise PrivacyParameterError("l2_norms: expected finite norms, found NaN or infinity")
    if np.any(arr < 0):
        raise PrivacyParameterError(f"l2_norms: expected norms >= 0, found {float(arr.min())!r}")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class GaussianRelease:
    """What one Gaussian release disclosed about each unit: kind, round id, noise std, clipped norms.

    ``l2_norms[u]`` is the L2 norm of unit u's clipped contribution in this release
    (0 for a unit that did not take part). ``refused[u]`` marks a unit the filter
    refused in this release (it asked for more than it had left, released 0 and
    stopped for good): the stop is part of the record so that replaying records
    rebuilds it. Privacy: the record is what the ledger stores and what filters are
    rebuilt from; it never holds data or noise.
    """

    kind: str
    round_id: str
    noise_std: float
    l2_norms: NDArray[np.float64] = field(repr=False)
    refused: NDArray[np.bool_] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in RELEASE_KINDS:
            raise PrivacyParameterError(f"kind: expected one of {RELEASE_KINDS}, got {self.kind!r}")
        if not isinstance(self.round_id, str) or not self.round_id:
            raise PrivacyParameterError(f"round_id: expected a non-empty string, got {self.round_id!r}")
        object.__setattr__(self, "noise_std", positive("noise_std", self.noise_std))
        object.__setattr__(self, "l2_norms", _readonly_norms(self.l2_norms))
        refused = np.zeros(self.l2_norms.size, dtype=np.bool_) if self.refused is None else self.refused
        refused = np.array(refused, dtype=np.bool_, copy=True).reshape(-1)
        if refused.size != self.l2_norms.size:
            raise PrivacyParameterError(f"refused: expected {self.l2_norms.size} flags, got {refused.size}")
        # Not l2_norms[refused]: reading through a mask takes time that grows with the units refused.
        if np.any(refused & (self.l2_norms > 0)):
            raise PrivacyParameterError("refused: a refused unit cannot have released a non-zero contribution")
        refused.setflags(write=False)
        object.__setattr__(self, "refused", refused)

    @property
    def mu(self) -> NDArray[np.float64]:
        """Per-unit sensitivity in noise units, ||v|| / noise_std."""
        return self.l2_norms / self.noise_std

    @property
    def squared_sensitivity(self) -> NDArray[np.float64]:
        """Per-unit increment of S = sum mu_t^2."""
        return squared_sensitivity(l2_norms=self.l2_norms, noise_std=self.noise_std)


def squared_sensitivity(*, l2_norms: NDArray[np.float64], noise_std: float) -> NDArray[np.float64]:
    """mu^2 = ||v||^2 / noise_std^2 per unit: the increment of every Gaussian filter's S."""
    inv_var = 1.0 / (noise_std * noise_std)
    out = np.square(np.asarray(l2_norms, dtype=np.float64))
    out *= inv_var
    return out


def gdp_cost(*, mu: float) -> float:
    """Gaussian DP of one release with sensitivity ``mu`` (DRS Thm 2.7: the Gaussian mechanism is mu-GDP)."""
    return float(mu)


def zcdp_cost(*, mu: float) -> float:
    """zCDP of one release: mu^2 / 2 (BS Prop. 1.6)."""
    return 0.5 * float(mu) ** 2


def rdp_cost(*, mu: float, order: float) -> float:
    """Rényi DP at ``order`` of one release: alpha mu^2 / 2 (Mironov 2017 Prop. 7; FZ Ex. 2.6)."""
    order = order_above_one("order", order)
    return 0.5 * order * float(mu) ** 2


def tree_levels(max_rounds: int) -> int:
    """L = ceil(log2 N) + 1: the binary-tree counter's levels over N rounds, hence the most nodes one halt
    event lands in (DNPR; privacy.md §7). Its cost is L / sigma_m^2 of the squared budget."""
    return math.ceil(math.log2(positive_int("max_rounds", max_rounds))) + 1
