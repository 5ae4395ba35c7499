"""The contract every ledger backend keeps (privacy.md §9), run once per backend.

client_agent/ledger.py has one backend today, the SQLite file behind :class:`Ledger`;
:class:`LedgerContract` is written against the ledger's interface (open, state, commit, lookup,
releases) and a few hooks, so that a second backend gets the same tests by subclassing it. The
properties, each from privacy.md §9 or the ledger module's own claims:

- a committed spend survives closing and reopening (a restarted agent reads it back);
- an answered request is stored with its exact reply and can never be committed twice;
- budgets, unit, trust mode and units are fixed when the ledger is created;
- a corrupt ledger raises ``LedgerError`` and is left exactly as it was (never reset);
- a handle that read an older state cannot overwrite a newer one, and a non-finite spend is refused;
- a crash inside a commit loses nothing committed before it and leaves no part of the new one;
- a crash while a ledger is created leaves no ledger at its path, or a whole one.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from client_agent.ledger import Ledger, LedgerConfig, LedgerError
from tests.factories import LEDGER_UNITS, fresh_ledger_state, ledger_config

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEND = 0.1  # what each committed round charges every unit


def digest(request_id: str) -> str:
    return hashlib.sha256(request_id.encode()).hexdigest()


def commit(ledger: Any, request_id: str, new_state: dict[str, np.ndarray], **release: np.ndarray) -> None:
    """Store one answered request with its release and the filter's new state, as the agent does."""
    ledger.commit(
        request_id=request_id,
        message_type="gradient",
        run_id="run",
        digest=digest(request_id),
        release={"noise_std": np.array([1.0]), **release},
        new_state=new_state,
        reply=f"reply to {request_id}".encode(),
    )


def commit_round(ledger: Any, request_id: str, *, spend: float = SPEND) -> dict[str, np.ndarray]:
    """Charge every unit ``spend`` more for one release at noise_std 1; return the new state."""
    state = ledger.state()
    new_state = {"spent": state["spent"] + spend, "stopped": state["stopped"]}
    commit(ledger, request_id, new_state, l2_norms=np.full(LEDGER_UNITS, np.sqrt(spend)))
    return new_state


