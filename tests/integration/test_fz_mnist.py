"""FZ Sec. 5.1 / Fig. 1 (simulations/reproductions/fz_sec51.py): cell rules, a small trial, the full run on request."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from protocol.filters import GaussianFilter
from simulations.datasets.idx import default_data_dir
from simulations.reproductions.fz_sec51 import (
    DELTA,
    EPSILONS,
    PAPER,
    SUBOPTIMAL_CLIP_FACTOR,
    TUNED,
    Tuned,
    append_result,
    cell,
    load_results,
    plot_accuracy,
    plot_fig1,
    run_trial,
    table_markdown,
)

MNIST = default_data_dir() / "mnist"
needs_mnist = pytest.mark.skipif(not MNIST.is_dir(), reason=f"MNIST IDX files not found under {MNIST}")


@pytest.mark.parametrize("epsilon", EPSILONS)
def test_cells_share_the_noise_and_gd_keeps_its_worst_case_guarantee(epsilon: float) -> None:
    renyi = GaussianFilter.renyi(epsilon=epsilon, delta=DELTA)
    tuned = TUNED[epsilon]
    cells = {(r, m): cell(epsilon, r, m) for r in ("tuned", "suboptimal") for m in ("gd", "renyi", "gdp")}
    sigmas = {c.noise_std for c in cells.values()}
    assert len(sigmas) == 1  # every method and regime sees the same noise
    sigma = sigmas.pop()
    # Tuned GD: exactly T0 full-norm steps fit the Rényi filter (FZ's accounting), not one more.
    assert cells[("tuned", "gd")].steps == tuned.steps
    assert tuned.steps * (tuned.clip / sigma) ** 2 <= renyi.threshold
    assert (tuned.steps + 1) * (tuned.clip / sigma) ** 2 > renyi.threshold
    # Suboptimal: clip k*C0 (FZ Sec. 5.1: 1.5x for eps 0.3 and 0.5, 2x for 1.0); GD's steps shrink by k^2.
    k = SUBOPTIMAL_CLIP_FACTOR[epsilon]
    sub_gd = cells[("suboptimal", "gd")]
    assert sub_gd.clip == pytest.approx(k * tuned.clip)
    assert sub_gd.steps == math.floor(tuned.steps / k**2 + 1e-9)
    assert sub_gd.steps * (sub_gd.clip / sigma) ** 2 <= renyi.threshold  # its guarantee holds at full norm
    assert cells[("suboptimal", "renyi")].steps == tuned.steps
    assert cells[("suboptimal", "gdp")].filter == "gdp" and cells[("suboptimal", "renyi")].filter == "renyi"


def test_bad_cells_are_refused() -> None:
    with pytest.raises(ValueError, match="--regime: expected one of"):
        cell(0.3, "lucky", "gd")
    with pytest.raises(ValueError, match="--method: expected one of"):
        cell(0.3, "tuned", "sgd")
    with pytest.raises(ValueError, match="--epsilon: expected one of"):
        cell(0.7, "tuned", "gd")


def test_results_file_with_a_broken_line_names_it(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    good = {
        "epsilon": 0.3,
        "regime": "tuned",
        "method": "gd",
        "final_accuracy": 0.9,
        "train_records": 600,
        "active_per_round": [600, 600],
        "clip": 1.0,
    }
    path.write_text(json.dumps(good) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: expected one JSON object per line"):
        load_results(path)
    path.write_text(json.dumps(good) + "\n[]\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: expected a trial with keys .* missing \['active_per_round'"):
        load_results(path)
    # A last line cut short (no newline) does not swallow the next trial appended after it.
    path.write_text(json.dumps(good))
    append_result(path, good | {"method": "gdp"})
    assert [r["method"] for r in load_results(path)] == ["gd", "gdp"]


# On request (`pytest -m slow`): run_federation and trial_record run in process in tests/unit/test_fz_campaign.py,
# run_flower in tests/integration/test_coordinator_flower.py.
@pytest.mark.slow
@needs_mnist
@pytest.mark.parametrize("engine", ["inprocess", pytest.param("flower", marks=pytest.mark.flower)])
def test_small_trial_filters_records_and_appends_its_result(tmp_path: Path, engine: str) -> None:
    """600 MNIST records, 3 steps: GD spends every record's worst case, the filtered run stops records itself."""
    tuned = Tuned(steps=2, clip=1.0, learning_rate=0.5)
    results = tmp_path / "results.jsonl"
    gd = cell(0.3, "suboptimal", "gd", tuned=tuned)
    filt = cell(0.3, "suboptimal", "renyi", tuned=tuned)
    assert (gd.steps, filt.steps) == (0, 2)  # GD: floor(2 / 1.5^2) = 0 full-norm steps; filtered: T0 = 2
    record = run_trial(filt, seed=1, out=tmp_path / "renyi", engine=engine, train_limit=600, eval_every=1)
    append_result(results, record)
    active = np.array(record["active_per_round"])
    assert record["rounds_completed"] == filt.steps
    assert active[0] == 600 and np.all(np.diff(active) <= 0)
    # At clip 1.5x the tuned one, a record at full norm is out of budget after floor(2 / 2.25) = 0 full steps
    # plus its partial remainder: the filter, not the step count, stopped most records by the last step.
    assert active[-1] < 600
    assert "(0.3, 1e-05)-differential privacy" in record["privacy"] and "renyi filter" in record["privacy"]
    accuracy = record["accuracy_by_round"]
    assert sorted(accuracy) == [1, 2] and accuracy[2] == record["final_accuracy"]  # evaluated every step
    rows = load_results(results)
    assert len(rows) == 1 and rows[0]["method"] == "renyi" and rows[0]["train_records"] == 600
    assert rows[0]["machine"]["cpus"] >= 1
    # The report counts only full-scale (60,000-record) trials unless told otherwise.
    shown = f"{100 * record['final_accuracy']:.2f} (1 trial)"
    assert shown not in table_markdown(rows)
    assert shown in table_markdown(rows, full_only=False)
    assert "not run" in table_markdown(rows)
    assert json.loads(results.read_text().splitlines()[0])["seed"] == 1


