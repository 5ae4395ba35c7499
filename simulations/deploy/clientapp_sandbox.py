"""Run each ClientApp so that nothing it does outlives its run (docs/deploy.md §9, issue 25).

Flower's SuperNode starts every run's ClientApp as ``flwr-clientapp ...`` found on its PATH, as the
SuperNode's own user, with the SuperNode's ``FLWR_HOME``. The ClientApp's code comes from the run's
app bundle, which the coordinator ships; a hostile bundle could then

- plant code: Flower unpacks a bundle into ``FLWR_HOME/apps/<name>.<hash>`` and reuses that folder,
  unchecked, for every later run of the same bundle (lines appended to the genuine proxy ran in the
  next genuine runs), and Python runs any ``.pth`` file in the user's site folder at every start;
- leave a process: a daemon forked by the bundle outlived its run and its SuperNode, querying the
  agent every 10 s.

This file, installed as ``flwr-clientapp`` first on the SuperNode's PATH (``fedfilter node-shim DIR``
writes it; it imports the standard library only, so it runs from any interpreter that has Flower),
starts the real ``flwr-clientapp`` instead:

- with a fresh, private ``FLWR_HOME``, ``HOME``, ``TMPDIR`` and working folder per run, removed when
  the run ends: every run unpacks its bundle afresh from the bytes the SuperLink sent, whose hashes
  Flower checks, so no earlier run's writes are ever loaded; Python runs isolated (``-I``: no user
  site folder, no ``PYTHON*`` variables);
- as PID 1 of a new PID namespace (``unshare --user --map-root-user --pid --fork --kill-child``,
  unprivileged): when it exits, or this wrapper dies, the kernel kills every process it left, so no
  process started by a ClientApp outlives its run. Processes in it cannot trace the SuperNode. PID 1
  ends the moment Flower's task returns (its thread may not keep it: a hostile review kept a ClientApp,
  and a process that planted code into the next run's folder, alive with a non-daemon thread and a
  patched ``os._exit``), and this wrapper kills the namespace after ``FEDFILTER_CLIENTAPP_MAX_SECONDS``
  (default 3600) whatever the ClientApp does: one task is one message, answered in seconds;
- on a read-only view of every mount but the run's folder (and its own ``/proc``): what a ClientApp
  writes goes into the run's folder, removed when the run ends, never into another run's (the review
  planted code into one) or the node's files, ``/tmp`` or ``/dev/shm``;
- with the host's CPU accounting out of sight (its own ``/proc``, an empty ``/sys``, and ``/proc/stat``,
  ``uptime``, ``loadavg``, ``pressure``, ``interrupts``, ``softirqs``, ``schedstat``, ``vmstat`` and
  ``diskstats`` masked): a hostile review read the agent's CPU time per request, to the microsecond,
  from its systemd cgroup's ``cpu.stat`` (world-readable), which reply pacing does not hide
  (privacy.md §8). The masks are mounted as root of an outer user namespace; the ClientApp then runs
  in an inner one, as this user's uid without capabilities, where the masks are locked (it cannot
  unmount them) and, procfs and sysfs being no longer fully visible, the kernel refuses it a fresh
  mount of either.

- in a network namespace of its own, a loopback and nothing else: a hostile review's ClientApp claimed a later
  run's task through the SuperNode's Runtime API (``AcquireTask`` needs no token in Flower 1.42's subprocess
  isolation), on its own SuperNode and on another of the host. It reaches its own SuperNode's API only
  through this wrapper's :class:`Relay`, on a listener PID 1 binds on its loopback and hands over: the relay
  passes its own task's calls with its own task's token and refuses every other (privacy.md §10).

Where user namespaces are off (``sysctl user.max_user_namespaces=0``), it refuses to start the
ClientApp (exit 78) and says so, unless ``FEDFILTER_CLIENTAPP_ISOLATION=none`` is set: then only the
fresh folders protect the next run, and the operator must contain processes otherwise (docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, TextIO

ISOLATION_ENV = "FEDFILTER_CLIENTAPP_ISOLATION"
# After SIGTERM or SIGINT (or the SuperNode's death), the ClientApp has this long to exit; then the
# whole namespace is killed (a bundle's handler could ignore the signal and never return).
GRACE_S = 10.0
EX_CONFIG = 78  # sysexits.h: a configuration error
# A mount namespace with its own /proc: with the host's /proc a bundle read the agent worker's CPU time
# (/proc/<pid>/task/<tid>/schedstat, readable by any uid), which reply pacing does not hide (privacy.md §8).
# Root of its user namespace (mapped to this user), so that SETUP can mount the masks before the ClientApp.
# Its own IPC namespace too: System V shared memory, semaphores and message queues, and POSIX message queues,
# live in it and go with it (on the host's they would outlive the run).
# And its own host and domain names (a ClientApp that set the host's would change them for the host).
# And a network namespace of its own (only its loopback): a hostile review's ClientApp claimed a later run's
# task through the SuperNode's Runtime API (``AcquireTask`` takes no token in Flower 1.42's subprocess mode), on
# its own SuperNode and on others of the host. It reaches that API only through this wrapper's relay
# (:class:`Relay`), which passes the calls that carry its own task's token and refuses every other.
UNSHARE = (
    "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc", "--uts",
    "--net",
)  # fmt: skip
# Host-wide counters in the namespace's own /proc that tell the CPU time others spend (on a dedicated cpuset,
# the agent's): masked with /dev/null (files) or an empty read-only tmpfs (folders), with all of /sys.
# A review found /proc/timer_list (each CPU's idle and iowait time in ns, to a root node's ClientApp) and
# /proc/irq/*/spurious (per-interrupt counts, to any uid) open; sched_debug and timer_stats on older kernels.
MASKED_PROC = (
    "stat", "uptime", "loadavg", "pressure", "interrupts", "softirqs", "schedstat", "vmstat", "diskstats",
    "zoneinfo", "sysrq-trigger", "timer_list", "sched_debug", "timer_stats", "irq", "sys/fs/file-nr",
)  # fmt: skip
# keyctl(2)'s number where the libc has no wrapper for it (keyutils is not the standard library).
KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 311, "s390x": 280}
# sysinfo(2) gives the host's load averages and process count, which no mount masks (the CPU time others
# spend, in minutes-long averages), and perf_event_open(2) counts events a permissive host
# (perf_event_paranoid <= 0) shares: a seccomp filter makes both fail with EPERM in the ClientApp. The
# system-call ABIs a process of the supported machines can use, (AUDIT_ARCH_*, the two numbers), x32's with its
# bit; any other ABI fails every call with ENOSYS (a ClientApp may run its own binary, e.g. a static 32-bit
# one, and an ABI left out would get around the filter).
DENIED = (
    (0xC000003E, (99, 298, 0x40000000 | 99, 0x40000000 | 298)),  # x86_64, x32
    (0x40000003, (116, 336)),  # i386
    (0xC00000B7, (179, 241)),  # aarch64
    (0x40000028, (116, 364)),  # arm
    (0xC00000F3, (179, 241)),  # riscv64
    (0x400000F3, (179, 241)),  # riscv32
    (0xC0000015, (116, 319)),  # ppc64le
    (0x00000014, (116, 319)),  # ppc32
    (0x80000016, (116, 331)),  # s390x
    (0x00000016, (116, 331)),  # s390 (31-bit)
)


def seccomp_program(denied: tuple[tuple[int, tuple[int, ...]], ...]) -> list[tuple[int, int, int, int]]:
    """Classic BPF over struct seccomp_data (nr at offset 0, arch at 4): a listed ABI's listed numbers return
    ERRNO(EPERM), its other calls ALLOW, and a call of an unlisted ABI ERRNO(ENOSYS). (code, jt, jf, k) rows."""
    code = [(0x20, 0, 0, 4)]  # ld arch
    for arch, numbers in denied:
        code += [(0x15, 0, len(numbers) + 2, arch), (0x20, 0, 0, 0)]  # jeq arch, else the next ABI; ld nr
        code += [(0x15, -1, 0, nr) for nr in numbers]  # jeq nr: to EPERM
        code += [(0x05, 0, 0, -2)]  # ja: to ALLOW
    code += [(0x06, 0, 0, 0x00050000 | 38), (0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, 0x00050000 | 1)]
    last = len(code) - 1  # ERRNO(ENOSYS) (an unlisted ABI), ALLOW, ERRNO(EPERM)
    return [
        (c, last - (i + 1) if jt == -1 else jt, jf, last - 1 - (i + 1) if c == 0x05 else k)
        for i, (c, jt, jf, k) in enumerate(code)
    ]


# The Runtime API as the ClientApp sees it: this port of its namespace's loopback (nothing else listens there),
# where the wrapper relays (:class:`Relay`) the calls Flower's ClientApp makes for its task (flwr 1.42,
# flwr/supernode/runtime/run_clientapp.py, supercore/logger.py and task_process/usage.py), each of which the
# SuperNode binds to the caller's task by its token header, and only with this run's token: ``AcquireTask``
# (which takes none) and every other call are refused with 403, unsent.
RELAY_PORT = 9094
TOKEN_HEADER = "flwr-task-token"  # flwr.supercore.constant.TASK_TOKEN_HEADER
RELAYED = frozenset(
    "/v1/runtime/" + name
    for name in (
        "send-task-heartbeat", "pull-task-input", "push-task-output", "push-object", "pull-object",
        "confirm-message-received", "pull-messages", "push-messages", "push-logs", "record-task-usage",
    )
)  # fmt: skip
RELAY_CONNECTIONS = 32  # at once; a further connection is closed unread
RELAY_LOGGED = 20  # refusals logged a run (each one line of the node's log, which outlives the run)
RELAY_TIMEOUT_S = 300.0  # per read or write, both ways (a pull of a large object is one response)
# Hop-by-hop headers (RFC 9110 §7.6.1): the relay's own on each side, never passed on.
HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
     "proxy-authenticate", "proxy-authorization", "content-length"),
)  # fmt: skip
MAX_ENV = "FEDFILTER_CLIENTAPP_MAX_SECONDS"
MAX_S = 3600.0  # one task (one message): then the namespace is killed, whatever the ClientApp does
# In the namespace, as its root: the masks, then PID 1 stays a supervisor (init of the PID namespace, in the
# outer user namespace: the ClientApp can neither signal nor trace it, so it keeps unshare's parent-death
# signal and ends the namespace whenever unshare or the ClientApp ends; a review's ClientApp, itself PID 1,
# cleared that signal, killed unshare and outlived its run); its child enters an inner user namespace in
# which this user's uid is the ClientApp's (no capabilities, every inherited mount locked, no nested user
# or cgroup namespace: from one a fresh cgroupfs showed cpu.stat again; /proc/sys read-only; a session
# keyring of its own, not the SuperNode's, which runs share), then RUN in a fresh interpreter.
SETUP = """\
import ctypes, os, platform, re, sys
libc = ctypes.CDLL(None, use_errno=True)
def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        sys.stderr.write(f"[fedfilter-clientapp] {what}: {os.strerror(e)}; not starting the ClientApp\\n")
        os._exit(78)
