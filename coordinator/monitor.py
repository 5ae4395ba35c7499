"""The active-set monitor, coordinator side (privacy.md §7): is the active count still >= T?

Both monitors read what the clients' ``query.monitor`` replies hold and nothing else;
their cost is reserved in every unit's filter at enrolment (client_agent.config.MonitorReservation).
Both implement :class:`Monitor`: ``observe(round, reports) -> Verdict``, so the round loop
(coordinator/rounds.py) never asks which one it holds. The release step gathers the reports
(coordinator/release.py; in secagg trust one masked sum, coordinator/secagg.py).

- :class:`SvtMonitor` (central trust): the sparse vector technique on the exact active
  count, LSL Alg. 1 with c = 1 (stop at the first "below").
- :class:`TreeMonitor` (local trust): the binary-tree counter over halt events (DNPR;
  Chan, Shi & Song); its prefix sums give an estimate of the active count every round and
  the threshold test is post-processing.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.typing import NDArray

from protocol.releases import tree_levels

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig


@dataclass(frozen=True)
class Verdict:
    """One round's monitor output: whether the count fell below T, and an estimate when the monitor gives one."""

    below: bool
    active_estimate: float | None = None
    estimate_std: float | None = None


@dataclass
class Reports:
    """One round's monitor replies: (values, the reporting client's noise std) per decoded reply.

    In secagg trust one pair, the session's masked sum and the std of the noise in it, or none
    when the session aborted. ``errors`` counts what was left out by name (the loop files them
    under 'monitor-'); a monitor adds the reports it cannot use.
    """

    values: list[tuple[np.ndarray, float]]
    asked: int  # the nodes asked
    errors: Counter[str] = field(default_factory=Counter)


class Monitor(Protocol):
    """The active-set monitor the round loop runs after each round (privacy.md §7)."""

    kind: str  # the run config's ``monitor``

    def observe(self, rnd: int, reports: Reports) -> Verdict:
        """Fold round ``rnd``'s reports in and say whether the active count fell below the threshold."""
        ...


def build_monitor(cfg: CoordinatorConfig, rng: np.random.Generator) -> Monitor | None:
    """The run's monitor (None: no monitor runs, and no monitor request is sent)."""
    if cfg.monitor == "svt":
        return SvtMonitor(threshold=cfg.monitor_threshold, epsilon=cfg.monitor_epsilon, rng=rng)
    if cfg.monitor == "tree":
        return TreeMonitor(threshold=cfg.monitor_threshold, n_units=cfg.n_public, levels=tree_levels(cfg.rounds))
    return None


class SvtMonitor:
    """LSL Alg. 1 on q_t = -(active count), threshold -T, sensitivity 1, c = 1.

    Privacy (LSL Thm 2 and Sec. 4.2): the threshold noise rho ~ Lap(1/eps_1) is drawn once;
    each check draws nu_t ~ Lap(c/eps_2). The active count is monotone in t for every pair
    of neighbours (a unit's halt only ever lowers D's count relative to D', whose unit is
    the null element and never halts), so Lap(c/eps_2) suffices rather than Lap(2c/eps_2).
    The run costs eps_svt = eps_1 + eps_2 (pure DP) whatever the number of checks, and
    stops at the first "below". Split: LSL's optimal ratio eps_1 : eps_2 = 1 : c^(2/3) for
    monotone queries, which is 1 : 1 at c = 1.
    """

    kind = "svt"

    def __init__(self, *, threshold: int, epsilon: float, rng: np.random.Generator) -> None:
        if not math.isfinite(epsilon) or epsilon <= 0:
            raise ValueError(f"epsilon: expected a finite number > 0, got {epsilon!r}")
        self.threshold = threshold
        self.epsilon_threshold = epsilon / 2.0
        self.epsilon_query = epsilon / 2.0
        self._rng = rng
        self._rho = float(rng.laplace(0.0, 1.0 / self.epsilon_threshold))
        self.halted = False

    def check(self, exact_count: float) -> Verdict:
        """Answer "below" when -count + nu >= -(T - 1/2) + rho; after the first "below" the SVT is spent.

        The half shifts the integer threshold so that, without noise, "below" means count < T.
        """
        if self.halted:
            raise RuntimeError("the sparse vector already answered 'below'; re-arming needs a new reservation")
        nu = float(self._rng.laplace(0.0, 1.0 / self.epsilon_query))
        below = -exact_count + nu >= -(self.threshold - 0.5) + self._rho
        self.halted = below
        return Verdict(below=below)

    def observe(self, rnd: int, reports: Reports) -> Verdict:
        """The SVT on the sum of every client's active count, or "still above" when a count is missing.

        A partial count would read as units leaving. Skipping the check depends on replies only
        (not on the count), so it costs nothing; the SVT answers at a later round.
        """
        if len(reports.values) < reports.asked or any(values.size != 1 for values, _ in reports.values):
            reports.errors["skipped-partial"] += 1
            return Verdict(below=False)
        return self.check(float(sum(float(values[0]) for values, _ in reports.values)))


