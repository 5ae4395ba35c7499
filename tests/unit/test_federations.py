"""One budget per person (issue 23): several federations and workloads on one ledger, quotas, the per-request cap.

Everything runs through the agent's real release path (``Agent.handle``); the ledger is then read back
and replayed independently of the agent's own bookkeeping.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.agent import Agent
from client_agent.config import AgentConfigError, parse_agent_config
from client_agent.ledger import SCHEMA_VERSION, Ledger, LedgerError
from client_agent.ledger_report import verify_ledger
from client_agent.state import AgentState
from protocol import messages as wire
from protocol.filters import GaussianFilter
from tests.factories import client_data, gradient_request, indicator_request, node_config

QUOTAS = {"alpha": 0.5, "beta": 0.7}  # they add up to more than 1: the global filter bounds both together


def two_federations(tmp_path: Path, **over: Any) -> dict[str, Any]:
    cfg = node_config(tmp_path, client_data(20, seed=3), trust="central", **over)
    cfg["federations"] = {name: {"quota": quota} for name, quota in QUOTAS.items()}
    return cfg


def ask(agent: Agent, request: Any, federation: str) -> Any:
    return agent.handle(*_encoded(request), federation)


def _encoded(request: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    kind = wire.message_type_of(request)
    config, arrays = wire.encode_request(request)
    return kind, config, arrays


def test_two_coordinators_interleaving_adaptive_requests_stay_within_quotas_and_the_budget(tmp_path: Path) -> None:
    agent = Agent(parse_agent_config(two_federations(tmp_path), simulation=True))
    assert agent.gaussian is not None
    threshold = agent.gaussian.threshold
    rng = np.random.default_rng(11)
    rounds = {"alpha": 0, "beta": 0}
    params = {name: np.zeros(8, np.float32) for name in QUOTAS}
    exhausted_seen = {name: 0 for name in QUOTAS}
    for _ in range(400):
        fed = "alpha" if rng.random() < 0.5 else "beta"
        rounds[fed] += 1
        # Adaptive: each coordinator moves its model by what it received and picks its next noise.
        noise = float(rng.choice([1.0, 2.0, 4.0]))
        request = gradient_request(
            f"{fed}-{rounds[fed]}",
            run_id=f"run-{fed}",
            round=rounds[fed],
            noise_std=noise,
            trust="central",
            parameters=params[fed],
        )
        outcome = ask(agent, request, fed)
        assert not outcome.is_error, outcome.local_detail
        reply = wire.ContributionReply.decode(outcome.config, outcome.arrays)
        if reply.status == wire.REPLY_EXHAUSTED:
            exhausted_seen[fed] += 1
        else:
            params[fed] = (params[fed] - 0.5 * reply.total).astype(np.float32)
        state = AgentState.from_arrays(agent.ledger.state())
        assert state.spent is not None and np.all(state.spent <= threshold)  # never over the budget
        for name, quota in QUOTAS.items():
            own = own_quota(agent, name)
            assert own is not None and own.spent is not None
            assert np.all(own.spent <= quota * threshold)  # each federation within its quota
        if all(exhausted_seen.values()):
            break
    assert all(exhausted_seen.values()), "both federations should have used up what they may spend"
    # What each federation spent, replayed from the ledger's own records of what it released.
    spent_by: dict[str, np.ndarray] = {name: np.zeros(agent.n_units) for name in QUOTAS}
    for row, release in agent.ledger.log():
        if "l2_norms" in release:
            spent_by[str(row["federation"])] += (release["l2_norms"] / float(release["noise_std"][0])) ** 2
    state = AgentState.from_arrays(agent.ledger.state())
    assert state.spent is not None
    np.testing.assert_allclose(spent_by["alpha"] + spent_by["beta"], state.spent, rtol=1e-12, atol=0)
    for name, quota in QUOTAS.items():
        own = own_quota(agent, name)
        assert own is not None and own.spent is not None
        np.testing.assert_allclose(spent_by[name], own.spent, rtol=1e-12, atol=0)
        assert np.all(spent_by[name] <= quota * threshold)
    # Together they used the budget, not 1.2 budgets: a unit stops when the first of its limits is hit.
    assert state.spent.max() > 0.99 * threshold * 0.5 and np.all(state.spent <= threshold)
    assert ledger_federations(agent) == ["alpha", "beta"]
    path = agent.ledger.path
    agent.close()
    assert verify_ledger(path) == []  # the global filter's replay of every release gives the stored state


def ledger_federations(agent: Agent) -> list[str]:
    return agent.ledger.federations()


def own_quota(agent: Agent, federation: str) -> AgentState | None:
    """``federation``'s quota state as a request reads it: from the ledger's state, read once."""
    return agent.quota_state(federation, AgentState.from_arrays(agent.ledger.state()))


def test_a_first_request_never_overwrites_a_charge_another_process_made_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A federation's first request builds its quota from the ledger's log. Another process (a second actor
    answering 'alpha') charging while it does so must make this request's commit fail, never be overwritten:
    the quota once read the state a second time, which moved the handle's record of the state it had read
    past that charge, and this request's new state, computed from the older one, was written over it
    (found by a hostile review of the ledger-lock fix: 0.0719 spent fell to 0.0625)."""
    import subprocess
    import sys
    import textwrap

    other = textwrap.dedent(
        """
        import json, sys
        from client_agent.agent import Agent
        from client_agent.config import parse_agent_config
        from protocol import messages as wire
        from tests.factories import gradient_request
        agent = Agent(parse_agent_config(json.loads(sys.argv[1]), simulation=True))
        request = gradient_request("a2", trust="central", round=2, noise_std=4.0)
        assert not agent.handle(wire.message_type_of(request), *wire.encode_request(request), "alpha").is_error
        agent.close()
        """
    )
    cfg = two_federations(tmp_path)
    cfg["federations"] = {"alpha": {"quota": 1.0}, "beta": {"quota": 1.0}}  # a2 charges: alpha has room
    agent = Agent(parse_agent_config(cfg, simulation=True))
    assert not ask(agent, gradient_request("a1", trust="central", noise_std=4.0), "alpha").is_error
    path = agent.ledger.path
    after_a1 = agent.ledger.state()["spent"]
    replay = agent.ledger.charged_by

    def charged_by(federation: str) -> np.ndarray:  # the window: the other process commits during the replay
        root = Path(__file__).resolve().parents[2]
        subprocess.run([sys.executable, "-c", other, json.dumps(cfg)], check=True, cwd=root, timeout=120)
        return replay(federation)

    monkeypatch.setattr(agent.ledger, "charged_by", charged_by)
    outcome = ask(agent, gradient_request("b1", trust="central", run_id="run-b", noise_std=4.0), "beta")
    assert outcome.error_code == wire.ERR_LEDGER and "another process committed" in outcome.local_detail
    agent.close()
    with Ledger.open_existing(path) as ledger:
        assert ledger.requests_answered() == 2  # a1 and the other process's a2; b1 stored nothing
        assert np.all(ledger.state()["spent"] > after_a1)  # a2 charged every unit, and that charge stands
    assert verify_ledger(path) == []  # the stored spend is every release's charge, a2's included