RO = 1 | 2 | 4 | 8  # MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
check(libc.mount(b"none", b"/sys", b"tmpfs", RO, b"size=4k,mode=555"), "masking /sys")
for name in MASKED:
    path = "/proc/" + name
    if os.path.isdir(path):
        check(libc.mount(b"none", path.encode(), b"tmpfs", RO, b"size=4k,mode=555"), "masking " + path)
    elif os.path.exists(path):
        check(libc.mount(b"/dev/null", path.encode(), None, 4096, None), "masking " + path)  # MS_BIND
# A /dev of its own: the harmless character devices only (a ClientApp of a SuperNode run as root is root on
# the host's device nodes otherwise).
devices = {name: os.open("/dev/" + name, os.O_PATH) for name in ("null", "zero", "full", "random", "urandom")}
check(libc.mount(b"none", b"/dev", b"tmpfs", 2 | 8, b"size=4k,mode=755"), "a /dev of its own")  # nosuid, noexec
for name, fd in devices.items():
    open("/dev/" + name, "w").close()
    check(libc.mount(f"/proc/self/fd/{fd}".encode(), ("/dev/" + name).encode(), None, 4096, None), "/dev/" + name)
    os.close(fd)
# Every mount read-only but the run's folder (bound onto itself first) and /proc: whatever the ClientApp
# writes goes into the run's folder, which the wrapper removes, and never into another run's or the node's.
run = os.getcwd()
check(libc.mount(run.encode(), run.encode(), None, 4096, None), "binding the run's folder")  # MS_BIND
os.chdir(run)  # through the new mount: the working folder held the old one, which becomes read-only
ATIME = {"noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
KEPT = {"nosuid": 2, "nodev": 4, "noexec": 8, **ATIME}  # a remount must keep a locked mount's flags
with open("/proc/self/mountinfo") as handle:
    mounts = [(line.split()[4], line.split()[5].split(",")) for line in handle]
for point, options in mounts:
    point = re.sub(r"\\\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)  # a space is \\040 there
    if point == run or point.split("/")[1] in ("proc", "sys") or not os.path.lexists(point):
        continue  # the run's folder, /proc (its masks are /dev/null), /sys (masked whole) and hidden mounts
    flags = 32 | 4096 | 1  # MS_REMOUNT | MS_BIND | MS_RDONLY
    if not point.startswith("/dev/"):
        flags |= 4  # MS_NODEV: device nodes only the five of its /dev
    for option in options:
        flags |= KEPT.get(option, 0)
    if not any(option in ATIME for option in options):
        flags |= 1 << 24  # MS_STRICTATIME
    check(libc.mount(None, point.encode(), None, flags, None), "making " + point + " read-only")
# Its network namespace has a loopback only, down until brought up here (as its root); then the relay's listener:
# bound here, on the namespace's loopback, handed to the wrapper (outside, where it accepts and relays) over
# the channel it passed, and closed here before the ClientApp starts (the ClientApp never holds it).
import fcntl, socket, struct
try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        ifreq = fcntl.ioctl(probe, 0x8913, struct.pack("16sH22x", b"lo", 0))  # SIOCGIFFLAGS
        fcntl.ioctl(probe, 0x8914, struct.pack("16sH22x", b"lo", struct.unpack("16sH22x", ifreq)[1] | 1))  # IFF_UP
    if int(sys.argv[3]) >= 0:
        with socket.socket(fileno=int(sys.argv[3])) as channel, socket.socket() as listener:
            listener.bind(("127.0.0.1", RELAY_PORT))
            listener.listen(64)
            socket.send_fds(channel, [b"listening"], [listener.fileno()])
except OSError as exc:
    sys.stderr.write(f"[fedfilter-clientapp] its network namespace (loopback, relay): {exc}; not starting it\\n")
    os._exit(78)
keyctl = KEYCTL.get(platform.machine())
if keyctl is None:
    sys.stderr.write(f"[fedfilter-clientapp] no keyctl number known for {platform.machine()}; not starting it\\n")
    os._exit(78)
child = os.fork()
if child:  # PID 1: wait for the ClientApp, then end the namespace with its code
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # init ignores what it leaves at default (Python's SIGINT raised)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
uid, gid = sys.argv[1], sys.argv[2]
check(libc.unshare(0x10000000 | 0x00020000), "a user and mount namespace for the ClientApp")
for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} 0 1"), ("gid_map", f"{gid} 0 1")):
    with open("/proc/self/" + name, "w") as handle:
        handle.write(text)
for name in ("max_user_namespaces", "max_cgroup_namespaces"):
    with open("/proc/sys/user/" + name, "w") as handle:
        handle.write("0")
check(libc.mount(b"/proc/sys", b"/proc/sys", None, 4096 | 16384, None), "binding /proc/sys")  # MS_BIND | MS_REC
check(libc.mount(None, b"/proc/sys", None, 32 | 4096 | RO, None), "making /proc/sys read-only")
libc.syscall.restype = ctypes.c_long
check(0 if libc.syscall(keyctl, 1, None) >= 0 else -1, "a session keyring of its own")  # JOIN_SESSION_KEYRING
# No capability survives the exec, also for uid 0 (a root SuperNode's: with them it lifted /proc/sys, raised
# the namespace limits and read cpu.stat from a fresh cgroupfs): an empty bounding set, and no new privileges.
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last capability)
kept = [cap for cap in range(64) if libc.prctl(23, cap, 0, 0, 0) == 1]  # PR_CAPBSET_READ: 1 while still there
check(-1 if kept else 0, f"dropping every capability (still bounded: {kept})")
check(libc.prctl(38, 1, 0, 0, 0), "no new privileges")  # PR_SET_NO_NEW_PRIVS
# The seccomp filter (seccomp_program's rows): sysinfo and perf_event_open fail with EPERM, other ABIs ENOSYS.
class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]
filters = (Filter * len(SECCOMP))(*[Filter(*row) for row in SECCOMP])
program = Program(len(SECCOMP), filters)
check(libc.prctl(22, 2, ctypes.byref(program), 0, 0), "a seccomp filter")  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
os.execv(sys.executable, [sys.executable, "-I", "-c", RUN, *sys.argv[4:]])
"""
# What a ClientApp runs: Flower's entry point, then the ClientApp's process ends at once (threads the bundle
# left cannot keep it), and the supervisor PID 1 ends the namespace with it.
FLOWER_CALL = "from flwr.supernode.cli import flwr_clientapp\nsys.argv[0] = 'flwr-clientapp'\ncode = flwr_clientapp()"
# What the ClientApp keeps of the SuperNode's environment (Flower's own variables are kept too).
KEEP = ("PATH", "LANG", "LC_ALL", "TZ", "SSL_CERT_FILE", "SSL_CERT_DIR")
# Flower's variables a ClientApp may see: its switches, never a secret of the node's (a hostile review read the
# node's FLWR_MODEL_API_KEY and Slack secret from a ClientApp's environment, which it could reply with).
KEEP_FLWR = (
    "FLWR_TELEMETRY_ENABLED", "FLWR_TELEMETRY_LOGGING", "FLWR_DISABLE_UPDATE_CHECK", "FLWR_LOG_LEVEL",
    "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS",
    "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES",
)  # fmt: skip
# Every other command Flower 1.42's SuperExec starts for a task (flwr.supercore.constant.TASK_TYPE_TO_COMMAND): a
# fedfilter node runs ClientApps only. A hostile review's bundle declared an ``agentapp`` component, and its
# SuperNode started the bundle's code as ``flwr-agentapp`` (Flower's own, next on the PATH) outside any sandbox:
# in the host's namespaces, with the node's FLWR_HOME, AcquireTask on every SuperNode of the host, daemons that
# outlived the run. :func:`write_shim` puts one of these beside the shim, each refusing its task.
REFUSED_COMMANDS = ("flwr-agentapp", "flwr-serverapp", "flwr-simulation", "flwr-model", "flwr-connector")
REFUSAL = """import sys
sys.stderr.write("[fedfilter-clientapp] refusing a task of type %s: this node runs ClientApps only, each in "
                 "fedfilter's sandbox (docs/deploy.md section 9)\\n" % sys.argv[0].rsplit("/", 1)[-1][:40])
