"""Benchmark: fedfilter's privacy stack against plain Flower, on Flower's simulation engine, measured in this script.

(1) Round time, same model, clients and data, 10 and 100 virtual SuperNodes (``--clients``):
    plain     = a minimal Flower ServerApp/ClientApp pair doing federated gradient descent:
                the server sends the parameters, each client returns the gradient of its
                summed loss (one backward pass), the server averages and steps;
    fedfilter = the real coordinator and client agents (record units, central trust, GDP filter):
                per-record gradients, partial clipping, the filter's charge committed to each
                client's SQLite ledger before the reply, noise once at the coordinator.
    Both run ``--rounds`` rounds after one warm-up round; a round's time is measured inside the
    ServerApp (send to the last reply and the model update), so Ray's start-up is left out.
    Data: the quickstart's synthetic 20-feature two-class records, 100 per client; logistic regression.
(2) Per-record gradient throughput of the paper's CNN (Opacus's MNIST example) on MNIST records,
    examples per second: torch.func (what the client agent runs) against Opacus's GradSampleModule
    (benchmarks/per_record_gradients.py does the full comparison; Opacus is a benchmark-only
    dependency: ``pip install -e '.[bench]'``).

Run: .venv/bin/python benchmarks/simulation.py [--clients 10 100] [--rounds 5] [--records 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import numpy as np
import torch

from client_agent.gradients import summed_gradient
from client_agent.workloads import _cross_entropy
from coordinator.config import CoordinatorConfig
from simulations.datasets.synthetic import synthetic_classification
from simulations.engine import backend_config, run_flower
from simulations.federation import write_clients
from workloads.models import build_model, flatten_parameters, load_flat_parameters

MODEL_ARGS = {"in_features": 20, "n_classes": 2}
RECORDS = 100


def federation(clients: int, root: Path) -> tuple[dict[int, dict[str, Any]], list[Path]]:
    x, y = synthetic_classification(clients * RECORDS, 20, 2, seed=0, separation=2.5)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    parts = [(x[i * RECORDS : (i + 1) * RECORDS], y[i * RECORDS : (i + 1) * RECORDS]) for i in range(clients)]
    per = write_clients(
        root / "clients",
        parts,
        ledger_dir=root / "ledgers",
        epsilon=1e3,  # a budget that lasts the benchmark: every round charges, none refuses
        delta=1e-5,
        unit="record",
        trust="central",
        filter="gdp",
        noise_seed=0,
        policy_max_request_share=1.0,
    )
    return per, [Path(per[i]["data-path"]) for i in range(clients)]


def plain_round_times(data_files: list[Path], rounds: int) -> list[float]:
    """Plain Flower FedSGD: no clipping, no filter, no ledger, no noise."""
    from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    times: list[float] = []
    n_total = RECORDS * len(data_files)
    server, client = ServerApp(), ClientApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        model = build_model("logreg", **MODEL_ARGS)
        params = flatten_parameters(model)
        while len(grid.get_node_ids()) < len(data_files):
            time.sleep(0.05)
        nodes = sorted(grid.get_node_ids())
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            msgs = [
                Message(RecordDict({"a": ArrayRecord({"p": Array(params)})}), node, "train.gradient") for node in nodes
            ]
            replies = grid.send_and_receive(msgs, timeout=600)
            total = np.zeros_like(params, dtype=np.float64)
            for reply in replies:
                total += reply.content.array_records["a"]["g"].numpy()
            params = (params - 1.0 * total / n_total).astype(np.float32)
            if r > 0:  # the first round warms up the actors
                times.append(time.perf_counter() - t0)

    @client.train("gradient")
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        with np.load(data_files[pid]) as data:
            x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"].astype(np.int64))
        model = build_model("logreg", **MODEL_ARGS)
        load_flat_parameters(model, msg.content.array_records["a"]["p"].numpy())
        g = summed_gradient(model, _cross_entropy, x, y).numpy()
        return Message(RecordDict({"a": ArrayRecord({"g": Array(g)})}), reply_to=msg)

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=len(data_files),
        backend_config=backend_config(),  # type: ignore[arg-type]
    )
    return times


def fedfilter_round_times(per: dict[int, dict[str, Any]], rounds: int, out: Path) -> list[float]:
    cfg = CoordinatorConfig(
        num_nodes=len(per),
        n_public=len(per) * RECORDS,
        rounds=rounds + 1,
        noise_std=8.0,
        l2_clip=1.0,
        learning_rate=1.0,
        trust="central",
        unit="record",
        model="logreg",
        model_args=json.dumps(MODEL_ARGS),
        run_id="bench",
        output_dir=str(out),
        noise_seed=0,
        progress=False,
    )
    summary = run_flower(cfg, per)
    assert summary["rounds_completed"] == rounds + 1, summary["stopped_because"]
    return [r["duration_s"] for r in summary["rounds"] if r["round"] >= 2]  # round 1 warms up the actors


def throughput(records: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import per_record_gradients as prg

    from client_agent.gradients import per_example_gradients
    from simulations.datasets.idx import default_data_dir

    x, y = prg.load_mnist(default_data_dir(), records)
    model = build_model("opacus_mnist_cnn")
    per_example_gradients(model, prg.LOSS, x[:256], y[:256])  # warm-up
    t_func = min(prg.elapsed(lambda: per_example_gradients(model, prg.LOSS, x, y)) for _ in range(2))
    print(f"\n(2) per-record gradients, opacus_mnist_cnn, {records} MNIST records, torch threads 2")
    print(f"  torch.func (client agent)   {records / t_func:9.0f} examples/s")
    try:
        import copy

        from opacus import GradSampleModule
    except ImportError:
        print("  Opacus: not installed (pip install -e '.[bench]'); ratio not measured")
        return
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    prg.opacus_gradients(gsm, x[:256], y[:256], 256)
    t_op = min(prg.elapsed(lambda: prg.opacus_gradients(gsm, x, y, 1024)) for _ in range(2))
    print(f"  Opacus GradSampleModule     {records / t_op:9.0f} examples/s")
    print(f"  ratio torch.func / Opacus throughput: {t_op / t_func:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--records", type=int, default=2000, help="MNIST records for the throughput part")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected an integer >= 1, got {args.rounds}")
    torch.set_num_threads(2)
    print(f"(1) round time on Flower's simulation engine (Ray, {os.cpu_count()} CPUs), {args.rounds} rounds each")
    for clients in args.clients:
        root = Path(tempfile.mkdtemp(prefix="fedfilter-simbench-"))
        per, files = federation(clients, root)
        plain = plain_round_times(files, args.rounds)
        ours = fedfilter_round_times(per, args.rounds, root / "out")
        p, f = statistics.median(plain), statistics.median(ours)
        print(
            f"  {clients:4d} clients: plain Flower {p * 1e3:8.1f} ms/round   "
            f"fedfilter {f * 1e3:8.1f} ms/round   ratio {f / p:5.2f}"
        )
    throughput(args.records)


if __name__ == "__main__":
    main()
