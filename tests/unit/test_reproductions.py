"""The paper reproductions (``realisation-survival``: TVC Fig. 2; ``filters-compare``: FZ Sec. 4.3).

Every pinned number names its source and is checked against a computation that does not go
through the code under test (a closed form, a slow loop, scipy's normal distribution, Google's
dp_accounting). The federation tests run small versions on the in-process engine; the full
versions on Flower's engine are in ``tests/integration/test_reproductions_flower.py`` (slow).
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from scipy import optimize, stats

from client_agent.ledger import Ledger
from protocol.comparisons import (
    gaussian_additive_rounds,
    gaussian_rounds,
    gaussian_rruv_rounds,
    pure_dp_gdp_mu,
    pure_rounds,
)
from protocol.realisation import RealisationFilter, RealisationState, advance, decide
from simulations.cli import main
from simulations.reproductions.fz_sec43 import NOISE_STDS, PURE_EPSILONS, comparison_tables
from simulations.reproductions.tvc_fig2 import (
    DKW_ALPHA,
    TVC_DELTA,
    TVC_EPSILON,
    TVC_MAX_ROUNDS,
    TVC_NOISE_STD,
    dkw_radius,
    mechanism_rounds,
    realisation_stopping_times,
    survival,
)

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

NORM = stats.norm()
LOG_INV_DELTA = math.log(1e5)


# --- independent oracles (scipy's normal distribution and the papers' formulas, nothing from protocol/) ---


def gdp_delta_oracle(mu: float, eps: float) -> float:
    """DRS Cor. 2.13: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    return float(NORM.cdf(-eps / mu + mu / 2) - math.exp(eps) * NORM.cdf(-eps / mu - mu / 2))


def mu_budget_oracle(eps: float, delta: float) -> float:
    return float(optimize.brentq(lambda m: gdp_delta_oracle(m, eps) - delta, 1e-3, 20.0, xtol=1e-14))


def rruv_lhs(sum_eps_expm1: float, sum_sq: float, eps: float, delta: float) -> float:
    """RRUV Thm 5.1 as FZ Sec. 4.3 state it (privacy.md §5)."""
    h = eps**2 / (28.04 * math.log(1 / delta))
    return 0.5 * sum_eps_expm1 + math.sqrt(2 * (sum_sq + h) * (1 + 0.5 * math.log1p(sum_sq / h)) * math.log(1 / delta))


def rruv_rounds_slow(eps_t: float, eps: float, delta: float) -> int:
    """Add identical eps_t rounds one at a time until RRUV's condition fails."""
    k = 0
    while rruv_lhs((k + 1) * eps_t * math.expm1(eps_t), (k + 1) * eps_t**2, eps, delta) <= eps:
        k += 1
    return k


def bs_budget_oracle(eps: float, delta: float) -> float:
    """FZ Thm 4.8's B* (BS Prop. 1.3 inverted): (sqrt(log(1/delta) + eps) - sqrt(log(1/delta)))^2."""
    return (math.sqrt(math.log(1 / delta) + eps) - math.sqrt(math.log(1 / delta))) ** 2


# --- the pure-DP to GDP conversion -------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.01, 0.1, 0.5, 1.0, 3.0])
def test_pure_dp_gdp_mu_is_the_smallest_mu_under_f_eps(eps: float) -> None:
    # f_{eps,0}(a) = max(0, 1 - e^eps a, e^-eps (1 - a)) against G_mu(a) = Phi(Phi^{-1}(1 - a) - mu) (DRS).
    mu = pure_dp_gdp_mu(epsilon_round=eps)
    a = np.concatenate([np.geomspace(1e-12, 0.5, 4000), 1 - np.geomspace(1e-12, 0.5, 4000)])
    f = np.maximum.reduce([np.zeros_like(a), 1 - math.exp(eps) * a, math.exp(-eps) * (1 - a)])

    def g(m: float) -> np.ndarray:
        return NORM.cdf(NORM.isf(a) - m)

    assert np.all(g(mu) <= f + 1e-12)  # every eps-DP mechanism is mu-GDP
    corner = 1 / (1 + math.exp(eps))
    smaller = mu * (1 - 1e-4)
    assert NORM.cdf(NORM.isf(corner) - smaller) > corner  # a smaller mu fails at the corner of f_{eps,0}


