"""Benchmark: operations per request of the agent's per-record pass, with the CPU's run lengths and a GPU's.

On a GPU every tensor operation costs a launch, tens of microseconds from Python whatever its size, so a
request's operation count bounds its time there. The per-record engine cuts its float64 runs
(``client_agent.layers.base.sum_records``) and its convolution blocks (``client_agent.layers.conv``) short
on a CPU, where a run should stay in cache, and long on any other device. This script runs the agent's
fused pass (``client_agent.streaming.fused_clipped_sum``, clip 1) over ``--records`` MNIST records with
the built-in MNIST CNN, on this CPU, with both lengths (the GPU's forced), and prints each one's
top-level ATen operations (torch.profiler), its time, and ``ratio=<CPU's count / GPU's>``; the norms
must be equal and the sums agree to float64 rounding. A GPU's own time: benchmarks/campaign_step.py.

Run: .venv/bin/python benchmarks/engine_ops.py [--records 6000] [--data-dir D]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import numpy as np
import torch
from torch.nn import functional as F

from client_agent.layers import base, conv
from client_agent.streaming import ArraySource, fused_clipped_sum
from simulations.datasets.idx import default_data_dir, load_idx_dataset, normalise_images
from workloads.models import build_model


def _clip(start: int, norms: np.ndarray) -> np.ndarray:
    return np.asarray(np.minimum(1.0, 1.0 / np.maximum(norms, 1e-12)), dtype=np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=6000, help="one campaign client's records (default 6000)")
    parser.add_argument("--data-dir", type=Path, help="the folder holding mnist/ (default: the shared copy)")
    args = parser.parse_args()
    images, labels = load_idx_dataset("mnist", args.data_dir or default_data_dir(), split="train")
    x = normalise_images(images[: args.records])
    y = np.asarray(labels[: args.records], dtype=np.int64)
    model, loss = build_model("opacus_mnist_cnn", seed=0), functools.partial(F.cross_entropy, reduction="none")
    cpu_runs, cpu_blocks = base.sum_records, conv.block_records
    meta = torch.device("meta")
    results = {}
    try:
        for name in ("cpu", "gpu"):
            if name == "gpu":  # a GPU's lengths on this CPU: the same operations the GPU would launch
                base.sum_records = lambda t: cpu_runs(t.to(meta))  # type: ignore[assignment]
                conv.block_records = lambda device, *shape: cpu_blocks(meta, *shape)  # type: ignore[assignment]
            fused_clipped_sum(model, loss, ArraySource(x, y), _clip)  # warm: the plan, the allocator
            with torch.profiler.profile() as prof:
                started = time.perf_counter()
                norms, total, _ = fused_clipped_sum(model, loss, ArraySource(x, y), _clip)
                seconds = time.perf_counter() - started
            ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
            results[name] = (ops, seconds, norms, total)
            print(f"{name} run lengths: {ops} top-level ATen operations, {seconds:.2f} s (profiled) on this CPU")
    finally:
        base.sum_records, conv.block_records = cpu_runs, cpu_blocks
    (c_ops, _, c_norms, c_total), (g_ops, _, g_norms, g_total) = results["cpu"], results["gpu"]
    norms_diff = float(np.max(np.abs(c_norms - g_norms) / np.maximum(c_norms, 1e-300)))
    diff = float(np.max(np.abs(c_total - g_total)) / np.max(np.abs(c_total)))
    print(
        f"norms within {norms_diff:.1e} relative ({'bit for bit' if np.array_equal(c_norms, g_norms) else 'not'} "
        f"equal); sums within {diff:.1e} relative; ratio={c_ops / g_ops:.2f} (operations, cpu / gpu lengths)"
    )


if __name__ == "__main__":
    main()
