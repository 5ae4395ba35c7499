"""Benchmark: per-record gradients for 6,000 MNIST records on ``opacus_mnist_cnn``, measured in this script.

Compared, on the same records and the same model (all rows assembled into one (n, d) float32 matrix):
  - torch.func: :func:`client_agent.gradients.per_example_gradients` (``vmap(grad(...))`` in chunks);
  - Opacus ``GradSampleModule`` (hooks; benchmark-only dependency, skipped with a message if missing);
  - a per-example Python loop (one backward per record), timed on a subset and extrapolated;
  - for scale, :func:`client_agent.gradients.summed_gradient` (one backward, no per-record rows).
Each method's rows are checked against the torch.func rows before timing is reported.

Run: .venv/bin/python benchmarks/per_record_gradients.py [--data-dir DIR] [--records N] [--loop-records M]
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from client_agent.gradients import per_example_gradients, summed_gradient
from simulations.datasets.idx import default_data_dir, load_idx_dataset, normalise_images
from workloads.models import build_model, parameter_count

DEFAULT_DATA_DIR = default_data_dir()
LOSS = functools.partial(F.cross_entropy, reduction="none")


def load_mnist(data_dir: Path, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` training records (checksums verified), normalised as Opacus's example does."""
    images, labels = load_idx_dataset("mnist", data_dir, split="train")
    x = torch.from_numpy(normalise_images(images[:n], dataset="mnist"))
    return x, torch.from_numpy(labels[:n].astype(np.int64))


def elapsed(fn: Callable[[], object]) -> float:
    """Wall time of one call of ``fn`` (s)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One ordinary backward pass per record (the slow reference)."""
    out = torch.empty((x.shape[0], parameter_count(model)), dtype=torch.float32)
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        out[i] = torch.cat([g.reshape(-1) for g in grads])
    return out


def opacus_gradients(gsm: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Per-record rows from Opacus's ``GradSampleModule`` (``loss_reduction="sum"``), chunk by chunk."""
    params = [p for p in gsm.parameters() if p.requires_grad]
    out = torch.empty((x.shape[0], sum(p.numel() for p in params)), dtype=torch.float32)
    for start in range(0, x.shape[0], chunk_size):
        stop = min(start + chunk_size, x.shape[0])
        gsm.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x[start:stop]), y[start:stop], reduction="sum").backward()  # type: ignore[no-untyped-call]
        rows = [p.grad_sample.reshape(stop - start, -1) for p in params]  # type: ignore[attr-defined]
        out[start:stop] = torch.cat(rows, dim=1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="folder holding mnist/")
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--loop-records", type=int, default=300, help="subset timed for the Python loop")
    parser.add_argument("--chunk-size", type=int, default=1024, help="records per vmap / Opacus batch")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, torch.set_num_threads({threads}) (= the cores available to this process)")
    x, y = load_mnist(args.data_dir.resolve(), args.records)
    n, m = x.shape[0], min(args.loop_records, x.shape[0])
    model = build_model("opacus_mnist_cnn", seed=0)
    print(f"opacus_mnist_cnn, d = {parameter_count(model):,}; {n:,} MNIST train records from {args.data_dir}")

    rows = per_example_gradients(model, LOSS, x, y, chunk_size=args.chunk_size)
    loop_model = copy.deepcopy(model)
    methods: dict[str, Callable[[], object]] = {
        "torch.func vmap(grad)": lambda: per_example_gradients(model, LOSS, x, y, chunk_size=args.chunk_size),
        f"Python loop, EXTRAPOLATED from {m} records": lambda: loop_gradients(loop_model, x[:m], y[:m]),
        "summed_gradient (one backward, no rows)": lambda: summed_gradient(model, LOSS, x, y),
    }
    scale = {name: 1.0 for name in methods} | {f"Python loop, EXTRAPOLATED from {m} records": n / m}
    agreement = {"loop": (float((loop_gradients(loop_model, x[:m], y[:m]) - rows[:m]).abs().max()), m)}
    try:
        import opacus
        from opacus import GradSampleModule
    except ImportError as exc:
        print(f"Opacus GradSampleModule: NOT RUN, opacus cannot be imported ({exc}); try pip install --no-deps opacus")
    else:
        # Inputs never require grad here, which Opacus's full backward hooks warn about on every layer.
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
        opacus_name = f"Opacus {opacus.__version__} GradSampleModule"
        methods[opacus_name] = lambda: opacus_gradients(gsm, x, y, args.chunk_size)
        scale[opacus_name] = 1.0
        agreement["Opacus"] = (float((opacus_gradients(gsm, x, y, args.chunk_size) - rows).abs().max()), n)
    del rows
    summed_gradient(model, LOSS, x, y)  # warm-up (the others were warmed up by the agreement checks)

    # Round-robin: every repeat runs every method once, so load from other processes hits them alike.
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            times[name].append(elapsed(fn) * scale[name])
    print(f"chunk size {args.chunk_size}; {args.repeats} round-robin repeats after one untimed warm-up run of each")
    print(f"times for all {n:,} records, best / median; records/s from the median:")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<44} {min(ts):8.3f} / {med:8.3f} s   {n / med:10,.0f} records/s")
    loop_ts = next(ts for name, ts in times.items() if name.startswith("Python loop"))
    print(f"  (loop measured on {m} records; its times are scaled by {n}/{m})")
    print("agreement with the torch.func rows (max |difference|):")
    for name, (diff, rows_checked) in agreement.items():
        print(f"  {name:<7} {diff:.2e} over {rows_checked:,} rows")

    def ratio(a: list[float], b: list[float]) -> str:
        per_repeat = [ta / tb for ta, tb in zip(a, b, strict=True)]
        return (
            f"{statistics.median(per_repeat):6.2f}   (range {min(per_repeat):.2f}-{max(per_repeat):.2f} over repeats)"
        )

    func_ts = times["torch.func vmap(grad)"]
    print("time ratios, median of the per-repeat ratios (same run):")
    opacus_ts = next((ts for name, ts in times.items() if name.startswith("Opacus")), None)
    if opacus_ts is not None:
        print(f"  torch.func / Opacus:           {ratio(func_ts, opacus_ts)}   < 1: torch.func faster")
    print(f"  loop / torch.func:             {ratio(loop_ts, func_ts)}   loop extrapolated from {m} records")
    print(f"  torch.func / summed_gradient:  {ratio(func_ts, times['summed_gradient (one backward, no rows)'])}")


if __name__ == "__main__":
    main()
