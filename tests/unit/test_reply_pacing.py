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
from pathlib import Path

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
