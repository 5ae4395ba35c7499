"""Benchmark: the privacy layer's overhead on one client round, measured in this script.

(a) ``client`` units, a ~100k-parameter MLP (784-128-10, 101,770 parameters), 600 records:
    baseline  = the client's gradient alone (one backward pass, :func:`summed_gradient`);
    full path = what the ClientApp does for a ``train.gradient`` request: open the agent
                and its ledger, decode and check the request, compute the same gradient,
                partial-clip, charge the filter, add noise, commit charge and reply
                (SQLite, WAL, synchronous=FULL), close (:func:`answer_request`).
    Goal: the privacy layer adds at most 10% to a round.
(b) per-record gradients: see benchmarks/per_record_gradients.py.

Run: .venv/bin/python benchmarks/client_round.py [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from client_agent.client_app import answer_request
from client_agent.gradients import summed_gradient
from client_agent.workloads import _cross_entropy
from protocol import messages as wire
from protocol.models import build_model, flatten_parameters, load_flat_parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--records", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="fedfilter-bench-"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.records, 784)).astype(np.float32)
    y = rng.integers(0, 10, args.records)
    np.savez(root / "data.npz", x=x, y=y)
    model_args = {"in_features": 784, "hidden": [128], "out_features": 10}
    model = build_model("mlp", **model_args)
    params = flatten_parameters(model)
    node_config = {
        "ledger-path": str(root / "ledger.sqlite"),
        "data-path": str(root / "data.npz"),
        "epsilon": 1e6,
        "delta": 1e-5,
        "unit": "client",
        "trust": "local",
    }

    def baseline() -> None:
        m = build_model("mlp", **model_args)
        load_flat_parameters(m, params)
        summed_gradient(m, _cross_entropy, torch.from_numpy(x), torch.from_numpy(y))

    counter = iter(range(10**9))

    def full() -> None:
        i = next(counter)
        request = wire.GradientRequest(
            request_id=f"b{i}",
            run_id="bench",
            round=i + 1,
            noise_std=1.0,
            l2_clip=1.0,
            trust="local",
            unit="client",
            model="mlp",
            model_args=json.dumps(model_args, sort_keys=True),
            parameters=params,
        )
        outcome = answer_request(node_config, wire.GRADIENT, *wire.encode_request(request))
        assert not outcome.is_error, outcome.error_reason

    full()  # creates the ledger
    baseline()
    base_t, full_t = [], []
    for _ in range(args.repeats):  # interleaved, so background load hits both alike
        t0 = time.perf_counter()
        baseline()
        base_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        full()
        full_t.append(time.perf_counter() - t0)
    b, f = statistics.median(base_t), statistics.median(full_t)
    print(f"model: mlp 784-128-10, {params.size:,} parameters; {args.records} records; client units; local trust")
    print(f"repeats: {args.repeats} (interleaved); torch threads: 2")
    print(f"  gradient only (baseline)            median {b * 1e3:8.2f} ms   best {min(base_t) * 1e3:8.2f} ms")
    print(f"  full client round (privacy layer)   median {f * 1e3:8.2f} ms   best {min(full_t) * 1e3:8.2f} ms")
    print(f"ratio full / baseline (median): {f / b:.3f}  -> privacy layer adds {100 * (f / b - 1):.1f}%")
    print(f"ratio full / baseline (best):   {min(full_t) / min(base_t):.3f}")


if __name__ == "__main__":
    main()
