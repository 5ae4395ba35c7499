"""The client's durable privacy ledger: one SQLite file per client (privacy.md §9).

This is the only client code that touches disk. It holds the ledger's fixed
configuration (filter, budgets, unit, trust mode), the filter state (named numpy
arrays stored as one checksummed blob) and every request answered (its digest,
what was released and charged, and the exact reply bytes).

Privacy notes:
- Charge before release: :meth:`Ledger.commit` stores the request, the release and
  the new filter state in one transaction and returns only once it is durable
  (``journal_mode=WAL``, ``synchronous=FULL``); the caller sends the reply after.
  A crash between commit and send can only over-count.
- Idempotent rounds: :meth:`Ledger.lookup` returns the stored reply for a request id
  already answered, so a repeat gets no new noise and no new charge.
- Never reset: an existing ledger is never recreated, repaired or overwritten, even
  when it is corrupt; opening it raises :class:`LedgerError` instead. Budgets, unit
  and trust mode are fixed when the ledger is created.
- A new ledger file appears atomically: it is built beside its final name and then
  hard-linked into place, so a ledger path is either absent or complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import io
import json
import math
import numbers
import os
import re
import secrets
import sqlite3
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Self, TypeVar

import numpy as np

from client_agent.high_water import HighWater, HighWaterError, Mark, fsync_path
from protocol.errors import FedfilterError
from protocol.messages import MONITOR
from protocol.npz import load_stored
from protocol.validate import as_float

SCHEMA_VERSION: Final = 3
"""Version of the ledger's table layout; any change to it is privacy-affecting (CHANGELOG).

2: every request names its federation (the coordinator whose socket it came over) and each federation
keeps its own per-unit spend against its quota (table ``quotas``).
3: indexes on (federation, created_at) and (federation, run_id), so that the policy's per-federation counts
(requests per run, per day) and a federation's first quota replay read that federation's entries only: a
count that scanned the table read every stored reply, and took time in proportion to the *other*
federations' volume (a hostile review: 0.02 ms with no other request, 62 ms with 1,000 of another
federation's 200 KB replies), which their own replies' timing would carry (privacy.md §11).
An older ledger is migrated in place, in one transaction, when an agent opens it (a version-1 ledger's
requests belong to federation ``default``; the monitor's owner is taken from its log, :data:`MONITOR_OWNER`)."""

APPLICATION_ID: Final = 0x46464C47  # "FFLG": marks an SQLite file as a fedfilter ledger
BUSY_TIMEOUT_MS: Final = 10_000
UNITS: Final = ("client", "record")
TRUST_MODES: Final = ("local", "central", "secagg")

_SQLITE_MAGIC: Final = b"SQLite format 3\x00"
_SQLITE_HEADER_BYTES: Final = 100
_ARRAY_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HEX_SHA256: Final = re.compile(r"[0-9a-f]{64}\Z")
_MAX_BLOB_ARRAYS: Final = 64  # a state or a release holds a handful of named arrays
_ARRAY_KINDS: Final = "biufcUS"  # bool, int, uint, float, complex, str, bytes: never objects
_CONFIG_FIELDS: Final = ("filter", "epsilon", "delta", "unit", "trust", "n_units", "params")
_FIXED_BECAUSE: Final = {
    "epsilon": "budgets are fixed when a ledger is created and are never changed",
    "delta": "budgets are fixed when a ledger is created and are never changed",
}
_FIXED_DEFAULT: Final = (
    "the filter, unit, trust mode and parameters are fixed when a ledger is created and are never changed"
)

DEFAULT_FEDERATION: Final = "default"
# Version 1's tables, and what turns them into version 2's: the statements are written so that a migrated
# ledger's schema text is exactly a new one's (SQLite appends an added column to the CREATE text).
_SCHEMA_V1: Final = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT",
    "CREATE TABLE state (id INTEGER PRIMARY KEY CHECK (id = 1), sha256 TEXT NOT NULL, blob BLOB NOT NULL) STRICT",
    "CREATE TABLE requests ("
    " request_id TEXT PRIMARY KEY, seq INTEGER NOT NULL UNIQUE, message_type TEXT NOT NULL, run_id TEXT NOT NULL,"
    " digest TEXT NOT NULL, created_at TEXT NOT NULL, release BLOB NOT NULL, reply BLOB NOT NULL) STRICT",
    "CREATE INDEX requests_by_run ON requests (run_id)",
)
_TO_V2: Final = (
    "ALTER TABLE requests ADD COLUMN federation TEXT NOT NULL DEFAULT 'default'",
    "CREATE TABLE quotas (federation TEXT PRIMARY KEY, sha256 TEXT NOT NULL, blob BLOB NOT NULL) STRICT",
)
_TO_V3: Final = (
    "CREATE INDEX requests_by_federation_time ON requests (federation, created_at)",
    "CREATE INDEX requests_by_federation_run ON requests (federation, run_id)",
)
_SCHEMA: Final = _SCHEMA_V1 + _TO_V2 + _TO_V3
# An older version's schema, and the statements that bring it to this one.
_OLDER: Final = {"1": (_SCHEMA_V1, _TO_V2 + _TO_V3), "2": (_SCHEMA_V1 + _TO_V2, _TO_V3)}
# The ``meta`` key naming the federation whose monitor reports used the agent's monitor reservation: set by
# the first monitor report's commit, in its transaction; a monitor report for any other federation is then
# refused (the reservation covers one halt event per unit, privacy.md §7, §11). A ledger migrated from an
# older version takes it from its first stored monitor report.
MONITOR_OWNER: Final = "monitor_federation"
# A federation's own spend against its quota, one entry per unit (client_agent/agent.py).
QUOTA_LAYOUT: Final = {"spent": np.dtype(np.float64), "stopped": np.dtype(np.bool_), "halt_round": np.dtype(np.int64)}

Arrays = dict[str, np.ndarray]
_T = TypeVar("_T")


class LedgerError(FedfilterError, RuntimeError):
    """A ledger cannot be used as asked; the message names what was expected and what was found."""


class CommittedError(LedgerError):
    """The request's transaction is committed (its charge stands), but what follows the commit failed (the
    high-water mark did not advance): the request is refused all the same, and the owner's audit line shows
    the charge (client_agent/agent.py)."""


def _corrupt(path: Path, detail: object) -> LedgerError:
    """The one error for a ledger file that cannot be trusted: it is never reset."""
    return LedgerError(
        f"ledger {path} is corrupt or not a fedfilter ledger: {detail}; refusing to answer; "
        "it is never reset; do not answer from an older copy (docs/deploy.md, 'A corrupt or lost ledger')"
    )


# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class LedgerConfig:
    """What a ledger is fixed to when it is created: filter, budgets, privacy unit and trust mode.

    Privacy note: a stored ledger's configuration is never changed; opening it with a different
    one is an error (privacy.md §9). ``params`` holds JSON-able filter details (threshold, reserved
    monitor cost, orders, realisation parameters, data fingerprint...) and is kept as an immutable
    canonical copy. Invalid values raise ``ValueError`` naming the parameter and the value received.
    """

    filter: str
    epsilon: float
    delta: float
    unit: str
    trust: str
    n_units: int
    params: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.filter, str) or not self.filter:
            raise ValueError(f"LedgerConfig.filter: expected a non-empty str, found {self.filter!r}")
        object.__setattr__(self, "epsilon", _positive_finite("epsilon", self.epsilon))
        delta = _real("delta", self.delta)
        if not 0.0 < delta < 1.0:
            raise ValueError(f"LedgerConfig.delta: expected 0 < delta < 1, found {self.delta!r}")
        object.__setattr__(self, "delta", delta)
        if self.unit not in UNITS:
            raise ValueError(f"LedgerConfig.unit: expected one of {UNITS}, found {self.unit!r}")
        if self.trust not in TRUST_MODES:
            raise ValueError(f"LedgerConfig.trust: expected one of {TRUST_MODES}, found {self.trust!r}")
        if isinstance(self.n_units, bool) or not isinstance(self.n_units, numbers.Integral) or self.n_units < 1:
            raise ValueError(f"LedgerConfig.n_units: expected an int >= 1, found {self.n_units!r}")
        object.__setattr__(self, "n_units", int(self.n_units))
        if not isinstance(self.params, Mapping) or not all(isinstance(k, str) for k in self.params):
            raise ValueError(f"LedgerConfig.params: expected a mapping with str keys, found {self.params!r}")
        try:
            canonical = json.dumps(dict(self.params), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"LedgerConfig.params: expected JSON-able finite values, found {self.params!r}: {exc}"
            ) from exc
        object.__setattr__(self, "params", types.MappingProxyType(json.loads(canonical)))

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configurations give equal strings."""
        fields = {name: getattr(self, name) for name in _CONFIG_FIELDS}
        fields["params"] = dict(self.params)
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> LedgerConfig:
        """Parse :meth:`to_json` output; unknown or missing fields raise ``ValueError``."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != set(_CONFIG_FIELDS):
            found = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"LedgerConfig JSON: expected fields {sorted(_CONFIG_FIELDS)}, found {found}")
        return cls(**data)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"LedgerConfig.{name}: expected a real number, found {value!r}")
    return as_float(f"LedgerConfig.{name}", value, error=ValueError)  # type: ignore[arg-type]


def _positive_finite(name: str, value: object) -> float:
    number = _real(name, value)
    if not (math.isfinite(number) and number > 0.0):
        raise ValueError(f"LedgerConfig.{name}: expected a finite number > 0, found {value!r}")
    return number


def _config_mismatch(path: Path, stored: LedgerConfig, given: LedgerConfig) -> LedgerError | None:
    """The first field where ``given`` differs from the ``stored`` configuration, as an error."""
    for name in _CONFIG_FIELDS:
        old, new = getattr(stored, name), getattr(given, name)
        if name == "params":
            keys = sorted(set(old) | set(new))
            diff = next((k for k in keys if k not in old or k not in new or old[k] != new[k]), None)
            if diff is None:
                continue
            name = f"params[{diff!r}]"
            old, new = old.get(diff, "<absent>"), new.get(diff, "<absent>")
        elif old == new:
            continue
        return LedgerError(
            f"ledger {path} was created with {name}={old!r}; the agent's configuration says {name}={new!r}: "
            f"{_FIXED_BECAUSE.get(name, _FIXED_DEFAULT)}"
        )
    return None


# --------------------------------------------------------------------------- array blobs


def _checked_arrays(what: str, arrays: Mapping[str, Any]) -> Arrays:
    """Named arrays as numpy arrays, refusing names or dtypes that cannot round-trip without pickle."""
    if not isinstance(arrays, Mapping) or not arrays:
        raise LedgerError(f"{what}: expected a non-empty mapping of name -> array, found {arrays!r}")
    checked: Arrays = {}
    for name, value in arrays.items():
        if not isinstance(name, str) or not _ARRAY_NAME.match(name):
            raise LedgerError(f"{what}: expected array names matching {_ARRAY_NAME.pattern}, found {name!r}")
        array = np.asarray(value)
        if array.dtype.kind not in _ARRAY_KINDS:
            raise LedgerError(f"{what}[{name!r}]: expected a bool/int/float/complex/str array, found {array.dtype}")
        checked[name] = array
    return checked


def _encode(arrays: Arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays)
    return buffer.getvalue()


def _decode(blob: bytes) -> Arrays:
    """Arrays from a stored .npz blob, at most the blob's own size decoded (protocol.npz); else ValueError."""
    return load_stored(bytes(blob), what="blob", max_members=_MAX_BLOB_ARRAYS)


def _layout(arrays: Arrays) -> dict[str, dict[str, object]]:
    return {name: {"shape": list(a.shape), "dtype": a.dtype.str} for name, a in sorted(arrays.items())}


def _describe(entry: Mapping[str, Any] | None) -> str:
    if entry is None:
        return "no such array"
    dtype = np.dtype(entry["dtype"])
    return f"shape {tuple(entry['shape'])} dtype {dtype.name if dtype.isnative else dtype.str}"


def _layout_mismatch(expected: Mapping[str, Any], found: Mapping[str, Any]) -> str | None:
    """Where two state layouts differ, as 'array X: expected ..., found ...', or None."""
    for name in sorted(set(expected) | set(found)):
        if expected.get(name) != found.get(name):
            return f"array {name!r}: expected {_describe(expected.get(name))}, found {_describe(found.get(name))}"
    return None


def _sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


# --------------------------------------------------------------------------- the ledger


@dataclasses.dataclass(frozen=True)
class StoredRequest:
    """A request already answered: its digest, what was released and charged, and the exact reply."""

    request_id: str
    message_type: str
    run_id: str
    digest: str
    created_at: str
    reply: bytes
    release: Arrays


def qualified_id(federation: str, key: str) -> str:
    """Where ``federation``'s request ``key`` is stored: the key itself for ``default`` (every ledger before
    federations), else ``|federation|key``. Request and session ids never hold '|' (protocol.messages), so
    no two federations' keys meet, and a key of ``default`` never starts with '|'."""
    return key if federation == DEFAULT_FEDERATION else f"|{federation}|{key}"


class FederationLedger:
    """The lookups of one federation: its request and session ids, in its own namespace of the ledger."""

    def __init__(self, ledger: Ledger, federation: str) -> None:
        self.ledger, self.federation = ledger, federation

    def lookup(self, request_id: str) -> StoredRequest | None:
        return self.ledger.lookup(qualified_id(self.federation, request_id))


@dataclasses.dataclass(frozen=True)
class StateRead:
    """What a read of the state saw: the state's sha256 and how many requests the ledger held."""

    sha: str
    requests: int


