"""Who may reach the agent's socket, and what a request may cost it in memory (issue 25, items 1 and 3).

The service runs as a real subprocess (``fedfilter agent serve``) on a Unix socket under tmp_path.
A peer outside ``agent-socket-peers`` is closed unread; a socket more open than 0660, or in a folder
others can write, never starts; a frame above the policy's bound is refused unread; more than
``MAX_CONNECTIONS`` requests at once are told "busy". The two-user case (one agent's SuperNode user
refused at another agent's socket) runs on Flower's deployment engine in tests/e2e.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from client_agent import local_wire
from client_agent.client_app import forward, send_frame
from client_agent.service import MAX_CONNECTIONS, REQUEST_HEADROOM_BYTES
from protocol import messages as wire
from tests.e2e.common import cannot_run
from tests.integration.test_agent_service import agent_toml, gradient, spent, start, status, stop, wait_for_socket


def served_with(tmp_path: Path, **over: object) -> tuple[Path, object]:
    toml = agent_toml(tmp_path, **over)
    proc = start(toml)
    wait_for_socket(proc, tmp_path / "agent.sock")
    return tmp_path / "agent.sock", proc


def test_a_caller_outside_the_socket_peers_is_closed_unread_and_charged_nothing(tmp_path: Path) -> None:
    other_uid = os.geteuid() + 4242  # not this process's user: this test's own connections are foreign
    toml = agent_toml(tmp_path, **{"agent-socket-peers": [str(other_uid)]})
    proc = start(toml)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "agent.sock").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        # Closed before a byte is read: the caller sees the connection end (or reset, having written).
        with pytest.raises((local_wire.FrameError, ConnectionResetError, BrokenPipeError)):
            forward(str(tmp_path / "agent.sock"), wire.GRADIENT, *gradient("g1"))
    finally:
        code, out = stop(proc)
    assert code == 0, out
    assert f"refused a connection from uid {os.geteuid()}" in out
    assert not (tmp_path / "ledger.sqlite").exists() or not np.any(spent(tmp_path))


def test_the_configured_peer_is_answered(tmp_path: Path) -> None:
    sock, proc = served_with(tmp_path, **{"agent-socket-peers": [str(os.geteuid())]})
    try:
        assert forward(str(sock), wire.GRADIENT, *gradient("g1"))[0] == 0
    finally:
        code, out = stop(proc)  # type: ignore[arg-type]
    assert code == 0, out


# 0666 and 0777 run by default; the one-bit-more-open modes (about 4.5 s each) with -m slow (test budget).
@pytest.mark.parametrize(
    "mode", ["0666", "0777", pytest.param("0661", marks=pytest.mark.slow), pytest.param("0670", marks=pytest.mark.slow)]
)
def test_a_socket_more_open_than_0660_is_refused_at_start(tmp_path: Path, mode: str) -> None:
    toml = agent_toml(tmp_path)  # written valid, then opened up as a careless operator would
    toml.write_text(toml.read_text() + f'agent-socket-mode = "{mode}"\n')
    proc = start(toml)
    proc.wait(timeout=60)
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 2, out
    assert "agent-socket-mode: expected 0660 or stricter" in out and mode in out
    assert not (tmp_path / "agent.sock").exists()


def test_a_socket_folder_others_can_write_is_refused_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(0o777)
    proc = start(agent_toml(tmp_path, **{"agent-socket": str(folder / "agent.sock")}))
    proc.wait(timeout=60)
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 2, out
    assert f"expected its folder {folder} to be writable by its owner only, found mode 0777" in out


def raw_connection(sock: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    conn.connect(str(sock))
    return conn


def test_a_frame_above_the_policy_bound_is_refused_unread_and_the_agent_goes_on(tmp_path: Path) -> None:
    params = 1000
    sock, proc = served_with(tmp_path, **{"policy-max-model-params": params})
    bound = 4 * params + REQUEST_HEADROOM_BYTES
    try:
        with raw_connection(sock) as conn:  # announces 1 GiB and sends none of it
            conn.sendall(struct.pack(">4sQ", local_wire.MAGIC, 1 << 30))
            code, reason, _, _ = local_wire.unpack_reply(local_wire.receive(conn, local_wire.MAX_FRAME_BYTES))
        assert (code, reason) == (wire.ERR_MALFORMED, wire.ERROR_TEXT[wire.ERR_MALFORMED])
        assert status(sock)["ledger"]["unit"] == "record"  # and the agent still answers
    finally:
        code, out = stop(proc)  # type: ignore[arg-type]
    assert code == 0, out
    assert f"expected at most {bound} bytes, found {1 << 30} announced" in out


def test_requests_beyond_the_connection_bound_are_told_busy_not_buffered(tmp_path: Path) -> None:
    sock, proc = served_with(tmp_path)
    stalled = []
    try:
        while len(stalled) < MAX_CONNECTIONS:  # each announces 100 bytes and sends none: a slot held
            conn = raw_connection(sock)
            try:
                conn.sendall(struct.pack(">4sQ", local_wire.MAGIC, 100))
            except BrokenPipeError:  # told busy: the readiness probe's slot was not yet released
                conn.close()
                time.sleep(0.1)
                continue
            stalled.append(conn)
        time.sleep(0.5)
        code, reason, _, _ = send_frame(str(sock), local_wire.pack_request(wire.STATUS, {}, {}), timeout=30)
        assert (code, reason) == (wire.ERR_UNAVAILABLE, wire.ERROR_TEXT[wire.ERR_UNAVAILABLE])
        for conn in stalled:
            conn.close()  # a short frame: refused as malformed, the slot freed
        stalled.clear()
        deadline = time.monotonic() + 30
        while True:
            try:
                assert status(sock)["ledger"]["unit"] == "record"
                break
            except AssertionError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        for conn in stalled:
            conn.close()
        code, out = stop(proc)  # type: ignore[arg-type]
    assert code == 0, out


def test_agent_status_shows_the_owner_policy_peers_spend_and_recent_answers(tmp_path: Path) -> None:
    """``fedfilter agent status`` reads the ledger while the agent serves, and names what it accepts."""
    import json
    import subprocess
    import sys

    sock, proc = served_with(tmp_path, **{"agent-socket-peers": [str(os.geteuid())], "policy-max-clip": 4.0})
    try:
        for i in range(3):
            assert forward(str(sock), wire.GRADIENT, *gradient(f"g{i}", rnd=i + 1))[0] == 0
        out = subprocess.run(
            [sys.executable, "-m", "simulations.cli", "agent", "status", str(tmp_path / "agent.toml"), "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
    finally:
        code, log = stop(proc)  # type: ignore[arg-type]
    assert code == 0, log
    report = json.loads(out)
    assert report["socket_peers"] == [str(os.geteuid())] and report["socket_mode"] == "0660"
    assert report["policy"]["max_clip"] == 4.0 and report["policy"]["min_noise_std"] == 1.0
    assert report["ledger"]["requests_answered"] == 3 and report["ledger"]["spent_max"] > 0
    assert [r["request_id"] for r in report["recent_answers"]] == ["g2", "g1", "g0"]
    assert report["high_water_check"] == "ok"


def test_slow_senders_and_readers_that_never_read_cannot_hold_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read and the reply each have one deadline in all (not per call): four slow callers lose their
    slots when it passes, and the agent answers again (in-process service, deadline patched to 1.5 s)."""
    import threading

    from client_agent import service
    from client_agent.service import load_service_config

    monkeypatch.setattr(service, "READ_TIMEOUT_S", 1.5)
    config = load_service_config(agent_toml(tmp_path))
    ready, stop_event = threading.Event(), threading.Event()
    server = threading.Thread(target=service.serve, args=(config,), kwargs={"ready": ready, "stop": stop_event})
    server.start()
    slow = []
    try:
        assert ready.wait(60)
        sock = tmp_path / "agent.sock"
        for _ in range(MAX_CONNECTIONS):  # each announces 1000 bytes, then trickles one byte at a time
            conn = raw_connection(sock)
            conn.sendall(struct.pack(">4sQ", local_wire.MAGIC, 1000))
            slow.append(conn)
        busy = send_frame(str(sock), local_wire.pack_request(wire.STATUS, {}, {}), timeout=30)
        assert busy[0] == wire.ERR_UNAVAILABLE
        for _ in range(8):  # 2.4 s of trickling: past the 1.5 s deadline for the whole frame
            for conn in slow:
                try:
                    conn.send(b"x")
                except OSError:
                    pass
            time.sleep(0.3)
        assert status(sock)["ledger"]["unit"] == "record"  # the slots were freed: answered
    finally:
        for conn in slow:
            conn.close()
        stop_event.set()
        server.join(timeout=60)
    assert not server.is_alive()


