"""``fedfilter ledger``: show, verify, list or report on a client's privacy ledger (read only)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulations.cli.arguments import Subparsers


def add_parser(sub: Subparsers) -> None:
    """``fedfilter ledger show``, ``verify``, ``requests`` and ``report``."""
    p = sub.add_parser("ledger", help="inspect a client's privacy ledger")
    lsub = p.add_subparsers(dest="ledger_command", required=True)
    show = lsub.add_parser("show", help="configuration and spend of a ledger, per federation (and per unit)")
    show.add_argument("path", type=Path)
    show.add_argument("--json", action="store_true")
    show.add_argument(
        "--units",
        action="store_true",
        help="each unit's spend S, its share of T, whether it is stopped and its epsilon so far (the odometer's)",
    )
    show.set_defaults(handler=run_show)
    requests = lsub.add_parser("requests", help="every answered request: who asked, what it cost, what it returned")
    requests.add_argument("path", type=Path)
    requests.add_argument("--json", action="store_true", help="a JSON list, one object per request")
    requests.add_argument(
        "--since", default=None, help="only requests answered at or after this ISO date/time (UTC if no zone)"
    )
    requests.add_argument("--federation", default=None, help="only the requests of this federation")
    requests.set_defaults(handler=run_requests)
    report = lsub.add_parser(
        "report", help="figures (PNG) of the spend over time, by federation and run, and one self-contained HTML page"
    )
    report.add_argument("path", type=Path)
    report.add_argument("--out", type=Path, required=True, help="folder for the figures and report.html")
    report.set_defaults(handler=run_report)
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

    summary = ledger_summary(args.path, units=args.units)
    if args.json:
        print(json.dumps(summary))
        return 0
    federations = summary.pop("federations")
    units = summary.pop("units", None)
    odometer = summary.pop("odometer")
    for key, value in summary.items():
        print(f"{key:<18} {value}")
    if odometer is not None:
        print(
            f"{'odometer':<18} epsilon {odometer['epsilon_at_full_budget']:.4g} at the full budget "
            f"(delta {summary['delta']:g}, {odometer['levels']} levels; valid at any stopping time)"
        )
    print("federations (share of T spent by each one's releases; units stopped for it):")
    for fed in federations:
        print(
            f"  {_printable(fed['federation'])}: {fed['requests']} requests, share max {fed['share_max']:.4g} "
            f"mean {fed['share_mean']:.4g}, {fed['units_stopped']} units stopped ({fed['source']})"
        )
    if units is not None:
        print(f"{'unit':>8} {'spent S':>12} {'share of T':>10} {'stopped':>7} {'eps so far':>10}")
        for unit in units:
            eps = "-" if unit["epsilon_so_far"] is None else f"{unit['epsilon_so_far']:.4g}"
            stopped = "yes" if unit["stopped"] else "no"
            print(f"{unit['unit']:>8} {unit['spent']:>12.6g} {unit['share']:>10.4g} {stopped:>7} {eps:>10}")
    return 0


def _printable(text: str) -> str:
    """A sender's string (run or request id) with non-printable characters escaped, for a terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def run_requests(args: argparse.Namespace) -> int:
    from client_agent.ledger_report import ledger_requests, parse_since

    since = None if args.since is None else parse_since(args.since)
    entries = ledger_requests(args.path, since=since, federation=args.federation)
    if args.json:
        print(json.dumps(entries))
        return 0
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("time (UTC)", lambda e: str(e["time"])[:19].replace("T", " ")),
        ("federation", lambda e: _printable(e["federation"])),
        ("run", lambda e: _printable(e["run_id"])),
        ("request", lambda e: _printable(e["request_id"])),
        ("round", lambda e: "-" if e["round"] is None else str(e["round"])),
        ("kind", lambda e: str(e["kind"])),
        ("noise", lambda e: "-" if e["noise_std"] is None else f"{e['noise_std']:.4g}"),
        ("units", lambda e: str(e["units_charged"])),
        ("cost max (of T)", lambda e: f"{e['cost_max']:.3g} ({100 * e['cost_max_share']:.2f}%)"),
        ("cost mean (of T)", lambda e: f"{e['cost_mean']:.3g} ({100 * e['cost_mean_share']:.2f}%)"),
        ("stopped", lambda e: str(e["units_newly_stopped"])),
        ("bytes", lambda e: str(e["reply_bytes"])),
    ]
    cells = [[fmt(e) for _, fmt in columns] for e in entries]
    widths = [max([len(name), *(len(row[i]) for row in cells)]) for i, (name, _) in enumerate(columns)]
    print("  ".join(name.ljust(w) for (name, _), w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not entries:
        print("(no answered request matches)")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from client_agent.ledger_figures import write_report

    for written in write_report(args.path, args.out):
        print(written)
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
