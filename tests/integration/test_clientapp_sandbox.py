"""The ``flwr-clientapp`` shim (simulations/deploy/clientapp_sandbox.py): nothing a ClientApp starts outlives it.

The shim's own file, with Flower's entry point swapped for a hostile stand-in (it forks a daemon
in its own session, ignores SIGTERM and SIGINT and never returns), run as a subprocess:

- SIGTERM to the shim: after its grace period the whole PID namespace is killed, daemon included;
- the stand-in's FLWR_HOME is a fresh folder, removed when the run ends;
- a stand-in that returns but leaves a non-daemon thread and a patched ``os._exit`` ends with its task,
  and one that never returns is killed after ``FEDFILTER_CLIENTAPP_MAX_SECONDS`` (a hostile review);
- inside, the host's CPU counters are out of sight and the masks cannot be lifted (a hostile review read
  the agent's CPU time from its cgroup's ``cpu.stat``), and it can write in its run's folder only, as root
  and as an unprivileged user.

The end-to-end version, on Flower's deployment engine with a hostile bundle, is in
tests/e2e/test_hostile_bundle.py.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from simulations.deploy import clientapp_sandbox
from tests.e2e.common import cannot_run

MARK = "fedfilter-sandbox-test-daemon"
HOSTILE = (
    "import json, os, signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', "
    f"'{MARK}'], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL)\n"
    "print(json.dumps({'flwr_home': os.environ['FLWR_HOME'], 'pid': os.getpid()}), flush=True)\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


# As Flower's SuperNode starts a ClientApp (flwr 1.42, supercore/superexec/executor/subprocess_executor.py).
FLOWER_ARGS = ("--runtime-api-address", "127.0.0.1:9", "--token", "ab" * 32, "--insecure")


def marked() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if MARK.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def shim_with(tmp_path: Path, stand_in: str) -> Path:
    """The shim's own source with Flower's call replaced by ``stand_in`` (Python that may set ``code``)."""
    why = clientapp_sandbox.namespaces_work("unshare")
    if why is not None:
        cannot_run(f"no sandbox here (PID and user namespaces, masks): {why}")
    source = Path(clientapp_sandbox.__file__).read_text()
    source = source.replace("GRACE_S = 10.0", "GRACE_S = 2.0")
    assert "FLOWER_CALL = " in source
    source = source.replace("FLOWER_CALL = ", f"FLOWER_CALL = {stand_in!r}\n_UNUSED = ", 1)
    shim = tmp_path / "shim.py"
    shim.write_text(source + "\n\nif __name__ == '__main__':\n    raise SystemExit(main())\n")
    shim.chmod(0o644)
    return shim


def test_a_clientapp_that_ignores_stop_signals_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    shim = shim_with(tmp_path, HOSTILE)
    proc = subprocess.Popen(
        [sys.executable, str(shim), *FLOWER_ARGS], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    report = proc.stdout.readline()  # the stand-in's first line (everything outside its run's folder is read-only)
    try:
        deadline = time.monotonic() + 30
        while not marked():
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.1)
        home = Path(json.loads(report)["flwr_home"])
        assert home.parent.name.startswith("fedfilter-clientapp-") and home.parent.exists()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)  # the grace period (2 s here), then the namespace is killed
        time.sleep(0.5)
        assert marked() == []  # the daemon went with it
        assert not home.parent.exists()  # and its fresh folders
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in marked():
            os.kill(pid, signal.SIGKILL)


LINGER = (
    "import threading, time\n"
    "subprocess = __import__('subprocess')\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', "
    f"'{MARK}'], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL)\n"
    "threading.Thread(target=time.sleep, args=(120,)).start()  # non-daemon: it would keep the process\n"
    "os._exit = lambda status: None  # and Flower's own force-exit with it\n"
    "code = 0\n"
)


def test_a_clientapp_ends_with_its_task_whatever_threads_it_leaves(tmp_path: Path) -> None:
    """A hostile review kept a ClientApp alive after its task (a non-daemon thread, a patched os._exit) and
    planted code into the next run's folder from it. PID 1 now ends when the task returns, and the namespace
    with it: the daemon it forked is gone as soon as the shim returns."""
    shim = shim_with(tmp_path, LINGER)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(shim), *FLOWER_ARGS], start_new_session=True, timeout=60, check=False
        )
        assert done.returncode == 0 and time.monotonic() - started < 30
        time.sleep(0.5)
        assert marked() == []
    finally:
        for pid in marked():
            os.kill(pid, signal.SIGKILL)


def test_a_clientapp_that_never_returns_is_killed_after_its_time(tmp_path: Path) -> None:
    shim = shim_with(tmp_path, HOSTILE)
    env = {**os.environ, clientapp_sandbox.MAX_ENV: "2"}
    try:
        done = subprocess.run(
            [sys.executable, str(shim), *FLOWER_ARGS],
            start_new_session=True,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0 and "ran past 2 s (FEDFILTER_CLIENTAPP_MAX_SECONDS)" in done.stderr
        time.sleep(0.5)
        assert marked() == []
        bad = subprocess.run(
            [sys.executable, str(shim), *FLOWER_ARGS],
            env={**env, clientapp_sandbox.MAX_ENV: "inf"},
            capture_output=True,
            text=True,
        )
        assert bad.returncode == clientapp_sandbox.EX_CONFIG and "expected a number of seconds > 0" in bad.stderr
    finally:
        for pid in marked():
            os.kill(pid, signal.SIGKILL)


PROBE = (
    "import ctypes, json\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def call(rc):\n"
    "    return [rc, ctypes.get_errno() if rc != 0 else 0]\n"
    "seen = {'uid': os.getuid(), 'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}\n"
    "seen['files'] = {f: open(f).read() for f in ('/proc/stat', '/proc/uptime', '/proc/loadavg') }\n"
    "seen['sysinfo'] = call(libc.sysinfo(ctypes.create_string_buffer(256)))  # the host's load averages\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "perf = {'x86_64': 298, 'aarch64': 241, 'riscv64': 241, 'ppc64le': 319, 's390x': 331}[os.uname().machine]\n"
    "seen['perf'] = call(libc.syscall(perf, None, 0, -1, -1, 0))\n"
    "seen['more'] = {f: open(f).read() for f in ('/proc/timer_list', '/proc/sys/fs/file-nr') if os.path.exists(f)}\n"
    "seen['irq'] = os.listdir('/proc/irq')\n"
    "try:\n"
    "    seen['loadavg'] = list(os.getloadavg())\n"
    "except OSError:\n"
    "    seen['loadavg'] = 'unobtainable'\n"
    "seen['sys'] = os.listdir('/sys')\n"
    "seen['umount'] = call(libc.umount2(b'/proc/stat', 2))\n"
    "seen['ipc'] = os.readlink('/proc/self/ns/ipc')\n"
    "seen['dev'] = sorted(os.listdir('/dev'))\n"
    "seen['caps'] = [line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')][0]\n"
    "seen['umount_sys'] = call(libc.umount2(b'/proc/sys', 2))\n"
    "import signal, time\n"
    "os.kill(1, signal.SIGINT)  # the supervisor ignores it: the run goes on\n"
    "time.sleep(0.3)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    f"seen['keyring'] = libc.syscall({clientapp_sandbox.KEYCTL.get(__import__('platform').machine(), -1)}, 0, -3, 0)\n"
    "def write(path):\n"
    "    try:\n"
    "        open(path, 'w').write('planted')\n"
    "        return 'written'\n"
    "    except OSError as exc:\n"
    "        return exc.strerror\n"
    "seen['writes'] = {p: write(p) for p in ('/tmp/fedfilter-planted', '/dev/shm/fedfilter-planted', "
    "os.path.join(os.path.dirname(os.getcwd()), 'fedfilter-planted'))}\n"
    "seen['own'] = write('own-file')\n"
    "os.mkdir('probe')\n"
    "seen['nested'] = call(libc.unshare(0x10000000 | 0x00020000 | 0x40000000))  # user, mount, net\n"
    "seen['proc'] = call(libc.mount(b'proc', b'probe', b'proc', 0, None))\n"
    "seen['sysfs'] = call(libc.mount(b'sysfs', b'probe', b'sysfs', 0, None))\n"
    "seen['umount_nested'] = call(libc.umount2(b'/sys', 2))\n"
    "sys.stdout.write(json.dumps(seen))\n"
    "code = 0\n"
)


def _unprivileged_python() -> str | None:
    """An interpreter of this version that uid 65534 can run (this venv may be under root's home)."""
    wanted = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for folder in ("/usr/bin", "/usr/local/bin"):
        candidate = os.path.join(folder, wanted)
        if os.path.exists(candidate):
            probe = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", candidate, "-c", "pass"],
                capture_output=True,
                check=False,
            )
            if probe.returncode == 0:
                return candidate
    return None


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_inside_the_host_cpu_counters_are_masked_and_the_masks_stay(tmp_path: Path, user: str) -> None:
    """A hostile review read the agent's CPU time per request, to the microsecond, from its systemd cgroup's
    cpu.stat under /sys (world-readable) inside the sandbox: pacing hides wall time only (privacy.md §8)."""
    shim = shim_with(tmp_path, PROBE)
    command = [sys.executable, str(shim), *FLOWER_ARGS]
    if user == "unprivileged":
        python = _unprivileged_python() if os.geteuid() == 0 and shutil.which("setpriv") else None
        if python is None:
            cannot_run(f"needs root, setpriv and a python{sys.version_info[0]}.{sys.version_info[1]} uid 65534 can run")
        shared = Path(tempfile.mkdtemp(prefix="fedfilter-sandbox-test-"))  # pytest's folders are root's alone
        shared.chmod(0o755)
        shim = Path(shutil.copy(shim, shared / "shim.py"))
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, str(shim), *FLOWER_ARGS]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/", check=False)
    finally:
        if user == "unprivileged":
            shutil.rmtree(shim.parent, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["uid"] == (0 if user == "root" else 65534)
    assert seen["ipc"] != os.readlink("/proc/self/ns/ipc")  # System V and POSIX queues go with the namespace
    # PID 1 is the sandbox's supervisor (the ClientApp cannot signal or trace it), the ClientApp PID 2.
    assert seen["pids"] == [1, 2] and seen["sys"] == []
    assert seen["dev"] == ["full", "null", "random", "urandom", "zero"]
    # No capability, also as root (a root SuperNode's ClientApp lifted /proc/sys and read cpu.stat with them).
    assert int(seen["caps"], 16) == 0 and seen["umount_sys"][0] == -1
    assert seen["keyring"] > 0 and seen["keyring"] != _session_keyring()  # not the SuperNode's, which runs share
    assert seen["files"] == {"/proc/stat": "", "/proc/uptime": "", "/proc/loadavg": ""}
    # sysinfo(2) gave the host's load averages, which no mount masks: a seccomp filter refuses it (EPERM).
    assert seen["sysinfo"] == [-1, 1] and seen["loadavg"] == "unobtainable"
    assert seen["perf"] == [-1, 1]  # perf_event_open too (a host with perf_event_paranoid <= 0 shares counts)
    # A review read each CPU's idle time (timer_list, as root) and per-interrupt counts (irq/*/spurious).
    assert set(seen["more"].values()) == {""} and seen["irq"] == []
    assert seen["umount"][0] == -1 and seen["umount_nested"][0] == -1  # locked: never lifted
    # Writes go into the run's own folder (removed with it) and nowhere else: not /tmp, /dev/shm, another run's.
    assert seen["own"] == "written" and seen["writes"]["/tmp/fedfilter-planted"] == "Read-only file system"
    assert seen["writes"]["/dev/shm/fedfilter-planted"] == "No such file or directory"  # a /dev of its own
    assert set(seen["writes"].values()) <= {"Read-only file system", "No such file or directory"}
    assert not Path("/tmp/fedfilter-planted").exists()
    # No nested user namespace (from one, a review mounted a fresh cgroupfs and read cpu.stat), no fresh procfs
    # or sysfs: ENOSPC, the namespace's max_user_namespaces is 0.
    assert seen["nested"] == [-1, 28]
    assert seen["proc"][0] == -1 and seen["sysfs"][0] == -1


def _session_keyring() -> int:
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(clientapp_sandbox.KEYCTL[platform.machine()], 0, -3, 0))  # GET_KEYRING_ID, @s


