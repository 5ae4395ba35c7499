"""Files a deployment needs: TLS certificates for the SuperLink, SuperNode keys, Flower's connection config.

What Flower 1.41 expects (read from the installed ``flwr``):
- SuperLink TLS: ``--ssl-ca-certfile``, ``--ssl-certfile``, ``--ssl-keyfile``, PEM files
  (``flwr.common.args.try_obtain_server_certificates``); SuperNodes and ``flwr`` verify the
  server against the CA given as ``--root-certificates`` / ``root-certificates``. The server
  certificate must name the address clients dial (here 127.0.0.1 and localhost by default).
- SuperNode authentication: the private key is an unencrypted OpenSSH private key on a NIST
  elliptic curve (``flower-supernode --auth-supernode-private-key`` loads it with
  ``load_ssh_private_key`` and requires ``ec.EllipticCurvePrivateKey``); the public key is the
  matching OpenSSH public key line (``flwr supernode register`` loads it with
  ``load_ssh_public_key`` and requires a NIST curve). Flower's documentation uses P-384.
- ``flwr run`` and ``flwr supernode register`` find the SuperLink through the connection table
  ``[superlink.<name>]`` of ``$FLWR_HOME/config.toml`` (default ``~/.flwr``).

Private keys are written with mode 0600 and never overwrite an existing file unless ``force``.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")
NODE_KEY_CURVE = ec.SECP384R1  # what Flower's documentation generates (ssh-keygen -t ecdsa -b 384)
TLS_KEY_CURVE = ec.SECP384R1
CONNECTION = "fedfilter-local"


class DeployFileError(ValueError):
    """A deployment file exists where a new one would go, or cannot be used."""


@dataclass(frozen=True)
class Certificates:
    """The SuperLink's TLS files: the CA (and its key) and the server certificate and key."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_dir(cls, folder: Path) -> Certificates:
        return cls(folder / "ca.crt", folder / "ca.key", folder / "server.pem", folder / "server.key")

    def files(self) -> tuple[Path, ...]:
        return (self.ca_cert, self.ca_key, self.server_cert, self.server_key)


@dataclass(frozen=True)
class NodeKeys:
    """One SuperNode's authentication key pair: OpenSSH private key and ``.pub`` public key."""

    private: Path
    public: Path

    @classmethod
    def at(cls, path: Path) -> NodeKeys:
        return cls(path, path.with_name(path.name + ".pub"))


# --- writing files ---------------------------------------------------------------------------


