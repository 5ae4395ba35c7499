"""Open agents kept between requests in a long-lived process: the privacy layer's fixed cost, paid once.

Opening an agent reads and fingerprints the client's data and opens the ledger with every
check (SQLite header and ``integrity_check``, schema, configuration, state checksum);
closing it checkpoints the WAL. Together that is most of what the privacy layer adds to a
small round (``benchmarks/client_round.py``). A process that answers many requests (a Ray
actor in simulation, an in-process transport, a long-lived ClientApp process) keeps the agent
open instead.

Privacy note: reuse never skips a check that protects a spend.

- Every request still reads the unit state from the ledger and verifies its checksum, and
  every commit still checks, inside its write transaction, that the stored state is the one
  it read; SQLite makes commits from other processes visible to the open connection. So a
  second process answering for the same ledger is handled exactly as without reuse.
- An agent is reused only when the ledger file, its WAL and the data file have the same
  identity, size and timestamps (modification and change) as this agent left them after
  its own last request. When only the ledger's contents changed (the same ledger file, by
  device and inode; the data file, a single file, and the TOML file with every mark they had), as when a second
  simulation actor answered for the same client, the ledger is reopened with every check
  of a first open (header bytes, integrity, schema, configuration and layout, state
  checksum, high-water mark: :meth:`client_agent.ledger.Ledger.reopen`), and the data is
  not reloaded. Anything else (a replaced file, new data, an edited policy, a failed check)
  closes it and opens afresh, with every check of a first open.
- An agent whose request ended in a ledger or internal error is closed, never reused.
- When the node config names an agent TOML file, an edit to that file (a new policy) also
  reopens the agent, so the edited policy holds from the next request.
- Agents are per process and per thread (an SQLite connection is not shared across
  threads or forks), keyed by the node config, at most ``max_entries`` of them (least
  recently used dropped first; closed by the thread that opened them).

Capacity (issue 24): a simulation's Ray actor answers for every virtual client that Flower
sends it, so with 1,000 clients each actor meets all 1,000. An open agent holds three file
descriptors (the ledger, its WAL and its shared-memory index) and about 340 KiB (a
100-record client, measured by benchmarks/simulation.py's setup); an agent pushed out is
reopened with every check at its next request (about 10 ms more). :func:`default_capacity`
therefore raises the process's soft descriptor limit to its hard limit and keeps as many
agents as fit in it, at most ``MOST_KEPT``.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from client_agent.agent import Agent
from client_agent.config import parse_agent_config
from client_agent.ledger import LedgerError
from protocol.validate import integer

FileMark = tuple[int, int, int, int, int] | None


def _mark(path: Path) -> FileMark:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _files(agent: Agent, node_config: Mapping[str, Any]) -> tuple[Path, ...]:
    """The ledger, its WAL, the data file and (when the node config names one) the agent's TOML file."""
    ledger = Path(agent.config.ledger_path)
    files = [ledger, ledger.with_name(ledger.name + "-wal"), Path(agent.config.data_path)]
    if "agent-config" in node_config:  # an edited policy must take effect at the next request
        files.append(Path(str(node_config["agent-config"])))
    return tuple(files)


def _marks(agent: Agent, node_config: Mapping[str, Any]) -> tuple[FileMark, ...]:
    return tuple(_mark(p) for p in _files(agent, node_config))


MOST_KEPT = 4096  # about 1.4 GiB of open agents per process at 340 KiB each
FDS_PER_AGENT = 5  # the ledger, its WAL, its shared-memory index, its header descriptor (ledger._HeldFiles), one spare
FDS_RESERVED = 256  # Ray's and Flower's own sockets and files