LEFTOVERS = (
    "print(os.getcwd(), flush=True)\n"
    "deep = 'deep'\n"
    "for _ in range(1200):  # os.walk and rmtree recurse: RecursionError, folder left\n"
    "    os.mkdir(deep)\n"
    "    os.chdir(deep)\n"
    "os.chdir(os.environ['HOME'])\n"
    "os.makedirs('keep/inner')\n"
    "open('keep/inner/file', 'w').write('left')\n"
    "os.chmod('keep/inner', 0o000)\n"
    "os.chmod('keep', 0o500)\n"
    "node = os.open('/proc/self/fd/1', os.O_WRONLY)  # the node's log at offset 0, were it the node's own stdout\n"
    "os.write(node, b'OVERWRITTEN')\n"
    "os.close(node)\n"
    "code = 0\n"
)


def test_a_run_folder_its_clientapp_locked_is_removed_and_the_nodes_output_is_only_appended_to(
    tmp_path: Path,
) -> None:
    """A review: a 0500 folder left in the run's folder survived the wrapper's rmtree (the next run found it),
    and a ClientApp reopened the SuperNode's stdout through /proc/self/fd and rewrote the node's log."""
    shim = shim_with(tmp_path, LEFTOVERS)
    log = tmp_path / "node.log"
    log.write_text("the node's first line\n")
    with log.open("a") as out:
        done = subprocess.run(
            [sys.executable, str(shim), *FLOWER_ARGS], stdout=out, stderr=subprocess.PIPE, timeout=60, check=False
        )
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "the node's first line"  # appended to, through the wrapper's pipe, never rewritten
    run = Path(lines[1])
    assert run.name.startswith("fedfilter-clientapp-") and not run.exists()


