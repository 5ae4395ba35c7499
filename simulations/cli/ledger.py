"""``fedfilter ledger``: show or verify a client's privacy ledger."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from simulations.cli.arguments import Subparsers


def add_parser(sub: Subparsers) -> None:
    """``fedfilter ledger show`` and ``fedfilter ledger verify``."""
    p = sub.add_parser("ledger", help="inspect a client's privacy ledger")
    lsub = p.add_subparsers(dest="ledger_command", required=True)
    show = lsub.add_parser("show", help="configuration and spend of a ledger")
    show.add_argument("path", type=Path)
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=run_show)
    verify = lsub.add_parser("verify", help="replay every release and check the stored state")
    verify.add_argument("path", type=Path)
    verify.add_argument(
        "--high-water",
        type=Path,
        default=None,
        help="the ledger's high-water mark (default: PATH.high-water when it exists); a rollback is reported",
    )
    verify.set_defaults(handler=run_verify)


def run_show(args: argparse.Namespace) -> int:
    from client_agent.ledger_report import ledger_summary

    summary = ledger_summary(args.path)
    if args.json:
        print(json.dumps(summary))
        return 0
    for key, value in summary.items():
        print(f"{key:<18} {value}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from client_agent.ledger_report import verify_ledger

    problems = verify_ledger(args.path, high_water=args.high_water)
    if problems:
        for problem in problems:
            print(f"{args.path}: {problem}", file=sys.stderr)
        return 1
    print(f"{args.path}: ok (every stored release replays to the stored state)")
    return 0
