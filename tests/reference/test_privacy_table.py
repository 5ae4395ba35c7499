"""Reference values of shared/design/privacy.md §3 (delta = 1e-5, unit sensitivity, sigma = 10).

Sources of the pinned numbers:
- mu_B = 0.719117: DRS Cor. 2.13 (largest mu with delta_GDP(mu, 3) <= 1e-5).
- rho_B (CKS) = 0.224249: CKS Cor. 13.
- rho_B (BS) = 0.173483: BS Prop. 1.3 inverted; FZ Thm 4.8's B*.
- rounds 51 / 44 / 34 = floor(budget / per-round cost), costs mu^2 = 0.01 and rho = 0.005.
- eps(44 rounds) = 2.96797: dp_accounting's RDP accountant; eps(51 rounds) = 2.97646: its PLD accountant
  (both quoted in privacy.md; re-derived from dp_accounting in test_dp_accounting_oracle.py).
"""

from __future__ import annotations

import json
import math

import pytest

from protocol.budget import budget_report
from protocol.conversions import gdp_epsilon, mu_budget, rho_budget, zcdp_epsilon
from protocol.filters import GaussianFilter
from simulations.cli import main


def test_mu_budget_matches_table() -> None:
    assert mu_budget(epsilon=3.0, delta=1e-5) == pytest.approx(0.719117, abs=5e-7)


def test_rho_budget_cks_matches_table() -> None:
    assert rho_budget(epsilon=3.0, delta=1e-5, conversion="cks") == pytest.approx(0.224249, abs=5e-7)


def test_rho_budget_bs_matches_table_and_closed_form() -> None:
    rho = rho_budget(epsilon=3.0, delta=1e-5, conversion="bs")
    assert rho == pytest.approx(0.173483, abs=5e-7)
    log_inv = math.log(1e5)
    assert rho == pytest.approx((math.sqrt(log_inv + 3.0) - math.sqrt(log_inv)) ** 2, rel=1e-15)


def test_filter_round_counts_match_table() -> None:
    gdp = GaussianFilter.gdp(epsilon=3.0, delta=1e-5)
    cks = GaussianFilter.zcdp(epsilon=3.0, delta=1e-5, conversion="cks")
    bs = GaussianFilter.zcdp(epsilon=3.0, delta=1e-5, conversion="bs")
    assert [f.full_norm_rounds(noise_std=10.0, l2_clip=1.0) for f in (gdp, cks, bs)] == [51, 44, 34]


def test_cross_check_epsilons_quoted_in_table() -> None:
    # zCDP of 44 rounds at sigma = 10 is rho = 44 / 200; GDP of 51 rounds is mu = sqrt(51) / 10.
    # Values: privacy.md §3, from dp_accounting 0.6.0 (pinned against the library itself in
    # tests/reference/test_dp_accounting_oracle.py::test_privacy_table_cross_check_values_come_from_dp_accounting).
    assert zcdp_epsilon(rho=44 / 200, delta=1e-5) == pytest.approx(2.96797, abs=1e-5)
    assert gdp_epsilon(mu=math.sqrt(51) / 10, delta=1e-5) == pytest.approx(2.97646, abs=1e-5)


def test_budget_report_rounds() -> None:
    report = budget_report(epsilon=3.0, delta=1e-5, noise_std=10.0, l2_clip=1.0)
    filters = report["filters"]
    assert isinstance(filters, dict)
    assert filters["gdp"]["rounds"] == 51
    assert filters["zcdp_cks"]["rounds"] == 44
    assert filters["zcdp_bs"]["rounds"] == 34
    # The best single Rényi order with the improved conversion reproduces the CKS budget
    # (CKS Cor. 13 is the improved conversion optimised over orders), hence 44 rounds.
    assert filters["rdp"]["rounds"] == 44


def test_cli_json_exact_shape(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["budget", "--epsilon", "3", "--delta", "1e-5", "--noise-std", "10", "--clip", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"epsilon", "delta", "noise_std", "clip", "filters"}
    assert set(out["filters"]) == {"gdp", "zcdp_cks", "zcdp_bs", "rdp"}
    assert set(out["filters"]["gdp"]) == {"mu_budget", "rounds"}
    assert set(out["filters"]["zcdp_cks"]) == {"rho_budget", "rounds"}
    assert set(out["filters"]["zcdp_bs"]) == {"rho_budget", "rounds"}
    assert set(out["filters"]["rdp"]) == {"order", "rounds"}
    assert (out["filters"]["gdp"]["rounds"], out["filters"]["zcdp_cks"]["rounds"]) == (51, 44)
    assert out["filters"]["zcdp_bs"]["rounds"] == 34


def test_cli_json_with_max_rounds_adds_realisation(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["budget", "--epsilon", "3", "--delta", "1e-5", "--noise-std", "10", "--clip", "1", "--max-rounds", "48"]
    assert main([*args, "--json"]) == 0
    real = json.loads(capsys.readouterr().out)["filters"]["realisation"]
    assert set(real) == {"kappa", "delta_tilde", "theta", "max_rounds"}
    assert real["max_rounds"] == 48
    # delta_tilde + theta (1 - delta_tilde) N <= delta (privacy.md §6).
    assert real["delta_tilde"] + real["theta"] * (1 - real["delta_tilde"]) * 48 <= 1e-5 * (1 + 1e-12)
