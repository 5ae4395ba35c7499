"""``fedfilter simulate``: outputs, plots, ledgers and the headline, through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


# On request (`pytest -m slow`): `fedfilter simulate` on Flower runs in tests/integration/test_workload_simulation.py,
# the quickstart in process in tests/integration/test_local_training_federation.py.
@pytest.mark.slow
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


def test_mnist_gd_preset_builds_its_federation(tmp_path: Path) -> None:
    # The plan only (a full run is paper-scale): 60,000 MNIST records over 10 clients, CNN-shaped inputs.
    from simulations.datasets.idx import default_data_dir
    from simulations.presets.base import Options
    from simulations.presets.mnist_gd import mnist_gd

    if not (default_data_dir() / "mnist").is_dir():
        pytest.skip("no local MNIST copy (../shared/data)")
    plan = mnist_gd(Options(out=str(tmp_path)), tmp_path)
    assert plan.cfg.n_public == 60_000 and plan.cfg.model == "opacus_mnist_cnn"
    sizes = [len(np.load(node["data-path"])["y"]) for node in plan.clients.values()]
    assert len(sizes) == 10 and sum(sizes) == 60_000
    assert np.load(plan.clients[0]["data-path"])["x"].shape[1:] == (1, 28, 28)
    # 26,010: the Opacus MNIST CNN's parameter count (tests/unit/test_gradients.py::test_opacus_cnn_layout).
    assert plan.evaluate is not None and set(plan.evaluate(np.zeros(26_010, np.float32))) == {"accuracy", "loss"}


def test_missing_dataset_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--preset", "mnist-gd", "--data-dir", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "fedfilter simulate: error:" in err and "file not found" in err and "--download" in err


def test_simulate_never_reuses_ledgers_that_hold_spend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    args = ["simulate", "--preset", "sparse-queries", "--rounds", "3", "--engine", "inprocess", "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2  # a second run over the first one's ledgers would read as a budget reset
    assert "already holds 10 client ledgers from an earlier run" in capsys.readouterr().err


def test_quickstart_epsilon_must_exceed_its_monitor_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--epsilon", "0.1", "--engine", "inprocess", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "--epsilon: the quickstart reserves epsilon 0.1 for its monitor in central trust" in err
    assert "got 0.1" in err and not (tmp_path / "q" / "clients").exists()


def test_the_main_command_greets_nobody_with_third_party_deprecations() -> None:
    """Flower's `run_simulation` banner is dropped while the engine runs it; Ray gets its future default."""
    import logging
    import os

    from simulations.engine import _NoRunSimulationDeprecation

    def record(text: str) -> logging.LogRecord:
        return logging.LogRecord("flwr", logging.WARNING, __file__, 1, text, None, None)

    quiet = _NoRunSimulationDeprecation()
    banner = "DEPRECATED FEATURE: The `run_simulation` function is deprecated and will be removed"
    assert not quiet.filter(record(banner))
    assert quiet.filter(record("DEPRECATED FEATURE: something else"))  # other warnings still pass
    assert quiet.filter(record("ServerApp: round 1 finished"))
    assert os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"
