"""The wire layout in Flower records, shared by both apps (pure conversion, no Flower runtime state).

Content of every message, both directions:
  RecordDict{ CONFIG: ConfigRecord(scalar fields), ARRAYS: ArrayRecord(named numpy arrays) }
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from protocol import messages as wire

Payload = tuple[dict[str, Any], dict[str, np.ndarray]]


def encode_content(config: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> RecordDict:
    """Flower content for a (config, arrays) pair."""
    return RecordDict(
        {
            wire.CONFIG: ConfigRecord(dict(config)),
            wire.ARRAYS: ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}),
        }
    )


def decode_content(content: RecordDict) -> Payload:
    """The (config, arrays) pair of a message's content; any other record is a ProtocolError."""
    extra = sorted(set(content.keys()) - {wire.CONFIG, wire.ARRAYS})
    if extra:
        raise wire.ProtocolError(f"message content: unexpected records {extra}; expected {[wire.CONFIG, wire.ARRAYS]}")
    config: dict[str, Any] = dict(content[wire.CONFIG]) if wire.CONFIG in content.config_records else {}
    arrays: dict[str, np.ndarray] = {}
    if wire.ARRAYS in content.array_records:
        for key, value in content.array_records[wire.ARRAYS].items():
            try:
                arrays[key] = value.numpy()
            except (ValueError, TypeError) as exc:  # garbage bytes, a pickled or non-numpy array
                raise wire.ProtocolError(f"array {key!r}: expected a numpy-serialised array, found: {exc}") from exc
    return config, arrays
