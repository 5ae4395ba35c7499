"""One ledger behind two node ids is enrolled once (privacy.md §8).

A second node answered from a ledger already enrolled (two SuperNodes of one owner on one agent, or a node
configuration given twice) gets the same request ids with the same content, so the agent answers it from its
ledger, uncharged, with the stored reply. In central trust the coordinator summed both: one client's exact sum
counted twice under one noise, each record moving the release by 2c against a charge for c, (2c/σ)² = 4x (a
hostile review, 2026-11-27). Each status reply now carries the ledger's tag for the run (Ledger.run_tag) and
enrolment drops a second node with a tag it already has. Through the coordinator's `run` and real agents.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from client_agent.agent import Agent
from client_agent.config import parse_agent_config
from coordinator.enrolment import EnrolmentError
from coordinator.rounds import run
from protocol import messages as wire
from simulations.inprocess import InProcessTransport
from tests.factories import central_clients, client_data, gradient_run, node_config

CLIENTS, RECORDS = 3, 30


def test_a_second_node_answered_from_an_enrolled_ledger_is_not_enrolled(tmp_path: Path) -> None:
    per = central_clients(tmp_path, CLIENTS, RECORDS)
    doubled = {**per, CLIENTS: dict(per[0])}  # a fourth node id answered by client 0's agent and ledger
    cfg = gradient_run(num_nodes=CLIENTS + 1, n_public=CLIENTS * RECORDS, rounds=2)
    summary = run(InProcessTransport(doubled), cfg)
    assert summary["clients_excluded"] == {"duplicate-ledger": 1}
    assert summary["units_enrolled"] == CLIENTS * RECORDS
    # Each round's sum holds each ledger's reply once (before: 4 replies, client 0's twice).
    assert [log["replies"] for log in summary["rounds"]] == [CLIENTS, CLIENTS]
    # An operator whose n_public counted the duplicate (120, what the four statuses reported; the run went on
    # with client 0 twice) is now told the enrolled units are 90, before any request is charged.
    with pytest.raises(EnrolmentError, match="divides by 120 enrolled units; the 3 enrolled clients hold 90"):
        run(InProcessTransport(doubled), replace(cfg, n_public=(CLIENTS + 1) * RECORDS))


def test_a_copy_of_an_enrolled_ledger_is_not_enrolled_beside_it(tmp_path: Path) -> None:
    # A client folder provisioned from a copy (its data and ledger) as a second node: another file, the same
    # ledger. Its salt (drawn at the ledger's creation) is the original's, so it has the original's tag.
    per = central_clients(tmp_path, CLIENTS, RECORDS)
    Agent(parse_agent_config(per[0], simulation=True)).close()  # makes client 0's ledger
    original = Path(per[0]["ledger-path"])
    copy = original.with_name("copy.sqlite")
    shutil.copyfile(original, copy)
    cfg = gradient_run(num_nodes=CLIENTS + 1, n_public=CLIENTS * RECORDS, rounds=1)
    summary = run(InProcessTransport({**per, CLIENTS: per[0] | {"ledger-path": str(copy)}}), cfg)
    assert summary["clients_excluded"] == {"duplicate-ledger": 1}
    assert [log["replies"] for log in summary["rounds"]] == [CLIENTS]


def _status_tag(agent: Agent, run_id: str) -> str:
    request = wire.StatusRequest(f"{run_id}:status", run_id, 0)
    outcome = agent.handle(wire.STATUS, *wire.encode_request(request))
    assert not outcome.is_error and outcome.config is not None
    tag = json.loads(outcome.config["description"])["ledger_tag"]
    assert isinstance(tag, str)
    return tag


def test_the_ledger_tag_is_one_per_ledger_file_and_run(tmp_path: Path) -> None:
    # Two ledgers made in the same second from the same data and settings (the same ledger id's inputs) are
    # two ledgers; two agents over one file are one; another run id gives another tag (not linkable across runs).
    data = client_data(RECORDS, 3, seed=0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Agent(parse_agent_config(node_config(tmp_path / "a", data), simulation=True))
    b = Agent(parse_agent_config(node_config(tmp_path / "b", data), simulation=True))
    try:
        again = Agent(parse_agent_config(node_config(tmp_path / "a", data), simulation=True))
        try:
            assert _status_tag(a, "run-1") == _status_tag(again, "run-1")
        finally:
            again.close()
        assert _status_tag(a, "run-1") != _status_tag(b, "run-1")
        assert _status_tag(a, "run-1") != _status_tag(a, "run-2")
        assert len(_status_tag(a, "run-1")) == 32
    finally:
        a.close()
        b.close()
    # A ledger made before salts gets one when an agent first opens it, kept from then on (a review: without
    # it, a copy of such a ledger had a tag of its own and was enrolled beside it).
    ledger_b = tmp_path / "b" / "ledger.sqlite"
    with sqlite3.connect(ledger_b) as conn:
        conn.execute("DELETE FROM meta WHERE key = 'tag_salt'")
    conn.close()
    tags = [_status_tag_of(tmp_path / "b", data) for _ in range(2)]  # two agents in turn over the one file
    assert tags[0] == tags[1] and len(tags[0]) == 32 and tags[0] != _status_tag_of(tmp_path / "a", data)
    (tmp_path / "c").mkdir()
    shutil.copyfile(ledger_b, tmp_path / "c" / "ledger.sqlite")  # a copy made after the upgrade's first open
    assert _status_tag_of(tmp_path / "c", data) == tags[0]


def _status_tag_of(folder: Path, data: tuple) -> str:
    agent = Agent(parse_agent_config(node_config(folder, data), simulation=True))
    try:
        return _status_tag(agent, "run-1")
    finally:
        agent.close()
