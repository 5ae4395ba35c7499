"""Benchmark: the privacy layer's overhead on one client round, measured in this script.

(a) ``client`` units, a ~100k-parameter MLP (784-128-10, 101,770 parameters), at several
    client data sizes (``--records``, default 600 and 6000):
    baseline  = the client's gradient alone (one backward pass, :func:`summed_gradient`);
    kept open = what the ClientApp does for a ``train.gradient`` request in a process that
                answers many (a Ray actor, a long-lived ClientApp): take the open agent
                (client_agent/agent_cache.py), decode and check the request, compute the same
                gradient, partial-clip, charge the filter, add noise, commit charge and reply
                (SQLite, WAL, synchronous=FULL) (:func:`answer_request`);
    cold      = the same, opening the agent for this request alone: load and fingerprint the
                data, open the ledger with every check (integrity_check), and close it
                (WAL checkpoint) afterwards (``answer_request(..., cache=None)``).
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

from client_agent.agent_cache import AgentCache
from client_agent.direct import answer_request
from client_agent.gradients import summed_gradient
from client_agent.workloads import _cross_entropy
from protocol import messages as wire
from workloads.models import build_model, flatten_parameters, load_flat_parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--records", type=int, nargs="+", default=[600, 6000])
    args = parser.parse_args()
    torch.set_num_threads(2)
    for records in args.records:
        measure(records, args.repeats)


def measure(records: int, repeats: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="fedfilter-bench-"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(records, 784)).astype(np.float32)
    y = rng.integers(0, 10, records)
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

    cache = AgentCache()

    def full(kept_open: bool = True) -> None:
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
        outcome = answer_request(
            # Separate ledgers: a cold open and close of the kept agent's ledger would (rightly) force it to reopen.
            node_config | {"ledger-path": str(root / ("kept.sqlite" if kept_open else "cold.sqlite"))},
            wire.GRADIENT,
            *wire.encode_request(request),
            cache=cache if kept_open else None,
            simulation=True,  # the simulation engines' agents (a deployed agent needs explicit policy bounds)
        )
        assert not outcome.is_error, outcome.error_reason

    full(True)  # creates the ledgers
    full(False)
    baseline()
    times: dict[str, list[float]] = {"baseline": [], "kept open": [], "cold": []}
    runs = {"baseline": baseline, "kept open": lambda: full(True), "cold": lambda: full(False)}
    for _ in range(repeats):  # interleaved, so background load hits all alike
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    cache.clear()
    size_mb = (root / "kept.sqlite").stat().st_size / 1e6
    print(f"model: mlp 784-128-10, {params.size:,} parameters; {records} records; client units; local trust")
    print(f"repeats: {repeats} (interleaved); torch threads: 2; ledger {size_mb:.1f} MB at the end")
    b = statistics.median(times["baseline"])
    for name, label in (
        ("baseline", "gradient only (baseline)"),
        ("kept open", "client round, agent kept open"),
        ("cold", "client round, agent opened cold"),
    ):
        t = times[name]
        med = statistics.median(t)
        print(
            f"  {label:34s} median {med * 1e3:8.2f} ms   best {min(t) * 1e3:8.2f} ms   "
            f"ratio {med / b:6.3f} (adds {100 * (med / b - 1):6.1f}%)"
        )
    print()


if __name__ == "__main__":
    main()