raise SystemExit(78)
"""


def run_program(call: str) -> str:
    """``call`` (Python that sets ``code``), then the process ends with that code by ``os._exit`` taken before
    ``call`` ran: no thread, ``atexit`` handler or patched ``os._exit`` of the bundle's keeps it alive (and
    whatever does, the wrapper's ``MAX_S`` ends)."""
    body = "\n".join("    " + line for line in call.splitlines())
    return (
        "import os, sys\n_exit = os._exit\ncode = 1\ntry:\n" + body + "\n"
        "except SystemExit as stop:\n    code = stop.code\n"
        "except BaseException:\n    import traceback\n    traceback.print_exc()\n    code = 1\n"
        "for stream in (sys.stdout, sys.stderr):\n    try:\n        stream.flush()\n    except BaseException:\n"
        "        pass\n"
        "_exit(code if isinstance(code, int) else (0 if code is None else 1))\n"
    )


def sandboxed(run: str) -> str:
    """SETUP with RUN = ``run``: the program the namespace's PID 1 runs (argv: uid, gid, the relay channel's
    descriptor or -1 for none, then Flower's)."""
    head = f"MASKED = {MASKED_PROC!r}\nKEYCTL = {KEYCTL!r}\nSECCOMP = {seccomp_program(DENIED)!r}\n"
    head += f"RELAY_PORT = {RELAY_PORT!r}\n"
    return head + f"RUN = {run!r}\n" + SETUP


