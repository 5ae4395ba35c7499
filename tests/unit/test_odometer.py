"""The privacy odometer (client_agent/odometer.py) against conversions computed here, independently.

The odometer's rule: levels j = 0..L-1 with S budgets B_j = B_top r^-(L-1-j) and delta_j = delta 2^-(L-j);
a spend S reads the smallest epsilon_j = conversion(B_j, delta_j) over the levels with B_j >= S. Each level
is a filter fixed in advance, so its epsilon must be valid at its (B_j, delta_j): for GDP this is checked
against DRS Cor. 2.13 written here with math.erfc and solved by bisection (not protocol.conversions).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from client_agent.odometer import LEVELS, RATIO, Odometer
from protocol.filters import GaussianFilter


def gdp_delta(mu: float, eps: float) -> float:
    """DRS Cor. 2.13: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), Phi(-x) = erfc(x/sqrt 2)/2."""
    a = eps / mu - mu / 2.0
    b = eps / mu + mu / 2.0
    return 0.5 * math.erfc(a / math.sqrt(2.0)) - math.exp(eps) * 0.5 * math.erfc(b / math.sqrt(2.0))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest eps >= 0 with gdp_delta(mu, eps) <= delta, by bisection (gdp_delta decreases in eps)."""
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gdp_delta(mu, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def zcdp_bs_epsilon(rho: float, delta: float) -> float:
    """Bun & Steinke Prop. 1.3: rho-zCDP is (rho + 2 sqrt(rho log(1/delta)), delta)-DP."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def rdp_improved_epsilon(rdp: float, order: float, delta: float) -> float:
    """The improved RDP conversion (CKS Prop. 12; Balle et al. 2020 Thm 21)."""
    eps = rdp + math.log((order - 1.0) / order) - (math.log(delta) + math.log(order)) / (order - 1.0)
    return max(0.0, eps)


def levels_here(filt: GaussianFilter) -> tuple[list[float], list[float]]:
    """The rule's levels, computed from its statement: S budgets and deltas, increasing budgets."""
    top = filt.threshold + filt.reserved
    budgets = [top * 2.0 ** (-(LEVELS - 1 - j) / 4.0) for j in range(LEVELS)]
    deltas = [filt.delta * 2.0 ** -(LEVELS - j) for j in range(LEVELS)]
    return budgets, deltas


def reading_here(budgets: list[float], epsilons: list[float], spent: float) -> float:
    """The smallest epsilon over the levels whose budget covers ``spent`` (0 for nothing, inf beyond the top)."""
    if spent == 0.0:
        return 0.0
    covering = [e for b, e in zip(budgets, epsilons, strict=True) if b >= spent * (1.0 - 1e-12)]
    return min(covering) if covering else math.inf


GDP_FILTERS = [
    GaussianFilter.gdp(epsilon=1.0, delta=1e-5),
    GaussianFilter.gdp(epsilon=4.0, delta=1e-6),
    GaussianFilter.gdp(epsilon=0.3, delta=1e-3).reserve(squared_budget=0.001),
]


def test_the_levels_are_the_stated_ladder_and_their_deltas_add_up_to_less_than_delta() -> None:
    filt = GDP_FILTERS[2]
    odometer = Odometer.for_filter(filt)
    budgets, deltas = levels_here(filt)
    assert RATIO == pytest.approx(2.0**0.25)
    assert odometer.budgets[-1] == filt.threshold + filt.reserved == odometer.full_budget
    np.testing.assert_allclose(odometer.budgets, budgets, rtol=1e-13)
    np.testing.assert_allclose(odometer.deltas, deltas, rtol=1e-13)
    assert sum(Fraction(d) for d in odometer.deltas) < Fraction(filt.delta)  # exactly: delta (1 - 2^-L)
    assert all(b1 < b2 for b1, b2 in zip(odometer.budgets, odometer.budgets[1:], strict=False))


@pytest.mark.parametrize("filt", GDP_FILTERS, ids=lambda f: f"gdp({f.epsilon},{f.delta},r={f.reserved})")
def test_every_gdp_level_is_valid_and_tight_against_drs_closed_form(filt: GaussianFilter) -> None:
    """Level j is the GDP filter at mu_j = sqrt(B_j): its epsilon meets delta_j by DRS Cor. 2.13, and not by much."""
    odometer = Odometer.for_filter(filt)
    for budget, delta, eps in zip(odometer.budgets, odometer.deltas, odometer.epsilons, strict=True):
        mu = math.sqrt(budget)
        assert gdp_delta(mu, eps) <= delta * (1.0 + 1e-6), (budget, delta, eps)  # valid at its level
        assert eps == pytest.approx(gdp_epsilon(mu, delta), rel=1e-7, abs=1e-12)  # and tight
    # For GDP a deeper level never reads more: the reading is the smallest covering level's epsilon.
    assert all(e1 < e2 for e1, e2 in zip(odometer.epsilons, odometer.epsilons[1:], strict=False))


@pytest.mark.parametrize("filt", GDP_FILTERS, ids=lambda f: f"gdp({f.epsilon},{f.delta},r={f.reserved})")
def test_gdp_readings_match_an_independent_odometer_and_never_fall_below_the_plain_conversion(
    filt: GaussianFilter,
) -> None:
    odometer = Odometer.for_filter(filt)
    budgets, deltas = levels_here(filt)
    epsilons = [gdp_epsilon(math.sqrt(b), d) for b, d in zip(budgets, deltas, strict=True)]
    rng = np.random.default_rng(0)
    spends = np.concatenate(
        [
            [0.0, 1e-12, filt.threshold, budgets[40] - filt.reserved, budgets[41] - filt.reserved],
            filt.threshold * rng.random(200),
            filt.threshold * 10.0 ** rng.uniform(-7, 0, 100),
        ]
    )
    spends = np.clip(spends, 0.0, filt.threshold)
    readings = odometer.epsilon(spends)
    for spent, reading in zip(spends, readings, strict=True):
        total = spent + filt.reserved
        assert reading == pytest.approx(reading_here(budgets, epsilons, total), rel=1e-7, abs=1e-12), spent
        plain = 0.0 if total == 0.0 else gdp_epsilon(math.sqrt(total), filt.delta)
        assert reading >= plain - 1e-9, spent  # the odometer costs something, never gives anything back
        assert reading == pytest.approx(odometer.epsilon(spent)[()], rel=0)  # scalar and vector agree
    assert odometer.plain(filt.threshold) == pytest.approx(filt.epsilon, rel=1e-6)  # the filter's own target
    full = float(odometer.epsilon(filt.threshold))
    assert filt.epsilon < full < 1.2 * filt.epsilon  # a little above the target: the top level has delta/2


@pytest.mark.parametrize(
    "filt",
    [
        GaussianFilter.gdp(epsilon=2.0, delta=1e-5),
        GaussianFilter.zcdp(epsilon=2.0, delta=1e-5),
        GaussianFilter.zcdp(epsilon=2.0, delta=1e-5, conversion="bs"),
        GaussianFilter.renyi(epsilon=2.0, delta=1e-5),
        GaussianFilter.renyi_multi(epsilon=2.0, delta=1e-5, orders=(2.0, 4.0, 8.0, 16.0, 32.0, 64.0)),
    ],
    ids=lambda f: f"{f.kind}-{f.conversion or 'drs'}",
)
def test_readings_increase_with_the_spend_read_zero_for_nothing_and_infinity_beyond_the_budget(
    filt: GaussianFilter,
) -> None:
    odometer = Odometer.for_filter(filt)
    grid = np.concatenate([[0.0], filt.threshold * np.geomspace(1e-9, 1.0, 2000)])
    readings = odometer.epsilon(grid)
    assert readings[0] == 0.0
    assert np.all(np.diff(readings) >= 0.0)
    assert np.all(np.isfinite(readings))
    assert readings[-1] >= filt.epsilon * (1 - 1e-9) or filt.kind == "renyi_multi"
    assert np.isinf(odometer.epsilon(filt.threshold * 1.001))
    for spent in (filt.threshold * 1e-4, filt.threshold * 0.3, filt.threshold):
        assert float(odometer.epsilon(spent)) >= odometer.plain(spent) - 1e-9


def test_zcdp_bs_levels_match_bun_steinke_closed_form() -> None:
    """zCDP: rho = B/2 at each level, converted with BS Prop. 1.3 (the filter's own conversion) at delta_j."""
    filt = GaussianFilter.zcdp(epsilon=2.0, delta=1e-5, conversion="bs")
    odometer = Odometer.for_filter(filt)
    budgets, deltas = levels_here(filt)
    expected = [zcdp_bs_epsilon(b / 2.0, d) for b, d in zip(budgets, deltas, strict=True)]
    np.testing.assert_allclose(odometer.epsilons, expected, rtol=1e-9)


@pytest.mark.parametrize("orders", [(8.0,), (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)])
def test_renyi_levels_take_the_best_of_the_filters_orders_and_readings_the_best_covering_level(
    orders: tuple[float, ...],
) -> None:
    """RDP alpha B/2 at each of the filter's orders (one rule S <= B_j is a Rényi filter at all of them), converted
    at delta_j; a deep level whose log(1/delta_j) makes it read more than a larger level is never the reading."""
    if len(orders) == 1:
        filt = GaussianFilter.renyi(epsilon=2.0, delta=1e-5, order=orders[0])
    else:
        filt = GaussianFilter.renyi_multi(epsilon=2.0, delta=1e-5, orders=orders)
    odometer = Odometer.for_filter(filt)
    budgets, deltas = levels_here(filt)
    expected = [
        min(rdp_improved_epsilon(a * b / 2.0, a, d) for a in orders) for b, d in zip(budgets, deltas, strict=True)
    ]
    np.testing.assert_allclose(odometer.epsilons, expected, rtol=1e-9, atol=1e-12)
    for spent in filt.threshold * np.geomspace(1e-6, 1.0, 50):
        assert float(odometer.epsilon(spent)) == pytest.approx(reading_here(budgets, expected, spent), rel=1e-9)


def test_a_central_svt_monitor_adds_its_epsilon_to_every_reading() -> None:
    filt = GaussianFilter.gdp(epsilon=1.5, delta=1e-5)
    plain, with_svt = Odometer.for_filter(filt), Odometer.for_filter(filt, extra_epsilon=0.5)
    spends = filt.threshold * np.array([0.0, 0.01, 0.5, 1.0])
    np.testing.assert_allclose(with_svt.epsilon(spends), plain.epsilon(spends) + 0.5)