# What a hostile ClientApp tries on the Runtime API (a review claimed a later run's task with AcquireTask, which
# takes no token in Flower 1.42's subprocess mode, on its own SuperNode and on another of the host's).
RELAY_PROBE = """\
import http.client, json, socket
args = sys.argv[1:]
host, port = args[args.index('--runtime-api-address') + 1].rsplit(':', 1)
token = args[args.index('--token') + 1]
def call(method, path, headers, body=b'', conn=None):
    c = conn or http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        c.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers:
            c.putheader(name, value)
        if not any(name.lower() == 'transfer-encoding' for name, _ in headers):
            c.putheader('Content-Length', str(len(body)))
        c.endheaders(body)
        r = c.getresponse()
        return [r.status, r.read().decode('latin-1')]
    except (OSError, http.client.HTTPException) as exc:
        return ['error', type(exc).__name__]
    finally:
        if conn is None:
            c.close()
mine = [('flwr-task-token', token), ('content-type', 'application/protobuf')]
seen = {'args': args}
seen['pull'] = call('POST', '/v1/runtime/pull-task-input', mine, bytes(range(256)) * 400)
kept = http.client.HTTPConnection(host, int(port), timeout=20)
seen['again'] = [call('POST', '/v1/runtime/send-task-heartbeat', mine, b'beat', kept) for _ in range(2)]
seen['acquire'] = call('POST', '/v1/runtime/acquire-task', [], b'')
seen['acquire_token'] = call('POST', '/v1/runtime/acquire-task', mine, b'')
seen['create'] = call('POST', '/v1/runtime/create-task', mine, b'')
seen['other_token'] = call('POST', '/v1/runtime/pull-task-input', [('flwr-task-token', 'f' * 64)], b'')
seen['no_token'] = call('POST', '/v1/runtime/pull-task-input', [], b'')
seen['two_tokens'] = call('POST', '/v1/runtime/pull-task-input', mine + [('flwr-task-token', 'f' * 64)], b'')
seen['get'] = call('GET', '/v1/runtime/pull-task-input', mine)
seen['dotted'] = call('POST', '/v1/runtime/pull-task-input/../acquire-task', mine, b'')
seen['chunked'] = call('POST', '/v1/runtime/pull-task-input', mine + [('Transfer-Encoding', 'chunked')])
def reach(port):
    try:
        socket.create_connection(('127.0.0.1', port), timeout=5).close()
        return 'connected'
    except OSError as exc:
        return type(exc).__name__
def raw(head):  # a request head as bytes, whatever http.client would refuse to send
    with socket.create_connection((host, int(port)), timeout=20) as c:
        c.sendall(head)
        got = b''
        while chunk := c.recv(65536):
            got += chunk
        return got.decode('latin-1')
hidden = 'POST /v1/runtime/acquire-task HTTP/1.1\\r\\nContent-Length: 0\\r\\n\\r\\n'
seen['raw'] = {
    'space_in_name': raw(('POST /v1/runtime/pull-task-input HTTP/1.1\\r\\nflwr-task-token: ' + token +
                          '\\r\\nX A: 1\\r\\nContent-Length: ' + str(len(hidden)) + '\\r\\n\\r\\n' + hidden).encode()),
    'bare_cr': raw(('POST /v1/runtime/pull-task-input HTTP/1.1\\r\\nflwr-task-token: ' + token +
                    '\\r\\nX-A: a\\rB: c\\r\\nContent-Length: 0\\r\\n\\r\\n').encode()),
    'nul': raw(('POST /v1/runtime/pull-task-input HTTP/1.1\\r\\nflwr-task-token: ' + token +
                '\\r\\nX-A: a\\x00b\\r\\nContent-Length: 0\\r\\n\\r\\n').encode()),
    'absolute': raw(('POST http://x/v1/runtime/pull-task-input HTTP/1.1\\r\\nflwr-task-token: ' + token +
                     '\\r\\nContent-Length: 0\\r\\n\\r\\n').encode()),
    'http2': raw(b'PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n'),
}
seen['flood'] = [call('POST', '/v1/runtime/acquire-task', [], b'')[0] for _ in range(30)]
seen['env'] = sorted(k for k in os.environ if k.startswith('FLWR_'))
seen['direct'] = reach(UPSTREAM)  # the SuperNode's own port, on the host's loopback
seen['interfaces'] = sorted(name for _, name in socket.if_nameindex())
sys.stdout.write(json.dumps(seen))
code = 0
"""


