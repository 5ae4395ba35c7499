"""Benchmark: the streaming per-record gradient engine (client_agent.streaming), measured in this script.

Part 1 (scale): one record-unit request through the engine (norms, clip scales, clipped sum) on
n = 10,000 and 100,000 records and an MLP 784 -> 1024 -> 256 -> 10 (d = 1,068,810; the (n, d)
matrix the old path materialised would be 43 and 428 GB). Each n runs in a fresh subprocess and
reports its peak RSS (VmHWM) after the engine, before the baseline: a plain non-private gradient
of the summed loss over the same records, one backward per chunk. The records are generated chunk
by chunk from a seed (a source whose data is not resident, as a memory-mapped file would be).

Part 2 (speed): Opacus's MNIST CNN on the 60,000 MNIST training records: time per full-batch
step of the privacy path (norms, the filter's clip scales, clipped sum) against the plain
gradient, and against Opacus ``GradSampleModule`` + per-sample clipping (if ``opacus`` imports;
otherwise against the old materialising path ``per_example_gradients``).

Parts 1 and 2 time the engine the agent runs (``StreamedGradients``, hooks on: outer products for
Linear layers, per-record rows of every other layer, each record's norm from the values its
contribution is summed from). The last lines of part 2 time the product's whole path, one request
through ``Agent.handle`` (decode, policy, the engine, the filter, ledger commit, reply), against
the same plain gradient and the same Opacus baseline.

Run: .venv/bin/python benchmarks/streaming.py [--quick] [--device cuda] [--threads K] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from client_agent.streaming import NORM_REL_ERROR, ArraySource, StreamedGradients
from protocol.filters import clip_scales
from workloads.models import build_model, parameter_count

LOSS = functools.partial(F.cross_entropy, reduction="none")
FLOAT32_EPS = float(np.finfo(np.float32).eps)
ROOT = Path(__file__).resolve().parents[1]


class SeededSource:
    """n synthetic records (784 features, 10 classes), chunk k drawn from seed (seed, k): nothing resident."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def batches(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for k, start in enumerate(range(0, self.n, size)):
            rng = np.random.default_rng((self.seed, size, k))
            b = min(size, self.n - start)
            yield rng.standard_normal((b, 784), dtype=np.float32), rng.integers(0, 10, b)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call: CPU time is robust to other processes' load."""
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def private_step(units: StreamedGradients, l2_clip: float) -> np.ndarray:
    """The privacy path of one release, fused as in Agent.release: norms, clip scales, clipped sum in one pass."""
    bound = l2_clip / (1.0 + units.norm_rel_error)

    def weights(start: int, norms: np.ndarray) -> np.ndarray:
        finite = np.isfinite(norms)
        scales = clip_scales(np.where(finite, norms, 0.0), np.full(norms.size, bound), dtype_eps=FLOAT32_EPS) * finite
        return scales * (units.charged_norms(norms, scales) > 0)  # every unit admitted that sends anything

    total = units.clipped_sum(weights)
    units.scale(clip_scales(units.norms(), np.full(units.n_units, bound), dtype_eps=FLOAT32_EPS))  # the charge
    return total


def plain_gradient(model: nn.Module, source: object, chunk_size: int, device: str) -> torch.Tensor:
    """The non-private full-batch gradient of the summed loss: one ordinary backward per chunk, accumulated."""
    params = [p for p in model.parameters()]
    total = [torch.zeros_like(p) for p in params]
    for xb, yb in source.batches(chunk_size):  # type: ignore[attr-defined]
        x = torch.as_tensor(xb).to(device)
        y = torch.as_tensor(yb).to(device=device, dtype=torch.int64)
        grads = torch.autograd.grad(LOSS(model(x), y).sum(), params)
        for t, g in zip(total, grads, strict=True):
            t += g
    return torch.cat([t.reshape(-1) for t in total])