def test_pure_dp_gdp_mu_small_epsilon_limit() -> None:
    # 2 Phi^{-1}(1/2 + eps/4 + O(eps^3)) = eps / (2 phi(0)) + O(eps^3) = sqrt(pi/2) eps + O(eps^3).
    assert pure_dp_gdp_mu(epsilon_round=1e-4) == pytest.approx(math.sqrt(math.pi / 2) * 1e-4, rel=1e-8)


# --- filters-compare: the tables (FZ Sec. 4.3) --------------------------------------------------


def test_gaussian_reference_row_of_privacy_md() -> None:
    # privacy.md §3 reference values, delta = 1e-5, epsilon = 3, sigma = 10: GDP 51 / zCDP-BS 34 rounds
    # (cross-checked there with dp_accounting's PLD and RDP accountants).
    row = gaussian_rounds(noise_std=10.0, l2_clip=1.0, epsilon=3.0, delta=1e-5)
    assert (row["gdp"], row["fz"]) == (51, 34)
    assert row["budgets"]["mu_budget"] == pytest.approx(0.719117, abs=1e-6)  # type: ignore[index]


@pytest.mark.parametrize("eps_t", [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
def test_pure_rows_against_closed_forms_and_slow_loops(eps_t: float) -> None:
    row = pure_rounds(epsilon_round=eps_t, epsilon=3.0, delta=1e-5)
    # FZ Thm 4.8: 1/2 k eps_t^2 <= B*, so k = floor(2 B* / eps_t^2).
    assert row["fz"] == math.floor(2 * bs_budget_oracle(3.0, 1e-5) / eps_t**2)
    assert row["rruv"] == rruv_rounds_slow(eps_t, 3.0, 1e-5)
    # GDP filter (ST): k mu_t^2 <= mu_B^2 with mu_t the conversion above.
    mu_b = mu_budget_oracle(3.0, 1e-5)
    assert row["gdp"] == math.floor(mu_b**2 / pure_dp_gdp_mu(epsilon_round=eps_t) ** 2)


def test_additive_gaussian_rounds_against_brute_force() -> None:
    for mu, eps in ((0.5, 8.0), (0.1, 3.0), (0.05, 1.0)):
        # Largest k with k delta_GDP(mu, eps/k) <= delta: basic composition, identical rounds.
        brute = max([k for k in range(1, 400) if k * gdp_delta_oracle(mu, eps / k) <= 1e-5], default=0)
        assert gaussian_additive_rounds(mu=mu, epsilon=eps, delta=1e-5).rounds == brute


def test_rruv_gaussian_rounds_against_brute_force() -> None:
    fractions = (0.1, 0.5, 0.9)
    for mu in (0.1, 0.05, 0.02):
        brute = 0
        for f in fractions:
            for k in range(1, 300):
                # eps_t with delta_GDP(mu, eps_t) = (1 - f) delta / k, then RRUV's condition at f delta.
                target = (1 - f) * 1e-5 / k * (1 - 1e-9)
                eps_t = optimize.brentq(lambda e, t=target, m=mu: gdp_delta_oracle(m, e) - t, 0.0, 50.0, xtol=1e-14)
                if rruv_lhs(k * eps_t * math.expm1(eps_t), k * eps_t**2, 3.0, f * 1e-5) > 3.0:
                    break  # more rounds only raise eps_t and the sums
                brute = max(brute, k)
        got = gaussian_rruv_rounds(mu=mu, epsilon=3.0, delta=1e-5, fractions=fractions)
        assert got.rounds == brute
        assert got.delta_filter + got.delta_rounds == pytest.approx(1e-5, rel=1e-12)
        assert got.rounds * got.delta_round <= got.delta_rounds


def test_orderings_and_monotonicity_of_the_tables() -> None:
    tables = comparison_tables(epsilon=3.0, delta=1e-5)
    pure, gauss = tables["pure"], tables["gaussian"]
    assert [r["epsilon_round"] for r in pure] == list(PURE_EPSILONS)
    assert [r["noise_std"] for r in gauss] == sorted(NOISE_STDS)
    for r in pure:
        # FZ: their filter is tighter than RRUV's (FZ abstract, Sec. 4.3).
        assert r["fz"] >= r["rruv"]
    for r in gauss:
        # A Gaussian composition is exactly sqrt(sum mu_t^2)-GDP (DRS), so the GDP filter admits at least what
        # any valid conversion does: mu_B^2 >= 2 rho_B(BS). RRUV pays an (eps_t, delta_t) split on top.
        assert r["gdp"] >= r["fz"] >= r["rruv"]["rounds"]
    for key in ("rruv", "fz", "gdp"):
        counts = [r[key] for r in pure]
        assert counts == sorted(counts, reverse=True)  # costlier rounds, fewer of them
        counts = [r[key]["rounds"] if key == "rruv" else r[key] for r in gauss]
        assert counts == sorted(counts)  # larger sigma, cheaper rounds, more of them
    # The orderings are not 0 >= 0: every filter admits rounds at the cheap end of both grids.
    assert min(r["rruv"] for r in pure if r["epsilon_round"] <= 0.1) > 0 and gauss[-1]["rruv"]["rounds"] > 0


# --- realisation-survival: the mechanism filters at the chosen (epsilon, delta) (TVC Fig. 2) ----------


def test_mechanism_stops_at_the_chosen_parameters() -> None:
    mech = mechanism_rounds(epsilon=TVC_EPSILON, delta=TVC_DELTA, noise_std=TVC_NOISE_STD, l2_clip=1.0)
    got = {name: entry["rounds"] for name, entry in mech.items()}
    # docs/results.md (realisation-survival setting): additive 3, RRUV 0, Renyi 9, GDP 11; each recomputed below.
    assert got == {"additive": 3, "rruv": 0, "rdp": 9, "gdp": 11}
    mu, eps, delta = 1 / TVC_NOISE_STD, TVC_EPSILON, TVC_DELTA
    # Independent values: basic composition by brute force; GDP as floor(mu_B^2 / mu^2) (DRS);
    assert got["additive"] == max(k for k in range(1, 100) if k * gdp_delta_oracle(mu, eps / k) <= delta)
    assert got["gdp"] == math.floor(mu_budget_oracle(eps, delta) ** 2 / mu**2)
    # Rényi at the best single order, improved conversion (CKS Prop. 12), on a dense grid of orders;
    orders = np.linspace(1.05, 40, 20000)
    budgets = eps - np.log((orders - 1) / orders) + (math.log(delta) + np.log(orders)) / (orders - 1)
    assert got["rdp"] == math.floor(float(np.max(2 * budgets / orders)) / mu**2)
    # RRUV: any Gaussian round of mu = 1/2 with delta_t <= delta has eps_t >= eps_min, and one such round
    # alone already puts RRUV's left-hand side above epsilon (log(1/delta_filter) >= log(1/delta)).
    eps_min = optimize.brentq(lambda e: gdp_delta_oracle(mu, e) - delta, 0.0, 50.0)
    assert 0.5 * eps_min * math.expm1(eps_min) + math.sqrt(2 * eps_min**2 * math.log(1 / delta)) > eps
    assert got["gdp"] >= got["rdp"]  # GDP is exact for Gaussian compositions; any RDP conversion is looser


def test_mechanism_stops_against_dp_accounting() -> None:
    import dp_accounting  # a pinned test dependency: an oracle that is missing must fail, not skip
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    def pld_eps(k: int) -> float:
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=TVC_NOISE_STD), count=k)
        return float(acc.get_epsilon(TVC_DELTA))

    # GDP filter's 11 queries are (8, 1e-5)-DP by the PLD accountant, and a 12th would not be.
    assert pld_eps(11) <= TVC_EPSILON + 1e-3 < pld_eps(12)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=TVC_NOISE_STD), count=9)
    assert acc.get_epsilon(TVC_DELTA) <= TVC_EPSILON  # the Rényi filter's 9 queries


