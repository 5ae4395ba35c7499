"""The local socket's framing between the ClientApp proxy and the agent service (privacy.md §10).

One request and one reply per connection over a Unix domain socket, each sent as a length-prefixed
frame (``MAGIC``, an 8-byte big-endian length, the bytes): the receiver knows a frame's size before
it reads a byte of it, so it refuses one above its bound at no cost. Each frame is an ``.npz``
archive (numpy, ``allow_pickle=False``: nothing in a frame can name or carry code) holding a
JSON header under ``__header__`` and the message's named arrays:

- request header: ``{"message_type": str, "config": {scalar fields}}``;
- reply header: ``{"error_code": int, "error_reason": str, "config": {scalar fields}}``.

This module imports numpy and the standard library only: the proxy in the app bundle imports
it, and the bundle must stay light (no torch) and hold nothing of the agent.
"""

from __future__ import annotations

import io
import json
import socket
import struct
import time
from typing import Any

import numpy as np
from numpy.typing import NDArray

from protocol.errors import FedfilterError
from protocol.messages import WIRE_MAX_VALUES
from protocol.npz import ArchiveError, load_stored

HEADER = "__header__"
MAGIC = b"FFA1"
_PREFIX = struct.Struct(">4sQ")
# The largest reply the proxy accepts: the wire's largest array (2^28 values) in float64, a central-trust
# reply's dtype (protocol.messages.reply_dtype), plus headroom. The agent's bound on *requests* is its own,
# from its policy (client_agent.service.max_request_bytes).
MAX_FRAME_BYTES = 8 * WIRE_MAX_VALUES + (1 << 20)
# A request's header holds scalar fields (strings of at most 256 characters); a larger one is refused before
# it is parsed, which held the GIL (a 34 MiB header took 1.6 s, a review)
MAX_REQUEST_HEADER_BYTES = 1 << 20
MAX_MEMBERS = 32  # the header and the arrays of the largest message (a secagg step has a handful)


class FrameError(FedfilterError, ValueError):
    """A frame that does not decode (wrong archive, header or array)."""


class FrameTooLarge(FrameError):
    """A frame whose announced length is above the receiver's bound: refused before it is read."""


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("frame: the deadline for the whole frame passed")
    return left


def send(sock: socket.socket, frame: bytes, *, deadline: float | None = None) -> None:
    """Send one length-prefixed frame; ``deadline`` (``time.monotonic()``) bounds the whole send."""
    view = memoryview(_PREFIX.pack(MAGIC, len(frame)) + frame) if len(frame) < 65536 else None
    parts = [view] if view is not None else [memoryview(_PREFIX.pack(MAGIC, len(frame))), memoryview(frame)]
    for part in parts:
        sent = 0
        while sent < len(part):
            if deadline is not None:  # else the socket's own timeout applies per call
                sock.settimeout(_remaining(deadline))
            sent += sock.send(part[sent:])


def _read_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; a slow sender cannot stretch it past ``deadline`` (a total, not a per-call, limit)."""
    got = 0
    while got < len(view):
        if deadline is not None:  # else the socket's own timeout applies per call
            sock.settimeout(_remaining(deadline))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise FrameError(f"frame: expected {len(view)} bytes, found the connection closed after {got}")
        got += n


def announced(sock: socket.socket, *, deadline: float | None = None) -> int:
    """The length the next frame announces (its prefix read, nothing more); FrameError on a bad prefix."""
    prefix = bytearray(_PREFIX.size)
    _read_exactly(sock, memoryview(prefix), deadline)
    magic, length = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(f"frame: expected the prefix {MAGIC!r}, found {bytes(magic)!r}")
    return int(length)


def receive(sock: socket.socket, max_bytes: int, *, deadline: float | None = None) -> bytearray:
    """One frame, read into one buffer of its announced size; above ``max_bytes`` it is never read."""
    length = announced(sock, deadline=deadline)
    if length > max_bytes:
        raise FrameTooLarge(f"frame: expected at most {max_bytes} bytes, found {length} announced")
    buf = bytearray(length)
    _read_exactly(sock, memoryview(buf), deadline)
    return buf


def _pack(header: dict[str, Any], arrays: dict[str, NDArray[Any]]) -> bytes:
    if HEADER in arrays:
        raise FrameError(f"arrays: the name {HEADER!r} is reserved for the frame's header")
    buf = io.BytesIO()
    text = json.dumps(header, sort_keys=True, allow_nan=True).encode()
    members: dict[str, Any] = {HEADER: np.frombuffer(text, dtype=np.uint8), **arrays}
    np.savez(buf, **members)
    return buf.getvalue()


def _unpack(frame: bytes | bytearray, max_header: int | None = None) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
    """Decode a frame from the other side of the socket, which the data owner does not control.

    :func:`protocol.npz.load_stored` checks it before anything is inflated or allocated: at most
    ``MAX_MEMBERS`` stored (never compressed) ``.npy`` members, each one's declared shape matching
    its bytes, each array a view of the frame's bytes (decoding costs at most the frame's own size);
    then a header of plain JSON. A hostile frame (a decompression bomb, a huge declared shape,
    thousands of members, a deeply nested header) is a FrameError, never a crash or a stall.
    """
    try:
        members = load_stored(frame, what="frame", max_members=MAX_MEMBERS)
        raw = members.pop(HEADER)
        if max_header is not None and raw.nbytes > max_header:
            raise FrameError(f"frame: expected a header of at most {max_header} bytes, found {raw.nbytes}")
        header = json.loads(bytes(raw).decode())
    except FrameError:
        raise
    except ArchiveError as exc:
        raise FrameError(str(exc)) from exc
    except KeyError as exc:
        raise FrameError(f"frame: expected a {HEADER!r} member, found none") from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FrameError(f"frame: expected a JSON header, found: {type(exc).__name__}") from exc
    except Exception as exc:  # numpy's header parser raises TokenError, SyntaxError, NotImplementedError
        raise FrameError(f"frame: expected a stored .npz archive, found: {type(exc).__name__}") from exc
    if not isinstance(header, dict):
        raise FrameError(f"frame: expected a JSON object as header, found {type(header).__name__}")
    return header, members


def pack_request(message_type: str, config: dict[str, Any], arrays: dict[str, NDArray[Any]]) -> bytes:
    return _pack({"message_type": message_type, "config": config}, arrays)


def unpack_request(frame: bytes | bytearray) -> tuple[str, dict[str, Any], dict[str, NDArray[Any]]]:
    header, arrays = _unpack(frame, MAX_REQUEST_HEADER_BYTES)
    message_type, config = header.get("message_type"), header.get("config")
    if not isinstance(message_type, str) or not isinstance(config, dict):
        raise FrameError("request frame: expected a header with 'message_type' (str) and 'config' (object)")
    return message_type, config, arrays


def pack_reply(
    error_code: int, error_reason: str, config: dict[str, Any] | None, arrays: dict[str, NDArray[Any]] | None
) -> bytes:
    return _pack({"error_code": error_code, "error_reason": error_reason, "config": config or {}}, arrays or {})


def unpack_reply(frame: bytes | bytearray) -> tuple[int, str, dict[str, Any], dict[str, NDArray[Any]]]:
    header, arrays = _unpack(frame)
    code, reason, config = header.get("error_code"), header.get("error_reason"), header.get("config")
    if (
        isinstance(code, bool)
        or not isinstance(code, int)
        or not isinstance(reason, str)
        or not isinstance(config, dict)
    ):
        raise FrameError("reply frame: expected 'error_code' (int), 'error_reason' (str) and 'config' (object)")
    return code, reason, config, arrays