def _log(text: str) -> None:
    print(f"[fedfilter-clientapp] {text}", file=sys.stderr, flush=True)


def _split_parent(argv: list[str]) -> tuple[list[str], int | None]:
    """``--parent-pid N`` names a PID of the outer namespace: the wrapper watches it, not the ClientApp."""
    out, parent, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--parent-pid" and i + 1 < len(argv):
            parent = int(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--parent-pid="):
            parent = int(argv[i].split("=", 1)[1])
        else:
            out.append(argv[i])
        i += 1
    return out, parent


def namespaces_work(unshare: str) -> str | None:
    """None when the sandbox (PID namespace, masks, inner user namespace) can be made here, else why not."""
    program = sandboxed(run_program("code = 0"))
    argv = [unshare, *UNSHARE, sys.executable, "-I", "-c", program, str(os.getuid()), str(os.getgid()), "-1"]
    folder = tempfile.mkdtemp(prefix="fedfilter-clientapp-probe-")  # a run's folder, as SETUP binds it
    try:
        probe = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, cwd=folder)
    except OSError as exc:
        return f"{unshare}: {exc}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return None if probe.returncode == 0 else (probe.stderr.strip() or f"exit code {probe.returncode}")


class Relay:
    """The ClientApp's only way to its SuperNode's Runtime API: an HTTP/1.1 relay, run by the wrapper outside the
    ClientApp's namespaces, on the listener PID 1 bound on the namespace's loopback (the ClientApp cannot reach
    the host's loopback, so neither its own SuperNode's API nor any other of the host's).

    A request is passed on only if it is a ``POST`` of one of :data:`RELAYED` with one :data:`TOKEN_HEADER` equal
    to the token the SuperNode gave this run (compared in constant time) and a ``Content-Length`` body; anything
    else gets 403 (411 for a body of another framing) with fixed text, and a line in the node's log with its
    method and path bounded; what is no HTTP/1.1 request head (over 64 KiB or 100 headers included) ends the
    connection. The response, status and end-to-end headers, is passed back as it comes."""

    def __init__(self, upstream: tuple[str, int], token: str, tls: ssl.SSLContext | None) -> None:
        self.upstream, self.token, self.tls = upstream, token.encode(), tls
        self.slots = threading.BoundedSemaphore(RELAY_CONNECTIONS)
        self.listener: socket.socket | None = None
        self.closed = threading.Event()
        self.refused = 0  # refusals so far; the first RELAY_LOGGED are logged (a flood would fill the node's log)
        self.lock = threading.Lock()

    @staticmethod
    def for_args(args: list[str]) -> tuple[list[str], Relay]:
        """Flower's ``flwr-clientapp`` arguments as the SuperNode gave them -> those the ClientApp gets (the
        Runtime API at the relay's port, in plain HTTP: the relay and the ClientApp share no network but its
        namespace's loopback) and the relay to the API they named. ValueError says what is missing."""
        out: list[str] = []
        named: dict[str, str] = {}
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            name, eq, inline = arg.partition("=")
            if name in ("--token-file", "--token-stdin"):
                raise ValueError(
                    f"expected the task's token as --token T (as Flower's SuperNode passes it), found {name}"
                )
            if name == "--insecure":
                named[name] = ""
            elif name in ("--runtime-api-address", "--token", "--root-certificates"):
                if not eq and i >= len(args):
                    raise ValueError(f"{name}: expected a value, found none")
                named[name] = inline if eq else args[i]
                i += 0 if eq else 1
            else:
                out.append(arg)
        address, token, certificates = (
            named.get(k) for k in ("--runtime-api-address", "--token", "--root-certificates")
        )
        insecure = "--insecure" in named
        if not token or not token.strip():
            raise ValueError("expected the task's token as --token T, found none")
        if not address:
            raise ValueError("expected --runtime-api-address HOST:PORT, found none")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--runtime-api-address: expected HOST:PORT, found {address[:100]!r}")
        tls = None
        if not insecure:
            tls = ssl.create_default_context(cafile=certificates)
        out = ["--runtime-api-address", f"127.0.0.1:{RELAY_PORT}", "--insecure", "--token", token.strip(), *out]
        return out, Relay((host.strip("[]"), int(port)), token.strip(), tls)

    def receive(self, channel: socket.socket, timeout: float) -> bool:
        """Take the listener PID 1 sends over ``channel``; False if none came (PID 1 failed or ``timeout``)."""
        channel.settimeout(timeout)
        try:
            _, fds, _, _ = socket.recv_fds(channel, 16, 1)
        except OSError:
            return False
        if len(fds) != 1:
            return False
        self.listener = socket.socket(fileno=fds[0])
        threading.Thread(target=self.serve, daemon=True, name="fedfilter-relay").start()
        return True

    def close(self) -> None:
        self.closed.set()
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()

    def serve(self) -> None:
        assert self.listener is not None
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed: the run ended
            if not self.slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self.connection, args=(conn,), daemon=True).start()

    def connection(self, conn: socket.socket) -> None:
        import http.client

        try:
            conn.settimeout(RELAY_TIMEOUT_S)
            reader = conn.makefile("rb")
            while not self.closed.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                method, path, headers = head
                refusal = self.refusal(method, path, headers)
                if refusal is not None:
                    self.log_refusal(f"{method[:16]!r} {path[:100]!r} ({refusal[1]})")
                    conn.sendall(_response(*refusal))
                    return
                length = int(headers["content-length"][0])
                host, port = self.upstream
                if self.tls is None:
                    upstream = http.client.HTTPConnection(host, port, timeout=RELAY_TIMEOUT_S)
                else:
                    upstream = http.client.HTTPSConnection(host, port, timeout=RELAY_TIMEOUT_S, context=self.tls)
                try:
                    upstream.putrequest("POST", path, skip_accept_encoding=True)
                    for name, values in headers.items():
                        if name not in HOP_BY_HOP:
                            for value in values:
                                upstream.putheader(name, value)
                    upstream.putheader("Content-Length", str(length))
                    upstream.endheaders()
                    _copy_exactly(reader, upstream.send, length)
                    answer = upstream.getresponse()
                    status = f"HTTP/1.1 {answer.status} {answer.reason}\r\n"
                    lines = [f"{k}: {v}\r\n" for k, v in answer.getheaders() if k.lower() not in HOP_BY_HOP]
                    size = (answer.getheader("Content-Length") or "").strip()
                    chunked = not size.isdigit()
                    lines.append("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {int(size)}\r\n")
                    conn.sendall((status + "".join(lines) + "\r\n").encode("latin-1"))
                    while chunk := answer.read1(65536):
                        conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                    if chunked:
                        conn.sendall(b"0\r\n\r\n")
                finally:
                    upstream.close()
        except (OSError, ValueError, http.client.HTTPException):
            return  # either side went away, or spoke no HTTP/1.1: this connection ends
        finally:
            conn.close()
            self.slots.release()

    def log_refusal(self, what: str) -> None:
        with self.lock:
            self.refused += 1
            count = self.refused
        if count <= RELAY_LOGGED:
            _log(f"refused a Runtime API call of the ClientApp: {what}")
        if count == RELAY_LOGGED:
            _log(f"{RELAY_LOGGED} refusals in this run: the further ones are not logged")

    def refusal(self, method: str, path: str, headers: dict[str, list[str]]) -> tuple[int, str] | None:
        """Why a request is not passed on, as (status, fixed text); None to pass it on."""
        if method != "POST" or path not in RELAYED:
            return 403, "not a call of this task's ClientApp"
        tokens = headers.get(TOKEN_HEADER, [])
        if len(tokens) != 1 or not hmac.compare_digest(tokens[0].strip().encode(), self.token):
            return 403, "not this task's token"
        if "transfer-encoding" in headers:
            return 411, "expected a Content-Length body"
        sizes = headers.get("content-length", [])
        if len(sizes) != 1 or not sizes[0].strip().isdigit():
            return 411, "expected a Content-Length body"
        return None


