"""``fedfilter agent``: serve a client agent, write its secagg identity, check its file, write demo agents."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from simulations.cli.arguments import Subparsers


def add_parser(sub: Subparsers) -> None:
    """``fedfilter agent serve|keygen|check|demo``."""
    agent = sub.add_parser("agent", help="client agent: serve it, check its configuration, write demo agents")
    asub = agent.add_subparsers(dest="agent_command", required=True)
    serve = asub.add_parser(
        "serve",
        help="run the data owner's agent service on the Unix socket its TOML names (agent-socket)",
        description=(
            "The client agent as the data owner's own long-lived service (privacy.md §10): it loads the "
            "configuration, the data and the ledger, and answers the node's ClientApp proxy on the Unix socket "
            "`agent-socket` (mode `agent-socket-mode`, default 0660) until SIGTERM. Run it as its own OS user."
        ),
    )
    serve.add_argument("path", type=Path, help="the agent TOML")
    serve.set_defaults(handler=run_serve)
    keygen = asub.add_parser(
        "keygen",
        help="write the agent's secagg identity key (secagg-identity-key) and print its public key",
        description=(
            "Writes PATH (mode 0600, never overwritten): the agent's long-term Ed25519 key, with which it signs "
            "its secagg key advertisements and survivor sets. Give the printed public key to the other data "
            "owners for their secagg-peers files, outside the coordinator."
        ),
    )
    keygen.add_argument("path", type=Path, help="the identity key file to create")
    keygen.add_argument(
        "--owner", default=None, help="the agent's OS user (name or uid), who owns the key; required when run as root"
    )
    keygen.set_defaults(handler=run_keygen)
    status = asub.add_parser(
        "status",
        help="for the owner: what the agent accepts (policy, peers), its ledger's spend and its recent answers",
        description=(
            "Reads the agent TOML and its ledger (read-only; safe while the agent serves) and prints the effective "
            "policy, who may connect to the socket, the ledger's high-water mark, every unit's spend in aggregate "
            "and the last --recent answered requests. Refusals are in the agent's own log, never in the ledger."
        ),
    )
    status.add_argument("path", type=Path, help="the agent TOML")
    status.add_argument("--recent", type=int, default=10, help="how many recent answers to list (default 10)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(handler=run_status)
    check = asub.add_parser("check", help="validate an agent TOML (configuration, data, ledger) before starting")
    check.add_argument("path", type=Path)
    check.set_defaults(handler=run_check)
    demo = asub.add_parser(
        "demo",
        help="demo agents for trying a deployment: synthetic data and an agent TOML each",
        description="Writes OUT/data{i}.npz, OUT/agent{i}.toml (absolute paths) and OUT/ledgers/ for --agents agents.",
    )
    demo.add_argument("--out", type=Path, required=True)
    demo.add_argument("--agents", type=int, default=3)
    demo.add_argument("--records", type=int, default=40, help="records per agent (default 40)")
    demo.add_argument("--epsilon", type=float, default=2.0)
    demo.add_argument("--delta", type=float, default=1e-5)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from simulations.deploy.agent_files import demo_parts, write_agent_files
    from simulations.deploy.files import DeployFileError

    existing = sorted(str(p) for p in args.out.glob("agent*.toml")) if args.out.exists() else []
    if existing:
        raise DeployFileError(f"refusing to overwrite existing agent files {existing}")
    parts = demo_parts(args.agents, records=args.records, seed=args.seed)
    for path in write_agent_files(args.out, parts, epsilon=args.epsilon, delta=args.delta, unit="record"):
        print(f"wrote {path}")
    print(f"n-public for a run with all of them: {args.agents * args.records}")
    return 0


def run_keygen(args: argparse.Namespace) -> int:
    import os

    from client_agent.config import AgentConfigError
    from client_agent.identity import write_identity

    if args.owner is None and os.geteuid() == 0:
        raise AgentConfigError(
            f"agent keygen: running as root, {args.path} would be readable by root only, not by the agent's user; "
            f"run `fedfilter agent keygen {args.path} --owner AGENT_USER` (or run keygen as that user; "
            "--owner root if the agent really runs as root)"
        )

    public = write_identity(args.path, owner=args.owner)
    print(f"wrote {args.path} (0600{', owner ' + args.owner if args.owner else ''})")
    print(f"identity (for the other owners' secagg-peers files): {public.hex()}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from client_agent.service import main as serve_main

    return serve_main(args.path)


def run_check(args: argparse.Namespace) -> int:
    from simulations.deploy.agent_files import check_agent_file

    report = check_agent_file(args.path)
    print(json.dumps(report, indent=2, default=str))
    dry = report.get("dry-run", {})
    for warning in dry.get("warnings", []) if isinstance(dry, dict) else []:
        print(f"warning: {warning}", file=sys.stderr)
    problems = dry.get("problems", []) if isinstance(dry, dict) else []
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def run_status(args: argparse.Namespace) -> int:
    from client_agent.config import parse_agent_config
    from client_agent.high_water import HighWater
    from client_agent.ledger import Ledger
    from client_agent.ledger_report import ledger_summary

    cfg = parse_agent_config({"agent-config": str(args.path)})
    report: dict[str, object] = {
        "agent": str(args.path),
        "target": {"epsilon": cfg.epsilon, "delta": cfg.delta, "filter": cfg.filter, "unit": cfg.unit},
        "trust": cfg.trust,
        "socket": None if cfg.socket_path is None else str(cfg.socket_path),
        "socket_mode": f"{cfg.socket_mode:04o}",
        "socket_peers": list(cfg.socket_peers) or ["(the service's own user)"],
        "policy": cfg.policy.describe(),
        "high_water": None if cfg.high_water_path is None else str(cfg.high_water_path),
    }
    if cfg.ledger_path.exists():
        report["ledger"] = ledger_summary(cfg.ledger_path)
        with Ledger.open_existing(cfg.ledger_path) as ledger:
            report["recent_answers"] = ledger.recent(args.recent)
            if cfg.high_water_path is not None:
                problem = HighWater(cfg.high_water_path, cfg.ledger_path).check(
                    ledger.mark(), marked=ledger.marked, request_at=ledger.request_fingerprint
                )
                report["high_water_check"] = problem or "ok"
    else:
        report["ledger"] = f"none yet at {cfg.ledger_path} (created at the first request)"
    if args.json:
        print(json.dumps(report, default=str))
        return 0
    for key, value in report.items():
        if key == "recent_answers":
            print("recent answers (newest first):")
            for row in value if isinstance(value, list) else []:
                seq, when, kind = row["seq"], row["created_at"], row["message_type"]
                print(f"  #{seq} {when} {kind} run {row['run_id']!r} id {row['request_id']!r}")
        elif isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:<24} {v}")
        else:
            print(f"{key:<26} {value}")
    return 0