def vmhwm_mb() -> float:
    """Peak resident set size of this process so far (MiB), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def scale_child(n: int, chunk_size: int, device: str) -> dict[str, float]:
    """One size of part 1, in this (fresh) process."""
    torch.manual_seed(0)
    model = build_model("mlp", seed=0, in_features=784, hidden=(1024, 256), out_features=10).to(device)
    source = SeededSource(n)
    warm = SeededSource(2 * chunk_size, seed=1)  # first calls (kernels, caches) are not the step's work
    private_step(StreamedGradients(model, LOSS, warm, chunk_size=chunk_size, device=device, hooks=True), 1.0)
    plain_gradient(model, warm, chunk_size, device)
    units = StreamedGradients(model, LOSS, source, chunk_size=chunk_size, device=device, hooks=True)
    (t_engine, c_engine) = timed(lambda: private_step(units, 1.0), device)
    peak = vmhwm_mb()
    gpu_peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else 0.0
    (t_plain, c_plain) = timed(lambda: plain_gradient(model, source, chunk_size, device), device)
    return {
        "n": n,
        "d": parameter_count(model),
        "peak_rss_mb": peak,
        "gpu_peak_mb": gpu_peak,
        "t_engine": t_engine,
        "t_plain": t_plain,
        "c_engine": c_engine,
        "c_plain": c_plain,
        "method": units.method,
    }


def part_scale(sizes: list[int], chunk_size: int, device: str) -> str:
    """Part 1; returns the summary line the script ends with."""
    print(
        f"== part 1: one record-unit request, MLP 784-1024-256-10, chunk {chunk_size}, device {device}, "
        f"{torch.get_num_threads()} torch threads"
    )
    results = []
    for n in sizes:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                *("--child", str(n), "--chunk-size", str(chunk_size), "--device", device),
                *("--threads", str(torch.get_num_threads())),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(r)
        materialised_gb = r["n"] * r["d"] * 4 / 1e9
        print(
            f"n={r['n']:>7} d={r['d']} ({r['method']}): engine {r['t_engine']:.1f} s, plain gradient "
            f"{r['t_plain']:.1f} s, ratio {r['t_engine'] / r['t_plain']:.2f} (CPU time: {r['c_engine']:.1f} / "
            f"{r['c_plain']:.1f} s = {r['c_engine'] / r['c_plain']:.2f}); peak RSS {r['peak_rss_mb']:.0f} MiB"
            + (f", GPU peak {r['gpu_peak_mb']:.0f} MiB" if device.startswith("cuda") else "")
            + f" (materialised rows would be {materialised_gb:.0f} GB)"
        )
    if len(results) > 1:
        growth = results[-1]["peak_rss_mb"] / results[0]["peak_rss_mb"]
        print(f"peak RSS growth {results[0]['n']} -> {results[-1]['n']}: {growth:.2f}x")
    last = results[-1]
    print(f"cpu_time_ratio_to_plain={last['c_engine'] / last['c_plain']:.2f} (this process's CPU seconds)")
    return (
        f"peak_rss_mb={last['peak_rss_mb']:.0f} n={last['n']} d={last['d']} "
        f"ratio_to_plain={last['t_engine'] / last['t_plain']:.2f}"
    )


def opacus_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk_size: int, l2_clip: float) -> torch.Tensor:
    """Opacus GradSampleModule per-sample gradients, then per-sample clipping and the sum, chunk by chunk."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(model)
    params = [p for p in gsm.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for start in range(0, len(x), chunk_size):
        xb, yb = x[start : start + chunk_size], y[start : start + chunk_size]
        for p in params:
            p.grad_sample = None
        LOSS(gsm(xb), yb).sum().backward()
        samples = [p.grad_sample.reshape(len(xb), -1) for p in params]
        norms = torch.stack([s.norm(2, dim=1) for s in samples], dim=1).norm(2, dim=1)
        factors = (l2_clip / (norms + 1e-6)).clamp(max=1.0)
        for t, p in zip(total, params, strict=True):
            t += torch.einsum("i,i...", factors, p.grad_sample)
            p.grad = None
    gsm._close()
    return torch.cat([t.reshape(-1) for t in total])


def materialised_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk_size: int, l2_clip: float) -> object:
    from client_agent.gradients import per_example_gradients

    rows = per_example_gradients(model, LOSS, x, y, chunk_size=chunk_size)
    norms = rows.double().norm(dim=1)
    return ((rows * (l2_clip / norms).clamp(max=1.0)[:, None].float()).sum(0)).double()


