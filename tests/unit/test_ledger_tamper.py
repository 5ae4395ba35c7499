"""A ledger file that was tampered with, restored or planted is refused, never answered from (issue 25).

Three attacks a file-level change makes possible, each shown to work without the defence and to be
refused with it:

- a trigger in the ledger's schema that puts the old state back after every commit (unlimited
  budget, with every checksum valid);
- a release blob that inflates (a 1 MiB deflated member declaring much more) or declares a shape
  its bytes do not hold;
- a ledger restored from an older copy (its spend forgotten): the high-water mark refuses it.
"""

from __future__ import annotations

import io
import re
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from client_agent.high_water import HighWater, HighWaterError, default_path
from client_agent.ledger import Ledger, LedgerError, _decode
from client_agent.ledger_report import verify_ledger
from protocol import messages as wire
from protocol.npz import ArchiveError
from tests.factories import build_agent, gradient_request
from tests.unit.test_ledger import commit_round, fresh_state, make_config


def restore_old_state(path: Path) -> str:
    """A trigger that puts the state as it is now back after every commit (which deletes and inserts the row)."""
    conn = sqlite3.connect(path)
    try:
        sha, blob = conn.execute("SELECT sha256, blob FROM state WHERE id = 1").fetchone()
    finally:
        conn.close()
    return (
        "CREATE TRIGGER undo AFTER INSERT ON state BEGIN "
        f"UPDATE state SET sha256 = '{sha}', blob = X'{bytes(blob).hex()}' WHERE id = 1; END"
    )


def new_ledger(path: Path, *, high_water: Path | None = None, rounds: int = 2) -> None:
    with Ledger.open(path, make_config(), initial_state=fresh_state(), high_water=high_water) as ledger:
        for i in range(rounds):
            commit_round(ledger, f"req-{i}")


def agent_ledger(folder: Path, requests: int = 2, **over: object) -> Path:
    """A real agent's ledger (so ``ledger verify`` can replay it) after ``requests`` answered gradients."""
    agent = build_agent(folder, **{"policy-min-noise-std": 1.0, **over})
    try:
        for i in range(requests):
            outcome = agent.handle(wire.GRADIENT, *wire.encode_request(gradient_request(f"g{i}", round=i + 1)))
            assert outcome.error_code == 0, outcome.error_reason
    finally:
        agent.close()
    return folder / "ledger.sqlite"