def default_capacity() -> int:
    """How many agents this process keeps open: what its descriptor limit allows, at most ``MOST_KEPT``.

    The soft limit is raised to the hard limit first (what Ray does for its own processes).
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = (MOST_KEPT * FDS_PER_AGENT + FDS_RESERVED) if hard == resource.RLIM_INFINITY else hard
            if target > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
    except (ImportError, ValueError, OSError):  # no resource module (Windows) or not allowed: keep the default
        return 128
    return max(16, min(MOST_KEPT, (soft - FDS_RESERVED) // FDS_PER_AGENT))


def _only_committed(before: tuple[FileMark, ...], now: tuple[FileMark, ...]) -> bool:
    """Whether only the ledger's contents changed: the ledger is the same file (device and inode), and the
    data file and the agent's TOML file (when named) have every mark they had."""
    ledger_before, ledger_now = before[0], now[0]
    return (
        ledger_before is not None
        and ledger_now is not None
        and ledger_before[:2] == ledger_now[:2]
        and before[2:] == now[2:]
    )


def _key(node_config: Mapping[str, Any], simulation: bool) -> tuple[object, ...]:
    items = tuple(sorted((str(k), repr(v)) for k, v in node_config.items()))
    return (os.getpid(), threading.get_ident(), simulation, items)


class AgentCache:
    """Agents kept open between requests; see the module docstring for when one is reused."""

    def __init__(self, *, max_entries: int = 128) -> None:
        self.max_entries = integer("max_entries", max_entries, at_least=1, error=ValueError)
        self._entries: OrderedDict[tuple[object, ...], tuple[Agent, tuple[FileMark, ...], threading.Thread]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self.refreshed = 0  # agents kept after another process committed to their ledger (tests, benchmarks)

    def __len__(self) -> int:
        return len(self._entries)

    def checkout(self, node_config: Mapping[str, Any], *, simulation: bool = False) -> Agent:
        """The open agent for ``node_config`` if its files are as it left them, else a freshly opened one.

        ``simulation`` is passed to :func:`parse_agent_config` (it alone admits seeded noise).
        Raises what :class:`Agent` and :func:`parse_agent_config` raise on a first open.
        """
        key = _key(node_config, simulation)
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None:
            agent, marks, owner = entry
            now = _marks(agent, node_config)
            if owner is threading.current_thread():
                if now == marks:
                    return agent
                # A data folder's mark does not change when a file inside it is rewritten: only a single
                # data file, whose own marks are compared, lets the data be kept (else a full reopen re-hashes it).
                if _only_committed(marks, now) and Path(agent.config.data_path).is_file():
                    # Another process (a second actor answering for this client) committed to the
                    # ledger: the same file, the same data and policy. Reopen the ledger with every
                    # check of a first open, but keep the data this agent read and checked (issue 24).
                    try:
                        agent.ledger.reopen()
                    except LedgerError:
                        pass  # closed; the full open below raises what it finds
                    else:
                        with self._lock:
                            self.refreshed += 1
                        return agent
                agent.close()  # something outside this agent touched its files: open with every check
        return Agent(parse_agent_config(node_config, simulation=simulation))

    def checkin(
        self, node_config: Mapping[str, Any], agent: Agent, *, reusable: bool, simulation: bool = False
    ) -> None:
        """Keep ``agent`` for the next request (``reusable``), or close it."""
        if not reusable:
            agent.close()
            return
        key = _key(node_config, simulation)
        here = threading.current_thread()
        evicted: list[tuple[Agent, tuple[FileMark, ...], threading.Thread]] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None and old[0] is not agent:
                evicted.append(old)
            self._entries[key] = (agent, _marks(agent, node_config), here)
            while len(self._entries) > self.max_entries:
                evicted.append(self._entries.popitem(last=False)[1])
        for a, _, owner in evicted:
            # An SQLite connection may only be closed by the thread that opened it; another
            # thread's agent is dropped and its connection closed when it is collected.
            if owner is here:
                a.close()

    def clear(self) -> None:
        """Close every kept agent (their ledgers checkpoint on close)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        here = threading.current_thread()
        for agent, _, owner in entries:
            if owner is here:
                agent.close()
