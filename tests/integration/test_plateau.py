"""The private plateau stop: a noisy training-accuracy count, charged by every unit's filter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from coordinator.rounds import run
from simulations.inprocess import InProcessTransport
from tests import factories


def federation(root: Path) -> dict:
    per, _, _ = factories.federation(
        root,
        clients=3,
        records=20,
        features=4,
        seed=1,
        separation=2.0,
        epsilon=4.0,
        delta=1e-5,
        unit="record",
        trust="local",
        noise_seed=2,
    )
    return per


def spent_and_answered(per: dict) -> tuple[np.ndarray, int]:
    spent, answered = [], 0
    for pid in per:
        with Ledger.open_existing(Path(per[pid]["ledger-path"])) as ledger:
            spent.append(ledger.state()["spent"])
            answered += ledger.requests_answered()
    return np.concatenate(spent), answered


def test_plateau_stops_and_is_charged(tmp_path: Path) -> None:
    common = dict(
        num_nodes=3,
        n_public=60,
        rounds=10,
        noise_std=4.0,
        l2_clip=1.0,
        learning_rate=1.0,
        unit="record",
        model="logreg",
        model_args=json.dumps({"in_features": 4, "n_classes": 2}),
        progress=False,
    )
    # min_delta 0.9: no later check can improve on the first, so the run stops at the third check.
    cfg = CoordinatorConfig(**common, plateau_every=1, plateau_patience=2, plateau_min_delta=0.9)
    per = federation(tmp_path / "plateau")
    summary = run(InProcessTransport(per), cfg)
    assert summary["stopped_because"] == "plateau" and summary["rounds_completed"] == 3
    assert all("train_accuracy_private" in r["metrics"] for r in summary["rounds"])
    spent, answered = spent_and_answered(per)
    assert answered == 3 * 2 * 3  # three rounds, a gradient and an accuracy request each, three clients

    plain = federation(tmp_path / "plain")
    run(InProcessTransport(plain), CoordinatorConfig(**(common | {"rounds": 3})))
    spent_plain, answered_plain = spent_and_answered(plain)
    assert answered_plain == 3 * 3
    assert np.all(spent >= spent_plain) and spent.sum() > spent_plain.sum()  # the accuracy counts were paid for