# --- realisation-survival: the Monte-Carlo against an independent simulation -----------------------


def tvc_stopping_times_oracle(eps: float, delta: float, mu: float, n_max: int, trials: int, seed: int) -> np.ndarray:
    """TVC Prop. 1 by hand: T = min(N, 1 + first j >= 1 with |L_j| > kappa), L_j a sum of N(mu^2/2, mu^2)."""
    # (delta~, theta) minimising z(delta~) + z(theta) with delta~ + theta (1 - delta~) N = delta (privacy.md §6).
    dts = delta * np.linspace(1e-4, 1 - 1e-4, 200001)
    z = NORM.isf(dts) + NORM.isf((delta - dts) / (n_max * (1 - dts)))
    kappa = eps - mu**2 - mu * float(np.min(z))
    rng = np.random.default_rng(seed)
    walk = np.cumsum(rng.normal(mu**2 / 2, mu, (trials, n_max)), axis=1)  # L_1 .. L_N
    over = np.abs(walk) > kappa
    first = np.where(over.any(axis=1), over.argmax(axis=1) + 1, n_max)  # j, or N when never over
    return np.minimum(first + 1, n_max)


def test_monte_carlo_matches_tvc_prop_1_and_beats_every_mechanism_filter() -> None:
    mu = 1 / TVC_NOISE_STD
    filt = RealisationFilter.create(epsilon=TVC_EPSILON, delta=TVC_DELTA, max_rounds=TVC_MAX_ROUNDS, mu_max=mu)
    n = 100_000
    ours = realisation_stopping_times(
        filt, noise_std=TVC_NOISE_STD, l2_clip=1.0, trials=n, rng=np.random.default_rng(11)
    )
    oracle = tvc_stopping_times_oracle(TVC_EPSILON, TVC_DELTA, mu, TVC_MAX_ROUNDS, n, seed=12)
    gap = np.max(np.abs(survival(ours, TVC_MAX_ROUNDS) - survival(oracle, TVC_MAX_ROUNDS)))
    assert gap <= 2 * dkw_radius(n, DKW_ALPHA)  # both within their DKW radius of the same curve
    s = survival(ours, TVC_MAX_ROUNDS)
    assert s[0] == 1.0 and s[-1] == 0.0 and np.all(np.diff(s) <= 0)  # a survival function
    mech = mechanism_rounds(epsilon=TVC_EPSILON, delta=TVC_DELTA, noise_std=TVC_NOISE_STD, l2_clip=1.0)
    best = max(entry["rounds"] for entry in mech.values())
    assert np.median(ours) > best  # TVC's point: most units answer more queries than any mechanism filter allows
    # Informative: spread out, not everyone reaching N (docs/results.md: P(T = 48) = 0.097 in the Monte-Carlo).
    assert 0.02 < np.mean(ours == TVC_MAX_ROUNDS) < 0.5


