"""The Flower ClientApp: thin wiring from Flower messages to :class:`client_agent.agent.Agent`.

The agent's configuration comes from Flower's node config (deployment: ``--node-config``;
simulation: :func:`simulation_node_config` adds it per partition). Flower's
``Context.state`` is never used for privacy state: it is in memory and empty at every
run; the ledger carries every spend (privacy.md §9).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from client_agent.agent import Agent, Outcome, fault_point
from client_agent.agent_cache import AgentCache
from client_agent.config import AgentConfigError, parse_agent_config
from client_agent.ledger import LedgerError
from protocol import messages as wire
from protocol.records import decode_content, encode_content

# Agents kept open between requests in this process (client_agent/agent_cache.py).
AGENTS = AgentCache()


def answer_request(
    node_config: Mapping[str, Any],
    message_type: str,
    config: dict[str, Any],
    arrays: dict[str, np.ndarray],
    *,
    cache: AgentCache | None = AGENTS,
) -> Outcome:
    """Everything the ClientApp does for one request, without Flower: open, answer, keep or close, then send.

    The agent comes from ``cache`` (kept open between requests in this process, see
    :mod:`client_agent.agent_cache`), or is opened and closed for this request alone when
    ``cache`` is None. The ``before_send`` fault point sits where the reply is handed to Flower.
    """
    try:
        agent = cache.checkout(node_config) if cache is not None else Agent(parse_agent_config(node_config))
    except AgentConfigError as exc:
        return Outcome(error_code=wire.ERR_LEDGER, error_reason=f"agent configuration: {exc}")
    except (LedgerError, ValueError, OSError) as exc:
        return Outcome(error_code=wire.ERR_LEDGER, error_reason=str(exc))
    outcome: Outcome | None = None
    try:
        outcome = agent.handle(message_type, config, arrays)
    finally:
        reusable = outcome is not None and outcome.error_code not in (wire.ERR_LEDGER, wire.ERR_INTERNAL)
        if cache is not None:
            cache.checkin(node_config, agent, reusable=reusable)
        else:
            agent.close()
    fault_point("before_send")
    return outcome


def handle_message(msg: Message, context: Context) -> Message:
    """The ClientApp handler: Flower message in, :func:`answer_request`, Flower message out."""
    try:
        req_config, req_arrays = decode_content(msg.content)
    except wire.ProtocolError as exc:
        return Message(Error(code=wire.ERR_MALFORMED, reason=str(exc)), reply_to=msg)
    outcome = answer_request(context.node_config, msg.metadata.message_type, req_config, req_arrays)
    if outcome.is_error:
        return Message(Error(code=outcome.error_code, reason=outcome.error_reason), reply_to=msg)
    assert outcome.config is not None and outcome.arrays is not None
    return Message(encode_content(outcome.config, outcome.arrays), reply_to=msg)


def simulation_node_config(per_partition: Mapping[int, Mapping[str, Any]]) -> Callable[..., Message]:
    """A ClientApp mod that adds each simulated node's agent config, keyed by Flower's partition-id."""

    def mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        pid = int(context.node_config["partition-id"])
        context.node_config.update(dict(per_partition.get(pid, {})))
        return call_next(msg, context)

    return mod


def register_handlers(client: ClientApp) -> ClientApp:
    """Route the protocol's message types to :func:`handle_message` (secagg's steps included)."""
    client.train("gradient")(handle_message)
    client.query("indicator")(handle_message)
    client.query("monitor")(handle_message)
    client.query("status")(handle_message)
    for step in wire.SECAGG_STEPS:  # "query.secagg_keys" -> query("secagg_keys")
        client.query(step.split(".", 1)[1])(handle_message)
    return client


def build_client_app(mods: list[Callable[..., Message]] | None = None) -> ClientApp:
    """A ClientApp with extra mods (simulations pass :func:`simulation_node_config`)."""
    return register_handlers(ClientApp(mods=mods or []))


app = ClientApp()
register_handlers(app)
