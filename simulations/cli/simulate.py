"""``fedfilter simulate``: a preset federation on one machine (:mod:`simulations.presets`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from protocol.validate import open_unit, positive, positive_int
from simulations.cli.arguments import Subparsers, number
from simulations.errors import SimulationError
from simulations.presets import PRESETS


def add_parser(sub: Subparsers) -> None:
    """``fedfilter simulate``."""
    p = sub.add_parser(
        "simulate",
        help="a federation on one machine (Flower simulation engine, real ClientApp and ServerApp)",
        description=(
            "Runs a preset federation on Flower's simulation engine and writes summary.json, rounds.jsonl, "
            "PNG plots and the clients' ledgers to --out. Options left out keep the preset's values."
        ),
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: quickstart (workload when --workload is given)")
    p.add_argument(
        "--workload",
        help="a workload 'package.module:object' (workloads/registry.py) with a demo hook: the agents and the "
        "coordinator load it (modules resolve from the current folder, as with python -m)",
    )
    p.add_argument("--clients", type=int, help="number of clients (virtual SuperNodes)")
    p.add_argument("--rounds", type=int, help="maximum rounds (queries, for sparse-queries)")
    p.add_argument("--epsilon", type=number, help="target epsilon per unit")
    p.add_argument("--delta", type=number, help="target delta per unit")
    p.add_argument("--noise-std", type=number, help="Gaussian noise std per round")
    p.add_argument("--clip", type=number, help="L2 clip norm C")
    p.add_argument("--trust", choices=["local", "central", "secagg"])
    p.add_argument("--unit", choices=["record", "client"])
    p.add_argument("--filter", choices=["gdp", "zcdp", "renyi", "renyi_multi"])
    p.add_argument(
        "--local-steps", type=int, help="quickstart with --unit client: local SGD steps per round (DP-FedAvg)"
    )
    p.add_argument("--local-lr", type=number, help="local SGD learning rate (with --local-steps)")
    p.add_argument("--local-batch-size", type=int, help="records per local SGD step (with --local-steps)")
    p.add_argument("--server-lr", type=number, help="server step on the averaged updates (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="data, model and (simulation only) noise seed")
    p.add_argument("--data-dir", help="folder with the MNIST IDX files (mnist-gd)")
    p.add_argument("--download", action="store_true", help="fetch missing MNIST files (checksums verified)")
    p.add_argument("--out", help="output directory (default: a new fedfilter-out/<preset>-<UTC time>)")
    p.add_argument(
        "--engine",
        default="flower",
        choices=["flower", "inprocess"],
        help="flower: Flower's simulation engine (default); inprocess: the same agents by direct calls",
    )
    p.add_argument(
        "--ray-address",
        help="run the virtual clients on an existing Ray cluster (host:port of its head, or auto; default: "
        "RAY_ADDRESS, else Ray starts on this machine); its nodes must share this host's disk (the clients' "
        "ledgers under --out are SQLite files that work on one host only)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from simulations.presets.base import Options
    from simulations.presets.run import headline, simulate

    for name in ("epsilon", "noise_std", "clip"):
        if getattr(args, name) is not None:
            positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.delta is not None:
        open_unit("--delta", args.delta)
    for name in ("clients", "rounds"):
        if getattr(args, name) is not None:
            positive_int(f"--{name}", getattr(args, name))
    opts = Options(
        clients=args.clients,
        rounds=args.rounds,
        epsilon=args.epsilon,
        delta=args.delta,
        noise_std=args.noise_std,
        clip=args.clip,
        trust=args.trust,
        unit=args.unit,
        filter=args.filter,
        seed=args.seed,
        data_dir=args.data_dir,
        download=args.download,
        out=args.out,
        engine=args.engine,
        ray_address=args.ray_address,
        local_steps=args.local_steps,
        local_lr=args.local_lr,
        local_batch_size=args.local_batch_size,
        server_lr=args.server_lr,
        workload=args.workload,
    )
    args.preset = args.preset or ("workload" if args.workload else "quickstart")
    if args.preset == "workload" and not args.workload:
        raise SimulationError("--preset workload: expected --workload 'package.module:object'")
    if args.workload and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does; the simulated clients inherit it
    if args.ray_address and args.engine != "flower":
        raise SimulationError("--ray-address: expected --engine flower (the inprocess engine runs no Ray)")
    if args.preset != "quickstart" and any(
        v is not None for v in (args.local_steps, args.local_lr, args.local_batch_size, args.server_lr)
    ):
        raise SimulationError("--local-steps, --local-lr, --local-batch-size, --server-lr: the quickstart preset only")
    summary = simulate(args.preset, opts)
    print()
    for line in headline(summary):
        print(line)
    plots = ", ".join(Path(p).name for p in summary["plots"])
    print(
        f"Written to {summary['simulation']['out']}: summary.json, rounds.jsonl, {plots}, "
        "ledgers/ (fedfilter ledger show PATH)"
    )
    return 0
