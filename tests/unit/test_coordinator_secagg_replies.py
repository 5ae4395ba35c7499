"""The coordinator's secagg session refuses a reply that belongs to another session, at every step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from client_agent.agent import Agent
from client_agent.config import parse_agent_config
from coordinator.secagg import SecaggSettings, secagg_release
from coordinator.transport import Payload, RoundReplies
from protocol import messages as wire

SIGMA, CLIP = 10.0, 100.0


def make_agents(tmp_path: Path, n: int) -> dict[int, Agent]:
    out = {}
    for i in range(n):
        rng = np.random.default_rng(i)
        np.savez(tmp_path / f"data{i}.npz", x=rng.normal(size=(10, 3)).astype(np.float32), y=rng.integers(0, 2, 10))
        cfg = {
            "ledger-path": str(tmp_path / f"ledger{i}.sqlite"),
            "data-path": str(tmp_path / f"data{i}.npz"),
            "epsilon": 20.0,
            "delta": 1e-5,
            "unit": "client",
            "trust": "secagg",
            "noise-seed": 100 + i,
        }
        out[1000 + i] = Agent(parse_agent_config(cfg))
    return out


class ForgedSession:
    """The agents answer; one node's reply to ``step`` claims another session."""

    def __init__(self, agents: Mapping[int, Agent], step: str, node: int) -> None:
        self.agents, self.step, self.node = dict(agents), step, node

    def node_ids(self, count: int, *, timeout: float) -> list[int]:
        return sorted(self.agents)[:count]

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


@pytest.mark.parametrize("step", [wire.SECAGG_KEYS, wire.SECAGG_SHARES, wire.INDICATOR, wire.SECAGG_UNMASK])
def test_a_reply_for_another_session_is_counted_and_left_out(tmp_path: Path, step: str) -> None:
    agents = make_agents(tmp_path, 4)
    forged = sorted(agents)[1]
    transport = ForgedSession(agents, step, forged)

    def count_request(node: int, secagg: wire.SecaggInput) -> wire.IndicatorRequest:
        return wire.IndicatorRequest(
            "run:indicator:r1", "run", 1, SIGMA, CLIP, "secagg", "client", "label", 0, 1.0, secagg=secagg
        )

    result = secagg_release(
        transport,
        run_id="run",
        rnd=1,
        purpose="indicator",
        nodes=sorted(agents),
        settings=SecaggSettings(min_clients=2, scale_bits=24),
        kind=wire.INDICATOR,
        build=count_request,
        size=1,
        noise_std=SIGMA,
        timeout=1.0,
    )
    name = {wire.SECAGG_KEYS: "secagg-keys-", wire.SECAGG_SHARES: "secagg-shares-", wire.INDICATOR: ""}.get(
        step, "secagg-unmask-"
    ) + "malformed-reply"
    assert result.replies.errors[name] == 1
    assert any("another session" in reason for reason in result.replies.reasons)
    # Left out of the step it forged; the session still completes with the other three clients.
    assert result.total is not None
