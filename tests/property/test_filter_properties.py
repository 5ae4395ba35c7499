"""Hypothesis properties of the Gaussian filters (house style: never overspends; replay rebuilds state;
partial clipping spends exactly the remainder; a stopped filter stays stopped)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.filters import FilterState, GaussianFilter, charge, clip_scales, partial_clip, rebuild
from protocol.realisation import RealisationFilter, RealisationState, advance, decide

targets = st.tuples(st.floats(0.05, 10.0), st.floats(1e-9, 0.2))
kinds = st.sampled_from(["gdp", "zcdp_cks", "zcdp_bs", "renyi"])


def make(kind: str, eps: float, delta: float) -> GaussianFilter:
    if kind == "gdp":
        return GaussianFilter.gdp(epsilon=eps, delta=delta)
    if kind == "renyi":
        return GaussianFilter.renyi(epsilon=eps, delta=delta)
    return GaussianFilter.zcdp(epsilon=eps, delta=delta, conversion="cks" if kind == "zcdp_cks" else "bs")


rounds = st.lists(
    st.tuples(st.floats(0.1, 20.0), st.lists(st.floats(0.0, 50.0), min_size=4, max_size=4)), min_size=1, max_size=40
)


@settings(max_examples=60, deadline=None)
@given(kind=kinds, target=targets, plan=rounds, use_partial=st.booleans())
def test_never_overspends_and_stopped_stays_stopped(
    kind: str, target: tuple[float, float], plan: list[tuple[float, list[float]]], use_partial: bool
) -> None:
    filt = make(kind, *target)
    state = FilterState.fresh(4)
    releases = []
    for t, (sigma, asked) in enumerate(plan):
        norms = np.array(asked)
        if use_partial:
            norms = np.minimum(norms, partial_clip(filt, state, noise_std=sigma, l2_clip=5.0) * (1 - 1e-12))
        result = charge(filt, state, noise_std=sigma, l2_norms=norms)
        assert np.all(result.state.spent <= filt.threshold)
        assert np.all(result.state.spent >= state.spent)  # spend never decreases
        assert np.all(result.state.stopped[state.stopped])  # stopped stays stopped
        assert not np.any(result.admitted[state.stopped])  # and is never admitted again
        np.testing.assert_array_equal(result.state.spent[state.stopped], state.spent[state.stopped])
        releases.append(result.release(kind="gradient", round_id=f"r{t}", noise_std=sigma, l2_norms=norms))
        state = result.state
    again = rebuild(filt, 4, releases)
    np.testing.assert_array_equal(again.spent, state.spent)
    np.testing.assert_array_equal(again.stopped, state.stopped)


@settings(max_examples=80, deadline=None)
@given(
    kind=kinds,
    target=targets,
    sigma=st.floats(0.1, 50.0),
    clip=st.floats(0.01, 10.0),
    spent_fraction=st.floats(0.0, 0.999),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_partial_clipping_spends_exactly_the_remainder(
    kind: str, target: tuple[float, float], sigma: float, clip: float, spent_fraction: float, dtype: type
) -> None:
    filt = make(kind, *target)
    state = FilterState(spent=[spent_fraction * filt.threshold], stopped=[False])
    bound = partial_clip(filt, state, noise_std=sigma, l2_clip=clip)
    rem = filt.threshold - state.spent[0]
    assert bound[0] <= clip
    # A long vector, clipped in its storage dtype, its norm measured after rounding.
    v = np.full((1, 64), 1e3, dtype=dtype)
    scale = clip_scales(np.linalg.norm(v.astype(np.float64), axis=1), bound, dtype_eps=float(np.finfo(dtype).eps))
    clipped = (v * scale[:, None].astype(dtype)).astype(dtype)
    norm = np.linalg.norm(clipped.astype(np.float64), axis=1)
    result = charge(filt, state, noise_std=sigma, l2_norms=norm)
    assert result.admitted[0]
    paid = result.state.spent[0] - state.spent[0]
    if bound[0] < clip:  # the partial round: spends the remainder, up to the dtype's rounding margin
        tol = 1e-4 if dtype is np.float32 else 1e-12
        assert rem * (1 - tol) <= paid <= rem
        assert result.state.stopped[0]
    else:
        assert norm[0] <= clip


@settings(max_examples=40, deadline=None)
@given(
    eps=st.floats(1.0, 20.0),
    n=st.integers(1, 60),
    mus=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=80),
    seed=st.integers(0, 2**31),
)
def test_realisation_filter_stops_for_good_and_within_n(eps: float, n: int, mus: list[float], seed: int) -> None:
    filt = RealisationFilter.create(epsilon=eps, delta=1e-4, max_rounds=n, mu_max=0.5)
    rng = np.random.default_rng(seed)
    state = RealisationState.fresh(filt, 3)
    taken = np.zeros(3, dtype=int)
    was_stopped = state.stopped.copy()
    for mu in mus:
        step = decide(filt, state, mu=np.full(3, mu))
        assert not np.any(step.participating[was_stopped])
        taken += step.participating
        loss = np.where(step.participating, rng.normal(mu**2 / 2, mu, 3), 0.0)
        state = advance(state, step, losses=loss)
        assert np.all(state.stopped[was_stopped])
        was_stopped = state.stopped.copy()
    assert np.all(taken <= n)
