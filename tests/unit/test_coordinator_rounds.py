"""The coordinator's round logic against a scripted transport: divisor, robustness, what it logs, enrolment."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from coordinator.enrolment import EnrolmentError
from coordinator.rounds import noise_rng, run
from coordinator.transport import Payload, RoundReplies
from protocol import messages as wire
from tests.factories import gradient_run, status
from workloads.models import build_model, flatten_parameters

NODES = [987_654_321, 987_654_322, 987_654_323]


class Scripted:
    """Answers status from ``statuses`` and gradient requests from ``totals`` (per node; None = an error reply)."""

    def __init__(self, statuses: Mapping[int, str], totals: Mapping[int, np.ndarray | str | None], trust: str):
        self.statuses, self.totals, self.trust = statuses, totals, trust
        self.sent: list[tuple[str, dict[int, Payload]]] = []

    def node_ids(self, count: int, *, timeout: float) -> list[int]:
        return sorted(self.statuses)[:count]

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        self.sent.append((message_type, dict(payloads)))
        out = RoundReplies()
        for node, (config, _) in payloads.items():
            if message_type == wire.STATUS:
                out.replies[node] = wire.StatusReply(config["request_id"], self.statuses[node]).encode()
                continue
            total = self.totals.get(node, "missing")
            if isinstance(total, str) and total == "missing":
                continue  # no reply at all
            if total is None:
                out.error("policy", "noise_std 0.1 asked; the policy requires noise_std >= 1.0")
            elif isinstance(total, str):
                empty = np.zeros(0, wire.reply_dtype(self.trust))
                reply = wire.ContributionReply(config["request_id"], wire.REPLY_EXHAUSTED, self.trust, 0.0, empty)
                out.replies[node] = reply.encode()
            else:
                noise = 1.0 if self.trust == "local" else 0.0
                total = total.astype(wire.reply_dtype(self.trust))
                reply = wire.ContributionReply(config["request_id"], wire.REPLY_OK, self.trust, noise, total)
                out.replies[node] = reply.encode()
        if message_type != wire.STATUS:
            out.missing = sum(1 for n in payloads if n not in self.totals)
        return out


def config(**over: Any) -> CoordinatorConfig:
    return gradient_run(**(dict(num_nodes=3, n_public=15, learning_rate=0.5, noise_seed=11) | over))


def test_step_divides_by_public_n_whoever_answered(tmp_path: Path) -> None:
    # One client active, one exhausted (central trust may say so), one refused: the divisor stays n = 15.
    d = 8  # logreg 3 -> 2
    active = np.arange(d, dtype=np.float32)
    scripted = Scripted(
        {n: status(trust="central") for n in NODES},
        {NODES[0]: active, NODES[1]: "exhausted", NODES[2]: None},
        "central",
    )
    cfg = config()
    summary = run(scripted, cfg)
    params0 = flatten_parameters(build_model("logreg", seed=0, in_features=3, n_classes=2)).astype(np.float32)
    noise = noise_rng(cfg).normal(0.0, cfg.noise_std, d)  # the same stream the run drew from
    expected = (params0 - 0.5 * (active.astype(np.float64) + noise) / 15).astype(np.float32)
    np.testing.assert_allclose(summary["parameters"], expected, rtol=1e-6)
    rnd = summary["rounds"][0]
    assert rnd["errors"] == {"policy": 1} and rnd["replies"] == 2
    assert rnd["errors_by_code"] == {"policy": 1}


def test_missing_replies_do_not_stop_the_round() -> None:
    scripted = Scripted({n: status(trust="local") for n in NODES}, {NODES[0]: np.ones(8, np.float32)}, "local")
    summary = run(scripted, config(trust="local", rounds=3))
    assert summary["rounds_completed"] == 3 and summary["stopped_because"] == "max_rounds"
    assert [r["missing"] for r in summary["rounds"]] == [2, 2, 2]
    assert summary["rounds"][0]["release_noise_std"] == pytest.approx(1.0)  # one client's noise reached the sum


def test_local_trust_logs_hold_no_node_ids_or_per_client_values(tmp_path: Path) -> None:
    marker = np.float32(12345.5)
    totals = {n: np.full(8, marker * (i + 1), np.float32) for i, n in enumerate(NODES)}
    scripted = Scripted({n: status(trust="local") for n in NODES}, totals, "local")
    run(scripted, config(trust="local", rounds=2, output_dir=str(tmp_path / "out")))
    written = (tmp_path / "out" / "rounds.jsonl").read_text() + (tmp_path / "out" / "summary.json").read_text()
    for node in NODES:
        assert str(node) not in written
    for i in range(len(NODES)):
        assert f"{float(marker) * (i + 1)}" not in written
    lines = [json.loads(line) for line in (tmp_path / "out" / "rounds.jsonl").read_text().splitlines()]
    assert set(lines[0]) == {
        "round",
        "task",
        "replies",
        "errors",
        "errors_by_code",
        "missing",
        "noise_std",
        "release_noise_std",
        "duration_s",
        "monitor",
        "secagg",
        "metrics",
        "query",
        "answer",
        "bound",
    }
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for key in ("epsilon", "delta", "filter", "unit", "trust", "monitor_reserved"):
        assert key in summary["privacy"]
    assert {"rounds_completed", "stopped_because", "final_metrics"} <= set(summary)


@pytest.mark.parametrize(
    ("cfg_over", "monitor", "message"),
    [
        (
            {"monitor": "svt", "monitor_epsilon": 0.5, "monitor_threshold": 3},
            {"kind": "none"},
            "monitor 'svt' asked; the client reserved 'none'",
        ),
        (
            {"monitor": "svt", "monitor_epsilon": 0.5, "monitor_threshold": 3},
            {"kind": "svt", "epsilon_svt": 0.25},
            "svt epsilon 0.5 asked; the client reserved 0.25",
        ),
    ],
)
def test_enrolment_refuses_an_unreserved_monitor(
    cfg_over: dict[str, Any], monitor: dict[str, Any], message: str
) -> None:
    scripted = Scripted({n: status(trust="central", monitor=monitor) for n in NODES}, {}, "central")
    with pytest.raises(EnrolmentError, match=message):
        run(scripted, config(**cfg_over))
    assert [kind for kind, _ in scripted.sent] == [wire.STATUS]  # nothing was asked of the clients


def test_enrolment_refuses_a_short_tree_and_a_trust_mismatch() -> None:
    tree = {"kind": "tree", "noise_std": 4.0, "max_rounds": 8, "levels": 4, "squared_cost": 0.25}
    scripted = Scripted({n: status(trust="local", monitor=tree) for n in NODES}, {}, "local")
    with pytest.raises(EnrolmentError, match="16 monitor rounds asked; the client's tree covers 8"):
        run(scripted, config(trust="local", rounds=16, monitor="tree", monitor_threshold=2))
    scripted = Scripted({n: status(trust="local") for n in NODES}, {}, "local")
    with pytest.raises(EnrolmentError, match="trust 'central' asked; a client's ledger is fixed to 'local'"):
        run(scripted, config())


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"monitor": "svt", "monitor_epsilon": 1.0, "monitor_threshold": 3, "trust": "local"},
            "monitor: 'svt' runs on exact counts and needs trust 'central'",
        ),
        ({"monitor": "tree", "monitor_threshold": 3}, "monitor: 'tree' is the local-trust monitor"),
        ({"monitor": "svt", "monitor_threshold": 3}, "monitor_epsilon: expected a finite number > 0 with svt, got 0.0"),
        ({"monitor": "svt", "monitor_epsilon": 1.0}, "monitor_threshold: expected an integer >= 1"),
        ({"task": "count"}, "task: expected one of"),
        ({"accuracy_beta": 1.5}, r"accuracy_beta: expected a number in \(0, 1\)"),
        ({"checkpoint_every": 2}, "checkpoint_every: checkpoints need output_dir"),
    ],
)
def test_bad_coordinator_config(over: dict[str, Any], message: str) -> None:
    with pytest.raises(CoordinatorConfigError, match=message):
        config(**over)


def test_enrolment_refuses_a_public_n_the_clients_do_not_hold() -> None:
    scripted = Scripted({n: status(trust="central") for n in NODES}, {}, "central")
    with pytest.raises(EnrolmentError, match="the run divides by 20 enrolled units; the 3 enrolled clients hold 15"):
        run(scripted, config(n_public=20))


class PartialMonitor(Scripted):
    """Answers monitor requests with exact counts, except one node that errors on ``bad_round``."""

    def __init__(self, bad_round: int) -> None:
        svt = {"kind": "svt", "epsilon_svt": 1.0}
        super().__init__({n: status(trust="central", monitor=svt) for n in NODES}, {}, "central")
        self.bad_round = bad_round

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        if message_type != wire.MONITOR:
            return super().send(message_type, payloads, timeout=timeout)
        out = RoundReplies()
        for node, (config, _) in payloads.items():
            if config["round"] == self.bad_round and node == NODES[0]:
                out.error("policy", "monitor round refused")
                continue
            reply = wire.ContributionReply(
                config["request_id"], wire.REPLY_OK, "central", 0.0, np.array([500.0], np.float64)
            )
            out.replies[node] = reply.encode()
        return out


def test_svt_skips_a_round_with_missing_counts() -> None:
    # 1,500 units active throughout, threshold 1,200: 300 above it, so (Laplace scale 2) the SVT says
    # "above"; a round where one client's count is missing would read as 1,000, far below.
    scripted = PartialMonitor(bad_round=2)
    summary = run(
        scripted, config(rounds=4, monitor="svt", monitor_epsilon=1.0, monitor_threshold=1200, task="indicator")
    )
    assert summary["stopped_because"] == "max_rounds" and summary["rounds_completed"] == 4
    assert summary["rounds"][1]["errors"]["monitor-skipped-partial"] == 1


def test_malformed_status_replies_exclude_the_client_with_a_clear_error() -> None:
    # A status whose ledger lacks a field, or has a non-number, is not enrolled; with none left, the run says why.
    broken = json.dumps({"ledger": {"epsilon": "three"}, "policy": {}})
    scripted = Scripted({n: broken for n in NODES}, {}, "central")
    with pytest.raises(EnrolmentError, match=r"no client enrolled: \{'malformed-status': 3\}"):
        run(scripted, config())


def _past_float(raw: dict[str, Any], where: str) -> str:
    if where == "epsilon":
        raw["ledger"]["epsilon"] = 10**400  # JSON reads integers of any length; float() of this one overflows
    elif where == "monitor":
        raw["ledger"]["params"]["monitor"] = {"kind": "svt", "epsilon_svt": -(10**400)}
    elif where == "workload":
        raw["workload"] = {"name": "w", "models": [], "queries": {"q": {"dim": 1, "l2_bound": 10**400}}}
    text = json.dumps(raw)
    if where == "digits":  # json.loads refuses an integer of over 4,300 digits with a plain ValueError
        text = text[:-1] + ', "x": 1' + "0" * 5000 + "}"
    elif where == "nesting":  # and nesting this deep with RecursionError
        text = text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    return text


@pytest.mark.parametrize("where", ["epsilon", "monitor", "workload", "digits", "nesting"])
def test_a_status_json_cannot_parse_as_floats_leaves_out_that_client_only(where: str) -> None:
    # One client's status used to abort the whole enrolment (OverflowError, ValueError, RecursionError)
    statuses = {n: status(trust="central") for n in NODES}
    statuses[NODES[0]] = _past_float(json.loads(statuses[NODES[0]]), where)
    scripted = Scripted(statuses, {n: np.ones(8, np.float32) for n in NODES}, "central")
    summary = run(scripted, config(n_public=10))
    assert summary["clients_excluded"] == {"malformed-status": 1}
    assert summary["privacy"]["clients_enrolled"] == 2


def test_out_of_range_reply_leaves_the_model_and_is_counted(tmp_path: Path) -> None:
    # A reply at float32's edge would overflow the step to inf; the model stays and the round says why.
    huge = np.full(8, np.finfo(np.float32).max, dtype=np.float32)
    scripted = Scripted({n: status(trust="local") for n in NODES}, {n: huge for n in NODES}, "local")
    summary = run(scripted, config(trust="local", learning_rate=1e6, output_dir=str(tmp_path)))
    params0 = flatten_parameters(build_model("logreg", seed=0, in_features=3, n_classes=2)).astype(np.float32)
    np.testing.assert_array_equal(summary["parameters"], params0)
    assert summary["rounds"][0]["errors"] == {"non-finite-step": 1}
    assert json.loads((tmp_path / "rounds.jsonl").read_text())["errors"] == {"non-finite-step": 1}


def test_client_whose_budget_is_empty_after_its_reservation_is_refused_at_enrolment(tmp_path: Path) -> None:
    # One client reserved a tree costing more than its small budget leaves: a clear refusal, no output files.
    tree = {"kind": "tree", "noise_std": 1.0, "max_rounds": 4, "squared_cost": 3.0, "levels": 3}
    statuses = {n: status(trust="local", monitor=tree) for n in NODES}
    scripted = Scripted(statuses, {}, "local")
    cfg = config(trust="local", monitor="tree", monitor_threshold=1, rounds=4, output_dir=str(tmp_path / "out"))
    with pytest.raises(EnrolmentError, match="leaves nothing after its monitor reservation"):
        run(scripted, cfg)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("monitor", "policy"),
    [
        ({"kind": "tree", "noise_std": 0.0, "max_rounds": 4, "squared_cost": 3.0, "levels": 3}, {}),
        ({"kind": "none"}, {"min_secagg_clients": 1.5}),
    ],
)
def test_status_with_a_zero_noise_tree_or_a_bad_secagg_floor_is_malformed(
    monitor: dict[str, Any], policy: dict[str, Any]
) -> None:
    # privacy.md §3: a noise parameter <= 0 is an error, not a default; a floor that is not an integer is not read as 2.
    raw = json.loads(status(trust="local", monitor=monitor)) | {"policy": policy}
    scripted = Scripted({n: json.dumps(raw) for n in NODES}, {}, "local")
    cfg = config(trust="local", monitor=monitor["kind"], monitor_threshold=1 if monitor["kind"] == "tree" else 0)
    with pytest.raises(EnrolmentError, match=r"no client enrolled: \{'malformed-status': 3\}"):
        run(scripted, cfg)


def test_model_args_the_model_does_not_take_fail_before_any_client_is_asked(tmp_path: Path) -> None:
    scripted = Scripted({n: status(trust="central") for n in NODES}, {}, "central")
    with pytest.raises(ValueError, match=r"model 'logreg': expected parameters \['in_features', 'n_classes'\]"):
        run(scripted, config(model_args=json.dumps({"no_such_arg": 1}), output_dir=str(tmp_path / "out")))
    assert scripted.sent == [] and not (tmp_path / "out").exists()


SECRET = "SECRET-PATH /home/x/data.npz sha256=abc"


class Leaky(Scripted):
    """``refused`` answer every request of the types in ``kinds`` with a ledger error whose reason holds SECRET."""

    def __init__(self, refused: list[int], kinds: set[str], **kw: Any) -> None:
        super().__init__(**kw)
        self.refused, self.kinds = refused, kinds

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        if message_type not in self.kinds:
            return super().send(message_type, payloads, timeout=timeout)
        out = super().send(message_type, {n: p for n, p in payloads.items() if n not in self.refused}, timeout=timeout)
        for _ in set(self.refused) & set(payloads):
            out.error(wire.error_name(wire.ERR_LEDGER), SECRET)
        return out


def assert_no_secret(text: str) -> None:
    for part in (SECRET, "SECRET", "/home/x/data.npz", "sha256=abc"):
        assert part not in text


def test_a_client_error_text_is_never_logged_only_its_code_is_counted(tmp_path: Path) -> None:
    # A client's error reason can carry data-dependent detail (a path, a hash): rounds.jsonl keeps counts by code.
    statuses = {n: status(trust="local") for n in NODES}
    totals = {n: np.ones(8, np.float32) for n in NODES}
    leaky = Leaky([NODES[2]], {wire.GRADIENT}, statuses=statuses, totals=totals, trust="local")
    summary = run(leaky, config(trust="local", rounds=2, output_dir=str(tmp_path / "out")))
    rounds_text = (tmp_path / "out" / "rounds.jsonl").read_text()
    assert_no_secret(rounds_text + (tmp_path / "out" / "summary.json").read_text() + repr(summary))
    lines = [json.loads(line) for line in rounds_text.splitlines()]
    assert [r["errors_by_code"] for r in lines] == [{"ledger": 1}, {"ledger": 1}]
    assert [r["errors"] for r in lines] == [{"ledger": 1}, {"ledger": 1}]
    assert summary["errors_total"] == {"ledger": 2}


def test_enrolment_error_counts_refusals_by_code_without_their_text() -> None:
    statuses = {n: status(trust="central") for n in NODES}
    leaky = Leaky(NODES[1:], {wire.STATUS}, statuses=statuses, totals={}, trust="central")
    leaky.statuses[NODES[0]] = json.dumps({"ledger": {"epsilon": "three"}, "policy": {}})
    with pytest.raises(EnrolmentError) as refused:
        run(leaky, config())
    assert str(refused.value) == "no client enrolled: {'ledger': 2, 'malformed-status': 1}"
    assert_no_secret(str(refused.value))


def test_a_realisation_filter_over_records_is_not_enrolled(tmp_path: Path) -> None:
    # privacy.md §6: a client's records share one noise draw, so the realisation filter is not private per record.
    statuses = {n: status(trust="local") for n in NODES[:2]} | {NODES[2]: status(trust="local", filter="realisation")}
    scripted = Scripted(statuses, {n: np.ones(8, np.float32) for n in NODES}, "local")
    summary = run(scripted, config(trust="local", n_public=10, output_dir=str(tmp_path / "out")))
    assert summary["clients_excluded"] == {"realisation-record": 1}
    assert summary["privacy"]["clients_enrolled"] == 2 and summary["privacy"]["filter"] == "gdp"
    assert all(NODES[2] not in payloads for kind, payloads in scripted.sent if kind != wire.STATUS)
    everyone = Scripted({n: status(trust="local", filter="realisation") for n in NODES}, {}, "local")
    with pytest.raises(EnrolmentError, match=r"no client enrolled: \{'realisation-record': 3\}"):
        run(everyone, config(trust="local"))
    assert [kind for kind, _ in everyone.sent] == [wire.STATUS]


def test_a_realisation_filter_over_clients_is_enrolled() -> None:
    statuses = {n: status(trust="local", unit="client", filter="realisation") for n in NODES}
    scripted = Scripted(statuses, {n: np.ones(8, np.float32) for n in NODES}, "local")
    cfg = config(trust="local", unit="client", n_public=15, noise_std=0.5)
    summary = run(scripted, cfg)
    assert summary["clients_excluded"] == {} and summary["privacy"]["filter"] == "realisation"


@pytest.mark.parametrize(
    "over",
    [{"trust": SECRET}, {"unit": SECRET}, {"params": {"monitor": {"kind": SECRET}}}],
    ids=["trust", "unit", "monitor"],
)
def test_a_status_with_free_text_where_a_closed_table_is_expected_is_malformed(over: dict[str, Any]) -> None:
    # A refusal quotes a client's trust, unit and monitor kind: each must come from the protocol's table.
    raw = json.loads(status(trust="central"))
    raw["ledger"] |= over
    scripted = Scripted({n: json.dumps(raw) for n in NODES}, {}, "central")
    with pytest.raises(EnrolmentError) as refused:
        run(scripted, config())
    assert str(refused.value) == "no client enrolled: {'malformed-status': 3}"
