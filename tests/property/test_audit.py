"""Empirical audit: an adaptive adversary against one unit's filter.

Game (sigma = 1 after scaling): in each round the adversary asks for sensitivity
mu_hi if the previous output was positive, else mu_lo (it chooses from past outputs).
The unit's filter decides what it actually releases. Under the unit's data
y_t = mu_t + Z_t, under the null element y_t = Z_t, with mu_t the (data-world)
filtered sensitivity, a function of y_{<t}. The transcript's privacy loss is
L = sum_t (mu_t y_t - mu_t^2 / 2).

(epsilon, delta)-DP of the transcript is exactly
  E_data[(1 - e^{epsilon - L})_+] <= delta  and  E_null[(1 - e^{epsilon + L})_+] <= delta
(the hockey-stick divergence in both directions; Balle et al. 2018 Thm 5 / DRS), which
we estimate by Monte Carlo. The tail P(L > epsilon) <= delta is a *sufficient*
condition; the realisation filter (TVC) is built to meet it, the GDP filter (DRS/ST)
is not (at mu_B the tail is Phi(-eps/mu_B + mu_B/2) > delta), so the GDP audit
checks the hockey-stick and the realisation audit checks both.

The same game with no filter exceeds delta, so the audit can fail.
"""

from __future__ import annotations

import numpy as np

from protocol.filters import FilterState, GaussianFilter, charge, partial_clip
from protocol.realisation import RealisationFilter, RealisationState, advance, decide

TRIALS = 200_000
ROUNDS = 60
MU_HI, MU_LO = 0.5, 0.1
EPSILON, DELTA = 1.0, 0.05


def play(world: str, policy: str, seed: int, *, epsilon: float = EPSILON) -> np.ndarray:
    """Privacy loss L of one unit's transcript per trial, in the given world, under a filter policy."""
    rng = np.random.default_rng(seed)
    loss = np.zeros(TRIALS)
    last = np.zeros(TRIALS)
    if policy == "gdp":
        filt = GaussianFilter.gdp(epsilon=epsilon, delta=DELTA)
        state = FilterState.fresh(TRIALS)
    elif policy == "realisation":
        rfilt = RealisationFilter.create(epsilon=epsilon, delta=DELTA, max_rounds=ROUNDS, mu_max=MU_HI)
        rstate = RealisationState.fresh(rfilt, TRIALS)
    for t in range(ROUNDS):
        asked = np.where(last > 0, MU_HI, MU_LO) if t else np.full(TRIALS, MU_HI)
        if policy == "gdp":
            mu = np.minimum(asked, partial_clip(filt, state, noise_std=1.0, l2_clip=MU_HI) * (1 - 1e-12))
            result = charge(filt, state, noise_std=1.0, l2_norms=mu)
            mu = np.where(result.admitted, mu, 0.0)
            state = result.state
        elif policy == "realisation":
            step = decide(rfilt, rstate, mu=asked)
            mu = np.where(step.participating, asked, 0.0)
        else:
            mu = asked
        noise = rng.standard_normal(TRIALS)
        y = (mu + noise) if world == "data" else noise
        step_loss = mu * y - 0.5 * mu * mu
        if policy == "realisation":
            rstate = advance(rstate, step, losses=step_loss)
        loss += step_loss
        last = y
    return loss


def hockey_stick(loss: np.ndarray, world: str, epsilon: float = EPSILON) -> tuple[float, float]:
    """Estimate and standard error of delta(epsilon) from losses sampled in ``world``."""
    sign = -1.0 if world == "data" else 1.0
    values = np.clip(-np.expm1(epsilon + sign * loss), 0.0, None)
    return float(values.mean()), float(values.std() / np.sqrt(values.size))


def test_gdp_filter_meets_delta_against_adaptive_adversary() -> None:
    for world, seed in (("data", 1), ("null", 2)):
        est, se = hockey_stick(play(world, "gdp", seed), world)
        assert est <= DELTA + 4 * se, (world, est, se)
        # The filter uses its budget: the audit is tight, not vacuous.
        assert est >= 0.5 * DELTA, (world, est)


def test_realisation_filter_meets_delta_and_tail_bound() -> None:
    eps = 4.0  # kappa > 0 needs epsilon > mu_max^2 + mu_max (z(delta~) + z(theta)) (TVC Prop. 1)
    data = play("data", "realisation", 3, epsilon=eps)
    tail = np.abs(data) > eps
    assert tail.mean() <= DELTA + 4 * np.sqrt(DELTA * (1 - DELTA) / TRIALS), tail.mean()
    for world, loss in (("data", data), ("null", play("null", "realisation", 4, epsilon=eps))):
        est, se = hockey_stick(loss, world, eps)
        assert est <= DELTA + 4 * se, (world, est, se)


def test_audit_detects_an_unfiltered_unit() -> None:
    est, se = hockey_stick(play("data", "none", 5), "data")
    assert est > DELTA + 10 * se, (est, se)
    unfiltered_realisation = play("data", "none", 6)
    assert (np.abs(unfiltered_realisation) > 4.0).mean() > DELTA + 0.01
