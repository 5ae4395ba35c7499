"""An in-process transport: the real client agents answered by direct calls, without Flower's runtime.

For tests that repeat a whole federation over many seeds and for quick experiments; the
same agents run under Flower's simulation engine through ``fedfilter simulate``. Every
request goes through :func:`client_agent.direct.answer_request`, exactly the code the
ClientApp runs (open the ledger, answer, commit, close), so spends, replays and refusals are
the real ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from client_agent.direct import answer_request
from coordinator.transport import RoundReplies
from protocol import messages as wire
from protocol.records import Payload


class InProcessTransport:
    """Node ids 1001, 1002, ... for the per-node agent configurations, in order."""

    def __init__(self, node_configs: Mapping[int, Mapping[str, Any]]) -> None:
        self.configs = {1001 + i: dict(node_configs[pid]) for i, pid in enumerate(sorted(node_configs))}

    def node_ids(self, count: int, *, timeout: float) -> list[int]:
        if len(self.configs) < count:
            raise TimeoutError(f"expected {count} nodes, found {len(self.configs)}")
        return sorted(self.configs)[:count]

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        out = RoundReplies()
        for node, (config, arrays) in payloads.items():
            outcome = answer_request(self.configs[node], message_type, dict(config), dict(arrays), simulation=True)
            if outcome.is_error:
                out.error(wire.error_name(outcome.error_code), outcome.error_reason)
            else:
                assert outcome.config is not None and outcome.arrays is not None
                out.replies[node] = (outcome.config, outcome.arrays)
        return out
