"""The client's durable privacy ledger (privacy.md §9): charge before release, idempotent, never reset."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from client_agent.ledger import SCHEMA_VERSION, Ledger, LedgerConfig, LedgerError
from tests.factories import LEDGER_UNITS as N_UNITS
from tests.factories import fresh_ledger_state as fresh_state
from tests.factories import ledger_config as make_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def commit_round(ledger: Ledger, request_id: str, *, run_id: str = "run-1", spend: float = 0.1) -> None:
    """Charge every unit ``spend`` more and store a one-release request."""
    state = ledger.state()
    new_state = {"spent": state["spent"] + spend, "stopped": state["spent"] + spend >= 1.0}
    ledger.commit(
        request_id=request_id,
        message_type="fit",
        run_id=run_id,
        digest=digest(request_id),
        release={"noise_std": 2.0, "l2_norms": np.full(N_UNITS, spend), "kind": "gaussian"},
        new_state=new_state,
        reply=f"reply to {request_id}".encode(),
    )


def commit_from(ledger: Ledger, state: dict[str, np.ndarray], request_id: str, **extra: Any) -> None:
    """Commit a new state computed from ``state`` (0.1 more spent), as a request read it."""
    ledger.commit(
        request_id=request_id,
        message_type="fit",
        run_id="run-1",
        digest=digest(request_id),
        release={"noise_std": 1.0},
        new_state={**state, "spent": state["spent"] + 0.1},
        reply=b"x",
        **extra,
    )


def assert_states_equal(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(found) == sorted(expected)
    for name, array in expected.items():
        assert found[name].dtype == array.dtype
        np.testing.assert_array_equal(found[name], array)


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    """A real ledger with two committed requests, closed."""
    path = tmp_path / "ledgers" / "client-0.sqlite"
    with Ledger.open(path, make_config(), initial_state=fresh_state()) as ledger:
        commit_round(ledger, "req-1")
        commit_round(ledger, "req-2")
    return path


def raw_sql(path: Path, *statements: tuple[str, tuple[Any, ...]]) -> None:
    """Edit a ledger file behind the ledger's back, as a tamperer (or a bug) would."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for sql, args in statements:
            conn.execute(sql, args)
    finally:
        conn.close()


class TestConfig:
    def test_json_round_trip_is_canonical(self) -> None:
        config = make_config(params={"b": [1, 2], "a": {"y": 1, "x": 2}})
        text = config.to_json()
        assert text == (
            '{"delta":1e-05,"epsilon":3.0,"filter":"gdp","n_units":5,'
            '"params":{"a":{"x":2,"y":1},"b":[1,2]},"trust":"local","unit":"record"}'
        )
        assert LedgerConfig.from_json(text) == config
        assert LedgerConfig.from_json(text).to_json() == text

    def test_an_integer_past_float_range_is_refused(self) -> None:
        # JSON reads an integer of any length: a corrupt ledger's config gets the ledger's error, not OverflowError
        text = make_config().to_json().replace('"epsilon":3.0', '"epsilon":1' + "0" * 400)
        with pytest.raises(ValueError, match=r"LedgerConfig.epsilon: expected a finite number, got an integer of 1329"):
            LedgerConfig.from_json(text)

    def test_numbers_are_normalised(self) -> None:
        config = make_config(epsilon=3, n_units=np.int64(5), params={"orders": (2, 4)})
        assert config == make_config(params={"orders": [2, 4]})
        assert isinstance(config.epsilon, float)

    def test_params_are_read_only(self) -> None:
        config = make_config()
        with pytest.raises(TypeError):
            config.params["threshold"] = 99.0  # type: ignore[index]

    @pytest.mark.parametrize(
        ("field", "value", "message"),
        [
            ("filter", "", "LedgerConfig.filter: expected a non-empty str, found ''"),
            ("epsilon", 0.0, "LedgerConfig.epsilon: expected a finite number > 0, found 0.0"),
            ("epsilon", float("inf"), "LedgerConfig.epsilon: expected a finite number > 0, found inf"),
            ("epsilon", True, "LedgerConfig.epsilon: expected a real number, found True"),
            ("delta", 1.0, "LedgerConfig.delta: expected 0 < delta < 1, found 1.0"),
            ("delta", float("nan"), "LedgerConfig.delta: expected 0 < delta < 1, found nan"),
            ("unit", "person", "LedgerConfig.unit: expected one of ('client', 'record'), found 'person'"),
            ("trust", "none", "LedgerConfig.trust: expected one of ('local', 'central', 'secagg'), found 'none'"),
            ("n_units", 0, "LedgerConfig.n_units: expected an int >= 1, found 0"),
            ("n_units", 2.0, "LedgerConfig.n_units: expected an int >= 1, found 2.0"),
            ("params", {"x": float("nan")}, "LedgerConfig.params: expected JSON-able finite values"),
            ("params", {"x": object()}, "LedgerConfig.params: expected JSON-able finite values"),
        ],
    )
    def test_invalid_values_are_refused(self, field: str, value: object, message: str) -> None:
        with pytest.raises(ValueError, match=re.escape(message)):
            make_config(**{field: value})

    def test_from_json_refuses_unknown_fields(self) -> None:
        text = make_config().to_json()[:-1] + ',"extra":1}'
        with pytest.raises(ValueError, match=r"LedgerConfig JSON: expected fields \[.*\], found \[.*'extra'"):
            LedgerConfig.from_json(text)


