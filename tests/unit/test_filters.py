"""Contract tests run against every Gaussian filter kind (privacy.md §3-4)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.filters import (
    EXHAUSTED_FRACTION,
    FilterState,
    GaussianFilter,
    charge,
    clip_scales,
    partial_clip,
    rebuild,
    remaining,
)
from protocol.releases import GaussianRelease
from protocol.validate import PrivacyParameterError

FILTERS = {
    "gdp": lambda: GaussianFilter.gdp(epsilon=2.0, delta=1e-5),
    "zcdp_cks": lambda: GaussianFilter.zcdp(epsilon=2.0, delta=1e-5),
    "zcdp_bs": lambda: GaussianFilter.zcdp(epsilon=2.0, delta=1e-5, conversion="bs"),
    "renyi_best": lambda: GaussianFilter.renyi(epsilon=2.0, delta=1e-5),
    "renyi_8": lambda: GaussianFilter.renyi(epsilon=2.0, delta=1e-5, order=8.0),
    "renyi_mironov": lambda: GaussianFilter.renyi(epsilon=2.0, delta=1e-5, order=12.0, conversion="mironov"),
    "renyi_multi": lambda: GaussianFilter.renyi_multi(epsilon=2.0, delta=1e-5, orders=[2, 4, 8, 16, 32, 64]),
}


@pytest.fixture(params=sorted(FILTERS))
def filt(request: pytest.FixtureRequest) -> GaussianFilter:
    return FILTERS[request.param]()


class TestFilterContract:
    def test_check_comes_before_release(self, filt: GaussianFilter) -> None:
        state = FilterState.fresh(2)
        sigma = 1.0
        too_much = math.sqrt(filt.threshold) * 1.01  # one release that alone exceeds T
        result = charge(filt, state, noise_std=sigma, l2_norms=np.array([too_much, 0.1]))
        assert result.admitted.tolist() == [False, True]
        assert result.state.spent[0] == 0.0  # refused: pays nothing
        assert result.state.spent[1] == pytest.approx(0.01)
        assert result.state.stopped.tolist() == [True, False]

    def test_stopped_stays_stopped(self, filt: GaussianFilter) -> None:
        state = charge(filt, FilterState.fresh(1), noise_std=1.0, l2_norms=np.array([1e6])).state
        assert state.stopped[0]
        for _ in range(3):
            result = charge(filt, state, noise_std=1e9, l2_norms=np.array([1e-9]))
            assert not result.admitted[0]
            assert result.state.stopped[0]
            assert result.state.spent[0] == state.spent[0]
            state = result.state

    def test_partial_clipping_runs_full_rounds_then_spends_remainder(self, filt: GaussianFilter) -> None:
        sigma, clip = 10.0, 1.0
        full = filt.full_norm_rounds(noise_std=sigma, l2_clip=clip)
        state = FilterState.fresh(1)
        clips = []
        for _ in range(full + 5):
            c = partial_clip(filt, state, noise_std=sigma, l2_clip=clip)
            norms = c * clip_scales(c, c, dtype_eps=np.finfo(np.float64).eps)
            clips.append(float(norms[0]))
            result = charge(filt, state, noise_std=sigma, l2_norms=norms)
            assert bool(result.admitted[0]) == (norms[0] > 0)
            state = result.state
        assert clips[:full] == pytest.approx([clip] * full, rel=1e-12)  # every full-norm round, the last included
        assert 0 < clips[full] < clip  # the partial round
        assert clips[full + 1 :] == [0.0] * 4  # then nothing
        assert state.stopped[0]
        assert state.spent[0] <= filt.threshold
        assert state.spent[0] == pytest.approx(filt.threshold, rel=1e-12)

    def test_reservation_lowers_threshold(self, filt: GaussianFilter) -> None:
        reserved = filt.reserve(squared_budget=0.1 * filt.threshold)
        assert reserved.threshold == pytest.approx(0.9 * filt.threshold)
        assert reserved.reserved == pytest.approx(0.1 * filt.threshold)
        with pytest.raises(PrivacyParameterError, match="leaves nothing"):
            filt.reserve(squared_budget=filt.threshold)

    def test_rebuild_reproduces_state(self, filt: GaussianFilter) -> None:
        rng = np.random.default_rng(0)
        state = FilterState.fresh(50)
        releases = []
        for t in range(200):
            sigma = float(rng.uniform(1, 5))
            bounds = partial_clip(filt, state, noise_std=sigma, l2_clip=1.0)
            norms = np.minimum(rng.uniform(0, 1.2, 50), bounds * (1 - 1e-12))
            result = charge(filt, state, noise_std=sigma, l2_norms=norms)
            releases.append(result.release(kind="gradient", round_id=f"r{t}", noise_std=sigma, l2_norms=norms))
            state = result.state
        again = rebuild(filt, 50, releases)
        np.testing.assert_array_equal(again.spent, state.spent)
        np.testing.assert_array_equal(again.stopped, state.stopped)

    def test_rebuild_refuses_overspent_record(self, filt: GaussianFilter) -> None:
        over = math.sqrt(filt.threshold) * 2
        with pytest.raises(PrivacyParameterError, match="charged beyond"):
            rebuild(filt, 1, [GaussianRelease("gradient", "r0", 1.0, [over])])

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
    def test_bad_norms_are_errors(self, filt: GaussianFilter, bad: float) -> None:
        with pytest.raises(PrivacyParameterError, match="l2_norms"):
            charge(filt, FilterState.fresh(2), noise_std=1.0, l2_norms=np.array([0.1, bad]))

    def test_wrong_number_of_units_is_error(self, filt: GaussianFilter) -> None:
        with pytest.raises(PrivacyParameterError, match="expected 3 norms"):
            charge(filt, FilterState.fresh(3), noise_std=1.0, l2_norms=np.zeros(2))

    @pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan"), float("inf")])
    def test_bad_noise_is_error(self, filt: GaussianFilter, sigma: float) -> None:
        with pytest.raises(PrivacyParameterError, match="noise_std"):
            charge(filt, FilterState.fresh(1), noise_std=sigma, l2_norms=np.zeros(1))
        with pytest.raises(PrivacyParameterError, match="noise_std"):
            partial_clip(filt, FilterState.fresh(1), noise_std=sigma, l2_clip=1.0)


def test_gdp_is_the_tightest_for_gaussian_rounds() -> None:
    thresholds = {name: make().threshold for name, make in FILTERS.items()}
    assert thresholds["gdp"] == max(thresholds.values())


def test_renyi_multi_uses_union_bound() -> None:
    multi = GaussianFilter.renyi_multi(epsilon=2.0, delta=1e-5, orders=[8, 16, 32])
    single_at_share = [GaussianFilter.renyi(epsilon=2.0, delta=1e-5 / 3, order=a).threshold for a in (8, 16, 32)]
    assert multi.threshold == pytest.approx(max(single_at_share), rel=1e-15)
    # Paying the union bound costs budget against the single best order at full delta.
    assert multi.threshold < GaussianFilter.renyi(epsilon=2.0, delta=1e-5).threshold


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epsilon": 0.0, "delta": 1e-5}, "epsilon: expected a finite number > 0, got 0.0"),
        ({"epsilon": float("nan"), "delta": 1e-5}, "epsilon: expected a finite number, got nan"),
        ({"epsilon": 1.0, "delta": 1.0}, r"delta: expected a number in \(0, 1\), got 1.0"),
        ({"epsilon": 1.0, "delta": 0.0}, r"delta: expected a number in \(0, 1\), got 0.0"),
    ],
)
def test_bad_targets_are_errors(kwargs: dict[str, float], message: str) -> None:
    for make in (GaussianFilter.gdp, GaussianFilter.zcdp, GaussianFilter.renyi):
        with pytest.raises(PrivacyParameterError, match=message):
            make(**kwargs)


def test_unknown_filter_kind_is_error() -> None:
    with pytest.raises(PrivacyParameterError, match=r"filter: expected one of .* got 'laplace'"):
        GaussianFilter.create("laplace", epsilon=1.0, delta=1e-5)


def test_order_that_leaves_no_budget_is_error() -> None:
    with pytest.raises(PrivacyParameterError, match="leaves no budget"):
        GaussianFilter.renyi(epsilon=0.5, delta=1e-5, order=1.5)


def test_remaining_and_exhaustion() -> None:
    filt = GaussianFilter.gdp(epsilon=1.0, delta=1e-5)
    almost = filt.threshold * (1 - EXHAUSTED_FRACTION / 2)
    state = charge(filt, FilterState.fresh(1), noise_std=1.0, l2_norms=np.array([math.sqrt(almost)])).state
    assert state.stopped[0]
    assert remaining(filt, state)[0] == 0.0


def test_clip_scales_keep_float32_norms_within_bound() -> None:
    rng = np.random.default_rng(1)
    v = rng.normal(size=(1000, 37)).astype(np.float32) * 10
    bounds = rng.uniform(0, 2, 1000)
    norms = np.linalg.norm(v.astype(np.float64), axis=1)
    scaled = v * clip_scales(norms, bounds, dtype_eps=float(np.finfo(np.float32).eps))[:, None].astype(np.float32)
    measured = np.linalg.norm(scaled.astype(np.float64), axis=1)
    assert np.all(measured <= bounds)


def test_release_record_validation() -> None:
    with pytest.raises(PrivacyParameterError, match="kind: expected one of"):
        GaussianRelease("laplace", "r0", 1.0, [0.1])
    with pytest.raises(PrivacyParameterError, match="noise_std"):
        GaussianRelease("gradient", "r0", 0.0, [0.1])
    with pytest.raises(PrivacyParameterError, match="NaN or infinity"):
        GaussianRelease("gradient", "r0", 1.0, [float("nan")])
    rel = GaussianRelease("gradient", "r0", 2.0, [1.0, 0.5])
    np.testing.assert_allclose(rel.squared_sensitivity, [0.25, 0.0625])
    assert not rel.l2_norms.flags.writeable


def test_reply_decode_refuses_non_numeric_noise() -> None:
    from protocol import messages as wire

    total = {"total": np.zeros(2, dtype=np.float32)}
    base = {"request_id": "r", "status": "ok", "trust": "local"}
    for bad in ("abc", None, float("nan"), -1.0, True):
        with pytest.raises(wire.ProtocolError, match="'noise_added' must be a finite number >= 0"):
            wire.ContributionReply.decode(base | {"noise_added": bad}, total)
    with pytest.raises(wire.ProtocolError, match="'noise_added': expected a finite number, got an integer of 1329"):
        wire.ContributionReply.decode(base | {"noise_added": 10**400}, total)  # JSON reads any integer


def _charge_one_pass(
    filt: GaussianFilter, state: FilterState, sigma: float, norms: np.ndarray
) -> tuple[np.ndarray, ...]:
    """privacy.md §3's rules written as one pass over whole arrays (the pre-issue-24 charge)."""
    new_spent = (norms / sigma) ** 2 + state.spent
    admitted = (new_spent <= filt.threshold) & ~state.stopped
    wants = norms > 0
    refused = wants & ~admitted
    new_spent = np.where(refused, state.spent, new_spent)
    stopped = (new_spent >= filt.threshold * (1.0 - EXHAUSTED_FRACTION)) | state.stopped | refused
    return new_spent, stopped, admitted & wants, refused


