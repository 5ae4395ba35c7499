"""Benchmark: a federated-GD round in ``secagg`` trust against ``local`` trust and the previous secagg.

For 10 and 100 clients and the ~100k-parameter MLP (784-128-10, 101,770 parameters), each
client holding 20 records (``client`` units), both trusts run the same rounds through the
real coordinator (coordinator/rounds.py) and the real client agents on the in-process
transport (simulations/inprocess.py: the agents answer one after the other in this process,
so a round's time is the sum of every client's work plus the coordinator's).

Reported per trust: the round time (median of the rounds after the first), the payload bytes
per client per round in each direction (array bytes plus the JSON of the scalar fields, summed
over every exchange of the round: one in local trust, five in secagg trust), the time spent
in each exchange and in the coordinator's own work (unmasking), and the secagg/local ratios.
m is the default max(2, ceil(2n/3)).

The previous secagg protocol (honest-but-curious only: no identities, signatures, request
fingerprint or consistency check; four exchanges) is measured by the same code run against
the baseline commit's packages (``--baseline``, default da05aad), checked out with
``git worktree`` into a temporary folder and put first on PYTHONPATH of a subprocess; the
line ``secagg/previous`` gives the cost of the active-adversary checks.

Run: .venv/bin/python benchmarks/secagg.py [--clients 10 100] [--rounds 3] [--baseline REV | --no-baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workloads.models import build_model, parameter_count

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
    per = write_clients(
        root / f"{trust}{n}",
        parts,
        epsilon=1000.0,
        delta=1e-5,
        unit="client",
        trust=trust,
        policy_max_request_share=1.0,
    )
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


def previous(rev: str, n: int, rounds: int) -> dict[str, Any]:
    """The previous protocol's secagg round: this script's ``--measure`` run on the baseline's packages."""
    repo = Path(__file__).resolve().parent.parent
    worktree = Path(tempfile.mkdtemp(prefix="fedfilter-secagg-baseline-")) / "tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(worktree), rev], cwd=repo, check=True, capture_output=True
    )
    try:
        out = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--measure",
                "secagg",
                "--clients",
                str(n),
                "--rounds",
                str(rounds),
            ],
            cwd=worktree,
            env={**os.environ, "PYTHONPATH": str(worktree)},
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=repo, check=False)
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    if not result["protocol_file"].startswith(str(worktree)):
        raise RuntimeError(f"baseline: expected the baseline's protocol package, got {result['protocol_file']}")
    return result


def report(n: int, trust: str, r: Mapping[str, Any]) -> None:
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(r["exchange_s"].items()))
    print(
        f"n={n:4d} {trust:15s}: round {r['round_s']:.2f} s; per client per round "
        f"{r['up_per_client'] / 1e3:.1f} kB up, {r['down_per_client'] / 1e3:.1f} kB down; "
        f"exchanges: {steps}; coordinator {r['coordinator_s']:.2f} s"
    )


def ratio(n: int, name: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    print(
        f"n={n:4d} {name}: round time x{a['round_s'] / b['round_s']:.2f}, "
        f"bytes up x{a['up_per_client'] / b['up_per_client']:.2f}, "
        f"bytes down x{a['down_per_client'] / b['down_per_client']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default="da05aad", help="commit of the previous secagg protocol")
    parser.add_argument("--no-baseline", action="store_true", help="skip the previous protocol")
    parser.add_argument("--measure", choices=["local", "secagg"], help=argparse.SUPPRESS)  # one JSON line
    args = parser.parse_args()
    if args.rounds < 2:  # the first round is left out of the median
        parser.error(f"--rounds: expected an integer >= 2, got {args.rounds}")
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="fedfilter-secagg-bench-"))
    if args.measure:
        import protocol

        result = measure(args.clients[0], args.measure, args.rounds, root)
        print(json.dumps(result | {"protocol_file": str(Path(protocol.__file__).resolve())}))
        return
    d = parameter_count(build_model("mlp", **MODEL_ARGS))
    print(f"MLP 784-128-10 ({d:,} parameters), {RECORDS} records per client, in-process, {args.rounds} rounds")
    for n in args.clients:
        result = {trust: measure(n, trust, args.rounds, root) for trust in ("local", "secagg")}
        if not args.no_baseline:
            result["secagg previous"] = previous(args.baseline, n, args.rounds)
        for trust, r in result.items():
            report(n, trust, r)
        ratio(n, "secagg/local", result["secagg"], result["local"])
        if "secagg previous" in result:
            ratio(n, "secagg/previous", result["secagg"], result["secagg previous"])


if __name__ == "__main__":
    main()