class TestRoundTrip:
    def test_create_commit_reopen(self, tmp_path: Path) -> None:
        path = tmp_path / "new" / "dir" / "ledger.sqlite"
        with Ledger.open(path, make_config(), initial_state=fresh_state()) as ledger:
            assert ledger.path == path
            assert_states_equal(ledger.state(), fresh_state())
            assert ledger.requests_answered() == 0
            assert ledger.lookup("req-1") is None
            commit_round(ledger, "req-1", spend=0.5)
            commit_round(ledger, "req-2", spend=0.5, run_id="run-2")
            commit_round(ledger, "req-0", spend=0.25, run_id="run-2")
        assert sorted(os.listdir(path.parent)) == ["ledger.sqlite"]  # no temporary files left behind

        with Ledger.open(path, make_config()) as ledger:
            expected_spent = np.full(N_UNITS, 1.25)
            assert_states_equal(ledger.state(), {"spent": expected_spent, "stopped": np.ones(N_UNITS, dtype=bool)})
            assert ledger.requests_answered() == 3
            assert ledger.requests_in_run("run-2") == 2
            assert ledger.requests_in_run("run-9") == 0
            stored = ledger.lookup("req-2")
            assert stored is not None
            assert (stored.request_id, stored.message_type, stored.run_id) == ("req-2", "fit", "run-2")
            assert stored.digest == digest("req-2")
            assert stored.reply == b"reply to req-2"
            assert stored.release["noise_std"] == 2.0 and stored.release["noise_std"].shape == ()
            assert stored.release["kind"] == "gaussian"
            np.testing.assert_array_equal(stored.release["l2_norms"], np.full(N_UNITS, 0.5))
            assert [(rid, kind) for rid, kind, _ in ledger.releases()] == [
                ("req-1", "fit"),
                ("req-2", "fit"),
                ("req-0", "fit"),
            ]  # commit order, not id order
            assert [float(r["l2_norms"][0]) for _, _, r in ledger.releases()] == [0.5, 0.5, 0.25]

        with Ledger.open_existing(path) as ledger:
            assert ledger.config == make_config()
            assert ledger.requests_answered() == 3

    def test_realisation_style_state(self, tmp_path: Path) -> None:
        state = {"loss": np.zeros(3), "accepting": np.ones(3, dtype=bool), "answered": np.zeros(1, dtype=np.int64)}
        config = make_config(filter="realisation", n_units=3)
        with Ledger.open(tmp_path / "l.sqlite", config, initial_state=state) as ledger:
            new_state = {**state, "answered": np.array([1], dtype=np.int64)}
            ledger.commit(
                request_id="q1",
                message_type="query",
                run_id="r",
                digest=digest("q1"),
                release={"answer": np.array([1.5])},
                new_state=new_state,
                reply=b"",
            )
        with Ledger.open(tmp_path / "l.sqlite", config) as ledger:
            assert_states_equal(ledger.state(), new_state)

    def test_wal_and_synchronous_full_are_really_set(self, ledger_path: Path) -> None:
        with Ledger.open(ledger_path, make_config()) as ledger:
            conn = ledger._conn
            assert conn is not None
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            assert conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
            assert conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000
            commit_round(ledger, "req-3")
            assert Path(f"{ledger_path}-wal").exists()
        with ledger_path.open("rb") as handle:
            header = handle.read(20)
        assert header[18:20] == b"\x02\x02"  # WAL is recorded in the file itself (SQLite file format §1.3.3)

    def test_creating_needs_an_initial_state(self, tmp_path: Path) -> None:
        path = tmp_path / "l.sqlite"
        with pytest.raises(
            LedgerError, match=re.escape(f"ledger {path}: expected an initial_state to create a new ledger, found None")
        ):
            Ledger.open(path, make_config())
        assert not path.exists()

    def test_open_existing_needs_a_file(self, tmp_path: Path) -> None:
        path = tmp_path / "missing.sqlite"
        with pytest.raises(
            LedgerError, match=re.escape(f"ledger {path}: expected an existing ledger file, found nothing at that path")
        ):
            Ledger.open_existing(path)
        assert not path.exists()

    def test_reopen_with_a_different_state_layout_is_refused(self, ledger_path: Path) -> None:
        other = {"spent": np.zeros(N_UNITS + 1), "stopped": np.zeros(N_UNITS + 1, dtype=bool)}
        with pytest.raises(
            LedgerError,
            match=re.escape(
                f"ledger {ledger_path} holds a different state from the agent's initial_state: "
                "array 'spent': expected shape (5,) dtype float64, found shape (6,) dtype float64"
            ),
        ):
            Ledger.open(ledger_path, make_config(), initial_state=other)

    def test_closed_ledger_refuses_use(self, ledger_path: Path) -> None:
        ledger = Ledger.open(ledger_path, make_config())
        ledger.close()
        ledger.close()
        with pytest.raises(
            LedgerError, match=re.escape(f"ledger {ledger_path}: expected an open ledger, found it closed")
        ):
            ledger.state()