def test_a_federation_draining_its_quota_leaves_the_other_its_share(tmp_path: Path) -> None:
    """The hostile coordinator of 'alpha' asks the largest requests its policy allows until its quota is spent;
    'beta' is still answered with every unit active, and what it may spend is the rest of the budget."""
    agent = Agent(parse_agent_config(two_federations(tmp_path), simulation=True))
    assert agent.gaussian is not None
    threshold = agent.gaussian.threshold
    for i in range(1, 30):
        outcome = ask(agent, gradient_request(f"a{i}", round=i, noise_std=0.5, trust="central"), "alpha")
        assert not outcome.is_error
    alpha = own_quota(agent, "alpha")
    assert alpha is not None and alpha.stopped is not None and alpha.spent is not None
    assert alpha.stopped.all() and np.all(alpha.spent <= 0.5 * threshold)
    last = ask(agent, gradient_request("a99", trust="central"), "alpha")
    reply = wire.ContributionReply.decode(last.config, last.arrays)
    assert reply.status == wire.REPLY_EXHAUSTED  # stopped for alpha, as any stop looks in central trust
    outcome = ask(agent, gradient_request("b1", noise_std=20.0, trust="central"), "beta")
    reply = wire.ContributionReply.decode(outcome.config, outcome.arrays)
    assert reply.status == wire.REPLY_OK and np.any(reply.total != 0)
    beta = own_quota(agent, "beta")
    assert beta is not None and beta.stopped is not None and not beta.stopped.any()
    # The same request id in the two federations is two requests: one coordinator cannot replay another's.
    again = ask(agent, gradient_request("a1", round=1, noise_std=4.0, trust="central"), "beta")
    assert not again.is_error
    agent.close()


