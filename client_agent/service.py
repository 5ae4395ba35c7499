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

Frames on the socket: :mod:`client_agent.local_wire` (npz without pickle, JSON headers).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

from client_agent import local_wire
from client_agent.agent import Agent, Outcome, refusal
from client_agent.config import AgentConfig, AgentConfigError, parse_agent_config
from protocol import messages as wire
from protocol.errors import FedfilterError

LOG = logging.getLogger("fedfilter.agent.service")
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes on Linux, the terminating NUL included


class ServiceError(FedfilterError, OSError):
    """The service cannot start: its socket or ledger is taken, or its configuration is incomplete."""


def load_service_config(path: Path) -> AgentConfig:
    """The agent TOML, which must name ``agent-socket`` (the Unix socket the proxy connects to)."""
    cfg = parse_agent_config({"agent-config": str(path)})
    if cfg.socket_path is None:
        raise AgentConfigError(f"agent-socket: expected the Unix socket path in {path}, found none")
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


class AgentService:
    """The agent behind the socket: one thread owns the agent and answers every request in turn."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedfilter-agent")
        self.agent: Agent | None = self.worker.submit(Agent, config).result()  # opened on the worker thread
        self.answered = 0

    def handle(self, frame: bytes, context: Any = None) -> bytes:
        """One request frame in, one reply frame out (runs on the worker thread)."""
        message_type = "?"
        try:
            message_type, req_config, arrays = local_wire.unpack_request(frame)
        except local_wire.FrameError as exc:
            outcome = refusal(wire.ERR_MALFORMED, "?", {}, exc)
        else:
            outcome = self._answer(message_type, req_config, arrays)
        self.answered += 1
        try:
            return local_wire.pack_reply(outcome.error_code, outcome.error_reason, outcome.config, outcome.arrays)
        except (local_wire.FrameError, TypeError, ValueError) as exc:
            failed = refusal(wire.ERR_INTERNAL, message_type, {}, exc)
            return local_wire.pack_reply(failed.error_code, failed.error_reason, None, None)

    def _answer(self, message_type: str, req_config: dict[str, Any], arrays: dict[str, Any]) -> Outcome:
        if self.agent is None:
            try:
                self.agent = Agent(self.config)
            except Exception as exc:  # the ledger or data cannot be opened: nothing is answered
                return refusal(wire.ERR_LEDGER, message_type, req_config, exc)
        outcome = self.agent.handle(message_type, req_config, arrays)
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


def serve(config: AgentConfig, *, ready: threading.Event | None = None, stop: threading.Event | None = None) -> int:
    """Run the service until ``stop`` is set (SIGTERM and SIGINT set it when run from the main thread)."""
    assert config.socket_path is not None
    path = config.socket_path
    stop = stop or threading.Event()
    claim_socket_path(path)
    with ledger_lock(config.ledger_path):
        service = AgentService(config)
        server = grpc.server(
            service.worker,
            handlers=[
                grpc.method_handlers_generic_handler(
                    local_wire.SERVICE, {"Handle": grpc.unary_unary_rpc_method_handler(service.handle)}
                )
            ],
            options=local_wire.CHANNEL_OPTIONS,
            maximum_concurrent_rpcs=8,  # requests waiting beyond these are refused, not buffered
        )
        old_umask = os.umask(0o777 & ~config.socket_mode)  # the socket is created with its final mode
        try:
            if server.add_insecure_port(f"unix:{path}") == 0:
                raise ServiceError(f"agent-socket: expected to listen on {path}, found it could not be bound")
        except RuntimeError as exc:  # grpc's own bind failure (a missing or unwritable folder)
            raise ServiceError(f"agent-socket: expected to listen on {path}, found: {exc}") from exc
        finally:
            os.umask(old_umask)
        os.chmod(path, config.socket_mode)
        server.start()
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():

            def on_signal(signum: int, frame: FrameType | None) -> None:
                LOG.info("signal %s: stopping", signal.Signals(signum).name)
                stop.set()

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal)
        LOG.info(
            "serving %s (unit %s, trust %s, filter %s) on %s, mode %o",
            config.ledger_path,
            config.unit,
            config.trust,
            config.filter,
            path,
            config.socket_mode,
        )
        if ready is not None:
            ready.set()
        try:
            stop.wait()
        finally:
            server.stop(grace=30).wait()  # the request in progress finishes and is committed
            service.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            for number, handler in previous.items():
                signal.signal(number, handler)
            LOG.info("stopped after %d requests", service.answered)
    return 0


def main(path: Path) -> int:
    """``fedfilter agent serve PATH``: validate, then serve until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return serve(load_service_config(path))