class TestConfigMismatch:
    @pytest.mark.parametrize(
        ("field", "value", "shown"),
        [
            ("filter", "zcdp", "filter='gdp'; the agent's configuration says filter='zcdp'"),
            ("epsilon", 5.0, "epsilon=3.0; the agent's configuration says epsilon=5.0"),
            ("delta", 1e-6, "delta=1e-05; the agent's configuration says delta=1e-06"),
            ("unit", "client", "unit='record'; the agent's configuration says unit='client'"),
            ("trust", "central", "trust='local'; the agent's configuration says trust='central'"),
            ("n_units", 6, "n_units=5; the agent's configuration says n_units=6"),
            (
                "params",
                {"threshold": 2.0, "monitor_reserve": 0.05, "data_fingerprint": "abc123"},
                "params['threshold']=1.25; the agent's configuration says params['threshold']=2.0",
            ),
            (
                "params",
                {"threshold": 1.25, "monitor_reserve": 0.05},
                "params['data_fingerprint']='abc123'; "
                "the agent's configuration says params['data_fingerprint']='<absent>'",
            ),
        ],
    )
    def test_every_field_is_checked(self, ledger_path: Path, field: str, value: object, shown: str) -> None:
        before = ledger_path.read_bytes()
        reason = (
            "budgets are fixed when a ledger is created and are never changed"
            if field in ("epsilon", "delta")
            else "the filter, unit, trust mode and parameters are fixed when a ledger is created and are never changed"
        )
        with pytest.raises(LedgerError, match=re.escape(f"ledger {ledger_path} was created with {shown}: {reason}")):
            Ledger.open(ledger_path, make_config(**{field: value}), initial_state=fresh_state())
        assert ledger_path.read_bytes() == before

    def test_budget_message_matches_the_contract(self, ledger_path: Path) -> None:
        with pytest.raises(
            LedgerError,
            match=re.escape(
                f"ledger {ledger_path} was created with epsilon=3.0; the agent's configuration says epsilon=5.0: "
                "budgets are fixed when a ledger is created and are never changed"
            ),
        ):
            Ledger.open(ledger_path, make_config(epsilon=5.0))


class TestCommit:
    def test_duplicate_request_id_is_refused_and_changes_nothing(self, ledger_path: Path) -> None:
        with Ledger.open(ledger_path, make_config()) as ledger:
            state_before = ledger.state()
            with pytest.raises(
                LedgerError,
                match=re.escape(
                    f"ledger {ledger_path}: commit of request 'req-1': expected a new request id, "
                    "found it already answered; nothing was stored"
                ),
            ):
                ledger.commit(
                    request_id="req-1",
                    message_type="other",
                    run_id="run-9",
                    digest=digest("something else"),
                    release={"noise_std": 9.0},
                    new_state={"spent": np.full(N_UNITS, 0.9), "stopped": np.ones(N_UNITS, dtype=bool)},
                    reply=b"a different reply",
                )
            assert_states_equal(ledger.state(), state_before)
            stored = ledger.lookup("req-1")
            assert stored is not None and stored.reply == b"reply to req-1" and stored.run_id == "run-1"
            assert ledger.requests_answered() == 2

    @pytest.mark.parametrize(
        ("new_state", "found"),
        [
            (
                {"spent": np.zeros(N_UNITS + 1), "stopped": np.zeros(N_UNITS, dtype=bool)},
                "array 'spent': expected shape (5,) dtype float64, found shape (6,) dtype float64",
            ),
            (
                {"spent": np.zeros(N_UNITS, dtype=np.float32), "stopped": np.zeros(N_UNITS, dtype=bool)},
                "array 'spent': expected shape (5,) dtype float64, found shape (5,) dtype float32",
            ),
            (
                {"spent": np.zeros(N_UNITS)},
                "array 'stopped': expected shape (5,) dtype bool, found no such array",
            ),
        ],
    )
    def test_wrong_state_layout_is_refused(self, ledger_path: Path, new_state: dict[str, Any], found: str) -> None:
        with Ledger.open(ledger_path, make_config()) as ledger:
            before = ledger.state()
            with pytest.raises(
                LedgerError,
                match=re.escape(
                    f"ledger {ledger_path}: commit of request 'req-3': new_state {found}; "
                    "the state's layout is fixed when the ledger is created"
                ),
            ):
                ledger.commit(
                    request_id="req-3",
                    message_type="fit",
                    run_id="run-1",
                    digest=digest("req-3"),
                    release={"noise_std": 1.0},
                    new_state=new_state,
                    reply=b"x",
                )
            assert ledger.lookup("req-3") is None
            assert_states_equal(ledger.state(), before)

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            ({"digest": "ABC"}, "expected digest to be 64 lowercase hex digits (sha256), found 'ABC'"),
            ({"run_id": ""}, "expected run_id to be a non-empty str, found ''"),
            ({"reply": "text"}, "expected reply to be bytes, found str"),
            ({"release": {"bad name": 1.0}}, "release: expected array names matching"),
            ({"release": {"obj": np.array([None])}}, "release['obj']: expected a bool/int/float/complex/str array"),
        ],
    )
    def test_bad_arguments_are_refused(self, ledger_path: Path, overrides: dict[str, Any], message: str) -> None:
        arguments: dict[str, Any] = {
            "request_id": "req-3",
            "message_type": "fit",
            "run_id": "run-1",
            "digest": digest("req-3"),
            "release": {"noise_std": 1.0},
            "new_state": fresh_state(),
            "reply": b"x",
        }
        with Ledger.open(ledger_path, make_config()) as ledger:
            with pytest.raises(LedgerError, match=re.escape(message)):
                ledger.commit(**{**arguments, **overrides})
            assert ledger.requests_answered() == 2

    def test_failure_inside_sqlite_rolls_back_the_whole_transaction(self, ledger_path: Path) -> None:
        # The request row is inserted first; the state insert then fails inside SQLite. A TEMP
        # trigger on the handle's own connection (a trigger in the file is refused at open).
        with Ledger.open(ledger_path, make_config()) as ledger:
            assert ledger._conn is not None
            ledger._conn.execute(
                "CREATE TEMP TRIGGER fail_state BEFORE INSERT ON main.state "
                "BEGIN SELECT RAISE(ABORT, 'disk says no'); END"
            )
            before = ledger.state()
            with pytest.raises(
                LedgerError,
                match=re.escape(
                    f"ledger {ledger_path}: commit of request 'req-3': expected to commit, found: disk says no; "
                    "rolled back, nothing stored"
                ),
            ):
                commit_round(ledger, "req-3")
            assert ledger.lookup("req-3") is None
            assert ledger.requests_answered() == 2
            assert_states_equal(ledger.state(), before)
            conn = ledger._conn
            assert conn is not None and not conn.in_transaction

    def test_interruption_between_statements_rolls_back(self, ledger_path: Path) -> None:
        class InterruptedConnection:
            """Forwards to the real connection but is interrupted right after the request row is inserted."""

            def __init__(self, real: sqlite3.Connection) -> None:
                self.real = real

            def execute(self, sql: str, args: Any = ()) -> Any:
                if sql.startswith("INSERT INTO state"):  # after the old state row is deleted
                    raise KeyboardInterrupt
                return self.real.execute(sql, args)

        with Ledger.open(ledger_path, make_config()) as ledger:
            before = ledger.state()
            real = ledger._conn
            assert real is not None
            ledger._conn = InterruptedConnection(real)  # type: ignore[assignment]
            with pytest.raises(KeyboardInterrupt):
                commit_round(ledger, "req-3")
            ledger._conn = real
            assert not real.in_transaction
            assert ledger.lookup("req-3") is None
            assert_states_equal(ledger.state(), before)
        with Ledger.open(ledger_path, make_config()) as ledger:
            assert ledger.lookup("req-3") is None
            assert_states_equal(ledger.state(), before)