def test_a_folder_above_the_sockets_that_others_can_change_is_refused(tmp_path: Path) -> None:
    """A hostile review: only the socket's own folder was checked, so a folder of the agent's inside a
    world-writable parent passed, and any user could rename it away and put their own socket at the path."""
    from client_agent.service import ServiceError, check_socket_folder

    shared = tmp_path / "shared"
    own = shared / "agent"
    own.mkdir(parents=True)
    own.chmod(0o750)
    shared.chmod(0o777)
    with pytest.raises(ServiceError, match=f"expected the folder {shared} to be writable by its owner only or sticky"):
        check_socket_folder(own / "agent.sock")
    shared.chmod(0o1777)  # sticky, like /tmp: only an entry's owner may rename it
    check_socket_folder(own / "agent.sock")
    shared.chmod(0o755)
    check_socket_folder(own / "agent.sock")


def test_a_link_or_a_folder_above_the_sockets_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    from client_agent.service import ServiceError, check_socket_folder

    if os.geteuid() != 0:
        cannot_run("needs root: it gives a folder and a link to another user (uid 65534)")
    own = tmp_path / "mine" / "agent"
    own.mkdir(parents=True)
    own.chmod(0o750)
    link = tmp_path / "link"
    link.symlink_to(own)
    os.lchown(link, 65534, 65534)
    with pytest.raises(ServiceError, match=f"expected the link {link} to belong to the agent's user or root"):
        check_socket_folder(link / "agent.sock")
    os.lchown(link, 0, 0)
    check_socket_folder(link / "agent.sock")
    os.chown(tmp_path / "mine", 65534, 65534)
    with pytest.raises(ServiceError, match=f"expected the folder {tmp_path / 'mine'} to belong to the agent's"):
        check_socket_folder(own / "agent.sock")
