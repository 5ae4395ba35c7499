"""``fedfilter certs``, ``keys`` and ``run``: a deployment's files and runs (:mod:`simulations.deploy`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from simulations.cli.arguments import Subparsers


def add_parser(sub: Subparsers) -> None:
    """``fedfilter certs``, ``fedfilter keys`` and ``fedfilter run``."""
    certs = sub.add_parser(
        "certs",
        help="create a CA and a TLS server certificate for the coordinator's SuperLink",
        description=(
            "Writes ca.crt, ca.key, server.pem and server.key to --out (keys with mode 0600). Start the "
            "SuperLink with --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key; "
            "give ca.crt to every client agent (flower-supernode --root-certificates ca.crt)."
        ),
    )
    certs.add_argument("--out", type=Path, required=True, help="folder for the four files")
    certs.add_argument(
        "--host",
        action="append",
        help="IP address or DNS name the SuperLink is reached at (repeatable; default 127.0.0.1, localhost, ::1)",
    )
    certs.add_argument("--days", type=int, default=365, help="server certificate validity in days (default 365)")
    certs.add_argument("--force", action="store_true", help="replace existing files")
    certs.set_defaults(handler=run_certs)

    keys = sub.add_parser(
        "keys",
        help="create a SuperNode key pair for node authentication",
        description=(
            "Writes PATH (OpenSSH EC P-384 private key, mode 0600) and PATH.pub. Register PATH.pub with "
            "`flwr supernode register PATH.pub <connection>`; start the agent with "
            "flower-supernode --auth-supernode-private-key PATH."
        ),
    )
    keys.add_argument("path", type=Path, help="private key file; the public key goes to PATH.pub")
    keys.add_argument("--comment", default="", help="comment at the end of the public key line")
    keys.add_argument("--force", action="store_true", help="replace existing files")
    keys.set_defaults(handler=run_keys)

    shim = sub.add_parser(
        "node-shim",
        help="write the flwr-clientapp shim for a SuperNode's PATH (fresh folders, namespaces of its own per run)",
        description=(
            "Writes DIR/flwr-clientapp (mode 0755), run by --python (default: this interpreter). Put DIR first on the "
            "SuperNode's PATH: each ClientApp then runs in fresh folders and namespaces of its own (PID, mount, "
            "network: its SuperNode's Runtime API only through a relay that passes its own task's calls), so nothing "
            "a run's bundle writes or starts outlives the run. Every other command Flower starts for a task "
            "(flwr-agentapp, ...) is written there too, and refuses its task (docs/deploy.md section 9)."
        ),
    )
    shim.add_argument("dir", type=Path, help="the folder for flwr-clientapp (e.g. /opt/fedfilter/node-bin)")
    shim.add_argument("--python", default=None, help="the interpreter the SuperNode's user runs it with")
    shim.set_defaults(handler=run_node_shim)

    run = sub.add_parser(
        "run",
        help="flwr run --stream on a deployment, with the run config checked first and an honest exit code",
        description=(
            "Checks every -c key against the app's [tool.flwr.app.config] and the coordinator's configuration, "
            "runs `flwr run APP CONNECTION -c ... --stream`, then exits 0 only if `flwr ls --run-id` reports "
            "the run finished:completed (flwr run itself exits 0 when the ServerApp fails)."
        ),
    )
    run.add_argument("app", type=Path, help="the Flower app folder (pyproject.toml)")
    run.add_argument("connection", help="the SuperLink connection name in $FLWR_HOME/config.toml")
    run.add_argument("-c", "--run-config", action="append", default=[], help="key=value overrides, as for flwr run")
    run.set_defaults(handler=run_deployed)


def run_certs(args: argparse.Namespace) -> int:
    from simulations.deploy.certs import DEFAULT_HOSTS, make_certificates  # cryptography: when it runs

    out = make_certificates(args.out, hosts=args.host or DEFAULT_HOSTS, days=args.days, force=args.force)
    for path in out.files():
        print(f"wrote {path}{' (0600)' if path.suffix == '.key' else ''}")
    return 0


def run_keys(args: argparse.Namespace) -> int:
    from simulations.deploy.keys import make_node_keys

    out = make_node_keys(args.path, comment=args.comment, force=args.force)
    print(f"wrote {out.private} (0600)")
    print(f"wrote {out.public}")
    return 0


def run_deployed(args: argparse.Namespace) -> int:
    from simulations.deploy.run import run

    return run(args.app, args.connection, args.run_config)


def run_node_shim(args: argparse.Namespace) -> int:
    import sys

    from simulations.deploy.clientapp_sandbox import REFUSED_COMMANDS, namespaces_work, write_shim

    path = write_shim(args.dir, args.python or sys.executable)
    print(f"wrote {path}; put {args.dir} first on the SuperNode's PATH")
    print(f"beside it, {', '.join(REFUSED_COMMANDS)} each refuse their task: a node runs ClientApps only")
    why = namespaces_work("unshare")
    if why is not None:
        print(f"warning: this host cannot make the sandbox's namespaces ({why}); the shim will refuse ClientApps")
    return 0
