"""Private model selection (issue 24, coordinator/tasks.py ``GradientTask._plateau``): the rules' behaviour.

The checks run through the task's real ``aggregate``; only the release step is replaced by one that
returns a chosen noisy sum, so the rule's statistics can be measured over thousands of runs.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.monitor import Reports
from coordinator.release import Ask, Released
from coordinator.report import RoundLog, RunWriter
from coordinator.tasks import GradientTask, RoundContext, plateau_checks, plateau_round
from coordinator.transport import RoundReplies

N = 1000  # public n


class ScriptedRelease:
    """A release step whose accuracy checks return n (true accuracy of the round + N(0, s^2))."""

    def __init__(self, truth: dict[int, float], std: float, rng: np.random.Generator) -> None:
        self.truth, self.std, self.rng = truth, std, rng
        self.asked: list[Ask] = []

    def release(self, ask: Ask) -> Released:
        self.asked.append(ask)
        value = N * (self.truth[ask.rnd] + self.std * self.rng.standard_normal())
        return Released(RoundReplies(), Counter(), np.array([value]), noise_var=(N * self.std) ** 2)

    def reports(self, rnd: int) -> Reports:  # pragma: no cover - no monitor here
        raise AssertionError("no monitor in these runs")


def config(rounds: int, **over: Any) -> CoordinatorConfig:
    keys: dict[str, Any] = dict(
        num_nodes=10,
        n_public=N,
        rounds=rounds,
        noise_std=4.0,
        l2_clip=1.0,
        unit="client",
        model="logreg",
        model_args=json.dumps({"in_features": 3, "n_classes": 2}),
        plateau_every=1,
        plateau_start=1,
        plateau_patience=rounds + 1,
        progress=False,
    )
    return CoordinatorConfig(**(keys | over))


def selected_round(cfg: CoordinatorConfig, truth: dict[int, float], std: float, rng: np.random.Generator) -> int:
    """Drive the task's aggregate over every round (no gradient released: the model stays) and read its choice."""
    task = GradientTask(cfg, np.zeros(8, np.float32), evaluate=None)
    step = ScriptedRelease(truth, std, rng)
    for rnd in range(1, cfg.rounds + 1):
        log = RoundLog(rnd, "gradient", 0, {}, {}, 0, cfg.noise_std, 0.0, 0.0)
        ctx = RoundContext(rnd, log, Counter(), step, RunWriter(""))
        task.aggregate(Released(RoundReplies(), Counter(), None, 0.0), ctx)
    assert [a.rnd for a in step.asked] == list(range(1, cfg.rounds + 1))
    assert task.selected is not None
    return task.selected[0]


def test_guarded_rule_picks_a_worse_round_at_most_alpha_of_the_time() -> None:
    # Every later round is truly as good as or worse than the first (a run past its useful horizon):
    # any move away from round 1 is a mistake. The guarded rule makes one w.p. <= alpha by its union
    # bound; FZ's 'best' rule (the highest noisy value) makes one most of the time.
    rounds, std, alpha = 8, 0.01, 0.1
    truth = {1: 0.80} | {r: 0.80 - 0.002 * (r - 1) for r in range(2, rounds + 1)}
    rng = np.random.default_rng(0)
    trials = 1000
    guarded = config(rounds, plateau_rule="guarded", plateau_alpha=alpha)
    wrong = sum(selected_round(guarded, truth, std, rng) != 1 for _ in range(trials)) / trials
    best = config(rounds, plateau_rule="best")
    wrong_best = sum(selected_round(best, truth, std, rng) != 1 for _ in range(trials)) / trials
    assert wrong <= alpha / 2  # the union bound is loose: about 0.005 here
    assert wrong_best > 0.5


def test_guarded_rule_follows_a_real_gain_beyond_the_noise() -> None:
    # Accuracy that climbs 0.1 a check, with noise std 0.005 (bound h = 0.013): the guarded rule moves to
    # the last round.
    rounds, std = 6, 0.005
    truth = {r: 0.3 + 0.1 * r for r in range(1, rounds + 1)}
    rng = np.random.default_rng(1)
    cfg = config(rounds, plateau_rule="guarded", plateau_alpha=0.05)
    assert all(selected_round(cfg, truth, std, rng) == rounds for _ in range(200))


def test_guarded_bound_is_the_union_bound_over_the_runs_checks() -> None:
    from scipy.stats import norm

    cfg = config(9, plateau_rule="guarded", plateau_alpha=0.05, plateau_every=2, plateau_start=3)
    assert [r for r in range(1, 10) if plateau_round(cfg, r)] == [3, 5, 7, 9] and plateau_checks(cfg) == 4
    task = GradientTask(cfg, np.zeros(8, np.float32), evaluate=None)
    step = ScriptedRelease({3: 0.7}, 0.02, np.random.default_rng(2))
    log = RoundLog(3, "gradient", 0, {}, {}, 0, cfg.noise_std, 0.0, 0.0)
    task.aggregate(Released(RoundReplies(), Counter(), None, 0.0), RoundContext(3, log, Counter(), step, RunWriter("")))
    (check,) = task.checks
    # Every check's noise within +-h, all four together w.p. >= 0.95: h = s z(0.05 / (2 * 4)).
    assert check["noise_bound"] == pytest.approx(0.02 * norm.isf(0.05 / 8), rel=1e-12)
    assert check["round"] == 3 and log.metrics["train_accuracy_private"] == check["train_accuracy_private"]


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"plateau_rule": "median"}, "plateau_rule: expected one of ('best', 'guarded'), got 'median'"),
        ({"plateau_alpha": 1.0}, "plateau_alpha: expected a number in (0, 1), got 1.0"),
        ({"plateau_noise_std": float("nan")}, "plateau_noise_std: expected a finite number >= 0"),
        ({"plateau_noise_std": -1.0}, "plateau_noise_std: expected a finite number >= 0"),
        ({"task": "indicator"}, "plateau_every: the plateau test asks the training accuracy"),
    ],
)
def test_bad_selection_settings_are_refused_by_name(over: dict[str, Any], message: str) -> None:
    from coordinator.config import CoordinatorConfigError

    with pytest.raises(CoordinatorConfigError) as err:
        config(4, **over)
    assert message in str(err.value)