def dyadic_nodes(t: int) -> list[tuple[int, int]]:
    """The (level, end) tree nodes whose intervals (end - 2^level, end] partition (0, t]."""
    out = []
    start = 0
    for level in reversed(range(t.bit_length())):
        if t & (1 << level):
            start += 1 << level
            out.append((level, start))
    return out


class TreeMonitor:
    """Prefix sums over the clients' noisy halt counts (binary-tree counter, DNPR).

    Round t's replies hold, per level i, the client's number of halts in (t - 2^i, t] plus
    N(0, sigma_m^2) when 2^i divides t (pure noise otherwise; the shape never varies). The
    coordinator sums them over clients into the tree's node (i, t) and estimates the number
    of halts in (0, t] from the ceil(log2 t)-or-fewer nodes that partition it. The estimate's
    noise std is sigma_m sqrt(sum over those nodes of the clients that reported them); a client
    that missed a round leaves its halts out of that node (the estimate errs towards "more active").
    """

    kind = "tree"

    def __init__(self, *, threshold: int, n_units: int, levels: int) -> None:
        self.threshold = threshold
        self.n_units = n_units
        self.levels = levels
        self._nodes: dict[tuple[int, int], tuple[float, float]] = {}  # (level, end) -> (sum, noise variance)

    def add_round(self, t: int, reports: list[tuple[NDArray[np.float32], float]]) -> Verdict:
        """Fold round t's replies (noisy level counts, the client's sigma_m) into the tree and test the threshold."""
        for level in range(self.levels):
            if t % (1 << level) == 0:
                total = float(sum(float(counts[level]) for counts, _ in reports))
                variance = float(sum(std * std for _, std in reports))
                self._nodes[(level, t)] = (total, variance)
        halted = 0.0
        variance = 0.0
        for node in dyadic_nodes(t):
            if node not in self._nodes:
                raise RuntimeError(f"tree node {node} was never reported: rounds must be reported in order from 1")
            value, var = self._nodes[node]
            halted += value
            variance += var
        estimate = self.n_units - halted
        return Verdict(below=estimate < self.threshold, active_estimate=estimate, estimate_std=math.sqrt(variance))

    def observe(self, rnd: int, reports: Reports) -> Verdict:
        """Round ``rnd``'s level counts into the tree; a report with fewer than ``levels`` values is left out.

        An aborted secagg session leaves round t's nodes at 0 (their halts are lost: the estimate errs
        towards "more active", as with a client that misses a round in local trust).
        """
        good = [(values[: self.levels], std) for values, std in reports.values if values.size >= self.levels]
        if len(good) < len(reports.values):
            reports.errors["wrong-shape"] += len(reports.values) - len(good)
        return self.add_round(rnd, good)


def gaussian_bound(*, noise_std: float, queries: int, beta: float) -> float:
    """Half-width h with P(max over ``queries`` answers of |N(0, noise_std^2)| > h) <= beta (union bound)."""
    from scipy.stats import norm  # on first use: scipy.stats takes most of a second to import

    return float(noise_std * norm.isf(beta / (2.0 * queries)))


