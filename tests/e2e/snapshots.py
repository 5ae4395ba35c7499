"""What an agent's ledger holds at one moment, for the end-to-end tests to compare across kills and runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client_agent.ledger import Ledger


@dataclass(frozen=True)
class Snapshot:
    request_ids: frozenset[str]
    spent: np.ndarray
    stopped: np.ndarray


def snapshot(path: Path) -> Snapshot:
    with Ledger.open_existing(path) as ledger:
        state = ledger.state()
        ids = frozenset(request_id for request_id, _, _ in ledger.releases())
    return Snapshot(ids, state["spent"].copy(), state["stopped"].copy())
