"""The ledger's high-water mark: the last state it committed, kept outside the ledger file (privacy.md §9).

A ledger is append-only, but its file is not: a backup restored over it, a snapshot rolled back,
or a copy taken earlier, is a consistent older ledger that ``PRAGMA integrity_check`` and every
checksum accept. Answering from it forgets every charge since (the budget is spent twice) and,
under ``secagg``, forgets the sessions already signed (a second survivor set signed in one
session unmasks a peer's input). So the agent keeps, in a small file of its own, a monotonic mark
of the ledger's last commit: which ledger (an id fixed at creation), how many requests it had
answered and the sha256 of its state. The mark is checked when the ledger opens and advanced
after every commit; a ledger behind its mark, or a different ledger at the mark's path, is
refused. A ledger *ahead* of its mark is the one crash window (committed, mark not yet written)
and is accepted and the mark moved up: the mark only ever moves forward.

The mark is written atomically (a temporary file, fsync, rename, fsync of the folder), owner-only.
It lives beside the ledger by default (``<ledger>.high-water``), which catches the ledger file
restored alone, replaced or deleted; a snapshot or backup of the whole folder would roll the mark
back with it, so a deployed agent keeps it where its backups do not reach (``ledger-high-water``:
another folder or disk; docs/deploy.md §9). Writes are read-compare-write under a lock, so the mark
never moves back. Restoring the mark with the ledger is the owner deliberately rolling back, which
docs/deploy.md tells them not to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from protocol.errors import FedfilterError


class HighWaterError(FedfilterError, RuntimeError):
    """The ledger is older than, or different from, the last state this agent committed."""


@dataclasses.dataclass(frozen=True)
class Mark:
    """What the mark holds: the ledger's id, its answered requests, its state's sha256, and a
    fingerprint of the request at ``seq`` (so that a ledger *ahead* of the mark must pass through it)."""

    ledger_id: str
    seq: int
    state_sha256: str
    last: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def default_path(ledger_path: Path) -> Path:
    return ledger_path.with_name(ledger_path.name + ".high-water")


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: so that a rename or link in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HighWater:
    """The mark file at ``path`` for the ledger at ``ledger_path``."""

    def __init__(self, path: Path, ledger_path: Path) -> None:
        self.path = path
        self.ledger_path = ledger_path

    def read(self) -> Mark | None:
        """The stored mark, or None when there is none yet; an unreadable mark is an error, never ignored."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HighWaterError(f"high-water mark {self.path}: expected a readable file, found: {exc}") from exc
        try:
            data: Any = json.loads(text)
            seq = data["seq"]
            if isinstance(seq, bool) or not isinstance(seq, int):  # 1e400 or 3.5 is no count of commits
                raise TypeError(f"seq: expected an integer, found {seq!r:.40}")
            mark = Mark(str(data["ledger_id"]), seq, str(data["state_sha256"]), str(data.get("last", "")))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise HighWaterError(
                f"high-water mark {self.path}: expected JSON with ledger_id, seq and state_sha256, found "
                f"{text[:120]!r}; refusing to answer (a damaged mark cannot tell a rolled-back ledger)"
            ) from exc
        if mark.seq < 0:
            raise HighWaterError(f"high-water mark {self.path}: expected seq >= 0, found {mark.seq}")
        return mark

    def refuse_creation(self) -> None:
        """A new ledger at a path whose mark says one lived there is a budget reset: refuse it."""
        mark = self.read()
        if mark is not None:
            raise HighWaterError(
                f"ledger {self.ledger_path}: expected the ledger that answered {mark.seq} requests "
                f"(high-water mark {self.path}), found no ledger file; a new ledger would reset every "
                "unit's budget. Put the ledger back, or, to start a new data set deliberately, remove the mark"
            )

    def check(self, found: Mark, *, marked: bool = False, request_at: Callable[[int], str] | None = None) -> str | None:
        """Why ``found`` (the ledger as opened) is behind, beside or off the mark, or None when it is not.

        ``marked``: the ledger records that a mark was kept for it (a missing mark is then a problem);
        ``request_at(seq)``: the fingerprint of the ledger's request at ``seq`` (a ledger ahead of the
        mark must hold the mark's last request there: else it is another history, a copy served elsewhere).
        """
        mark = self.read()
        if mark is None:
            if marked:
                return (
                    f"expected its high-water mark at {self.path} (the ledger records that one was kept), found none: "
                    "a deleted mark cannot tell a rolled-back ledger"
                )
            return None
        if found.ledger_id != mark.ledger_id:
            return (
                f"expected the ledger this agent committed to (id {mark.ledger_id}), found another ledger "
                f"(id {found.ledger_id}) at {self.ledger_path}"
            )
        if found.seq < mark.seq or (found.seq == mark.seq and found.state_sha256 != mark.state_sha256):
            return (
                f"expected a ledger at or after its last commit ({mark.seq} requests answered, state sha256 "
                f"{mark.state_sha256[:16]}...), found one rolled back to {found.seq} requests (state sha256 "
                f"{found.state_sha256[:16]}...): restored from a backup, a snapshot or a copy"
            )
        if mark.seq > 0 and mark.last and request_at is not None and request_at(mark.seq) != mark.last:
            return (
                f"expected the ledger's request {mark.seq} to be the one the mark recorded, found another: a "
                "different history (a copy answered elsewhere) put over this ledger"
            )
        return None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def advance(self, mark: Mark) -> None:
        """Write ``mark`` atomically and durably; the caller has committed the state it describes.

        Under an exclusive lock, read-compare-write: the mark never moves back (a reader that checked
        an older state, e.g. ``fedfilter agent check`` beside a serving agent, cannot lower it).
        """
        try:
            with self._locked():
                current = self.read()
                if current is not None and current.ledger_id == mark.ledger_id and current.seq > mark.seq:
                    return
                self._write(mark)
        except OSError as exc:
            raise HighWaterError(
                f"high-water mark {self.path}: expected to record the commit, found: {exc}; the charge stands "
                "in the ledger, and the agent refuses to answer until the mark can be written"
            ) from exc

    def _write(self, mark: Mark) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                os.write(fd, mark.to_json().encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            fsync_path(self.path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise HighWaterError(
                f"high-water mark {self.path}: expected to record the commit, found: {exc}; the charge stands "
                "in the ledger, and the agent refuses to answer until the mark can be written"
            ) from exc
