"""Stop a seeded simulation and go on later: the run's snapshot (``checkpoints/snapshot.npz``).

A long simulation (the FZ Sec. 5.1 campaign's runs take hours; issue 26) must survive its process
being stopped. Every ``snapshot_every`` rounds the coordinator saves, after the round's log line:
the round, the model and the task's model-selection state (GradientTask.snapshot), the noise
generator's state, the rounds' log lines and error counts. ``resume`` (the snapshot's path) goes on
from the next round with the *same* client ledgers.

Why the resumed run is the run that would have happened (privacy.md §9, "Resuming a seeded simulation"):
- Rounds after the snapshot that the clients had already answered before the stop are asked again
  with the same request ids and the same content (the model at the snapshot is saved exactly, and
  every later model follows from replayed replies and the restored noise); each agent answers them
  from its ledger, byte for byte, with no new charge (client_agent/agent.py, step 2). A client that
  had not answered yet answers afresh, from the filter state the ledger holds.
- The coordinator's noise continues from the saved generator state, so a replayed round's release
  gets the same noise as before the stop: the same released value, not a second noisy look at the
  same sum.
- Only simulations with ``noise_seed`` may snapshot: the generator's state lets anyone who reads it
  compute the run's future noise, which the seed already does; a run with noise from OS entropy
  never writes it (coordinator/config.py refuses the combination). Nor may a run with a monitor
  (the SVT's threshold noise is drawn once, at its start) or secure aggregation (its sessions' keys).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.config import CoordinatorConfigError
from coordinator.report import RoundLog, _json_default

if TYPE_CHECKING:
    from coordinator.tasks import GradientTask

SNAPSHOT_NAME = "snapshot.npz"
FORMAT = 1
_TASK_PREFIX = "task_"


@dataclass(frozen=True)
class Snapshot:
    """A run's state after ``round`` (see the module docstring)."""

    round: int
    run_id: str
    rng_state: dict[str, Any]
    logs: list[dict[str, Any]]
    errors_total: dict[str, int]
    task_state: dict[str, Any]
    task_arrays: dict[str, np.ndarray]

    def round_logs(self) -> list[RoundLog]:
        return [RoundLog(**line) for line in self.logs]


def save_snapshot(
    output_dir: str,
    *,
    rnd: int,
    run_id: str,
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
        "run_id": run_id,
        "rng": rng.bit_generator.state,
        "logs": [asdict(log) for log in logs],
        "errors_total": dict(errors_total),
        "task": state,
    }
    folder = Path(output_dir) / "checkpoints"
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


def load_snapshot(path: str, *, run_id: str, rounds: int) -> Snapshot:
    """The snapshot at ``path``, checked against the run that resumes it (same run id, a round before its last)."""
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
    expected = {"format", "round", "run_id", "rng", "logs", "errors_total", "task"}
    if not isinstance(meta, dict) or set(meta) != expected or meta["format"] != FORMAT:
        found = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise CoordinatorConfigError(
            f"resume: expected a format-{FORMAT} snapshot with {sorted(expected)}, found {found}"
        )
    if meta["run_id"] != run_id:
        raise CoordinatorConfigError(f"resume: the snapshot is run {meta['run_id']!r}'s, not {run_id!r}'s")
    rnd = meta["round"]
    if isinstance(rnd, bool) or not isinstance(rnd, int) or not 1 <= rnd < rounds:
        raise CoordinatorConfigError(f"resume: expected the snapshot's round in [1, rounds={rounds}), found {rnd!r}")
    logged = [line.get("round") if isinstance(line, dict) else None for line in meta["logs"]]
    if not logged or logged != list(range(rnd - len(logged) + 1, rnd + 1)):  # from 1, or a branch's first round
        raise CoordinatorConfigError(f"resume: expected the snapshot to log consecutive rounds up to {rnd}")
    return Snapshot(rnd, run_id, meta["rng"], meta["logs"], meta["errors_total"], meta["task"], arrays)
