"""The coordinator's secagg session: a reply for another session or an error reply, at every step, is
counted by name and left out; a client's error text and per-client detail are never kept."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from client_agent.agent import Agent
from coordinator.secagg import SecaggRound, SecaggSettings, secagg_release
from coordinator.transport import Payload, RoundReplies, Transport
from protocol import messages as wire
from tests.factories import COUNT_NOISE_STD, count_request, secagg_agents


class OneNodeMisbehaves:
    """A transport over real agents in which ``node`` misbehaves at ``step`` (subclasses say how)."""

    def __init__(self, agents: Mapping[int, Agent], step: str, node: int) -> None:
        self.agents, self.step, self.node = dict(agents), step, node

    def node_ids(self, count: int, *, timeout: float) -> list[int]:
        return sorted(self.agents)[:count]


class ForgedSession(OneNodeMisbehaves):
    """The agents answer; one node's reply to ``step`` claims another session."""

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        out = RoundReplies()
        for node, (config, arrays) in payloads.items():
            outcome = self.agents[node].handle(message_type, dict(config), dict(arrays))
            assert not outcome.is_error and outcome.config is not None and outcome.arrays is not None
            reply = dict(outcome.config)
            if message_type == self.step and node == self.node:
                reply["session"] = "another:session"
            out.replies[node] = (reply, outcome.arrays)
        return out


def release(transport: Transport, nodes: list[int]) -> SecaggRound:
    """One counting session over ``nodes`` with m = 2."""
    return secagg_release(
        transport,
        run_id="run",
        rnd=1,
        purpose="indicator",
        nodes=nodes,
        settings=SecaggSettings(min_clients=3, scale_bits=24),
        kind=wire.INDICATOR,
        build=lambda node, s: count_request(s),
        size=1,
        noise_std=COUNT_NOISE_STD,
        timeout=1.0,
    )


STEP_PREFIX = {wire.SECAGG_KEYS: "secagg-keys-", wire.SECAGG_SHARES: "secagg-shares-", wire.INDICATOR: ""}


@pytest.mark.parametrize("step", [wire.SECAGG_KEYS, wire.SECAGG_SHARES, wire.INDICATOR, wire.SECAGG_UNMASK])
def test_a_reply_for_another_session_is_counted_and_left_out(tmp_path: Path, step: str) -> None:
    agents = secagg_agents(tmp_path, 4)
    forged = sorted(agents)[1]
    result = release(ForgedSession(agents, step, forged), sorted(agents))
    name = STEP_PREFIX.get(step, "secagg-unmask-") + "malformed-reply"
    assert result.replies.errors[name] == 1
    assert "another:session" not in repr(result.replies.errors) + repr(result.counts)  # counted, never quoted
    # Left out of the step it forged; the session still completes with the other three clients.
    assert result.total is not None


SECRET = "SECRET-PATH /home/x/data.npz sha256=abc"


class Refusing(OneNodeMisbehaves):
    """The agents answer; at ``step`` one node answers with a policy error whose reason holds SECRET."""

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        out = RoundReplies()
        for node, (config, arrays) in payloads.items():
            if message_type == self.step and node == self.node:
                out.error(wire.error_name(wire.ERR_POLICY), SECRET)
                continue
            outcome = self.agents[node].handle(message_type, dict(config), dict(arrays))
            assert not outcome.is_error and outcome.config is not None and outcome.arrays is not None
            out.replies[node] = (dict(outcome.config), outcome.arrays)
        return out


@pytest.mark.parametrize("step", [wire.SECAGG_KEYS, wire.SECAGG_SHARES, wire.INDICATOR, wire.SECAGG_UNMASK])
def test_an_error_reply_is_counted_by_code_and_its_text_is_not_kept(tmp_path: Path, step: str) -> None:
    agents = secagg_agents(tmp_path, 4)
    result = release(Refusing(agents, step, sorted(agents)[2]), sorted(agents))
    assert dict(result.replies.errors) == {STEP_PREFIX.get(step, "secagg-unmask-") + "policy": 1}
    assert result.total is not None  # three clients are enough for m = 2
    assert "SECRET" not in repr(result)


class TamperedUnmask(Refusing):
    """Every unmask answer has one seed-share byte flipped: the shares no longer reconstruct the seeds."""

    def __init__(self, agents: Mapping[int, Agent]) -> None:
        super().__init__(agents, "no step", 0)

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        out = super().send(message_type, payloads, timeout=timeout)
        if message_type == wire.SECAGG_UNMASK:
            for node, (config, arrays) in out.replies.items():
                shares = np.array(arrays["seed_shares"], copy=True)
                shares[0, 7] ^= 0x01
                out.replies[node] = (config, {**arrays, "seed_shares": shares})
        return out


def test_a_failed_unmask_aborts_with_the_coordinators_fixed_reason(tmp_path: Path) -> None:
    # The protocol's error names a client's roster index and what its reply held; the log says only what failed.
    agents = secagg_agents(tmp_path, 4)
    result = release(TamperedUnmask(agents), sorted(agents))
    assert result.total is None
    fixed = "the unmask step failed a consistency check (shares, commitments or masked inputs)"
    assert result.counts["aborted"] == fixed
    assert dict(result.replies.errors) == {"secagg-aborted": 1}