def plant(path: Path, sql: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(sql)
    finally:
        conn.close()


# --------------------------------------------------------------------------- foreign schema objects


def test_a_trigger_that_undoes_every_commit_gives_unlimited_budget_without_the_schema_check(tmp_path: Path) -> None:
    """The attack itself, on a handle opened as ``ledger verify`` opens one (foreign objects allowed)."""
    path = tmp_path / "ledger.sqlite"
    new_ledger(path)
    plant(path, restore_old_state(path))
    with Ledger.open_existing(path, allow_foreign=True) as ledger:
        before = ledger.state()["spent"].copy()
        for i in range(5):
            commit_round(ledger, f"extra-{i}", spend=0.3)  # 1.5 in all: past every unit's budget of 1
            ledger.state()  # the handle re-reads what the trigger left
        assert np.array_equal(ledger.state()["spent"], before)  # nothing was ever charged
        assert ledger.requests_answered() == 7


@pytest.mark.parametrize(
    "sql, named",
    [
        (restore_old_state, "trigger 'undo'"),
        ("CREATE VIEW shown AS SELECT * FROM requests", "view 'shown'"),
        ("CREATE TABLE notes (x)", "table 'notes'"),
        ("CREATE INDEX by_type ON requests (message_type)", "index 'by_type'"),
    ],
)
def test_the_agent_refuses_a_ledger_holding_objects_it_did_not_create(
    tmp_path: Path, sql: str | Callable[[Path], str], named: str
) -> None:
    path = agent_ledger(tmp_path)
    assert verify_ledger(path) == []
    plant(path, sql if isinstance(sql, str) else sql(path))
    with pytest.raises(LedgerError, match=f"expected only the tables and indexes fedfilter creates, found {named}"):
        build_agent(tmp_path, **{"policy-min-noise-std": 1.0})
    assert verify_ledger(path) == [f"schema: {named} was not created by fedfilter"]


def test_an_altered_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    new_ledger(path)
    plant(path, "ALTER TABLE requests ADD COLUMN note TEXT")
    with pytest.raises(LedgerError, match="found missing or altered table 'requests'"):
        Ledger.open(path, make_config())


def version_2(path: Path) -> None:
    """A ledger as schema version 2 left it (before version 3's two indexes)."""
    new_ledger(path)
    for sql in (
        "DROP INDEX requests_by_federation_time",
        "DROP INDEX requests_by_federation_run",
        "UPDATE meta SET value = '2' WHERE key = 'schema_version'",
    ):
        plant(path, sql)


def test_an_older_ledger_holding_a_trigger_is_refused_for_it_and_never_migrated(tmp_path: Path) -> None:
    # A migration writes to meta: a trigger on it would run on the agent's behalf. It is left as it is, and
    # the refusal names the trigger rather than saying that a migration would do (a review of 2026-11-27).
    path = tmp_path / "ledger.sqlite"
    version_2(path)
    plant(path, "CREATE TRIGGER t AFTER UPDATE ON meta BEGIN UPDATE state SET sha256 = sha256 WHERE id = 1; END")
    before = path.read_bytes()
    for migrate in (False, True):
        with pytest.raises(LedgerError, match="fedfilter creates, found trigger 't'"):
            Ledger.open_existing(path, migrate=migrate)
    with pytest.raises(LedgerError, match="fedfilter creates, found trigger 't'"):
        Ledger.open(path, make_config())  # an agent's open migrates too
    assert path.read_bytes() == before


def test_an_older_ledger_with_a_view_for_its_meta_is_refused_without_reading_it(tmp_path: Path) -> None:
    # The migration read meta before it compared the schema: a view named meta that never ends hung every
    # agent's open of the file (a review of 2026-11-27). Run where a hang is a failure, not a stuck suite.
    path = tmp_path / "ledger.sqlite"
    version_2(path)
    plant(path, "ALTER TABLE meta RENAME TO meta_kept")
    plant(
        path,
        "CREATE VIEW meta AS WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) "
        "SELECT 'schema_version' AS key, '2' AS value FROM n WHERE x < 0",
    )
    code = (
        "import sys\n"
        "from client_agent.ledger import Ledger, LedgerError\n"
        "from tests.unit.test_ledger import make_config\n"
        "for open_ in (lambda: Ledger.open_existing(sys.argv[1], migrate=True), "
        "lambda: Ledger.open(sys.argv[1], make_config())):\n"
        "    try:\n"
        "        open_()\n"
        "    except LedgerError as exc:\n"
        "        print('refused:', exc)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    refusals = done.stdout.splitlines()
    assert len(refusals) == 2, refusals
    assert all(re.search("found missing or altered .*table 'meta'", r) for r in refusals), refusals


def test_a_schema_changed_after_open_stops_the_next_commit(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    new_ledger(path)
    with Ledger.open(path, make_config()) as ledger:
        plant(path, restore_old_state(path))
        before = ledger.state()
        with pytest.raises(LedgerError, match="expected the schema this handle checked at open"):
            commit_round(ledger, "req-x")
        assert ledger.lookup("req-x") is None and np.array_equal(ledger.state()["spent"], before["spent"])


# --------------------------------------------------------------------------- blobs


def deflated_blob(n_bytes: int) -> bytes:
    buf = io.BytesIO()
    member = io.BytesIO()
    np.save(member, np.zeros(n_bytes // 8))
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("l2_norms.npy", member.getvalue())
    return buf.getvalue()


def test_a_deflated_blob_is_refused_before_it_inflates() -> None:
    blob = deflated_blob(64 << 20)  # 64 MiB of zeros in about 64 KiB
    assert len(blob) < 1 << 20
    with pytest.raises(ArchiveError, match=r"expected stored \.npy members"):
        _decode(blob)


def test_a_member_declaring_more_than_its_bytes_is_refused() -> None:
    member = io.BytesIO()
    np.save(member, np.zeros(4))
    lying = member.getvalue().replace(b"'shape': (4,)", b"'shape': (9,)")  # same length, bigger claim
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("spent.npy", lying)
    with pytest.raises(ArchiveError, match=r"declares shape \(9,\)"):
        _decode(buf.getvalue())


def test_a_planted_release_blob_is_a_corrupt_ledger_in_verify(tmp_path: Path) -> None:
    path = agent_ledger(tmp_path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("UPDATE requests SET release = ? WHERE seq = 1", (deflated_blob(64 << 20),))
    conn.close()
    with pytest.raises(LedgerError, match=r"release of request 'g0' does not decode: blob: expected stored"):
        verify_ledger(path)


# --------------------------------------------------------------------------- rollback


def test_a_restored_ledger_spends_the_budget_twice_without_its_mark_and_is_refused_with_it(tmp_path: Path) -> None:
    path, mark = tmp_path / "ledger.sqlite", tmp_path / "marks" / "ledger.mark"
    mark.parent.mkdir()
    new_ledger(path, high_water=mark, rounds=2)
    backup = tmp_path / "backup.sqlite"
    shutil.copy(path, backup)
    with Ledger.open(path, make_config(), high_water=mark) as ledger:
        for i in range(2, 9):
            commit_round(ledger, f"req-{i}")  # 0.9 spent in all
        spent_now = ledger.state()["spent"].copy()
    shutil.copy(backup, path)  # the owner "restores it from a backup"

    with Ledger.open(path, make_config()) as restored:  # the attack: no mark, the old spend is back
        assert np.all(restored.state()["spent"] < spent_now - 0.5)
    with pytest.raises(LedgerError, match="found one rolled back to 2 requests"):
        Ledger.open(path, make_config(), high_water=mark)


def test_a_deployed_agent_keeps_a_mark_by_default_and_verify_reports_a_rollback(tmp_path: Path) -> None:
    from client_agent.agent import Agent
    from client_agent.config import parse_agent_config
    from tests.factories import node_config

    deployed = {"policy-min-noise-std": 1.0, "policy-max-clip": 10.0}  # a deployed agent states both
    config = parse_agent_config(node_config(tmp_path, **deployed))
    assert config.high_water_path == default_path(tmp_path / "ledger.sqlite")
    agent = Agent(config)
    request = wire.encode_request(gradient_request("g0"))
    assert agent.handle(wire.GRADIENT, *request).error_code == 0
    agent.close()
    path = tmp_path / "ledger.sqlite"
    shutil.copy(path, tmp_path / "backup.sqlite")
    agent = Agent(config)
    assert agent.handle(wire.GRADIENT, *wire.encode_request(gradient_request("g1", round=2))).error_code == 0
    agent.close()
    assert verify_ledger(path) == []
    shutil.copy(tmp_path / "backup.sqlite", path)
    problems = verify_ledger(path)
    assert len(problems) == 1 and "rolled back to 1 requests" in problems[0]
    with pytest.raises(LedgerError, match="rolled back to 1 requests"):
        Agent(config)


def test_a_deleted_ledger_is_not_recreated_while_its_mark_exists(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    new_ledger(path, high_water=default_path(path))
    path.unlink()
    with pytest.raises(LedgerError, match="found no ledger file; a new ledger would reset every unit's budget"):
        Ledger.open(path, make_config(), initial_state=fresh_state(), high_water=default_path(path))
    assert not path.exists()


def test_another_ledger_at_the_path_is_refused(tmp_path: Path) -> None:
    path, other = tmp_path / "ledger.sqlite", tmp_path / "other" / "ledger.sqlite"
    new_ledger(path, high_water=default_path(path), rounds=1)
    new_ledger(other, rounds=5)  # a different ledger (its own creation time), further ahead
    shutil.copy(other, path)
    with pytest.raises(LedgerError, match="found another ledger"):
        Ledger.open(path, make_config(), high_water=default_path(path))


def test_a_mark_behind_the_ledger_is_the_crash_window_and_moves_up(tmp_path: Path) -> None:
    """Committed, then killed before the mark was written: accepted, and the mark catches up."""
    path = tmp_path / "ledger.sqlite"
    mark = default_path(path)
    new_ledger(path, high_water=mark, rounds=1)
    stale = mark.read_bytes()
    with Ledger.open(path, make_config(), high_water=mark) as ledger:
        commit_round(ledger, "req-1")
    mark.write_bytes(stale)
    with Ledger.open(path, make_config(), high_water=mark) as ledger:
        assert HighWater(mark, path).read() == ledger.mark()
        assert ledger.mark().seq == 2


def test_every_commit_advances_the_mark_and_a_damaged_mark_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    mark = default_path(path)
    with Ledger.open(path, make_config(), initial_state=fresh_state(), high_water=mark) as ledger:
        for i in range(3):
            commit_round(ledger, f"req-{i}")
            stored = HighWater(mark, path).read()
            assert stored == ledger.mark() and stored is not None and stored.seq == i + 1
    assert mark.stat().st_mode & 0o777 == 0o600
    mark.write_text("{not json")
    with pytest.raises(LedgerError, match="a damaged mark cannot tell a rolled-back ledger"):
        Ledger.open(path, make_config(), high_water=mark)


@pytest.mark.parametrize("seq", ["1e400", "2.5", "true", '"2"', "[" * 100_000 + "]" * 100_000])
def test_a_mark_whose_seq_is_no_count_is_damaged(tmp_path: Path, seq: str) -> None:
    # 1e400 raised OverflowError through int(), 2.5 was read as 2, deep nesting raised RecursionError
    path = tmp_path / "ledger.sqlite"
    mark = default_path(path)
    new_ledger(path, high_water=mark, rounds=1)
    good = HighWater(mark, path).read()
    assert good is not None
    mark.write_text(
        mark.read_text().replace(f'"seq": {good.seq}', f'"seq": {seq}').replace(f'"seq":{good.seq}', f'"seq":{seq}')
    )
    assert seq[:5] in mark.read_text()
    with pytest.raises(HighWaterError, match="a damaged mark cannot tell a rolled-back ledger"):
        HighWater(mark, path).read()
    with pytest.raises(LedgerError, match="a damaged mark cannot tell a rolled-back ledger"):
        Ledger.open(path, make_config(), high_water=mark)


def test_the_mark_never_moves_back(tmp_path: Path) -> None:
    """A reader that checked an older state (``agent check`` beside a serving agent) cannot lower it."""
    path = tmp_path / "ledger.sqlite"
    mark = default_path(path)
    new_ledger(path, high_water=mark, rounds=1)
    with Ledger.open(path, make_config(), high_water=mark) as ledger:
        older = ledger.mark()
        commit_round(ledger, "req-late")
        newer = ledger.mark()
    HighWater(mark, path).advance(older)  # the late writer
    assert HighWater(mark, path).read() == newer


def test_a_deleted_mark_is_refused_once_the_ledger_kept_one(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    backup = tmp_path / "backup.sqlite"
    new_ledger(path, high_water=default_path(path), rounds=1)
    shutil.copy(path, backup)  # taken after the mark was first kept: the backup says so too
    with Ledger.open(path, make_config(), high_water=default_path(path)) as ledger:
        commit_round(ledger, "req-more")
    shutil.copy(backup, path)
    default_path(path).unlink()  # restore the ledger and delete the mark that would refuse it
    with pytest.raises(LedgerError, match="the ledger records that one was kept"):
        Ledger.open(path, make_config(), high_water=default_path(path))


def test_a_copy_answered_elsewhere_and_put_back_ahead_of_the_mark_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    mark = default_path(path)
    new_ledger(path, high_water=mark, rounds=1)
    fork = tmp_path / "elsewhere" / "ledger.sqlite"
    fork.parent.mkdir()
    shutil.copy(path, fork)
    with Ledger.open(path, make_config(), high_water=mark) as ledger:  # here: one more request
        commit_round(ledger, "req-here")
    with Ledger.open(fork, make_config()) as ledger:  # there: two other requests, so it is ahead
        commit_round(ledger, "req-there-1")
        commit_round(ledger, "req-there-2")
    shutil.copy(fork, path)
    with pytest.raises(LedgerError, match="a different history"):
        Ledger.open(path, make_config(), high_water=mark)


def test_a_charge_committed_before_its_mark_failed_is_in_the_owners_audit_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hostile review: the mark's write failing after the commit (a full disk) refused the request, and the
    audit line said 'refused: ledger' with no cost, its retry 'replayed': the owner's log never showed a spend
    the ledger holds. The refusal stands (nothing is sent); its line now carries the committed charge."""
    import json

    from tests.factories import client_data

    audit = tmp_path / "audit.jsonl"
    extra = {"ledger-high-water": str(tmp_path / "mark"), "audit-log": str(audit)}
    agent = build_agent(tmp_path, client_data(6, seed=4), epsilon=4.0, **extra)
    write = HighWater._write

    def full_disk(self: HighWater, mark: object) -> None:
        raise HighWaterError("high-water mark: [Errno 28] No space left on device")

    monkeypatch.setattr(HighWater, "_write", full_disk)
    request = gradient_request("r1", noise_std=2.0)
    refused = agent.handle(wire.message_type_of(request), *wire.encode_request(request))
    assert refused.error_code == wire.ERR_LEDGER and "is committed: its charge stands" in refused.local_detail
    monkeypatch.setattr(HighWater, "_write", write)
    spent = agent.ledger.state()["spent"]
    assert agent.ledger.requests_answered() == 1 and np.all(spent > 0)
    agent.close()
    line = json.loads(audit.read_text().splitlines()[-1])
    assert line["outcome"] == "refused: ledger" and line["charge"] == "committed: it stands, though nothing was sent"
    assert line["units_charged"] == 6
    assert agent.gaussian is not None
    assert line["spend_share_max"] == pytest.approx(float(spent.max()) / agent.gaussian.threshold, rel=1e-12)
