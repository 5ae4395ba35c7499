"""The deployed path on one host: a SuperLink with TLS and node authentication, SuperNodes running client agents.

Used by ``scripts/deploy_local.py``, the end-to-end tests and ``benchmarks/deploy_latency.py``.
It runs exactly the commands of ``docs/deploy.md``:

- ``flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key
  --enable-supernode-auth --disable-runtime-dependency-installation --host 127.0.0.1 --port P``
- ``flwr supernode register agent.pub fedfilter-local`` (one per agent; the node id is fixed by the key)
- ``fedfilter agent serve /abs/agent.toml`` (the data owner's agent service, on the TOML's ``agent-socket``)
- ``flower-supernode --superlink 127.0.0.1:P --root-certificates ca.crt --auth-supernode-private-key agent
  --node-config 'agent-socket="/abs/agent.sock"' --host 127.0.0.1 --port Q`` (its ClientApp is a proxy)
- ``flwr run APP fedfilter-local -c key=value ... --stream``

Every server binds 127.0.0.1 on a free port picked at start. Each process starts in its own
session; stopping it signals its process group and every process it started (found through
``/proc`` before the signal), by PID. Each SuperNode gets its own ``FLWR_HOME`` (where Flower
installs the app bundle), as separate machines would; the ``flwr`` CLI gets one whose
``config.toml`` names only this SuperLink, so the user's ``~/.flwr`` is never read or written.

SuperNodes as another OS user: a :class:`NodeLauncher` gives the command prefix (``setpriv
--reuid=nobody --regid=nogroup --clear-groups``), the folder of the Flower commands that user can
run and the environment they start with; each SuperNode's home (``root/agents/NAME``) and key
must then be that user's (create them before :meth:`LocalDeployment.start_agent`).

Restarts: a SuperNode killed without a goodbye stays "online" on the SuperLink until two
heartbeats are missed (flwr 1.41: 2 x 30 s), and the SuperLink refuses to activate the same
node id again before that (the SuperNode exits with code 305). :meth:`LocalDeployment.start_agent`
retries like a service supervisor would.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import FedfilterError
from simulations.deploy.agent_files import check_agent_file
from simulations.deploy.certs import CONNECTION, Certificates, make_certificates, write_connection
from simulations.deploy.clientapp_sandbox import write_shim

FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # no `uv sync` of the app bundle (no network)
    "PYTHONUNBUFFERED": "1",
    # No user site folder: a bundle running as the node's user could otherwise plant a .pth file in
    # ~/.local that the SuperNode's own Python would run at its next start.
    "PYTHONNOUSERSITE": "1",
}
APP_PACKAGES = ("protocol", "workloads", "client_agent", "coordinator")
ACTIVATION_REFUSED = "Failed to activate SuperNode"
_NODE_ID = re.compile(r"SuperNode ID: (\d+)")


class DeploymentError(FedfilterError, RuntimeError):
    """A process of the local deployment did not start, refused, or a run ended without its summary."""


@dataclass(frozen=True)
class NodeLauncher:
    """How :meth:`LocalDeployment.start_agent` starts SuperNodes (default: like every other process).

    ``prefix`` goes before the command (e.g. ``setpriv --reuid=nobody --regid=nogroup --clear-groups``);
    ``bin_dir`` holds ``flower-supernode``, ``flower-superexec`` and ``flwr-clientapp`` and goes first
    on PATH (default: the deployment's ``bin_dir``); ``env``, when given, replaces the inherited
    environment (Flower's variables, ``FLWR_HOME`` and ``PATH`` are set on top of it).
    """

    prefix: tuple[str, ...] = ()
    bin_dir: Path | None = None
    env: Mapping[str, str] | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/PID/stat`` (state, ppid, ..., starttime at index 19), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot): with the PID, it names one process for good."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` is a live process (not a zombie), and the same one that started at ``started``."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return False
    return started is None or int(fields[19]) == started


def run_config_args(run_config: Mapping[str, Any]) -> list[str]:
    """``-c key=value`` arguments for ``flwr run``; values in TOML syntax, as Flower parses them."""
    out: list[str] = []
    for key, value in run_config.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, str):
            # Flower splits on `key="..."` or `key='...'`, so the value may hold one kind of quote only.
            if '"' not in value and "\\" not in value:
                text = f'"{value}"'
            elif "'" not in value:
                text = f"'{value}'"
            else:
                raise DeploymentError(f"run config {key!r}: a value with both quote kinds cannot pass flwr -c")
        else:
            raise DeploymentError(f"run config {key!r}: expected a bool, number or string, got {value!r}")
        out += ["-c", f"{key}={text}"]
    return out


def stage_app(dest: Path, source: Path | None = None) -> Path:
    """Copy the Flower app (``pyproject.toml`` and the packages both apps import) to ``dest``; returns ``dest``.

    ``flwr run`` bundles every ``.py``/``.toml``/``.md`` under the app folder; a staged copy keeps
    the bundle to what the ServerApp and ClientApp need.
    """
    source = source or Path(__file__).resolve().parents[2]
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "README.md"):
        if (source / name).exists():
            shutil.copy2(source / name, dest / name)
    for package in APP_PACKAGES:
        shutil.copytree(
            source / package,
            dest / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            dirs_exist_ok=True,
        )
    return dest


@dataclass
class Service:
    """One process started by :class:`LocalDeployment` (a SuperLink, a SuperNode, a ``flwr run``)."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes]
    node_id: int | None = None
    started: list[float] = field(default_factory=list)
    agent: Service | None = None  # a SuperNode's agent service (fedfilter agent serve), which it proxies to

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return _tail(self.log_text(), lines)


class LocalDeployment:
    """A coordinator service and client agents under ``root``; a context manager that stops them all."""

    def __init__(
        self,
        root: Path,
        *,
        bin_dir: Path | None = None,
        echo: Callable[[str], None] | None = None,
        node_launcher: NodeLauncher | None = None,
        sandbox_clientapps: bool = True,
    ) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.bin_dir = (bin_dir or Path(sys.executable).parent).resolve()
        self.node_launcher = node_launcher or NodeLauncher()
        # False only to show what the shim prevents (the e2e tests' old-layout control): Flower's own
        # flwr-clientapp, with the SuperNode's FLWR_HOME and no PID namespace.
        self.sandbox_clientapps = sandbox_clientapps
        self._shim_lock = threading.Lock()
        self._shims: dict[Path, Path] = {}
        self.echo = echo or (lambda _line: None)
        self.services: list[Service] = []
        self.certs: Certificates | None = None
        self.port: int | None = None
        self.flwr_home = self.root / "flwr-cli"
        self.superlink: Service | None = None
        self.pids_seen: dict[int, int | None] = {}  # pid -> start time: processes started here and by them

    # -- processes ---------------------------------------------------------------------------

    def env(
        self, flwr_home: Path, *, base: Mapping[str, str] | None = None, bin_dir: Path | None = None
    ) -> dict[str, str]:
        """The environment of a process run with ``FLWR_HOME=flwr_home``: ``base`` (default: ours) and Flower's."""
        env = dict(os.environ if base is None else base)
        env.update(FLOWER_ENV)
        env["FLWR_HOME"] = str(flwr_home)
        bin_dir = bin_dir or self.bin_dir
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"  # flower-superexec, flwr-clientapp
        return env

    def _tool(self, name: str, bin_dir: Path | None = None) -> str:
        bin_dir = bin_dir or self.bin_dir
        path = bin_dir / name
        if not path.exists():
            raise DeploymentError(f"{name}: expected it in {bin_dir} (the environment with flwr 1.41), found none")
        return str(path)

    def _spawn(
        self, name: str, argv: list[str], flwr_home: Path, log: Path, *, env: Mapping[str, str] | None = None
    ) -> Service:
        self.echo("$ " + shlex.join(argv))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else self.env(flwr_home),
                cwd=flwr_home,
                start_new_session=True,
            )
        service = Service(name, argv, log, proc, started=[time.monotonic()])
        self.services.append(service)
        self._seen([proc.pid])
        return service

    def signal(self, service: Service, sig: int) -> None:
        """Send ``sig`` to the service's process group and to every process it started (by PID)."""
        pids = [service.pid, *descendants(service.pid)]
        self._seen(pids)
        own = os.getpgid(0)
        groups = set()
        for pid in pids:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
        for group in groups - {own}:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, service: Service) -> None:
        """SIGKILL: the service and everything it started die at once, with no goodbye to the SuperLink."""
        self.echo(f"# kill -KILL {service.name} (pid {service.pid})")
        pids = [service.pid, *descendants(service.pid)]
        self._seen(pids)
        self.signal(service, signal.SIGKILL)
        service.proc.wait(timeout=30)
        # SIGKILL lands asynchronously: a child in the middle of an fsync (a ClientApp committing to its
        # ledger) dies once the write returns. Return only when every process of the service is gone.
        deadline = time.monotonic() + 30
        while any(pid_alive(p, self.pids_seen.get(p)) for p in pids):
            if time.monotonic() > deadline:
                raise DeploymentError(f"{service.name}: processes {pids} still alive 30 s after SIGKILL")
            time.sleep(0.05)

    def stop(self, service: Service, *, grace: float = 10.0) -> None:
        """SIGTERM (a SuperNode then says goodbye to the SuperLink), SIGKILL whatever is left after ``grace``."""
        pids = [service.pid, *descendants(service.pid)]
        self._seen(pids)
        if service.alive():
            self.signal(service, signal.SIGTERM)
            try:
                service.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.signal(service, signal.SIGKILL)
        for pid in pids:  # children the service left behind (already reparented), if still the same process
            if pid_alive(pid, self.pids_seen.get(pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            service.proc.wait(timeout=30)
        except subprocess.TimeoutExpired as exc:
            raise DeploymentError(f"{service.name} (pid {service.pid}) did not stop") from exc

    def stop_all(self) -> None:
        """Stop every process this deployment started: agents and runs first, the SuperLink last."""
        problems = []
        for service in sorted(self.services, key=lambda s: s is self.superlink):
            try:
                self.stop(service, grace=5.0)
            except (DeploymentError, OSError) as exc:
                problems.append(f"{service.name}: {exc}")
        self.services.clear()
        if problems:
            raise DeploymentError("; ".join(problems))

    def survivors(self) -> list[int]:
        """Processes started here (or by them) that are still alive: none after :meth:`stop_all`."""
        for service in self.services:
            self._seen(descendants(service.pid))
        return sorted(pid for pid, started in self.pids_seen.items() if pid_alive(pid, started))

    def _seen(self, pids: list[int]) -> None:
        for pid in pids:
            self.pids_seen.setdefault(pid, start_time(pid))

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()

    # -- coordinator service -----------------------------------------------------------------

    @property
    def address(self) -> str:
        if self.port is None:
            raise DeploymentError("the SuperLink is not started")
        return f"127.0.0.1:{self.port}"

    def start_superlink(self, *, timeout: float = 90.0) -> Service:
        """TLS with a fresh CA under ``root/certs`` (kept if present) and node authentication on."""
        cert_dir = self.root / "certs"
        self.certs = (
            Certificates.in_dir(cert_dir)
            if Certificates.in_dir(cert_dir).server_key.exists()
            else make_certificates(cert_dir)
        )
        self.port = free_port()
        home = self.root / "superlink"
        home.mkdir(parents=True, exist_ok=True)
        argv = [
            self._tool("flower-superlink"),
            "--ssl-ca-certfile",
            str(self.certs.ca_cert),
            "--ssl-certfile",
            str(self.certs.server_cert),
            "--ssl-keyfile",
            str(self.certs.server_key),
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
            "--database",
            str(home / "state.db"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.superlink = self._spawn("superlink", argv, home, self.root / "logs" / "superlink.log")
        write_connection(self.flwr_home, self.address, self.certs.ca_cert)
        deadline = time.monotonic() + timeout
        while "Uvicorn running" not in self.superlink.log_text():
            if not self.superlink.alive() or time.monotonic() > deadline:
                raise DeploymentError(f"the SuperLink did not start; its log ends:\n{self.superlink.tail()}")
            time.sleep(0.2)
        return self.superlink

    def flwr(self, *args: str, timeout: float = 120.0) -> str:
        """Run the ``flwr`` CLI against this SuperLink; returns its output, raises on a non-zero exit."""
        argv = [self._tool("flwr"), *args]
        self.echo("$ " + shlex.join(argv))
        done = subprocess.run(
            argv, env=self.env(self.flwr_home), cwd=self.root, capture_output=True, timeout=timeout, check=False
        )
        out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        if done.returncode != 0:
            raise DeploymentError(f"flwr {' '.join(args)}: exit code {done.returncode}; output:\n{out[-3000:]}")
        return out

    def _flwr_json(self, *args: str) -> dict[str, Any]:
        """``flwr ... --format json``: the JSON object in its output (Flower may print log lines around it)."""
        out = self.flwr(*args, "--format", "json")
        try:
            reply = json.loads(out[out.index("{") : out.rindex("}") + 1])
        except ValueError as exc:  # no braces, or not JSON between them
            raise DeploymentError(f"flwr {' '.join(args)}: expected a JSON object, got:\n{out[-3000:]}") from exc
        if not isinstance(reply, dict):
            raise DeploymentError(f"flwr {' '.join(args)}: expected a JSON object, got {reply!r}")
        return reply

    def register(self, public_key: Path) -> int:
        """``flwr supernode register``: the SuperLink accepts the key's owner; returns its node id."""
        reply = self._flwr_json("supernode", "register", str(public_key), CONNECTION)
        if not reply.get("success"):
            raise DeploymentError(f"flwr supernode register {public_key}: expected success, got {reply}")
        return int(reply["node-id"])

    def unregister(self, node_id: int) -> None:
        self.flwr("supernode", "unregister", str(node_id), CONNECTION)

    def nodes(self) -> dict[int, str]:
        """Node id -> status (registered, online, offline, unregistered) as the SuperLink lists them."""
        reply = self._flwr_json("supernode", "ls", CONNECTION)
        return {int(n["node-id"]): str(n["status"]) for n in reply.get("nodes", [])}

    # -- client agents -----------------------------------------------------------------------

    def start_agent_service(self, name: str, agent_toml: Path, *, timeout: float = 90.0) -> Service:
        """``fedfilter agent serve AGENT.toml`` (privacy.md §10); returns once its socket answers."""
        described = check_agent_file(agent_toml)
        federations = described["federations"]
        assert isinstance(federations, list)
        sockets = [f.get("socket") for f in federations]
        if not sockets or not all(isinstance(s, str) for s in sockets):
            raise DeploymentError(f"agent {name}: expected agent-socket (or one per federation) in {agent_toml}")
        socket_path = ", ".join(str(s) for s in sockets)
        home = self.root / "agents" / name
        home.mkdir(parents=True, exist_ok=True)
        argv = [self._tool("fedfilter"), "agent", "serve", str(agent_toml.resolve())]
        log = self.root / "logs" / f"{name}-service.log"
        seen = len(log.read_text(errors="replace")) if log.exists() else 0  # a restart appends to the log
        service = self._spawn(f"{name}-service", argv, home, log)
        deadline = time.monotonic() + timeout
        while "serving " not in service.log_text()[seen:]:
            if not service.alive() or time.monotonic() > deadline:
                raise DeploymentError(
                    f"agent {name}: expected `fedfilter agent serve` to open {socket_path}, found exit code "
                    f"{service.proc.poll()}; its log ends:\n{service.tail()}"
                )
            time.sleep(0.1)
        return service

    def clientapp_shim(self, launcher: NodeLauncher | None = None) -> Path:
        """``root/node-bin/flwr-clientapp``: each ClientApp in fresh folders and its own PID namespace.

        :mod:`simulations.deploy.clientapp_sandbox`, run by the node's interpreter; it goes first on
        every SuperNode's PATH, so nothing a run's bundle writes or starts outlives the run.
        """
        node_bin = (launcher or self.node_launcher).bin_dir or self.bin_dir
        python = node_bin / "python3" if (node_bin / "python3").exists() else Path(sys.executable)
        with self._shim_lock:  # SuperNodes are started from several threads
            if python not in self._shims:
                folder = self.root / "node-bin" / hashlib.sha256(str(python).encode()).hexdigest()[:12]
                self._shims[python] = write_shim(folder, str(python))
            return self._shims[python]

    def start_agent(
        self,
        name: str,
        agent_toml: Path,
        private_key: Path,
        *,
        retry_for: float = 120.0,
        timeout: float = 90.0,
        agent: Service | None = None,
        launcher: NodeLauncher | None = None,
        socket: Path | None = None,
    ) -> Service:
        """Start the agent service (unless ``agent`` is one still running), then a SuperNode that proxies to it.

        The SuperNode's node config holds only ``agent-socket``: the data, the ledger and the
        policy stay with the agent service. Waits for the SuperNode's node id; while the SuperLink
        refuses to activate the node (a crashed predecessor still counts as online), starts it
        again every few seconds for up to ``retry_for`` seconds. ``launcher`` (default: the
        deployment's) starts this SuperNode, e.g. as its own OS user. ``socket``: the agent socket of
        this SuperNode's federation, for an agent that serves several (default: its ``agent-socket``).
        """
        launcher = launcher or self.node_launcher
        if self.certs is None:
            raise DeploymentError("start the SuperLink first")
        if agent is None or not agent.alive():
            agent = self.start_agent_service(name, agent_toml)
        socket_path = str(socket) if socket is not None else check_agent_file(agent_toml)["agent-socket"]
        home = self.root / "agents" / name
        home.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + retry_for
        attempt = 0
        while True:
            attempt += 1
            argv = [
                *launcher.prefix,
                self._tool("flower-supernode", launcher.bin_dir),
                "--superlink",
                self.address,
                "--root-certificates",
                str(self.certs.ca_cert),
                "--auth-supernode-private-key",
                str(private_key.resolve()),
                "--node-config",
                f'agent-socket="{socket_path}"',
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
                "--max-retries",
                "3",
            ]
            log = self.root / "logs" / f"{name}.log"
            seen = len(log.read_text(errors="replace")) if log.exists() else 0
            env = self.env(home, base=launcher.env, bin_dir=launcher.bin_dir)
            if self.sandbox_clientapps:
                env["PATH"] = f"{self.clientapp_shim(launcher).parent}{os.pathsep}{env['PATH']}"
            service = self._spawn(name, argv, home, log, env=env)
            waited_until = time.monotonic() + timeout
            while True:
                text = service.log_text()[seen:]
                if found := _NODE_ID.search(text):
                    service.node_id = int(found.group(1))
                    service.agent = agent
                    return service
                if not service.alive() or time.monotonic() > waited_until:
                    break
                time.sleep(0.2)
            code = service.proc.poll()
            self.stop(service, grace=2.0)
            self.services.remove(service)
            if ACTIVATION_REFUSED in text and time.monotonic() < deadline:
                self.echo(f"# {name}: the SuperLink refused activation (attempt {attempt}); trying again")
                time.sleep(3.0)
                continue
            raise DeploymentError(
                f"agent {name}: expected the SuperNode to report its node id, found exit code {code}; "
                f"its log ends:\n{_tail(text)}"
            )

    # -- runs --------------------------------------------------------------------------------

    def run(self, app: Path, run_config: Mapping[str, Any], *, timeout: float = 900.0) -> dict[str, Any]:
        """``flwr run APP fedfilter-local -c ... --stream``; returns the run's ``summary.json`` (``output-dir``).

        The summary gains ``wall_s``, the seconds from ``flwr run`` until it returned.
        """
        config = dict(run_config)
        config.setdefault("output-dir", str(self.root / "runs" / str(config.get("run-id", "run"))))
        config.setdefault("progress", False)
        out_dir = Path(str(config["output-dir"]))
        argv = [self._tool("flwr"), "run", str(app.resolve()), CONNECTION, *run_config_args(config), "--stream"]
        log = self.root / "logs" / f"flwr-run-{config.get('run-id', 'run')}.log"
        started = time.monotonic()
        service = self._spawn(f"flwr run {config.get('run-id', '')}", argv, self.flwr_home, log)
        try:
            service.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise DeploymentError(
                f"flwr run did not finish within {timeout} s; its log ends:\n{service.tail()}"
            ) from exc
        finally:
            self.stop(service, grace=2.0)
            self.services.remove(service)
        wall = time.monotonic() - started
        summary_path = out_dir / "summary.json"
        if not summary_path.exists():
            superlink = self.superlink.tail() if self.superlink else ""
            raise DeploymentError(
                f"run {config.get('run-id')}: expected {summary_path}, found none (flwr run exit code "
                f"{service.proc.returncode}); its log ends:\n{service.tail()}\nSuperLink log ends:\n{superlink}"
            )
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        summary["wall_s"] = wall
        summary["rounds"] = [json.loads(line) for line in (out_dir / "rounds.jsonl").read_text().splitlines() if line]
        return summary


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def wait_for(predicate: Callable[[], bool], *, timeout: float, what: str, every: float = 0.5) -> None:
    """Poll ``predicate`` until it holds; a DeploymentError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise DeploymentError(f"expected {what} within {timeout} s; it did not happen")
        time.sleep(every)
