"""A user's workload end to end: ``fedfilter simulate --workload`` on Flower's simulation engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations.cli import main

REF = "examples.gn_regression.workload:WORKLOAD"


@pytest.mark.flower
def test_example_workload_federation_on_flower(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Both sides load the same object: the agents from their node config's `workload`, the
    # coordinator from its run config; the GroupNorm CNN trains on MSE over two targets.
    out = tmp_path / "gn"
    assert main(["simulate", "--workload", REF, "--clients", "2", "--rounds", "3", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 3 and summary["task"] == "gradient"
    assert summary["simulation"]["workload"]["name"] == "gn_regression"
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert all(r["replies"] == 2 and not r["errors"] for r in rounds)  # every client answered every round
    assert all("mse" in r["metrics"] for r in rounds)  # the workload's own evaluation
    assert len(list((out / "ledgers").glob("client*.sqlite"))) == 2
    assert "Written to" in capsys.readouterr().out


def test_example_workload_in_process_and_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gn"
    argv = ["simulate", "--workload", REF, "--clients", "2", "--rounds", "2", "--engine", "inprocess"]
    assert main([*argv, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["privacy"]["unit"] == "record"
    assert main(["simulate", "--workload", "workloads.builtin:BUILTIN", "--out", str(tmp_path / "b")]) == 2
    assert "expected a workload with a demo hook" in capsys.readouterr().err
    assert main(["simulate", "--workload", "nope.module:W", "--out", str(tmp_path / "c")]) == 2
    assert "expected an importable module 'nope.module'" in capsys.readouterr().err
