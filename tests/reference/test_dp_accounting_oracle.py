"""The conversions against Google's dp_accounting, an independent implementation.

- zCDP / RDP: dp_accounting's RDP accountant (improved conversion, Balle et al. 2020 /
  CKS Prop. 12) on a composed Gaussian mechanism equals our CKS conversion of
  rho = k / (2 sigma^2). Its orders are a grid; we optimise over orders continuously,
  so ours is at most theirs and within the grid's slack (1e-3 relative).
- GDP: the PLD accountant's epsilon for k Gaussian rounds equals our GDP epsilon of
  mu = sqrt(k) / sigma (k-fold composition of a sigma-Gaussian is sqrt(k)/sigma-GDP, DRS),
  up to PLD discretisation (1e-3 relative).
"""

from __future__ import annotations

import math

import dp_accounting  # a pinned test dependency: a broken install must fail here, not skip the oracle
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from protocol.conversions import gdp_delta, gdp_epsilon, rdp_epsilon, zcdp_epsilon

CASES = [(10.0, 44), (10.0, 51), (1.0, 1), (2.0, 48), (5.0, 200), (0.8, 10), (30.0, 1000)]
FINE_ORDERS = list(np.concatenate([np.linspace(1.01, 10, 900), np.linspace(10.5, 512, 1004)]))


@pytest.mark.parametrize(("sigma", "rounds"), CASES)
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_zcdp_cks_matches_rdp_accountant(sigma: float, rounds: int, delta: float) -> None:
    acc = rdp_privacy_accountant.RdpAccountant(orders=FINE_ORDERS)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=sigma), count=rounds)
    oracle = acc.get_epsilon(delta)
    ours = zcdp_epsilon(rho=rounds / (2 * sigma**2), delta=delta)
    assert ours <= oracle + 1e-9
    assert ours == pytest.approx(oracle, rel=1e-3)


@pytest.mark.parametrize("order", [1.5, 2.0, 8.0, 32.0])
def test_improved_rdp_conversion_matches_rdp_accountant_at_one_order(order: float) -> None:
    acc = rdp_privacy_accountant.RdpAccountant(orders=[order])
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=4.0), count=20)
    rdp = order * 20 / (2 * 4.0**2)
    assert rdp_epsilon(rdp=rdp, order=order, delta=1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize(("sigma", "rounds"), CASES)
def test_gdp_matches_pld_accountant(sigma: float, rounds: int) -> None:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=sigma), count=rounds)
    mu = math.sqrt(rounds) / sigma
    assert gdp_epsilon(mu=mu, delta=1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3, abs=1e-4)
    assert gdp_delta(mu=mu, epsilon=1.0) == pytest.approx(acc.get_delta(1.0), rel=2e-3, abs=1e-9)


def test_privacy_table_cross_check_values_come_from_dp_accounting() -> None:
    """privacy.md §3 quotes eps(44 rounds, sigma=10) = 2.96797 (RDP) and eps(51 rounds) = 2.97646 (PLD), delta = 1e-5.

    The RDP value needs a fine order grid (the accountant's default grid gives 2.96801).
    """
    rdp = rdp_privacy_accountant.RdpAccountant(orders=FINE_ORDERS)
    rdp.compose(dp_accounting.GaussianDpEvent(noise_multiplier=10.0), count=44)
    assert rdp.get_epsilon(1e-5) == pytest.approx(2.96797, abs=1e-5)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.GaussianDpEvent(noise_multiplier=10.0), count=51)
    assert pld.get_epsilon(1e-5) == pytest.approx(2.97646, abs=1e-5)
