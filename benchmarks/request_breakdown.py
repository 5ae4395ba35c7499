"""Benchmark: where one small request's time goes in a simulation's agent, against the plain client's work.

A cross-device simulation's round time is Flower's per-message cost plus each client's work
(issue 24; benchmarks/simulation.py measures whole rounds). This script looks inside one client:

(a) one request of a kept-open agent (``client_agent.direct.answer_request``, the simulation
    ClientApp's path) for a 100-record client, logistic regression on 20 features, against the
    plain Flower client's work in the same loop (load the data file, build the model, one summed
    gradient), interleaved; the agent's time split by its parts (they are timed by wrapping the
    methods, so the parts are exclusive except where noted);
(b) the same requests when two caches (two simulation actors) answer for each client in turn, so
    each finds the other's commit and reopens the ledger with every check, keeping its data.

Run: .venv/bin/python benchmarks/request_breakdown.py [--unit record|client] [--requests N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from client_agent import agent as agent_module
from client_agent import ledger as ledger_module
from client_agent.agent_cache import AgentCache
from client_agent.direct import answer_request
from client_agent.gradients import summed_gradient
from client_agent.workloads import _cross_entropy
from protocol import messages as wire
from simulations.datasets.synthetic import synthetic_classification
from simulations.federation import write_clients
from workloads.models import build_model, flatten_parameters, load_flat_parameters

MODEL_ARGS = {"in_features": 20, "n_classes": 2}
PARTS = {
    (agent_module.Agent, "release"): "release: per-record gradients (isolated), checks, clip, charge, noise",
    (ledger_module.Ledger, "commit"): "ledger commit (charge, release record, reply; one fsync)",
    (agent_module.Agent, "contributions"): "model (a cached copy) and contributions set-up",
    (ledger_module.Ledger, "state"): "state read and checksum",
    (ledger_module.Ledger, "quota_state"): "quota state read",
    (agent_module.Agent, "check_policy"): "policy checks",
}


def timed_parts() -> dict[str, float]:
    spent: dict[str, float] = defaultdict(float)
    for (cls, name), label in PARTS.items():
        original = getattr(cls, name)

        def wrapper(*args: Any, _f: Callable[..., Any] = original, _label: str = label, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - t0

        setattr(cls, name, wrapper)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", choices=["record", "client"], default="record")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=50, help="clients for part (b)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="fedfilter-breakdown-"))
    x, y = synthetic_classification(100 * args.clients, 20, 2, seed=0, separation=2.5)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    parts = [(x[i * 100 : (i + 1) * 100], y[i * 100 : (i + 1) * 100]) for i in range(args.clients)]
    per = write_clients(
        root / "clients",
        parts,
        ledger_dir=root / "ledgers",
        epsilon=1e3,
        delta=1e-5,
        unit=args.unit,
        trust="central",
        filter="gdp",
        noise_seed=0,
        policy_max_request_share=1.0,
    )
    params = flatten_parameters(build_model("logreg", **MODEL_ARGS))
    local = {"local_steps": 5, "local_lr": 0.5, "local_batch_size": 16} if args.unit == "client" else {}
    rounds = iter(range(1, 10**9))

    def request(client: int, cache: AgentCache) -> None:
        r = next(rounds)
        req = wire.GradientRequest(
            request_id=f"r{r}",
            run_id="bench",
            round=r,
            noise_std=8.0,
            l2_clip=1.0,
            trust="central",
            unit=args.unit,
            model="logreg",
            model_args=json.dumps(MODEL_ARGS, sort_keys=True),
            parameters=params,
            **local,
        )
        outcome = answer_request(per[client], wire.GRADIENT, *wire.encode_request(req), cache=cache, simulation=True)
        assert not outcome.is_error, outcome.error_reason

    data = Path(per[0]["data-path"])

    def plain() -> None:
        with np.load(data) as d:
            xx, yy = torch.from_numpy(d["x"]), torch.from_numpy(d["y"].astype(np.int64))
        model = build_model("logreg", **MODEL_ARGS)
        load_flat_parameters(model, params)
        summed_gradient(model, _cross_entropy, xx, yy)

    # (a)
    cache = AgentCache()
    for _ in range(10):
        request(0, cache)
        plain()
    spent = timed_parts()
    ours, base = [], []
    for _ in range(args.requests):
        t0 = time.perf_counter()
        request(0, cache)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain()
        base.append(time.perf_counter() - t0)
    mean, plain_mean = statistics.mean(ours), statistics.mean(base)
    print(f"(a) {args.unit} units, 100 records, logreg, 1 torch thread, {args.requests} requests interleaved")
    print(f"  plain client (load, build, summed gradient)     {plain_mean * 1e3:7.2f} ms")
    print(f"  fedfilter request, agent kept open              {mean * 1e3:7.2f} ms   ratio {mean / plain_mean:5.2f}")
    top = 0.0
    for label, total in sorted(spent.items(), key=lambda kv: -kv[1]):
        share = total / args.requests
        if not label.startswith(("state", "quota")):  # those two are also read inside commit's checks
            top += share
        print(f"    {label:66s} {share * 1e3:6.2f} ms")
    print(f"    {'the rest: decode, replay lookup, digest, audit line, reply':66s} {(mean - top) * 1e3:6.2f} ms")

    # (b)
    caches = [AgentCache(), AgentCache()]
    for c in range(args.clients):
        for k in (0, 1):
            request(c, caches[k])
    t0 = time.perf_counter()
    for i in range(6):
        for c in range(args.clients):
            request(c, caches[i % 2])
    alternating = (time.perf_counter() - t0) / (6 * args.clients)
    t0 = time.perf_counter()
    for _ in range(6):
        for c in range(args.clients):
            request(c, caches[0])
    same = (time.perf_counter() - t0) / (6 * args.clients)
    print(f"(b) {args.clients} clients, two caches answering in turn (two simulation actors)")
    print(
        f"  each request finds the other's commit           {alternating * 1e3:7.2f} ms   ledgers reopened: "
        f"{caches[0].refreshed + caches[1].refreshed}"
    )
    print(f"  the same cache answers again                    {same * 1e3:7.2f} ms   ratio {alternating / same:5.2f}")


if __name__ == "__main__":
    main()
