"""The deployed Flower ClientApp: a thin proxy to the data owner's agent service (privacy.md §10).

Flower's deployment engine runs this code from the app bundle that the run's submitter (the
coordinator side) ships, so it must hold nothing of the client: it reads one node-config key,
``agent-socket`` (set by the SuperNode's operator: ``--node-config 'agent-socket="..."'``),
forwards each Message's records over that Unix socket to ``fedfilter agent serve`` and returns
the agent's reply. The data, the ledger, the policy and the filter live in the service, under
another OS user. It imports no torch and opens no file of the agent.

An agent that cannot be reached gets an error reply with fixed text (``agent unavailable``):
nothing reached the agent, so nothing was spent. If the agent answered but the reply was lost,
the charge stands and a retry with the same request id gets the stored reply (privacy.md §9).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from client_agent import local_wire
from protocol import messages as wire
from protocol.records import decode_content, encode_content

LOG = logging.getLogger("fedfilter.proxy")
SOCKET_KEY = "agent-socket"
# A request may take long (per-record gradients over a large silo); Flower's own message TTL applies too.
TIMEOUT_S = 3600.0


def forward(
    socket_path: str,
    message_type: str,
    config: dict[str, Any],
    arrays: dict[str, Any],
    *,
    timeout: float = TIMEOUT_S,
) -> tuple[int, str, dict[str, Any], dict[str, Any]]:
    """The agent's reply to one request sent over ``socket_path``: (error code, reason, config, arrays)."""
    frame = local_wire.pack_request(message_type, dict(config), dict(arrays))  # FrameError, TypeError: malformed
    return send_frame(socket_path, frame, timeout=timeout)


def send_frame(
    socket_path: str, frame: bytes, *, timeout: float = TIMEOUT_S
) -> tuple[int, str, dict[str, Any], dict[str, Any]]:
    """Send one packed request frame over ``socket_path`` and unpack the agent's reply.

    OSError (TimeoutError included) when the agent cannot be reached or does not answer in time;
    FrameError when the reply does not decode. The agent checks who connects (SO_PEERCRED): a caller
    it does not accept sees the connection closed (a FrameError: no reply).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        try:
            local_wire.send(sock, frame)
        except (BrokenPipeError, ConnectionResetError):
            # The agent answered before reading (told "busy" when all its slots are taken) and closed:
            # its reply is already in this socket's buffer; with none, receive raises below.
            pass
        reply = local_wire.receive(sock, local_wire.MAX_FRAME_BYTES)
    return local_wire.unpack_reply(reply)


def unavailable(msg: Message, detail: object) -> Message:
    LOG.warning("agent unavailable for %s: %s", msg.metadata.message_type, detail)
    return Message(Error(code=wire.ERR_UNAVAILABLE, reason=wire.ERROR_TEXT[wire.ERR_UNAVAILABLE]), reply_to=msg)


def proxy_message(msg: Message, context: Context) -> Message:
    """Forward one Message to the agent service named by the node config's ``agent-socket``."""
    socket_path = context.node_config.get(SOCKET_KEY)
    if not isinstance(socket_path, str) or not socket_path:
        return unavailable(msg, f"node config: expected {SOCKET_KEY!r} naming the agent's socket")
    try:
        config, arrays = decode_content(msg.content)
    except wire.ProtocolError:
        reason = wire.ERROR_TEXT[wire.ERR_MALFORMED]
        return Message(Error(code=wire.ERR_MALFORMED, reason=reason), reply_to=msg)
    try:
        frame = local_wire.pack_request(msg.metadata.message_type, dict(config), dict(arrays))
    except (local_wire.FrameError, TypeError, ValueError) as exc:  # e.g. bytes in the config, a reserved name
        LOG.warning("malformed %s request: %s", msg.metadata.message_type, exc)
        return Message(Error(code=wire.ERR_MALFORMED, reason=wire.ERROR_TEXT[wire.ERR_MALFORMED]), reply_to=msg)
    try:
        code, reason, reply_config, reply_arrays = send_frame(socket_path, frame)  # packed once, above
    except (local_wire.FrameError, OSError) as exc:
        return unavailable(msg, exc)
    if code != 0:
        return Message(Error(code=code, reason=reason), reply_to=msg)
    return Message(encode_content(reply_config, reply_arrays), reply_to=msg)


def register_proxy(client: ClientApp) -> ClientApp:
    """Route every message type of the protocol (secagg's steps included) to :func:`proxy_message`."""
    client.train("gradient")(proxy_message)
    for name in ("indicator", "monitor", "status"):
        client.query(name)(proxy_message)
    for step in wire.SECAGG_STEPS:  # "query.secagg_keys" -> query("secagg_keys")
        client.query(step.split(".", 1)[1])(proxy_message)
    return client


app = ClientApp()
register_proxy(app)
