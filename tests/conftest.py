"""Fixtures shared by the whole suite, built on the factories in tests/factories.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client_agent.ledger import Ledger
from tests.factories import fresh_ledger_state, ledger_config


@pytest.fixture
def tmp_ledger(tmp_path: Path) -> Iterator[Ledger]:
    """A new, open ledger (:func:`tests.factories.ledger_config`, nothing spent) at tmp_path/ledger.sqlite."""
    with Ledger.open(tmp_path / "ledger.sqlite", ledger_config(), initial_state=fresh_ledger_state()) as ledger:
        yield ledger


@pytest.fixture
def no_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The secagg noise share patched to zero, so a decoded sum is the plain sum of the encoded contributions."""
    from protocol import secagg as sa

    monkeypatch.setattr(sa, "rounded_gaussian", lambda rng, *, noise_std, scale_bits, size: np.zeros(size, np.int64))