class Ledger:
    """One client's durable privacy ledger; open it with :meth:`open` or :meth:`open_existing`.

    Privacy note: charge before release (:meth:`commit` is durable before it returns) and never
    reset (an existing file is only ever read, checked and appended to).
    """

    def __init__(self, path: Path, conn: sqlite3.Connection, contents: _Contents) -> None:
        self._path = path
        self._conn: sqlite3.Connection | None = conn
        self._config = contents.config
        self._layout = contents.layout
        self._ledger_id = contents.ledger_id
        self._created_at = contents.created_at
        self._tag_salt = contents.tag_salt
        self._schema_version = contents.schema_version
        self.foreign_objects = contents.foreign
        self._marked = contents.marked
        self._state_sha = ""
        self._state_seq = -1  # how many requests the ledger held when this handle last read the state
        self._high_water: HighWater | None = None
        self._held: tuple[int, int] | None = None  # this handle's count in _HELD, released after its connection
        # Cursors of log() and releases() a caller may leave unfinished: closed before the connection, whose
        # close would otherwise leave SQLite's files open (a "zombie") after _HELD released the file.
        self._cursors: weakref.WeakSet[sqlite3.Cursor] = weakref.WeakSet()

    # ----- opening

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        config: LedgerConfig,
        *,
        initial_state: Mapping[str, Any] | None = None,
        high_water: str | os.PathLike[str] | None = None,
    ) -> Self:
        """Open the ledger at ``path``, creating it (with ``initial_state``) if it does not exist.

        Privacy note: an existing ledger must match ``config`` field by field and, when given, the
        layout of ``initial_state``; it is never recreated or reset, even when it is corrupt. With
        ``high_water`` (a mark file, :mod:`client_agent.high_water`), a ledger older than its last
        commit, another ledger at its path, or a missing ledger whose mark exists, is refused, and
        every commit advances the mark.
        """
        ledger_path = Path(path)
        if not isinstance(config, LedgerConfig):
            raise LedgerError(f"ledger {ledger_path}: expected a LedgerConfig, found {type(config).__name__}")
        state = (
            None if initial_state is None else _checked_arrays(f"ledger {ledger_path}: initial_state", initial_state)
        )
        mark = None if high_water is None else HighWater(Path(high_water), ledger_path)
        remote = network_filesystem(ledger_path)
        if remote is not None:
            raise LedgerError(
                f"ledger {ledger_path}: expected a local filesystem, found {remote}: SQLite's WAL, which every "
                "commit goes through, works on one host only (its index is shared memory), so two hosts could "
                "each commit against their own view and one spend would overwrite the other; keep ledgers on a "
                "local disk"
            )
        if ledger_path.exists():
            _migrate(ledger_path)
        if not ledger_path.exists():
            if state is None:
                raise LedgerError(f"ledger {ledger_path}: expected an initial_state to create a new ledger, found None")
            if mark is not None:
                _high_water_call(mark.refuse_creation)
            _create(ledger_path, config, state)
        ledger = cls._open_checked(ledger_path)
        try:
            if mark is not None:
                ledger._watch(mark)
            mismatch = _config_mismatch(ledger_path, ledger._config, config)
            if mismatch is not None:
                raise mismatch
            if state is not None and (diff := _layout_mismatch(ledger._layout, _layout(state))) is not None:
                raise LedgerError(
                    f"ledger {ledger_path} holds a different state from the agent's initial_state: {diff}"
                )
            if not ledger._tag_salt:  # a ledger made before salts gets one when an agent first opens it
                ledger._draw_salt()
        except BaseException:
            ledger.close()
            raise
        return ledger

    def _draw_salt(self) -> None:
        """Give a ledger made before salts its ``tag_salt`` (:meth:`run_tag`): drawn once, kept by every later open
        (two processes drawing at once keep the first one written; both read it back)."""
        try:
            conn = self._connection()
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('tag_salt', ?)", (secrets.token_hex(16),))
            row = conn.execute("SELECT value FROM meta WHERE key = 'tag_salt'").fetchone()
        except sqlite3.Error as exc:
            raise _corrupt(self._path, exc) from exc
        self._tag_salt = str(row[0])

    @classmethod
    def open_existing(cls, path: str | os.PathLike[str], *, allow_foreign: bool = False, migrate: bool = False) -> Self:
        """Open an existing ledger without a configuration to compare (for ``ledger show`` / ``verify``).

        ``allow_foreign`` (``ledger verify`` only, which writes nothing) opens a ledger whose schema
        holds objects fedfilter did not create, listed in :attr:`foreign_objects`; an agent never does.
        ``migrate``: bring an older ledger to this version first, as an agent's open does (for a reader that
        owns the file, e.g. a campaign branching from a run it finished before a schema change; the
        migration drops and rewrites nothing, so the ledger's id, state and spend are unchanged).
        """
        ledger_path = Path(path)
        if not ledger_path.exists():
            raise LedgerError(f"ledger {ledger_path}: expected an existing ledger file, found nothing at that path")
        if migrate:
            _migrate(ledger_path)
        return cls._open_checked(ledger_path, allow_foreign=allow_foreign)

    def _watch(self, high_water: HighWater) -> None:
        """Check the ledger against its high-water mark, bring the mark up to it, and advance it at every commit."""
        found = self.mark()
        problem = _high_water_call(
            lambda: high_water.check(found, marked=self._marked, request_at=self.request_fingerprint)
        )
        if problem is not None:
            raise LedgerError(
                f"ledger {self._path}: {problem}; refusing to answer: a rolled-back ledger spends budget twice "
                "(docs/deploy.md, 'A corrupt or lost ledger')"
            )
        if _high_water_call(high_water.read) != found:
            _high_water_call(lambda: high_water.advance(found))
        if not self._marked:  # from now on a missing mark is refused (a backup taken later carries this too)
            try:
                self._connection().execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('high_water', 'kept')")
            except sqlite3.Error as exc:
                raise _corrupt(self._path, exc) from exc
            self._marked = True
        self._high_water = high_water

    @property
    def marked(self) -> bool:
        """Whether the ledger records that a high-water mark is kept for it."""
        return self._marked

    def request_fingerprint(self, seq: int) -> str:
        """The high-water mark's fingerprint of the request at ``seq`` ("" when there is none)."""
        row = self._query_one("SELECT request_id, created_at FROM requests WHERE seq = ?", (int(seq),))
        return "" if row is None else _fingerprint(str(row[0]), str(row[1]))

    def mark(self) -> Mark:
        """The ledger's position: its id, how many requests it has answered and its state's sha256."""
        (seq,) = self._query_one("SELECT COALESCE(MAX(seq), 0) FROM requests")
        row = self._query_one("SELECT sha256 FROM state WHERE id = 1")
        if row is None:
            raise _corrupt(self._path, "expected one state row, found none")
        return Mark(self._ledger_id, int(seq), str(row[0]), self.request_fingerprint(int(seq)) if seq else "")

    @classmethod
    def _open_checked(cls, path: Path, *, allow_foreign: bool = False) -> Self:
        """Connect read-mostly and check header, integrity, schema version, config and state checksum."""
        held = _check_header(path)
        try:
            conn = sqlite3.connect(
                path.absolute().as_uri() + "?mode=rw", uri=True, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000
            )
        except sqlite3.Error as exc:  # SQLite could not open the file (descriptors, permissions): not its content
            _HELD.release(held)
            raise LedgerError(f"ledger {path}: expected to open it, found SQLite's error: {exc}") from exc
        try:
            contents = _check_contents(path, conn)
            if contents.foreign and not allow_foreign:
                raise _foreign(path, contents.foreign)
            _set_durable_pragmas(path, conn)
            try:
                now = os.stat(path)
            except OSError as exc:  # gone or unreadable since the header was read: an OS error, not corruption
                raise LedgerError(f"ledger {path}: expected to find it again after connecting, found {exc}") from exc
            if (now.st_dev, now.st_ino) != held:  # the connection's file is the one its descriptor holds
                raise LedgerError(
                    f"ledger {path}: expected the file whose header was checked, found another one at the path "
                    "(replaced while it was being opened); nothing was read from it"
                )
            _one_name(path, held)
            ledger = cls(path, conn, contents)
            ledger._held = held
            ledger.state()  # verifies the checksum and layout, and records the state this handle has seen
        except BaseException:
            conn.close()
            _HELD.release(held)
            raise
        return ledger

    # ----- reading

    @property
    def path(self) -> Path:
        """Where the ledger file lives."""
        return self._path

    def run_tag(self, federation: str, run_id: str) -> str:
        """This ledger's tag in one run (32 hex digits): the same for every node id answered from this file or a
        copy of it, and unlinkable across runs. A hash of the ledger's salt (128 random bits drawn at creation,
        readable by its owner only) with the federation and run id: no data (not the ledger's id, which hashes
        its configuration and so the data's digest), no spend, and no one without the file can compute it.
        A ledger made before salts gets one when an agent first opens it (copies made before that draw their
        own); without one (read by ``open_existing`` only), the creation time and the held file's device and
        inode. Enrolment drops a second node with the tag of one it already has (privacy.md §8)."""
        if self._tag_salt:
            text = f"fedfilter-ledger-run-tag|salt|{self._tag_salt}|{federation}|{run_id}"
        else:
            if self._held is not None:  # the file this handle holds, whatever is at the path now
                dev, ino = self._held
            else:
                st = os.stat(self._path)
                dev, ino = st.st_dev, st.st_ino
            text = f"fedfilter-ledger-run-tag|{self._created_at}|{dev}:{ino}|{federation}|{run_id}"
        return _sha256(text.encode())[:32]

    @property
    def config(self) -> LedgerConfig:
        """The configuration fixed when the ledger was created."""
        return self._config

    def state(self) -> Arrays:
        """The current filter state, after checking its sha256; a mismatch raises :class:`LedgerError`."""
        # One statement, one snapshot: the state and the number of requests it is the state after.
        row = self._query_one(
            "SELECT sha256, blob, (SELECT COALESCE(MAX(seq), 0) FROM requests) FROM state WHERE id = 1"
        )
        if row is None:
            raise _corrupt(self._path, "expected one state row, found none")
        stored_sha, blob, seq = row
        found_sha = _sha256(blob)
        if found_sha != stored_sha:
            raise _corrupt(self._path, f"state checksum: expected sha256 {stored_sha}, found {found_sha}")
        try:
            arrays = _decode(blob)
        except (ValueError, OSError, EOFError) as exc:
            raise _corrupt(self._path, f"state blob does not decode: {exc}") from exc
        if (diff := _layout_mismatch(self._layout, _layout(arrays))) is not None:
            raise _corrupt(self._path, f"stored state {diff}")
        self._state_sha, self._state_seq = stored_sha, int(seq)
        return arrays

    def lookup(self, request_id: str) -> StoredRequest | None:
        """The stored answer to ``request_id``, or None if it was never answered (idempotent rounds)."""
        row = self._query_one(
            "SELECT message_type, run_id, digest, created_at, reply, release FROM requests WHERE request_id = ?",
            (request_id,),
        )
        if row is None:
            return None
        message_type, run_id, digest, created_at, reply, release = row
        return StoredRequest(
            request_id,
            message_type,
            run_id,
            digest,
            created_at,
            bytes(reply),
            self._decode_release(request_id, release),
        )

    def quota_state(self, federation: str) -> Arrays | None:
        """``federation``'s own per-unit spend against its quota (None before its first request), checksum checked."""
        row = self._query_one("SELECT sha256, blob FROM quotas WHERE federation = ?", (federation,))
        if row is None:
            return None
        stored_sha, blob = row
        if _sha256(blob) != stored_sha:
            raise _corrupt(self._path, f"quota state of federation {federation!r}: checksum does not match")
        try:
            arrays = _decode(blob)
        except (ValueError, OSError, EOFError) as exc:
            raise _corrupt(self._path, f"quota state of federation {federation!r} does not decode: {exc}") from exc
        if (problem := self._quota_layout_problem(arrays)) is not None:
            raise _corrupt(self._path, f"quota state of federation {federation!r}: {problem}")
        return arrays

    def federations(self) -> list[str]:
        """Every federation that has a request in this ledger, or a quota state, sorted."""
        conn = self._connection()
        try:
            rows = conn.execute("SELECT federation FROM requests UNION SELECT federation FROM quotas").fetchall()
        except sqlite3.Error as exc:
            raise _corrupt(self._path, exc) from exc
        return sorted(str(row[0]) for row in rows)

    def _quota_layout_problem(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        expected = {name: {"shape": [self._config.n_units], "dtype": dtype.str} for name, dtype in QUOTA_LAYOUT.items()}
        return _layout_mismatch(expected, _layout(dict(arrays)))

    def log(
        self, *, since: str | None = None, federation: str | None = None
    ) -> Iterator[tuple[dict[str, object], Arrays]]:
        """Every answered request in commit order (the owner's audit trail): its row and its release record."""
        sql = (
            "SELECT seq, created_at, federation, message_type, run_id, request_id, length(reply), release FROM requests"
        )
        if federation is not None:
            # That federation's entries only, then sorted: SQLite would otherwise walk the seq index over every
            # row (a federation's first request replays its own log, client_agent/agent.py quota_state).
            sql += " INDEXED BY requests_by_federation_time"
        clauses, args = [], []
        if since is not None:
            clauses.append("created_at >= ?")
            args.append(since)
        if federation is not None:
            clauses.append("federation = ?")
            args.append(federation)
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        keys = ("seq", "created_at", "federation", "message_type", "run_id", "request_id", "reply_bytes")
        conn = self._connection()
        try:
            cursor = conn.execute(sql + " ORDER BY seq", args)
            self._cursors.add(cursor)
            for row in cursor:
                entry = dict(zip(keys, row[:-1], strict=True))
                yield entry, self._decode_release(str(entry["request_id"]), row[-1])
        except sqlite3.Error as exc:
            raise _corrupt(self._path, exc) from exc

    def charged_by(self, federation: str) -> np.ndarray:
        """What ``federation``'s stored Gaussian releases charged each unit, summed in commit order with the
        charge's own arithmetic ((norm / noise_std)^2 added to the spend so far), so it equals the quota spend
        the agent committed (realisation releases, monitor and secagg steps charge nothing here)."""
        spent = np.zeros(self._config.n_units)
        for _, arrays in self.log(federation=federation):
            if "l2_norms" not in arrays or "noise_std" not in arrays or "losses" in arrays:
                continue
            cost = np.divide(
                np.asarray(arrays["l2_norms"], dtype=np.float64), float(np.asarray(arrays["noise_std"])[0])
            )
            np.multiply(cost, cost, out=cost)
            spent = cost + spent
        return spent

    def monitor_owner(self) -> str | None:
        """The federation whose monitor reports used the monitor reservation (:data:`MONITOR_OWNER`), or None."""
        row = self._query_one("SELECT value FROM meta WHERE key = ?", (MONITOR_OWNER,))
        return None if row is None else str(row[0])

    def requests_answered(self) -> int:
        """How many requests this ledger has answered, over all runs."""
        return int(self._query_one("SELECT COUNT(*) FROM requests")[0])

    def requests_in_run(self, run_id: str, federation: str | None = None) -> int:
        """How many requests this ledger has answered in run ``run_id`` (of ``federation``, when given)."""
        if federation is None:
            return int(self._query_one("SELECT COUNT(*) FROM requests WHERE run_id = ?", (run_id,))[0])
        sql = "SELECT COUNT(*) FROM requests WHERE run_id = ? AND federation = ?"
        return int(self._query_one(sql, (run_id, federation))[0])

    def requests_since(self, moment: datetime, federation: str | None = None) -> int:
        """How many requests this ledger has answered at or after ``moment`` (a UTC datetime), over all runs
        (of ``federation``, when given)."""
        if moment.tzinfo is None:
            raise LedgerError(f"ledger {self._path}: expected a timezone-aware moment, found {moment!r}")
        since = moment.astimezone(UTC).isoformat(timespec="microseconds")
        if federation is None:
            return int(self._query_one("SELECT COUNT(*) FROM requests WHERE created_at >= ?", (since,))[0])
        sql = "SELECT COUNT(*) FROM requests WHERE created_at >= ? AND federation = ?"
        return int(self._query_one(sql, (since, federation))[0])

    def recent(self, limit: int) -> list[dict[str, object]]:
        """The last ``limit`` requests answered, newest first: seq, time, message type, run id and request id."""
        conn = self._connection()
        try:
            rows = conn.execute(
                "SELECT seq, created_at, message_type, run_id, request_id FROM requests ORDER BY seq DESC LIMIT ?",
                (int(limit),),
            ).fetchall()
        except sqlite3.Error as exc:
            raise _corrupt(self._path, exc) from exc
        keys = ("seq", "created_at", "message_type", "run_id", "request_id")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def releases(self) -> Iterator[tuple[str, str, Arrays]]:
        """``(request_id, message_type, release)`` in commit order, for replay and verification."""
        conn = self._connection()
        try:
            cursor = conn.execute("SELECT request_id, message_type, release FROM requests ORDER BY seq")
            self._cursors.add(cursor)
            for request_id, message_type, release in cursor:
                yield request_id, message_type, self._decode_release(request_id, release)
        except sqlite3.Error as exc:
            raise _corrupt(self._path, exc) from exc

    @property
    def last_read(self) -> StateRead:
        """The state this handle last read (or committed), as :meth:`commit` checks it: pass it as ``base``."""
        return StateRead(self._state_sha, self._state_seq)

    # ----- writing

    def commit(
        self,
        *,
        request_id: str,
        message_type: str,
        run_id: str,
        digest: str,
        release: Mapping[str, Any],
        new_state: Mapping[str, Any],
        reply: bytes,
        federation: str = DEFAULT_FEDERATION,
        quota_state: Mapping[str, Any] | None = None,
        base: StateRead | None = None,
        monitor_owner: bool = False,
    ) -> None:
        """Store a request, what it released and charged, and the new state, in one durable transaction.

        ``base``: :attr:`last_read` taken when the state ``new_state`` was computed from was read; the ledger
        must still be as it was then: the same state and no request committed since (default: the state this
        handle last read, which any later read moves on). The number of requests is checked, not only the
        state's checksum: a commit that leaves the state's bytes as they were still changes a federation's
        quota row, which a request computed from an older read would write back.

        ``federation``: whose socket the request came over; ``quota_state``: that federation's own
        per-unit spend after it (:data:`QUOTA_LAYOUT`), stored in the same transaction.
        ``monitor_owner``: the request is a monitor report; ``federation`` becomes the monitor's owner
        (:data:`MONITOR_OWNER`) if it has none, and the commit is refused if another federation owns it.

        Privacy note: charge before release. This returns only once the transaction is committed
        with ``synchronous=FULL``; send ``reply`` after it returns. On any failure the transaction
        is rolled back: neither the request nor the state changes. A request id already answered,
        a state whose array names, shapes or dtypes differ from the stored one, or a stored state
        changed by another process since this handle last read it, raise :class:`LedgerError`.
        """
        where = f"ledger {self._path}: commit of request {request_id!r}"
        for name, value in (("request_id", request_id), ("message_type", message_type), ("run_id", run_id)):
            if not isinstance(value, str) or not value:
                raise LedgerError(f"{where}: expected {name} to be a non-empty str, found {value!r}")
        if not isinstance(digest, str) or not _HEX_SHA256.match(digest):
            raise LedgerError(f"{where}: expected digest to be 64 lowercase hex digits (sha256), found {digest!r}")
        if not isinstance(reply, bytes | bytearray | memoryview):
            raise LedgerError(f"{where}: expected reply to be bytes, found {type(reply).__name__}")
        state = _checked_arrays(f"{where}: new_state", new_state)
        for name, array in state.items():
            # A NaN or infinite spend would be committed as every later request's starting point and
            # brick the ledger for good (every check after it fails): refuse it before it is stored.
            if array.dtype.kind in "fc" and not np.all(np.isfinite(array)):
                raise LedgerError(f"{where}: expected finite values in new_state[{name!r}], found NaN or infinity")
        if (diff := _layout_mismatch(self._layout, _layout(state))) is not None:
            raise LedgerError(f"{where}: new_state {diff}; the state's layout is fixed when the ledger is created")
        if not isinstance(federation, str) or not federation:
            raise LedgerError(f"{where}: expected federation to be a non-empty str, found {federation!r}")
        quota_blob = None
        if quota_state is not None:
            quota = _checked_arrays(f"{where}: quota_state", quota_state)
            if (problem := self._quota_layout_problem(quota)) is not None:
                raise LedgerError(f"{where}: quota_state {problem}")
            if not np.all(np.isfinite(quota["spent"])):
                raise LedgerError(f"{where}: expected finite values in quota_state['spent'], found NaN or infinity")
            quota_blob = _encode(quota)
        release_blob = _encode(_checked_arrays(f"{where}: release", release))
        state_blob = _encode(state)
        state_sha = _sha256(state_blob)
        created_at = datetime.now(UTC).isoformat(timespec="microseconds")

        conn = self._connection()
        if self._held is not None:
            _one_name(self._path, self._held)
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise LedgerError(f"{where}: expected to take the write lock, found: {exc}; nothing was stored") from exc
        try:
            if conn.execute("SELECT 1 FROM requests WHERE request_id = ?", (request_id,)).fetchone() is not None:
                raise LedgerError(f"{where}: expected a new request id, found it already answered; nothing was stored")
            (schema_version,) = conn.execute("PRAGMA schema_version").fetchone()
            if schema_version != self._schema_version:
                raise LedgerError(
                    f"{where}: expected the schema this handle checked at open (version {self._schema_version}), "
                    f"found version {schema_version}: another process changed it; nothing was stored"
                )
            (stored_sha,) = conn.execute("SELECT sha256 FROM state WHERE id = 1").fetchone()
            (seq,) = conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM requests").fetchone()
            read = self.last_read if base is None else base
            if StateRead(stored_sha, seq - 1) != read:
                raise LedgerError(
                    f"{where}: expected the ledger as the new state was computed from it (state sha256 "
                    f"{read.sha}, {read.requests} requests), found sha256 {stored_sha}, {seq - 1} requests: "
                    "another process committed; read state() again and recompute; nothing was stored"
                )
            if monitor_owner:
                conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (MONITOR_OWNER, federation))
                (owner,) = conn.execute("SELECT value FROM meta WHERE key = ?", (MONITOR_OWNER,)).fetchone()
                if owner != federation:
                    raise LedgerError(
                        f"{where}: expected the monitor reservation free or held by federation {federation!r}, found "
                        f"it used by federation {owner!r}; nothing was stored"
                    )
            conn.execute(
                "INSERT INTO requests (request_id, seq, message_type, run_id, digest, created_at, release, reply, "
                "federation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (request_id, seq, message_type, run_id, digest, created_at, release_blob, bytes(reply), federation),
            )
            # The state and quota rows are deleted and inserted whole, never updated: SQLite overwrites a
            # same-size blob page by page and skips the pages whose bytes did not change, so an UPDATE
            # wrote (and fsynced) more pages the more units changed or newly stopped, and fewer when all
            # had stopped (60,000 units: 1.55 MB of WAL with none stopped, 2.55 MB with 300 newly
            # stopped, 0.57 MB with all stopped). An insert writes every page of the row: the commit's
            # size depends on the arrays' sizes only (privacy.md §8, §9).
            conn.execute("DELETE FROM state WHERE id = 1")
            conn.execute("INSERT INTO state (id, sha256, blob) VALUES (1, ?, ?)", (state_sha, state_blob))
            if quota_blob is not None:
                conn.execute("DELETE FROM quotas WHERE federation = ?", (federation,))
                conn.execute(
                    "INSERT INTO quotas (federation, sha256, blob) VALUES (?, ?, ?)",
                    (federation, _sha256(quota_blob), quota_blob),
                )
            conn.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise LedgerError(f"{where}: expected to commit, found: {exc}; rolled back, nothing stored") from exc
            raise
        self._state_sha, self._state_seq = state_sha, int(seq)
        if self._high_water is not None:  # committed: the charge stands whatever happens to the mark
            high_water = self._high_water
            mark = Mark(self._ledger_id, int(seq), state_sha, _fingerprint(request_id, created_at))
            try:
                high_water.advance(mark)
            except HighWaterError as exc:
                raise CommittedError(f"{exc} (request {request_id!r} is committed: its charge stands)") from exc

    # ----- lifecycle

    def close(self) -> None:
        """Close the connection; closing twice is harmless."""
        if self._conn is not None:
            for cursor in list(self._cursors):
                cursor.close()
            self._conn.close()
            self._conn = None
        if self._held is not None:  # after the connection: the file's descriptors may close with the last handle
            held, self._held = self._held, None
            _HELD.release(held)

    def reopen(self) -> None:
        """Close this handle's connection and open the file again with every check of :meth:`open`.

        For a ledger another process wrote to since this handle last read it. The connection is
        closed first (a header read never closes a descriptor of a file another handle of this
        process holds, :class:`_HeldFiles`, which would drop that handle's POSIX locks and let another
        process delete the WAL it commits to). Then the file is read afresh and checked as an
        open checks it (header bytes, integrity, application id, schema objects and version, state
        checksum, and the high-water mark when one is kept), and it must be the ledger this handle
        opened: the same ledger id, configuration and state layout. Not repeated: the migration
        of an older version, which a ledger already at this version never needs (an older file is
        refused here, and the caller's full open migrates it). On any error the handle stays closed.
        """
        self.close()
        fresh = type(self)._open_checked(self._path)
        try:
            if fresh._ledger_id != self._ledger_id:
                raise LedgerError(f"ledger {self._path}: expected the ledger this agent opened, found another one")
            mismatch = _config_mismatch(self._path, self._config, fresh._config)
            if mismatch is not None:
                raise mismatch
            if (diff := _layout_mismatch(self._layout, fresh._layout)) is not None:
                raise LedgerError(f"ledger {self._path} holds another state layout than when it was opened: {diff}")
            if self._high_water is not None:
                fresh._watch(self._high_water)
        except BaseException:
            fresh.close()
            raise
        # Adopt the checked connection and what it read; the high-water mark object stays this handle's.
        self._conn, fresh._conn = fresh._conn, None
        self._held, fresh._held = fresh._held, None
        self._schema_version = fresh._schema_version
        self.foreign_objects = fresh.foreign_objects
        self._marked = fresh._marked
        self._state_sha, self._state_seq = fresh._state_sha, fresh._state_seq

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- helpers

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LedgerError(f"ledger {self._path}: expected an open ledger, found it closed")
        return self._conn

    def _query_one(self, sql: str, args: tuple[object, ...] = ()) -> Any:
        try:
            return self._connection().execute(sql, args).fetchone()
        except sqlite3.Error as exc:
            raise _corrupt(self._path, exc) from exc

    def _decode_release(self, request_id: str, blob: bytes) -> Arrays:
        try:
            return _decode(blob)
        except (ValueError, OSError, EOFError) as exc:
            raise _corrupt(self._path, f"release of request {request_id!r} does not decode: {exc}") from exc