def part_mnist(data_dir: Path, n: int, chunk_size: int, device: str, repeats: int) -> None:
    from simulations.datasets.idx import load_idx_dataset, normalise_images

    images, labels = load_idx_dataset("mnist", data_dir, split="train")
    x_np = normalise_images(images[:n], dataset="mnist")
    y_np = labels[:n].astype(np.int64)
    model = build_model("opacus_mnist_cnn", seed=0).to(device)
    d = parameter_count(model)
    print(
        f"== part 2: opacus_mnist_cnn (d={d}) on {n} MNIST records, chunk {chunk_size}, device {device}, "
        f"{torch.get_num_threads()} torch threads"
    )
    source = ArraySource(x_np, y_np)
    x, y = torch.from_numpy(x_np).to(device), torch.from_numpy(y_np).to(device)

    def engine(src: ArraySource = source) -> object:
        return private_step(StreamedGradients(model, LOSS, src, chunk_size=chunk_size, device=device, hooks=True), 1.0)

    warm = ArraySource(x_np[: 2 * chunk_size], y_np[: 2 * chunk_size])  # first calls are not the step's work
    engine(warm)
    plain_gradient(model, warm, chunk_size, device)

    plain = [timed(lambda: plain_gradient(model, source, chunk_size, device), device) for _ in range(repeats)]
    private = [timed(engine, device) for _ in range(repeats)]
    t_plain, c_plain = min(t for t, _ in plain), min(c for _, c in plain)
    t_engine, c_engine = min(t for t, _ in private), min(c for _, c in private)
    print(
        f"plain gradient {t_plain:.2f} s (CPU {c_plain:.2f} s); privacy path, engine "
        f"(norms, clip scales, clipped sum) {t_engine:.2f} s (CPU {c_engine:.2f} s)"
    )
    print(f"privacy_path_over_plain={t_engine / t_plain:.2f} cpu_time_ratio={c_engine / c_plain:.2f} (goal <= 2.0)")
    import warnings

    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus's hooks, on input x
    try:
        import opacus

        name = f"opacus {opacus.__version__} GradSampleModule + per-sample clipping"
        other: Callable[[], object] = lambda: opacus_step(model, x, y, chunk_size, 1.0)  # noqa: E731
        check = opacus_step(model, x[:512], y[:512], chunk_size, 1.0).double().cpu().numpy()
    except ImportError:
        name = "old materialising path per_example_gradients (opacus not installed)"
        other = lambda: materialised_step(model, x, y, chunk_size, 1.0)  # noqa: E731
        check = None
    if check is not None:  # both clip to 1.0 (Opacus with its 1e-6 guard, the engine to 1/(1+E))
        ours = private_step(
            StreamedGradients(model, LOSS, ArraySource(x_np[:512], y_np[:512]), device=device, hooks=True), 1.0
        )
        print(
            f"check: engine vs opacus clipped sum on 512 records, relative difference "
            f"{np.linalg.norm(ours - check) / np.linalg.norm(check):.1e} (clip 1/(1+{NORM_REL_ERROR}) vs 1)"
        )
    others = [timed(other, device) for _ in range(repeats)]
    t_other, c_other = min(t for t, _ in others), min(c for _, c in others)
    print(f"{name}: {t_other:.2f} s (CPU {c_other:.2f} s)")
    print(
        f"speedup_vs_baseline={t_other / t_engine:.2f} cpu_time_speedup={c_other / c_engine:.2f} (goal >= 1.5) "
        f"baseline={name.split(' ')[0]}"
    )
    if device == "cpu":
        t_agent = agent_request(model, x_np, y_np, repeats)
        print(
            f"whole request through Agent.handle (decode, policy, per-record gradients, filter, ledger commit, "
            f"reply): {t_agent:.2f} s; agent_request_over_plain={t_agent / t_plain:.2f} (goal <= 2.0) "
            f"agent_speedup_vs_baseline={t_other / t_agent:.2f} (goal >= 1.5)"
        )


def agent_request(model: nn.Module, x_np: np.ndarray, y_np: np.ndarray, repeats: int) -> float:
    """The product's own path: one client agent holding every record (record units, local trust)
    answers one gradient request for ``model``; the best of ``repeats`` fresh agents and ledgers."""
    import tempfile

    from client_agent.agent import Agent
    from client_agent.config import parse_agent_config
    from protocol import messages as wire
    from workloads.models import flatten_parameters

    root = Path(tempfile.mkdtemp(prefix="fedfilter-stream-bench-"))
    np.savez(root / "data.npz", x=x_np, y=y_np)
    request = wire.GradientRequest(
        "r1", "bench", 1, 2.0, 1.0, "local", "record", "opacus_mnist_cnn", "{}", flatten_parameters(model)
    )
    best = float("inf")
    for k in range(repeats):
        node = {"ledger-path": str(root / f"ledger{k}.sqlite"), "data-path": str(root / "data.npz")}
        agent = Agent(parse_agent_config(node | {"epsilon": 8.0, "delta": 1e-5, "unit": "record"}))
        try:
            start = time.perf_counter()
            out = agent.handle(wire.GRADIENT, *wire.encode_request(request))
            best = min(best, time.perf_counter() - start)
            assert not out.is_error, out.local_detail
        finally:
            agent.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a minute")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--data-dir", type=Path, default=Path("/work/shared/data"))
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--skip", choices=("scale", "mnist"), default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.child:
        print(json.dumps(scale_child(args.child, args.chunk_size, args.device)))
        return
    last = ""
    if args.skip != "scale":
        last = part_scale([1_000, 10_000] if args.quick else [10_000, 100_000], args.chunk_size, args.device)
    if args.skip != "mnist":
        part_mnist(args.data_dir, 6_000 if args.quick else 60_000, args.chunk_size, args.device, 1 if args.quick else 2)
    if last:
        print(last)  # the one-line summary of part 1, last


if __name__ == "__main__":
    main()