class _Upstream(http.server.BaseHTTPRequestHandler):
    """A stand-in for the SuperNode's Runtime API: records each call and answers with what it got."""

    protocol_version = "HTTP/1.1"
    calls: ClassVar[list[tuple[str, list[str], bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.calls.append((self.path, self.headers.get_all("flwr-task-token") or [], body))
        answer = b"got " + str(len(body)).encode() + b" " + body[:4]
        self.send_response(200)
        self.send_header("Content-Type", "application/protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *_: object) -> None:
        pass


def test_the_clientapp_reaches_only_its_own_tasks_calls_through_the_relay(tmp_path: Path) -> None:
    """A hostile review's ClientApp, kept alive past its reply, polled the SuperNode's Runtime API with
    AcquireTask (no token needed) and claimed a later run's task, also on another SuperNode's port. In a
    network namespace of its own it reaches only the relay, which passes its own task's calls with its token."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    _Upstream.calls = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    token = "0123456789abcdef" * 4
    try:
        shim = shim_with(tmp_path, f"UPSTREAM = {port}\n" + RELAY_PROBE)
        args = ["--runtime-api-address", f"127.0.0.1:{port}", "--token", token, "--insecure", "--flag-kept"]
        # A node's secrets in Flower's variables stay with the node (a review's ClientApp read them).
        env = {**os.environ, "FLWR_MODEL_API_KEY": "sk-node-secret", "FLWR_TELEMETRY_ENABLED": "0"}
        done = subprocess.run(
            [sys.executable, str(shim), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            check=False,
            env=env,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # Flower's arguments, the API at the relay (plain HTTP: the relay and the ClientApp share its loopback only).
    relay = f"127.0.0.1:{clientapp_sandbox.RELAY_PORT}"
    assert seen["args"] == ["--runtime-api-address", relay, "--insecure", "--token", token, "--flag-kept"]
    body = bytes(range(256)) * 400
    assert seen["pull"] == [200, "got 102400 " + body[:4].decode("latin-1")]
    assert seen["again"] == [[200, "got 4 beat"]] * 2  # one connection, kept alive
    forbidden = "fedfilter sandbox: "
    for name in ("acquire", "acquire_token", "create", "get", "dotted"):
        assert seen[name] == [403, forbidden + "not a call of this task's ClientApp\n"], name
    for name in ("other_token", "no_token", "two_tokens"):
        assert seen[name] == [403, forbidden + "not this task's token\n"], name
    assert seen["chunked"] == [411, forbidden + "expected a Content-Length body\n"]
    assert seen["direct"] == "ConnectionRefusedError"  # the host's loopback is not its loopback
    assert seen["interfaces"] == ["lo"]
    # What a lenient parser upstream could read as two requests, or no HTTP/1.1 at all: the connection ends, unsent
    # (a space in a name cut the relay's own Content-Length off a lenient server, the body read as a request).
    assert seen["raw"] == {name: "" for name in ("space_in_name", "bare_cr", "nul", "absolute", "http2")}
    assert "FLWR_MODEL_API_KEY" not in seen["env"] and "FLWR_TELEMETRY_ENABLED" in seen["env"]
    # The SuperNode got its three calls, each with its token, and nothing else.
    assert [(path, tokens) for path, tokens, _ in _Upstream.calls] == [
        ("/v1/runtime/pull-task-input", [token]),
        ("/v1/runtime/send-task-heartbeat", [token]),
        ("/v1/runtime/send-task-heartbeat", [token]),
    ]
    assert _Upstream.calls[0][2] == body
    # A flood of refusals (each one line of the node's log, which outlives the run): the first 20 are logged.
    assert seen["flood"] == [403] * 30
    assert done.stderr.count("refused a Runtime API call of the ClientApp") == clientapp_sandbox.RELAY_LOGGED
    assert done.stderr.count("20 refusals in this run: the further ones are not logged") == 1


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--runtime-api-address", "127.0.0.1:9094", "--insecure"], "expected the task's token as --token T"),
        (["--runtime-api-address", "127.0.0.1:9094", "--token-stdin"], "found --token-stdin"),
        (["--token", "ab", "--insecure"], "expected --runtime-api-address HOST:PORT, found none"),
        (["--runtime-api-address", "nowhere", "--token", "ab"], "expected HOST:PORT, found 'nowhere'"),
        (["--token"], "--token: expected a value, found none"),
    ],
)
def test_the_shim_refuses_arguments_it_cannot_relay(args: list[str], expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        clientapp_sandbox.Relay.for_args(args)


def test_the_relay_speaks_tls_to_the_api_when_the_supernode_named_its_certificates(tmp_path: Path) -> None:
    from simulations.deploy.certs import make_certificates

    certs = make_certificates(tmp_path / "certs")
    args = ["--runtime-api-address=[::1]:9094", f"--root-certificates={certs.ca_cert}", "--token", " ab ", "--x"]
    out, relay = clientapp_sandbox.Relay.for_args(args)
    assert out == [
        "--runtime-api-address",
        f"127.0.0.1:{clientapp_sandbox.RELAY_PORT}",
        "--insecure",
        "--token",
        "ab",
        "--x",
    ]
    assert relay.upstream == ("::1", 9094) and relay.token == b"ab" and relay.tls is not None
    assert relay.tls.verify_mode == ssl.CERT_REQUIRED and relay.tls.check_hostname
    assert (
        clientapp_sandbox.Relay.for_args(["--runtime-api-address", "h:1", "--token", "t", "--insecure"])[1].tls is None
    )


def test_every_task_command_but_the_clientapps_refuses_its_task(tmp_path: Path) -> None:
    """A hostile review's bundle declared an ``agentapp`` component, and the SuperNode started its code as Flower's
    own ``flwr-agentapp``, outside the sandbox. The shim's folder has every task command Flower's SuperExec
    starts (flwr.supercore.constant.TASK_TYPE_TO_COMMAND, read here so that a new one in Flower fails this test),
    and each one but ``flwr-clientapp`` refuses its task."""
    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND

    assert set(clientapp_sandbox.REFUSED_COMMANDS) == set(TASK_TYPE_TO_COMMAND.values()) - {"flwr-clientapp"}
    shim = clientapp_sandbox.write_shim(tmp_path / "bin", sys.executable)
    assert shim == tmp_path / "bin" / "flwr-clientapp"
    assert sorted(p.name for p in shim.parent.iterdir()) == sorted({*TASK_TYPE_TO_COMMAND.values()})
    for command in clientapp_sandbox.REFUSED_COMMANDS:
        args = [str(shim.parent / command), "--runtime-api-address", "127.0.0.1:9", "--token", "ab", "--insecure"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == clientapp_sandbox.EX_CONFIG
        assert done.stderr == (
            f"[fedfilter-clientapp] refusing a task of type {command}: this node runs ClientApps only, each in "
            "fedfilter's sandbox (docs/deploy.md section 9)\n"
        )


# systemd settings that mount over parts of /proc; under any of them the kernel refuses an unprivileged process a
# fresh /proc (mount_too_revealing: the existing one is not fully visible), so the sandbox cannot start.
PROC_OVERMOUNTS = ("ProtectKernelTunables", "ProtectKernelLogs", "ProtectProc", "ProcSubset")


def test_the_documented_supernode_unit_leaves_proc_whole_for_the_sandbox() -> None:
    """A review found the unit's ProtectKernelTunables=yes (/proc/sys read-only over the host's /proc) made every
    ClientApp exit 78: the sandbox's unshare --mount-proc failed. Below, that layout, reproduced."""
    unit = Path(clientapp_sandbox.__file__).parents[2] / "docs" / "systemd" / "flower-supernode@.service"
    settings = {line.split("=", 1)[0].strip() for line in unit.read_text().splitlines() if "=" in line[:40]}
    settings = {s for s in settings if not s.startswith("#")}
    assert "ExecStart" in settings and not settings & set(PROC_OVERMOUNTS)


def test_proc_mounted_over_keeps_the_sandbox_from_starting() -> None:
    """Why the unit leaves /proc whole: /proc/sys bound read-only over the host's /proc, as ProtectKernelTunables
    does, and the sandbox's namespaces cannot be made by an unprivileged user; without it they can."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
        cannot_run("needs root, setpriv and unshare to lay out /proc as systemd would")
    sandbox = "setpriv --reuid=65534 --regid=65534 --clear-groups unshare --user --map-root-user --pid --fork --mount "
    sandbox += "--mount-proc true"
    layouts = {"whole": sandbox, "overmounted": f"mount --bind -o ro /proc/sys /proc/sys && {sandbox}"}
    done = {
        name: subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        for name, command in layouts.items()
    }
    assert done["whole"].returncode == 0, done["whole"].stderr
    assert done["overmounted"].returncode != 0 and "mount /proc failed" in done["overmounted"].stderr


NOISY = (
    "sys.stdout.write('\\x1b[92mINFO \\x1b[0m: Start\\n\\x1b[2J\\x1b]0;title\\x07\\r\\x00fake\\n')\n"
    "sys.stdout.flush()\n"
    "sys.stderr.write('e' * 5000)\n"
    "sys.stderr.flush()\n"
    "code = 0\n"
)


def test_the_clientapps_output_reaches_the_nodes_log_bounded_and_without_terminal_controls(tmp_path: Path) -> None:
    """A review: a ClientApp's output, copied into the node's log without a limit, could fill the log's disk and
    write terminal controls into a log that outlives the run. Flower's colour codes pass; other controls are
    escaped; past FEDFILTER_CLIENTAPP_MAX_LOG_BYTES a stream is drained, not written."""
    shim = shim_with(tmp_path, NOISY)
    env = {**os.environ, clientapp_sandbox.LOG_ENV: "1000"}
    done = subprocess.run([sys.executable, str(shim), *FLOWER_ARGS], capture_output=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"\x1b[92mINFO \x1b[0m: Start\n\\x1b[2J\\x1b]0;title\\x07\\x0d\\x00fake\n"
    copied = done.stderr.split(b"\n[fedfilter-clientapp] the ClientApp's output passed 1000 bytes")
    assert len(copied) == 2 and copied[0].endswith(b"e" * 1000)
    assert done.stderr.count(b"e" * 10) == 100 and b"e" * 1001 not in done.stderr
    bad = subprocess.run(
        [sys.executable, str(shim), *FLOWER_ARGS],
        capture_output=True,
        text=True,
        env={**env, clientapp_sandbox.LOG_ENV: "lots"},
    )
    assert (
        bad.returncode == clientapp_sandbox.EX_CONFIG and "expected a whole number of bytes, found 'lots'" in bad.stderr
    )