def assert_same_state(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(found) == sorted(expected)
    for name, array in expected.items():
        assert found[name].dtype == np.asarray(array).dtype, name
        np.testing.assert_array_equal(found[name], array, err_msg=name)


class LedgerContract(abc.ABC):
    """What every ledger backend must satisfy. Not collected itself; each ``Test*`` subclass runs it once.

    A subclass provides a ``ledger`` fixture (a new, open ledger with :func:`tests.factories.ledger_config`
    and nothing spent, closed after the test), the hooks below, and ``CORRUPTIONS``: name -> a function
    that damages a closed ledger at a path.
    """

    CORRUPTIONS: ClassVar[dict[str, Callable[[Path], None]]]

    @abc.abstractmethod
    def reopen(self, path: Path, config: LedgerConfig) -> Any:
        """Open the existing ledger at ``path`` as an agent does, with its configuration."""

    @abc.abstractmethod
    def open_existing(self, path: Path) -> Any:
        """Open the existing ledger at ``path`` without a configuration (``fedfilter ledger show``)."""

    @abc.abstractmethod
    def create(self, path: Path, config: LedgerConfig) -> Any:
        """Open the ledger at ``path``, creating it with nothing spent if it is not there."""

    @abc.abstractmethod
    def crash_inside_commit(self, path: Path, config: LedgerConfig) -> int:
        """In another process: commit ``req-1`` (charging SPEND), then die inside the commit of ``req-2``
        before it completes. Returns the process's exit status."""

    @abc.abstractmethod
    def crash_inside_create(self, path: Path, config: LedgerConfig) -> int:
        """In another process: die while creating a new ledger at ``path``. Returns its exit status."""

    # -- the tests -------------------------------------------------------------------------------

    def test_a_spend_survives_closing_and_reopening(self, ledger: Any) -> None:
        path, config = ledger.path, ledger.config
        commit_round(ledger, "req-1")
        expected = commit_round(ledger, "req-2")
        ledger.close()
        with self.reopen(path, config) as again:
            assert_same_state(again.state(), expected)
            assert again.requests_answered() == 2
            stored = again.lookup("req-2")
            assert stored is not None and stored.reply == b"reply to req-2" and stored.digest == digest("req-2")
            assert [request_id for request_id, _, _ in again.releases()] == ["req-1", "req-2"]  # commit order
        with self.open_existing(path) as read_only:
            assert_same_state(read_only.state(), expected)

    def test_the_stored_releases_add_up_to_the_stored_spend(self, ledger: Any) -> None:
        for i in range(3):
            commit_round(ledger, f"req-{i}", spend=0.1 * (i + 1))
        # privacy.md §2: each release charges (norm / sigma)^2; the ledger keeps what it released.
        charged = sum((release["l2_norms"] / release["noise_std"][0]) ** 2 for _, _, release in ledger.releases())
        np.testing.assert_allclose(ledger.state()["spent"], charged, rtol=1e-12)

    def test_an_answered_request_cannot_be_committed_again(self, ledger: Any) -> None:
        expected = commit_round(ledger, "req-1")
        with pytest.raises(LedgerError, match="already answered"):
            commit_round(ledger, "req-1")
        assert_same_state(ledger.state(), expected)
        assert ledger.requests_answered() == 1
        assert ledger.lookup("req-2") is None

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("epsilon", 5.0),
            ("delta", 1e-6),
            ("unit", "client"),
            ("trust", "central"),
            ("n_units", 6),
            ("filter", "zcdp"),
        ],
    )
    def test_budgets_units_and_trust_are_fixed_at_creation(self, ledger: Any, field: str, value: object) -> None:
        path, config = ledger.path, ledger.config
        commit_round(ledger, "req-1")
        ledger.close()
        before = path.read_bytes()
        with pytest.raises(LedgerError, match=rf"was created with {field}=.*the agent's configuration says {field}="):
            self.reopen(path, dataclasses.replace(config, **{field: value}))
        assert path.read_bytes() == before

    def test_a_corrupt_ledger_is_refused_and_never_reset(self, ledger: Any, corruption: str) -> None:
        path, config = ledger.path, ledger.config
        commit_round(ledger, "req-1")
        ledger.close()
        self.CORRUPTIONS[corruption](path)
        before = path.read_bytes()
        refused = r"corrupt or not a fedfilter ledger: .*; it is never reset"
        for _ in range(2):  # refusing twice shows the first refusal repaired nothing
            with pytest.raises(LedgerError, match=refused):
                self.reopen(path, config)
            with pytest.raises(LedgerError, match=refused):
                self.open_existing(path)
            assert path.read_bytes() == before

    def test_a_stale_handle_cannot_overwrite_a_newer_state(self, ledger: Any) -> None:
        with self.reopen(ledger.path, ledger.config) as other:
            stale = other.state()
            expected = commit_round(ledger, "req-1")
            with pytest.raises(LedgerError, match="another process committed"):
                commit(other, "req-2", {**stale, "spent": stale["spent"] + SPEND})
            assert_same_state(other.state(), expected)

    @pytest.mark.parametrize("bad", [np.nan, np.inf])
    def test_a_non_finite_spend_is_refused(self, ledger: Any, bad: float) -> None:
        state = ledger.state()
        spent = state["spent"].copy()
        spent[0] = bad
        with pytest.raises(LedgerError, match=r"expected finite values in new_state\['spent'\]"):
            commit(ledger, "req-1", {**state, "spent": spent})
        assert_same_state(ledger.state(), state)
        assert ledger.requests_answered() == 0

    def test_a_crash_inside_a_commit_loses_nothing_and_leaves_no_part_of_it(self, ledger: Any) -> None:
        path, config = ledger.path, ledger.config
        ledger.close()
        status = self.crash_inside_commit(path, config)
        assert status == -signal.SIGKILL, status
        with self.reopen(path, config) as again:
            stored = again.lookup("req-1")
            assert stored is not None and stored.reply == b"reply to req-1"  # the commit that returned is kept
            assert again.lookup("req-2") is None  # the one that did not is gone, with its charge
            np.testing.assert_array_equal(again.state()["spent"], np.full(LEDGER_UNITS, SPEND))
            assert again.requests_answered() == 1
            commit_round(again, "req-2")  # and the ledger goes on
            np.testing.assert_allclose(again.state()["spent"], np.full(LEDGER_UNITS, 2 * SPEND))

    def test_a_crash_while_creating_leaves_no_ledger_or_a_whole_one(self, tmp_path: Path) -> None:
        path = tmp_path / "new" / "ledger.sqlite"
        status = self.crash_inside_create(path, ledger_config())
        assert status == -signal.SIGKILL, status
        if path.exists():  # a whole ledger: it opens, nothing spent
            with self.open_existing(path) as whole:
                assert_same_state(whole.state(), fresh_ledger_state())
        else:
            with pytest.raises(LedgerError, match="expected an existing ledger file"):
                self.open_existing(path)
        with self.create(path, ledger_config()) as created:
            assert_same_state(created.state(), fresh_ledger_state())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each backend's own ways to be damaged, one test each."""
    if metafunc.cls is not None and "corruption" in metafunc.fixturenames:
        metafunc.parametrize("corruption", sorted(metafunc.cls.CORRUPTIONS))


