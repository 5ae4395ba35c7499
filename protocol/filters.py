"""Individual Gaussian privacy filters as pure state machines over S = sum_t mu_t^2.

Every filter of privacy.md §3 is, for Gaussian releases, a threshold T on the spent
squared budget S(u) of each unit u (see :mod:`protocol.releases`):

| filter        | continue while                     | threshold T on S                | source                 |
|---------------|------------------------------------|---------------------------------|------------------------|
| ``gdp``       | sqrt(S) <= mu_B                    | mu_B^2                          | ST; KTH                |
| ``zcdp``      | S / 2 <= rho_B                     | 2 rho_B                         | FZ Thm 4.3, Remark 4.4 |
| ``renyi``     | alpha S / 2 <= B_alpha (one order) | 2 B_alpha / alpha               | FZ Thm 4.3             |
| ``renyi_multi``| some order fits, at delta/k each | max_alpha 2 B_alpha(delta/k)/alpha | union bound (k orders) |

Rules (privacy.md §3): the check comes before the release (a unit takes part in a
round only if its new S still satisfies the rule); a unit that is refused, or whose
remaining budget falls to at most ``EXHAUSTED_FRACTION`` of T, is stopped for good;
S never decreases.

State is a frozen pair of read-only arrays; :func:`charge` returns a new state.
``state.spent`` holds S per unit, so a filter over one client is a length-1 state and
a filter over a silo's records is vectorised.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from protocol.branchless import or_zero, select
from protocol.conversions import (
    RdpConversion,
    ZcdpConversion,
    best_rdp_order,
    mu_budget,
    rdp_threshold,
    rho_budget,
)
from protocol.releases import GaussianRelease
from protocol.validate import PrivacyParameterError, non_negative, open_unit, order_above_one, positive, positive_int

FilterKind = Literal["gdp", "zcdp", "renyi", "renyi_multi"]
FILTER_KINDS: tuple[str, ...] = ("gdp", "zcdp", "renyi", "renyi_multi")

# A unit whose remaining budget is at most this fraction of T is exhausted. Partial
# clipping leaves a rounding margin of 64 ulps of the norm (see :func:`clip_scales`),
# about 1.5e-5 of S in float32; without this rule a unit would go on releasing ever
# smaller remainders. It leaves at most 0.01% of a budget unused.
EXHAUSTED_FRACTION = 1e-4


@dataclass(frozen=True)
class GaussianFilter:
    """A per-unit filter for Gaussian releases: continue while S <= ``threshold``.

    Build with :meth:`gdp`, :meth:`zcdp`, :meth:`renyi` or :meth:`renyi_multi`; the
    target (epsilon, delta) is the guarantee for each unit, two-sided (privacy.md §1).
    ``reserved`` is the part of the squared budget set aside at enrolment (for the
    active-set monitor, privacy.md §7); ``threshold`` is what is left for releases.
    """

    kind: str
    epsilon: float
    delta: float
    threshold: float
    reserved: float = 0.0
    orders: tuple[float, ...] = ()
    conversion: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FILTER_KINDS:
            raise PrivacyParameterError(f"filter: expected one of {FILTER_KINDS}, got {self.kind!r}")
        positive("epsilon", self.epsilon)
        open_unit("delta", self.delta)
        positive("threshold", self.threshold)
        non_negative("reserved", self.reserved)

    # -- constructors -------------------------------------------------------------

    @classmethod
    def gdp(cls, *, epsilon: float, delta: float) -> GaussianFilter:
        """GDP filter: continue while sqrt(S) <= mu_B, mu_B from DRS (default; tightest for Gaussian releases)."""
        mu_b = mu_budget(epsilon=epsilon, delta=delta)
        return cls(kind="gdp", epsilon=epsilon, delta=delta, threshold=mu_b * mu_b)

    @classmethod
    def zcdp(cls, *, epsilon: float, delta: float, conversion: ZcdpConversion = "cks") -> GaussianFilter:
        """zCDP filter: continue while S/2 <= rho_B, rho_B by CKS Cor. 13 or BS (FZ Thm 4.8's B*)."""
        rho_b = rho_budget(epsilon=epsilon, delta=delta, conversion=conversion)
        return cls(kind="zcdp", epsilon=epsilon, delta=delta, threshold=2.0 * rho_b, conversion=conversion)

    @classmethod
    def renyi(
        cls,
        *,
        epsilon: float,
        delta: float,
        order: float | None = None,
        conversion: RdpConversion = "improved",
    ) -> GaussianFilter:
        """Rényi filter at one order fixed in advance (FZ Thm 4.3); ``None`` picks the best one for Gaussian rounds."""
        if order is None:
            order = best_rdp_order(epsilon=epsilon, delta=delta, conversion=conversion)
        order = order_above_one("order", order)
        threshold = rdp_threshold(epsilon=epsilon, delta=delta, order=order, conversion=conversion)
        return cls(
            kind="renyi", epsilon=epsilon, delta=delta, threshold=threshold, orders=(order,), conversion=conversion
        )

    @classmethod
    def renyi_multi(
        cls,
        *,
        epsilon: float,
        delta: float,
        orders: Sequence[float] = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
        conversion: RdpConversion = "improved",
    ) -> GaussianFilter:
        """Rényi filter over several orders: continue while any order fits, each at delta/|orders|.

        Derivation: at each order alpha, FZ's filter with budget B_alpha(delta/k) fails
        with probability at most delta/k (FZ Thm 4.3); a union bound over the k orders
        bounds the probability that any of them fails by delta. So running on while
        *some* order's filter holds is (epsilon, delta)-DP. For Gaussian releases the
        rule "alpha S/2 <= B_alpha for some alpha" is S <= max_alpha 2 B_alpha/alpha.
        """
        if len(orders) == 0:
            raise PrivacyParameterError("orders: expected at least one Rényi order, got none")
        checked = tuple(order_above_one(f"orders[{i}]", a) for i, a in enumerate(orders))
        positive("epsilon", epsilon)  # named here: the per-order loop below skips orders, not bad epsilons
        share = open_unit("delta", delta) / len(checked)
        usable = []
        for order in checked:
            try:
                usable.append(rdp_threshold(epsilon=epsilon, delta=share, order=order, conversion=conversion))
            except PrivacyParameterError:
                continue
        if not usable:
            raise PrivacyParameterError(
                f"orders: none of {checked} leaves a positive budget at (epsilon, delta/k)=({epsilon!r}, {share!r})"
            )
        return cls(
            kind="renyi_multi",
            epsilon=epsilon,
            delta=delta,
            threshold=max(usable),
            orders=checked,
            conversion=conversion,
        )

    @classmethod
    def create(cls, kind: str, *, epsilon: float, delta: float, **options: object) -> GaussianFilter:
        """Build a filter by name through a closed table (names come from configs and the wire)."""
        table = {"gdp": cls.gdp, "zcdp": cls.zcdp, "renyi": cls.renyi, "renyi_multi": cls.renyi_multi}
        if kind not in table:
            raise PrivacyParameterError(f"filter: expected one of {tuple(table)}, got {kind!r}")
        built: GaussianFilter = table[kind](epsilon=epsilon, delta=delta, **options)
        return built

    # -- derived ------------------------------------------------------------------

    def reserve(self, *, squared_budget: float) -> GaussianFilter:
        """Set aside ``squared_budget`` of S at enrolment (local-trust monitor: T <- T - S_m, privacy.md §7)."""
        amount = non_negative("squared_budget", squared_budget)
        if amount >= self.threshold:
            raise PrivacyParameterError(
                f"squared_budget: the reservation {amount!r} leaves nothing of the threshold {self.threshold!r}"
            )
        return replace(self, threshold=self.threshold - amount, reserved=self.reserved + amount)

    def full_norm_rounds(self, *, noise_std: float, l2_clip: float) -> int:
        """Rounds at full norm C before the first partial round: floor(T sigma^2 / C^2), as the filter counts them."""
        step = (positive("l2_clip", l2_clip) / positive("noise_std", noise_std)) ** 2
        return rounds_within(self.threshold, step)

    def spent_in_currency(self, spent: float) -> float:
        """S expressed in the filter's own currency: mu (GDP), rho (zCDP), or RDP at the first order."""
        if self.kind == "gdp":
            return math.sqrt(spent)
        if self.kind == "zcdp":
            return spent / 2.0
        return self.orders[0] * spent / 2.0

    def describe(self) -> dict[str, object]:
        """A JSON-ready statement of the filter (for summaries and ledgers)."""
        return {
            "filter": self.kind,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "threshold": self.threshold,
            "reserved": self.reserved,
            "orders": list(self.orders),
            "conversion": self.conversion,
        }


def rounds_within(threshold: float, step: float) -> int:
    """The largest k with k * step <= threshold, exactly as repeated float additions see it."""
    k = int(threshold // step)
    while (k + 1) * step <= threshold:
        k += 1
    while k > 0 and k * step > threshold:
        k -= 1
    return k


@dataclass(frozen=True, eq=False)
class FilterState:
    """Spent squared budget S and the stopped flag, one entry per unit (read-only arrays)."""

    spent: NDArray[np.float64] = field(repr=False)
    stopped: NDArray[np.bool_] = field(repr=False)

    def __post_init__(self) -> None:
        spent = np.array(self.spent, dtype=np.float64).reshape(-1)
        stopped = np.array(self.stopped, dtype=np.bool_).reshape(-1)
        if spent.shape != stopped.shape:
            raise PrivacyParameterError(f"state: spent has {spent.size} units but stopped has {stopped.size}")
        if not np.all(np.isfinite(spent)) or np.any(spent < 0):
            raise PrivacyParameterError("state.spent: expected finite values >= 0")
        spent.setflags(write=False)
        stopped.setflags(write=False)
        object.__setattr__(self, "spent", spent)
        object.__setattr__(self, "stopped", stopped)

    @classmethod
    def fresh(cls, n_units: int) -> FilterState:
        """A state for ``n_units`` units that have spent nothing."""
        n = positive_int("n_units", n_units)
        return cls(spent=np.zeros(n), stopped=np.zeros(n, dtype=np.bool_))

    @classmethod
    def _built(cls, spent: NDArray[np.float64], stopped: NDArray[np.bool_]) -> FilterState:
        """A state from arrays :func:`charge` has just computed (valid by construction): no copy, no re-check."""
        spent.setflags(write=False)
        stopped.setflags(write=False)
        out = object.__new__(cls)
        object.__setattr__(out, "spent", spent)
        object.__setattr__(out, "stopped", stopped)
        return out

    @property
    def n_units(self) -> int:
        return int(self.spent.size)


def remaining(filt: GaussianFilter, state: FilterState) -> NDArray[np.float64]:
    """T - S per unit, 0 for stopped units."""
    out = filt.threshold - state.spent
    np.maximum(out, 0.0, out=out)
    return or_zero(~np.asarray(state.stopped), out)


def partial_clip(filt: GaussianFilter, state: FilterState, *, noise_std: float, l2_clip: float) -> NDArray[np.float64]:
    """Per-unit clip c_t(u) = min(C, sigma sqrt(T - S(u))), 0 for stopped units (FZ Alg. 3; privacy.md §4).

    A unit takes part at full norm C while it can, then spends its exact remainder,
    then stops.
    """
    sigma = positive("noise_std", noise_std)
    clip = positive("l2_clip", l2_clip)
    out = np.subtract(filt.threshold, state.spent)
    np.maximum(out, 0.0, out=out)
    np.sqrt(out, out=out)
    out *= sigma
    np.minimum(out, clip, out=out)
    return or_zero(~np.asarray(state.stopped), out)


def clip_scales(norms: NDArray[np.floating], bounds: NDArray[np.floating], *, dtype_eps: float) -> NDArray[np.float64]:
    """Scale factors that bring vectors of L2 norm ``norms`` within ``bounds``, with room for rounding.

    ``dtype_eps`` is the machine epsilon of the dtype the scaled vectors are stored in;
    a vector over its bound is scaled to 64 ulps under it, so that the norm measured
    after scaling and rounding still lies within it (the charge is computed from that measured norm).
    """
    norms64 = np.asarray(norms, dtype=np.float64)
    bounds64 = np.asarray(bounds, dtype=np.float64)
    target = bounds64 * (1.0 - 64.0 * dtype_eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        # Vectors already within their bound are left exactly as they are.
        over = norms64 > bounds64
        scale = select(over, target / select(norms64 > 0, norms64, 1.0), 1.0)
    return np.asarray(np.clip(scale, 0.0, 1.0), dtype=np.float64)


@dataclass(frozen=True, eq=False)
class Charge:
    """The result of pricing one release: the new state and which units it admitted."""

    state: FilterState
    admitted: NDArray[np.bool_] = field(repr=False)
    refused: NDArray[np.bool_] = field(repr=False)

    def release(self, *, kind: str, round_id: str, noise_std: float, l2_norms: NDArray[np.floating]) -> GaussianRelease:
        """The record of what this charge let out: admitted norms, zeros elsewhere, and the refusals."""
        released = or_zero(self.admitted, np.asarray(l2_norms, dtype=np.float64).reshape(-1))
        return GaussianRelease(kind, round_id, noise_std, released, refused=self.refused)


# Units per block of :func:`charge`: a block's arrays (about 1.8 MiB) stay in the core's
# cache, so the filter update reads its inputs from memory once, however many numpy
# operations it takes (issue 24; benchmarks/accounting.py measures it).
CHARGE_BLOCK = 1 << 16


# Filters of at least this many units are charged by protocol/fused_charge.py when numba is installed.
FUSED_MIN_UNITS = CHARGE_BLOCK
_LARGEST = float(np.finfo(np.float64).max)


def _fused_kernel() -> Callable[..., ChargeParts] | None:
    """The compiled charge, or None: numba is not installed, or ``FEDFILTER_FUSED_CHARGE=0``."""
    if os.environ.get("FEDFILTER_FUSED_CHARGE", "1") == "0":
        return None
    try:
        from protocol.fused_charge import fused_charge
    except Exception:  # not installed, or llvmlite cannot load here: numpy's path, the same results
        return None
    return fused_charge


# What both charge paths return: new spent, admitted, refused, stopped, a norm < 0, a cost not finite.
ChargeParts = tuple[NDArray[np.float64], NDArray[np.bool_], NDArray[np.bool_], NDArray[np.bool_], bool, bool]


def charge_outputs(n: int) -> tuple[NDArray[np.float64], NDArray[np.bool_], NDArray[np.bool_], NDArray[np.bool_]]:
    """The arrays a charge of ``n`` units fills: new spent, admitted, refused, stopped."""
    return np.empty(n), np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_)


def _blocked_charge(
    norms: NDArray[np.float64],
    spent: NDArray[np.float64],
    was_stopped: NDArray[np.bool_],
    *,
    sigma: float,
    threshold: float,
    low: float,
) -> ChargeParts:
    """The charge in numpy, block by block (:data:`ChargeParts`)."""
    n = norms.size
    new_spent, admitted, refused, stopped = charge_outputs(n)
    block = min(n, CHARGE_BLOCK)
    wants = np.empty(block, dtype=np.bool_)
    increments = np.empty(block, dtype=np.float64)
    negative = not_finite = False
    # inf * 0 (a non-finite cost that does not fit) is NaN: the charge raises for it below.
    with np.errstate(invalid="ignore"):
        for lo in range(0, n, CHARGE_BLOCK):
            hi = min(lo + CHARGE_BLOCK, n)
            x, old, old_stopped = norms[lo:hi], spent[lo:hi], was_stopped[lo:hi]
            cost, ok, no, stop, want = (
                new_spent[lo:hi],
                admitted[lo:hi],
                refused[lo:hi],
                stopped[lo:hi],
                wants[: hi - lo],
            )
            inc = increments[: hi - lo]
            negative = (float(x.min()) < 0.0) or negative  # a NaN minimum is caught by the cost
            # The cost is (norm / sigma)^2, divided first: 1 / sigma overflows for a subnormal sigma.
            np.divide(x, sigma, out=inc)
            np.multiply(inc, inc, out=inc)
            np.add(old, inc, out=cost)
            # A NaN or infinite norm, or a non-finite cost, makes the largest cost NaN or infinite.
            not_finite = (not float(cost.max()) <= _LARGEST) or not_finite
            np.less_equal(cost, threshold, out=ok)
            np.greater(ok, old_stopped, out=ok)  # fits and not stopped
            # Stopped: left with at most EXHAUSTED_FRACTION of T, or does not fit (stopped before,
            # or refused). For a unit that fits, the cost is its new S; a | ~b is a >= b on booleans.
            np.greater_equal(cost, low, out=stop)
            np.greater_equal(stop, ok, out=stop)
            np.greater(x, 0.0, out=want)
            np.greater(want, ok, out=no)  # wants and does not fit: refused
            # A unit that does not fit pays nothing: S + inc * fits is S + 0 = S exactly for it (inc is
            # finite and >= 0, else the charge raises below), and the cost just checked for a unit that
            # fits (a norm of 0 adds 0). Arithmetic, not a masked copy: np.copyto(where=) branches per
            # element, so its time told how many units were refused (privacy.md §8, protocol/branchless.py).
            np.multiply(inc, ok, out=inc)
            np.add(old, inc, out=cost)
            np.logical_and(ok, want, out=ok)
    return new_spent, admitted, refused, stopped, negative, not_finite


def charge(filt: GaussianFilter, state: FilterState, *, noise_std: float, l2_norms: NDArray[np.floating]) -> Charge:
    """Check, then charge, a release with per-unit clipped norms ``l2_norms`` (privacy.md §3 rules).

    A unit is admitted when it is not stopped and S + ||v||^2/sigma^2 <= T; an admitted
    unit pays that cost. A unit that asks for more than it has left (or is stopped)
    is refused: it must contribute 0, pays 0, and is stopped for good. A unit with a
    zero norm pays nothing. Units left with at most EXHAUSTED_FRACTION of T stop.

    The update runs block by block over ``CHARGE_BLOCK`` units, each block with the same
    elementwise operations in the same order, so the result is the same as one pass over
    the whole array, bit for bit; only the memory traffic differs. With numba installed
    (``fedfilter[fast]``), a filter of at least ``FUSED_MIN_UNITS`` units is charged by one
    compiled pass with the same arithmetic (protocol/fused_charge.py), bit for bit the same
    result; ``FEDFILTER_FUSED_CHARGE=0`` keeps numpy. Validation: a NaN, infinite or negative
    norm, or a non-finite cost, raises; a filter of zero units gets an empty charge, and finite
    norms whose plain sum would overflow are accepted.
    """
    sigma = positive("noise_std", noise_std)
    norms = np.asarray(l2_norms, dtype=np.float64).reshape(-1)
    n = state.n_units
    if norms.size != n:
        raise PrivacyParameterError(f"l2_norms: expected {n} norms (one per unit), got {norms.size}")
    threshold = filt.threshold
    low = threshold * (1.0 - EXHAUSTED_FRACTION)
    spent, was_stopped = state.spent, state.stopped
    fused = _fused_kernel() if n >= FUSED_MIN_UNITS else None
    if fused is not None:
        new_spent, admitted, refused, stopped, negative, not_finite = fused(
            norms, spent, was_stopped, sigma=sigma, threshold=threshold, low=low
        )
    else:
        new_spent, admitted, refused, stopped, negative, not_finite = _blocked_charge(
            norms, spent, was_stopped, sigma=sigma, threshold=threshold, low=low
        )
    if negative or not_finite:
        if not (bool(np.isfinite(norms).all()) and float(norms.min()) >= 0.0):
            raise PrivacyParameterError("l2_norms: expected finite norms >= 0, found NaN, infinity or a negative value")
        raise PrivacyParameterError(
            f"noise_std: {sigma!r} prices these norms at a non-finite cost; expected (norm / noise_std)^2 to be finite"
        )
    return Charge(state=FilterState._built(new_spent, stopped), admitted=admitted, refused=refused)


def rebuild(filt: GaussianFilter, n_units: int, releases: Iterable[GaussianRelease]) -> FilterState:
    """Replay releases through the filter; the result equals the state charged release by release.

    A release that charges a unit the filter would have refused means the record
    list is not one this filter produced: that is an error, never a silent skip.
    Units a record marks as refused are stopped, as they were when it was made.
    """
    state = FilterState.fresh(n_units)
    for release in releases:
        if release.l2_norms.size != n_units:
            raise PrivacyParameterError(
                f"release {release.round_id!r}: expected {n_units} norms (one per unit), got {release.l2_norms.size}"
            )
        result = charge(filt, state, noise_std=release.noise_std, l2_norms=release.l2_norms)
        over = (release.l2_norms > 0) & ~result.admitted
        if np.any(over):
            first = int(np.flatnonzero(over)[0])
            raise PrivacyParameterError(
                f"release {release.round_id!r}: unit {first} was charged beyond what the filter admits "
                f"(spent {state.spent[first]!r}, threshold {filt.threshold!r})"
            )
        assert release.refused is not None
        state = FilterState(spent=result.state.spent, stopped=result.state.stopped | release.refused)
    return state