def test_report_plots_fig1_from_full_scale_filtered_runs(tmp_path: Path) -> None:
    rows = [
        {
            "epsilon": 0.3,
            "regime": "suboptimal",
            "method": "renyi",
            "clip": 1.5,
            "train_records": 60000,
            "active_per_round": [60000, 60000, 30000, 100],
            "final_accuracy": 0.9,
            "accuracy_by_round": {"2": 0.5, "3": 0.9},  # as read back from the JSON lines file
            "gd_steps": 2,
            "selected_step": 3,  # starred in the zoomed panel below
        }
    ]
    assert plot_fig1(rows, tmp_path / "fig.png") == tmp_path / "fig.png"
    assert plot_accuracy(rows, tmp_path / "acc.png") == tmp_path / "acc.png"
    assert (tmp_path / "acc.png").stat().st_size > 1000
    assert plot_accuracy([{**rows[0], "train_records": 600}], tmp_path / "none.png") is None
    assert (tmp_path / "fig.png").stat().st_size > 1000
    assert plot_fig1([{**rows[0], "train_records": 600}], tmp_path / "none.png") is None
    table = table_markdown(rows)
    # Paper columns: FZ Sec. 5.1 table (suboptimal, eps 0.3: GD 84.47, GD with filtering 92.25).
    assert "| 0.3 | suboptimal | 84.47 | 92.25 | not run | 90.00 (1 trial) | not run |" in table
    assert set(PAPER) == {(e, r) for e in EPSILONS for r in ("tuned", "suboptimal")}


@pytest.mark.slow
@needs_mnist
def test_full_suboptimal_cell_eps_03_filter_beats_gd(tmp_path: Path) -> None:
    """FZ Sec. 5.1, suboptimal regime at eps 0.3 (paper: GD 84.47% vs GD+filter 92.25%): one trial each, full MNIST."""
    gd = run_trial(cell(0.3, "suboptimal", "gd"), seed=0, out=tmp_path / "gd", engine="flower")
    filt = run_trial(cell(0.3, "suboptimal", "renyi"), seed=0, out=tmp_path / "renyi", engine="flower")
    assert filt["final_accuracy"] > gd["final_accuracy"]
