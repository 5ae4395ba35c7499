"""Benchmark: steps of the FZ Sec. 5.1 campaign (10 agents x 6,000 MNIST records, in process) on a device.

The campaign's step is one private GD round of the in-process federation (``fz_sec51.run_federation``): ten
agents each answer a gradient request with the per-record engine, the coordinator adds noise and steps.
This script runs ``--rounds`` rounds on ``--device`` and prints each round's seconds (the coordinator's
``duration_s``; round 1 apart, it decides each agent's plan on synthetic records). When the device is not
the CPU it then runs the same rounds on the CPU in the same process and prints ``ratio=<cpu / device>``
(above 1: the device is faster), and before that the same rounds on the device with a CPU's block sizes
(1,024-record chunks, 2^25 floats of rows a block: six blocks a client, not two) and
``blocks=<cpu-sized / device-sized>`` (above 1: the device's larger blocks are faster). ``--profile``:
torch.profiler over the device's rounds, the 25 operators of most self time (CUDA time first on a GPU)
-> stdout: where a step goes.

Measured on an H100 on 2026-11-27 in the campaign itself (scripts/gpu_campaign.sh, no profile): 2-3 s a
step per worker with 3-8 workers sharing the GPU, 10-13 s on one thread of this project's CPU. On a lent
H200 on 2026-11-27, alone, 4 torch threads, 6 rounds (`--device cuda --rounds 6 --threads 4`): 0.605 s a
step with the device's blocks, 0.823 s with a CPU's (blocks=1.36), 4.71 s on its CPU (ratio=7.79). The
profile there (`--profile`): 81 ms of CUDA time a step; the rest is launches and host round trips.

Run: .venv/bin/python benchmarks/campaign_step.py [--device cuda] [--rounds 4] [--train-limit N]
[--threads T] [--data-dir D] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import torch

from client_agent import streaming, workloads
from simulations.datasets.partition import mnist_silos
from simulations.reproductions.fz_sec51 import CLIENTS, Tuned, cell, run_federation


def steps(device: str, args: argparse.Namespace, profile: bool) -> list[float]:
    """Seconds of each round of ``args.rounds`` GD rounds (tuned epsilon 0.3, C 1, lr 2) on ``device``."""
    c = cell(0.3, "tuned", "gd", tuned=Tuned(steps=args.rounds, clip=1.0, learning_rate=2.0))
    parts, test_x, test_y = mnist_silos(CLIENTS, seed=0, data_dir=args.data_dir, train_limit=args.train_limit)
    with tempfile.TemporaryDirectory() as tmp:
        common: dict[str, Any] = {"seed": 0, "out": Path(tmp), "parts": parts, "eval_every": args.rounds}
        common.update(eval_x=test_x[:1000], eval_y=test_y[:1000], device=device)
        if not profile:
            fed = run_federation(c, **common)
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.startswith("cuda"):
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                fed = run_federation(c, **common)
            key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25))
    return [float(r["duration_s"]) for r in fed.summary["rounds"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--train-limit", type=int, help="training records in all (default: all 60,000)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--data-dir", type=Path, help="the folder holding mnist/ (default: the shared copy)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds: expected an integer >= 2 (round 1 is reported apart), got {args.rounds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = {args.device: steps(args.device, args, args.profile)}
    if args.device != "cpu":
        with cpu_sized_blocks():
            runs[f"{args.device} (a CPU's blocks)"] = steps(args.device, args, False)
        runs["cpu"] = steps("cpu", args, False)
    for device, seconds in runs.items():
        later = seconds[1:]
        print(
            f"{device}: round 1 {seconds[0]:.2f} s; rounds 2-{len(seconds)} median {statistics.median(later):.3f} s "
            f"(min {min(later):.3f}, max {max(later):.3f}), {torch.get_num_threads()} torch threads"
        )
    if args.device != "cpu":
        device = statistics.median(runs[args.device][1:])
        cpu_blocks = statistics.median(runs[f"{args.device} (a CPU's blocks)"][1:])
        print(
            f"blocks={cpu_blocks / device:.2f} ({args.device}: a CPU's block sizes / its own, "
            f"median of rounds 2-{args.rounds})"
        )
        ratio = statistics.median(runs["cpu"][1:]) / device
        print(f"ratio={ratio:.2f} (cpu / {args.device}, median of rounds 2-{args.rounds})")


@contextmanager
def cpu_sized_blocks() -> Iterator[None]:
    """The engine's CPU chunk and block sizes on every device (the baseline of the device's own)."""
    saved = workloads.DEVICE_CHUNK_RECORDS, streaming._DEVICE_EXPLICIT_FLOATS
    workloads.DEVICE_CHUNK_RECORDS, streaming._DEVICE_EXPLICIT_FLOATS = (
        workloads.CHUNK_RECORDS,
        streaming._EXPLICIT_FLOATS,
    )
    try:
        yield
    finally:
        workloads.DEVICE_CHUNK_RECORDS, streaming._DEVICE_EXPLICIT_FLOATS = saved


if __name__ == "__main__":
    main()
