"""A privacy odometer for each unit: an (epsilon, delta) bound on what it has spent so far, valid whenever one stops.

A filter's conversion of the spend S (``GaussianFilter``'s budget read backwards) is a guarantee for a
budget fixed in advance; read off at a time the coordinators chose adaptively, it is not one (Rogers,
Roth, Ullman & Vadhan 2016 separate the two). An odometer is. This one is the filters-to-odometer
construction of Lécuyer, "Practical Privacy Filters and Odometers with Rényi Differential Privacy and
Applications to Differentially Private Deep Learning" (2021, odometers from a sequence of filters at
increasing budgets), and of Whitehouse, Ramdas, Rogers & Wu, "Fully-Adaptive Composition in
Differential Privacy" (ICML 2023, odometers from filters with delta split across them):

**Levels (fixed in advance, from the ledger's configuration only).** With ``B_top`` = the filter's full
budget in its additive currency S = sum_t mu_t^2 (threshold + reserved monitor cost), ``r`` =
:data:`RATIO` and ``L`` = :data:`LEVELS`, level j = 0..L-1 has

    B_j = B_top * r^-(L-1-j)          (the top level, j = L-1, is the full budget)
    delta_j = delta * 2^-(L-j)        (the top gets delta/2, the next delta/4, ...; sum < delta)
    epsilon_j = conversion(B_j, delta_j)

where ``conversion`` is the filter kind's own, for a spend of B:
  - ``gdp``: mu = sqrt(B), epsilon = gdp_epsilon(mu, delta_j) (DRS Cor. 2.13);
  - ``zcdp``: rho = B / 2, epsilon = zcdp_epsilon(rho, delta_j) with the filter's conversion (CKS or BS);
  - ``renyi``: RDP alpha B / 2 at the filter's order, rdp_epsilon at delta_j with the filter's conversion;
  - ``renyi_multi``: the smallest such epsilon over the filter's orders, each at delta_j.

**Reading.** For a unit whose spend is S (plus the reserved monitor cost, counted as spent from
enrolment), the odometer reads the smallest epsilon_j over the levels that cover it (B_j >= S), plus
epsilon_svt for a central-trust SVT monitor (basic composition, privacy.md §7). Nothing spent reads 0.
Dropping a level whose epsilon is not below a larger level's (at deep levels a Rényi conversion's
log(1/delta_j) term grows faster than alpha B_j / 2 shrinks) leaves the published rule: levels with
epsilon increasing in B, and the reading is the epsilon of the smallest level whose budget covers the
spend so far. A spend above B_top (never, in a ledger that ``ledger verify`` accepts) reads infinity.

**Why it is valid at any stopping time.** Level j alone is the filter "continue while S <= B_j", the
project's own filter at a smaller budget: valid under full adaptivity (GDP: ST; KTH; zCDP and Rényi:
FZ Thm 4.3 — a Gaussian release's cost is alpha mu^2 / 2 at every order, so one rule S <= B_j is a Rényi
filter at every order at once, and the best order may be taken at each level). So for every level j,
the interaction stopped where the spend would first pass B_j — whatever the coordinators asked and
whenever they stop — is (epsilon_j, delta_j)-DP for the unit. If the odometer reads epsilon_j at some
time, every release so far kept S <= B_j (S never decreases), so the transcript so far is a prefix of
level j's: it carries level j's guarantee. The levels' deltas add up to less than delta, so all the
levels' guarantees hold together (the union bound of both papers). The levels depend only on the
ledger's fixed configuration, never on the data or on the requests.

**Never below the plain conversion.** Each conversion grows with the spend and shrinks with delta, and
a covering level has B_j >= S and delta_j < delta; so the reading is at least the filter's conversion of
S at the ledger's delta (:meth:`Odometer.plain`). At the full budget it is a little above the filter's
target epsilon (the price of not fixing the stopping time in advance); for ``renyi_multi`` it may be below
it, because that filter's target pays a union bound over its orders (delta/k each) that one level, a
Rényi filter at all orders at once, does not need.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from protocol.conversions import RdpConversion, gdp_epsilon, rdp_epsilon, zcdp_epsilon
from protocol.filters import GaussianFilter
from protocol.validate import PrivacyParameterError, non_negative

RATIO = 2.0**0.25
"""Budget ratio between consecutive levels: each level's S budget is 2^(1/4) (about 1.19) times the last."""
LEVELS = 64
"""Number of levels: the lowest covers S up to 2^-15.75 (about 1.8e-5) of the full budget."""


