"""``fedfilter agent serve`` and the ClientApp proxy (issue 13; privacy.md §10).

The service runs as a real subprocess on a Unix socket under tmp_path; requests go through the
deployed ClientApp's own proxy code (:func:`client_agent.client_app.proxy_message`) with real
Flower Messages, or through :func:`client_agent.client_app.forward`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_agent.client_app import forward, proxy_message
from client_agent.ledger import Ledger
from protocol import messages as wire
from protocol.records import decode_content, encode_content
from simulations.deploy.agent_files import write_agent_toml
from tests import factories

ENV = os.environ | {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


def agent_toml(root: Path, name: str = "agent", **over: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 3)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    values: dict[str, Any] = {
        "ledger-path": str(root / "ledger.sqlite"),
        "data-path": str(root / "data.npz"),
        "agent-socket": str(root / f"{name}.sock"),
        "epsilon": 2.0,
        "delta": 1e-5,
        "unit": "record",
        "trust": "local",
        "policy-min-noise-std": 1.0,
        "policy-max-clip": 10.0,
        "policy-max-request-share": 1.0,  # these tests spend budgets in a few requests
    } | over
    return write_agent_toml(root / f"{name}.toml", values)


def start(toml: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "simulations.cli", "agent", "serve", str(toml)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_socket(proc: subprocess.Popen[str], path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                status(path)
                return
            except Exception:
                pass
        if proc.poll() is not None:
            raise AssertionError(f"agent service exited early: {proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.1)
    raise AssertionError("agent service did not open its socket in time")


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


@pytest.fixture(autouse=True)
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower stamps new Messages with the process's task identity, which a Flower process sets."""
    for name, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    toml = agent_toml(tmp_path)
    proc = start(toml)
    try:
        wait_for_socket(proc, tmp_path / "agent.sock")
        yield toml, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def status(sock: Path) -> dict[str, Any]:
    code, reason, config, arrays = forward(str(sock), wire.STATUS, {"request_id": "s", "run_id": "r", "round": 0}, {})
    assert code == 0, reason
    return wire.StatusReply.decode(config, arrays).parsed()


def gradient(request_id: str, rnd: int = 1, noise_std: float = 2.0) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    return wire.encode_request(factories.gradient_request(request_id, round=rnd, noise_std=noise_std))


def flower_request(message_type: str, config: dict[str, Any], arrays: dict[str, np.ndarray]) -> Message:
    return Message(encode_content(config, arrays), dst_node_id=1, message_type=message_type)


def context(sock: Path | None) -> Context:
    node_config = {} if sock is None else {"agent-socket": str(sock)}
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})


def spent(toml_dir: Path) -> np.ndarray:
    return factories.spent(toml_dir / "ledger.sqlite")


