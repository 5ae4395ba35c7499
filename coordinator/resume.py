"""Stop a seeded simulation and go on later: the run's snapshot (``checkpoints/snapshot.npz``).

A long simulation (the FZ Sec. 5.1 campaign's runs take hours; issue 26) must survive its process
being stopped. Every ``snapshot_every`` rounds the coordinator saves, after the round's log line:
the round, the model and the task's model-selection state (GradientTask.snapshot), the noise
generator's state, the rounds' log lines and error counts. ``resume`` (the snapshot's path) goes on
from the next round with the *same* client ledgers.

The resumed run must be the run that would have happened (privacy.md §9, "Resuming a seeded simulation"):
- Rounds after the snapshot that the clients had already answered before the stop are asked again
  with the same request ids and the same content (the model at the snapshot is saved exactly, and
  every later model follows from replayed replies and the restored noise); each agent answers them
  from its ledger, byte for byte, with no new charge (client_agent/agent.py, step 2). A client that
  had not answered yet answers afresh, from the filter state the ledger holds.
- The coordinator's noise continues from the saved generator state, so a replayed round's release
  gets the same noise as before the stop: the same released value, not a second noisy look at the
  same sum.
- That holds only while every release after the snapshot that the stopped process made is made again
  alike: were a client's answer lost before the stop and given after it, the same noise would fall on
  another sum, and the two releases' difference would be that answer. :class:`ReleaseGuard` keeps a
  fingerprint of every release (``checkpoints/releases.jsonl``: replies, errors, noise variance, four
  fixed random projections of the noisy sum) and stops a resumed run, before a release is used, when one
  differs from the stopped process's release of the same round and purpose (:class:`ResumeDriftError`).
  A snapshot also holds a digest of the run's settings; a run with other settings may not resume it. The
  fingerprints are the snapshot's folder's: a run resumes only there, and only with fingerprints up to the
  snapshot's round. A central-trust run's session (its request ids' ``#<session>``) is in the snapshot too,
  so the resumed run asks the same ids.
- Only simulations with ``noise_seed`` may snapshot: the generator's state lets anyone who reads it
  compute the run's future noise, which the seed already does; a run with noise from OS entropy
  never writes it (coordinator/config.py refuses the combination). Nor may a run with a monitor
  (the SVT's threshold noise is drawn once, at its start) or secure aggregation (its sessions' keys).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from coordinator.report import RoundLog, _json_default

if TYPE_CHECKING:
    from coordinator.monitor import Reports
    from coordinator.release import Ask, Released, ReleaseStep
    from coordinator.tasks import GradientTask

# Settings that may differ between a run and its resumption: where it writes, how it shows progress, the
# snapshot itself, how long it waits. Everything else decides what the run asks and releases.
_VOLATILE = frozenset(
    {"resume", "snapshot_every", "output_dir", "progress", "initial_checkpoint", "round_timeout", "enrol_timeout"}
    | {"session"}  # drawn by each central-trust run, not set: a resumed run takes its snapshot's (Snapshot.session)
)
RELEASES_NAME = "releases.jsonl"
_PROJECTIONS = 4


class ResumeDriftError(RuntimeError):
    """A resumed run's release differs from the stopped process's release of the same round and purpose, or
    cannot be checked against it (the fingerprints are missing)."""


def settings_digest(cfg: CoordinatorConfig) -> str:
    """A digest of every setting that decides what the run asks and releases (not where it writes)."""
    kept = {k: v for k, v in asdict(cfg).items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=repr).encode()).hexdigest()


SNAPSHOT_NAME = "snapshot.npz"
FORMAT = 1
_TASK_PREFIX = "task_"


@dataclass(frozen=True)
class Snapshot:
    """A run's state after ``round`` (see the module docstring)."""

    round: int
    run_id: str
    rng_state: dict[str, Any]
    settings: str
    logs: list[dict[str, Any]]
    errors_total: dict[str, int]
    task_state: dict[str, Any]
    task_arrays: dict[str, np.ndarray]
    session: str = ""  # the run's session (CoordinatorConfig.session); "" in a snapshot written before sessions

    def round_logs(self) -> list[RoundLog]:
        return [RoundLog(**line) for line in self.logs]


