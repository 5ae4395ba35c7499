"""Benchmark: a federated-GD round in ``secagg`` trust against ``local`` trust, measured in one run.

For 10 and 100 clients and the ~100k-parameter MLP (784-128-10, 101,770 parameters), each
client holding 20 records (``client`` units), both trusts run the same rounds through the
real coordinator (coordinator/rounds.py) and the real client agents on the in-process
transport (simulations/inprocess.py: the agents answer one after the other in this process,
so a round's time is the sum of every client's work plus the coordinator's).

Reported per trust: the round time (median of the rounds after the first), the payload bytes
per client per round in each direction (array bytes plus the JSON of the scalar fields, summed
over every exchange of the round: one in local trust, four in secagg trust), the time spent
in each exchange and in the coordinator's own work (unmasking), and the secagg/local ratios.
m is the default max(2, ceil(2n/3)).

Run: .venv/bin/python benchmarks/secagg.py [--clients 10 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protocol.models import build_model, parameter_count

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

from coordinator.config import CoordinatorConfig
from coordinator.rounds import run
from coordinator.transport import RoundReplies
from protocol import messages as wire
from protocol.records import Payload
from simulations.federation import write_clients
from simulations.inprocess import InProcessTransport

MODEL_ARGS = {"in_features": 784, "hidden": [128], "out_features": 10}
RECORDS = 20  # per client


def payload_bytes(payload: Payload) -> int:
    config, arrays = payload
    return len(json.dumps(config, default=str).encode()) + sum(int(np.asarray(a).nbytes) for a in arrays.values())


class Measured(InProcessTransport):
    """The in-process transport, counting bytes each way and time per exchange (status excluded)."""

    def __init__(self, node_configs: Mapping[int, Mapping[str, Any]]) -> None:
        super().__init__(node_configs)
        self.down = 0  # coordinator -> clients
        self.up = 0  # clients -> coordinator
        self.seconds: dict[str, float] = defaultdict(float)

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        t0 = time.perf_counter()
        got = super().send(message_type, payloads, timeout=timeout)
        if message_type != wire.STATUS:
            self.seconds[message_type] += time.perf_counter() - t0
            self.down += sum(payload_bytes(p) for p in payloads.values())
            self.up += sum(payload_bytes(p) for p in got.replies.values())
        return got


def measure(n: int, trust: str, rounds: int, root: Path) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    parts = [(rng.normal(size=(RECORDS, 784)).astype(np.float32), rng.integers(0, 10, RECORDS)) for _ in range(n)]
    per = write_clients(root / f"{trust}{n}", parts, epsilon=1000.0, delta=1e-5, unit="client", trust=trust)
    cfg = CoordinatorConfig(
        num_nodes=n,
        n_public=n,
        rounds=rounds,
        noise_std=10.0,
        l2_clip=1.0,
        trust=trust,
        unit="client",
        model="mlp",
        model_args=json.dumps(MODEL_ARGS),
        run_id=f"bench-{trust}-{n}",
        progress=False,
    )
    transport = Measured(per)
    summary = run(transport, cfg)
    logs = summary["rounds"]
    assert all(not log["errors"] for log in logs), [log["errors"] for log in logs]
    exchanges = sum(transport.seconds.values())
    total = sum(log["duration_s"] for log in logs)
    return {
        "round_s": statistics.median(log["duration_s"] for log in logs[1:]),
        "up_per_client": transport.up / (n * rounds),
        "down_per_client": transport.down / (n * rounds),
        "exchange_s": {k.split(".")[-1]: v / rounds for k, v in transport.seconds.items()},
        "coordinator_s": (total - exchanges) / rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 2:  # the first round is left out of the median
        parser.error(f"--rounds: expected an integer >= 2, got {args.rounds}")
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="fedfilter-secagg-bench-"))
    d = parameter_count(build_model("mlp", **MODEL_ARGS))
    print(f"MLP 784-128-10 ({d:,} parameters), {RECORDS} records per client, in-process, {args.rounds} rounds")
    for n in args.clients:
        result = {trust: measure(n, trust, args.rounds, root) for trust in ("local", "secagg")}
        local, secagg = result["local"], result["secagg"]
        for trust, r in result.items():
            steps = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(r["exchange_s"].items()))
            print(
                f"n={n:4d} {trust:6s}: round {r['round_s']:.2f} s; per client per round "
                f"{r['up_per_client'] / 1e3:.1f} kB up, {r['down_per_client'] / 1e3:.1f} kB down; "
                f"exchanges: {steps}; coordinator {r['coordinator_s']:.2f} s"
            )
        print(
            f"n={n:4d} secagg/local: round time x{secagg['round_s'] / local['round_s']:.2f}, "
            f"bytes up x{secagg['up_per_client'] / local['up_per_client']:.2f}, "
            f"bytes down x{secagg['down_per_client'] / local['down_per_client']:.2f}"
        )


if __name__ == "__main__":
    main()