# --- the SQLite backend (client_agent.ledger.Ledger) ---------------------------------------------------


def _random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(7).bytes(8192))


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _zero_length(path: Path) -> None:
    path.write_bytes(b"")


def _state_tampered(path: Path) -> None:
    """One bit of the stored state changed behind the ledger's back: its checksum no longer matches."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        (blob,) = conn.execute("SELECT blob FROM state").fetchone()
        conn.execute("UPDATE state SET blob = ?", (blob[:-1] + bytes([blob[-1] ^ 1]),))
    finally:
        conn.close()


def _another_sqlite_file(path: Path) -> None:
    path.unlink()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE t (x)")
    finally:
        conn.close()


def _run_child(code: str, *args: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO_ROOT, env=env, capture_output=True, timeout=120
    )
    if result.returncode != -signal.SIGKILL:
        print(result.stderr.decode())
    return result.returncode


class TestSqliteLedger(LedgerContract):
    """client_agent.ledger.Ledger: one SQLite file, WAL journal, synchronous=FULL, created by a hard link."""

    CORRUPTIONS: ClassVar[dict[str, Callable[[Path], None]]] = {
        "random_bytes": _random_bytes,
        "truncated": _truncated,
        "zero_length": _zero_length,
        "state_tampered": _state_tampered,
        "another_sqlite_file": _another_sqlite_file,
    }

    @pytest.fixture
    def ledger(self, tmp_ledger: Ledger) -> Ledger:
        return tmp_ledger

    def reopen(self, path: Path, config: LedgerConfig) -> Ledger:
        return Ledger.open(path, config)

    def open_existing(self, path: Path) -> Ledger:
        return Ledger.open_existing(path)

    def create(self, path: Path, config: LedgerConfig) -> Ledger:
        return Ledger.open(path, config, initial_state=fresh_ledger_state())

    def crash_inside_commit(self, path: Path, config: LedgerConfig) -> int:
        # The second commit's statements run inside its transaction; the process is killed as it is
        # about to send COMMIT, so the transaction was begun, written to, and never committed.
        code = """
            import os, signal, sys
            from client_agent.ledger import Ledger, LedgerConfig
            from tests.contracts.test_ledger import commit_round

            class KilledAtCommit:
                def __init__(self, conn):
                    self.conn = conn
                def execute(self, sql, *args):
                    if sql == "COMMIT":
                        os.kill(os.getpid(), signal.SIGKILL)
                    return self.conn.execute(sql, *args)
                def __getattr__(self, name):
                    return getattr(self.conn, name)

            ledger = Ledger.open(sys.argv[1], LedgerConfig.from_json(sys.argv[2]))
            commit_round(ledger, "req-1")
            ledger._conn = KilledAtCommit(ledger._conn)
            commit_round(ledger, "req-2")
        """
        return _run_child(code, str(path), config.to_json())

    def crash_inside_create(self, path: Path, config: LedgerConfig) -> int:
        # Killed when the complete ledger built beside its final name is about to be linked into place.
        code = """
            import os, signal, sys
            from client_agent.ledger import Ledger, LedgerConfig
            from tests.factories import fresh_ledger_state

            os.link = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
            Ledger.open(sys.argv[1], LedgerConfig.from_json(sys.argv[2]), initial_state=fresh_ledger_state())
        """
        return _run_child(code, str(path), config.to_json())
