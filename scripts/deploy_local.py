"""Try the deployed path on one machine: a coordinator service and client agents, TLS and node authentication.

What it does, printing every command it runs (the same as docs/deploy.md):
1. certificates for the SuperLink (``fedfilter certs``) and a key pair per agent (``fedfilter keys``);
2. demo data and an agent configuration file per agent (synthetic, 4 features, 2 classes);
3. ``flower-superlink`` with TLS and ``--enable-supernode-auth`` on 127.0.0.1 and a free port;
4. ``flwr supernode register`` for every agent's public key;
5. ``fedfilter agent serve <its TOML>`` per agent (the owner's service), and a ``flower-supernode`` per
   agent with ``--node-config agent-socket="<its socket>"`` (the ClientApp is a proxy to it), with
   fedfilter's ``flwr-clientapp`` shim first on its PATH (each ClientApp in fresh folders and a PID
   namespace of its own; docs/deploy.md §9). Everything runs as the current user: a try-out, not the
   per-agent users of §9;
6. ``flwr run <repo> fedfilter-local -c ... --stream`` (twice with --runs 2: budgets carry over);
7. each agent's ledger (``fedfilter ledger show``), then every process is stopped.

Run: .venv/bin/python scripts/deploy_local.py [--workdir DIR] [--agents 3] [--rounds 4] [--runs 1] [--keep-running]
Everything lives under --workdir (default: a new temporary folder); nothing is written to ~/.flwr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

from client_agent.ledger_report import ledger_summary  # noqa: E402
from simulations.deploy.agent_files import demo_parts, write_agent_files  # noqa: E402
from simulations.deploy.keys import make_node_keys  # noqa: E402
from simulations.deploy.local import DeploymentError, LocalDeployment  # noqa: E402

RECORDS = 40


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="folder for certificates, keys, agents, logs and runs")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1, help="runs one after the other against the same agents")
    parser.add_argument("--noise-std", type=float, default=3.0)
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--trust", choices=["local", "central", "secagg"], default="local")
    parser.add_argument("--keep-running", action="store_true", help="leave the services up until Ctrl-C")
    args = parser.parse_args()
    for name in ("agents", "rounds", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
    root = (args.workdir or Path(tempfile.mkdtemp(prefix="fedfilter-deploy-"))).resolve()
    print(f"# working folder: {root}")

    with LocalDeployment(root, echo=print) as dep:
        print(f"# agent configurations and demo data: {root / 'clients'}")
        tomls = write_agent_files(
            root / "clients",
            demo_parts(args.agents, records=RECORDS),
            epsilon=args.epsilon,
            delta=1e-5,
            unit="record",
            trust=args.trust,
        )
        print(f"# fedfilter certs --out {root / 'certs'}")
        dep.start_superlink()
        node_ids = []
        for i, toml in enumerate(tomls):
            print(f"# fedfilter keys {root / 'keys' / f'agent{i}'}")
            keys = make_node_keys(root / "keys" / f"agent{i}")
            node_ids.append(dep.register(keys.public))
            print(f"# fedfilter agent check {toml}")
            dep.start_agent(f"agent{i}", toml, keys.private)
        print(f"# registered and online: {node_ids}")
        for run in range(1, args.runs + 1):
            run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{run}"
            summary = dep.run(
                REPO,
                {
                    "num-nodes": args.agents,
                    "n-public": args.agents * RECORDS,
                    "rounds": args.rounds,
                    "noise-std": args.noise_std,
                    "l2-clip": 1.0,
                    "learning-rate": 0.5,
                    "unit": "record",
                    "trust": args.trust,
                    "model-args": json.dumps({"in_features": 4, "n_classes": 2}),
                    "run-id": run_id,
                },
            )
            print(
                f"# run {run_id}: {summary['rounds_completed']} rounds, stopped because "
                f"{summary['stopped_because']}, errors {summary['errors_total'] or 'none'}; "
                f"{summary['wall_s']:.0f} s; summary in {root / 'runs' / run_id / 'summary.json'}"
            )
            print(f"# {summary['privacy']['statement']}")
            for toml in tomls:
                ledger = ledger_summary(Path(tomllib.loads(toml.read_text())["ledger-path"]))
                print(
                    f"#   {Path(ledger['path']).name}: {ledger['units_active']}/{ledger['units_total']} units active, "
                    f"largest spend {ledger['spent_max']:.3f} of {ledger['threshold']:.3f}"
                )
        if args.keep_running:
            print(f"# services up; FLWR_HOME={dep.flwr_home} flwr run {REPO} fedfilter-local -c ... ; Ctrl-C stops all")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        print("# stopping every process by PID")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (DeploymentError, ValueError) as exc:  # every process is stopped by then (LocalDeployment.__exit__)
        print(f"deploy_local: error: {exc}", file=sys.stderr)
        sys.exit(2)