def test_the_default_cap_refuses_a_drain_in_one_request_and_charges_nothing(tmp_path: Path) -> None:
    """The hostile request of the deployment walk-through (noise 1e-6, clip 1e6) spent 40 of 40 budgets at once;
    a default agent (a quarter of the budget per request) refuses it, and answers a request under the cap."""
    cfg = node_config(tmp_path)
    del cfg["policy-max-request-share"]  # the product's default
    agent = Agent(parse_agent_config(cfg, simulation=True))
    assert agent.config.policy.max_request_share == 0.25 and agent.gaussian is not None
    before = agent.ledger.state()["spent"].copy()
    outcome = ask(agent, gradient_request("drain", noise_std=1e-6, l2_clip=1e6), "default")
    assert outcome.error_code == wire.ERR_POLICY
    assert "policy-max-request-share = 0.25" in outcome.local_detail
    assert outcome.error_reason == wire.ERROR_TEXT[wire.ERR_POLICY]  # fixed text on the wire
    np.testing.assert_array_equal(agent.ledger.state()["spent"], before)
    assert agent.ledger.requests_answered() == 0
    # Exactly at the cap: answered, and no unit pays more than a quarter of its budget.
    sigma = 1.0 / np.sqrt(0.25 * agent.gaussian.threshold)
    outcome = ask(agent, gradient_request("at-cap", noise_std=float(sigma) * (1 + 1e-9)), "default")
    assert not outcome.is_error, outcome.local_detail
    assert agent.ledger.state()["spent"].max() <= 0.25 * agent.gaussian.threshold
    agent.close()


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5, float("nan")])
def test_a_request_share_outside_0_1_is_refused_at_start(tmp_path: Path, share: float) -> None:
    with pytest.raises(AgentConfigError, match=r"policy-max-request-share: expected a share of the budget in \(0, 1\]"):
        parse_agent_config(node_config(tmp_path, **{"policy-max-request-share": share}), simulation=True)


@pytest.mark.parametrize(
    ("federations", "message"),
    [
        ({"a": {"quota": 0.0}}, r"federations.a.quota: expected a share of every unit's budget in \(0, 1\]"),
        ({"a": {"quota": 1.5}}, r"federations.a.quota: expected a share"),
        ({"a b": {}}, "federations: expected a name of 1-64 letters"),
        ({"a": {"color": "red"}}, r"federations.a: unknown keys \['color'\]"),
        ({"a": {"monitor": True}, "b": {"monitor": True}}, "at most one federation may use it"),
        ({"a": {"socket": "/x/s"}, "b": {"socket": "/x/s"}}, "one socket per federation"),
    ],
)
def test_bad_federation_tables_are_refused_naming_what_was_expected(
    tmp_path: Path, federations: dict[str, Any], message: str
) -> None:
    with pytest.raises(AgentConfigError, match=message):
        parse_agent_config(node_config(tmp_path) | {"federations": federations}, simulation=True)


def test_an_unknown_federation_is_never_answered(tmp_path: Path) -> None:
    agent = Agent(parse_agent_config(two_federations(tmp_path), simulation=True))
    outcome = ask(agent, gradient_request("g", trust="central"), "gamma")
    assert outcome.is_error and "expected one of ['alpha', 'beta']" in outcome.local_detail
    assert agent.ledger.requests_answered() == 0
    agent.close()


def test_only_the_federation_holding_the_monitor_reservation_may_query_it(tmp_path: Path) -> None:
    cfg = two_federations(tmp_path, monitor="svt", **{"monitor-epsilon": 0.1})
    cfg["federations"]["alpha"]["monitor"] = True
    agent = Agent(parse_agent_config(cfg, simulation=True))
    monitor = wire.MonitorRequest("m1", "run", 1, trust="central")
    refused = ask(agent, monitor, "beta")
    assert refused.error_code == wire.ERR_POLICY and "for federation 'beta'" in refused.local_detail
    answered = ask(agent, monitor, "alpha")
    assert not answered.is_error
    agent.close()


def _tree_federations(tmp_path: Path, monitored: str) -> dict[str, Any]:
    cfg = node_config(
        tmp_path,
        client_data(4, seed=1),
        epsilon=8.0,
        monitor="tree",
        **{"monitor-noise-std": 5.0, "monitor-max-rounds": 64},
    )
    cfg["federations"] = {name: {"quota": quota, "monitor": name == monitored} for name, quota in QUOTAS.items()}
    return cfg


