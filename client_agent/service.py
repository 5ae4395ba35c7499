"""``fedfilter agent serve AGENT.toml``: the data owner's own long-lived agent (privacy.md §10).

In ``local`` and ``secagg`` trust the coordinator is not trusted, yet Flower's deployment engine
runs the ClientApp code from the app bundle that the run's submitter ships. So the code that
holds the data, the ledger and the policy runs here, in the owner's service, under the owner's
OS user; the ClientApp in the bundle is a proxy (:mod:`client_agent.client_app`) that forwards
each request over a Unix domain socket and holds nothing.

The service:

- loads the configuration, the data and the ledger once, at start, and refuses to start (exit 2,
  a message naming what was expected and found) on an invalid TOML, a socket path that another
  process is serving, or a ledger that another agent holds (an exclusive ``flock`` on
  ``<ledger>.lock`` for the service's lifetime);
- answers one request at a time on one thread (one ledger transaction at a time; the SQLite
  connection belongs to that thread) through :meth:`client_agent.agent.Agent.handle`, the same
  code the simulations call. A client that disconnects mid-request does not undo anything: the
  charge is committed before the reply is built, and a retry with the same request id gets the
  stored reply (privacy.md §9);
- logs every refusal with its detail locally (the wire carries only the code's fixed text);
- reopens the agent, with every check of a first open, after a ledger or internal error;
- on SIGTERM or SIGINT stops taking requests, finishes the one in progress, closes the ledger
  (WAL checkpoint), removes the socket and exits 0.

Who may connect (privacy.md §10): the socket is created 0660 or stricter in a folder that only its
owner can write, and every connection's peer is checked with ``SO_PEERCRED`` against the agent's
configured peers (``agent-socket-peers``: its own SuperNode's user; by default its own user only).
Any other caller is closed before a byte is read, so one agent's SuperNode (or a bundle running
under it) cannot reach another agent's socket on the same host, whatever the socket's mode.

Memory: a request frame announces its length first; one above :func:`max_request_bytes` (what
the policy's largest model needs) is refused unread, decoding makes no copy of an array
(:mod:`protocol.npz`), and at most ``MAX_CONNECTIONS`` requests are held at once.

Frames on the socket: :mod:`client_agent.local_wire` (npz without pickle, JSON headers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import os
import pwd
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

from client_agent import local_wire
from client_agent.agent import Agent, Outcome, refusal
from client_agent.config import AgentConfig, AgentConfigError, Federation, parse_agent_config
from protocol import messages as wire
from protocol.errors import FedfilterError
from protocol.validate import as_float

LOG = logging.getLogger("fedfilter.agent.service")
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes on Linux, the terminating NUL included
# Connections being read or answered at once; one more is told "busy" and closed, never buffered.
# With max_request_bytes each, this bounds what requests can hold in memory (benchmarks/agent_memory.py).
MAX_CONNECTIONS = 4
# A caller has this long, in all, to send the frame it announced, and again to take the reply: a slow
# sender or a reader that never reads cannot hold a slot for ever (the charge stands either way).
READ_TIMEOUT_S = 120.0
# Beyond the parameters: headers and secagg tables (n x 32-byte keys, 64-byte signatures) for large rosters.
REQUEST_HEADROOM_BYTES = 16 << 20
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ServiceError(FedfilterError, OSError):
    """The service cannot start: its socket or ledger is taken, or its configuration is incomplete."""


def load_service_config(path: Path) -> AgentConfig:
    """The agent TOML, which must name ``agent-socket`` (or, per [federations.NAME] table, ``socket``)."""
    cfg = parse_agent_config({"agent-config": str(path)})
    for fed in cfg.served:
        if fed.socket_path is None:
            where = "agent-socket" if not cfg.federations else f"federations.{fed.name}.socket"
            raise AgentConfigError(f"{where}: expected the Unix socket path in {path}, found none")
    return cfg


@contextlib.contextmanager
def ledger_lock(ledger_path: Path) -> Iterator[None]:
    """Hold ``<ledger>.lock`` exclusively: a second agent on the same ledger is refused at start."""
    lock_path = ledger_path.with_name(ledger_path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ServiceError(
                f"ledger {ledger_path}: expected no other agent on this ledger, found it locked by "
                f"{lock_path} (process {holder}); stop that agent first"
            ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def claim_socket_path(path: Path) -> None:
    """Make sure ``path`` is free: a stale socket is removed; a served one or any other file is an error."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ServiceError(
            f"agent-socket: expected a path of at most {MAX_SOCKET_PATH} bytes (the Unix socket limit), "
            f"found {len(os.fsencode(path))} bytes in {path}"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise ServiceError(f"agent-socket: expected an existing folder for {path}, found none") from None
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ServiceError(f"agent-socket: expected {path} to be free or a socket, found another kind of file")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # a socket left by a service that did not stop cleanly
        return
    finally:
        probe.close()
    raise ServiceError(f"agent-socket: expected {path} to be free, found another process serving it")


