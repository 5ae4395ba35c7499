"""How the coordinator talks to client agents: one request per node per round, replies by node.

:class:`FlowerTransport` does it over a Flower ``Grid`` (simulation or deployment). The
round logic in :mod:`coordinator.rounds` sees only (config, arrays) pairs in the layout of
:mod:`protocol.messages`, so the same logic runs over any transport that keeps this
contract (tests pass a scripted one).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from flwr.app import Message
from flwr.serverapp import Grid

from protocol import messages as wire
from protocol.records import Payload, decode_content, encode_content


@dataclass
class RoundReplies:
    """A round's replies by node; error replies counted by code name; the number missing.

    Privacy: an Error reply's reason is the client's own text and may carry data-dependent
    detail (a ledger hash, a path, a fingerprint), so it is never kept: only the code's name
    (:func:`protocol.messages.error_name`) or the coordinator's own fixed name is counted.
    """

    replies: dict[int, Payload] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    missing: int = 0

    def error(self, name: str, reason: str = "") -> None:
        """Count one error under ``name``; ``reason`` (the client's text) is dropped, never stored."""
        self.errors[name] += 1


class Transport(Protocol):
    def node_ids(self, count: int, *, timeout: float) -> list[int]: ...

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies: ...


class FlowerTransport:
    """Requests as Flower messages over a ``Grid``; replies mapped by ``reply_to_message_id``.

    Mapping by reply id, not ``src_node_id``: errors the SuperLink generates come from node 1
    (architecture.md).
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def node_ids(self, count: int, *, timeout: float) -> list[int]:
        """Node ids once ``count`` nodes are connected (in simulation the grid starts empty)."""
        start = time.monotonic()
        while True:
            ids = sorted(self.grid.get_node_ids())
            if len(ids) >= count:
                return ids[:count]
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"expected {count} connected nodes within {timeout} s, found {len(ids)}")
            time.sleep(0.1)

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        messages = {node: Message(encode_content(*payload), node, message_type) for node, payload in payloads.items()}
        got = self.grid.send_and_receive(list(messages.values()), timeout=timeout)
        by_id = {msg.metadata.message_id: node for node, msg in messages.items()}  # ids are set when sent
        out = RoundReplies()
        for reply in got:
            node = by_id.get(reply.metadata.reply_to_message_id)
            if node is None or node in out.replies:
                out.error("unmatched")  # a reply to no request of this round
                continue
            if reply.has_error():
                out.error(wire.error_name(reply.error.code))
                continue
            try:
                out.replies[node] = decode_content(reply.content)
            except Exception:  # a reply Flower delivered but whose records do not decode
                out.error("malformed-reply")
        answered = len(out.replies) + sum(out.errors.values()) - out.errors["unmatched"]
        out.missing = len(payloads) - answered
        return out