def conversion_epsilon(filt: GaussianFilter, spent: float, delta: float) -> float:
    """The filter kind's own conversion of a spend ``spent`` (in S = sum mu^2) to epsilon at ``delta``."""
    if spent <= 0.0:
        return 0.0
    if filt.kind == "gdp":
        return gdp_epsilon(mu=math.sqrt(spent), delta=delta)
    if filt.kind == "zcdp":
        return zcdp_epsilon(rho=spent / 2.0, delta=delta, conversion="bs" if filt.conversion == "bs" else "cks")
    rdp_conversion: RdpConversion = "mironov" if filt.conversion == "mironov" else "improved"
    if filt.kind in ("renyi", "renyi_multi"):
        if not filt.orders:
            raise PrivacyParameterError(f"filter {filt.kind!r}: expected its Rényi order(s), found none")
        return min(
            rdp_epsilon(rdp=order * spent / 2.0, order=order, delta=delta, conversion=rdp_conversion)
            for order in filt.orders
        )
    raise PrivacyParameterError(f"filter: expected one of gdp, zcdp, renyi, renyi_multi, got {filt.kind!r}")


@dataclass(frozen=True)
class Odometer:
    """The levels of :mod:`client_agent.odometer`'s rule for one filter; :meth:`epsilon` reads a unit's spend."""

    filter: GaussianFilter
    budgets: tuple[float, ...]  # B_j, increasing; the last is the full budget
    deltas: tuple[float, ...]  # delta_j
    epsilons: tuple[float, ...]  # conversion(B_j, delta_j)
    offset: float = 0.0  # S counted as spent from enrolment (the tree monitor's reservation)
    extra_epsilon: float = 0.0  # epsilon added to every reading (the SVT monitor's, basic composition)

    @classmethod
    def for_filter(cls, filt: GaussianFilter, *, extra_epsilon: float = 0.0) -> Odometer:
        """The odometer of ``filt``: levels up to its full budget (threshold + reserved), at its delta."""
        return _odometer(filt, non_negative("extra_epsilon", extra_epsilon))

    @property
    def full_budget(self) -> float:
        """B_top: the filter's whole budget in S (threshold plus the reserved monitor cost)."""
        return self.budgets[-1]

    @functools.cached_property
    def _readings(self) -> NDArray[np.float64]:
        # The smallest epsilon over the levels at or above each one (suffix minimum): see the module's rule.
        eps = np.asarray(self.epsilons, dtype=np.float64)
        return np.minimum.accumulate(eps[::-1])[::-1]

    def epsilon(self, spent: ArrayLike) -> NDArray[np.float64]:
        """The odometer's epsilon (at the filter's delta) for each unit's releases' spend S (vectorised)."""
        s = np.asarray(spent, dtype=np.float64)
        if np.any(~np.isfinite(s)) or np.any(s < 0):
            raise PrivacyParameterError("spent: expected finite values >= 0")
        total = s + self.offset
        index = np.searchsorted(np.asarray(self.budgets), total, side="left")
        readings = np.append(self._readings, np.inf)[index]
        out = np.where(total > 0.0, readings, 0.0) + self.extra_epsilon
        return np.asarray(out, dtype=np.float64)

    def plain(self, spent: float) -> float:
        """The filter's conversion of S (plus the reservation) at the ledger's delta: valid only for a budget fixed
        in advance, never above :meth:`epsilon` (a reference, not a running bound)."""
        return conversion_epsilon(self.filter, float(spent) + self.offset, self.filter.delta) + self.extra_epsilon

    def describe(self) -> dict[str, object]:
        """A JSON-ready statement of the rule and its top reading."""
        return {
            "rule": "Lécuyer 2021 / Whitehouse et al. 2023: filters at budgets B_top * r^-k, delta/2^(k+1) each; "
            "reads the epsilon of the smallest level covering the spend",
            "levels": len(self.budgets),
            "ratio": RATIO,
            "full_budget": self.full_budget,
            "delta": self.filter.delta,
            "epsilon_at_full_budget": float(self.epsilon(self.filter.threshold)),
            "filter_epsilon": self.filter.epsilon + self.extra_epsilon,
        }


@functools.lru_cache(maxsize=32)
def _odometer(filt: GaussianFilter, extra_epsilon: float) -> Odometer:
    top = filt.threshold + filt.reserved
    # The top level (j = L-1, r^0) is exactly the full budget.
    budgets = tuple(top * RATIO ** -(LEVELS - 1 - j) if j < LEVELS - 1 else top for j in range(LEVELS))
    deltas = tuple(filt.delta * 2.0 ** -(LEVELS - j) for j in range(LEVELS))
    epsilons = tuple(conversion_epsilon(filt, b, d) for b, d in zip(budgets, deltas, strict=True))
    return Odometer(filt, budgets, deltas, epsilons, offset=filt.reserved, extra_epsilon=extra_epsilon)