# RFC 9110 §5.1 and §5.5: a field name is a token; a value holds visible characters, spaces and tabs (obs-text
# kept), never CR, LF, NUL or another control (a lenient upstream would read a bare CR or a space in a name as
# the end of a header, and the body after it as the next request).
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(r"/[\x21-\x7e]*")


def _read_head(reader: IO[bytes]) -> tuple[str, str, dict[str, list[str]]] | None:
    """One HTTP/1.1 request line and its headers (names lower-cased); None at the end of the connection.
    ValueError for what is no HTTP/1.1 request head, or one over 64 KiB or 100 headers."""
    line = reader.readline(65537)
    if not line:
        return None
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise ValueError("not an HTTP/1.1 request line")
    if parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise ValueError("not an HTTP/1.1 request line")
    headers: dict[str, list[str]] = {}
    total = len(line)
    for _ in range(101):
        line = reader.readline(65537)
        total += len(line)
        if total > 65536 or not line.endswith(b"\n"):
            raise ValueError("request head too long or cut")
        if line in (b"\r\n", b"\n"):
            return parts[0], parts[1], headers
        name, colon, value = line.decode("latin-1").rstrip("\r\n").partition(":")
        value = value.strip(" \t")
        if not colon or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise ValueError("malformed header")
        headers.setdefault(name.lower(), []).append(value)
    raise ValueError("too many headers")


