"""``fedfilter simulate``: outputs, plots, ledgers and the headline, through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations.cli import main


def test_sparse_queries_preset_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert (
        main(["simulate", "--preset", "sparse-queries", "--rounds", "30", "--engine", "inprocess", "--out", str(out)])
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["queries_answered"] == 30 and summary["worst_case_queries"] >= 1
    assert len((out / "rounds.jsonl").read_text().splitlines()) == 30
    assert {p.name for p in out.glob("*.png")} == {"metrics.png", "active_units.png"}
    assert len(list((out / "ledgers").glob("client*.sqlite"))) == 10
    assert "Queries answered: 30" in capsys.readouterr().out
    assert main(["ledger", "show", str(out / "ledgers" / "client0.sqlite"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["requests_answered"] == 30


def test_bad_simulate_option_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--noise-std", "-1"]) == 2
    assert "--noise-std: expected a finite number > 0, got -1.0" in capsys.readouterr().err


@pytest.mark.flower
def test_quickstart_on_flower(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "qs"
    assert main(["simulate", "--rounds", "6", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["simulation"]["engine"] == "flower"
    assert summary["privacy"]["epsilon"] == 1.0 and summary["privacy"]["unit"] == "record"
    active = summary["simulation"]["active_units_per_round"]
    worst = summary["simulation"]["worst_case_rounds"]
    assert summary["rounds_completed"] > worst  # the run went on past the worst-case stop
    assert active[worst] == active[0]  # nobody could have run out by then, exactly as accounted
    printed = capsys.readouterr().out
    assert "Test accuracy at the worst-case stop" in printed