def save_snapshot(
    cfg: CoordinatorConfig,
    *,
    rnd: int,
    rng: np.random.Generator,
    logs: list[RoundLog],
    errors_total: Counter[str],
    task: GradientTask,
) -> Path:
    """Write ``checkpoints/snapshot.npz`` whole (temporary file, fsync, rename): a reader never sees half of one."""
    state, arrays = task.snapshot()
    meta = {
        "format": FORMAT,
        "round": rnd,
        "run_id": cfg.run_id,
        "session": cfg.session,
        "settings": settings_digest(cfg),
        "rng": rng.bit_generator.state,
        "logs": [asdict(log) for log in logs],
        "errors_total": dict(errors_total),
        "task": state,
    }
    folder = Path(cfg.output_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path, tmp = folder / SNAPSHOT_NAME, folder / f".{SNAPSHOT_NAME}.tmp"
    with open(tmp, "wb") as fh:
        saved: dict[str, Any] = {_TASK_PREFIX + k: v for k, v in arrays.items()}
        saved["meta"] = np.array(json.dumps(meta, sort_keys=True, default=_json_default))
        np.savez(fh, **saved)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def load_snapshot(cfg: CoordinatorConfig) -> Snapshot:
    """The snapshot ``cfg.resume``, checked against the run that resumes it: the same run id and settings, a
    round before its last, consecutive rounds logged, a noise generator state numpy accepts."""
    path, run_id, rounds = cfg.resume, cfg.run_id, cfg.rounds
    try:
        with np.load(path, allow_pickle=False) as saved:
            if "meta" not in saved.files:
                raise CoordinatorConfigError(f"resume: expected a snapshot with 'meta' in {path}, found {saved.files}")
            meta = json.loads(str(saved["meta"]))
            arrays = {k.removeprefix(_TASK_PREFIX): saved[k] for k in saved.files if k.startswith(_TASK_PREFIX)}
    except CoordinatorConfigError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise CoordinatorConfigError(f"resume: cannot read the snapshot {path}: {exc}") from exc
    expected = {"format", "round", "run_id", "settings", "rng", "logs", "errors_total", "task"}
    # 'session' from 2026-11-27 on; a snapshot written before has none, and its run named its requests run_id.
    if not isinstance(meta, dict) or set(meta) - {"session"} != expected or meta["format"] != FORMAT:
        found = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise CoordinatorConfigError(
            f"resume: expected a format-{FORMAT} snapshot with {sorted(expected)}, found {found}"
        )
    if meta["run_id"] != run_id:
        raise CoordinatorConfigError(f"resume: the snapshot is run {meta['run_id']!r}'s, not {run_id!r}'s")
    session = meta.get("session", "")
    if not isinstance(session, str) or (session and cfg.trust != "central"):
        raise CoordinatorConfigError(
            f"resume: expected the snapshot's session as text, and only in central trust; found {session!r:.40}"
        )
    # The stopped process's release fingerprints sit beside the snapshot; resumed into another folder, the run
    # would find none to compare and could add the same noise to another sum (ReleaseGuard).
    own = (Path(cfg.output_dir) / "checkpoints").resolve()
    if Path(path).resolve().parent != own:
        raise CoordinatorConfigError(
            f"resume: expected the snapshot in this run's own folder ({own}), found {Path(path).resolve()}: a run "
            "goes on in the folder that holds its release fingerprints"
        )
    if meta["settings"] != settings_digest(cfg):
        raise CoordinatorConfigError(
            "resume: the snapshot was made with other settings than this run's (model, data size, noise, clip, "
            "learning rate, rounds, selection ...); a resumed run must ask what the stopped one asked"
        )
    try:
        np.random.default_rng().bit_generator.state = meta["rng"]  # the generator noise_rng builds
    except (TypeError, ValueError, KeyError) as exc:
        raise CoordinatorConfigError(
            f"resume: the snapshot's noise generator state is not one numpy accepts: {exc}"
        ) from exc
    rnd = meta["round"]
    if isinstance(rnd, bool) or not isinstance(rnd, int) or not 1 <= rnd < rounds:
        raise CoordinatorConfigError(f"resume: expected the snapshot's round in [1, rounds={rounds}), found {rnd!r}")
    logged = [line.get("round") if isinstance(line, dict) else None for line in meta["logs"]]
    if not logged or logged != list(range(rnd - len(logged) + 1, rnd + 1)):  # from 1, or a branch's first round
        raise CoordinatorConfigError(f"resume: expected the snapshot to log consecutive rounds up to {rnd}")
    return Snapshot(
        rnd, run_id, meta["rng"], meta["settings"], meta["logs"], meta["errors_total"], meta["task"], arrays, session
    )


class ReleaseGuard:
    """Records every release's fingerprint; in a resumed run, refuses one that differs from the stopped
    process's release of the same round and purpose (module docstring). Wraps the run's release step."""

    def __init__(self, inner: ReleaseStep, output_dir: str, snapshot: Snapshot | None) -> None:
        self.inner = inner
        self.path = Path(output_dir) / "checkpoints" / RELEASES_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Releases after the snapshot that an earlier process made: kept in the file (a second stop before
        # this process makes them again must not forget them) and compared when made again.
        self.before: dict[tuple[int, str], dict[str, Any]] = {}
        kept: list[str] = []
        if snapshot is not None:
            last = 0
            for line in self.path.read_text().splitlines() if self.path.exists() else []:
                try:
                    entry = json.loads(line)
                    key = (int(entry["round"]), str(entry["purpose"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by the stop: that release was never used
                kept.append(line)
                last = max(last, key[0])
                if key[0] > snapshot.round:
                    self.before[key] = entry
            if last < snapshot.round:  # every release is fingerprinted before use, so the file reaches the snapshot
                raise ResumeDriftError(
                    f"resume: expected the release fingerprints of rounds up to {snapshot.round} in {self.path}, "
                    f"found {'none' if not last else f'rounds up to {last}'}; without them a release made again "
                    "cannot be checked. Start the run again from round 1 in a new folder"
                )
        self.path.write_text("".join(k + "\n" for k in kept))
        self._directions: dict[int, np.ndarray] = {}

    def _projection(self, total: np.ndarray) -> list[float]:
        directions = self._directions.get(total.size)
        if directions is None:
            directions = np.random.default_rng(total.size).standard_normal((_PROJECTIONS, total.size))
            self._directions[total.size] = directions
        return [float(v) for v in directions @ total.astype(np.float64)]

    def release(self, ask: Ask) -> Released:
        released = self.inner.release(ask)
        entry = {
            "round": ask.rnd,
            "purpose": ask.purpose,
            "replies": len(released.replies.replies),
            "errors": dict(sorted(released.errors.items())),
            "noise_var": released.noise_var,
            "projection": None if released.total is None else self._projection(released.total),
        }
        earlier = self.before.get((ask.rnd, ask.purpose))
        if earlier is not None and not _same(earlier, entry):
            raise ResumeDriftError(
                f"resume: round {ask.rnd}'s {ask.purpose} release differs from the one made before the stop "
                f"(replies {earlier['replies']} -> {entry['replies']}, errors {earlier['errors']} -> "
                f"{entry['errors']}); the same noise would fall on another sum. Stopped before using it; start "
                "the run again from round 1 in a new folder"
            )
        if earlier is None:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(entry, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        return released

    def reports(self, rnd: int) -> Reports:
        return self.inner.reports(rnd)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same release up to the order its replies were summed in (a float sum's last bits)."""
    if (a["replies"], a["errors"]) != (b["replies"], b["errors"]):
        return False
    if not math.isclose(a["noise_var"], b["noise_var"], rel_tol=1e-12):
        return False
    if a["projection"] is None or b["projection"] is None:
        return a["projection"] is b["projection"]
    return bool(np.allclose(a["projection"], b["projection"], rtol=1e-9, atol=1e-6))
