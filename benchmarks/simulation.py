"""Benchmark: fedfilter's privacy stack against plain Flower, on Flower's simulation engine, measured in this script.

(1) Round time and memory, same model, clients and data, from 10 to 10,000 virtual SuperNodes
    (``--clients``), for both unit kinds (``--units``):
    record units: plain     = a minimal Flower ServerApp/ClientApp pair doing federated gradient descent:
                              the server sends the parameters, each client returns the gradient of its
                              summed loss (one backward pass), the server averages and steps;
                  fedfilter = the real coordinator and client agents (central trust, GDP filter):
                              per-record gradients, partial clipping, the filter's charge committed to each
                              client's SQLite ledger before the reply, noise once at the coordinator;
    client units: plain     = FedAvg with local training: each client runs ``LOCAL_STEPS`` steps of
                              minibatch SGD from the server's parameters and returns its update; the
                              server averages the updates;
                  fedfilter = the same local training through the agents (client units, central
                              trust): each update clipped, charged and committed, noise at the coordinator.
    Both run on the same engine: Flower's in-memory LinkState with a per-node index of undelivered
    messages (simulations/linkstate.py; what ``fedfilter simulate`` runs), or Flower's stock one with
    ``--stock-link-state``, whose delivery loop scans every message for every node (quadratic).
    Both run ``--rounds`` rounds after one warm-up round; a round's time is measured inside the
    ServerApp (send to the last reply and the model update), so Ray's start-up is left out. Also
    printed: the peak resident memory of the whole simulation (this process and its Ray
    processes, sampled every 0.1 s) and the ledger bytes per client after the run.
    Data: the quickstart's synthetic 20-feature two-class records, 100 per client; logistic regression.
    The last line is ``simulation_worst_ratio=<r> clients_max=<n>``: the worst round-time ratio
    over every size and unit kind run.
(2) Per-record gradient throughput of the paper's CNN (Opacus's MNIST example) on MNIST records,
    examples per second: torch.func (what the client agent runs) against Opacus's GradSampleModule
    (benchmarks/per_record_gradients.py does the full comparison; Opacus is a benchmark-only
    dependency: ``pip install -e '.[bench]'``). Skipped with ``--no-throughput``.

Run: .venv/bin/python benchmarks/simulation.py [--clients 10 100 1000 10000] [--units record client]
     [--rounds 3] [--records 2000] [--no-throughput]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
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
from simulations.linkstate import indexed_link_state
from workloads.models import build_model, flatten_parameters, load_flat_parameters

MODEL_ARGS = {"in_features": 20, "n_classes": 2}
RECORDS = 100
LOCAL_STEPS, LOCAL_LR, LOCAL_BATCH = 5, 0.5, 16


def federation(clients: int, root: Path, unit: str) -> tuple[dict[int, dict[str, Any]], Path]:
    x, y = synthetic_classification(clients * RECORDS, 20, 2, seed=0, separation=2.5)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    parts = [(x[i * RECORDS : (i + 1) * RECORDS], y[i * RECORDS : (i + 1) * RECORDS]) for i in range(clients)]
    per = write_clients(
        root / "clients",
        parts,
        ledger_dir=root / "ledgers",
        epsilon=1e3,  # a budget that lasts the benchmark: every round charges, none refuses
        delta=1e-5,
        unit=unit,
        trust="central",
        filter="gdp",
        noise_seed=0,
        policy_max_request_share=1.0,
    )
    assert all(Path(per[i]["data-path"]) == (root / "clients" / f"data{i}.npz").resolve() for i in range(clients))
    return per, (root / "clients").resolve()


def ledger_size(folder: Path) -> int:
    """Bytes of every ledger file (and WAL) in ``folder``; a WAL that Ray's exiting actors checkpoint and
    delete while this runs counts as gone."""
    total = 0
    for entry in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += entry.stat().st_size
    return total


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it (Ray's raylet, GCS and workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


@contextlib.contextmanager
def peak_rss() -> Iterator[list[int]]:
    """Samples the whole simulation's resident memory every 0.1 s; yields a list holding the peak."""
    peak = [_tree_rss(os.getpid())]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            peak[0] = max(peak[0], _tree_rss(os.getpid()))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def plain_round_times(data_dir: Path, clients: int, rounds: int, unit: str, indexed: bool) -> list[float]:
    """Plain Flower: FedSGD (record units' baseline) or FedAvg with local SGD (client units'); no clipping,
    no filter, no ledger, no noise. Client ``i`` reads ``data_dir/data{i}.npz`` (as Flower's examples load a
    partition by its id: the app holds no per-client list, which Flower's Ray backend would pickle with
    every message)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    times: list[float] = []
    n_total = RECORDS * clients
    server, client = ServerApp(), ClientApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        model = build_model("logreg", **MODEL_ARGS)
        params = flatten_parameters(model)
        while len(grid.get_node_ids()) < clients:
            time.sleep(0.05)
        nodes = sorted(grid.get_node_ids())
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            content = RecordDict({"a": ArrayRecord({"p": Array(params)}), "c": ConfigRecord({"round": r})})
            msgs = [Message(content, node, "train.gradient") for node in nodes]
            replies = grid.send_and_receive(msgs, timeout=3600)
            total = np.zeros_like(params, dtype=np.float64)
            for reply in replies:
                total += reply.content.array_records["a"]["g"].numpy()
            if unit == "record":
                params = (params - 1.0 * total / n_total).astype(np.float32)
            else:
                params = (params + total / len(nodes)).astype(np.float32)
            if r > 0:  # the first round warms up the actors
                times.append(time.perf_counter() - t0)

    @client.train("gradient")
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        with np.load(data_dir / f"data{pid}.npz") as data:
            x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"].astype(np.int64))
        model = build_model("logreg", **MODEL_ARGS)
        start = msg.content.array_records["a"]["p"].numpy()
        load_flat_parameters(model, start)
        if unit == "record":
            g = summed_gradient(model, _cross_entropy, x, y).numpy()
        else:
            rng = np.random.default_rng([pid, int(msg.content.config_records["c"]["round"])])
            optimizer = torch.optim.SGD(model.parameters(), lr=LOCAL_LR)
            for _ in range(LOCAL_STEPS):
                idx = torch.from_numpy(rng.choice(len(y), size=min(LOCAL_BATCH, len(y)), replace=False))
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                optimizer.step()
            g = flatten_parameters(model) - start
        return Message(RecordDict({"a": ArrayRecord({"g": Array(g)})}), reply_to=msg)

    with indexed_link_state() if indexed else contextlib.nullcontext():
        run_simulation(
            server_app=server,
            client_app=client,
            num_supernodes=clients,
            backend_config=backend_config(),  # type: ignore[arg-type]
        )
    return times


def fedfilter_round_times(
    per: dict[int, dict[str, Any]], rounds: int, out: Path, unit: str, indexed: bool
) -> list[float]:
    local = {"local_steps": LOCAL_STEPS, "local_lr": LOCAL_LR, "local_batch_size": LOCAL_BATCH}
    cfg = CoordinatorConfig(
        num_nodes=len(per),
        n_public=len(per) * RECORDS if unit == "record" else len(per),
        rounds=rounds + 1,
        noise_std=8.0 if unit == "record" else 0.5,
        l2_clip=1.0,
        learning_rate=1.0,
        trust="central",
        unit=unit,
        model="logreg",
        model_args=json.dumps(MODEL_ARGS),
        run_id="bench",
        output_dir=str(out),
        noise_seed=0,
        progress=False,
        # the enrolment query and a round reach every client: about 40 ms a client at 10,000 (the default 120 s
        # enrolled 1,898 of 10,000 clients)
        enrol_timeout=3600.0,
        round_timeout=3600.0,
        **(local if unit == "client" else {}),
    )
    summary = run_flower(cfg, per, indexed_state=indexed)
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
    parser.add_argument("--units", nargs="+", choices=["record", "client"], default=["record", "client"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=2000, help="MNIST records for the throughput part")
    parser.add_argument("--no-throughput", action="store_true", help="leave out part (2)")
    parser.add_argument(
        "--stock-link-state",
        action="store_true",
        help="both apps on Flower's stock in-memory LinkState (its delivery loop is quadratic in the clients)",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected an integer >= 1, got {args.rounds}")
    torch.set_num_threads(2)
    state = "stock LinkState" if args.stock_link_state else "LinkState indexed by node, simulations/linkstate.py"
    print(f"(1) round time on Flower's simulation engine (Ray, {os.cpu_count()} CPUs, {state}), {args.rounds} rounds")
    worst = 0.0
    for unit in args.units:
        print(f"  {unit} units" + (f" (local training: {LOCAL_STEPS} steps)" if unit == "client" else ""))
        for clients in args.clients:
            root = Path(tempfile.mkdtemp(prefix="fedfilter-simbench-"))
            try:
                per, data_dir = federation(clients, root, unit)
                with peak_rss() as plain_mem:
                    plain = plain_round_times(data_dir, clients, args.rounds, unit, not args.stock_link_state)
                with peak_rss() as ours_mem:
                    ours = fedfilter_round_times(per, args.rounds, root / "out", unit, not args.stock_link_state)
                ledger_bytes = ledger_size(root / "ledgers") / clients
            finally:
                shutil.rmtree(root, ignore_errors=True)
            p, f = statistics.median(plain), statistics.median(ours)
            worst = max(worst, f / p)
            print(
                f"  {clients:6d} clients: plain {p * 1e3:9.1f} ms/round  fedfilter {f * 1e3:9.1f} ms/round  "
                f"ratio {f / p:5.2f}   peak RSS plain {plain_mem[0] / 2**20:7.0f} MiB  fedfilter "
                f"{ours_mem[0] / 2**20:7.0f} MiB   ledger {ledger_bytes / 1024:6.1f} KiB/client",
                flush=True,
            )
    if not args.no_throughput:
        throughput(args.records)
    print(f"simulation_worst_ratio={worst:.2f} clients_max={max(args.clients)}")


if __name__ == "__main__":
    main()