def _refuse_existing(paths: Sequence[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists() or p.is_symlink()]
    if existing and not force:
        raise DeployFileError(f"refusing to overwrite existing files {existing}; pass --force to replace them")


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Write ``data`` to ``path`` through a new file of mode 0600 (private) or 0644, then rename over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600 if private else 0o644)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pem_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or any(c.isspace() for c in host):
                raise DeployFileError(f"host: expected an IP address or a DNS name, got {host!r}") from None
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_certificates(
    folder: Path, *, hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 365, force: bool = False
) -> Certificates:
    """A new CA and a server certificate it signs, valid for ``hosts`` (IP addresses or DNS names).

    The SuperLink takes ``ca.crt``, ``server.pem`` and ``server.key``; SuperNodes and ``flwr``
    take ``ca.crt``. ``ca.key`` signs further server certificates; keep it offline.
    """
    if days < 1:
        raise DeployFileError(f"days: expected an integer >= 1, got {days}")
    if not hosts:
        raise DeployFileError("hosts: expected at least one IP address or DNS name the SuperLink is reached at")
    out = Certificates.in_dir(folder)
    _refuse_existing(out.files(), force)
    san = _san(hosts)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)

    ca_key = ec.generate_private_key(TLS_KEY_CURVE())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedfilter coordinator CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=max(days, 3650)))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = ec.generate_private_key(TLS_KEY_CURVE())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]))]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(san, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA384())
    )

    _write(out.ca_key, _pem_private(ca_key), private=True)
    _write(out.server_key, _pem_private(server_key), private=True)
    _write(out.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(out.server_cert, server_cert.public_bytes(serialization.Encoding.PEM), private=False)
    return out


def make_node_keys(path: Path, *, comment: str = "", force: bool = False) -> NodeKeys:
    """A SuperNode key pair: ``path`` (OpenSSH private key, P-384, mode 0600) and ``path.pub``.

    Start the SuperNode with ``--auth-supernode-private-key path``; register ``path.pub`` on the
    SuperLink with ``flwr supernode register path.pub <connection>``.
    """
    out = NodeKeys.at(path)
    _refuse_existing((out.private, out.public), force)
    key = ec.generate_private_key(NODE_KEY_CURVE())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    if comment:
        if any(c.isspace() for c in comment):
            raise DeployFileError(f"comment: expected no whitespace, got {comment!r}")
        public += b" " + comment.encode()
    _write(out.private, private, private=True)
    _write(out.public, public + b"\n", private=False)
    return out


def connection_toml(address: str, root_certificates: Path, *, name: str = CONNECTION) -> str:
    """The ``$FLWR_HOME/config.toml`` that makes ``name`` the default connection to a TLS SuperLink."""
    return (
        f'[superlink]\ndefault = "{name}"\n\n'
        f"[superlink.{name}]\n"
        f'address = "{address}"\n'
        f'root-certificates = "{root_certificates.resolve()}"\n'
    )


def write_connection(flwr_home: Path, address: str, root_certificates: Path, *, name: str = CONNECTION) -> Path:
    """Write (or replace) ``flwr_home/config.toml`` with one connection; returns its path."""
    text = connection_toml(address, root_certificates, name=name)
    tomllib.loads(text)  # what flwr will parse
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(text)
    return path


def toml_value(value: object) -> str:
    """One value in TOML syntax: string, boolean, integer, float or a list of strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "inf" if value == math.inf else repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    raise DeployFileError(f"agent config value: expected a string, boolean, number or list of strings, got {value!r}")


def write_agent_toml(path: Path, values: Mapping[str, object]) -> Path:
    """Write an agent configuration file (flat ``key = value`` lines) and check that it parses back."""
    from client_agent.config import parse_agent_config

    text = "".join(f"{key} = {toml_value(value)}\n" for key, value in values.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    parse_agent_config({"agent-config": str(path)})
    return path


def write_agent_files(root: Path, parts: Sequence[tuple[np.ndarray, np.ndarray]], **agent: object) -> list[Path]:
    """Data files, ledgers folder and ``agent{i}.toml`` (absolute paths) for each part, under ``root``.

    Each TOML names its service's socket, ``agent{i}.sock`` beside it (``fedfilter agent serve``).
    """
    from simulations.federation import write_clients

    root = root.resolve()
    per = write_clients(root, parts, ledger_dir=root / "ledgers", **agent)
    return [
        write_agent_toml(root / f"agent{pid}.toml", per[pid] | {"agent-socket": str(root / f"agent{pid}.sock")})
        for pid in sorted(per)
    ]


def demo_parts(agents: int, *, records: int = 40, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Synthetic demo data per agent: 4 features, 2 classes; half the records have small gradients."""
    if agents < 1 or records < 2:
        raise DeployFileError(f"demo: expected agents >= 1 and records >= 2, got {agents} and {records}")
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(agents):
        x = rng.normal(size=(records, 4)).astype(np.float32)
        x[records // 2 :] *= 0.05  # these records' units outlive the others
        parts.append((x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)))
    return parts


def check_agent_file(path: Path) -> dict[str, object]:
    """Validate an agent TOML as the ClientApp will: configuration, data file, and an existing ledger.

    Returns a short description; raises ``AgentConfigError``, ``LedgerError`` or ``ValueError``
    naming what was expected and what was found. Nothing is created or spent.
    """
    from client_agent.agent import open_client_data
    from client_agent.config import parse_agent_config
    from client_agent.ledger_report import ledger_summary

    cfg = parse_agent_config({"agent-config": str(path)})  # relative paths resolve against the file's folder
    if not cfg.data_path.exists():
        raise DeployFileError(
            f"data-path: expected the workload's data (an .npz file by default), found nothing at {cfg.data_path}"
        )
    workload, source = open_client_data(cfg)  # the workload named in the file, and its data source
    out: dict[str, object] = {
        "agent-config": str(path),
        "workload": workload.name,
        "records": len(source),
        "units": len(source) if cfg.unit == "record" else 1,
        "target": f"({cfg.epsilon:g}, {cfg.delta:g})",
        "filter": cfg.filter,
        "unit": cfg.unit,
        "trust": cfg.trust,
        "policy": cfg.policy.describe(),
    }
    if cfg.socket_path is not None:
        out["agent-socket"] = str(cfg.socket_path)
    if cfg.secagg_identity_key is not None and cfg.secagg_peers is not None:
        from client_agent.identity import load_identity, load_peers
        from protocol.secagg import identity_public_key

        out["secagg-identity"] = identity_public_key(load_identity(cfg.secagg_identity_key)).hex()
        out["secagg-peers"] = len(load_peers(cfg.secagg_peers))
    if cfg.ledger_path.exists():
        from client_agent.agent import Agent

        Agent(cfg).close()  # the ClientApp's own check: the ledger was created with this configuration and data
        summary = ledger_summary(cfg.ledger_path)
        out["ledger"] = {k: summary[k] for k in ("units_total", "units_active", "units_exhausted", "spent_max")}
    elif not cfg.ledger_path.parent.is_dir():
        raise DeployFileError(f"ledger-path: expected an existing folder, found none at {cfg.ledger_path.parent}")
    else:
        out["ledger"] = "created at the first request"
    return out


# --- command line (registered by simulations.cli) ----------------------------------------------


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``fedfilter certs``, ``fedfilter keys`` and ``fedfilter agent check``."""
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
    certs.set_defaults(handler=_run_certs)

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
    keys.set_defaults(handler=_run_keys)

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
    run.set_defaults(handler=_run_deployed)

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
    serve.set_defaults(handler=_run_agent_serve)
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
    keygen.set_defaults(handler=_run_agent_keygen)
    check = asub.add_parser("check", help="validate an agent TOML (configuration, data, ledger) before starting")
    check.add_argument("path", type=Path)
    check.set_defaults(handler=_run_agent_check)
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
    demo.set_defaults(handler=_run_agent_demo)


def _run_certs(args: argparse.Namespace) -> int:
    out = make_certificates(args.out, hosts=args.host or DEFAULT_HOSTS, days=args.days, force=args.force)
    for path in out.files():
        print(f"wrote {path}{' (0600)' if path.suffix == '.key' else ''}")
    return 0


def _run_keys(args: argparse.Namespace) -> int:
    out = make_node_keys(args.path, comment=args.comment, force=args.force)
    print(f"wrote {out.private} (0600)")
    print(f"wrote {out.public}")
    return 0


def _run_agent_demo(args: argparse.Namespace) -> int:
    existing = sorted(str(p) for p in args.out.glob("agent*.toml")) if args.out.exists() else []
    if existing:
        raise DeployFileError(f"refusing to overwrite existing agent files {existing}")
    parts = demo_parts(args.agents, records=args.records, seed=args.seed)
    for path in write_agent_files(args.out, parts, epsilon=args.epsilon, delta=args.delta, unit="record"):
        print(f"wrote {path}")
    print(f"n-public for a run with all of them: {args.agents * args.records}")
    return 0


def _run_deployed(args: argparse.Namespace) -> int:
    from simulations.deployed_run import run

    return run(args.app, args.connection, args.run_config)


def _run_agent_keygen(args: argparse.Namespace) -> int:
    from client_agent.identity import write_identity

    public = write_identity(args.path)
    print(f"wrote {args.path} (0600)")
    print(f"identity (for the other owners' secagg-peers files): {public.hex()}")
    return 0


def _run_agent_serve(args: argparse.Namespace) -> int:
    from client_agent.service import main as serve_main

    return serve_main(args.path)


def _run_agent_check(args: argparse.Namespace) -> int:
    print(json.dumps(check_agent_file(args.path), indent=2, default=str))
    return 0
