"""A monitor that cannot tell the population from its threshold says so before the run (issue 24)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.rounds import run
from simulations.inprocess import InProcessTransport
from tests.factories import federation


def test_an_svt_monitor_that_cannot_tell_20_from_2_warns_before_round_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Client units with local training on 20 clients: the SVT monitor (epsilon 0.1, threshold 2) stops a
    run with everybody active most of the time; the user hears it before round 1 and in the summary.
    (The quickstart no longer runs such a monitor: tests/integration/test_model_selection_federation.py.)"""
    caplog.set_level(logging.WARNING, logger="fedfilter.coordinator")
    per, _, _ = federation(
        tmp_path,
        clients=20,
        records=10,
        features=4,
        seed=0,
        separation=2.0,
        epsilon=1.0,
        delta=1e-5,
        unit="client",
        trust="central",
        monitor="svt",
        monitor_epsilon=0.1,
        noise_seed=1,
    )
    cfg = CoordinatorConfig(
        num_nodes=20,
        n_public=20,
        rounds=1,
        noise_std=8.0,
        l2_clip=1.0,
        trust="central",
        unit="client",
        model="logreg",
        model_args=json.dumps({"in_features": 4, "n_classes": 2}),
        monitor="svt",
        monitor_epsilon=0.1,
        monitor_threshold=2,
        local_steps=2,
        local_lr=0.5,
        local_batch_size=5,
        noise_seed=2,
        progress=False,
    )
    summary = run(InProcessTransport(per), cfg)
    reliability = summary["monitor_reliability"]
    assert (reliability["epsilon"], reliability["threshold"], reliability["population"]) == (0.1, 2, 20)
    assert reliability["false_stop"] > 0.25 and not reliability["separates"]
    warned = [r.getMessage() for r in caplog.records if r.name == "fedfilter.coordinator"]
    assert any("cannot tell 20 active units from its threshold of 2" in m for m in warned)
    assert reliability["warning"].startswith("the monitor cannot tell 20")