def test_the_proxy_forwards_flower_messages_and_the_service_charges(
    served: tuple[Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    _, proc = served
    sock = tmp_path / "agent.sock"
    assert oct(os.stat(sock).st_mode & 0o777) == oct(0o660)  # the TOML's default socket mode
    described = status(sock)
    assert described["ledger"]["unit"] == "record" and "data_sha256" not in json.dumps(described)
    reply = proxy_message(flower_request(wire.GRADIENT, *gradient("g1")), context(sock))
    assert not reply.has_error()
    config, arrays = decode_content(reply.content)
    decoded = wire.ContributionReply.decode(config, arrays)
    assert decoded.status == wire.REPLY_OK and decoded.total.shape == (8,)
    # A repeat of the id is the stored reply, byte for byte (privacy.md §9), through the proxy too.
    again = proxy_message(flower_request(wire.GRADIENT, *gradient("g1")), context(sock))
    assert decode_content(again.content)[1]["total"].tobytes() == arrays["total"].tobytes()
    # Outside the policy: the code's fixed text, nothing spent; the detail is in the service's log.
    refused = proxy_message(flower_request(wire.GRADIENT, *gradient("g2", 2, noise_std=0.5)), context(sock))
    assert refused.has_error() and refused.error.code == wire.ERR_POLICY
    assert refused.error.reason == wire.ERROR_TEXT[wire.ERR_POLICY]
    code, out = stop(proc)
    assert code == 0, out
    assert not sock.exists()  # removed on SIGTERM
    assert "noise_std 0.5 asked; the policy requires noise_std >= 1.0" in out  # logged locally
    after = spent(tmp_path)
    assert after.max() > 0 and np.count_nonzero(after) == 20  # g1 charged once, g2 never
    # Replies were paced (local trust's default): the marks, kept beside the ledger, name public fields only.
    marks = json.loads((tmp_path / "ledger.sqlite.pacing.json").read_text())
    assert set(marks) <= {json.dumps(["default", kind]) for kind in (wire.GRADIENT, wire.STATUS)}
    assert marks[json.dumps(["default", wire.GRADIENT])] > 0


def test_an_unreachable_agent_is_a_fixed_error_that_spends_nothing(tmp_path: Path) -> None:
    reply = proxy_message(flower_request(wire.GRADIENT, *gradient("g1")), context(tmp_path / "none.sock"))
    assert reply.has_error() and reply.error.code == wire.ERR_UNAVAILABLE
    assert reply.error.reason == wire.ERROR_TEXT[wire.ERR_UNAVAILABLE] and "agent unavailable" in reply.error.reason
    missing = proxy_message(flower_request(wire.GRADIENT, *gradient("g1")), context(None))
    assert missing.has_error() and missing.error.reason == wire.ERROR_TEXT[wire.ERR_UNAVAILABLE]


def test_a_taken_socket_a_locked_ledger_and_a_bad_toml_stop_the_service_with_a_clear_error(
    served: tuple[Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    toml, _ = served
    second = start(toml)  # the same socket, served
    code, out = stop(second, 0) if second.wait(timeout=60) is not None else (None, "")
    assert code == 2 and "expected" in out and "found another process serving it" in out
    other = tmp_path / "other.toml"
    other.write_text(toml.read_text().replace("agent.sock", "agent2.sock"))
    third = start(other)  # another socket, the same ledger
    third.wait(timeout=60)
    code, out = stop(third, 0)
    assert code == 2 and "expected no other agent on this ledger, found it locked" in out
    bad = tmp_path / "bad.toml"
    bad.write_text(toml.read_text() + "epsilon-typo = 1\n")
    fourth = start(bad)
    fourth.wait(timeout=60)
    code, out = stop(fourth, 0)
    assert code == 2 and "unknown keys ['epsilon-typo']" in out
    assert status(tmp_path / "agent.sock")["ledger"]["epsilon"] == 2.0  # the first service is untouched


def test_sigkill_mid_run_and_restart_loses_no_spend(served: tuple[Path, subprocess.Popen[str]], tmp_path: Path) -> None:
    toml, proc = served
    sock = tmp_path / "agent.sock"
    first = forward(str(sock), wire.GRADIENT, *gradient("g1"))
    assert first[0] == 0
    proc.kill()  # no clean stop: the socket file stays behind
    proc.wait(timeout=30)
    before = spent(tmp_path)
    restarted = start(toml)  # a stale socket is reclaimed; the ledger lock died with the process
    try:
        wait_for_socket(restarted, sock)
        replay = forward(str(sock), wire.GRADIENT, *gradient("g1"))
        assert replay[3]["total"].tobytes() == first[3]["total"].tobytes()  # stored reply, no new noise
        np.testing.assert_array_equal(spent(tmp_path), before)  # and no new charge
        assert forward(str(sock), wire.GRADIENT, *gradient("g2", 2))[0] == 0
        assert np.all(spent(tmp_path) >= before) and spent(tmp_path).sum() > before.sum()
    finally:
        code, out = stop(restarted)
    assert code == 0, out


def test_the_proxy_module_imports_no_torch_and_no_agent_code() -> None:
    probe = (
        "import sys, client_agent.client_app as m; "
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'scipy', 'sqlite3') "
        "or k in ('client_agent.agent', 'client_agent.ledger', 'client_agent.config', 'client_agent.direct')); "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=ENV, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_hostile_frames_are_refused_without_inflating_or_allocating(tmp_path: Path) -> None:
    """The proxy side of the socket is the bundle's code: a frame is checked before it is decoded."""
    import io
    import zipfile

    from client_agent import local_wire

    def frame(members: dict[str, bytes], compress: int = zipfile.ZIP_STORED) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=compress) as archive:
            for name, data in members.items():
                archive.writestr(name, data)
        return buf.getvalue()

    def npy(array: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.save(buf, array)
        return buf.getvalue()

    header = npy(np.frombuffer(json.dumps({"message_type": wire.STATUS, "config": {}}).encode(), np.uint8))
    bomb = frame({"__header__.npy": header, "x.npy": npy(np.zeros(10**7, np.uint8))}, zipfile.ZIP_DEFLATED)
    assert len(bomb) < 200_000  # 10 MB that would be inflated
    huge = npy(np.zeros(4, np.uint8)).replace(b"(4,)", b"(17592186044416,)")  # declares 16 TiB, holds 4 bytes
    cases = {
        "compressed": bomb,
        "declared shape": frame({"__header__.npy": header, "x.npy": huge}),
        "many members": frame({"__header__.npy": header, **{f"a{i}.npy": npy(np.zeros(1)) for i in range(40)}}),
        "nested header": frame({"__header__.npy": npy(np.frombuffer(b"[" * 100_000, np.uint8))}),
        "not a zip": b"garbage",
    }
    for name, data in cases.items():
        with pytest.raises(local_wire.FrameError):
            local_wire.unpack_request(data)
            pytest.fail(f"{name}: a hostile frame was decoded")
    # A good frame round-trips, arrays and all.
    good = local_wire.pack_request(wire.GRADIENT, {"a": 1.5}, {"p": np.arange(3, dtype=np.float32)})
    message_type, config, arrays = local_wire.unpack_request(good)
    assert message_type == wire.GRADIENT and config == {"a": 1.5} and arrays["p"].tolist() == [0.0, 1.0, 2.0]


def test_the_proxy_answers_a_request_it_cannot_frame_as_malformed(tmp_path: Path) -> None:
    msg = flower_request(wire.GRADIENT, {"request_id": "x", "blob": b"\x00"}, {})
    reply = proxy_message(msg, context(tmp_path / "none.sock"))
    assert reply.has_error() and reply.error.code == wire.ERR_MALFORMED


def test_an_agent_killed_mid_request_charges_nothing_and_answers_after_restart(tmp_path: Path) -> None:
    """SIGKILL between computing and committing (FEDFILTER_FAULT=after_compute): nothing left, nothing charged."""
    toml = agent_toml(tmp_path)
    sock = tmp_path / "agent.sock"
    faulty = subprocess.Popen(
        [sys.executable, "-m", "simulations.cli", "agent", "serve", str(toml)],
        env=ENV | {"FEDFILTER_FAULT": "after_compute"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_socket(faulty, sock)
        reply = proxy_message(flower_request(wire.GRADIENT, *gradient("g1")), context(sock))
        assert reply.has_error() and reply.error.code == wire.ERR_UNAVAILABLE  # the service died mid-request
        assert faulty.wait(timeout=30) == -signal.SIGKILL
    finally:
        if faulty.poll() is None:
            faulty.kill()
    with Ledger.open_existing(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.requests_answered() == 0 and not np.any(ledger.state()["spent"])
    restarted = start(toml)
    try:
        wait_for_socket(restarted, sock)
        assert forward(str(sock), wire.GRADIENT, *gradient("g1"))[0] == 0  # answered afresh, charged once
        assert np.count_nonzero(spent(tmp_path)) == 20
    finally:
        code, out = stop(restarted)
    assert code == 0, out


def test_a_caller_that_gives_up_mid_request_gets_the_committed_reply_on_retry(
    served: tuple[Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    """The proxy disconnects (its deadline passes) while the agent works: the agent still commits, once."""
    sock = tmp_path / "agent.sock"
    # The service's first gradient imports torch (seconds): the caller's 0.5 s deadline passes mid-request.
    with pytest.raises(TimeoutError):
        forward(str(sock), wire.GRADIENT, *gradient("g1"), timeout=0.5)
    deadline = time.monotonic() + 60
    while True:  # the agent finishes and commits the request nobody is waiting for
        with Ledger.open_existing(tmp_path / "ledger.sqlite") as ledger:
            if ledger.requests_answered() == 1:
                break
        assert time.monotonic() < deadline, "the abandoned request was never committed"
        time.sleep(0.2)
    retry = forward(str(sock), wire.GRADIENT, *gradient("g1"))
    again = forward(str(sock), wire.GRADIENT, *gradient("g1"))
    assert retry[0] == 0 and retry[3]["total"].tobytes() == again[3]["total"].tobytes()
    with Ledger.open_existing(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.requests_answered() == 1  # charged once, whatever the caller saw


def test_a_socket_path_over_the_unix_limit_is_a_clear_error(tmp_path: Path) -> None:
    from client_agent.service import MAX_SOCKET_PATH, ServiceError, claim_socket_path

    long_path = tmp_path / ("s" * (MAX_SOCKET_PATH + 1 - len(str(tmp_path)))) / "agent.sock"
    with pytest.raises(ServiceError, match=f"expected a path of at most {MAX_SOCKET_PATH} bytes"):
        claim_socket_path(long_path)


def test_the_service_answers_a_users_own_workload(tmp_path: Path) -> None:
    """A deployed agent on the example workload (examples/gn_regression: its own model, loss, dataset
    class and histogram query), through the proxy's wire, with no change to fedfilter."""
    from examples.gn_regression import workload as example
    from tests.workload_fixtures import histogram, model_request, write_agent
    from workloads.models import parameter_count

    toml = write_agent(tmp_path, **{"agent-socket": str(tmp_path / "agent.sock")})
    proc = start(toml)
    try:
        wait_for_socket(proc, tmp_path / "agent.sock")
        described = status(tmp_path / "agent.sock")["workload"]
        assert described["name"] == "gn_regression" and described["models"] == ["gn_cnn"]
        code, reason, config, arrays = forward(str(tmp_path / "agent.sock"), wire.GRADIENT, *model_request())
        assert code == 0, reason
        d = parameter_count(example.WORKLOAD.build_model("gn_cnn", outputs=2))
        assert wire.ContributionReply.decode(config, arrays).total.shape == (d,)  # the gradient of its model
        code, reason, config, arrays = forward(str(tmp_path / "agent.sock"), wire.INDICATOR, *histogram())
        assert code == 0, reason
        assert wire.ContributionReply.decode(config, arrays).total.shape == (8,)  # one bin per histogram cell
    finally:
        assert stop(proc)[0] == 0
