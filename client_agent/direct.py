"""The agent called in the ClientApp's own process: simulations (Ray, in-process) and tests.

Here the ClientApp and the agent share a process, which is safe only where the app is not
someone else's bundle: one-machine simulations, whose coordinator side and clients are one
person's. A deployed node runs the proxy (:mod:`client_agent.client_app`) instead, and the
agent is the owner's own service (:mod:`client_agent.service`, privacy.md §10).

The agent's configuration comes from the node config (:func:`simulation_node_config` adds it
per partition). Flower's ``Context.state`` is never used for privacy state: it is in memory and
empty at every run; the ledger carries every spend (privacy.md §9).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from client_agent.agent import Agent, Outcome, fault_point, refusal
from client_agent.agent_cache import AgentCache, default_capacity
from client_agent.config import AgentConfigError, parse_agent_config
from client_agent.ledger import LedgerError
from protocol import messages as wire
from protocol.records import decode_content, encode_content

# Agents kept open between requests in this process (client_agent/agent_cache.py), as many as its
# descriptor limit allows: a simulation's Ray actor answers for every virtual client.
AGENTS = AgentCache(max_entries=default_capacity())


def answer_request(
    node_config: Mapping[str, Any],
    message_type: str,
    config: dict[str, Any],
    arrays: dict[str, np.ndarray],
    *,
    cache: AgentCache | None = AGENTS,
    simulation: bool = False,
) -> Outcome:
    """Everything the ClientApp does for one request, without Flower: open, answer, keep or close, then send.

    The agent comes from ``cache`` (kept open between requests in this process, see
    :mod:`client_agent.agent_cache`), or is opened and closed for this request alone when
    ``cache`` is None. The ``before_send`` fault point sits where the reply is handed to Flower.
    """
    try:
        if cache is not None:
            agent = cache.checkout(node_config, simulation=simulation)
        else:
            agent = Agent(parse_agent_config(node_config, simulation=simulation))
    except (AgentConfigError, LedgerError, ValueError, OSError) as exc:
        # Fixed text on the wire: a configuration or ledger message names the owner's files and
        # can carry the data's fingerprint (privacy.md §8); the details go to the client's log.
        return refusal(wire.ERR_LEDGER, message_type, config, exc)
    outcome: Outcome | None = None
    try:
        outcome = agent.handle(message_type, config, arrays)
    finally:
        reusable = outcome is not None and outcome.error_code not in (wire.ERR_LEDGER, wire.ERR_INTERNAL)
        if cache is not None:
            cache.checkin(node_config, agent, reusable=reusable, simulation=simulation)
        else:
            agent.close()
    fault_point("before_send")
    return outcome


def handle_message(msg: Message, context: Context, *, simulation: bool = False) -> Message:
    """The ClientApp handler: Flower message in, :func:`answer_request`, Flower message out."""
    try:
        req_config, req_arrays = decode_content(msg.content)
    except wire.ProtocolError as exc:
        outcome = refusal(wire.ERR_MALFORMED, msg.metadata.message_type, {}, exc)
        return Message(Error(code=outcome.error_code, reason=outcome.error_reason), reply_to=msg)
    outcome = answer_request(
        context.node_config, msg.metadata.message_type, req_config, req_arrays, simulation=simulation
    )
    if outcome.is_error:
        return Message(Error(code=outcome.error_code, reason=outcome.error_reason), reply_to=msg)
    assert outcome.config is not None and outcome.arrays is not None
    return Message(encode_content(outcome.config, outcome.arrays), reply_to=msg)


# Per-partition configs fetched from Ray's object store, kept in this process (a Ray actor answers for
# many virtual clients): keyed by the object's id (it embeds the job's id, new for every driver that
# connects to a cluster), the last few runs only.
_SHARED_CONFIGS: dict[bytes, Mapping[int, Mapping[str, Any]]] = {}
_SHARED_KEPT = 4


def _partition_configs(configs: Any) -> Mapping[int, Mapping[str, Any]]:
    """The mapping itself, or the one a Ray ``ObjectRef`` names, fetched once per process and run."""
    if isinstance(configs, Mapping):
        return configs
    key = configs.binary()
    found = _SHARED_CONFIGS.get(key)
    if found is None:
        import ray

        found = ray.get(configs)
        if not isinstance(found, Mapping):
            raise TypeError(f"simulation node configs: expected a mapping in Ray's object store, found {type(found)}")
        while len(_SHARED_CONFIGS) >= _SHARED_KEPT:
            _SHARED_CONFIGS.pop(next(iter(_SHARED_CONFIGS)))
        _SHARED_CONFIGS[key] = found
    return found


def simulation_node_config(per_partition: Mapping[int, Mapping[str, Any]] | Any) -> Callable[..., Message]:
    """A ClientApp mod that adds each simulated node's agent config, keyed by Flower's partition-id.

    ``per_partition``: the mapping, or a Ray ``ObjectRef`` to it (``ray.put``). Flower's Ray backend pickles
    the ClientApp, and so this mod, with every message it sends to an actor: a mapping of every node's
    config costs O(clients) per message (147 KB at 1,000 clients, 1.5 MB at 10,000), a reference O(1); each
    actor then fetches the mapping once (:mod:`simulations.engine` passes a reference).
    """

    def mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        pid = int(context.node_config["partition-id"])
        context.node_config.update(dict(_partition_configs(per_partition).get(pid, {})))
        return call_next(msg, context)

    return mod


def handle_simulated_message(msg: Message, context: Context) -> Message:
    """:func:`handle_message` for the simulation engine's ClientApp: seeded noise is admitted."""
    return handle_message(msg, context, simulation=True)


def register_handlers(client: ClientApp, *, simulation: bool = False) -> ClientApp:
    """Route the protocol's message types to :func:`handle_message` (secagg's steps included).

    ``simulation`` is set in code by the simulation engines only (never from a configuration):
    the deployed app (:data:`app`) refuses an agent configuration with ``noise-seed``.
    """
    handler = handle_simulated_message if simulation else handle_message
    client.train("gradient")(handler)
    client.query("indicator")(handler)
    client.query("monitor")(handler)
    client.query("status")(handler)
    for step in wire.SECAGG_STEPS:  # "query.secagg_keys" -> query("secagg_keys")
        client.query(step.split(".", 1)[1])(handler)
    return client


def build_client_app(mods: list[Callable[..., Message]] | None = None, *, simulation: bool = False) -> ClientApp:
    """A ClientApp with extra mods (simulations pass :func:`simulation_node_config` and ``simulation=True``)."""
    return register_handlers(ClientApp(mods=mods or []), simulation=simulation)
