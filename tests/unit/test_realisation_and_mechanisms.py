"""Realisation-level filter (TVC, privacy.md §6) and mechanism-level filters (privacy.md §5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from protocol.conversions import rho_budget
from protocol.mechanism_filters import (
    additive_allows,
    fz_dp_allows,
    pure_dp_rdp,
    rdp_allows,
    rounds_allowed,
    rruv_allows,
    rruv_bound,
    split_approx_rounds_allowed,
)
from protocol.realisation import (
    RealisationFilter,
    RealisationState,
    advance,
    choose_split,
    decide,
    realised_loss,
    theta_for,
    upper_quantile,
)
from protocol.validate import PrivacyParameterError


class TestRealisation:
    def test_kappa_is_tvc_prop1_for_unit_sensitivity(self) -> None:
        sigma, eps, delta, n = 2.0, 6.0, 1e-5, 48
        filt = RealisationFilter.create(epsilon=eps, delta=delta, max_rounds=n, mu_max=1.0 / sigma)
        z = upper_quantile(filt.delta_tilde) + upper_quantile(filt.theta)
        # TVC Prop. 1: kappa = epsilon - 1/sigma^2 - (z(delta~) + z(theta)) / sigma.
        assert filt.kappa(mu=1.0 / sigma) == pytest.approx(eps - 1 / sigma**2 - z / sigma, rel=1e-14)

    def test_split_spends_delta_and_is_optimal(self) -> None:
        dt, theta = choose_split(delta=1e-5, max_rounds=48)
        assert dt + theta * (1 - dt) * 48 == pytest.approx(1e-5, rel=1e-12)
        best = upper_quantile(dt) + upper_quantile(theta)
        for other in np.geomspace(1e-9, 9.9e-6, 200):
            th = theta_for(delta=1e-5, delta_tilde=other, max_rounds=48)
            assert best <= upper_quantile(other) + upper_quantile(th) + 1e-9

    def test_split_that_overspends_delta_is_error(self) -> None:
        with pytest.raises(PrivacyParameterError, match=r"delta_tilde \+ theta"):
            RealisationFilter(epsilon=1.0, delta=1e-5, max_rounds=10, mu_max=0.5, delta_tilde=5e-6, theta=1e-6)

    def test_realised_loss_distribution(self) -> None:
        # Under the unit's data l ~ N(mu^2/2, mu^2) (privacy.md §6).
        rng = np.random.default_rng(3)
        sigma, d = 2.0, 5
        v = np.array([[1.0, 0.0, 0.5, 0.0, 0.0]])
        mu = float(np.linalg.norm(v)) / sigma
        losses = np.array(
            [realised_loss(contribution=v, noise=rng.normal(0, sigma, d), noise_std=sigma)[0] for _ in range(20000)]
        )
        assert stats.kstest(losses, stats.norm(mu**2 / 2, mu).cdf).pvalue > 1e-3

    def test_records_sharing_noise(self) -> None:
        v = np.array([[1.0, 0.0], [0.0, 2.0]])
        xi = np.array([0.5, -1.0])
        got = realised_loss(contribution=v, noise=xi, noise_std=1.0)
        # (||v||^2 + 2 <xi, v>) / 2 per record.
        np.testing.assert_allclose(got, [(1 + 1.0) / 2, (4 - 4.0) / 2])

    def test_decision_rule_and_stopping(self) -> None:
        filt = RealisationFilter.create(epsilon=8.0, delta=1e-3, max_rounds=5, mu_max=0.5)
        state = RealisationState.fresh(filt, 3)
        assert state.accepting.all()
        margin = float(filt.margin(0.5))
        state = RealisationState(loss=[0.0, margin + 1e-9, -(margin + 1e-9)], accepting=[True, True, True])
        step = decide(filt, state, mu=[0.5, 0.5, 0.5])
        assert step.participating.tolist() == [True, True, True]  # y_i released either way
        assert step.accept_next.tolist() == [True, False, False]  # |L| > margin stops, both signs
        state = advance(state, step, losses=[0.1, 0.1, 0.1])
        step2 = decide(filt, state, mu=[0.5, 0.5, 0.5])
        assert step2.participating.tolist() == [True, False, False]
        with pytest.raises(PrivacyParameterError, match="did not take part"):
            advance(state, step2, losses=[0.0, 0.3, 0.0])

    def test_at_most_max_rounds(self) -> None:
        filt = RealisationFilter.create(epsilon=50.0, delta=1e-3, max_rounds=4, mu_max=0.1)
        state = RealisationState.fresh(filt, 1)
        taken = 0
        for _ in range(10):
            step = decide(filt, state, mu=[0.1])
            taken += int(step.participating[0])
            state = advance(state, step, losses=[0.005 if step.participating[0] else 0.0])
        assert taken == 4

    def test_request_above_cap_is_error(self) -> None:
        filt = RealisationFilter.create(epsilon=5.0, delta=1e-3, max_rounds=4, mu_max=0.5)
        with pytest.raises(PrivacyParameterError, match="mu_max"):
            decide(filt, RealisationState.fresh(filt, 1), mu=[0.6])


class TestMechanismFilters:
    def test_additive(self) -> None:
        assert additive_allows(epsilons=[0.5, 0.5], deltas=[1e-6, 1e-6], epsilon=1.0, delta=2e-6)
        assert not additive_allows(epsilons=[0.5, 0.6], deltas=[0, 0], epsilon=1.0, delta=1e-6)
        assert not additive_allows(epsilons=[0.1], deltas=[2e-6], epsilon=1.0, delta=1e-6)
        # Basic composition (privacy.md §5): k rounds of 1/8 (exact in binary) fit epsilon = 1 iff k <= 8.
        assert (
            rounds_allowed(lambda k: additive_allows(epsilons=[0.125] * k, deltas=[0] * k, epsilon=1.0, delta=1e-5))
            == 8
        )

    def test_rruv_formula(self) -> None:
        # Direct transcription of FZ Sec. 4.3's statement of RRUV Thm 5.1, for 3 rounds of 0.1.
        eps_g, delta_g = 1.0, 1e-5
        h = eps_g**2 / (28.04 * math.log(1 / delta_g))
        s = 3 * 0.01
        expected = 0.5 * 3 * 0.1 * math.expm1(0.1) + math.sqrt(
            2 * (s + h) * (1 + 0.5 * math.log(1 + s / h)) * math.log(1 / delta_g)
        )
        assert rruv_bound(epsilons=[0.1] * 3, epsilon=eps_g, delta=delta_g) == pytest.approx(expected, rel=1e-14)

    def test_fz_dp_filter_beats_rruv(self) -> None:
        # FZ Sec. 4.3: their filter admits more rounds than RRUV's at the same (epsilon, delta).
        for eps_t in (0.01, 0.03, 0.1):
            rruv = rounds_allowed(lambda k, e=eps_t: rruv_allows(epsilons=[e] * k, epsilon=1.0, delta=1e-5))
            fz = rounds_allowed(lambda k, e=eps_t: fz_dp_allows(epsilons=[e] * k, epsilon=1.0, delta=1e-5))
            assert fz > rruv > 0
            # FZ Thm 4.8 is a closed form: floor(2 B* / eps_t^2) rounds.
            assert fz == math.floor(2 * rho_budget(epsilon=1.0, delta=1e-5, conversion="bs") / eps_t**2 * (1 + 1e-12))

    def test_rdp_fixed_order(self) -> None:
        # min(eps, alpha eps^2 / 2) (Mironov 2017 Prop. 3; BS Prop. 3.3): 2 * 0.01 / 2 = 0.01; min(3, 45) = 3.
        assert pure_dp_rdp(epsilon_round=0.1, order=2.0) == pytest.approx(0.01)
        assert pure_dp_rdp(epsilon_round=3.0, order=10.0) == 3.0
        k = rounds_allowed(lambda k: rdp_allows(rdps=[8 * 0.01 / 2] * k, order=8.0, epsilon=2.0, delta=1e-5))
        assert k > 0
        assert not rdp_allows(rdps=[8 * 0.01 / 2] * (k + 1), order=8.0, epsilon=2.0, delta=1e-5)

    def test_split_rounds_capped_by_delta(self) -> None:
        k = split_approx_rounds_allowed(
            lambda k: fz_dp_allows(epsilons=[0.01] * k, epsilon=1.0, delta=1e-5), delta_round=1e-7, delta_rounds=1e-5
        )
        # The delta cap binds (privacy.md §5): sum delta_t <= 1e-5 with 1e-7 a round is 100 rounds,
        # while FZ's filter alone would admit more at eps_t = 0.01.
        assert k == 100
        assert rounds_allowed(lambda k: fz_dp_allows(epsilons=[0.01] * k, epsilon=1.0, delta=1e-5)) > 100

    def test_bad_history_is_error(self) -> None:
        with pytest.raises(PrivacyParameterError, match="epsilons"):
            rruv_allows(epsilons=[0.1, float("nan")], epsilon=1.0, delta=1e-5)
