"""The simulation engine's indexed LinkState (simulations/linkstate.py) hands out what Flower's stock one does.

Differential: the same operations, driven through Flower's own run registration, node registration and
in-memory Grid, against Flower's ``InMemoryLinkState`` and against :class:`IndexedInMemoryLinkState`; every
``get_message_ins`` must return the same messages in the same order, and the stores must hold the same
live (unexpired) messages after each step. When an *expired* message is dropped differs, by design: Flower's
scan drops any node's expired messages it passes, the index drops a node's own when that node is asked
(the engine asks every node every 0.1 s) and the grid's pull drops those it asks about.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState, RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from simulations.linkstate import indexed_link_state

RUN_ID, TASK_ID, NODES = 7, 11, 6


@pytest.fixture(autouse=True)
def _task_identity() -> Any:
    """What ``run_simulation`` sets for its legacy API (the grid stamps messages with it); restored after."""
    saved = {k: TaskIdentity.__dict__.get(k) for k in ("_task_id", "_run_id", "_node_id")}
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, RUN_ID, SUPERLINK_NODE_ID
    yield
    for k, v in saved.items():
        setattr(TaskIdentity, k, v)


def _world(indexed: bool) -> tuple[InMemoryLinkState, InMemoryGrid, list[int]]:
    """A state, grid and nodes built as ``flwr.simulation.run_simulation`` builds them."""
    if indexed:
        with indexed_link_state():
            factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
            state = factory.state()
    else:
        factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
        state = factory.state()
    assert isinstance(state, InMemoryLinkState)
    assert (type(state).__name__ == "IndexedInMemoryLinkState") is indexed
    run = Run.create_empty(run_id=RUN_ID)
    run.primary_task_id = TASK_ID
    run.federation_id = NOOP_FEDERATION_ID
    state.run_ids[RUN_ID] = RunRecord(run=run)
    state.task_store[TASK_ID] = Task(task_id=TASK_ID, run_id=RUN_ID)
    nodes = sorted(_register_nodes(NODES, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, nodes


def _tag(msg: Message) -> int:
    return int(msg.content.config_records["c"]["k"])


def _script(seed: int) -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(seed)
    ops: list[tuple[Any, ...]] = []
    for k in range(120):
        kind = rng.choice(["push", "push", "push", "get", "get", "pull", "expire"])
        node = int(rng.integers(NODES))
        if kind == "push":
            ops.append(("push", node, k, float(rng.choice([3600.0, 50.0]))))
        elif kind == "get":
            ops.append(("get", node, rng.choice([1, 2, None]), rng.choice([None, RUN_ID, RUN_ID + 1])))
        elif kind == "pull":
            ops.append(("pull",))
        else:
            ops.append(("expire",))
    return ops


def _play(indexed: bool, ops: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Runs ``ops``; the LinkState's clock is moved 100 s on by each ``expire`` (short-lived messages live 50 s)."""
    from flwr.server.superlink.linkstate import in_memory_linkstate
    from flwr.supercore.date import now

    skew = [datetime.timedelta(0)]
    monkeypatch.setattr(in_memory_linkstate, "now", lambda: now() + skew[0])
    state, grid, nodes = _world(indexed)
    seen: list[Any] = []
    pushed: list[str] = []
    for op in ops:
        if op[0] == "push":
            _, node, k, ttl = op
            msg = Message(RecordDict({"c": ConfigRecord({"k": k})}), nodes[node], "train", ttl=ttl)
            pushed += list(grid.push_messages([msg]))
        elif op[0] == "get":
            _, node, limit, run_id = op
            got = state.get_message_ins(nodes[node], limit, run_id=run_id)
            seen.append(("get", [_tag(m) for m in got]))
        elif op[0] == "pull":  # no replies exist, so this only checks and expires what the grid asks about
            list(grid.pull_messages(pushed))
        else:
            skew[0] += datetime.timedelta(seconds=100)  # every message pushed with ttl 50 s is now past its time
        clock = in_memory_linkstate.now().timestamp()
        live = [m for m in state.message_ins_store.values() if m.metadata.created_at + m.metadata.ttl > clock]
        seen.append(("store", sorted(_tag(m) for m in live)))
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_indexed_state_hands_out_what_flowers_does(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _script(seed)
    stock, indexed = _play(False, ops, monkeypatch), _play(True, ops, monkeypatch)
    assert sum(1 for kind, got in stock if kind == "get" and got) > 5  # the script does hand messages out
    assert indexed == stock


def test_the_swap_is_undone() -> None:
    from flwr.server.superlink.linkstate import linkstate_factory

    before = getattr(linkstate_factory, "InMemoryLinkState")  # noqa: B009
    with pytest.raises(RuntimeError), indexed_link_state():
        assert getattr(linkstate_factory, "InMemoryLinkState") is not before  # noqa: B009
        raise RuntimeError
    assert getattr(linkstate_factory, "InMemoryLinkState") is before  # noqa: B009


def test_a_sweep_over_many_nodes_is_linear() -> None:
    """The engine's delivery loop asks for every node's next message; with the index a sweep touches each
    node's own messages only. Counted, not timed: how often the stock scan's per-message check runs."""
    counts = {}
    for indexed in (False, True):
        state, grid, nodes = _world(indexed)
        grid.push_messages([Message(RecordDict(), n, "train") for n in nodes])
        calls = 0
        check = state._check_stored_messages

        def counting(ids: set[str], run_id: int | None = None, _check: Any = check) -> None:
            nonlocal calls
            calls += 1
            _check(ids, run_id)

        state._check_stored_messages = counting  # type: ignore[method-assign]
        got = [state.get_message_ins(n, 1) for n in nodes]
        assert all(len(g) == 1 for g in got)
        counts[indexed] = calls
    assert counts[True] == NODES
    assert counts[False] > NODES * (NODES - 1) / 2  # each node's question scans the messages stored before it