def _copy_exactly(reader: IO[bytes], send: object, length: int) -> None:
    while length > 0:
        chunk = reader.read(min(length, 65536))
        if not chunk:
            raise ValueError("request body cut")
        send(chunk)  # type: ignore[operator]
        length -= len(chunk)


def _response(status: int, text: str) -> bytes:
    reason = {403: "Forbidden", 411: "Length Required"}[status]
    body = f"fedfilter sandbox: {text}\n".encode()
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode("latin-1") + body


def main(argv: list[str] | None = None) -> int:
    args, parent = _split_parent(list(sys.argv[1:] if argv is None else argv))
    mode = os.environ.get(ISOLATION_ENV, "pidns")
    if mode not in ("pidns", "none"):
        _log(f"{ISOLATION_ENV}: expected 'pidns' (default) or 'none', found {mode!r}; not starting the ClientApp")
        return EX_CONFIG
    try:
        limit = float(os.environ.get(MAX_ENV, MAX_S))
    except ValueError:
        limit = -1.0
    if not 0 < limit < float("inf"):
        _log(f"{MAX_ENV}: expected a number of seconds > 0, found {os.environ.get(MAX_ENV)!r}; not starting it")
        return EX_CONFIG
    log_limit = os.environ.get(LOG_ENV, str(MAX_LOG_BYTES)).strip()
    if not log_limit.isdigit() or len(log_limit) > 15:
        _log(
            f"{LOG_ENV}: expected a whole number of bytes, found {os.environ.get(LOG_ENV, '')[:40]!r}; not starting it"
        )
        return EX_CONFIG
    if os.geteuid() == 0:
        _log(
            "warning: the SuperNode runs as root, so its ClientApps are root on every root-owned file they can "
            "read (the sandbox keeps them read-only); run each SuperNode as a user of its own (docs/deploy.md §9)"
        )
    run = run_program(FLOWER_CALL)
    command = [sys.executable, "-I", "-c", run, *args]
    relay: Relay | None = None
    if mode == "pidns":
        unshare = shutil.which("unshare", path=os.environ.get("PATH", os.defpath)) or "unshare"
        why = namespaces_work(unshare)
        if why is not None:
            _log(
                f"cannot start the ClientApp in a PID namespace of its own ({why}); a process it starts could "
                f"outlive its run. Enable user namespaces, or set {ISOLATION_ENV}=none and contain the "
                "SuperNode's processes otherwise (docs/deploy.md §9)"
            )
            return EX_CONFIG
        try:
            args, relay = Relay.for_args(args)
        except (ValueError, OSError) as exc:  # OSError: the named root certificates cannot be read
            _log(f"{exc}; not starting the ClientApp")
            return EX_CONFIG
        channel, theirs = socket.socketpair()
        command = [unshare, *UNSHARE, sys.executable, "-I", "-c", sandboxed(run), str(os.getuid()), str(os.getgid())]
        command += [str(theirs.fileno()), *args]
    run_dir = Path(tempfile.mkdtemp(prefix="fedfilter-clientapp-"))  # 0700, this user's
    (run_dir / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k in KEEP or k in KEEP_FLWR}
    env |= {"FLWR_HOME": str(run_dir / "flwr"), "HOME": str(run_dir), "TMPDIR": str(run_dir / "tmp")}
    env |= {"PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=run_dir,
        start_new_session=True,  # one process group: a signal reaches unshare and the ClientApp
        preexec_fn=_die_with_parent,  # this wrapper killed: unshare dies, and --kill-child takes the rest
        # Pipes, copied on by this wrapper: the SuperNode's own stdout and stderr (its log files) reopened by
        # /proc/self/fd went around the read-only view, and a review's ClientApp rewrote the node's log.
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(theirs.fileno(),) if relay is not None else (),
    )
    copies = [
        threading.Thread(target=_copy, args=(source, sink, int(log_limit)), daemon=True)
        for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
    ]
    for copy in copies:
        copy.start()
    if relay is not None:
        theirs.close()
        if not relay.receive(channel, timeout=min(limit, 60.0)):
            channel.close()
            if proc.poll() is None:
                _log("the sandbox did not hand over the Runtime API relay's listener; killing its namespace")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
            for copy in copies:
                copy.join(timeout=GRACE_S)
            _remove(run_dir)
            return code or EX_CONFIG
        channel.close()

    def kill_later() -> None:
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            _log(f"the ClientApp did not exit within {GRACE_S:.0f} s of a stop signal; killing its namespace")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # unshare dies, and --kill-child takes PID 1 and the rest

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        threading.Thread(target=kill_later, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    if parent is not None:

        def watch() -> None:  # Flower's own parent monitor, from outside the namespace
            while proc.poll() is None:
                if not _alive(parent):
                    forward(signal.SIGINT, None)
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()
    try:
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _log(f"the ClientApp ran past {limit:.0f} s ({MAX_ENV}); killing its namespace")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # unshare dies, and --kill-child takes PID 1 and the rest
            return proc.wait()
    finally:
        if relay is not None:
            relay.close()
        for copy in copies:  # the namespace is gone: every writer of the pipes with it
            copy.join(timeout=GRACE_S)
        _remove(run_dir)


# A ClientApp's output goes into the node's log, which outlives the run: a review's could fill the log's disk and
# write terminal controls into it. Each stream is copied up to this many bytes a run, then drained unwritten; its
# control characters are escaped (\\xNN), but newlines, tabs and colour codes (ESC [ ... m, Flower's log levels).
LOG_ENV = "FEDFILTER_CLIENTAPP_MAX_LOG_BYTES"
MAX_LOG_BYTES = 16 << 20
_CONTROL = re.compile(rb"\x1b\[[0-9;]{0,16}m|[\x00-\x08\x0b-\x1f\x7f]")


def _escaped(match: re.Match[bytes]) -> bytes:
    found = match.group()
    return found if len(found) > 1 else b"\\x%02x" % found[0]


def _copy(source: IO[bytes] | None, sink: TextIO, limit: int = MAX_LOG_BYTES) -> None:
    """Copy a ClientApp's output to this wrapper's own, chunk by chunk, until every writer is gone: its control
    characters escaped (:data:`_CONTROL`), at most ``limit`` bytes, then one line saying the rest is dropped."""
    if source is None:
        return
    copied = 0
    with contextlib.suppress(OSError, ValueError):
        while chunk := os.read(source.fileno(), 65536):
            if copied >= limit:
                continue  # drained, so that the ClientApp never blocks on a full pipe
            chunk = chunk[: limit - copied]
            copied += len(chunk)
            sink.buffer.write(_CONTROL.sub(_escaped, chunk))
            if copied >= limit:
                note = f"the ClientApp's output passed {limit} bytes ({LOG_ENV}); dropping the rest"
                sink.buffer.write(f"\n[fedfilter-clientapp] {note}\n".encode())
            sink.buffer.flush()


def _remove(top: Path) -> None:
    """Remove a run's folder, whatever its ClientApp left there (:func:`_remove_tree`); a failure is logged, never
    raised, so that the ClientApp's exit code stays the wrapper's."""
    try:
        _remove_tree(top)
    except Exception as exc:  # a failure to clean up must not hide how the run ended
        _log(f"could not remove the run's folder {top}: {exc!r}")


def _remove_tree(top: Path) -> None:
    """Empty and remove ``top`` through descriptors, never following a link, at any depth, with two folders open
    at a time: each folder's entries are moved up into ``top`` (one rename each), then the emptied folder goes.

    A review's ClientApp left a 0500 folder (``rmtree`` could not empty it, and the next run found it) and a
    nesting 1,100 folders deep (``os.walk`` and ``rmtree`` recurse: RecursionError, folder left, exit code lost).
    A folder is made 0700 through an ``O_PATH | O_NOFOLLOW`` descriptor of it, so a link swapped in is unlinked,
    never followed."""
    token = f".fedfilter-removing-{os.getpid()}-{threading.get_ident()}"
    moved = 0
    root = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(root, 0o700)
        while True:
            with os.scandir(root) as found:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in found]
            if not entries:
                break
            progress = False
            for name, is_dir in entries:
                with contextlib.suppress(OSError):
                    if not is_dir:
                        os.unlink(name, dir_fd=root)
                        progress = True
                        continue
                    try:
                        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=root)
                    except OSError:  # not a folder any more (a link swapped in): unlinked, never followed
                        os.unlink(name, dir_fd=root)
                        progress = True
                        continue
                    try:
                        os.chmod(f"/proc/self/fd/{handle}", 0o700)
                        folder = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_DIRECTORY)
                    finally:
                        os.close(handle)
                    try:
                        with os.scandir(folder) as inner:
                            names = [e.name for e in inner]
                        for inside in names:
                            moved += 1
                            os.rename(inside, f"{token}-{moved}", src_dir_fd=folder, dst_dir_fd=root)
                            progress = True
                    finally:
                        os.close(folder)
                    os.rmdir(name, dir_fd=root)
                    progress = True
            if not progress:
                raise OSError(f"{top}: entries that cannot be removed: {[name for name, _ in entries][:5]}")
    finally:
        os.close(root)
    os.rmdir(top)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the wrapper dies (prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
        os._exit(EX_CONFIG)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_shim(bin_dir: Path, python: str) -> Path:
    """Write ``bin_dir/flwr-clientapp``: this file, run by ``python`` (an interpreter with Flower); and beside it
    each of :data:`REFUSED_COMMANDS`, which refuses its task (exit 78)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).read_text()
    for command in REFUSED_COMMANDS:
        _write_executable(bin_dir / command, f"#!{python} -I\n" + REFUSAL)
    return _write_executable(
        bin_dir / "flwr-clientapp",
        f"#!{python}\n" + source + '\n\nif __name__ == "__main__":\n    raise SystemExit(main())\n',
    )


def _write_executable(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # concurrent writers
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)
    return path
