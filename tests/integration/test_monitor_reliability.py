"""A monitor that cannot tell the population from its threshold says so before the run (issue 24)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from simulations.presets.base import Options
from simulations.presets.run import headline, simulate


def test_the_cross_device_quickstart_warns_that_its_monitor_cannot_tell_20_from_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Client units with local training on 20 clients: the SVT monitor (epsilon 0.1, threshold 2) stops
    a run with everybody active about half the time within 3 rounds; the user hears it before round 1."""
    caplog.set_level(logging.WARNING, logger="fedfilter.coordinator")
    opts = Options(
        clients=20,
        rounds=1,
        unit="client",
        trust="central",
        local_steps=5,
        local_lr=0.5,
        local_batch_size=16,
        engine="inprocess",
        out=str(tmp_path / "run"),
    )
    summary = simulate("quickstart", opts)
    reliability = summary["monitor_reliability"]
    assert (reliability["epsilon"], reliability["threshold"], reliability["population"]) == (0.1, 2, 20)
    assert reliability["false_stop"] > 0.25 and not reliability["separates"]
    warned = [r.getMessage() for r in caplog.records if r.name == "fedfilter.coordinator"]
    assert any("cannot tell 20 active units from its threshold of 2" in m for m in warned)
    assert any(line.startswith("Warning: the monitor cannot tell 20") for line in headline(summary))
