"""What a run writes: a JSON line per round, ``summary.json``, checkpoints, and a progress display.

Everything here comes from noised sums, the monitor, public configuration and the
clients' replies as aggregates: no node id and no per-client value is stored or logged
(privacy.md §8).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np


@dataclass
class RoundLog:
    """One line of ``rounds.jsonl``: aggregates only, never a node id, a per-client value or a client's text."""

    round: int
    task: str
    replies: int
    errors: dict[str, int]  # errors_by_code, plus the coordinator's checks and the plateau and monitor requests
    errors_by_code: dict[str, int]  # the release request's failed replies by code name (secagg: every step's)
    missing: int
    noise_std: float  # sigma of each release (per client in local trust)
    release_noise_std: float  # std of the noise in the released sum
    duration_s: float
    monitor: dict[str, Any] = field(default_factory=dict)
    secagg: dict[str, Any] = field(default_factory=dict)  # clients left after each step, or why it aborted
    metrics: dict[str, float | None] = field(default_factory=dict)
    query: dict[str, Any] | None = None
    answer: float | None = None
    bound: float | None = None


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to a temporary file, fsync, rename: a reader never sees half a summary."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True, default=_json_default)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Progress:
    """One status line per round: redrawn in place on a terminal, every ~5% of the run otherwise."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(1, total // 20)
        self.start = time.monotonic()

    def update(self, done: int, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * done / self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.start
        extra = " ".join(f"{k}={_short(v)}" for k, v in fields.items() if v is not None)
        line = f"[{bar}] round {done}/{self.total} {elapsed:6.1f}s {extra}"
        if self.tty:
            self.stream.write("\r" + line[:160].ljust(160))
            self.stream.flush()
        elif done % self.every == 0 or done == self.total:
            self.stream.write(line + "\n")
            self.stream.flush()

    def finish(self, message: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\n")
        self.stream.write(message + "\n")
        self.stream.flush()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class RunWriter:
    """``rounds.jsonl`` (appended and flushed each round) and ``summary.json`` under ``output_dir``."""

    def __init__(self, output_dir: str, lines: list[dict[str, Any]] | None = None) -> None:
        """A new ``rounds.jsonl`` holding ``lines`` (a resumed run's rounds so far), or empty."""
        self.dir = Path(output_dir) if output_dir else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            text = "".join(json.dumps(line, sort_keys=True, default=_json_default) + "\n" for line in lines or [])
            (self.dir / "rounds.jsonl").write_text(text)

    def round(self, line: dict[str, Any]) -> None:
        if self.dir is None:
            return
        with open(self.dir / "rounds.jsonl", "a") as fh:
            fh.write(json.dumps(line, sort_keys=True, default=_json_default) + "\n")
            fh.flush()

    def checkpoint(self, rnd: int, parameters: np.ndarray, *, name: str = "round") -> str | None:
        """``checkpoints/<name>_<round>.npz``: ``round`` every k rounds and the last, ``selected`` the chosen model."""
        if self.dir is None:
            return None
        folder = self.dir / "checkpoints"
        folder.mkdir(exist_ok=True)
        path = folder / f"{name}_{rnd:05d}.npz"
        tmp = folder / f".{name}_{rnd:05d}.tmp.npz"
        np.savez(tmp, parameters=parameters, round=np.array(rnd))
        os.replace(tmp, path)
        return str(path)

    def summary(self, summary: dict[str, Any]) -> None:
        if self.dir is not None:
            write_json_atomic(self.dir / "summary.json", summary)


def load_checkpoint(path: str) -> tuple[int, np.ndarray]:
    """``(round, parameters)`` of a checkpoint written by :meth:`RunWriter.checkpoint`."""
    from coordinator.config import CoordinatorConfigError

    try:
        with np.load(path, allow_pickle=False) as saved:
            if "parameters" not in saved.files or "round" not in saved.files:
                raise CoordinatorConfigError(
                    f"initial_checkpoint: expected arrays 'parameters' and 'round' in {path}, found {saved.files}"
                )
            return int(saved["round"]), np.asarray(saved["parameters"], dtype=np.float32).reshape(-1)
    except OSError as exc:
        raise CoordinatorConfigError(f"initial_checkpoint: cannot read {path}: {exc}") from exc
