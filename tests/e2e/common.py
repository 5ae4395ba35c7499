"""Shared by the end-to-end tests: the agents' data, and what a ledger holds at one moment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from client_agent.ledger import Ledger


def cannot_run(reason: str) -> None:
    """Skip with ``reason``; under CI=true fail with it instead: CI must run this test, never skip it."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"this test must run in CI and cannot: {reason}")
    pytest.skip(reason)


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


def make_parts(
    agents: int, records: int, *, seed: int, small_half: bool = False
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each agent's records: 4 features, label = first feature > 0; ``small_half``: the second half's
    gradients are small, so those units outlive the first run."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(agents):
        x = rng.normal(size=(records, 4)).astype(np.float32)
        if small_half:
            x[records // 2 :] *= 0.01
        parts.append((x, (x[:, 0] > 0).astype(np.int64)))
    return parts
