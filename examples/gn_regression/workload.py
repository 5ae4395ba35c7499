"""Example workload: multi-output regression with a GroupNorm CNN, a file-backed torch Dataset and a histogram.

Nothing here is built in: the model (``gn_cnn``), the loss (per-example squared error over two
targets), the data (a torch ``Dataset`` over a raw float32 file this module writes), the validity
rule (finite features and targets: the default) and the queries (``target_histogram``: a one-hot
vector over 8 bins of one target, L2 bound 1; ``clipped_target``: one target clipped to [-2, 2],
L2 bound 2). Use it from an agent TOML (``workload = "examples.gn_regression.workload:WORKLOAD"``)
or run the demo::

    fedfilter simulate --workload examples.gn_regression.workload:WORKLOAD --clients 3 --rounds 5
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from workloads.registry import Demo, Query, QueryArgs, Workload

SIDE = 8  # each record: a 1 x 8 x 8 grid
OUTPUTS = 2  # two regression targets per record
BINS = 8  # target_histogram: bins over [LOW, HIGH)
LOW, HIGH = -2.0, 2.0
RECORD_FLOATS = SIDE * SIDE + OUTPUTS  # one record in the file: 64 features, then 2 targets


def gn_cnn(*, outputs: int = OUTPUTS, channels: int = 8) -> nn.Module:
    """Conv (stride 2) -> GroupNorm -> ReLU -> Linear: per-example gradients work (no BatchNorm)."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, stride=2, padding=1),
        nn.GroupNorm(2, channels),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * (SIDE // 2) ** 2, outputs),
    )


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-example squared error summed over the outputs, shape (b,) (reduction none)."""
    return ((outputs - targets.to(outputs.dtype).reshape(outputs.shape)) ** 2).sum(dim=1)


class GridRegressionFile(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Records from a raw little-endian float32 file, RECORD_FLOATS per record, memory-mapped."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        if size == 0 or size % (4 * RECORD_FLOATS):
            raise ValueError(
                f"data {path}: expected a whole number of {RECORD_FLOATS}-float32 records, got {size} bytes"
            )
        self.rows = np.memmap(self.path, dtype="<f4", mode="r").reshape(-1, RECORD_FLOATS)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = np.array(self.rows[i])
        return torch.from_numpy(row[: SIDE * SIDE].reshape(1, SIDE, SIDE)), torch.from_numpy(row[SIDE * SIDE :])


def grid_data(path: Path) -> Any:
    from workloads.data_sources import TorchDatasetSource

    return TorchDatasetSource(GridRegressionFile(path))


def _target(y: Any, column: int) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64).reshape(len(y), -1)
    return y[:, min(column, y.shape[1] - 1)]


def target_histogram(x: Any, y: Any, args: QueryArgs) -> np.ndarray:
    """One-hot over BINS equal bins of target ``column`` in [LOW, HIGH) (values outside go to the end bins)."""
    t = _target(y, args.column)
    idx = np.clip(np.floor((t - LOW) / (HIGH - LOW) * BINS), 0, BINS - 1).astype(np.int64)
    return np.eye(BINS, dtype=np.float32)[idx]


def clipped_target(x: Any, y: Any, args: QueryArgs) -> np.ndarray:
    """Target ``column`` clipped to [-2, 2]."""
    return np.clip(_target(y, args.column), -2.0, 2.0).reshape(-1, 1)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Mean squared error per target on public test data."""
    out = model(x)
    return {"mse": float(squared_error(out, y).mean().item()) / OUTPUTS}


def make_records(n: int, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic grids and two targets: a smooth function of the grid plus a little noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, SIDE, SIDE)).astype(np.float32)
    left, top = x[:, 0, :, : SIDE // 2].mean(axis=(1, 2)), x[:, 0, : SIDE // 2, :].mean(axis=(1, 2))
    y = np.stack([2.0 * left - top, left + top], axis=1) * 2.0 + 0.05 * rng.normal(size=(n, OUTPUTS))
    return x, y.astype(np.float32)


def write_records(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    rows = np.concatenate([x.reshape(len(x), -1), y.reshape(len(y), -1)], axis=1).astype("<f4")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows.tofile(path)
    return path


def demo(*, clients: int, seed: int, root: Path, records: int = 40) -> Demo:
    """Simulation hook: one file of ``records`` records per client, plus public test data."""
    x, y = make_records(clients * records + 200, seed=seed)
    paths = [
        write_records(root / f"grid{i}.f32", x[i * records : (i + 1) * records], y[i * records : (i + 1) * records])
        for i in range(clients)
    ]
    test = (x[clients * records :], y[clients * records :])
    return Demo(
        clients=paths,
        model="gn_cnn",
        model_args={"outputs": OUTPUTS},
        learning_rate=1.0,
        noise_std=2.0,
        l2_clip=1.0,
        epsilon=4.0,
        rounds=8,
        test=test,
    )


WORKLOAD = Workload(
    name="gn_regression",
    models={"gn_cnn": gn_cnn},
    loss=squared_error,
    data=grid_data,
    queries={
        "target_histogram": Query(target_histogram, dim=BINS, l2_bound=1.0, doc="one-hot bins of target `column`"),
        "clipped_target": Query(clipped_target, dim=1, l2_bound=2.0, doc="target `column` clipped to [-2, 2]"),
    },
    evaluate=evaluate,
    demo=demo,
)
