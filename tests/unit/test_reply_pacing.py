"""Reply pacing in ``fedfilter agent serve`` (client_agent/service.py ReplyPacer; privacy.md §8).

A reply's compute time depends on who stopped through the owner's model (a stopped record enters
as zeros, and max-pooling is faster on zeros: 523 ms with none of 2,000 records stopped against
461 ms with all, the paper's CNN). The service holds each reply until (1 + margin) x the slowest
like reply before it. These tests drive the pacer on a fake clock: what they check is the rule
(when a reply may leave), not the machine's timing.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from client_agent import service
from client_agent.config import DEFAULT_PACING_MARGIN, AgentConfigError, parse_agent_config
from client_agent.service import ReplyPacer, ServiceError
from tests.factories import node_config


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(service.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(service.time, "sleep", fake.sleep)
    return fake


def answer(pacer: ReplyPacer, clock: FakeClock, key: str, takes: float) -> float:
    """One request that takes ``takes`` seconds to answer; the time until its reply leaves."""
    started = clock.monotonic()
    clock.now += takes
    pacer.hold(key, started)
    return clock.now - started


def test_a_reply_leaves_no_sooner_than_the_slowest_like_reply_plus_the_margin(clock: FakeClock) -> None:
    pacer = ReplyPacer(0.25, None)
    key = ReplyPacer.key("alpha", "train.gradient")
    assert answer(pacer, clock, key, 3.0) == pytest.approx(3.0)  # the first after start: cold, sets no mark
    assert pacer.marks == {}
    assert answer(pacer, clock, key, 0.5) == pytest.approx(0.5)  # no mark yet: leaves when ready, sets the mark
    # Records stop, the natural time falls (zeros are faster): every reply still leaves at 0.625 s.
    for natural in (0.45, 0.3, 0.1, 0.0):
        assert answer(pacer, clock, key, natural) == pytest.approx(0.625)
    assert pacer.marks[key] == pytest.approx(0.5)  # faster replies never lower the mark
    assert answer(pacer, clock, key, 0.6) == pytest.approx(0.625)  # within the margin: held, the mark rises
    assert pacer.marks[key] == pytest.approx(0.6)
    assert answer(pacer, clock, key, 1.0) == pytest.approx(1.0)  # slower than every earlier one: leaves when ready
    assert answer(pacer, clock, key, 0.2) == pytest.approx(1.25)


def test_marks_are_per_federation_and_message_type_never_per_model(clock: FakeClock) -> None:
    pacer = ReplyPacer(0.25, None)
    alpha, beta = ReplyPacer.key("alpha", "train.gradient"), ReplyPacer.key("beta", "train.gradient")
    counts = ReplyPacer.key("alpha", "query.indicator")
    for key in (alpha, alpha, beta, counts):
        answer(pacer, clock, key, 2.0 if key == alpha else 0.1)
    assert pacer.marks == {alpha: pytest.approx(2.0)}  # beta's and the counts' first requests were cold
    assert answer(pacer, clock, beta, 0.1) == pytest.approx(0.1)  # beta's replies never wait for alpha's
    # The key takes no model field: a coordinator cannot mint a fresh, empty mark by varying an argument.
    assert ReplyPacer.key.__code__.co_argcount == 2


def test_marks_survive_a_restart_and_the_first_reply_after_it_is_held(clock: FakeClock, tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite.pacing.json"
    key = ReplyPacer.key("default", "train.gradient")
    first = ReplyPacer(0.25, path)
    answer(first, clock, key, 1.0)
    answer(first, clock, key, 0.8)
    assert json.loads(path.read_text()) == {key: pytest.approx(0.8)}
    restarted = ReplyPacer(0.25, path)
    assert answer(restarted, clock, key, 0.1) == pytest.approx(1.0)  # cold, yet held to the stored mark
    assert restarted.marks == {key: pytest.approx(0.8)}


@pytest.mark.parametrize(
    "text",
    ["not json", '{"k": -1}', '{"k": "slow"}', "[1, 2]", '{"k": NaN}', '{"k": true}', '{"k": 1' + "0" * 400 + "}"],
)
def test_a_corrupt_marks_file_stops_the_service_with_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "marks.json"
    path.write_text(text)
    with pytest.raises(ServiceError, match=f"reply pacing: expected .*{re.escape(str(path))}"):
        ReplyPacer(0.25, path)


def test_pacing_is_on_by_default_except_in_central_trust(tmp_path: Path) -> None:
    def margin(**over: object) -> float | None:
        values = node_config(tmp_path, **{"policy-min-noise-std": 1.0, "policy-max-clip": 1.0}) | over
        return parse_agent_config(values).reply_pacing_margin

    assert margin() == DEFAULT_PACING_MARGIN == 0.25
    assert margin(trust="central") is None  # the coordinator is trusted there (privacy.md §8)
    assert margin(**{"reply-pacing-margin": "off"}) is None
    assert margin(**{"reply-pacing-margin": 1}) == 1.0
    for bad in (-0.1, "fast", True, float("inf")):
        with pytest.raises(AgentConfigError, match='reply-pacing-margin: expected a number >= 0 or "off"'):
            margin(**{"reply-pacing-margin": bad})


def test_a_made_up_message_type_shares_one_key(clock: FakeClock) -> None:
    """Review 2: any string became a key kept for good (120 requests of 20 kB types: a 1.2 MB marks file)."""
    assert ReplyPacer.key("alpha", "x" * 20_000) == ReplyPacer.key("alpha", "other") == '["alpha", "?"]'
    assert ReplyPacer.key("alpha", "train.gradient") == '["alpha", "train.gradient"]'


def test_a_reply_that_raises_the_mark_still_leaves_at_the_deadline(
    clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 2: the marks were saved after the wait was computed, so a reply that set a new mark left
    late by the save's time (9-15 ms): "this one was slower than all before". The save now runs inside it."""
    pacer = ReplyPacer(0.25, tmp_path / "marks.json")
    key = ReplyPacer.key("alpha", "train.gradient")
    answer(pacer, clock, key, 1.0)  # cold
    answer(pacer, clock, key, 1.0)  # the mark: 1.0
    real_save = pacer._save

    def slow_save() -> None:
        clock.now += 0.05  # a save that takes 50 ms
        real_save()

    monkeypatch.setattr(pacer, "_save", slow_save)
    assert answer(pacer, clock, key, 1.1) == pytest.approx(1.25)  # sets the mark 1.1, leaves at the deadline
    assert answer(pacer, clock, key, 0.9) == pytest.approx(1.1 * 1.25)
    assert oct((tmp_path / "marks.json").stat().st_mode & 0o777) == oct(0o600)


