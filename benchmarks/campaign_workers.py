"""Benchmark: one campaign worker at every core's threads against one worker per core at 1 thread each.

The FZ Sec. 5.1 campaign (issue 26) spends its time in the agent's per-record pass: Opacus's MNIST CNN,
each record's gradient computed alone, clipped and summed (``client_agent.streaming.fused_clipped_sum``).
On a small machine torch's intra-op threads scale that pass poorly, so independent jobs in separate
processes may get more passes per hour. This script measures exactly that, in fresh subprocesses on
the same MNIST records: the baseline runs one process with ``--cores`` threads, the alternative runs
``--cores`` processes with 1 thread each at the same time; each configuration runs ``--rounds`` times,
interleaved, after a warm-up pass per process. It prints the passes per second of each and their ratio.

Run: .venv/bin/python benchmarks/campaign_workers.py [--records N] [--passes K] [--rounds R] [--cores C]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(records: int, passes: int, threads: int, data_dir: Path | None) -> None:
    """Time ``passes`` fused passes over the first ``records`` MNIST training records; print them as JSON."""
    import numpy as np
    import torch
    from torch.nn import functional as F

    from client_agent.streaming import ArraySource, fused_clipped_sum
    from simulations.datasets.idx import default_data_dir, load_idx_dataset, normalise_images
    from workloads.models import build_model

    torch.set_num_threads(threads)
    images, labels = load_idx_dataset("mnist", data_dir or default_data_dir(), split="train")
    x = normalise_images(images[:records])
    y = np.asarray(labels[:records], dtype=np.int64)
    model = build_model("opacus_mnist_cnn", seed=0)
    loss = functools.partial(F.cross_entropy, reduction="none")

    def weights(start: int, norms: np.ndarray) -> np.ndarray:  # clip at 1, as the campaign's C0
        return np.asarray(np.minimum(1.0, 1.0 / np.maximum(norms, 1e-12)), dtype=np.float64)

    def one() -> float:
        t = time.perf_counter()
        fused_clipped_sum(model, loss, ArraySource(x, y), weights)
        return time.perf_counter() - t

    one()  # warm-up: the per-record plan, allocations
    print(json.dumps([one() for _ in range(passes)]), flush=True)


def run(processes: int, threads: int, args: argparse.Namespace) -> tuple[float, list[float]]:
    """``processes`` workers at once; the wall time until the last finished and every pass's time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--worker", "--threads", str(threads)]
    cmd += ["--records", str(args.records), "--passes", str(args.passes)]
    if args.data_dir is not None:
        cmd += ["--data-dir", str(args.data_dir)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(processes)]
    passes: list[float] = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"worker failed with exit code {p.returncode}")
        passes += json.loads(out.strip().splitlines()[-1])
    # Throughput from the passes themselves (start-up and warm-up left out): the slowest worker's sum.
    per_worker = [sum(passes[i * args.passes : (i + 1) * args.passes]) for i in range(processes)]
    return max(per_worker), passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=6000)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.records, args.passes, args.threads, args.data_dir)
        return
    if args.cores < 2:
        raise SystemExit(
            f"--cores: expected at least 2 (one worker per core against one at every core), got {args.cores}"
        )
    one_rate, many_rate = [], []
    for r in range(args.rounds):
        wall, passes = run(1, args.cores, args)
        one_rate.append(args.passes / wall)
        print(f"round {r}: 1 worker x {args.cores} threads: passes {' '.join(f'{p:.3f}' for p in passes)} s")
        wall, passes = run(args.cores, 1, args)
        many_rate.append(args.cores * args.passes / wall)
        print(f"round {r}: {args.cores} workers x 1 thread: passes {' '.join(f'{p:.3f}' for p in passes)} s")
    a, b = statistics.median(one_rate), statistics.median(many_rate)
    print(
        f"\n{args.records} MNIST records per pass (opacus_mnist_cnn, fused clipped sum), "
        f"median of {args.rounds} rounds:\n"
        f"  1 worker x {args.cores} threads: {a:.3f} passes/s\n"
        f"  {args.cores} workers x 1 thread:  {b:.3f} passes/s\n"
        f"  ratio (workers / one worker): {b / a:.2f}x"
    )


if __name__ == "__main__":
    main()
