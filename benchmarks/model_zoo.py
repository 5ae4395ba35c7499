"""Benchmark (issue 22): one record-unit request through ``Agent.handle`` on a zoo of models, against a plain
full-batch gradient of the same records and against Opacus, measured in this script.

For each model: a fresh agent (record units, local trust, its own ledger) answers one gradient request
over all its records (decode, policy, the isolated per-record engine, the filter, ledger commit,
reply); the baseline is the non-private gradient of the summed loss over the same records, one
ordinary backward per chunk of 1,024, the records read through the same data source as the agent reads
them (the workload's: arrays, or a torch Dataset item by item), in its fastest layout (for convolutions, contiguous or
channels_last, whichever is faster here); Opacus is ``GradSampleModule`` + per-sample clipping and the
clipped sum, where Opacus supports the model without replacing its layers (``na`` otherwise: LSTM
and attention need Opacus's own DPLSTM / DPMultiheadAttention). Timings are interleaved and the best
of ``--repeats`` is kept, at 1 and 2 torch threads.

Models: Opacus's MNIST CNN on the MNIST training records (60,000), the GroupNorm CNN of
examples/gn_regression, and from examples/model_zoo the bag of tokens, the LSTM classifier and the
2-layer transformer encoder with positional embeddings, and the 784-1024-256-10 MLP (1,068,810
parameters); 20,000 records each unless ``--records``.

Output: one line per model and thread count, ``model=<name> threads=<k> n=<n> ratio_to_plain=<r>
ratio_to_opacus=<r|na>``, then ``worst_ratio_to_plain=<r>``.

Run: .venv/bin/python benchmarks/model_zoo.py [--quick] [--models cnn mlp ...] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from protocol import messages as wire
from workloads.models import flatten_parameters, parameter_count

DATA_DIR = Path(os.environ.get("FEDFILTER_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
CHUNK = 1024


@dataclass
class Case:
    name: str
    workload: str  # the agent TOML's workload reference
    model: str
    model_args: dict[str, Any]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    write: Callable[[Path, int], tuple[Path, np.ndarray, np.ndarray]]  # (data path, x, y) for n records
    opacus: bool
    conv: bool = False


def _npz(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    np.savez(path, x=x, y=y)
    return path


def _mnist(root: Path, n: int) -> tuple[Path, np.ndarray, np.ndarray]:
    from simulations.datasets.idx import load_idx_dataset, normalise_images

    images, labels = load_idx_dataset("mnist", DATA_DIR, split="train")
    x, y = normalise_images(images[:n], dataset="mnist"), labels[:n].astype(np.int64)
    return _npz(root / "mnist.npz", x, y), x, y


def _features(root: Path, n: int) -> tuple[Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((n, 784), dtype=np.float32), rng.integers(0, 10, n)
    return _npz(root / "features.npz", x, y), x, y


def _grids(root: Path, n: int) -> tuple[Path, np.ndarray, np.ndarray]:
    from examples.gn_regression.workload import make_records, write_records

    x, y = make_records(n, seed=0)
    return write_records(root / "grids.f32", x, y), x, y


def _tokens(root: Path, n: int) -> tuple[Path, np.ndarray, np.ndarray]:
    from examples.model_zoo.workload import make_records

    x, y = make_records(n, seed=0)
    return _npz(root / "tokens.npz", x, y), x, y


def _cases() -> dict[str, Case]:
    from examples.gn_regression.workload import squared_error
    from examples.model_zoo.workload import cross_entropy
    from workloads.builtin import cross_entropy as builtin_ce

    zoo = "examples.model_zoo.workload:WORKLOAD"
    mlp_args = {"in_features": 784, "hidden": [1024, 256], "out_features": 10}
    return {
        "mnist_cnn": Case("mnist_cnn", "builtin", "opacus_mnist_cnn", {}, builtin_ce, _mnist, True, conv=True),
        "gn_cnn": Case(
            "gn_cnn", "examples.gn_regression.workload:WORKLOAD", "gn_cnn", {}, squared_error, _grids, True, conv=True
        ),
        "bag_of_tokens": Case("bag_of_tokens", zoo, "bag", {}, cross_entropy, _tokens, True),
        "lstm": Case("lstm", zoo, "lstm", {}, cross_entropy, _tokens, False),
        "transformer": Case("transformer", zoo, "transformer", {"layers": 2}, cross_entropy, _tokens, False),
        "mlp_1m": Case("mlp_1m", "builtin", "mlp", mlp_args, builtin_ce, _features, True),
    }


def _build(case: Case) -> nn.Module:
    from workloads.registry import load_workload

    return load_workload(case.workload).build_model(case.model, seed=0, **case.model_args)


def _batches(source: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The records as the agent reads them: the workload's own data source, chunk by chunk."""
    for xa, ya in source.batches(CHUNK):
        xb, yb = torch.as_tensor(np.asarray(xa)), torch.as_tensor(np.asarray(ya))
        yield (xb.float() if xb.is_floating_point() else xb.long()), yb