def _serve_one(listener: service._Listener, endpoint: service._Endpoint, frame: bytes) -> tuple[int, dict[str, Any]]:
    """One connection through the listener's real path (a socket pair), its reply decoded."""
    import socket
    import threading

    from client_agent import local_wire

    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = threading.Thread(target=local_wire.send, args=(ours, frame), daemon=True)  # frames over the buffer
        sender.start()
        endpoint.slots.acquire()
        listener._serve_one(theirs, endpoint)
        sender.join(10)
        code, _, config, _ = local_wire.unpack_reply(local_wire.receive(ours, 1 << 20, deadline=time.monotonic() + 10))
    return code, config


def test_a_frame_that_does_not_decode_never_reaches_the_worker_or_its_pace(tmp_path: Path) -> None:
    # A review: each junk frame was answered on the one worker and held to the "?" mark (raised to 1.6 s by one
    # 34 MiB header), so twenty 4-byte frames from one federation held another's status reply 8 s, uncharged.
    # Such a frame never reaches the agent: it is refused on its connection's thread, unpaced, and sets no mark.
    import socket

    from client_agent import local_wire
    from protocol import messages as wire

    cfg = parse_agent_config(node_config(tmp_path), simulation=True)
    svc = service.AgentService(cfg)
    try:
        assert svc.pacer is not None
        submitted: list[object] = []
        real_submit = svc.worker.submit
        svc.worker.submit = lambda fn, *a: submitted.append(fn) or real_submit(fn, *a)  # type: ignore[method-assign]
        endpoint = service._Endpoint(cfg.served[0].name, socket.socket(socket.AF_UNIX), frozenset())
        listener = service._Listener(svc, [endpoint], service.max_request_bytes(cfg))
        big = local_wire.pack_request(wire.STATUS, {"x": "y" * (local_wire.MAX_REQUEST_HEADER_BYTES + 1)}, {})
        for junk in (b"", b"\x00\x01\x02\x03", big):
            code, _ = _serve_one(listener, endpoint, junk)
            assert code == wire.ERR_MALFORMED
        assert submitted == [] and svc.pacer.marks == {}
        status = wire.encode_request(wire.StatusRequest("s1", "run", 0))
        code, config = _serve_one(listener, endpoint, local_wire.pack_request(wire.STATUS, *status))
        assert code == 0 and config["request_id"] == "s1"
        assert submitted == [svc.paced]  # a request that decodes is answered on the worker, paced
        assert not any('"?"' in key for key in svc.pacer.marks)
        endpoint.sock.close()
    finally:
        svc.close()