def test_blocked_charge_equals_the_one_pass_rules_bit_for_bit() -> None:
    """charge runs block by block (issue 24); across block edges it gives the same bits."""
    from protocol.filters import CHARGE_BLOCK

    rng = np.random.default_rng(24)
    filt = GaussianFilter.renyi(epsilon=1.0, delta=1e-5)
    n = 4 * CHARGE_BLOCK + 1234  # five blocks, the last partial
    spent = rng.uniform(0, filt.threshold, n)
    stopped = rng.random(n) < 0.1
    spent[-5:] = filt.threshold  # exhausted at the tail of the last, partial block
    state = FilterState(spent=spent, stopped=stopped)
    norms = rng.uniform(0, 3.0, n)
    norms[rng.random(n) < 0.1] = 0.0
    result = charge(filt, state, noise_std=7.0, l2_norms=norms)
    expected = _charge_one_pass(filt, state, 7.0, norms)
    assert np.array_equal(result.state.spent, expected[0])
    assert np.array_equal(result.state.stopped, expected[1])
    assert np.array_equal(result.admitted, expected[2])
    assert np.array_equal(result.refused, expected[3])
    # every outcome occurs, in more than one block
    for mask in (expected[2], expected[3], ~expected[2] & ~expected[3]):
        assert all(mask[lo : lo + CHARGE_BLOCK].any() for lo in range(0, n, CHARGE_BLOCK))
    # a bad norm in the last block is still found, with the norms' message
    bad = norms.copy()
    bad[-1] = np.nan  # in the last block
    with pytest.raises(PrivacyParameterError, match="expected finite norms"):
        charge(filt, state, noise_std=7.0, l2_norms=bad)
    bad[-1] = -1e-300
    with pytest.raises(PrivacyParameterError, match="expected finite norms"):
        charge(filt, state, noise_std=7.0, l2_norms=bad)
