"""Private model selection (issue 24, coordinator/tasks.py ``GradientTask._plateau``): the rules' behaviour.

The checks run through the task's real ``aggregate``; only the release step is replaced by one that
returns a chosen noisy sum, so the rule's statistics can be measured over thousands of runs.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import partial
from typing import Any

import numpy as np
import pytest

from coordinator.analysts import Query
from coordinator.config import CoordinatorConfig
from coordinator.monitor import Reports
from coordinator.release import Ask, PlainRelease, Released
from coordinator.report import RoundLog, RunWriter
from coordinator.tasks import GradientTask, RoundContext, indicator_request, plateau_checks, plateau_round
from coordinator.transport import RoundReplies
from protocol import messages as wire

N = 1000  # public n


class ScriptedRelease:
    """A release step whose accuracy checks return n (true accuracy of the round + N(0, s^2))."""

    def __init__(self, truth: dict[int, float], std: float, rng: np.random.Generator) -> None:
        self.truth, self.std, self.rng = truth, std, rng
        self.asked: list[Ask] = []

    def release(self, ask: Ask) -> Released:
        self.asked.append(ask)
        value = N * (self.truth[ask.rnd] + self.std * self.rng.standard_normal())
        return Released(RoundReplies(), Counter(), np.array([value]), noise_var=(N * self.std) ** 2, complete=True)

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
    trials = 600
    guarded = config(rounds, plateau_rule="guarded", plateau_alpha=alpha)
    wrong = sum(selected_round(guarded, truth, std, rng) != 1 for _ in range(trials)) / trials
    best = config(rounds, plateau_rule="best")
    wrong_best = sum(selected_round(best, truth, std, rng) != 1 for _ in range(trials)) / trials
    assert wrong <= alpha  # by the union bound (0.021 here)
    # Every round exactly as good as the first: the bound's hardest case, still within alpha (0.071 here).
    flat = {r: 0.80 for r in range(1, rounds + 1)}
    assert sum(selected_round(guarded, flat, std, rng) != 1 for _ in range(trials)) / trials <= alpha
    assert wrong_best > 0.5


def test_guarded_rule_follows_a_real_gain_beyond_the_noise() -> None:
    # Accuracy that climbs 0.1 a check, with noise std 0.005 (bound h = 0.013): the guarded rule moves to
    # the last round.
    rounds, std = 6, 0.005
    truth = {r: 0.3 + 0.1 * r for r in range(1, rounds + 1)}
    rng = np.random.default_rng(1)
    cfg = config(rounds, plateau_rule="guarded", plateau_alpha=0.05)
    assert all(selected_round(cfg, truth, std, rng) == rounds for _ in range(200))


def test_guarded_margin_is_the_union_bound_over_the_runs_checks() -> None:
    from scipy.stats import norm

    cfg = config(9, plateau_rule="guarded", plateau_alpha=0.05, plateau_every=2, plateau_start=3)
    assert [r for r in range(1, 10) if plateau_round(cfg, r)] == [3, 5, 7, 9] and plateau_checks(cfg) == 4
    task = GradientTask(cfg, np.zeros(8, np.float32), evaluate=None)
    step = ScriptedRelease({3: 0.7, 5: 0.7}, 0.02, np.random.default_rng(2))
    logs = []
    for rnd in (3, 5):
        log = RoundLog(rnd, "gradient", 0, {}, {}, 0, cfg.noise_std, 0.0, 0.0)
        ctx = RoundContext(rnd, log, Counter(), step, RunWriter(""))
        task.aggregate(Released(RoundReplies(), Counter(), None, 0.0), ctx)
        logs.append(log)
    first, second = task.checks
    # The first check is the baseline; a later one must beat it by the one-sided bound on the difference of
    # two checks' noises, all four checks together w.p. >= 0.95: m = sqrt(s^2 + s^2) z(0.05 / 4).
    assert first["margin"] == 0.0
    assert second["margin"] == pytest.approx(0.02 * 2**0.5 * norm.isf(0.05 / 4), rel=1e-12)
    assert first["round"] == 3 and logs[0].metrics["train_accuracy_private"] == first["train_accuracy_private"]


class ZeroReplies:
    """A transport whose every node answers a zero row (central trust)."""

    def send(self, kind: str, payloads: dict[int, Any], *, timeout: float) -> RoundReplies:
        out = RoundReplies()
        for node, (config, _) in payloads.items():
            reply = wire.ContributionReply(config["request_id"], "ok", "central", 0.0, np.zeros(1, np.float64))
            out.replies[node] = reply.encode()
        return out


def test_central_noise_is_the_requests_own_not_the_runs() -> None:
    # Review finding (issue 24): a check sent at sigma_s was charged (v / sigma_s)^2 by every client but
    # released with the run's sigma; the release must add the noise the request names.
    cfg = config(4, trust="central", noise_std=1.0)
    step = PlainRelease(ZeroReplies(), cfg, [0, 1, 2], np.random.default_rng(3))
    build = partial(indicator_request, cfg, "plateau", 1, Query("correct"), noise_std=4.0, l2_clip=1.0)
    draws = [step.release(Ask(1, "plateau", wire.INDICATOR, build, 1)) for _ in range(4000)]
    assert {d.noise_var for d in draws} == {16.0}
    assert np.std([d.total[0] for d in draws if d.total is not None]) == pytest.approx(4.0, rel=0.05)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"plateau_rule": "median"}, "plateau_rule: expected one of ('best', 'guarded'), got 'median'"),
        ({"plateau_alpha": 1.0}, "plateau_alpha: expected a number in (0, 1), got 1.0"),
        ({"plateau_noise_std": float("nan")}, "plateau_noise_std: expected a finite number >= 0"),
        ({"plateau_noise_std": -1.0}, "plateau_noise_std: expected a finite number >= 0"),
        ({"plateau_noise_std": 1e-310}, "plateau_noise_std: expected a finite number >= 0"),
        ({"task": "indicator"}, "plateau_every: the plateau test asks the training accuracy"),
    ],
)
def test_bad_selection_settings_are_refused_by_name(over: dict[str, Any], message: str) -> None:
    from coordinator.config import CoordinatorConfigError

    with pytest.raises(CoordinatorConfigError) as err:
        config(4, **over)
    assert message in str(err.value)


# --- review findings (issue 24) ------------------------------------------------------------------


def test_a_records_accuracy_check_depends_on_that_record_alone() -> None:
    # The 'correct' query runs the owner's model; batched, BatchRescale divides every record by the
    # batch's largest feature, so one record could flip the others' answers while being charged only
    # for its own. Through the agent's query path each record's forward runs alone.
    from dataclasses import replace as dc_replace

    import torch

    from client_agent.workloads import indicator_rows
    from tests.factories import indicator_request as make_request
    from tests.isolation_workloads import CLASSES, FEATURES, RESCALE
    from workloads.builtin import BUILTIN
    from workloads.models import flatten_parameters

    workload = dc_replace(RESCALE, queries={"correct": BUILTIN.query("correct")})
    args = json.dumps({"threshold": 100.0})
    model = workload.build_model("rescale", seed=0, threshold=100.0)
    with torch.no_grad():  # class 0 exactly when tanh(x0 / scale) > 0.1, else class 1
        for p in model.parameters():
            p.zero_()
        model.body[0].weight[0, 0] = 1.0
        model.body[2].weight[0, 0] = 1.0
        model.body[2].bias[0] = -0.1
    params = flatten_parameters(model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, 40)
    request = make_request("q", predicate="correct", model="rescale", model_args=args, parameters=params)
    before = indicator_rows(request, x, y, unit="record", workload=workload)
    loud = x.copy()
    loud[7] *= 1e4  # one record far above the threshold: batched, it would rescale every other record
    after = indicator_rows(request, loud, y, unit="record", workload=workload)
    others = np.arange(40) != 7
    np.testing.assert_array_equal(before[others], after[others])
    # The same model run on the whole batch does move other records' answers (the attack is real).
    with torch.no_grad():
        batched = model(torch.from_numpy(x)).argmax(1).numpy() == y
        moved = model(torch.from_numpy(loud)).argmax(1).numpy() == y
    assert np.any(batched[others] != moved[others])


def test_a_records_accuracy_check_refuses_what_the_gradient_engine_refuses_and_nulls_invalid_records() -> None:
    import torch

    from client_agent.workloads import indicator_rows
    from tests.factories import MODEL_ARGS, N_PARAMS
    from tests.factories import indicator_request as make_request
    from workloads.builtin import BUILTIN

    params = np.zeros(N_PARAMS, np.float32)
    params[0] = -1.0  # predicts class 1 exactly when x0 > 0
    x = np.array([[1.0, 0, 0], [-1.0, 0, 0], [np.nan, 0, 0], [-2.0, 0, 0]], np.float32)
    y = np.array([1, 0, 0, 0])
    request = make_request("q", predicate="correct", model="logreg", model_args=MODEL_ARGS, parameters=params)
    rows = indicator_rows(request, x, y, unit="record", workload=BUILTIN)
    # A NaN record used to count as correct when its label was 0 (argmax of NaN logits is 0): now the null element.
    np.testing.assert_array_equal(rows[:, 0], [1.0, 1.0, 0.0, 1.0])
    client = indicator_rows(dc_replace_reduce(request), x, y, unit="client", workload=BUILTIN)
    np.testing.assert_allclose(client, [[0.75]])  # 3 of 4 records, the invalid one counted as 0
    with pytest.raises(ValueError, match="BatchNorm"):
        from dataclasses import replace as dc_replace

        bn = dc_replace(
            BUILTIN, models={"bn": lambda: torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))}
        )
        bn_params = np.zeros(3 + 3 + 6 + 2, np.float32)
        bn_request = make_request("b", predicate="correct", model="bn", model_args="{}", parameters=bn_params)
        indicator_rows(bn_request, x[:2], y[:2], unit="record", workload=bn)


def dc_replace_reduce(request: Any) -> Any:
    from dataclasses import replace as dc_replace

    return dc_replace(request, unit="client", reduce="mean")


def test_round_and_check_costs_fit_the_agents_cap_to_the_last_ulp() -> None:
    # request_share sized the cap as (C/sigma)^2 / T * T, an ulp under (C/sigma)^2 for 5% of plans whose
    # rounds cost more than T/4: every round refused. The quickstart's check (clip 1, sigma / C) likewise.
    from protocol.filters import GaussianFilter
    from simulations.federation import request_share
    from simulations.presets.quickstart import check_noise_std

    refused = plans = 0
    for eps in (1.0, 3.0):
        threshold = GaussianFilter.create("gdp", epsilon=eps, delta=1e-5).threshold
        for s10 in range(5, 120, 3):
            for c100 in range(5, 300, 7):
                sigma, clip = s10 / 10, c100 / 100
                cost = (clip / sigma) ** 2
                if not 0.25 * threshold < cost <= threshold:
                    continue
                plans += 1
                cap = request_share("gdp", epsilon=eps, delta=1e-5, noise_std=sigma, clip=clip) * threshold
                refused += not cost <= cap
                refused += not (1.0 / check_noise_std(sigma, clip)) ** 2 <= cap
    assert plans > 200 and refused == 0


@pytest.mark.parametrize("kind", ["gdp", "zcdp", "renyi"])
def test_the_first_check_is_answered_in_full_under_the_agents_filter(kind: str) -> None:
    # The guarded rule's first check must see every unit's whole fraction: at the worst-case stop every
    # unit has spent at most H full-norm rounds, and its partial clip for the check must still be 1.
    from protocol.filters import FilterState, GaussianFilter, partial_clip
    from simulations.presets.quickstart import selection_plan

    for sigma, clip in ((8.0, 1.0), (6.6, 1.15), (3.0, 0.5)):
        keys, horizon, _ = selection_plan(1.0, 1e-5, sigma, clip, 0.0, kind)
        if not keys:
            continue
        filt = GaussianFilter.create(kind, epsilon=1.0, delta=1e-5)
        state = FilterState(spent=np.array([horizon * (clip / sigma) ** 2]), stopped=np.array([False]))
        bound = partial_clip(filt, state, noise_std=keys["plateau_noise_std"], l2_clip=1.0)
        assert bound[0] == 1.0


def test_fz_checks_land_on_the_rounds_the_test_set_is_evaluated() -> None:
    from simulations.reproductions.fz_sec51 import SELECT_EVERY, cell, selection_keys

    c = cell(0.3, "tuned", "renyi")
    for gd_steps in (40, 17, 10, 100):
        keys = selection_keys(c, gd_steps + 1)
        cfg = config(200, **keys)
        checks = [r for r in range(1, 201) if plateau_round(cfg, r)]
        assert checks[0] > gd_steps and all(r % SELECT_EVERY == 0 for r in checks)
        assert keys["plateau_noise_std"] == c.noise_std


def run_checks(cfg: CoordinatorConfig, truth: dict[int, float], incomplete: set[int]) -> GradientTask:
    task = GradientTask(cfg, np.zeros(8, np.float32), evaluate=None)

    class Refused(ScriptedRelease):
        def release(self, ask: Ask) -> Released:
            out = super().release(ask)
            if ask.rnd in incomplete:
                out.errors["policy"] += 1
                out.complete = False
            return out

    step = Refused(truth, 0.001, np.random.default_rng(4))
    for rnd in sorted(truth):
        log = RoundLog(rnd, "gradient", 0, {}, {}, 0, cfg.noise_std, 0.0, 0.0)
        ctx = RoundContext(rnd, log, Counter(), step, RunWriter(""))
        task.aggregate(Released(RoundReplies(), Counter(), None, 0.0), ctx)
    return task


def test_a_check_some_client_did_not_answer_is_logged_but_never_selected() -> None:
    # A later incomplete check (it sums fewer units than n) is never selected on, however high it reads.
    cfg = config(3, plateau_rule="guarded")
    task = run_checks(cfg, {1: 0.5, 2: 0.9, 3: 0.7}, incomplete={2})
    assert [c["complete"] for c in task.checks] == [True, False, True]
    assert task.selected is not None and task.selected[0] == 3
    # An incomplete first check leaves no sound baseline: its model (the worst-case stop's) is returned.
    task = run_checks(cfg, {1: 0.9, 2: 0.5, 3: 0.99}, incomplete={1})
    assert task.selected is not None and task.selected[0] == 1 and task.plateau_stale == 2


# --- second review (issue 24): the query path has the gradient engine's protections -------------


def test_a_stopped_records_value_never_reaches_the_model_nor_refuses_the_check(tmp_path: Any) -> None:
    # Every record exhausted, then 'correct' asked with a category table of 5, 8, 7 entries: record 3 holds
    # category 7. Before the fix its data still reached the model, and an id outside the table refused the
    # request uncharged ("is the stopped record's category >= k?", asked for free, again and again).
    from tests.factories import build_agent
    from tests.factories import indicator_request as make_request
    from tests.isolation_workloads import CLASSES, TOKEN_QUERIES, TOKENS
    from workloads.models import flatten_parameters

    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, size=(12, TOKENS)).astype(np.int64)
    y = rng.integers(0, CLASSES, 12)
    x[3, 0] = 7
    agent = build_agent(tmp_path, (x, y), workload="tests.isolation_workloads:TOKEN_QUERIES")
    try:
        for i in range(4):  # sigma 0.3 on a 0/1 value costs 11 >> the threshold: every record stops
            burn = make_request(f"burn{i}", predicate="threshold", column=1, value=-1.0, noise_std=0.3, round=1 + i)
            assert not agent.handle(wire.INDICATOR, *wire.encode_request(burn)).is_error
        assert bool(np.all(agent.ledger.state()["stopped"]))
        for k, categories in enumerate((5, 8, 7)):
            model = TOKEN_QUERIES.build_model("two_tables", seed=0, categories=categories)
            ask = make_request(
                f"q{k}",
                predicate="correct",
                model="two_tables",
                round=10 + k,
                model_args=json.dumps({"categories": categories}),
                parameters=flatten_parameters(model),
            )
            outcome = agent.handle(wire.INDICATOR, *wire.encode_request(ask))
            assert not outcome.is_error, (categories, outcome.error_code)
    finally:
        agent.close()


def test_an_id_outside_a_table_nulls_its_record_in_a_check_in_both_unit_kinds() -> None:
    from dataclasses import replace as dc_replace

    from client_agent.workloads import indicator_rows
    from tests.factories import indicator_request as make_request
    from tests.isolation_workloads import CLASSES, TOKEN_QUERIES, TOKENS
    from workloads.models import flatten_parameters

    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, size=(10, TOKENS)).astype(np.int64)
    y = rng.integers(0, CLASSES, 10)
    x[3, 0] = 7  # beyond a table of 5 categories
    args = json.dumps({"categories": 5})
    params = flatten_parameters(TOKEN_QUERIES.build_model("two_tables", seed=0, categories=5))
    request = make_request("q", predicate="correct", model="two_tables", model_args=args, parameters=params)
    rows = indicator_rows(request, x, y, unit="record", workload=TOKEN_QUERIES)
    assert rows[3, 0] == 0.0  # the null element, not an error
    mean = dc_replace(request, unit="client", reduce="mean")
    client = indicator_rows(mean, x, y, unit="client", workload=TOKEN_QUERIES)
    assert client[0, 0] == pytest.approx(float(np.delete(rows[:, 0], 3).sum()) / 10)


def test_nothing_a_forward_keeps_on_its_module_carries_one_block_into_the_next() -> None:
    # A forward that keeps a running maximum (a tensor) on its module: under one vmap per 4,096-record block
    # it re-bound as block 1's value in block 2 and moved block-2 answers. Each call now runs on a fresh copy.
    from dataclasses import replace as dc_replace

    import torch
    from torch import nn

    from client_agent.streaming import ArraySource
    from client_agent.workloads import indicator_rows
    from tests.factories import indicator_request as make_request
    from tests.isolation_workloads import CLASSES, CONTROLS, FEATURES
    from workloads.builtin import BUILTIN
    from workloads.models import flatten_parameters

    class TensorRunningMax(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, CLASSES))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            peak = self.__dict__.get("peak")
            peak = x.abs().amax() if peak is None else torch.maximum(peak, x.abs().amax())
            self.__dict__["peak"] = peak
            return self.body(x / peak)

    workload = dc_replace(CONTROLS, models={"trm": TensorRunningMax}, queries={"correct": BUILTIN.query("correct")})
    params = flatten_parameters(workload.build_model("trm", seed=0))
    rng = np.random.default_rng(0)
    n = 2 * 4096
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, n)
    request = make_request("q", predicate="correct", model="trm", model_args="{}", parameters=params)
    before = indicator_rows(request, ArraySource(x, y), unit="record", workload=workload)[:, 0]
    loud = x.copy()
    loud[17] *= 1000.0  # one record of block 1
    after = indicator_rows(request, ArraySource(loud, y), unit="record", workload=workload)[:, 0]
    np.testing.assert_array_equal(np.delete(before, 17), np.delete(after, 17))