# --------------------------------------------------------------------------- file-level checks


# Filesystems whose files another host can open: SQLite's WAL mode does not work on them (sqlite.org/wal.html,
# "all processes using a database must be on the same host computer").
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ncpfs",
        "afs",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "9p",
        "fuse.sshfs",
        "fuse.glusterfs",
        "fuse.s3fs",
        "fuse.rclone",
        "fuse.cephfs",
        "ocfs2",
        "gfs2",
    }
)


def network_filesystem(path: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the network filesystem ``path`` (or the folder it would be created in) lives on, else None.

    Read from the kernel's mount table (Linux); where there is none, None (nothing is known).
    """
    try:
        with open(mountinfo) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path if path.exists() else path.parent)
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        after = line.split(" - ", 1)[1].split()
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best) and after:
            best, kind = point, after[0]
    return kind if kind in NETWORK_FILESYSTEMS else None


class _HeldFiles:
    """The descriptors this process reads ledger headers through: per file (device, inode), kept open
    while any ledger handle of this process has that file open, and closed together after the last.

    POSIX drops every lock a process holds on a file when the process closes *any* descriptor of that
    file (https://www.sqlite.org/howtocorrupt.html, section 2.2). Had a header been read through a
    descriptor opened and closed while another handle of this process held an SQLite connection to the
    file, that connection's locks would be gone: another process closing its own connection would take
    itself for the last one, checkpoint and delete the WAL this connection still reads and commits to,
    and the next commit here would go on from a state without the other process's charges (a lost
    spend; tests/unit/test_ledger.py, TestOneProcessTwoHandles). So a descriptor of a ledger file is
    closed only when no handle of this process has the file open any more.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[tuple[int, int], list[int]] = {}
        self._handles: dict[tuple[int, int], int] = {}

    def hold(self, path: Path) -> tuple[tuple[int, int], bytes]:
        """Count one more handle of ``path``'s file; its key and its first header bytes."""
        with self._lock:
            st = os.stat(path)
            key = (st.st_dev, st.st_ino)
            if key not in self._fds:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                found = os.fstat(fd)
                key = (found.st_dev, found.st_ino)  # the file opened, should the path have changed since stat
                # A second descriptor of a held file (the path moved onto it in between) is kept as well.
                self._fds.setdefault(key, []).append(fd)
            self._handles[key] = self._handles.get(key, 0) + 1
            try:
                return key, os.pread(self._fds[key][0], _SQLITE_HEADER_BYTES, 0)
            except OSError:
                self._release(key)
                raise

    def release(self, key: tuple[int, int]) -> None:
        """One handle of the file ``key`` closed its connection: after the last, close the file's descriptors."""
        with self._lock:
            self._release(key)

    def _release(self, key: tuple[int, int]) -> None:
        left = self._handles[key] - 1
        if left:
            self._handles[key] = left
            return
        del self._handles[key]
        for fd in self._fds.pop(key):
            os.close(fd)

    def links(self, key: tuple[int, int]) -> int:
        """How many names (hard links) the held file ``key`` has now."""
        with self._lock:
            return os.fstat(self._fds[key][0]).st_nlink

    def holding(self) -> int:
        """How many files this process holds descriptors of (tests)."""
        with self._lock:
            return len(self._fds)


_HELD = _HeldFiles()


def _one_name(path: Path, held: tuple[int, int]) -> None:
    """Refuse a ledger file with more than one name (hard link). SQLite keeps a WAL and an index per *name*:
    through two names, two processes commit to one file through two logs, each blind to the other's, and one
    charge is lost (found by a hostile review: 0.3 spent fell to 0.1). The one second name allowed is
    removed: the temporary name a creation gives the complete file before linking it into place (its own
    unlink may not have run yet, or the creation was killed in between; removing it first is harmless)."""
    links = _HELD.links(held)
    if links > 1 and _remove_creation_names(path, held):
        links = _HELD.links(held)
    if links > 1:
        raise LedgerError(
            f"ledger {path}: expected a file with one name, found {links} hard links to it: SQLite keeps a "
            "log per name, so two names would be two logs of one ledger and a charge could be lost; remove "
            "the other names (a backup is a copy, never a hard link)"
        )


def _remove_creation_names(path: Path, held: tuple[int, int]) -> bool:
    """Remove the temporary names :func:`_create` gives this very file (``.<name>.creating-*`` beside it); any."""
    removed = False
    for other in path.parent.glob(f".{glob.escape(path.name)}.creating-*"):
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(other)
            if (st.st_dev, st.st_ino) == held:
                other.unlink()
                removed = True
    return removed


def _check_header(path: Path) -> tuple[int, int]:
    """Refuse anything that is not an SQLite file before SQLite sees it (an empty file would be 'a new database').

    The file is then held (:class:`_HeldFiles`): the caller releases the key it gets when its connection closes.
    """
    try:
        key, header = _HELD.hold(path)
    except OSError as exc:  # not the file's fault (out of descriptors, permissions, gone): say so, not "corrupt"
        raise LedgerError(f"ledger {path}: expected to read its header, found the OS error {exc}") from exc
    if not header:
        _HELD.release(key)
        raise _corrupt(path, "expected an SQLite database, found an empty (0-byte) file")
    if len(header) < _SQLITE_HEADER_BYTES or not header.startswith(_SQLITE_MAGIC):
        _HELD.release(key)
        raise _corrupt(path, f"expected an SQLite database header, found {header[:16]!r}")
    return key


def _set_durable_pragmas(path: Path, conn: sqlite3.Connection) -> None:
    """WAL journal and synchronous=FULL, verified: a commit is on disk when it returns."""
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        conn.execute("PRAGMA synchronous = FULL")
        (synchronous,) = conn.execute("PRAGMA synchronous").fetchone()
    except sqlite3.Error as exc:
        raise _corrupt(path, exc) from exc
    if str(mode).lower() != "wal":
        raise LedgerError(f"ledger {path}: expected journal_mode wal, found {mode!r}")
    if synchronous != 2:
        raise LedgerError(f"ledger {path}: expected synchronous FULL (2), found {synchronous!r}")


@dataclasses.dataclass(frozen=True)
class _Contents:
    config: LedgerConfig
    layout: dict[str, Any]
    ledger_id: str
    schema_version: int
    foreign: tuple[str, ...]
    marked: bool
    created_at: str = ""  # the creation's time (microseconds), "" in a ledger that has none
    tag_salt: str = ""  # 32 random hex digits drawn at creation (Ledger.run_tag); "" in a ledger made before


_MASTER: Final = "SELECT type, name, tbl_name, sql FROM sqlite_master"


@functools.cache
def _schema_objects(statements: tuple[str, ...]) -> frozenset[tuple[str, str, str, str | None]]:
    """Every object the schema ``statements`` make: the tables, their indexes and SQLite's autoindexes."""
    conn = sqlite3.connect(":memory:")
    try:
        for statement in statements:
            conn.execute(statement)
        return frozenset(conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall())
    finally:
        conn.close()


def _expected_schema() -> frozenset[tuple[str, str, str, str | None]]:
    """Every object a fedfilter ledger's schema holds (this version's)."""
    return _schema_objects(_SCHEMA)


def _check_contents(path: Path, conn: sqlite3.Connection) -> _Contents:
    """Integrity, application id, schema objects and version, and stored configuration; reads only."""
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        # Before anything else reads the schema: a trigger or view must never run on an agent's behalf.
        conn.execute("PRAGMA trusted_schema = OFF")
        problems = [row[0] for row in conn.execute("PRAGMA integrity_check")]
        if problems != ["ok"]:
            raise _corrupt(path, "integrity_check: " + "; ".join(problems[:5]).replace("\n", " "))
        (app_id,) = conn.execute("PRAGMA application_id").fetchone()
        if app_id != APPLICATION_ID:
            raise _corrupt(path, f"expected SQLite application_id {APPLICATION_ID:#x}, found {app_id:#x}")
        (schema_version,) = conn.execute("PRAGMA schema_version").fetchone()
        objects = set(conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall())
        foreign = tuple(sorted(f"{kind} {name!r}" for kind, name, _, _ in objects - _expected_schema()))
        missing = sorted(f"{kind} {name!r}" for kind, name, _, _ in _expected_schema() - objects)
        meta = (
            dict(conn.execute("SELECT key, value FROM meta").fetchall())
            if ("table", "meta") in {(kind, name) for kind, name, _, _ in objects}
            else {}
        )
        if (old := meta.get("schema_version")) in _OLDER:  # an older ledger an agent has not migrated yet
            # An object that version did not make is left alone by a migration: say that, not that one would do.
            if extra := tuple(sorted(f"{k} {n!r}" for k, n, _, _ in objects - _schema_objects(_OLDER[old][0]))):
                raise _foreign(path, extra)
            raise LedgerError(
                f"ledger {path}: expected schema version {SCHEMA_VERSION}, found {old} (an agent opening it "
                "migrates it: `fedfilter agent check AGENT.toml`)"
            )
        if missing:
            raise _corrupt(
                path, "expected fedfilter's tables and indexes, found missing or altered " + ", ".join(missing)
            )
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.Error as exc:
        raise _corrupt(path, exc) from exc
    version = meta.get("schema_version")
    if version != str(SCHEMA_VERSION):
        hint = " (an agent opening it migrates it: `fedfilter agent check AGENT.toml`)" if version in _OLDER else ""
        raise LedgerError(f"ledger {path}: expected schema version {SCHEMA_VERSION}, found {version}{hint}")
    try:
        config = LedgerConfig.from_json(meta["config"])
        layout = json.loads(meta["state_layout"])
    except (KeyError, ValueError) as exc:
        raise _corrupt(path, f"stored configuration is unreadable: {exc!r}") from exc
    well_formed = isinstance(layout, dict) and all(
        isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("dtype"), str)
        for v in layout.values()
    )
    if not well_formed:
        raise _corrupt(path, f"expected a state layout of {{name: {{shape, dtype}}}}, found {str(layout)[:200]}")
    # Fixed at creation: the ledger's own id for its high-water mark (a restored copy keeps it).
    ledger_id = _sha256(f"{meta.get('created_at', '')}|{meta['config']}".encode())[:32]
    marked = meta.get("high_water") == "kept"
    created_at, salt = str(meta.get("created_at", "")), str(meta.get("tag_salt", ""))
    return _Contents(config, layout, ledger_id, int(schema_version), foreign, marked, created_at, salt)


