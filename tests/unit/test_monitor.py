"""The active-set monitors: tree prefix sums, the SVT's threshold rule and its privacy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.monitor import SvtMonitor, TreeMonitor, dyadic_nodes, gaussian_bound


@given(st.integers(min_value=1, max_value=10_000))
def test_dyadic_nodes_partition_the_prefix(t: int) -> None:
    covered = []
    for level, end in dyadic_nodes(t):
        assert end % (1 << level) == 0  # a node that closes at `end`
        covered.extend(range(end - (1 << level) + 1, end + 1))
    assert covered == list(range(1, t + 1))
    assert len(dyadic_nodes(t)) == bin(t).count("1") <= math.ceil(math.log2(t)) + 1


def client_reports(halts: np.ndarray, t: int, levels: int) -> np.ndarray:
    """What a client reports at round t without noise: halts in (t - 2^i, t] at closing levels, else 0."""
    out = np.zeros(levels, dtype=np.float32)
    for level in range(levels):
        if t % (1 << level) == 0:
            out[level] = np.count_nonzero((halts > t - (1 << level)) & (halts <= t))
    return out


def test_tree_prefix_sums_are_exact_without_noise() -> None:
    rng = np.random.default_rng(0)
    n_rounds, levels = 50, math.ceil(math.log2(50)) + 1
    clients = [np.where(rng.random(30) < 0.7, rng.integers(1, n_rounds + 1, 30), -1) for _ in range(4)]
    monitor = TreeMonitor(threshold=60, n_units=120, levels=levels)
    for t in range(1, n_rounds + 1):
        verdict = monitor.add_round(t, [(client_reports(h, t, levels), 0.0) for h in clients])
        true_active = 120 - sum(int(np.count_nonzero((h > 0) & (h <= t))) for h in clients)
        assert verdict.active_estimate == pytest.approx(true_active)
        assert verdict.below == (true_active < 60)


def test_tree_estimate_std_counts_the_nodes_and_clients() -> None:
    monitor = TreeMonitor(threshold=1, n_units=10, levels=4)
    for t in range(1, 8):
        verdict = monitor.add_round(t, [(np.zeros(4, np.float32), 2.0)] * 3)
    # (0, 7] = (0,4] + (4,6] + (6,7]: three nodes, three clients each, sigma_m = 2.
    assert verdict.estimate_std == pytest.approx(2.0 * math.sqrt(9))


def test_svt_without_noise_is_the_threshold_test() -> None:
    monitor = SvtMonitor(threshold=10, epsilon=1e9, rng=np.random.default_rng(0))
    assert not monitor.check(10).below  # still >= T
    assert monitor.check(9).below
    with pytest.raises(RuntimeError, match="already answered 'below'"):
        monitor.check(8)


def stop_rounds(counts: np.ndarray, *, epsilon: float, threshold: int, samples: int, seed: int) -> np.ndarray:
    """The round at which each of ``samples`` independent SVT runs stops (len(counts) if never)."""
    out = np.full(samples, len(counts))
    rng = np.random.default_rng(seed)
    for i in range(samples):
        monitor = SvtMonitor(threshold=threshold, epsilon=epsilon, rng=rng)
        for t, c in enumerate(counts):
            if monitor.check(float(c)).below:
                out[i] = t
                break
    return out


def test_svt_stopping_round_is_epsilon_dp_for_neighbouring_counts() -> None:
    # D: the unit halts at round 2, so D's count is one lower from then on; D' holds the null
    # element, which never halts (privacy.md §1). Every stopping round must have probability
    # ratio at most e^epsilon (LSL Thm 2, monotone queries). A wrong noise scale (epsilon
    # spent as if it were 4 times larger) breaks the bound, so the check can fail.
    base = np.array([14, 13, 12, 11, 10, 9, 8, 7])
    d = base - (np.arange(len(base)) >= 2)
    eps, samples = 1.0, 20_000
    for claimed, run_eps, should_hold in ((eps, eps, True), (eps, 4 * eps, False)):
        a = np.bincount(stop_rounds(d, epsilon=run_eps, threshold=10, samples=samples, seed=1), minlength=9)
        b = np.bincount(stop_rounds(base, epsilon=run_eps, threshold=10, samples=samples, seed=2), minlength=9)
        ok = (a > 400) & (b > 400)  # outcomes estimated to a few percent
        ratio = np.max(np.maximum(a[ok] / b[ok], b[ok] / a[ok]))
        if should_hold:
            assert ratio <= math.exp(claimed) * 1.15
        else:
            assert ratio > math.exp(claimed) * 1.15


def test_gaussian_bound_union() -> None:
    # P(|Z| > sigma z) = 2 P(Z > z), union over the queries: z = z_{1 - beta/(2k)}.
    # Sources: the standard normal table (z_0.975 = 1.959964, Abramowitz & Stegun Table 26.5) and
    # Python's statistics.NormalDist, independent of the scipy quantile the code uses.
    from statistics import NormalDist

    assert gaussian_bound(noise_std=2.0, queries=1, beta=0.05) == pytest.approx(2 * 1.959964, rel=1e-6)
    z = NormalDist().inv_cdf(1 - 0.05 / 200)
    assert gaussian_bound(noise_std=1.0, queries=100, beta=0.05) == pytest.approx(z, rel=1e-9)


@pytest.mark.parametrize(
    ("epsilon", "threshold", "population", "rounds"),
    [(0.1, 2, 20, 30), (1.0, 2, 20, 10), (0.5, 10, 40, 20)],
)
def test_svt_reliability_matches_the_monitor_it_describes(
    epsilon: float, threshold: int, population: int, rounds: int
) -> None:
    """The computed false-stop and late-stop probabilities against 8,000 runs of SvtMonitor.check itself."""
    from coordinator.monitor import svt_reliability

    rel = svt_reliability(epsilon=epsilon, threshold=threshold, population=population, rounds=rounds)
    rng = np.random.default_rng(24)
    trials = 8_000
    false_stops = late = 0
    for _ in range(trials):
        monitor = SvtMonitor(threshold=threshold, epsilon=epsilon, rng=rng)
        false_stops += any(monitor.check(population).below for _ in range(rounds))
        monitor = SvtMonitor(threshold=threshold, epsilon=epsilon, rng=rng)
        late += not any(monitor.check(rel.late_count).below for _ in range(rel.late_rounds))
    for computed, observed in ((rel.false_stop, false_stops / trials), (rel.late_stop, late / trials)):
        sd = math.sqrt(max(computed * (1 - computed), 1e-4) / trials)
        assert abs(observed - computed) < 5 * sd + 1e-3, (computed, observed)


def test_a_monitor_that_cannot_tell_20_from_2_says_so() -> None:
    """Issue 24's cross-device quickstart: 20 client units, threshold 2, epsilon_svt 0.1."""
    from coordinator.monitor import svt_reliability

    weak = svt_reliability(epsilon=0.1, threshold=2, population=20, rounds=30)
    assert weak.false_stop > 0.9 and not weak.separates
    assert weak.warning() is not None and "cannot tell 20 active units from its threshold of 2" in weak.warning()
    strong = svt_reliability(epsilon=1.0, threshold=100, population=1000, rounds=30)
    assert strong.separates and strong.warning() is None
    for epsilon in (5e-324, 1e300):  # subnormal and huge: probabilities, never NaN (computed in units of 2/eps)
        extreme = svt_reliability(epsilon=epsilon, threshold=2, population=20, rounds=30)
        assert 0.0 <= extreme.false_stop <= 1.0 and 0.0 <= extreme.late_stop <= 1.0
    with pytest.raises(ValueError, match="population: expected an integer >= 1"):
        svt_reliability(epsilon=1.0, threshold=2, population=0, rounds=3)