@dataclass(frozen=True)
class SvtReliability:
    """How well an SVT monitor (:class:`SvtMonitor`) tells a whole population from its threshold (issue 24).

    - ``false_stop``: the probability that it answers "below" within ``rounds`` checks while all
      ``population`` units stay active (a run that stops with nobody gone). Counts only fall, so a
      real run's chance of stopping before its count nears the threshold is at least this.
    - ``late_stop``: the probability that it still answers "above" ``late_rounds`` checks in a row
      while the count is ``late_count`` (half the threshold, rounded down), with the threshold noise
      drawn afresh (an approximation: a run that got there has not stopped before, which favours
      larger threshold noise and a later stop).

    Exact for the mechanism as :class:`SvtMonitor` runs it: "below" iff nu - rho >= count - T + 1/2
    with rho ~ Lap(2/eps) drawn once and nu ~ Lap(2/eps) per check, integrated over rho numerically.
    """

    epsilon: float
    threshold: int
    population: int
    rounds: int
    false_stop: float
    late_count: int
    late_rounds: int
    late_stop: float

    @property
    def separates(self) -> bool:
        """Whether the monitor tells the whole population from the threshold: both errors below 5%."""
        return self.false_stop < 0.05 and self.late_stop < 0.05

    def describe(self) -> str:
        return (
            f"SVT monitor (epsilon_svt = {self.epsilon:g}, threshold {self.threshold}): P(stops within "
            f"{self.rounds} rounds while all {self.population} units stay active) = {self.false_stop:.3f}; "
            f"P(goes on {self.late_rounds} rounds with {self.late_count} active) = {self.late_stop:.3f}"
        )

    def warning(self) -> str | None:
        """What to say before the run when the monitor cannot tell the population from its threshold."""
        if self.separates:
            return None
        return (
            f"the monitor cannot tell {self.population} active units from its threshold of {self.threshold}: "
            f"{self.describe()}. Raise monitor_epsilon (its cost is reserved in every filter) or move the "
            "threshold further from the population, or run without a monitor."
        )


def _below_probability(gap: NDArray[np.float64]) -> NDArray[np.float64]:
    """P(nu >= gap * b) for nu ~ Lap(0, b), elementwise (``gap`` in units of the scale b)."""
    upper = 0.5 * np.exp(-np.maximum(gap, 0.0))
    return np.where(gap >= 0.0, upper, 1.0 - 0.5 * np.exp(np.minimum(gap, 0.0)))


def svt_reliability(
    *, epsilon: float, threshold: int, population: int, rounds: int, late_rounds: int = 5
) -> SvtReliability:
    """:class:`SvtReliability` of ``SvtMonitor(threshold=threshold, epsilon=epsilon)`` over ``population`` units."""
    if not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon: expected a finite number > 0, got {epsilon!r}")
    for name, value in (("population", population), ("rounds", rounds), ("late_rounds", late_rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    # Both noises have scale b = 2/eps (rho ~ Lap(1/eps_1), nu ~ Lap(1/eps_2), eps_1 = eps_2 = eps/2). Work in
    # units of b, so a tiny (even subnormal) epsilon cannot overflow: u = rho / b on a grid wide enough that
    # the Laplace tails beyond it hold < 1e-12 of the mass.
    u = np.linspace(-30.0, 30.0, 120_001)
    weight = np.exp(-np.abs(u)) / 2.0

    def integrate(values: NDArray[np.float64]) -> float:  # the trapezoid rule on the grid (numpy >= 1.26)
        return float(np.sum((values[1:] + values[:-1]) * np.diff(u)) / 2.0)

    weight /= integrate(weight)

    def p_below(count: int) -> NDArray[np.float64]:  # "below" iff nu - rho >= count - T + 1/2
        return _below_probability((count - threshold + 0.5) * (epsilon / 2.0) + u)

    false_stop = integrate(weight * (1.0 - (1.0 - p_below(population)) ** rounds))
    late_count = max(threshold // 2, 0)
    late_stop = integrate(weight * (1.0 - p_below(late_count)) ** late_rounds)
    return SvtReliability(
        epsilon=epsilon,
        threshold=threshold,
        population=population,
        rounds=rounds,
        false_stop=min(max(false_stop, 0.0), 1.0),
        late_count=late_count,
        late_rounds=late_rounds,
        late_stop=min(max(late_stop, 0.0), 1.0),
    )