def _foreign(path: Path, foreign: tuple[str, ...]) -> LedgerError:
    """The refusal of a ledger whose schema holds objects fedfilter did not create."""
    return _corrupt(
        path,
        "expected only the tables and indexes fedfilter creates, found "
        + ", ".join(foreign)
        + " (a trigger or view can rewrite or hide what the agent commits)",
    )


def _migrate(path: Path) -> None:
    """Bring an older ledger (:data:`_OLDER`) to this version in one transaction; any other is left as it is.

    Nothing is dropped or rewritten: from version 1 a column (every past request is federation ``default``)
    and an empty table are added; from versions 1 and 2, two indexes, and :data:`MONITOR_OWNER` from the
    first stored monitor report (if any); the version in ``meta`` moves to this one. The ledger's id, state
    and requests, hence its high-water mark, are unchanged. An older file with any object fedfilter did
    not create is left alone (the open that follows refuses it).
    """
    try:
        key, header = _HELD.hold(path)  # never a descriptor closed under another handle's locks (_HeldFiles)
    except OSError:
        return  # the open that follows says what is wrong
    try:
        if header.startswith(_SQLITE_MAGIC):  # else not an SQLite file: the open that follows says so
            _migrate_held(path)
    finally:
        _HELD.release(key)


def _migrate_held(path: Path) -> None:
    try:
        conn = sqlite3.connect(path.absolute().as_uri() + "?mode=rw", uri=True, isolation_level=None)
    except sqlite3.Error:
        return
    try:
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA trusted_schema = OFF")
            (app_id,) = conn.execute("PRAGMA application_id").fetchone()
            if app_id != APPLICATION_ID:
                return  # a file the open that follows refuses
            # The objects first: nothing is read from a file that holds anything an older version did not make
            # (a view named meta would run, and may never end).
            objects = set(conn.execute(_MASTER).fetchall())
            shapes = [v for v, (schema, _) in _OLDER.items() if objects == _schema_objects(schema)]
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() if shapes else None
            if row is None or row[0] not in shapes:
                return  # this version's ledger, or a file the open that follows refuses
            old = str(row[0])
        except sqlite3.Error:
            return
        try:
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("BEGIN IMMEDIATE")
            if set(conn.execute(_MASTER).fetchall()) != objects:  # changed since (a trigger added): left as it is
                conn.execute("ROLLBACK")
                return
            (version,) = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if version == old:  # another agent may have migrated it since
                for statement in _OLDER[old][1]:
                    conn.execute(statement)
                first = conn.execute(
                    "SELECT federation FROM requests WHERE message_type = ? ORDER BY seq LIMIT 1", (MONITOR,)
                ).fetchone()
                if first is not None:
                    conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (MONITOR_OWNER, first[0]))
                conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise _corrupt(path, f"migrating from schema version {old}: {exc}") from exc
    finally:
        conn.close()