class TestNeverReset:
    @staticmethod
    def _random_bytes(path: Path) -> None:
        path.write_bytes(np.random.default_rng(7).bytes(8192))

    @staticmethod
    def _truncated(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    @staticmethod
    def _zero_length(path: Path) -> None:
        path.write_bytes(b"")

    @staticmethod
    def _state_tampered(path: Path) -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        (blob,) = conn.execute("SELECT blob FROM state").fetchone()
        conn.execute("UPDATE state SET blob = ?", (blob.replace(b"\x00" * 8, b"\x00" * 7 + b"\x01", 1),))
        conn.close()

    @staticmethod
    def _schema_version_changed(path: Path) -> None:
        raw_sql(path, ("UPDATE meta SET value = '7' WHERE key = 'schema_version'", ()))

    @staticmethod
    def _other_sqlite_file(path: Path) -> None:
        path.unlink()
        raw_sql(path, ("CREATE TABLE t (x)", ()))

    CASES: ClassVar[dict[str, tuple[Callable[[Path], None], str]]] = {
        "random_bytes": (_random_bytes, "expected an SQLite database header, found b'"),
        "truncated": (_truncated, "database disk image is malformed"),
        "zero_length": (_zero_length, "expected an SQLite database, found an empty (0-byte) file"),
        "state_tampered": (_state_tampered, "state checksum: expected sha256 "),
        "other_sqlite_file": (_other_sqlite_file, "expected SQLite application_id 0x46464c47, found 0x0"),
    }

    @pytest.mark.parametrize("case", sorted(CASES))
    @pytest.mark.parametrize("opener", ["open", "open_existing"])
    def test_corrupt_ledger_is_refused_and_left_as_it_was(self, ledger_path: Path, case: str, opener: str) -> None:
        damage, detail = self.CASES[case]
        damage(ledger_path)
        before = ledger_path.read_bytes()
        pattern = (
            re.escape(f"ledger {ledger_path} is corrupt or not a fedfilter ledger: ")
            + ".*"
            + re.escape(detail)
            + ".*"
            + re.escape("; refusing to answer; it is never reset; do not answer from an older copy")
        )
        for _ in range(2):  # refusing twice shows the first refusal repaired nothing
            with pytest.raises(LedgerError, match=pattern):
                if opener == "open":
                    Ledger.open(ledger_path, make_config(), initial_state=fresh_state())
                else:
                    Ledger.open_existing(ledger_path)
            assert ledger_path.read_bytes() == before

    def test_unknown_schema_version_is_refused(self, ledger_path: Path) -> None:
        self._schema_version_changed(ledger_path)
        before = ledger_path.read_bytes()
        with pytest.raises(
            LedgerError, match=re.escape(f"ledger {ledger_path}: expected schema version {SCHEMA_VERSION}, found 7")
        ):
            Ledger.open(ledger_path, make_config(), initial_state=fresh_state())
        assert ledger_path.read_bytes() == before

    def test_tampering_while_open_is_caught_on_read(self, ledger_path: Path) -> None:
        with Ledger.open(ledger_path, make_config()) as ledger:
            self._state_tampered(ledger_path)
            with pytest.raises(LedgerError, match=r"is corrupt or not a fedfilter ledger: state checksum: expected"):
                ledger.state()


class TestDurabilityAndConcurrency:
    def test_commit_survives_sigkill(self, tmp_path: Path) -> None:
        path = tmp_path / "l.sqlite"
        child = textwrap.dedent(
            f"""
            import os, signal
            import numpy as np
            from client_agent.ledger import Ledger, LedgerConfig
            config = LedgerConfig.from_json({make_config().to_json()!r})
            state = {{"spent": np.zeros({N_UNITS}), "stopped": np.zeros({N_UNITS}, dtype=bool)}}
            ledger = Ledger.open({str(path)!r}, config, initial_state=state)
            ledger.commit(request_id="req-1", message_type="fit", run_id="run-1", digest="ab" * 32,
                          release={{"noise_std": 1.0}}, new_state={{**state, "spent": np.full({N_UNITS}, 0.5)}},
                          reply=b"sent after commit")
            os.kill(os.getpid(), signal.SIGKILL)
            """
        )
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        result = subprocess.run([sys.executable, "-c", child], cwd=REPO_ROOT, env=env, capture_output=True, timeout=60)
        assert result.returncode == -signal.SIGKILL, result.stderr.decode()
        with Ledger.open(path, make_config()) as ledger:
            stored = ledger.lookup("req-1")
            assert stored is not None and stored.reply == b"sent after commit"
            np.testing.assert_array_equal(ledger.state()["spent"], np.full(N_UNITS, 0.5))

    def test_second_handle_sees_commits_and_cannot_overwrite_them(self, ledger_path: Path) -> None:
        with Ledger.open(ledger_path, make_config()) as first, Ledger.open(ledger_path, make_config()) as second:
            stale = second.state()
            commit_round(first, "req-3")
            assert second.lookup("req-3") is not None
            with pytest.raises(
                LedgerError,
                match=r"the ledger as the new state was computed from it .* another process committed",
            ):
                commit_from(second, stale, "req-4")
            assert second.lookup("req-4") is None
            commit_round(second, "req-4")  # reads the fresh state first
            np.testing.assert_allclose(first.state()["spent"], np.full(N_UNITS, 0.4))

    def test_a_commit_is_checked_against_the_state_it_was_computed_from(self, ledger_path: Path) -> None:
        """A later read of the state (any code between a request's read and its commit) must not let a new
        state computed from the earlier read be written over a commit made in between."""
        with Ledger.open(ledger_path, make_config()) as first, Ledger.open(ledger_path, make_config()) as second:
            stale = first.state()
            base = first.last_read
            commit_round(second, "req-3")  # another handle (another process) charges 0.1
            first.state()  # a second read moves the handle's own record on
            assert first.last_read != base
            with pytest.raises(
                LedgerError, match=r"the ledger as the new state was computed from it .* nothing was stored"
            ):
                commit_from(first, stale, "req-4", base=base)
            np.testing.assert_allclose(first.state()["spent"], np.full(N_UNITS, 0.3))  # req-3's charge stands

    @pytest.mark.parametrize("explicit", [True, False])
    def test_a_commit_that_leaves_the_state_as_it_was_still_moves_the_base(
        self, ledger_path: Path, explicit: bool
    ) -> None:
        """A commit may leave the state's bytes unchanged and change only a federation's quota row (a unit
        stopped everywhere, now stopped for that federation too). A request computed from a read before it
        must not pass the check and write the older quota back (found by a hostile review: a monitor
        request wrote back 16 stopped units over 20)."""

        def quota(stopped: int) -> dict[str, np.ndarray]:
            flags = np.arange(N_UNITS) < stopped
            return {"spent": np.full(N_UNITS, 0.2), "stopped": flags, "halt_round": np.where(flags, 3, -1)}

        def commit(handle: Ledger, request_id: str, stopped: int, **base: Any) -> None:
            same = {**fresh_state(), "spent": np.full(N_UNITS, 0.1)}  # 0.2 spent: the same bytes at every commit
            commit_from(handle, same, request_id, federation="alpha", quota_state=quota(stopped), **base)

        with Ledger.open(ledger_path, make_config()) as first, Ledger.open(ledger_path, make_config()) as second:
            commit(first, "q1", 2)
            base = first.last_read
            second.state()
            commit(second, "q2", 4)  # the same state bytes; alpha's quota stops two more units
            assert second.last_read.sha == base.sha
            given = {"base": base} if explicit else {}  # the default: what this handle last read (q1's commit)
            with pytest.raises(LedgerError, match=r"3 requests\), found sha256 \w+, 4 requests: another process"):
                commit(first, "q3", 2, **given)
            stored = first.quota_state("alpha")
            assert stored is not None and int(stored["stopped"].sum()) == 4  # q2's quota stands

    def test_two_processes_committing_lose_no_charge(self, ledger_path: Path, tmp_path: Path) -> None:
        # Both workers start together (a file barrier) and pause between reading and committing,
        # so their read-modify-write cycles overlap; every charge must still land exactly once.
        go = tmp_path / "go"
        worker = textwrap.dedent(
            f"""
            import sys, time
            from pathlib import Path
            from client_agent.ledger import Ledger, LedgerConfig, LedgerError
            config = LedgerConfig.from_json({make_config().to_json()!r})
            name = sys.argv[1]
            with Ledger.open({str(ledger_path)!r}, config) as ledger:
                Path({str(tmp_path)!r}, "ready-" + name).touch()
                while not Path({str(go)!r}).exists():
                    time.sleep(0.001)
                done = 0
                while done < 15:
                    state = ledger.state()
                    time.sleep(0.002)
                    try:
                        ledger.commit(request_id=f"{{name}}-{{done}}", message_type="fit", run_id=name,
                                      digest="cd" * 32, release={{"n": done}},
                                      new_state={{**state, "spent": state["spent"] + 0.01}}, reply=b"")
                    except LedgerError as exc:
                        if "another process committed" not in str(exc):
                            raise
                        continue
                    done += 1
            """
        )
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        workers = [
            subprocess.Popen([sys.executable, "-c", worker, name], cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE)
            for name in ("a", "b")
        ]
        try:
            while not all((tmp_path / f"ready-{name}").exists() for name in ("a", "b")):
                assert all(process.poll() is None for process in workers), "a worker died before the barrier"
                time.sleep(0.005)
            go.touch()
        finally:
            for process in workers:
                _, stderr = process.communicate(timeout=60)
                assert process.returncode == 0, stderr.decode()
        with Ledger.open(ledger_path, make_config()) as ledger:
            assert ledger.requests_answered() == 32
            assert ledger.requests_in_run("a") == ledger.requests_in_run("b") == 15
            np.testing.assert_allclose(ledger.state()["spent"], np.full(N_UNITS, 0.2 + 30 * 0.01))


class TestOneProcessTwoHandles:
    """A second handle this process opens on a ledger it already holds must leave the first one's POSIX
    locks in place. Before _HeldFiles the header check opened and closed a Python descriptor of the file,
    which drops every lock the process holds on it: another process closing its connection then took
    itself for the last one, checkpointed and deleted the WAL, and the first handle's next commit went on
    from a state without that process's charge (0.4 spent fell to 0.2; found when an in-process run and a
    Flower run were made in one Python process, the driver's cached agents still open)."""

    OTHER = textwrap.dedent(
        f"""
        import sys
        from client_agent.ledger import Ledger, LedgerConfig
        with Ledger.open(sys.argv[1], LedgerConfig.from_json({make_config().to_json()!r})) as ledger:
            if sys.argv[2] != "-":
                state = ledger.state()
                ledger.commit(request_id=sys.argv[2], message_type="fit", run_id="other", digest="ef" * 32,
                              release={{"n": 1}}, new_state={{**state, "spent": state["spent"] + 0.3}}, reply=b"")
            print(ledger.requests_answered(), float(ledger.state()["spent"][0]))
        """
    )

    def other(self, path: Path, request_id: str = "-") -> tuple[int, float]:
        """Another process opens the ledger, commits ``request_id`` (0.3 more each) unless "-", and closes it."""
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        run = subprocess.run(
            [sys.executable, "-c", self.OTHER, str(path), request_id],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        answered, spent = run.stdout.split()
        return int(answered), float(spent)

    @pytest.mark.parametrize("second_open", ["open_existing", "open", "reopen"])
    def test_another_process_charge_survives_a_second_handle(self, ledger_path: Path, second_open: str) -> None:
        with Ledger.open(ledger_path, make_config()) as first:  # an agent kept open (0.2 spent, 2 requests)
            first.state()
            if second_open == "open_existing":  # what `fedfilter ledger show` or a preset's read does
                Ledger.open_existing(ledger_path).close()
            elif second_open == "open":  # another agent of this process on the same ledger
                Ledger.open(ledger_path, make_config()).close()
            else:
                with Ledger.open(ledger_path, make_config()) as second:
                    second.reopen()
            assert self.other(ledger_path, "other-1") == (3, pytest.approx(0.5))  # another actor charges 0.3
            commit_round(first, "req-3")  # reads the state the other process left, then charges 0.1
            np.testing.assert_allclose(first.state()["spent"], np.full(N_UNITS, 0.6))
            assert self.other(ledger_path) == (4, pytest.approx(0.6))  # visible while this handle is open
        assert self.other(ledger_path) == (4, pytest.approx(0.6))
        with Ledger.open_existing(ledger_path) as after:
            assert after.lookup("other-1") is not None and after.lookup("req-3") is not None

    def test_descriptors_close_with_the_last_handle_and_on_refusals(self, ledger_path: Path, tmp_path: Path) -> None:
        from client_agent.ledger import _HELD

        before = _HELD.holding()
        first = Ledger.open(ledger_path, make_config())
        second = Ledger.open_existing(ledger_path)
        assert _HELD.holding() == before + 1  # one file, one set of descriptors, however many handles
        second.reopen()
        first.close()
        assert _HELD.holding() == before + 1  # the second handle still holds it
        second.close()
        second.close()  # closing twice releases once
        assert _HELD.holding() == before
        empty = tmp_path / "empty.sqlite"
        empty.touch()
        not_sqlite = tmp_path / "text.sqlite"
        not_sqlite.write_bytes(b"not a ledger" * 20)
        for bad, expected in ((empty, r"found an empty \(0-byte\) file"), (not_sqlite, "header, found b'not a ledger")):
            with pytest.raises(LedgerError, match=expected):
                Ledger.open_existing(bad)
            assert _HELD.holding() == before, bad
        with pytest.raises(
            LedgerError, match=r"was created with epsilon=3\.0; the agent.s configuration says epsilon=9\.0"
        ):
            Ledger.open(ledger_path, make_config(epsilon=9.0))
        assert _HELD.holding() == before

    def test_a_file_replaced_while_it_is_opened_is_refused(
        self, ledger_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The connection must be on the file whose descriptor the handle holds: a copy moved onto the path
        between the header check and the connect (as a restore tool writes it) would leave the connection's
        file unheld, and a later handle's close would drop its locks again."""
        import shutil

        from client_agent import ledger as ledger_module

        copy = tmp_path / "copy.sqlite"
        shutil.copyfile(ledger_path, copy)  # byte for byte: the same ledger id, the same requests
        connect = sqlite3.connect

        def swapping(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            monkeypatch.setattr(ledger_module.sqlite3, "connect", connect)
            os.replace(copy, ledger_path)
            return connect(*args, **kwargs)

        before = ledger_module._HELD.holding()
        monkeypatch.setattr(ledger_module.sqlite3, "connect", swapping)
        with pytest.raises(LedgerError, match=r"found another one at the path \(replaced while it was being opened\)"):
            Ledger.open_existing(ledger_path)
        assert ledger_module._HELD.holding() == before
        with Ledger.open_existing(ledger_path) as again:  # the copy, opened whole, is the same ledger
            assert again.requests_answered() == 2

    @pytest.mark.parametrize("where", ["header", "sqlite"])
    def test_running_out_of_descriptors_is_not_called_corruption(
        self, ledger_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An OS error opening the file (here: no descriptor left) is reported as what it is, not as a corrupt
        ledger, whether the header's open or SQLite's meets it; nothing stays held."""
        import errno

        from client_agent import ledger as ledger_module

        def no_descriptor(*args: Any, **kwargs: Any) -> Any:
            if where == "header":
                raise OSError(errno.EMFILE, "Too many open files")
            raise sqlite3.OperationalError("unable to open database file")

        before = ledger_module._HELD.holding()
        target = (ledger_module.os, "open") if where == "header" else (ledger_module.sqlite3, "connect")
        with monkeypatch.context() as patched:
            patched.setattr(*target, no_descriptor)
            with pytest.raises(LedgerError) as refused:
                Ledger.open_existing(ledger_path)
        expected = (
            "read its header, found the OS error .*Too many open" if where == "header" else "open it, found SQLite"
        )
        assert re.search(f"expected to ({expected})", str(refused.value)), refused.value
        assert "corrupt" not in str(refused.value) and ledger_module._HELD.holding() == before
        with Ledger.open_existing(ledger_path) as again:
            assert again.requests_answered() == 2

    def test_a_ledger_with_two_names_is_refused(self, ledger_path: Path, tmp_path: Path) -> None:
        """SQLite keeps a WAL per name: through a hard link, two processes would commit to one file through two
        logs, each blind to the other's, and one charge would be lost (found by a hostile review: 0.3 spent
        fell to 0.1). Refused at open, and at a commit when the name was added after the open."""
        alias = tmp_path / "alias.sqlite"
        os.link(ledger_path, alias)
        for path in (ledger_path, alias):
            with pytest.raises(LedgerError, match="expected a file with one name, found 2 hard links"):
                Ledger.open_existing(path)
        alias.unlink()
        with Ledger.open(ledger_path, make_config()) as ledger:
            os.link(ledger_path, alias)
            with pytest.raises(LedgerError, match="expected a file with one name, found 2 hard links"):
                commit_round(ledger, "req-3")
            alias.unlink()
            assert ledger.lookup("req-3") is None
            commit_round(ledger, "req-3")
            np.testing.assert_allclose(ledger.state()["spent"], np.full(N_UNITS, 0.3))

    def test_a_creations_leftover_name_is_removed(self, ledger_path: Path) -> None:
        """A creation killed between linking its temporary file into place and unlinking it leaves that name:
        it is the ledger's own, so an open removes it (any other second name is refused)."""
        leftover = ledger_path.with_name(f".{ledger_path.name}.creating-123-abcd")
        os.link(ledger_path, leftover)
        with Ledger.open(ledger_path, make_config()) as ledger:
            assert ledger.requests_answered() == 2
        assert not leftover.exists() and os.stat(ledger_path).st_nlink == 1

    def test_closing_with_an_unfinished_log_leaves_no_file_open(self, ledger_path: Path) -> None:
        """A log() or releases() left unfinished keeps a statement open: the connection's close would leave
        SQLite's files open after the header descriptor closed, unheld. The handle closes its cursors first."""

        def open_files() -> set[str]:
            names = set()
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(FileNotFoundError):  # listdir's own descriptor, closed by now
                    names.add(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
            return names

        ledger = Ledger.open_existing(ledger_path)
        log, releases = ledger.log(), ledger.releases()
        assert next(log)[0]["request_id"] == "req-1" and next(releases)[0] == "req-1"
        assert ledger_path.name in open_files()
        ledger.close()
        assert not {name for name in open_files() if name.startswith(ledger_path.name)}
        del log, releases


def test_new_ledger_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """The ledger holds every unit's spend (and secagg session secrets): mode 0600 whatever the umask."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = tmp_path / "owner.sqlite"
        cfg = LedgerConfig(filter="gdp", epsilon=1.0, delta=1e-5, unit="record", trust="local", n_units=2, params={})
        with Ledger.open(path, cfg, initial_state={"spent": np.zeros(2)}) as ledger:
            assert ledger.requests_answered() == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_malformed_state_layout_is_corrupt_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "layout.sqlite"
    cfg = LedgerConfig(filter="gdp", epsilon=1.0, delta=1e-5, unit="record", trust="local", n_units=2, params={})
    Ledger.open(path, cfg, initial_state={"spent": np.zeros(2)}).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("UPDATE meta SET value = '[1, 2]' WHERE key = 'state_layout'")
    conn.close()
    with pytest.raises(LedgerError, match=r"corrupt.*expected a state layout of \{name: \{shape, dtype\}\}"):
        Ledger.open_existing(path)


def test_a_ledger_on_a_network_filesystem_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's WAL works on one host only: two hosts could each commit against their own view of the
    ledger (review of issue 24: a Ray cluster over several hosts sharing --out)."""
    import client_agent.ledger as ledger_module

    mounts = tmp_path / "mountinfo"
    mounts.write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        f"99 22 0:50 / {tmp_path}/shared rw,relatime - nfs4 server:/export rw\n"
    )
    (tmp_path / "shared").mkdir()
    assert ledger_module.network_filesystem(tmp_path / "shared" / "l.sqlite", str(mounts)) == "nfs4"
    assert ledger_module.network_filesystem(tmp_path / "local.sqlite", str(mounts)) is None
    assert ledger_module.network_filesystem(tmp_path / "sharedx" / "l.sqlite", str(mounts)) is None  # a prefix only
    real = ledger_module.network_filesystem
    monkeypatch.setattr(ledger_module, "network_filesystem", lambda path: real(path, str(mounts)))
    path = tmp_path / "shared" / "l.sqlite"
    with pytest.raises(LedgerError, match="expected a local filesystem, found nfs4"):
        Ledger.open(path, make_config(), initial_state=fresh_state())
    assert not path.exists()  # nothing created


class TestCommitSizeDoesNotDependOnWhoStopped:
    """A commit's disk write (WAL frames, then one fsync) must not tell who stopped (privacy.md §8, §9).

    Review finding: SQLite overwrites a same-size blob page by page and writes only the pages whose
    bytes changed, so ``UPDATE state`` wrote more pages the more units newly stopped or changed, and
    almost none when every unit had stopped (60,000 units: 1.55 MB of WAL, 2.55 MB with 300 newly
    stopped, 0.57 MB with all stopped). The state and quota rows are now deleted and inserted whole.
    """

    UNITS = 20_000  # each blob spans dozens of 4 KiB pages

    def _frames_of_second_commit(self, folder: Path, old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> int:
        path = folder / "ledger.sqlite"
        config = make_config(n_units=self.UNITS)
        with Ledger.open(path, config, initial_state=fresh_state(self.UNITS)) as ledger:
            release = {"noise_std": 2.0, "l2_norms": np.zeros(self.UNITS), "kind": "gaussian"}
            quota = {"spent": np.zeros(self.UNITS), "stopped": np.zeros(self.UNITS, np.bool_)}
            quota["halt_round"] = np.full(self.UNITS, -1, np.int64)

            def commit(request_id: str, state: dict[str, np.ndarray]) -> None:
                ledger.commit(
                    request_id=request_id,
                    message_type="fit",
                    run_id="run-1",
                    digest=digest(request_id),
                    release=release,
                    new_state=state,
                    reply=b"r" * 64,
                    federation="alpha",
                    quota_state={**quota, "spent": state["spent"], "stopped": state["stopped"]},
                )

            commit("req-1", old)
            checkpointer = sqlite3.connect(path)
            try:
                checkpointer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                commit("req-2", new)
                _, frames, _ = checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            finally:
                checkpointer.close()
        return int(frames)

    def test_the_same_frames_whoever_stopped(self, tmp_path: Path) -> None:
        rng = np.random.default_rng(0)
        n = self.UNITS
        spent = rng.random(n) * 0.5
        cases: dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}
        # Every active unit pays a little more; nobody stops.
        cases["none stop"] = (
            {"spent": spent, "stopped": np.zeros(n, np.bool_)},
            {"spent": spent + 1e-3, "stopped": np.zeros(n, np.bool_)},
        )
        newly = np.zeros(n, np.bool_)
        newly[rng.choice(n, 300, replace=False)] = True
        cases["300 newly stop"] = (
            {"spent": spent, "stopped": np.zeros(n, np.bool_)},
            {"spent": np.where(newly, 1.0, spent + 1e-3), "stopped": newly},
        )
        gone = {"spent": np.ones(n), "stopped": np.ones(n, np.bool_)}
        cases["all stopped before"] = (gone, {k: v.copy() for k, v in gone.items()})  # nothing changes
        frames = {}
        for i, (name, (old, new)) in enumerate(cases.items()):
            folder = tmp_path / str(i)
            folder.mkdir()
            frames[name] = self._frames_of_second_commit(folder, old, new)
        assert len(set(frames.values())) == 1, frames
        assert frames["none stop"] > 2 * (n * 9 // 4096)  # the state and quota blobs were written whole

    def test_an_update_in_place_would_show_it(self, tmp_path: Path) -> None:
        """The witness has power: SQLite's same-size UPDATE writes only the changed pages."""
        path = tmp_path / "plain.sqlite"
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, blob BLOB NOT NULL)")
            blob = np.random.default_rng(1).bytes(200_000)
            conn.execute("INSERT INTO t VALUES (1, ?)", (blob,))
            written = {}
            for name, new in (("same", blob), ("one byte", blob[:-1] + bytes([blob[-1] ^ 1])), ("all", blob[::-1])):
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                conn.execute("UPDATE t SET blob = ? WHERE id = 1", (new,))
                written[name] = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
                conn.execute("UPDATE t SET blob = ? WHERE id = 1", (blob,))
        finally:
            conn.close()
        assert written["same"] < written["one byte"] < written["all"], written