def test_a_request_header_over_the_limit_is_refused_before_it_is_parsed() -> None:
    from client_agent import local_wire

    frame = local_wire.pack_request("status", {"x": "y" * local_wire.MAX_REQUEST_HEADER_BYTES}, {})
    with pytest.raises(local_wire.FrameError, match=r"expected a header of at most 1048576 bytes, found 10486"):
        local_wire.unpack_request(frame)
    header = {"x": "y" * (local_wire.MAX_REQUEST_HEADER_BYTES - 100)}
    assert local_wire.unpack_request(local_wire.pack_request("status", header, {}))[1] == header


def test_a_refusal_decided_before_the_answer_leaves_unpaced_and_an_answer_does_not(tmp_path: Path) -> None:
    # A malformed or policy refusal is decided from the request's fields, the configuration and the federation's
    # own counts (privacy.md §11): held to its kind's mark, a stream of them held the one worker from every other
    # federation, uncharged. A request that is answered is held, whatever its outcome.
    import socket

    from client_agent import local_wire
    from protocol import messages as wire
    from tests.factories import gradient_request

    cfg = parse_agent_config(node_config(tmp_path, **{"policy-min-noise-std": 1.0}), simulation=True)
    svc = service.AgentService(cfg)
    try:
        assert svc.pacer is not None
        held: list[str] = []
        svc.pacer.hold = lambda key, started: held.append(key) or 0.0  # type: ignore[method-assign]
        endpoint = service._Endpoint(cfg.served[0].name, socket.socket(socket.AF_UNIX), frozenset())
        listener = service._Listener(svc, [endpoint], service.max_request_bytes(cfg))

        def ask(config: dict[str, Any], arrays: dict[str, Any]) -> int:
            return _serve_one(listener, endpoint, local_wire.pack_request(wire.GRADIENT, config, arrays))[0]

        config, arrays = wire.encode_request(gradient_request("g1"))
        assert ask(config | {"noise_std": "two"}, arrays) == wire.ERR_MALFORMED
        assert ask(config | {"noise_std": 0.5}, arrays) == wire.ERR_POLICY  # under policy-min-noise-std
        assert held == []
        assert ask(config, arrays) == 0
        assert held == [ReplyPacer.key(cfg.served[0].name, wire.GRADIENT)]
        endpoint.sock.close()
    finally:
        svc.close()