def _fingerprint(request_id: str, created_at: str) -> str:
    """What the high-water mark records of a request: its id and commit time, hashed."""
    return _sha256(f"{request_id}|{created_at}".encode())[:32]


def _high_water_call(call: Callable[[], _T]) -> _T:
    """Run a high-water mark operation, its errors as :class:`LedgerError` (the agent's ledger refusal)."""
    try:
        return call()
    except HighWaterError as exc:
        raise LedgerError(str(exc)) from exc


def _create(path: Path, config: LedgerConfig, state: Arrays) -> None:
    """Build a complete ledger beside ``path`` and hard-link it into place; never replaces an existing file.

    If another process creates ``path`` first, its ledger wins and this one is discarded; the caller
    then opens and checks the winner like any existing ledger.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.creating-{os.getpid()}-{secrets.token_hex(4)}")
    state_blob = _encode(state)
    meta = {
        "schema_version": str(SCHEMA_VERSION),
        "config": config.to_json(),
        "state_layout": json.dumps(_layout(state), sort_keys=True),
        "created_at": datetime.now(UTC).isoformat(timespec="microseconds"),
        "tag_salt": secrets.token_hex(16),  # Ledger.run_tag
    }
    try:
        # Owner-only from the first byte (SQLite gives its WAL the same mode): the ledger holds
        # every unit's spend and, in secagg trust, the session secrets.
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        conn = sqlite3.connect(tmp, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            _set_durable_pragmas(tmp, conn)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", sorted(meta.items()))
            conn.execute("INSERT INTO state (id, sha256, blob) VALUES (1, ?, ?)", (_sha256(state_blob), state_blob))
            conn.execute("COMMIT")
            (busy, _, _) = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if busy:
                raise LedgerError(f"ledger {tmp}: expected the new ledger to checkpoint, found it busy")
        finally:
            conn.close()
        fsync_path(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return  # another process created it first; it is checked on open like any existing ledger
        fsync_path(path.parent)
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: expected to create a new ledger, found: {exc}") from exc
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + "-wal"), tmp.with_name(tmp.name + "-shm")):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