def plain(model: nn.Module, case: Case, source: Any, layout: torch.memory_format) -> None:
    """The non-private gradient of the summed loss over the same records read the same way, one backward per
    chunk, accumulated."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for xb, yb in _batches(source):
        if layout is torch.channels_last and xb.ndim == 4:
            xb = xb.contiguous(memory_format=torch.channels_last)
        for t, g in zip(total, torch.autograd.grad(case.loss(model(xb), yb).sum(), params), strict=True):
            t += g


def opacus(model: nn.Module, case: Case, source: Any) -> None:
    """Opacus GradSampleModule per-sample gradients, per-sample clipping to 1, the clipped sum."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(model)
    params = [p for p in gsm.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for xb, yb in _batches(source):
        for p in params:
            p.grad_sample = None
        case.loss(gsm(xb), yb).sum().backward()
        norms = torch.stack([p.grad_sample.reshape(len(xb), -1).norm(dim=1) for p in params], dim=1).norm(dim=1)
        factors = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        for t, p in zip(total, params, strict=True):
            t += torch.einsum("i,i...", factors, p.grad_sample)
            p.grad = None
    gsm._close()


def agent_request(case: Case, data: Path, model: nn.Module, root: Path, k: str) -> float:
    """Seconds of one gradient request through Agent.handle, on a fresh agent and ledger opened beforehand
    (an owner's agent is a long-lived service: opening it is not a request's work)."""
    import json

    from client_agent.agent import Agent
    from client_agent.config import parse_agent_config

    node = {
        "ledger-path": str(root / f"ledger-{case.name}-{k}.sqlite"),
        "data-path": str(data),
        "workload": case.workload,
        "epsilon": 8.0,
        "delta": 1e-5,
        "unit": "record",
        "trust": "local",
        # A deployed agent's policy must be explicit: what this benchmark's request asks (noise std 2, clip 1).
        "policy-min-noise-std": 2.0,
        "policy-max-clip": 1.0,
    }
    agent = Agent(parse_agent_config(node))
    args = json.dumps(case.model_args)
    request = wire.GradientRequest(
        "r1", "bench", 1, 2.0, 1.0, "local", "record", case.model, args, flatten_parameters(model)
    )
    try:
        start = time.perf_counter()
        out = agent.handle(wire.GRADIENT, *wire.encode_request(request))
        elapsed = time.perf_counter() - start
        if out.is_error:
            raise RuntimeError(f"{case.name}: the agent refused: {out.local_detail}")
    finally:
        agent.close()
    return elapsed


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_case(case: Case, n: int, threads: int, repeats: int, root: Path) -> tuple[float, float | None]:
    torch.set_num_threads(threads)
    from workloads.registry import load_workload

    data, _, _ = case.write(root, n)
    source = load_workload(case.workload).data(data)
    model = _build(case)
    layouts = [torch.contiguous_format] + ([torch.channels_last] if case.conv else [])
    k = (f"{threads}-{i}" for i in range(10_000))  # a fresh ledger per request: nothing is a stored replay
    # Warm-up on a small slice: first calls (kernels, caches, vmap tracing) are not the request's work.
    agent_request(case, case.write(root / "warm", min(n, 2 * CHUNK))[0], model, root / "warm", next(k))
    t_agent, t_plain, t_opacus = float("inf"), float("inf"), float("inf")
    for _ in range(repeats):  # interleaved: a slow moment of the machine hits every contender alike
        t_plain = min(t_plain, *(best(functools.partial(plain, model, case, source, lay), 1) for lay in layouts))
        t_agent = min(t_agent, agent_request(case, data, model, root, next(k)))
        if case.opacus:
            t_opacus = min(t_opacus, best(lambda: opacus(_build(case), case, source), 1))
    ratio = t_agent / t_plain
    to_opacus = t_agent / t_opacus if case.opacus else None
    print(
        f"   {case.name}: d={parameter_count(model)} agent {t_agent:.2f} s, plain {t_plain:.2f} s"
        + (f", opacus {t_opacus:.2f} s" if case.opacus else ", opacus na"),
        flush=True,
    )
    return ratio, to_opacus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cases = _cases()
    parser.add_argument("--models", nargs="+", default=list(cases), choices=list(cases))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--records", type=int, default=0, help="records per model (default: 60,000 MNIST, else 20,000)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2,000 records, one repeat: a smoke run")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="There is a performance drop")  # vmap's per-record fallbacks
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus's hooks
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="fedfilter-zoo-") as tmp:
        root = Path(tmp)
        (root / "warm").mkdir()
        for name in args.models:
            for threads in args.threads:
                n = 2_000 if args.quick else args.records or (60_000 if name == "mnist_cnn" else 20_000)
                ratio, to_opacus = run_case(cases[name], n, threads, 1 if args.quick else args.repeats, root)
                worst = max(worst, ratio)
                opacus_text = "na" if to_opacus is None else f"{to_opacus:.2f}"
                print(
                    f"model={name} threads={threads} n={n} ratio_to_plain={ratio:.2f} ratio_to_opacus={opacus_text}",
                    flush=True,
                )
    print(f"worst_ratio_to_plain={worst:.2f}")


if __name__ == "__main__":
    main()
