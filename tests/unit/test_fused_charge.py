"""The compiled charge (protocol/fused_charge.py) is the numpy charge bit for bit, errors included.

numba is in the ``test`` extra, so CI runs these; without numba they fail under CI=true and skip
elsewhere (the numpy path is then the only one, and tests/unit/test_filters*.py cover it).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import filters
from protocol.filters import FUSED_MIN_UNITS, FilterState, GaussianFilter, PrivacyParameterError, charge

if importlib.util.find_spec("numba") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("numba is not installed: the test extra installs it (pip install -e '.[test]')", pytrace=False)
    pytest.skip("numba is not installed (pip install -e '.[fast]')", allow_module_level=True)

from protocol.fused_charge import fused_charge

FILT = GaussianFilter.gdp(epsilon=1.0, delta=1e-5)
T = FILT.threshold
LOW = T * (1.0 - filters.EXHAUSTED_FRACTION)
SPECIAL_NORMS = [0.0, -0.0, 5e-324, 1e-300, 1e-160, 0.5, 1.0, 3.0, 1e150, 1e300, 1.7976931348623157e308]


def both(norms: np.ndarray, spent: np.ndarray, stopped: np.ndarray, sigma: float) -> tuple[tuple, tuple]:
    kw = {"sigma": sigma, "threshold": T, "low": LOW}
    return fused_charge(norms, spent, stopped, **kw), filters._blocked_charge(norms, spent, stopped, **kw)


def assert_bitwise_equal(a: tuple, b: tuple) -> None:
    for x, y in zip(a[:4], b[:4], strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    assert a[4:] == b[4:]  # some norm negative, some cost not finite


norm_values = st.one_of(
    st.sampled_from(SPECIAL_NORMS),
    st.floats(min_value=0.0, max_value=10.0),
    st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(
        st.tuples(norm_values, st.floats(min_value=0.0, max_value=1.0), st.booleans()), min_size=0, max_size=40
    ),
    sigma=st.sampled_from([1e-300, 1e-3, 0.5, 1.0, 7.3, 1e200]),
)
def test_the_fused_charge_is_the_numpy_charge_bit_for_bit(data: list, sigma: float) -> None:
    norms = np.array([d[0] for d in data], dtype=np.float64)
    # Spends from 0 to T: below, at and just under the threshold and the exhaustion line.
    spent = np.array([d[1] * T for d in data], dtype=np.float64)
    stopped = np.array([d[2] for d in data], dtype=np.bool_)
    with np.errstate(over="ignore"):
        fused, numpy_path = both(norms, spent, stopped, sigma)
    assert_bitwise_equal(fused, numpy_path)


def test_a_large_random_filter_is_charged_alike_through_charge(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(4)
    n = FUSED_MIN_UNITS + 12_345  # the fused path, across more than one numpy block
    state = FilterState(spent=rng.uniform(0, T, n), stopped=rng.random(n) < 0.1)
    norms = rng.uniform(0, 1.0, n)
    norms[::9] = 0.0
    fused = charge(FILT, state, noise_std=2.0, l2_norms=norms)
    monkeypatch.setenv("FEDFILTER_FUSED_CHARGE", "0")
    plain = charge(FILT, state, noise_std=2.0, l2_norms=norms)
    assert 0 < plain.refused.sum() < n and 0 < plain.admitted.sum() < n  # every outcome occurs
    for x, y in (
        (fused.state.spent, plain.state.spent),
        (fused.state.stopped, plain.state.stopped),
        (fused.admitted, plain.admitted),
        (fused.refused, plain.refused),
    ):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_the_fused_path_is_taken_only_from_fused_min_units(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def spy(norms: np.ndarray, *args: object, **kwargs: object) -> tuple:
        calls.append(norms.size)
        return fused_charge(norms, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(filters, "_fused_kernel", lambda: spy)
    for n in (FUSED_MIN_UNITS - 1, FUSED_MIN_UNITS):
        charge(FILT, FilterState.fresh(n), noise_std=1.0, l2_norms=np.zeros(n))
    assert calls == [FUSED_MIN_UNITS]  # the path depends on the number of units only (public)


@pytest.mark.parametrize(
    ("bad", "sigma", "message"),
    [
        (np.nan, 1.0, "expected finite norms >= 0"),
        (np.inf, 1.0, "expected finite norms >= 0"),
        (-1.0, 1.0, "expected finite norms >= 0"),
        (1e300, 1e-300, "prices these norms at a non-finite cost"),
    ],
)
def test_both_paths_refuse_bad_norms_alike(
    monkeypatch: pytest.MonkeyPatch, bad: float, sigma: float, message: str
) -> None:
    n = FUSED_MIN_UNITS
    norms = np.full(n, 0.5)
    norms[n // 2] = bad
    for fused in ("1", "0"):
        monkeypatch.setenv("FEDFILTER_FUSED_CHARGE", fused)
        with pytest.raises(PrivacyParameterError, match=message), np.errstate(over="ignore"):
            charge(FILT, FilterState.fresh(n), noise_std=sigma, l2_norms=norms)


def test_without_a_cache_location_the_kernel_is_compiled_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent run as its own user from a read-only install: numba raises RuntimeError ("no locator
    available") when a cached function is decorated; the module must still load and charge."""
    import importlib

    import numba

    import protocol.fused_charge as module

    real = numba.njit
    asked: list[bool] = []

    def njit(*args: object, cache: bool = False, **kwargs: object) -> object:
        asked.append(cache)
        if cache:
            raise RuntimeError("cannot cache function '_kernel': no locator available")
        return real(*args, cache=cache, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(numba, "njit", njit)
    try:
        reloaded = importlib.reload(module)
        assert asked == [True, False]
        norms, spent, stopped = np.array([0.5, 0.0, 3.0]), np.array([0.0, 0.0, T]), np.zeros(3, np.bool_)
        kw = {"sigma": 1.0, "threshold": T, "low": LOW}
        expected = filters._blocked_charge(norms, spent, stopped, **kw)
        assert_bitwise_equal(reloaded.fused_charge(norms, spent, stopped, **kw), expected)
    finally:
        monkeypatch.undo()
        importlib.reload(module)