class ReplyPacer:
    """A reply leaves no sooner than (1 + margin) x the slowest answer to a like request before it.

    Why (privacy.md §8): a reply's compute time depends on the data through the owner's model, and
    so on who stopped, in ways no uniform code path removes: a stopped record enters the model as
    zeros, and max-pooling ran 35-44 us faster per stopped record (2,000 records of the paper's CNN:
    523 ms with none stopped, 461 ms with all stopped), a sort over token ids likewise. Records only
    ever stop, so a client's natural reply time falls as its records stop; a reply held until the
    slowest like reply so far (plus the margin for the machine's noise) leaves at a time set by
    earlier replies, whoever has stopped since. Only a request slower than (1 + margin) x every like
    request before it leaves when ready (and raises the mark): what that tells is that this request
    was slower than all before, never that records stopped.

    "Like" is keyed on the federation (each federation's marks are its own, so one coordinator's
    requests never pace another's) and the message type, not on the model: a key the coordinator
    could vary at will (a model argument) would give every request a fresh, empty mark. So a cheap
    model's replies wait for the slowest model asked of that federation. What pacing cannot hide: a
    request slower than every earlier one of its kind leaves when ready, so a coordinator that asks
    ever heavier models learns one natural time per escalation (each such request is charged like any
    other). The first request of a kind after the service starts does not set a mark (it pays the
    process's one-time costs: imports, the model cache, compiling; a mark from it would hold every
    later reply to a cold start's time); it is held to the stored mark like any other. Marks only rise
    and are kept beside the ledger (``<ledger>.pacing.json``, written when one rises), so a restart
    does not reset them to a reply's natural time. The wait runs on the
    agent's one worker thread, so requests queued behind a paced one are paced too.
    """

    def __init__(self, margin: float, path: Path | None) -> None:
        self.margin, self.path = margin, path
        self.marks: dict[str, float] = {}
        self.warm: set[str] = set()  # kinds answered since the service started
        if path is not None and path.exists():
            try:
                loaded = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ServiceError(f"reply pacing: expected a JSON object of marks in {path}, found: {exc}") from exc
            expected = f"reply pacing: expected {path} to map keys to seconds >= 0"
            if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, float | int) and not isinstance(v, bool) for k, v in loaded.items()
            ):
                raise ServiceError(f"{expected}, found {loaded!r:.200}")
            self.marks = {k: as_float(f"{expected}; {k!r}", v, error=ServiceError) for k, v in loaded.items()}
            if not all(math.isfinite(v) and v >= 0 for v in self.marks.values()):
                raise ServiceError(f"{expected}, found {loaded!r:.200}")

    @staticmethod
    def key(federation: str, message_type: str) -> str:
        """Known message types only: any other string (the coordinator's) is "?", so a coordinator cannot
        grow the marks file (and the save's time) with made-up types."""
        return json.dumps([federation, message_type if message_type in wire.MESSAGE_TYPES else "?"])

    def hold(self, key: str, started: float) -> float:
        """Wait until the key's deadline (measured from ``started``, time.monotonic); the seconds waited.

        The deadline is fixed before the marks are saved and the save runs inside the wait: a save
        after it (or before a wait computed from the clock) made a reply whose natural time set a new
        mark leave later than the deadline, telling that it was slower than every earlier one."""
        elapsed = time.monotonic() - started
        mark = self.marks.get(key, 0.0)
        deadline = started + mark * (1.0 + self.margin)
        cold = key not in self.warm
        self.warm.add(key)
        if elapsed > mark and not cold:
            self.marks[key] = elapsed
            self._save()
        wait = deadline - time.monotonic()
        if wait > 0:
            time.sleep(wait)
            return wait
        return 0.0

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:  # owner-only, fsynced, then renamed: a power loss leaves the old marks or the new ones
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps(self.marks, sort_keys=True))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:  # pacing goes on from memory; the owner is told
            LOG.warning("reply pacing: could not save the marks to %s: %s", self.path, exc)


def pacing_path(config: AgentConfig) -> Path:
    return config.ledger_path.with_name(config.ledger_path.name + ".pacing.json")


