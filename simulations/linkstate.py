"""Flower's in-memory LinkState with an index of undelivered messages per node: the simulation engine in O(N).

Flower's simulation engine (``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``) asks the
LinkState, every 0.1 s, for the next message of *every* virtual node, and ``InMemoryLinkState.get_message_ins``
answers each question by scanning *every* stored message under the state's lock (Flower's reviewers call
it "horrible" in flwrlabs/flower#4993). With N nodes and one message each a sweep is N x N checks: about
3 s at 1,000 nodes and minutes at 10,000, with the lock held against the replies. That, not the clients'
work, is what made plain Flower cost 41 ms a client at 1,000 clients (docs/results.md).

:class:`IndexedInMemoryLinkState` keeps, per destination node, the ids of its undelivered messages in the
order they were stored, and answers ``get_message_ins`` from that index with the same checks, in the same
order, as Flower's scan: the expiry and federation check (``_check_stored_messages``) on each candidate, then
the node, run and not-yet-delivered conditions, then ``delivered_at`` stamped on what it returns. Every
other method is Flower's. One difference in bookkeeping, not in what is handed out: Flower's scan drops any
node's expired messages it passes, the index drops a node's own when that node is polled (every node, every
0.1 s) and the grid's pull drops those it asks about. The swap applies to Flower's own ``run_simulation``
(:func:`indexed_link_state`), for fedfilter's runs and for the plain Flower app its benchmark compares with alike.

Nothing here touches what a client computes, charges or releases: the state holds Flower's messages and
their order of delivery only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flwr.app import Message
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

_swap_lock = threading.Lock()


def _indexed_class() -> type[InMemoryLinkState]:
    from flwr.server.superlink.linkstate import in_memory_linkstate
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    class IndexedInMemoryLinkState(InMemoryLinkState):
        """``InMemoryLinkState`` whose ``get_message_ins`` reads a per-node index instead of every message."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # node id -> ids of messages stored for it and not yet handed out, in storage order
            self.undelivered: dict[int, dict[str, None]] = {}

        def store_message_ins(self, message: Message) -> str | None:
            message_id = super().store_message_ins(message)
            if message_id is None:
                return None
            with self.lock:
                stored = self.message_ins_store.get(message_id)
                if stored is not None and stored.metadata.delivered_at == "":
                    self.undelivered.setdefault(stored.metadata.dst_node_id, {})[message_id] = None
            return message_id

        def get_message_ins(self, node_id: int, limit: int | None, *, run_id: int | None = None) -> list[Message]:
            if limit is not None and limit < 1:
                raise AssertionError("`limit` must be >= 1")
            found: list[Message] = []
            if not self.undelivered.get(node_id):  # most nodes, most of the time: nothing waits (a racy read
                return found  # of one dict; a message stored meanwhile is found by the next sweep, 0.1 s on)
            with self.lock:
                pending = self.undelivered.get(node_id)
                for msg_id in list(pending or ()):
                    self._check_stored_messages({msg_id})
                    msg = self.message_ins_store.get(msg_id)
                    if msg is None or msg.metadata.delivered_at != "" or msg.metadata.dst_node_id != node_id:
                        pending.pop(msg_id, None)  # type: ignore[union-attr]  # deleted, expired or handed out
                        continue
                    if run_id is not None and msg.metadata.run_id != run_id:
                        continue
                    found.append(msg)
                    if limit and len(found) == limit:
                        break
                clock = getattr(in_memory_linkstate, "now")  # noqa: B009  # Flower's clock, as its scan stamps
                delivered_at = clock().isoformat()
                for msg in found:
                    msg.metadata.delivered_at = delivered_at
                    pending.pop(msg.metadata.message_id, None)  # type: ignore[union-attr]
                if pending is not None and not pending:
                    del self.undelivered[node_id]
            return found

    return IndexedInMemoryLinkState


@contextlib.contextmanager
def indexed_link_state() -> Iterator[None]:
    """Within the block, Flower's ``run_simulation`` builds an :class:`IndexedInMemoryLinkState`.

    Flower's LinkState factory names ``InMemoryLinkState`` at module level; the block rebinds that name and
    restores it on the way out. One block at a time in a process (a lock), as ``run_simulation`` is.
    """
    from flwr.server.superlink.linkstate import linkstate_factory

    with _swap_lock:
        stock = getattr(linkstate_factory, "InMemoryLinkState")  # noqa: B009  # not re-exported for type checkers
        setattr(linkstate_factory, "InMemoryLinkState", _indexed_class())  # noqa: B010
        try:
            yield
        finally:
            setattr(linkstate_factory, "InMemoryLinkState", stock)  # noqa: B010
