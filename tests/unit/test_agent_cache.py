"""Agents kept open between requests (client_agent/agent_cache.py): reused only while their files are untouched."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.agent_cache import AgentCache
from client_agent.direct import answer_request
from client_agent.ledger import Ledger
from protocol import messages as wire
from tests import factories


def node_config(tmp_path: Path) -> dict[str, Any]:
    return factories.node_config(tmp_path, **{"noise-seed": 3})


def gradient(i: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    return wire.encode_request(factories.gradient_request(f"r{i}", round=i, noise_std=4.0))


def spent(cfg: dict[str, Any]) -> np.ndarray:
    return factories.spent(cfg["ledger-path"])


@pytest.fixture
def cache() -> Any:
    c = AgentCache(max_entries=4)
    yield c
    c.clear()


def test_agent_is_reused_between_requests(tmp_path: Path, cache: AgentCache) -> None:
    cfg = node_config(tmp_path)
    assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
    first = cache.checkout(cfg, simulation=True)
    cache.checkin(cfg, first, reusable=True, simulation=True)
    assert not answer_request(cfg, wire.GRADIENT, *gradient(2), cache=cache, simulation=True).is_error
    again = cache.checkout(cfg, simulation=True)
    assert again is first  # the same open agent: no new open, no data reload
    cache.checkin(cfg, again, reusable=True, simulation=True)
    # Every request charged, exactly as when the agent is opened and closed per request.
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    ref = node_config(ref_dir)
    for i in (1, 2):
        assert not answer_request(ref, wire.GRADIENT, *gradient(i), cache=None, simulation=True).is_error
    assert spent(cfg).tobytes() == spent(ref).tobytes()
    assert np.all(spent(cfg) > 0)


def test_truncated_ledger_is_refused_not_answered_from_the_open_agent(tmp_path: Path, cache: AgentCache) -> None:
    cfg = node_config(tmp_path)
    assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
    path = Path(cfg["ledger-path"])
    cache.clear()  # checkpoint the WAL into the file, as a process exit would, then damage the file
    assert not answer_request(cfg, wire.GRADIENT, *gradient(2), cache=cache, simulation=True).is_error
    path.write_bytes(path.read_bytes()[:1000])
    outcome = answer_request(cfg, wire.GRADIENT, *gradient(3), cache=cache, simulation=True)
    assert outcome.error_code == wire.ERR_LEDGER
    assert "corrupt" in outcome.local_detail
    assert len(cache) == 0  # an agent whose ledger failed is not kept


def test_edited_ledger_bytes_force_a_full_reopen(tmp_path: Path, cache: AgentCache) -> None:
    cfg = node_config(tmp_path)
    assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
    kept = cache.checkout(cfg, simulation=True)
    cache.checkin(cfg, kept, reusable=True, simulation=True)
    path = Path(cfg["ledger-path"])
    with path.open("r+b") as handle:  # same size, different bytes: only the timestamps tell
        handle.seek(0)
        handle.write(b"NOT SQLITE")
    outcome = answer_request(cfg, wire.GRADIENT, *gradient(2), cache=cache, simulation=True)
    assert outcome.error_code == wire.ERR_LEDGER
    assert "header" in outcome.local_detail


def test_another_process_committing_is_seen_and_no_spend_is_lost(tmp_path: Path, cache: AgentCache) -> None:
    cfg = node_config(tmp_path)
    # Two "processes" on one ledger, alternating: this cache, and an agent opened per request.
    for i in range(1, 7):
        use = cache if i % 2 else None
        outcome = answer_request(cfg, wire.GRADIENT, *gradient(i), cache=use, simulation=True)
        assert not outcome.is_error, outcome.error_reason
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    ref = node_config(ref_dir)
    for i in range(1, 7):
        assert not answer_request(ref, wire.GRADIENT, *gradient(i), cache=None, simulation=True).is_error
    assert spent(cfg).tobytes() == spent(ref).tobytes()
    with Ledger.open_existing(Path(cfg["ledger-path"])) as ledger:
        assert ledger.requests_answered() == 6
    # requests 3 and 5 found the other process's commit: the ledger was checked again on the open
    # connection, the data not reloaded (issue 24: two simulation actors answer for one client)
    assert cache.refreshed == 2


def test_a_trigger_added_by_another_process_is_found_by_the_refresh(tmp_path: Path, cache: AgentCache) -> None:
    import sqlite3

    cfg = node_config(tmp_path)
    assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
    before = spent(cfg).copy()
    conn = sqlite3.connect(cfg["ledger-path"])  # same file, same inode: only the contents change
    conn.execute("CREATE TRIGGER undo AFTER UPDATE ON state BEGIN SELECT 1; END")
    conn.commit()
    conn.close()
    outcome = answer_request(cfg, wire.GRADIENT, *gradient(2), cache=cache, simulation=True)
    assert outcome.error_code == wire.ERR_LEDGER
    assert "trigger 'undo'" in outcome.local_detail
    assert cache.refreshed == 0 and len(cache) == 0
    with Ledger.open_existing(Path(cfg["ledger-path"]), allow_foreign=True) as ledger:
        assert ledger.state()["spent"].tobytes() == before.tobytes()  # nothing charged


def test_new_data_file_reopens_and_the_ledger_refuses_it(tmp_path: Path, cache: AgentCache) -> None:
    cfg = node_config(tmp_path)
    assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
    x = np.ones((10, 3), np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=np.zeros(10, np.int64))
    outcome = answer_request(cfg, wire.GRADIENT, *gradient(2), cache=cache, simulation=True)
    assert outcome.error_code == wire.ERR_LEDGER
    assert "data_sha256" in outcome.local_detail
    # privacy: the mismatch names both data fingerprints; only the code's fixed text may leave the client
    assert outcome.error_reason == wire.ERROR_TEXT[wire.ERR_LEDGER]
    assert str(tmp_path) not in outcome.error_reason


def test_replayed_request_from_the_open_agent_is_byte_identical(tmp_path: Path, cache: AgentCache) -> None:
    cfg = node_config(tmp_path)
    first = answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True)
    again = answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True)
    assert first.config == again.config
    for name in first.arrays:
        assert first.arrays[name].tobytes() == again.arrays[name].tobytes()
    with Ledger.open_existing(Path(cfg["ledger-path"])) as ledger:
        assert ledger.requests_answered() == 1  # no second charge


def test_least_recently_used_agents_are_closed(tmp_path: Path) -> None:
    cache = AgentCache(max_entries=2)
    try:
        for k in range(3):
            d = tmp_path / f"c{k}"
            d.mkdir()
            assert not answer_request(
                node_config(d), wire.GRADIENT, *gradient(1), cache=cache, simulation=True
            ).is_error
        assert len(cache) == 2
    finally:
        cache.clear()
    assert len(cache) == 0
    assert os.path.exists(tmp_path / "c0" / "ledger.sqlite")


def test_bad_cache_size() -> None:
    with pytest.raises(ValueError, match="max_entries: expected an integer >= 1, got 0"):
        AgentCache(max_entries=0)


def test_edited_agent_file_policy_holds_from_the_next_request(tmp_path: Path, cache: AgentCache) -> None:
    flat = node_config(tmp_path)
    toml = tmp_path / "agent.toml"
    lines = [f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in flat.items()]
    toml.write_text("\n".join(lines) + "\npolicy-min-noise-std = 1.0\n")
    cfg = {"agent-config": str(toml)}
    assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
    toml.write_text("\n".join(lines) + "\npolicy-min-noise-std = 10.0\n")  # the owner tightens the policy
    outcome = answer_request(cfg, wire.GRADIENT, *gradient(2), cache=cache, simulation=True)
    assert outcome.error_code == wire.ERR_POLICY
    assert "noise_std 4.0 asked; the policy requires noise_std >= 10.0" in outcome.local_detail


def test_another_threads_agent_is_never_used_or_closed_here(tmp_path: Path, cache: AgentCache) -> None:
    import threading

    cfg = node_config(tmp_path)
    errors: list[BaseException] = []

    def answer_in_thread() -> None:
        try:
            assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    worker = threading.Thread(target=answer_in_thread)
    worker.start()
    worker.join()
    assert not errors and len(cache) == 1
    # This thread gets its own agent (SQLite connections are per thread), and the dead thread's is not closed here.
    assert not answer_request(cfg, wire.GRADIENT, *gradient(2), cache=cache, simulation=True).is_error
    cache.clear()


def test_default_capacity_fits_the_descriptor_limit(tmp_path: Path, cache: AgentCache) -> None:
    """An open agent holds at most FDS_PER_AGENT descriptors: the cache keeps what the hard limit allows (issue 24)."""
    import subprocess
    import sys

    from client_agent.agent_cache import FDS_PER_AGENT

    def agents_descriptors() -> list[str]:
        """This process's descriptors of files under tmp_path (the agents' data, ledgers, WALs and indexes)."""
        found = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # listdir's own descriptor, closed by now
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(str(tmp_path)):
                    found.append(target)
        return found

    for i in range(3):  # three agents kept open, each with its ledger, WAL, index and header descriptor
        (tmp_path / f"client{i}").mkdir()
        cfg = node_config(tmp_path / f"client{i}")
        assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
    held = agents_descriptors()
    assert len(cache) == 3 and 3 * 3 <= len(held) <= 3 * (FDS_PER_AGENT - 1), held  # one to spare

    code = (
        "import resource; from client_agent.agent_cache import default_capacity as d\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 600))\n"
        "print(d(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [
        str((600 - 256) // FDS_PER_AGENT),
        "600",
    ]  # the soft limit rose to the hard one, and the cache fits it
    from client_agent.agent_cache import MOST_KEPT
    from client_agent.direct import AGENTS

    assert 16 <= AGENTS.max_entries <= MOST_KEPT


def test_a_reopened_ledger_keeps_its_commits_when_another_process_closes_it(tmp_path: Path) -> None:
    """Ledger.reopen must not drop this process's SQLite locks: a Python open and close of the file while a
    connection to it is open does (POSIX), and another process closing the ledger then checkpoints and
    deletes the WAL this process still commits to, losing the commit (found in review of issue 24)."""
    import subprocess
    import sys

    from client_agent.ledger import LedgerConfig

    path = str(tmp_path / "ledger.sqlite")
    setup = (
        "import sys, numpy as np; from client_agent.ledger import Ledger, LedgerConfig\n"
        "cfg = LedgerConfig(filter='gdp', epsilon=1.0, delta=1e-5, unit='record', trust='local', n_units=2,"
        " params={})\n"
        "led = Ledger.open(sys.argv[1], cfg, initial_state={'spent': np.zeros(2)})\n"
        "if sys.argv[2] != '-':\n"
        "    led.state(); led.commit(request_id=sys.argv[2], message_type='gradient', run_id='r', digest='0' * 64,"
        " release={'x': np.zeros(1)}, new_state={'spent': np.full(2, 0.2)}, reply=b'ok')\n"
        "print(led.requests_answered()); led.close()\n"
    )

    def other(request_id: str = "-") -> int:
        run = subprocess.run([sys.executable, "-c", setup, path, request_id], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        return int(run.stdout.split()[-1])

    cfg = LedgerConfig(filter="gdp", epsilon=1.0, delta=1e-5, unit="record", trust="local", n_units=2, params={})

    def commit(ledger: Ledger, request_id: str, spent: float) -> None:
        ledger.state()
        ledger.commit(
            request_id=request_id,
            message_type="gradient",
            run_id="r",
            digest="0" * 64,
            release={"x": np.zeros(1)},
            new_state={"spent": np.full(2, spent)},
            reply=b"ok",
        )

    ledger = Ledger.open(path, cfg, initial_state={"spent": np.zeros(2)})
    commit(ledger, "q1", 0.1)
    assert other("q2") == 2  # another actor commits
    ledger.reopen()  # what the agent cache does when it sees that commit
    assert other() == 2  # another process opens and closes the ledger
    commit(ledger, "q3", 0.9)
    assert other() == 3  # a third open sees this process's commit
    ledger.close()
    assert other() == 3


def test_an_agent_whose_ledger_another_process_committed_to_keeps_every_commit(
    tmp_path: Path, cache: AgentCache
) -> None:
    """The same through the agent cache and real requests, each process answering in turn."""
    import json
    import subprocess
    import sys

    cfg = node_config(tmp_path)
    answer = (  # a request answered by an agent of its own (imports torch: only where a request is answered)
        "from client_agent.direct import answer_request; from protocol import messages as wire;"
        "from tests import factories\n"
        "assert not answer_request(cfg, wire.GRADIENT, *wire.encode_request(factories.gradient_request("
        "f'r{i}', round=i, noise_std=4.0)), cache=None, simulation=True).is_error\n"
    )
    count = "with Ledger.open_existing(cfg['ledger-path']) as ledger: print(ledger.requests_answered())"

    def in_another_process(i: int) -> int:
        script = "import json, sys; from client_agent.ledger import Ledger; cfg = json.loads(sys.argv[1]); "
        script += f"i = int(sys.argv[2])\n{answer if i else ''}{count}"
        run = subprocess.run(
            [sys.executable, "-c", script, json.dumps(cfg), str(i)], capture_output=True, text=True, check=True
        )
        return int(run.stdout.split()[-1])

    assert not answer_request(cfg, wire.GRADIENT, *gradient(1), cache=cache, simulation=True).is_error
    assert in_another_process(2) == 2  # another actor commits: this agent reopens its ledger next
    assert not answer_request(cfg, wire.GRADIENT, *gradient(3), cache=cache, simulation=True).is_error
    assert cache.refreshed == 1
    assert in_another_process(0) == 3  # another process opens and closes the ledger
    assert not answer_request(cfg, wire.GRADIENT, *gradient(4), cache=cache, simulation=True).is_error
    assert in_another_process(0) == 4  # this commit is in the file every process reads
    cache.clear()
    assert in_another_process(0) == 4
