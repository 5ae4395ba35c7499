"""Benchmark: round latency of the deployed path against Flower's simulation engine, measured in this script.

The same run configuration, clients and data go through
  simulated = Flower's simulation engine (Ray, ``run_simulation``), the real ServerApp and ClientApp
              (:func:`simulations.engine.run_flower`);
  deployed  = ``flower-superlink`` with TLS and node authentication, one ``flower-supernode`` per
              client agent, ``flwr run`` (:class:`simulations.deploy.local.LocalDeployment`),
              all on 127.0.0.1.
Round latency is the coordinator's own ``duration_s`` per round (``rounds.jsonl``: request out to
the last reply in), the same code on both paths. Each path gets fresh ledgers. The budget is large
enough that no unit stops, so every round does the same work.

Run: .venv/bin/python benchmarks/deploy_latency.py [--clients 3] [--rounds 5] [--records 200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

from coordinator.config import CoordinatorConfig
from simulations.datasets.partition import partition_iid
from simulations.datasets.synthetic import synthetic_classification
from simulations.deploy.agent_files import write_agent_files
from simulations.deploy.keys import make_node_keys
from simulations.deploy.local import LocalDeployment, stage_app
from simulations.engine import run_flower
from simulations.federation import write_clients

AGENT = {"epsilon": 50.0, "delta": 1e-5, "unit": "record", "trust": "local"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--records", type=int, default=200, help="records per client (784 features, 10 classes)")
    parser.add_argument("--keep", action="store_true", help="keep the working folder (logs, ledgers, runs)")
    parser.add_argument(
        "--no-sandbox",
        action="store_true",
        help="Flower's own flwr-clientapp instead of fedfilter's shim (to measure what the shim costs)",
    )
    args = parser.parse_args()
    for name in ("clients", "rounds", "records"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")

    root = Path(tempfile.mkdtemp(prefix="fedfilter-deploy-bench-"))
    x, y = synthetic_classification(args.clients * args.records, 784, 10, seed=0, separation=3.0)
    parts = [(x[idx], y[idx]) for idx in partition_iid(len(x), args.clients, seed=0)]
    run_config: dict[str, Any] = {
        "task": "gradient",
        "num-nodes": args.clients,
        "n-public": len(x),
        "rounds": args.rounds,
        "noise-std": 5.0,
        "l2-clip": 1.0,
        "learning-rate": 0.5,
        "trust": "local",
        "unit": "record",
        "model": "logreg",
        "model-args": json.dumps({"in_features": 784, "n_classes": 10}),
        "seed": 0,
        "progress": False,
        "round-timeout": 600.0,
        "enrol-timeout": 300.0,
    }

    # Simulated: Flower's simulation engine, the same apps.
    sim_cfg = CoordinatorConfig.from_run_config(
        {**run_config, "run-id": "bench-sim", "output-dir": str(root / "runs" / "sim")}
    )
    per = write_clients(
        root / "sim-clients", parts, ledger_dir=root / "sim-clients" / "ledgers", **AGENT, policy_max_request_share=1.0
    )
    started = time.monotonic()
    sim = run_flower(sim_cfg, per)
    sim_wall = time.monotonic() - started
    sim_rounds = [float(r["duration_s"]) for r in sim["rounds"]]

    # Deployed: SuperLink with TLS and node authentication, one SuperNode per agent, flwr run.
    with LocalDeployment(root / "deploy", sandbox_clientapps=not args.no_sandbox) as dep:
        tomls = write_agent_files(root / "deploy-clients", parts, **AGENT)
        app = stage_app(root / "app")
        started = time.monotonic()
        dep.start_superlink()
        for i, toml in enumerate(tomls):
            keys = make_node_keys(root / "keys" / f"agent{i}")
            dep.register(keys.public)
            dep.start_agent(f"agent{i}", toml, keys.private)
        setup_s = time.monotonic() - started
        deployed = dep.run(app, {**run_config, "run-id": "bench-deployed"}, timeout=3600)
    dep_rounds = [float(r["duration_s"]) for r in deployed["rounds"]]

    for name, summary in (("simulated", sim), ("deployed", deployed)):
        if summary["rounds_completed"] != args.rounds or summary["errors_total"]:
            raise SystemExit(
                f"{name}: expected {args.rounds} clean rounds, got {summary['rounds_completed']} "
                f"with errors {summary['errors_total']}"
            )

    print(
        f"{args.clients} clients x {args.records} records, logreg 784x10, {args.rounds} gradient rounds, "
        f"local trust, record units; {os.cpu_count()} CPU cores"
    )
    print(f"{'path':<11}{'median round s':>16}{'mean round s':>14}{'rounds s':>40}{'run wall s':>12}")
    for name, rounds, wall in (("simulated", sim_rounds, sim_wall), ("deployed", dep_rounds, deployed["wall_s"])):
        shown = " ".join(f"{r:.2f}" for r in rounds)
        print(f"{name:<11}{statistics.median(rounds):>16.3f}{statistics.mean(rounds):>14.3f}{shown:>40}{wall:>12.1f}")
    ratio = statistics.median(dep_rounds) / statistics.median(sim_rounds)
    print(f"deployed / simulated round latency (medians): {ratio:.1f}x")
    print(
        f"(deployed setup: certificates, SuperLink, {args.clients} registrations and SuperNodes: {setup_s:.1f} s; "
        "run wall = flwr run until it returned, or run_simulation including Ray start)"
    )
    if args.keep:
        print(f"working folder: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
