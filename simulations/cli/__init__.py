"""The ``fedfilter`` command line.

Subcommands:
  budget   privacy calculator: each filter's budget and the full-norm rounds it allows
  ledger   show or verify a client's privacy ledger
  simulate a federation on one machine, on Flower's simulation engine
  certs    CA and TLS server certificate for the coordinator's SuperLink (simulations.deploy)
  keys     a SuperNode key pair for node authentication
  agent    check a client agent's configuration file; write demo agents
  reproduce long paper reproductions (FZ Sec. 5.1 on MNIST; simulations.fz_mnist)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from client_agent.ledger import LedgerError
from coordinator.rounds import EnrolmentError
from protocol.budget import budget_report
from protocol.validate import PrivacyParameterError, open_unit, positive, positive_int


def _number(text: str) -> float:
    """Parse a float, keeping NaN and infinity so that validation names them."""
    try:
        return float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc


def _add_budget(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "budget",
        help="each filter's budget and the full-norm rounds it allows",
        description=(
            "Privacy calculator. For a target (epsilon, delta) per unit and Gaussian rounds of noise std S "
            "with clip C, prints each filter's budget and how many rounds at full norm it allows."
        ),
    )
    p.add_argument("--epsilon", type=_number, required=True, help="target epsilon per unit (> 0)")
    p.add_argument("--delta", type=_number, required=True, help="target delta per unit, in (0, 1)")
    p.add_argument("--noise-std", type=_number, required=True, help="Gaussian noise std per round (> 0)")
    p.add_argument("--clip", type=_number, required=True, help="L2 clip norm C (> 0)")
    p.add_argument("--max-rounds", type=int, default=None, help="N, for the realisation-level filter (TVC)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_run_budget)


def _run_budget(args: argparse.Namespace) -> int:
    # Validate under the names the user typed, so the error names the argument.
    positive("--epsilon", args.epsilon)
    open_unit("--delta", args.delta)
    positive("--noise-std", args.noise_std)
    positive("--clip", args.clip)
    if args.max_rounds is not None:
        positive_int("--max-rounds", args.max_rounds)
    report = budget_report(
        epsilon=args.epsilon,
        delta=args.delta,
        noise_std=args.noise_std,
        l2_clip=args.clip,
        max_rounds=args.max_rounds,
    )
    if args.json:
        print(json.dumps(report))
        return 0
    filters = report["filters"]
    assert isinstance(filters, dict)
    mu = args.clip / args.noise_std
    print(f"target ({args.epsilon:g}, {args.delta:g})-DP per unit; Gaussian rounds with noise std {args.noise_std:g},")
    print(f"clip {args.clip:g}: sensitivity mu = {mu:.6g} per full-norm round")
    print()
    print(f"{'filter':<34}{'budget':>22}{'full-norm rounds':>18}")
    rows = [
        ("GDP (default)", f"mu_B = {filters['gdp']['mu_budget']:.6f}", filters["gdp"]["rounds"]),
        ("zCDP, CKS conversion", f"rho_B = {filters['zcdp_cks']['rho_budget']:.6f}", filters["zcdp_cks"]["rounds"]),
        (
            "zCDP, BS conversion (FZ Thm 4.8)",
            f"rho_B = {filters['zcdp_bs']['rho_budget']:.6f}",
            filters["zcdp_bs"]["rounds"],
        ),
        ("Rényi, best order fixed in advance", f"order = {filters['rdp']['order']:.4f}", filters["rdp"]["rounds"]),
    ]
    for name, budget, rounds in rows:
        print(f"{name:<34}{budget:>22}{rounds:>18}")
    if "realisation" in filters:
        r = filters["realisation"]
        print()
        print(
            f"realisation-level filter (TVC), N = {r['max_rounds']}: continue while |L| <= kappa = {r['kappa']:.6f} "
            f"(delta~ = {r['delta_tilde']:.3g}, theta = {r['theta']:.3g})"
        )
        from protocol.realisation import RealisationFilter, RealisationState

        real = RealisationFilter.create(
            epsilon=args.epsilon, delta=args.delta, max_rounds=r["max_rounds"], mu_max=args.clip / args.noise_std
        )
        if not RealisationState.fresh(real, 1).accepting[0]:
            print("  at this sigma and (epsilon, delta) the realisation filter accepts no request at all")
        elif r["kappa"] <= 0:
            print("  kappa <= 0: at this sigma and (epsilon, delta) the realisation filter stops after one request")
    print()
    print("Units whose realised contributions are smaller than C keep going after these rounds (FZ Prop. 5.1).")
    return 0


def _add_ledger(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("ledger", help="inspect a client's privacy ledger")
    lsub = p.add_subparsers(dest="ledger_command", required=True)
    show = lsub.add_parser("show", help="configuration and spend of a ledger")
    show.add_argument("path", type=Path)
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=_run_ledger_show)
    verify = lsub.add_parser("verify", help="replay every release and check the stored state")
    verify.add_argument("path", type=Path)
    verify.set_defaults(handler=_run_ledger_verify)


def _run_ledger_show(args: argparse.Namespace) -> int:
    from client_agent.ledger_report import ledger_summary

    summary = ledger_summary(args.path)
    if args.json:
        print(json.dumps(summary))
        return 0
    for key, value in summary.items():
        print(f"{key:<18} {value}")
    return 0


def _run_ledger_verify(args: argparse.Namespace) -> int:
    from client_agent.ledger_report import verify_ledger

    problems = verify_ledger(args.path)
    if problems:
        for problem in problems:
            print(f"{args.path}: {problem}", file=sys.stderr)
        return 1
    print(f"{args.path}: ok (every stored release replays to the stored state)")
    return 0


def _add_simulate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from simulations.simulate import PRESETS

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
        help="a workload 'package.module:object' (protocol/workload.py) with a demo hook: the agents and the "
        "coordinator load it (modules resolve from the current folder, as with python -m)",
    )
    p.add_argument("--clients", type=int, help="number of clients (virtual SuperNodes)")
    p.add_argument("--rounds", type=int, help="maximum rounds (queries, for sparse-queries)")
    p.add_argument("--epsilon", type=_number, help="target epsilon per unit")
    p.add_argument("--delta", type=_number, help="target delta per unit")
    p.add_argument("--noise-std", type=_number, help="Gaussian noise std per round")
    p.add_argument("--clip", type=_number, help="L2 clip norm C")
    p.add_argument("--trust", choices=["local", "central", "secagg"])
    p.add_argument("--unit", choices=["record", "client"])
    p.add_argument("--filter", choices=["gdp", "zcdp", "renyi", "renyi_multi"])
    p.add_argument(
        "--local-steps", type=int, help="quickstart with --unit client: local SGD steps per round (DP-FedAvg)"
    )
    p.add_argument("--local-lr", type=_number, help="local SGD learning rate (with --local-steps)")
    p.add_argument("--local-batch-size", type=int, help="records per local SGD step (with --local-steps)")
    p.add_argument("--server-lr", type=_number, help="server step on the averaged updates (default 1.0)")
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
    p.set_defaults(handler=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from simulations.simulate import Options, headline, simulate

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
        local_steps=args.local_steps,
        local_lr=args.local_lr,
        local_batch_size=args.local_batch_size,
        server_lr=args.server_lr,
        workload=args.workload,
    )
    args.preset = args.preset or ("workload" if args.workload else "quickstart")
    if args.preset == "workload" and not args.workload:
        raise ValueError("--preset workload: expected --workload 'package.module:object'")
    if args.workload and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does; the simulated clients inherit it
    if args.preset != "quickstart" and any(
        v is not None for v in (args.local_steps, args.local_lr, args.local_batch_size, args.server_lr)
    ):
        raise ValueError("--local-steps, --local-lr, --local-batch-size, --server-lr: the quickstart preset only")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedfilter",
        description="Federated learning and analytics with individual privacy filters.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_budget(sub)
    _add_ledger(sub)
    _add_simulate(sub)
    from simulations.deploy import add_commands as _add_deploy

    _add_deploy(sub)
    from simulations.fz_mnist import add_commands as _add_reproduce

    _add_reproduce(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (PrivacyParameterError, LedgerError, ValueError, OSError, EnrolmentError) as exc:
        print(f"fedfilter {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