# --- the presets through the command line (in-process engine) ------------------------------------------


def replayed_halt(filt: RealisationFilter, releases: list[dict[str, np.ndarray]]) -> int:
    """The halt round protocol/realisation.py gives for one unit's stored losses (its ledger's releases)."""
    state = RealisationState.fresh(filt, 1)
    for i, rel in enumerate(releases, start=1):
        step = decide(filt, state, mu=np.asarray(rel["l2_norms"]) / float(rel["noise_std"][0]))
        assert bool(step.participating[0]) == bool(rel["participating"][0])
        assert bool(step.accept_next[0]) == bool(rel["accept_next"][0])
        if not step.accept_next[0] and state.accepting[0]:
            return i
        state = advance(state, step, losses=np.asarray(rel["losses"]))
    return -1


def test_realisation_survival_preset_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rs"
    clients, n_max = 10, 16
    args = ["simulate", "--preset", "realisation-survival", "--engine", "inprocess", "--out", str(out)]
    assert main([*args, "--clients", str(clients), "--rounds", str(n_max)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rep = summary["reproduction"]
    assert {p.name for p in out.glob("*.png")} >= {"survival.png"} and (out / "survival.csv").exists()
    # docs/results.md; recomputed independently in test_mechanism_stops_at_the_chosen_parameters.
    assert rep["mechanism_stops"] == {"additive": 3, "rruv": 0, "rdp": 9, "gdp": 11}
    # The federation's stopping times, replayed from every ledger's stored realised losses through
    # protocol/realisation.py, are the halt rounds the agents recorded.
    filt = RealisationFilter.create(epsilon=TVC_EPSILON, delta=TVC_DELTA, max_rounds=n_max, mu_max=0.5)
    times, standardised = [], []
    for pid in range(clients):
        with Ledger.open_existing(out / "ledgers" / f"client{pid}.sqlite") as ledger:
            releases = [rel for _, _, rel in ledger.releases() if str(rel["kind"]) == "indicator"]
            halt = int(ledger.state()["halt_round"][0])
        assert len(releases) == n_max
        assert replayed_halt(filt, releases) == halt == sum(bool(r["participating"][0]) for r in releases)
        times.append(halt)
        # mu = C / sigma = 1/2: the loss is N(mu^2/2, mu^2) = N(0.125, 0.5^2) (privacy.md §6).
        standardised += [(float(r["losses"][0]) - 0.125) / 0.5 for r in releases if r["participating"][0]]
    assert times == rep["federation"]["stopping_times"]
    # The realised losses are N(mu^2/2, mu^2) (privacy.md §6): the empirical CDF within its DKW band of Phi.
    z = np.sort(standardised)
    ecdf_gap = np.max(np.abs(np.arange(1, z.size + 1) / z.size - NORM.cdf(z)))
    assert ecdf_gap <= dkw_radius(z.size, DKW_ALPHA)
    # The federation's survival curve agrees with the Monte-Carlo of the same filter, within the DKW bound.
    with (out / "survival.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    fed = np.array([float(r["realisation_federation"]) for r in rows])
    mc = np.array([float(r["realisation_monte_carlo"]) for r in rows])
    np.testing.assert_allclose(fed, survival(np.array(times), n_max), atol=1e-6)
    tolerance = dkw_radius(clients, DKW_ALPHA) + dkw_radius(rep["monte_carlo"]["trials"], DKW_ALPHA)
    assert np.max(np.abs(fed - mc)) <= tolerance and rep["agreement"]["agrees"]
    # The GDP filter's step curve: every unit answers exactly 11 queries (docs/results.md; checked above).
    assert [float(r["gdp"]) for r in rows] == [1.0] * 11 + [0.0] * (n_max + 1 - 11)
    printed = capsys.readouterr().out
    assert "TVC Fig. 2 at (epsilon, delta) = (8, 1e-05)" in printed and "they agree." in printed


def test_filters_compare_preset_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fc"
    args = ["simulate", "--preset", "filters-compare", "--engine", "inprocess", "--out", str(out)]
    assert main([*args, "--clients", "3", "--noise-std", "5"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    check = summary["reproduction"]["cross_check"]
    # privacy.md §3: mu_B = 0.719117 at (3, 1e-5); at sigma = 5 a full-norm round costs mu^2 = 1/25.
    assert check["table_gdp_rounds"] == math.floor(0.719117**2 * 25) == 12
    for client in check["clients"]:
        # Exactly the table's full-norm rounds, then the exact remainder in one partial round (FZ Alg. 3).
        assert client["full_norm_rounds"] == 12 and client["halt_round"] == 13
        assert len(client["partial_norms"]) == 1 and 0 < client["partial_norms"][0] < 1
        assert client["spent"] == pytest.approx(client["threshold"], rel=1e-4)
    assert check["agrees"] and summary["rounds_completed"] == 14  # the table's 12 full-norm rounds + 2 (preset default)
    with (out / "filters_compare.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(PURE_EPSILONS) + len(set(NOISE_STDS) | {5.0})
    sigma10 = next(r for r in rows if r["noise_std"] == "10.0")
    assert (sigma10["fz_thm_4_8"], sigma10["gdp"]) == ("34", "51")  # privacy.md §3 reference row
    assert json.loads((out / "filters_compare.json").read_text())["epsilon"] == 3.0
    assert (out / "filters_compare.png").stat().st_size > 0
    assert "as the table says." in capsys.readouterr().out


def test_a_preset_refuses_the_options_it_fixes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--preset", "realisation-survival", "--filter", "gdp", "--out", str(tmp_path / "x")]
    assert main(args) == 2
    assert "--filter: the realisation-survival preset runs with filter 'realisation'; got 'gdp'" in (
        capsys.readouterr().err
    )
    args = ["simulate", "--preset", "filters-compare", "--noise-std", "5", "--rounds", "12", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "--rounds: expected at least 13" in capsys.readouterr().err
    assert main(["simulate", "--preset", "filters-compare", "--clip", "2", "--out", str(tmp_path / "y")]) == 2
    assert "--clip: the filters-compare preset runs with clip 1.0; got 2.0" in capsys.readouterr().err


def test_realisation_survival_refuses_an_epsilon_that_answers_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # At (2, 1e-5), sigma = 2, N = 48 the filter's margin at the first query is negative (TVC Alg. 1 with
    # mu_0 = 0): refuse before building the federation, not after running it.
    out = tmp_path / "rs"
    args = ["simulate", "--preset", "realisation-survival", "--engine", "inprocess", "--out", str(out)]
    assert main([*args, "--epsilon", "2"]) == 2
    assert "--epsilon: at sigma = 2 and N = 48 the realisation filter accepts no query below epsilon" in (
        capsys.readouterr().err
    )
    assert not (out / "clients").exists()
    budget = ["budget", "--epsilon", "2", "--delta", "1e-5", "--noise-std", "2", "--clip", "1", "--max-rounds", "48"]
    assert main(budget) == 0
    assert "accepts no request at all" in capsys.readouterr().out