def test_the_monitor_reservation_stays_with_the_first_federation_that_used_it(tmp_path: Path) -> None:
    """A hostile review: with the monitor flag moved from one federation to another between runs, the second
    federation's view counted every unit's halt again, 10 tree nodes per unit against the 7 reserved (privacy.md
    §7, §11). The first monitor report's commit now claims the reservation for its federation, for good."""
    agent = Agent(parse_agent_config(_tree_federations(tmp_path, "alpha"), simulation=True))
    assert not ask(agent, gradient_request("g1", round=1), "alpha").is_error
    assert agent.ledger.monitor_owner() is None  # nothing claimed before a monitor report
    assert not ask(agent, wire.MonitorRequest("m1", "run", 1, trust="local"), "alpha").is_error
    assert agent.ledger.monitor_owner() == "alpha"
    agent = _reopen(agent, _tree_federations(tmp_path, "beta"))  # the owner moves the flag: accepted at start
    answered = agent.ledger.requests_answered()
    refused = ask(agent, wire.MonitorRequest("m2", "run", 2, trust="local"), "beta")
    assert refused.error_code == wire.ERR_POLICY and "was used by federation 'alpha'" in refused.local_detail
    assert agent.ledger.requests_answered() == answered  # nothing stored, nothing released
    # The ledger refuses it too, in the commit's own transaction (two processes racing for a first claim).
    state = agent.ledger.state()
    with pytest.raises(
        LedgerError,
        match="expected the monitor reservation free or held by federation 'beta', found it used by federation 'alpha'",
    ):
        agent.ledger.commit(
            request_id="|beta|m3",
            message_type=wire.MONITOR,
            run_id="run",
            digest="0" * 64,
            release={"round": np.array([3])},
            new_state=state,
            reply=b"",
            federation="beta",
            monitor_owner=True,
        )
    assert agent.ledger.requests_answered() == answered and agent.ledger.monitor_owner() == "alpha"
    agent = _reopen(agent, _tree_federations(tmp_path, "alpha"))  # back to its owner: answered
    assert not ask(agent, wire.MonitorRequest("m4", "run", 4, trust="local"), "alpha").is_error
    agent.close()


