"""Benchmark: the per-record engine on a CNN whose weights are channels-last, against the same CNN in NCHW.

The per-record engine (``client_agent.isolation``) runs the owner's module in the memory format it comes
in. A model whose 2-D convolution weights are channels-last (``model.to(memory_format=torch.channels_last)``)
gives channels-last convolution outputs inside each record's function, so pooling and activations run
PyTorch's channels-last CPU kernels (its max-pool kernel is vectorised over channels there, not in NCHW).
This script times the agent's fused pass (``client_agent.streaming.fused_clipped_sum``: each record's
gradient alone, clipped at 1, summed) on the same parameters in both layouts, interleaved, the best of
``--repeats`` each, at each ``--threads``, on:

- Opacus's MNIST CNN (the built-in ``opacus_mnist_cnn``, channels-last since this measurement) on the first
  ``--records`` MNIST training records: the FZ Sec. 5.1 campaign's work;
- the GroupNorm CNN of examples/gn_regression on its generated 8x8 grids (no pooling: left in NCHW).

It also prints the largest relative difference of the two layouts' clipped sums and norms (float32
rounding). Output: one line per model and thread count with both times and ``ratio=<NCHW / channels-last>``
(above 1: channels-last is faster).

Run: .venv/bin/python benchmarks/conv_layout.py [--records N] [--repeats R] [--threads 1 2] [--models ...]
[--data-dir D]
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from client_agent.streaming import ArraySource, fused_clipped_sum


def _weights(start: int, norms: np.ndarray) -> np.ndarray:  # clip at 1
    return np.asarray(np.minimum(1.0, 1.0 / np.maximum(norms, 1e-12)), dtype=np.float64)


def _mnist(records: int, data_dir: Path | None) -> tuple[nn.Module, Callable[..., torch.Tensor], ArraySource]:
    from simulations.datasets.idx import default_data_dir, load_idx_dataset, normalise_images
    from workloads.models import build_model

    images, labels = load_idx_dataset("mnist", data_dir or default_data_dir(), split="train")
    x, y = normalise_images(images[:records]), np.asarray(labels[:records], dtype=np.int64)
    loss = functools.partial(F.cross_entropy, reduction="none")
    return build_model("opacus_mnist_cnn", seed=0), loss, ArraySource(x, y)


def _grids(records: int, data_dir: Path | None) -> tuple[nn.Module, Callable[..., torch.Tensor], ArraySource]:
    from examples.gn_regression.workload import gn_cnn, make_records, squared_error
    from workloads.models import build_with

    x, y = make_records(records, seed=0)
    return build_with(gn_cnn, "gn_cnn", seed=0), squared_error, ArraySource(x, y)


def _pass(
    model: nn.Module, loss: Callable[..., torch.Tensor], source: ArraySource
) -> tuple[float, np.ndarray, np.ndarray]:
    t = time.perf_counter()
    norms, total, _ = fused_clipped_sum(model, loss, source, _weights)
    return time.perf_counter() - t, norms, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=6000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--data-dir", type=Path)
    ap.add_argument(
        "--models", nargs="+", choices=["opacus_mnist_cnn", "gn_cnn"], default=["opacus_mnist_cnn", "gn_cnn"]
    )
    args = ap.parse_args()
    if args.records < 1 or args.repeats < 1 or min(args.threads) < 1:
        raise SystemExit(
            f"--records, --repeats and --threads: expected integers >= 1, got {args.records}, {args.repeats}, "
            f"{args.threads}"
        )
    for name, make in (("opacus_mnist_cnn", _mnist), ("gn_cnn", _grids)):
        if name not in args.models:
            continue
        built, loss, source = make(args.records, args.data_dir)
        models = {  # the same parameters, laid out NCHW (False) and channels-last (True)
            False: copy.deepcopy(built).to(memory_format=torch.contiguous_format),
            True: copy.deepcopy(built).to(memory_format=torch.channels_last),
        }
        for threads in args.threads:
            torch.set_num_threads(threads)
            for layout in (False, True):  # warm-up: the plan, allocations, kernels
                _pass(models[layout], loss, ArraySource(source.x[:512], source.y[:512]))
            best = {False: float("inf"), True: float("inf")}
            out: dict[bool, tuple[np.ndarray, np.ndarray]] = {}
            for _ in range(args.repeats):  # interleaved: a slow moment of the machine hits both alike
                for layout in (False, True):
                    dt, norms, total = _pass(models[layout], loss, source)
                    best[layout] = min(best[layout], dt)
                    out[layout] = (norms, total)
            sum_diff = np.abs(out[True][1] - out[False][1]).max() / np.abs(out[False][1]).max()
            norm_diff = (np.abs(out[True][0] - out[False][0]) / np.maximum(out[False][0], 1e-12)).max()
            print(
                f"model={name} threads={threads} n={args.records} nchw={best[False]:.3f}s "
                f"channels_last={best[True]:.3f}s ratio={best[False] / best[True]:.2f} "
                f"sum_rel_diff={sum_diff:.1e} norm_rel_diff={norm_diff:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