class AgentService:
    """The agent behind the socket: one thread owns the agent and answers every request in turn."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        margin = config.reply_pacing_margin
        self.pacer = None if margin is None else ReplyPacer(margin, pacing_path(config))
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedfilter-agent")
        self.agent: Agent | None = self.worker.submit(Agent, config).result()  # opened on the worker thread
        self.answered = 0

    def unpack(
        self, frame: bytes | bytearray | None, unread: Exception | None = None
    ) -> tuple[str, dict[str, Any], dict[str, Any]] | bytes:
        """A request frame decoded, or the malformed refusal for one that was not read or does not decode.

        Runs on the connection's thread, never the worker's, and its refusal leaves unpaced: such a frame
        never reaches the agent, so the refusal and its time depend on the frame alone (no data, no
        ledger). Held to a mark on the worker, as before, a federation's stream of junk frames held the one
        worker from every other federation, uncharged and uncounted (a review: twenty 4-byte frames, 8 s
        added to another federation's status reply)."""
        try:
            if frame is None:
                raise local_wire.FrameError(f"frame: not read: {unread}")
            return local_wire.unpack_request(frame)
        except local_wire.FrameError as exc:
            outcome = refusal(wire.ERR_MALFORMED, "?", {}, exc)
            return local_wire.pack_reply(outcome.error_code, outcome.error_reason, None, None)

    def handle(self, request: tuple[str, dict[str, Any], dict[str, Any]], federation: str | None = None) -> bytes:
        """One decoded request in, one reply frame out (runs on the worker thread), held to its pace.

        ``federation``: whose socket the frame came over (the agent's first federation when None)."""
        started = time.monotonic()
        fed = federation or self.config.served[0].name
        message_type, req_config, arrays = request
        outcome = self._answer(message_type, req_config, arrays, fed)
        self.answered += 1
        try:
            reply = local_wire.pack_reply(outcome.error_code, outcome.error_reason, outcome.config, outcome.arrays)
        except (local_wire.FrameError, TypeError, ValueError) as exc:
            failed = refusal(wire.ERR_INTERNAL, message_type, {}, exc)
            reply = local_wire.pack_reply(failed.error_code, failed.error_reason, None, None)
        if self.pacer is not None and not outcome.before_answer:  # see Outcome.before_answer
            self.pacer.hold(ReplyPacer.key(fed, message_type), started)
        return reply

    def paced(self, request: tuple[str, dict[str, Any], dict[str, Any]], federation: str | None = None) -> bytes:
        """:meth:`handle`, with any exception it lets out held to the pace as well and answered as internal."""
        started = time.monotonic()
        try:
            return self.handle(request, federation)
        except Exception as exc:
            failed = refusal(wire.ERR_INTERNAL, "?", {}, exc)
            if self.pacer is not None:
                self.pacer.hold(ReplyPacer.key(federation or self.config.served[0].name, "?"), started)
            return local_wire.pack_reply(failed.error_code, failed.error_reason, None, None)

    def _answer(
        self, message_type: str, req_config: dict[str, Any], arrays: dict[str, Any], federation: str
    ) -> Outcome:
        if self.agent is None:
            try:
                self.agent = Agent(self.config)
            except Exception as exc:  # the ledger or data cannot be opened: nothing is answered
                return refusal(wire.ERR_LEDGER, message_type, req_config, exc)
        outcome = self.agent.handle(message_type, req_config, arrays, federation)
        if outcome.error_code == wire.ERR_LEDGER:
            # The next request reopens it with every check of a first open. Only a ledger error
            # does: a request that forces an internal error must not buy a costly reopen each time.
            self.agent.close()
            self.agent = None
        return outcome

    def close(self) -> None:
        def shut() -> None:
            if self.agent is not None:
                self.agent.close()
                self.agent = None

        self.worker.submit(shut).result()
        self.worker.shutdown()


def max_request_bytes(config: AgentConfig) -> int:
    """The largest request frame the policy allows: the largest model's float32 parameters plus headroom."""
    return 4 * config.policy.max_model_params + REQUEST_HEADROOM_BYTES


def peer_uids(config: AgentConfig | Federation) -> frozenset[int]:
    """The uids ``agent-socket-peers`` (a federation's ``socket-peers``) names, user names resolved now; none
    named: this process's own."""
    uids: set[int] = set()
    for peer in config.socket_peers:
        if peer.isdigit():
            uids.add(int(peer))
            continue
        try:
            uids.add(pwd.getpwnam(peer).pw_uid)
        except KeyError:
            raise ServiceError(
                f"agent-socket-peers: expected existing OS users or uids, found no user {peer!r}"
            ) from None
    return frozenset(uids or {os.geteuid()})


def check_socket_folder(path: Path) -> None:
    """The socket's folder must be writable by its owner only (else anyone could replace the socket)."""
    folder = path.parent
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise ServiceError(f"agent-socket: expected an existing folder for {path}, found: {exc}") from exc
    if st.st_mode & 0o022:
        raise ServiceError(
            f"agent-socket: expected its folder {folder} to be writable by its owner only, found mode "
            f"{stat.S_IMODE(st.st_mode):04o}; anyone who can write there can replace the socket "
            "(use a folder of the agent's own, e.g. systemd's RuntimeDirectory, mode 0750)"
        )
    if st.st_uid not in (os.geteuid(), 0):
        raise ServiceError(
            f"agent-socket: expected its folder {folder} to belong to the agent's user or root, found uid {st.st_uid}"
        )
    if (problem := _ancestor_problem(folder)) is not None:
        raise ServiceError(f"agent-socket: {problem}; whoever can change it can put their own socket at {path}")


def _ancestor_problem(folder: Path) -> str | None:
    """Why a folder above the socket's (as written or resolved), or a link on the way, lets someone other than
    the agent's user or root move the socket's folder away; None when none does (a hostile review: a folder of
    the agent's own inside a world-writable parent passed, and any user could rename it and take the path).

    Each folder above must belong to the agent's user or root and be writable by its owner only, or sticky
    (like /tmp: then only an entry's owner may rename it); each symbolic link on the way must belong to the
    agent's user or root (its owner may point it elsewhere)."""
    trusted = (os.geteuid(), 0)
    given = Path(os.path.abspath(folder))
    for chain in (given, Path(os.path.realpath(folder))):
        for above in [*reversed(chain.parents), chain]:
            try:
                link = os.lstat(above)
                st = os.stat(above)
            except OSError as exc:
                return f"expected to read the folders above its own, found {above}: {exc}"
            if stat.S_ISLNK(link.st_mode) and link.st_uid not in trusted:
                return f"expected the link {above} to belong to the agent's user or root, found uid {link.st_uid}"
            if above == chain:
                continue  # the socket's own folder: checked above, more strictly
            if st.st_uid not in trusted:
                return f"expected the folder {above} to belong to the agent's user or root, found uid {st.st_uid}"
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                return (
                    f"expected the folder {above} to be writable by its owner only or sticky, found mode "
                    f"{stat.S_IMODE(st.st_mode):04o}"
                )
    return None


def _peer(conn: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def _busy_reply() -> bytes:
    return local_wire.pack_reply(wire.ERR_UNAVAILABLE, wire.ERROR_TEXT[wire.ERR_UNAVAILABLE], None, None)


@dataclasses.dataclass
class _Endpoint:
    """One federation's socket: who may connect, and its own connection slots."""

    federation: str
    sock: socket.socket
    allowed: frozenset[int]
    slots: threading.BoundedSemaphore = dataclasses.field(
        default_factory=lambda: threading.BoundedSemaphore(MAX_CONNECTIONS)
    )


class _Listener:
    """Accepts connections on every federation's socket, checks each one's peer against that socket's
    peers, and answers one request per connection, tagged with the socket's federation."""

    def __init__(self, service: AgentService, endpoints: list[_Endpoint], max_bytes: int) -> None:
        self.service, self.endpoints, self.max_bytes = service, endpoints, max_bytes
        self.threads: set[threading.Thread] = set()
        self.refused = 0

    def run(self, stop: threading.Event) -> None:
        with selectors.DefaultSelector() as sel:
            for endpoint in self.endpoints:
                sel.register(endpoint.sock, selectors.EVENT_READ, endpoint)
            while not stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    endpoint = key.data
                    try:
                        conn, _ = endpoint.sock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    self._accept(conn, endpoint)

    def _accept(self, conn: socket.socket, endpoint: _Endpoint) -> None:
        pid, uid = _peer(conn)
        if uid not in endpoint.allowed:
            self.refused += 1
            LOG.warning(
                "refused a connection from uid %d (process %d) on federation %r's socket: not among its peers",
                uid,
                pid,
                endpoint.federation,
            )
            conn.close()  # before a byte is read: nothing of the request reaches the agent
            return
        if not endpoint.slots.acquire(blocking=False):
            LOG.warning(
                "busy: %d requests of federation %r in progress; refused one from process %d",
                MAX_CONNECTIONS,
                endpoint.federation,
                pid,
            )
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)
                local_wire.send(conn, _busy_reply())
            conn.close()
            return
        thread = threading.Thread(
            target=self._serve_one, args=(conn, endpoint), name="fedfilter-agent-conn", daemon=True
        )
        self.threads.add(thread)
        thread.start()

    def _serve_one(self, conn: socket.socket, endpoint: _Endpoint) -> None:
        try:
            try:
                deadline = time.monotonic() + READ_TIMEOUT_S
                frame: bytes | bytearray | None = local_wire.receive(conn, self.max_bytes, deadline=deadline)
                reason: Exception | None = None
            except local_wire.FrameError as exc:  # too large, a bad prefix or a short frame
                frame, reason = None, exc
            request = self.service.unpack(frame, reason)  # a frame that does not decode never reaches the worker
            if isinstance(request, bytes):
                reply = request
            else:
                reply = self.service.worker.submit(self.service.paced, request, endpoint.federation).result()
            with contextlib.suppress(OSError):  # the caller gave up: the charge stands, a retry gets this reply
                local_wire.send(conn, reply, deadline=time.monotonic() + READ_TIMEOUT_S)
        except OSError as exc:
            LOG.warning("connection dropped before its request was read: %s", exc)
        finally:
            conn.close()
            endpoint.slots.release()
            self.threads.discard(threading.current_thread())

    def drain(self, timeout: float) -> None:
        for thread in list(self.threads):
            thread.join(timeout)


def _bind(path: Path, mode: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)  # the socket is created with its final mode
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ServiceError(f"agent-socket: expected to listen on {path}, found: {exc}") from exc
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(64)
    sock.setblocking(False)
    return sock


def serve(config: AgentConfig, *, ready: threading.Event | None = None, stop: threading.Event | None = None) -> int:
    """Run the service until ``stop`` is set (SIGTERM and SIGINT set it when run from the main thread).

    One socket per federation (``agent-socket``, or each [federations.NAME] table's ``socket``), each
    answering only its own peers; every request is answered by the one agent on the one ledger.
    """
    stop = stop or threading.Event()
    feds = config.served
    allowed = {fed.name: peer_uids(fed) for fed in feds}
    for i, one in enumerate(feds):
        for other in feds[i + 1 :]:
            if shared := allowed[one.name] & allowed[other.name]:
                # Not a privacy loss (the one filter per unit bounds both), but the quotas no longer separate
                # them: a bundle of either federation can ask through both sockets (docs/deploy.md).
                LOG.warning(
                    "federations %r and %r both answer uid %s: their quotas do not separate them; give each "
                    "federation's SuperNode a user of its own",
                    one.name,
                    other.name,
                    sorted(shared),
                )
    for fed in feds:
        assert fed.socket_path is not None
        check_socket_folder(fed.socket_path)
        claim_socket_path(fed.socket_path)
    with ledger_lock(config.ledger_path):
        service = AgentService(config)
        endpoints: list[_Endpoint] = []
        try:
            for fed in feds:
                assert fed.socket_path is not None
                endpoints.append(_Endpoint(fed.name, _bind(fed.socket_path, fed.socket_mode), allowed[fed.name]))
        except BaseException:
            for endpoint in endpoints:
                endpoint.sock.close()
            service.close()
            raise
        listener = _Listener(service, endpoints, max_request_bytes(config))
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():

            def on_signal(signum: int, frame: FrameType | None) -> None:
                LOG.info("signal %s: stopping", signal.Signals(signum).name)
                stop.set()

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal)
        for fed in feds:
            LOG.info(
                "serving %s (unit %s, trust %s, filter %s) to federation %r (quota %s) on %s, mode %o, peers uid %s, "
                "requests up to %d bytes",
                config.ledger_path,
                config.unit,
                config.trust,
                config.filter,
                fed.name,
                fed.quota,
                fed.socket_path,
                fed.socket_mode,
                sorted(allowed[fed.name]),
                listener.max_bytes,
            )
        if ready is not None:
            ready.set()
        try:
            listener.run(stop)
        finally:
            for fed, endpoint in zip(feds, endpoints, strict=True):
                endpoint.sock.close()
                assert fed.socket_path is not None
                with contextlib.suppress(FileNotFoundError):
                    fed.socket_path.unlink()
            listener.drain(timeout=30)  # the requests in progress finish and are committed
            service.close()
            for number, handler in previous.items():
                signal.signal(number, handler)
            LOG.info("stopped after %d requests (%d connections refused)", service.answered, listener.refused)
    return 0


def main(path: Path) -> int:
    """``fedfilter agent serve PATH``: validate, then serve until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return serve(load_service_config(path))