def _vm_steps(ledger: Ledger, call: Any) -> int:
    """SQLite virtual-machine instructions ``call`` runs on ``ledger``'s connection: work, not time."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    conn = ledger._connection()
    conn.set_progress_handler(count, 1)
    try:
        call()
    finally:
        conn.set_progress_handler(None, 1)
    return steps


def test_a_federations_policy_counts_and_log_do_not_read_another_federations_requests(tmp_path: Path) -> None:
    """A hostile review: the per-federation counts of every request's policy check (requests per run, per day)
    scanned the whole table, every stored reply of every federation, so one federation's reply took longer
    the more another had asked (0.02 ms with none, 62 ms with 1,000 of another's 200 KB replies; privacy.md
    §11). With the schema's (federation, ...) indexes they read the asking federation's entries only: the
    same SQLite work whatever another federation stored (instructions counted, not timed)."""
    from datetime import UTC, datetime, timedelta

    agent = Agent(parse_agent_config(two_federations(tmp_path), simulation=True))
    assert not ask(agent, gradient_request("a1", run_id="run-a", noise_std=50.0, trust="central"), "alpha").is_error
    # One of beta's first, so that both counts of alpha's end at one of beta's index entries.
    assert not ask(agent, gradient_request("b", run_id="run-a", noise_std=50.0, trust="central"), "beta").is_error
    ledger = agent.ledger
    day = datetime.now(UTC) - timedelta(days=1)
    reads = {
        "per run": lambda: ledger.requests_in_run("run-a", "alpha"),
        "per day": lambda: ledger.requests_since(day, "alpha"),
        "its own log": lambda: list(ledger.log(federation="alpha")),
    }
    before = {name: _vm_steps(ledger, read) for name, read in reads.items()}
    whole = _vm_steps(ledger, lambda: ledger.requests_since(day))  # every federation's: a scan, the control
    for i in range(40):
        request = gradient_request(f"b{i}", run_id="run-a", round=i + 1, noise_std=50.0, trust="central")
        assert not ask(agent, request, "beta").is_error
    after = {name: _vm_steps(ledger, read) for name, read in reads.items()}
    assert after == before
    assert _vm_steps(ledger, lambda: ledger.requests_since(day)) > whole + 40  # the measure sees a scan
    assert ledger.requests_in_run("run-a", "alpha") == 1 and ledger.requests_in_run("run-a", "beta") == 41
    agent.close()


def test_two_workloads_on_one_ledger_each_request_resolves_to_its_own(tmp_path: Path) -> None:
    from examples.gn_regression import workload as example

    extra = "examples.gn_regression.workload:WORKLOAD"
    agent = Agent(parse_agent_config(node_config(tmp_path, workloads=[extra]), simulation=True))
    assert [w.name for w in agent.workloads] == ["builtin", example.WORKLOAD.name]
    assert agent.workload_of(gradient_request()).name == "builtin"
    status = json.loads(ask(agent, wire.StatusRequest("s", "run", 0), "default").config["description"])
    assert [w["name"] for w in status["workloads"]] == ["builtin", example.WORKLOAD.name]
    # All charge the same filter: the builtin model's gradient, the builtin query, and the example
    # workload's model with its own loss, one ledger.
    assert not ask(agent, gradient_request("g1", noise_std=20.0), "default").is_error
    assert not ask(agent, indicator_request("q1", noise_std=20.0), "default").is_error
    spent = agent.ledger.state()["spent"].copy()
    regression = "workloads.regression:REGRESSION"
    agent = _reopen(agent, node_config(tmp_path, workloads=[extra, regression]))
    linreg = gradient_request(
        "g2", model="linreg", model_args=json.dumps({"in_features": 3}), parameters=np.zeros(4, np.float32)
    )
    outcome = ask(agent, linreg, "default")
    assert not outcome.is_error, outcome.local_detail
    assert agent.workload_of(linreg).name == "regression"
    assert np.all(agent.ledger.state()["spent"] >= spent) and np.any(agent.ledger.state()["spent"] > spent)
    assert agent.ledger.requests_answered() == 3
    agent.close()


def _reopen(agent: Agent, cfg: dict[str, Any]) -> Agent:
    agent.close()
    return Agent(parse_agent_config(cfg, simulation=True))


def test_a_name_registered_by_two_workloads_stops_the_agent(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match="expected each model name in one workload, found 'logreg' in both"):
        Agent(
            parse_agent_config(node_config(tmp_path, workloads=["tests.unit.test_federations:TWIN"]), simulation=True)
        )


def _twin() -> Any:
    import dataclasses

    from workloads.builtin import BUILTIN

    return dataclasses.replace(BUILTIN, name="twin", models={"logreg": BUILTIN.models["logreg"]}, queries={})


TWIN = _twin()


def test_one_secagg_key_in_two_federations_is_refused(tmp_path: Path) -> None:
    from simulations.federation import secagg_identities

    keys = secagg_identities(tmp_path / "ids", 2)[0]
    table = {"secagg-identity-key": keys["secagg-identity-key"], "secagg-peers": keys["secagg-peers"]}
    cfg = node_config(tmp_path, unit="client", trust="secagg") | {"federations": {"a": table, "b": dict(table)}}
    with pytest.raises(AgentConfigError, match="expected one key per federation"):
        Agent(parse_agent_config(cfg, simulation=True))


def test_a_version_1_ledger_is_migrated_in_place_keeping_every_spend(tmp_path: Path) -> None:
    cfg = node_config(tmp_path)
    agent = Agent(parse_agent_config(cfg, simulation=True))
    for i in range(3):
        assert not ask(agent, gradient_request(f"g{i}", round=i + 1), "default").is_error
    spent = agent.ledger.state()["spent"].copy()
    path = agent.ledger.path
    agent.close()
    with sqlite3.connect(path) as conn:  # back to version 1's layout, as a ledger written before issue 23
        conn.execute("DROP INDEX requests_by_federation_time")
        conn.execute("DROP INDEX requests_by_federation_run")
        conn.execute("DROP TABLE quotas")
        conn.execute("ALTER TABLE requests DROP COLUMN federation")
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    with pytest.raises(Exception, match="found 1 \\(an agent opening it migrates it"):
        Ledger.open_existing(path)
    agent = Agent(parse_agent_config(cfg, simulation=True))  # migrates, in one transaction
    np.testing.assert_array_equal(agent.ledger.state()["spent"], spent)
    assert [row["federation"] for row, _ in agent.ledger.log()] == ["default"] * 3
    assert not ask(agent, gradient_request("g9", round=9), "default").is_error
    agent.close()
    with Ledger.open_existing(path) as ledger:
        assert ledger.requests_answered() == 4
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    assert verify_ledger(path) == []


def test_a_version_2_ledger_gains_the_indexes_and_its_monitors_owner_from_its_log(tmp_path: Path) -> None:
    agent = Agent(parse_agent_config(_tree_federations(tmp_path, "alpha"), simulation=True))
    assert not ask(agent, gradient_request("g1", round=1), "beta").is_error
    assert not ask(agent, wire.MonitorRequest("m1", "run", 1, trust="local"), "alpha").is_error
    path = agent.ledger.path
    agent.close()
    with sqlite3.connect(path) as conn:  # back to version 2, as a ledger written before this version
        conn.execute("DROP INDEX requests_by_federation_time")
        conn.execute("DROP INDEX requests_by_federation_run")
        conn.execute("DELETE FROM meta WHERE key = 'monitor_federation'")
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    with pytest.raises(LedgerError, match="found 2 \\(an agent opening it migrates it"):
        Ledger.open_existing(path)
    agent = Agent(parse_agent_config(_tree_federations(tmp_path, "beta"), simulation=True))  # migrates
    assert agent.ledger.monitor_owner() == "alpha"  # from the stored monitor report
    refused = ask(agent, wire.MonitorRequest("m2", "run", 2, trust="local"), "beta")
    assert refused.error_code == wire.ERR_POLICY and "was used by federation 'alpha'" in refused.local_detail
    agent.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"requests_by_federation_time", "requests_by_federation_run"} <= names
    assert verify_ledger(path) == []


def test_quota_filters_are_the_global_filter_scaled() -> None:
    from client_agent.agent import quota_filter
    from client_agent.config import Federation

    filt = GaussianFilter.gdp(epsilon=1.0, delta=1e-5)
    assert quota_filter(filt, Federation("a", 0.3)).threshold == pytest.approx(0.3 * filt.threshold, rel=1e-15)


def test_ledger_verify_replays_each_federations_quota_and_finds_an_edited_one(tmp_path: Path) -> None:
    import io

    agent = Agent(parse_agent_config(two_federations(tmp_path), simulation=True))
    for i in range(1, 4):
        for fed in QUOTAS:
            ask(agent, gradient_request(f"{fed}{i}", round=i, noise_std=8.0, trust="central"), fed)
    path = agent.ledger.path
    agent.close()
    assert verify_ledger(path) == []
    with sqlite3.connect(path) as conn:  # a quota state lowered by hand, its checksum made to match
        (blob,) = conn.execute("SELECT blob FROM quotas WHERE federation = 'alpha'").fetchone()
        arrays = dict(np.load(io.BytesIO(blob)))
        arrays["spent"] = arrays["spent"] * 0.5
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        import hashlib

        new = buf.getvalue()
        conn.execute(
            "UPDATE quotas SET blob = ?, sha256 = ? WHERE federation = 'alpha'", (new, hashlib.sha256(new).hexdigest())
        )
    problems = verify_ledger(path)
    assert len(problems) == 1 and problems[0].startswith("federation 'alpha', unit ")


def _agent_of(tmp_path: Path, data: Any = None, **over: Any) -> Agent:
    cfg = node_config(tmp_path, data or client_data(20, seed=3), **over)
    cfg["federations"] = {"alpha": {"quota": 0.5}, "beta": {"quota": 0.5}}
    return Agent(parse_agent_config(cfg, simulation=True))


def test_seeded_noise_is_not_reused_across_federations(tmp_path: Path) -> None:
    """Two colluding coordinators send the same request id on their own sockets, at noise 10 and 20 (review finding).

    Agent.rng once seeded the draw with the *unqualified* ledger id, so both replies carried the same
    standard normal draw z: reply_a = c + 10z, reply_b = c + 20z, and 2*reply_a - reply_b = c, the exact count.
    """
    x, y = client_data(20, seed=3)
    agent = _agent_of(tmp_path, (x, y), **{"noise-seed": 7})
    req = dict(predicate="label", column=0, value=1.0, l2_clip=1.0)
    a = ask(agent, indicator_request("same-id", noise_std=10.0, **req), "alpha")
    b = ask(agent, indicator_request("same-id", noise_std=20.0, **req), "beta")
    assert not a.is_error and not b.is_error, (a.local_detail, b.local_detail)
    ra = wire.ContributionReply.decode(a.config, a.arrays).total.astype(np.float64)
    rb = wire.ContributionReply.decode(b.config, b.arrays).total.astype(np.float64)
    exact = float(np.count_nonzero(y == 1))
    recovered = 2 * ra - rb
    # With independent noise, 2*ra - rb ~ N(c, 800): recovering c to 1e-4 has probability ~3e-5.
    assert not np.allclose(recovered, exact, atol=1e-4), f"noise cancelled: recovered the exact count {recovered}"


def test_one_federation_cannot_exhaust_the_daily_request_limit_of_another(tmp_path: Path) -> None:
    """alpha spends the agent-wide per-day request limit; beta (which asked nothing) is then refused.

    check_policy once counted ledger.requests_since(...) over every federation: one coordinator blocks the
    other (availability), and beta's refusal tells it how many requests alpha made (activity leak).
    """
    agent = _agent_of(tmp_path, **{"policy-max-requests-per-day": 3})
    for i in range(3):
        out = ask(agent, indicator_request(f"a{i}", round=i + 1, noise_std=50.0), "alpha")
        assert not out.is_error, out.local_detail
    out = ask(agent, indicator_request("b0", noise_std=50.0), "beta")
    assert not out.is_error, f"beta refused because of alpha's requests: {out.local_detail}"


def test_a_federation_not_configured_is_a_policy_refusal_with_fixed_text(tmp_path: Path) -> None:
    agent = _agent_of(tmp_path)
    out = ask(agent, indicator_request("q", noise_std=50.0), "gamma")
    assert out.error_code == wire.ERR_POLICY and out.error_reason == wire.ERROR_TEXT[wire.ERR_POLICY]
    # Without a federation, an agent of several cannot guess which one asks: refused the same way.
    config, arrays = wire.encode_request(indicator_request("q2", noise_std=50.0))
    assert agent.handle(wire.INDICATOR, config, arrays).error_code == wire.ERR_POLICY


def test_every_request_answered_or_refused_leaves_one_audit_line_and_no_data(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    cfg = two_federations(tmp_path, **{"audit-log": str(log)})
    del cfg["policy-max-request-share"]  # the default cap: the drain below is refused
    agent = Agent(parse_agent_config(cfg, simulation=True))
    assert not ask(agent, gradient_request("g1", noise_std=8.0, trust="central"), "alpha").is_error
    assert ask(agent, gradient_request("g2", noise_std=1e-6, l2_clip=1e6, trust="central"), "beta").is_error
    assert ask(agent, gradient_request("g1", noise_std=8.0, trust="central"), "alpha").config is not None  # replay
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(entry["federation"], entry["request_id"], entry["outcome"]) for entry in lines] == [
        ("alpha", "g1", "answered"),
        ("beta", "g2", "refused: policy"),
        ("alpha", "g1", "replayed"),
    ]
    first = lines[0]
    assert first["units_charged"] == agent.n_units and first["noise_std"] == 8.0 and first["workload"] == "builtin"
    assert 0 < first["spend_share_max"] <= 1 and first["reply_bytes"] > 0
    x, _ = client_data(20, seed=3)
    assert all(f"{v:.6g}" not in log.read_text() for v in x.ravel()[:20])  # public fields and aggregates only
    agent.close()


def test_a_refused_requests_fields_are_bounded_in_the_audit_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A review: a refused request's fields went into the owner's log whole (3 MiB strings: 63 MB of log from
    # five uncharged requests); the wire's limits bound them (256 characters, 2^53).
    log = tmp_path / "audit.jsonl"
    agent = Agent(parse_agent_config(two_federations(tmp_path, **{"audit-log": str(log)}), simulation=True))
    config, arrays = wire.encode_request(gradient_request("g1", noise_std=8.0, trust="central"))
    huge = config | {"request_id": "r" * 3_000_000, "run_id": "u" * 257, "round": 10**400, "model": "m" * 256}
    out = agent.handle("x" * 1000, huge, arrays, "alpha")
    assert out.error_code == wire.ERR_MALFORMED
    out = agent.handle(wire.GRADIENT, huge, arrays, "alpha")
    assert out.error_code == wire.ERR_MALFORMED
    text = log.read_text()
    assert len(text) < 4000, len(text)
    first, second = (json.loads(line) for line in text.splitlines())
    assert first["kind"] == "<1000 characters>"
    assert second["request_id"] == "<3000000 characters>" and second["run_id"] == "<257 characters>"
    assert second["round"] == "<an integer of 1329 bits>" and second["model"] == "m" * 256  # at the limit: as sent
    refused = [r.getMessage() for r in caplog.records if r.name == "fedfilter.agent" and "refused" in r.getMessage()]
    assert len(refused) == 2 and all(len(m) < 1000 for m in refused)  # the agent's own log line is bounded too
    agent.close()


def test_concurrent_processes_cannot_together_pass_a_rate_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """policy-max-rounds-per-run = 1: another process answering the run's one request after this one counted
    the run's requests must make this one's commit refused (the state is read before the counts; found by a
    hostile review: N processes could answer N requests of a one-request run)."""
    import subprocess
    import sys
    import textwrap

    other = textwrap.dedent(
        """
        import json, sys
        from client_agent.agent import Agent
        from client_agent.config import parse_agent_config
        from protocol import messages as wire
        from tests.factories import gradient_request
        agent = Agent(parse_agent_config(json.loads(sys.argv[1]), simulation=True))
        request = gradient_request("x2", trust="central", run_id="one", noise_std=4.0)
        assert not agent.handle(wire.message_type_of(request), *wire.encode_request(request), "alpha").is_error
        agent.close()
        """
    )
    cfg = two_federations(tmp_path, **{"policy-max-rounds-per-run": 1})
    agent = Agent(parse_agent_config(cfg, simulation=True))
    count = agent.ledger.requests_in_run

    def requests_in_run(run_id: str, federation: str | None = None) -> int:  # the window: after the count
        used = count(run_id, federation)
        root = Path(__file__).resolve().parents[2]
        subprocess.run([sys.executable, "-c", other, json.dumps(cfg)], check=True, cwd=root, timeout=120)
        return used

    monkeypatch.setattr(agent.ledger, "requests_in_run", requests_in_run)
    outcome = ask(agent, gradient_request("x1", trust="central", run_id="one", noise_std=4.0), "alpha")
    assert outcome.error_code == wire.ERR_LEDGER and "another process committed" in outcome.local_detail
    path = agent.ledger.path
    agent.close()
    with Ledger.open_existing(path) as ledger:
        assert ledger.requests_in_run("one") == 1  # the run's one request, the other process's


@pytest.mark.parametrize("key", ["audit-log", "ledger-high-water"])
@pytest.mark.parametrize("spelling", ["same", "wal", "dotdot", "symlink", "hardlink"])
def test_the_audit_log_and_the_mark_are_never_the_ledger(tmp_path: Path, key: str, spelling: str) -> None:
    """Both are opened, written and closed beside the ledger's connection: on the ledger itself a close would
    drop the connection's locks (client_agent/ledger.py, _HeldFiles) and a write would corrupt it. Every
    spelling of the ledger is refused (a hostile review found '..', links and the mark's lock accepted)."""
    cfg = two_federations(tmp_path)
    ledger = Path(cfg["ledger-path"]).absolute()
    Agent(parse_agent_config(cfg, simulation=True)).close()  # the ledger exists: links can point at it
    (tmp_path / "sub").mkdir()
    if spelling == "same":
        side = ledger
    elif spelling == "wal":
        side = ledger.with_name(ledger.name + "-wal")
    elif spelling == "dotdot":
        side = tmp_path / "sub" / ".." / ledger.relative_to(tmp_path)
    elif spelling == "symlink":
        side = tmp_path / "sub" / "link"
        side.symlink_to(ledger)
    else:
        side = tmp_path / "sub" / "hard"
        os.link(ledger, side)
    cfg[key] = str(side)
    with pytest.raises(AgentConfigError, match=f"{key}: expected files other than the ledger and its WAL"):
        parse_agent_config(cfg, simulation=True)


def test_the_marks_lock_file_is_never_the_ledger(tmp_path: Path) -> None:
    """The mark is kept with a lock file beside it, ``<mark>.lock``: that may not be the ledger either."""
    cfg = two_federations(tmp_path)
    cfg["ledger-path"] = str(tmp_path / "mark.lock")
    cfg["ledger-high-water"] = str(tmp_path / "mark")
    with pytest.raises(AgentConfigError, match="ledger-high-water: expected files other than the ledger"):
        parse_agent_config(cfg, simulation=True)


def test_a_link_made_after_the_configuration_was_read_is_refused_at_open(tmp_path: Path) -> None:
    cfg = two_federations(tmp_path)
    Agent(parse_agent_config(cfg, simulation=True)).close()
    cfg["audit-log"] = str(tmp_path / "audit.jsonl")
    config = parse_agent_config(cfg, simulation=True)
    os.link(cfg["ledger-path"], tmp_path / "audit.jsonl")
    with pytest.raises(AgentConfigError, match="audit-log: expected files other than the ledger"):
        Agent(config)
