"""Benchmark: the convolution patches without the redundant copies, against the earlier patches.

``client_agent.layers.conv.patches`` gathers each record's unfolded input for its per-record conv
gradient. It used to pad every input (also with zero padding) and copy it channels-last (also when it
was channels-last already, as the built-in channels-last MNIST CNN's activations are); now it does
neither where it need not. This script times the agent's fused pass (``fused_clipped_sum``, clip 1)
over ``--records`` MNIST records with the built-in MNIST CNN, with the earlier patches (kept here as
the baseline) and the current ones, interleaved, ``--repeats`` each after a warm-up, and prints the
medians and ``ratio=<earlier / current>`` (above 1: the current is faster), and whether the norms and
sums are bit for bit the same.

Run: .venv/bin/python benchmarks/conv_patches.py [--records 6000] [--repeats 7] [--threads 1] [--data-dir D]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from client_agent.layers import conv
from client_agent.streaming import ArraySource, fused_clipped_sum
from simulations.datasets.idx import default_data_dir, load_idx_dataset, normalise_images
from workloads.models import build_model


def earlier_patches(a: torch.Tensor, k: conv.Pair, d: conv.Pair, p: conv.Pair, s: conv.Pair) -> torch.Tensor:
    """The patches as they were before 2026-11-27: always padded, always copied channels-last."""
    padded = nn.functional.pad(a, (p[1], p[1], p[0], p[0]))
    b, c, h, w = padded.shape
    oh, ow = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1, (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
    last = torch.empty((b, h, w, c), dtype=a.dtype, device=a.device)
    last.copy_(padded.permute(0, 2, 3, 1))
    sb, sh, sw, sc = last.stride()
    view = last.as_strided((b, oh, ow, k[0], k[1], c), (sb, sh * s[0], sw * s[1], sh * d[0], sw * d[1], sc))
    return view.reshape(b, oh * ow, c * k[0] * k[1])


def _clip(start: int, norms: np.ndarray) -> np.ndarray:
    return np.asarray(np.minimum(1.0, 1.0 / np.maximum(norms, 1e-12)), dtype=np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", type=Path, help="the folder holding mnist/ (default: the shared copy)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    images, labels = load_idx_dataset("mnist", args.data_dir or default_data_dir(), split="train")
    x = normalise_images(images[: args.records])
    y = np.asarray(labels[: args.records], dtype=np.int64)
    model, loss = build_model("opacus_mnist_cnn", seed=0), functools.partial(F.cross_entropy, reduction="none")
    current = conv.patches
    variants = {"earlier": earlier_patches, "current": current}
    times: dict[str, list[float]] = {name: [] for name in variants}
    out = {}
    try:
        for rep in range(args.repeats + 1):  # the first round warms both up
            for name, fn in variants.items():
                conv.patches = fn
                started = time.perf_counter()
                out[name] = fused_clipped_sum(model, loss, ArraySource(x, y), _clip)
                if rep:
                    times[name].append(time.perf_counter() - started)
    finally:
        conv.patches = current
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name}: median {med[name]:.3f} s (min {min(t):.3f}, max {max(t):.3f}), {args.threads} threads")
    same = np.array_equal(out["earlier"][0], out["current"][0]) and np.array_equal(out["earlier"][1], out["current"][1])
    print(f"ratio={med['earlier'] / med['current']:.3f} (earlier / current); norms and sum bit for bit: {same}")


if __name__ == "__main__":
    main()
