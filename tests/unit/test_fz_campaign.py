"""The FZ Sec. 5.1 campaign (issue 26): job order and skipping, resume, the tuning split, tuned settings,
lr x C <= 3, the one-run-two-rows trial and its private selection, the report, the campaign's exit codes.

Small versions only (a few hundred MNIST records, a handful of steps); the campaign itself runs in
the background (`fedfilter reproduce fz-mnist --campaign`).
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.ledger import Ledger
from protocol.filters import GaussianFilter
from simulations.cli import main
from simulations.datasets.idx import default_data_dir
from simulations.reproductions import fz_sec51 as fz
from simulations.reproductions.fz_sec51 import (
    DELTA,
    EPSILONS,
    KIND_PREFIX,
    KIND_TRIAL,
    KIND_TUNE,
    MAX_LR_TIMES_CLIP,
    TUNE_EXTEND_MAX,
    TUNE_GRID,
    Job,
    Tuned,
    append_result,
    append_results,
    campaign_jobs,
    cell,
    chosen_tuning,
    current_trials,
    finished,
    leading_tuning,
    load_results,
    next_job,
    pending_jobs,
    report_markdown,
    run_job,
    select_step,
    stable_learning_rate,
    superseded,
    tuning_grid,
    tuning_jobs,
    tuning_silos,
)

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

MNIST = default_data_dir() / "mnist"
needs_mnist = pytest.mark.skipif(not MNIST.is_dir(), reason=f"MNIST IDX files not found under {MNIST}")


def tune_row(job: Job, accuracy: float) -> dict[str, Any]:
    t = job.tuned
    return {
        "kind": KIND_TUNE,
        "job": job.key,
        "method": "gd",
        "epsilon": job.epsilon,
        "steps": t.steps,
        "clip": t.clip,
        "learning_rate": t.learning_rate,
        "validation_accuracy": accuracy,
    }


def trial_row(job: Job, method: str, accuracy: float, **extra: Any) -> dict[str, Any]:
    return {
        "kind": KIND_TRIAL,
        "job": job.key,
        "epsilon": job.epsilon,
        "regime": job.regime,
        "method": method,
        "final_accuracy": accuracy,
        "last_accuracy": accuracy,
        "train_records": 60000,
        "active_per_round": [60000],
        "clip": 1.0,
        **extra,
    }


def all_tuned(accuracy: float = 0.9) -> list[dict[str, Any]]:
    return [tune_row(j, accuracy) for j in tuning_jobs()]


# --- the job list ---------------------------------------------------------------------------------


def sessionless(request_id: str) -> str:
    """A request id without its run's session ('<run_id>#<16 hex>:...' -> '<run_id>:...'; config.wire_run_id)."""
    return re.sub(r"#[0-9a-f]{16}:", ":", request_id, count=1)


def test_jobs_run_in_the_issues_order() -> None:
    before = campaign_jobs([])
    # Until every grid point has its row, the list ends with the tuning grid (the trials' settings come from it).
    assert [j.kind for j in before] == [KIND_PREFIX] + [KIND_TUNE] * 12
    assert [(j.epsilon, j.tuned.steps, j.tuned.learning_rate) for j in before[1:5]] == [
        (0.3, 100, 1.5),
        (0.3, 100, 2.0),
        (0.3, 150, 1.5),
        (0.3, 150, 2.0),
    ]
    assert [(j.tuned.steps, j.tuned.learning_rate) for j in before if j.epsilon == 1.0] == [
        (300, 1.0),
        (300, 1.5),
        (400, 1.0),
        (400, 1.5),
    ]
    assert all(j.tuned.clip == 1.0 and j.method == "gd" for j in before[1:])
    jobs = campaign_jobs(all_tuned())
    trials = jobs[13:]
    assert len(trials) == 6 + 12 + 18
    seed0 = [(j.seed, j.regime, j.epsilon, j.method) for j in trials[:6]]
    # Seed 0 of all six cells, GD + Rényi in one run, suboptimal first.
    assert seed0 == [(0, "suboptimal", e, "gd+renyi") for e in EPSILONS] + [
        (0, "tuned", e, "gd+renyi") for e in EPSILONS
    ]
    assert {(j.seed, j.method) for j in trials[6:18]} == {(1, "gd+renyi"), (2, "gd+renyi")}
    assert [j.seed for j in trials[6:18]] == [1] * 6 + [2] * 6
    assert [j.method for j in trials[18:]] == ["gdp"] * 18  # the GDP column last
    assert len({j.key for j in jobs}) == len(jobs)  # every key names one job


def test_finished_jobs_are_skipped_and_a_half_written_job_is_not_finished() -> None:
    rows: list[dict[str, Any]] = []
    assert next_job(rows) == fz.prefix_check_job()
    rows.append({"kind": KIND_PREFIX, "job": fz.prefix_check_job().key, "method": "gd+renyi"})
    assert next_job(rows) == tuning_jobs()[0]
    rows += all_tuned()
    first_trial = campaign_jobs(rows)[13]
    assert next_job(rows) == first_trial
    rows.append(trial_row(first_trial, "gd", 0.9))  # the GD row alone: the Rényi row is still missing
    assert not finished(first_trial, rows) and next_job(rows) == first_trial
    rows.append(trial_row(first_trial, "renyi", 0.92))
    assert finished(first_trial, rows) and next_job(rows) == campaign_jobs(rows)[14]
    everything = rows + [trial_row(j, m, 0.9) for j in campaign_jobs(rows) for m in j.row_methods]
    assert next_job(everything) is None


def test_resume_after_a_last_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    prefix = {"kind": KIND_PREFIX, "job": fz.prefix_check_job().key, "method": "gd+renyi", "epsilon": 0.3}
    prefix |= {"gd_steps": 8, "parameters_equal": True}
    append_result(path, prefix | {"max_abs_difference": 0.0})
    whole = json.dumps(tune_row(tuning_jobs()[0], 0.9))
    with path.open("a") as fh:
        fh.write(whole[: len(whole) // 2])  # a crash in the middle of the write
    rows = load_results(path)
    assert [r["kind"] for r in rows] == [KIND_PREFIX]  # the cut line is left out ...
    assert next_job(rows) == tuning_jobs()[0]  # ... so its job runs again
    append_results(path, [tune_row(tuning_jobs()[0], 0.9), tune_row(tuning_jobs()[1], 0.8)])
    rows = load_results(path)
    assert [r["kind"] for r in rows] == [KIND_PREFIX, KIND_TUNE, KIND_TUNE]
    assert next_job(rows) == tuning_jobs()[2]
    # A broken line that is not the last is an error naming it, as before.
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: expected one JSON object per line"):
        load_results(path)
    path.write_text(json.dumps({"kind": "guess", "job": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:1: expected a kind among \['prefix-check', 'trial', 'tune'\]"):
        load_results(path)
    path.write_text(json.dumps({"kind": KIND_TUNE, "job": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:1: expected a tune with keys .* missing \['clip', 'epsilon'"):
        load_results(path)


# --- tuned settings and the lr x C rule -----------------------------------------------------------


def test_tuned_settings_are_the_best_grid_point_per_epsilon() -> None:
    rows = all_tuned(0.5)
    grid = {eps: [j for j in tuning_jobs() if j.epsilon == eps] for eps in EPSILONS}
    rows += [tune_row(grid[0.3][1], 0.93), tune_row(grid[1.0][3], 0.95), tune_row(grid[1.0][1], 0.95)]
    # Later rows override? No: the best accuracy wins, and among equal ones the earliest grid point.
    assert chosen_tuning(rows, 0.3) == Tuned(steps=100, clip=1.0, learning_rate=2.0)
    assert chosen_tuning(rows, 1.0) == Tuned(steps=300, clip=1.0, learning_rate=1.5)
    assert chosen_tuning(rows, 0.5) == Tuned(steps=100, clip=1.0, learning_rate=1.5)  # all tied: the first
    # A missing grid point: no choice yet at that epsilon, and no trial job of it is listed; the other
    # epsilons' trials, whose grids are complete, are.
    partial = [r for r in all_tuned() if r["job"] != grid[0.5][3].key]
    assert chosen_tuning(partial, 0.5) is None and chosen_tuning(partial, 0.3) is not None
    listed = {j.epsilon for j in campaign_jobs(partial) if j.kind == KIND_TRIAL}
    assert listed == {0.3, 1.0}
    first = next(j for j in pending_jobs(partial) if j.kind == KIND_TRIAL)
    assert (first.epsilon, first.regime, first.seed) == (0.3, "suboptimal", 0)
    # The trials use the chosen settings.
    trial = campaign_jobs(rows)[13]
    assert (trial.epsilon, trial.tuned) == (0.3, Tuned(steps=100, clip=1.0, learning_rate=2.0))


def test_a_grid_whose_best_point_has_its_largest_t0_grows_along_t0_and_trials_wait_for_it() -> None:
    base = [j for j in tuning_jobs() if j.epsilon == 0.5]
    rows = [*all_tuned(0.9), tune_row(base[3], 0.95)]  # (150, 2.0) wins, at the grid's largest T0
    grown = tuning_grid(rows, 0.5)
    assert [(j.tuned.steps, j.tuned.learning_rate) for j in grown[4:]] == [(200, 2.0)]
    assert tuning_grid(rows, 0.3) == [j for j in tuning_jobs() if j.epsilon == 0.3]  # tied: T0 100, interior
    assert chosen_tuning(rows, 0.5) is None and leading_tuning(rows, 0.5) == base[3].tuned
    assert "| 0.5 | 150 | 2 | 93.90 | 95.00 | leading (grid growing) |" in report_markdown(rows)
    assert all(j.epsilon != 0.5 for j in campaign_jobs(rows) if j.kind == KIND_TRIAL)
    assert grown[4] in pending_jobs(rows)
    rows.append(tune_row(grown[4], 0.96))  # T0 200 wins again: T0 250 next
    assert [j.tuned.steps for j in tuning_grid(rows, 0.5)[4:]] == [200, 250]
    rows.append(tune_row(tuning_grid(rows, 0.5)[5], 0.955))  # T0 250 loses: the grid is complete
    assert len(tuning_grid(rows, 0.5)) == 6
    assert chosen_tuning(rows, 0.5) == Tuned(steps=200, clip=1.0, learning_rate=2.0)
    trials = [j for j in campaign_jobs(rows) if j.kind == KIND_TRIAL and j.epsilon == 0.5]
    assert trials and all(j.tuned == Tuned(steps=200, clip=1.0, learning_rate=2.0) for j in trials)
    # A trial run at the superseded T0 150 is kept apart from the table; one at T0 200 is in it.
    old, new = (Job(KIND_TRIAL, 0.5, "suboptimal", "gd+renyi", 0, t) for t in (base[3].tuned, trials[0].tuned))
    rows += [trial_row(old, "renyi", 0.931), trial_row(new, "renyi", 0.942)]
    assert superseded(rows, rows[-2]) and not superseded(rows, rows[-1])
    assert [r["final_accuracy"] for r in current_trials(rows)] == [0.942]
    report = report_markdown(rows)
    table, apart = report.split("superseded")[0], report.split("superseded")[1].split("T0=40")[0]
    assert "94.20 (1 trial)" in table and "93.10" not in table and "93.10 (1 trial)" in apart


def test_a_grid_grows_at_most_tune_extend_max_points() -> None:
    rows = all_tuned(0.9)
    for k in range(TUNE_EXTEND_MAX + 2):  # every new point wins
        grid = tuning_grid(rows, 1.0)
        best = grid[-1] if k else grid[3]
        rows.append(tune_row(best, 0.95 + 0.001 * k))
    grid = tuning_grid(rows, 1.0)
    assert len(grid) == 4 + TUNE_EXTEND_MAX
    assert [j.tuned.steps for j in grid[4:]] == [500, 600, 700][:TUNE_EXTEND_MAX]
    assert chosen_tuning(rows, 1.0) == grid[-1].tuned


def test_learning_rate_times_clip_stays_at_most_3() -> None:
    assert stable_learning_rate(learning_rate=2.0, l2_clip=1.5) == 2.0  # 3.0 exactly: kept
    assert stable_learning_rate(learning_rate=2.0, l2_clip=2.0) == 1.5  # 4 would diverge (issue 26)
    assert stable_learning_rate(learning_rate=1.0, l2_clip=2.0) == 1.0
    for eps, grid in TUNE_GRID.items():
        for steps, lr in grid:
            tuned = Tuned(steps=steps, clip=1.0, learning_rate=lr)
            for regime in ("tuned", "suboptimal"):
                c = cell(eps, regime, "renyi", tuned=tuned)
                assert c.learning_rate * c.clip <= MAX_LR_TIMES_CLIP + 1e-12
                assert c.learning_rate == min(lr, MAX_LR_TIMES_CLIP / c.clip)
    # The issue's unstable cell: eps 1.0 suboptimal at lr 2 (C = 2) now runs at lr 1.5; sigma and GD's steps
    # as the issue's diagnosis: sigma 70.06, 75 GD steps at T0 = 300.
    sub = cell(1.0, "suboptimal", "gd", tuned=Tuned(steps=300, clip=1.0, learning_rate=2.0))
    assert (sub.clip, sub.learning_rate, sub.steps) == (2.0, 1.5, 75)
    assert sub.noise_std == pytest.approx(70.06, abs=0.01)
    renyi = GaussianFilter.renyi(epsilon=1.0, delta=DELTA)
    assert renyi.full_norm_rounds(noise_std=sub.noise_std, l2_clip=1.0) == 300


def test_select_step_takes_the_best_private_count_earliest_first() -> None:
    assert select_step({10: 0.5, 15: 0.7, 20: 0.7, 25: 0.6}, 30) == 15
    assert select_step({}, 30) == 30  # no count asked: the last step


# --- the tuning split -------------------------------------------------------------------------------


def test_tuning_split_holds_out_validation_from_training_and_never_reads_the_test_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []

    def fake(name: str, data_dir: Path, *, split: str = "train", download: bool = False) -> Any:
        asked.append(split)
        if split != "train":
            raise AssertionError(f"the tuning split read the {split} set")
        x = np.arange(600 * 28 * 28, dtype=np.uint8).reshape(600, 28, 28)
        x[:, 0, 0] = np.arange(600) % 256  # distinct records
        x[:, 0, 1] = np.arange(600) // 256
        return x, np.arange(600) % 10

    monkeypatch.setattr(fz, "load_idx_dataset", fake)
    parts, val_x, _ = tuning_silos(10, data_dir=Path("/nowhere"))
    assert asked == ["train"]
    assert len(val_x) == 100 and sum(len(p[0]) for p in parts) == 500  # 5:1, as 50,000 / 10,000

    # Disjoint, and together every training record once.
    def ids(x: np.ndarray) -> set[tuple[float, float]]:
        return {(float(a), float(b)) for a, b in zip(x[:, 0, 0, 0], x[:, 0, 0, 1], strict=True)}

    train = set().union(*(ids(p[0]) for p in parts))
    assert len(train) == 500 and not train & ids(val_x) and len(train | ids(val_x)) == 600
    again = tuning_silos(10, data_dir=Path("/nowhere"))
    np.testing.assert_array_equal(again[1], val_x)  # a fixed split


@needs_mnist
def test_a_tuning_job_trains_on_the_split_and_reports_validation_accuracy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from simulations.datasets import idx, partition

    real = idx.load_idx_dataset

    def train_only(name: str, data_dir: Path, *, split: str = "train", download: bool = False) -> Any:
        assert split == "train", f"a tuning job read the {split} set"
        return real(name, data_dir, split=split, download=download)

    monkeypatch.setattr(fz, "load_idx_dataset", train_only)
    monkeypatch.setattr(partition, "load_idx_dataset", train_only)
    job = Job(KIND_TUNE, 0.5, "tuned", "gd", 0, Tuned(steps=3, clip=1.0, learning_rate=2.0))
    (row,) = run_job(job, out=tmp_path / "t", train_limit=600)
    assert row["kind"] == KIND_TUNE and row["job"] == job.key
    assert (row["train_records"], row["validation_records"], row["rounds_completed"]) == (500, 100, 3)
    assert 0.0 <= row["validation_accuracy"] <= 1.0 and "not accounted" in row["privacy"]
    assert row["noise_std"] == cell(0.5, "tuned", "gd", tuned=job.tuned).noise_std


# --- one run, two rows; private selection -------------------------------------------------------------


@needs_mnist
def test_gd_and_renyi_rows_from_one_run_with_private_selection_charged(tmp_path: Path) -> None:
    tuned = Tuned(steps=10, clip=1.0, learning_rate=2.0)
    job = Job(KIND_TRIAL, 0.3, "suboptimal", "gd+renyi", 1, tuned)
    gd_cell = cell(0.3, "suboptimal", "gd", tuned=tuned)
    assert gd_cell.steps == math.floor(10 / 1.5**2) == 4
    out = tmp_path / "run"
    gd, renyi = run_job(job, out=out, train_limit=300, test_limit=500)
    assert (gd["method"], renyi["method"]) == ("gd", "renyi") and gd["job"] == renyi["job"] == job.key
    # GD row: the filtered run's model at GD's last worst-case step, evaluated on the test set.
    assert gd["rounds_completed"] == gd["selected_step"] == 4 and gd["final_accuracy"] == gd["last_accuracy"]
    assert gd["active_per_round"] == [300] * 5 == renyi["active_per_round"][:5]  # no filter binds before GD's horizon
    # Private counts every 5 steps from GD's horizon on, none before it; the selected step is the best count.
    private = {int(k): v for k, v in renyi["private_train_accuracy_by_round"].items()}
    assert sorted(private) == [5, 10]
    assert renyi["selected_step"] == select_step(private, 10)
    assert renyi["final_accuracy"] == renyi["accuracy_by_round"][renyi["selected_step"]]
    assert renyi["last_accuracy"] == renyi["accuracy_by_round"][10] and renyi["rounds_completed"] == 10
    # The counts are charged by every record's filter: replaying each ledger's releases (gradients and counts)
    # gives the stored spend, and the count releases are there.
    filt = GaussianFilter.renyi(epsilon=0.3, delta=DELTA)
    for pid in range(10):
        with Ledger.open_existing(out / "ledgers" / f"client{pid}.sqlite") as ledger:
            releases = list(ledger.releases())
            spent = np.asarray(ledger.state()["spent"])
        kinds = [str(rel["kind"]) for _, _, rel in releases]
        assert kinds.count("indicator") == 2 and kinds.count("gradient") == 10
        assert any(":plateau:r5" in rid for rid, _, _ in releases)
        total = sum(
            np.asarray(rel["l2_norms"]) ** 2 / float(np.asarray(rel["noise_std"])[0]) ** 2 for *_, rel in releases
        )
        np.testing.assert_allclose(spent, total, rtol=1e-9)
        assert np.all(spent <= filt.threshold * (1 + 1e-9))
    assert "everything this run released" in renyi["privacy"]


@needs_mnist
def test_gdp_branches_from_the_gd_step_with_the_prefix_charged_in_its_own_ledgers(tmp_path: Path) -> None:
    tuned = Tuned(steps=5, clip=1.0, learning_rate=2.0)  # suboptimal eps 0.3: GD 2 steps, filtered 5
    first = Job(KIND_TRIAL, 0.3, "suboptimal", "gd+renyi", 2, tuned)
    rows = run_job(first, out=tmp_path / "renyi", train_limit=200, test_limit=300)
    for pid in range(10):  # back to schema version 2, as the campaign's runs finished before schema 3 are
        with sqlite3.connect(tmp_path / "renyi" / "ledgers" / f"client{pid}.sqlite") as conn:
            conn.execute("DROP INDEX requests_by_federation_time")
            conn.execute("DROP INDEX requests_by_federation_run")
            conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    sources = sorted((tmp_path / "renyi" / "ledgers").glob("client*.sqlite"))
    before = [f.read_bytes() for f in sources]
    gdp = Job(KIND_TRIAL, 0.3, "suboptimal", "gdp", 2, tuned)
    (branched,) = run_job(gdp, out=tmp_path / "gdp", train_limit=200, test_limit=300, rows=rows)
    # The branch read copies: the source run's ledgers are as they were, still version 2 (a review: the path
    # comes from a results row, so the branch must not write there).
    assert len(sources) == 10 and [f.read_bytes() for f in sources] == before
    (alone,) = run_job(gdp, out=tmp_path / "alone", train_limit=200, test_limit=300)  # no source: from round 1
    assert "round_00002.npz" in branched["branched_from"] and "branched_from" not in alone
    assert branched["rounds_completed"] == alone["rounds_completed"] == 5
    assert branched["accuracy_by_round"][2] == rows[0]["final_accuracy"]  # the prefix's GD step, then its own
    assert sorted(int(r) for r in branched["private_train_accuracy_by_round"]) == [5]  # counts after GD's step
    assert branched["active_per_round"][:3] == [200] * 3
    filt = GaussianFilter.gdp(epsilon=0.3, delta=DELTA)
    for pid in range(10):
        with Ledger.open_existing(tmp_path / "gdp" / "ledgers" / f"client{pid}.sqlite") as ledger:
            releases = list(ledger.releases())
            spent = np.asarray(ledger.state()["spent"])
            assert ledger.config.filter == "gdp"
        with Ledger.open_existing(tmp_path / "alone" / "ledgers" / f"client{pid}.sqlite") as ledger:
            scratch = list(ledger.releases())
        ids = [rid for rid, _, _ in releases]
        # The prefix under the Rényi run's request ids, then the branch from round 3 under its own (each run
        # in a session of its own: '<run_id>#<16 hex>', coordinator/config.py wire_run_id).
        with Ledger.open_existing(tmp_path / "renyi" / "ledgers" / f"client{pid}.sqlite", migrate=True) as ledger:
            assert ids[:2] == [rid for rid, _, _ in ledger.releases()][:2]
        assert [sessionless(rid) for rid in ids[:3]] == [
            "fz-0.3-suboptimal-renyi-2:gradient:r1",
            "fz-0.3-suboptimal-renyi-2:gradient:r2",
            "fz-0.3-suboptimal-gdp-2:gradient:r3",
        ]
        # The prefix charges exactly what a GDP run from round 1 charged for the same two steps.
        for (_, _, got), (_, _, want) in zip(releases[:2], scratch[:2], strict=True):
            np.testing.assert_array_equal(got["l2_norms"], want["l2_norms"])
        # And the stored spend is every release replayed, within the filter.
        total = sum(np.asarray(r["l2_norms"]) ** 2 / float(np.asarray(r["noise_std"])[0]) ** 2 for *_, r in releases)
        np.testing.assert_allclose(spent, total, rtol=1e-9)
        assert np.all(spent <= filt.threshold * (1 + 1e-9))


def test_a_run_resumes_from_a_checkpoint_at_the_next_round(tmp_path: Path) -> None:
    from coordinator.config import CoordinatorConfig, CoordinatorConfigError
    from coordinator.rounds import run
    from simulations.inprocess import InProcessTransport
    from tests import factories

    def clients(name: str) -> dict[int, dict[str, Any]]:
        per, _, _ = factories.federation(
            tmp_path / name,
            clients=2,
            records=10,
            features=4,
            seed=1,
            separation=2.0,
            epsilon=50.0,
            delta=1e-5,
            trust="central",
            unit="record",
        )
        return per

    common: dict[str, Any] = {
        "num_nodes": 2,
        "n_public": 20,
        "noise_std": 1e-9,
        "l2_clip": 1.0,
        "learning_rate": 1.0,
        "model": "logreg",
        "model_args": json.dumps({"in_features": 4, "n_classes": 2}),
        "progress": False,
        "trust": "central",
        "noise_seed": 0,
    }
    whole = run(InProcessTransport(clients("whole")), CoordinatorConfig(**common, rounds=5))
    first = CoordinatorConfig(**common, rounds=2, output_dir=str(tmp_path / "first"), checkpoint_every=2)
    run(InProcessTransport(clients("first")), first)
    saved = tmp_path / "first" / "checkpoints" / "round_00002.npz"
    rest = run(
        InProcessTransport(clients("rest")), CoordinatorConfig(**common, rounds=5, initial_checkpoint=str(saved))
    )
    assert [r["round"] for r in rest["rounds"]] == [3, 4, 5]
    np.testing.assert_allclose(rest["parameters"], whole["parameters"], atol=1e-6)  # 2 + 3 steps = 5 steps
    with pytest.raises(
        CoordinatorConfigError, match=r"initial_checkpoint: expected a round in \[0, rounds=2\), found 2"
    ):
        run(InProcessTransport(clients("late")), CoordinatorConfig(**common, rounds=2, initial_checkpoint=str(saved)))
    np.savez(tmp_path / "bad.npz", parameters=np.zeros(3), round=np.array(1))
    with pytest.raises(CoordinatorConfigError, match=r"initial_checkpoint: expected 10 parameters .* found 3"):
        run(
            InProcessTransport(clients("bad")),
            CoordinatorConfig(**common, rounds=5, initial_checkpoint=str(tmp_path / "bad.npz")),
        )


# --- a run stopped with its process goes on from its snapshot -----------------------------------------


class _Killed(BaseException):
    """The campaign's process dies here (a session's end): not an Exception, so nothing records a failure."""


@needs_mnist
def test_a_job_stopped_mid_run_goes_on_from_its_snapshot_to_the_same_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from simulations.inprocess import InProcessTransport

    tuned = Tuned(steps=12, clip=1.0, learning_rate=2.0)  # suboptimal eps 0.3: GD 5 steps, the filtered run 12
    job = Job(KIND_TRIAL, 0.3, "suboptimal", "gd+renyi", 1, tuned)
    assert fz.SNAPSHOT_EVERY == 10
    whole = run_job(job, out=tmp_path / "whole", train_limit=120, test_limit=100)

    real_send = InProcessTransport.send

    def dies_after_round_11(self: InProcessTransport, message_type: str, payloads: Any, *, timeout: float) -> Any:
        out = real_send(self, message_type, payloads, timeout=timeout)
        if message_type.endswith("gradient") and {int(c["round"]) for c, _ in payloads.values()} == {11}:
            raise _Killed  # after the clients answered (and were charged for) round 11; the snapshot is round 10's
        return out

    out = tmp_path / "attempt"
    monkeypatch.setattr(InProcessTransport, "send", dies_after_round_11)
    with pytest.raises(_Killed):
        run_job(job, out=out, train_limit=120, test_limit=100)
    monkeypatch.setattr(InProcessTransport, "send", real_send)
    assert (out / fz.SNAPSHOT).is_file()
    with pytest.raises(fz.SimulationError, match="already holds ledgers"):  # never silently from round 1 here
        run_job(job, out=out, train_limit=120, test_limit=100)
    resumed = run_job(job, out=out, train_limit=120, test_limit=100, resume=out / fz.SNAPSHOT)

    assert resumed[1]["resumed_at_round"] == 10
    varying = {"wall_s", "finished_utc", "out", "resumed_at_round", "machine"}
    for got, want in zip(resumed, whole, strict=True):
        assert {k: v for k, v in got.items() if k not in varying} == {k: v for k, v in want.items() if k not in varying}
    # every record paid for each release once: the same releases and spend as the uninterrupted run's ledgers
    for pid in range(fz.CLIENTS):
        with Ledger.open_existing(out / "ledgers" / f"client{pid}.sqlite") as a:
            with Ledger.open_existing(tmp_path / "whole" / "ledgers" / f"client{pid}.sqlite") as b:
                # the same releases, each run under its own session ('<run_id>#<16 hex>:...')
                assert [sessionless(rid) for rid, _, _ in a.releases()] == [
                    sessionless(rid) for rid, _, _ in b.releases()
                ]
                np.testing.assert_array_equal(a.state()["spent"], b.state()["spent"])


def test_a_resumed_branch_keeps_where_its_first_attempt_started(tmp_path: Path) -> None:
    """A gdp attempt records its branch (or round 1) in its folder; the resumed attempt reads that, not the
    results and folders of now (the source's folder may be gone, or a source may have appeared since)."""
    branch = fz.Branch(tmp_path / "src" / "checkpoints" / "round_00004.npz", tmp_path / "src" / "ledgers", 4)
    fz._record_branch(tmp_path / "a", (branch, {"accuracy_by_round": {1: 0.5, 4: 0.75, 5: 0.8}}))
    got = fz._recorded_branch(tmp_path / "a")
    assert got is not None and got[0] == branch
    assert {int(r): a for r, a in got[1]["accuracy_by_round"].items()} == {1: 0.5, 4: 0.75, 5: 0.8}
    fz._record_branch(tmp_path / "b", None)
    assert fz._recorded_branch(tmp_path / "b") is None
    with pytest.raises(fz.SimulationError, match="where the stopped attempt started is not known"):
        fz._recorded_branch(tmp_path / "c")


def test_the_campaign_goes_on_in_the_newest_attempt_of_the_same_job_that_left_a_snapshot(tmp_path: Path) -> None:
    from simulations.cli.reproduce import resumable_attempt

    campaign = tmp_path / "campaign"
    prefix = "tune_tuned_eps=1_gd_seed=0_T0=300_C0=1_lr=1"
    for name in (
        f"{prefix}-20261125-080000",  # older, with a snapshot
        f"{prefix}-20261126-080000",  # newer, with a snapshot: this one
        f"{prefix}-20261126-090000",  # newest, but stopped before its first snapshot
        "tune_tuned_eps=1_gd_seed=0_T0=300_C0=1_lr=1.5-20261127-080000",  # another job (lr 1.5)
        f"{prefix}-notes",  # not an attempt
    ):
        (campaign / name / "checkpoints").mkdir(parents=True)
        if not name.endswith("090000"):
            (campaign / name / fz.SNAPSHOT).write_bytes(b"")
    assert resumable_attempt(campaign, prefix) == campaign / f"{prefix}-20261126-080000"
    assert resumable_attempt(campaign, prefix + "_other") is None


# --- the report -------------------------------------------------------------------------------------


def test_report_keeps_campaign_trials_tuning_and_earlier_rows_apart() -> None:
    rows = all_tuned(0.9)
    rows[1]["validation_accuracy"] = 0.95  # eps 0.3: T0 100, lr 2 chosen
    trial = campaign_jobs(rows)[13]  # seed 0, suboptimal, eps 0.3
    rows += [
        {"kind": KIND_PREFIX, "job": "p", "epsilon": 0.3, "gd_steps": 8, "train_records": 6000}
        | {"parameters_equal": True, "max_abs_difference": 0.0},
        trial_row(trial, "gd", 0.87),
        trial_row(trial, "renyi", 0.91, last_accuracy=0.90),
        trial_row(trial, "renyi", 0.11),  # a rerun's repeated row counts once
        {  # a trial from before the campaign (no kind, no job): T0 = 40
            "epsilon": 0.3,
            "regime": "suboptimal",
            "method": "gd",
            "final_accuracy": 0.4938,
            "train_records": 60000,
            "active_per_round": [60000],
            "clip": 1.5,
        },
    ]
    text = report_markdown(rows)
    campaign, rest = text.split("Filtered runs at their last step:")
    last, rest = rest.split("Tuning (")
    tuning, earlier = rest.split("T0=40 (earlier settings")
    assert "| 0.3 | suboptimal | 84.47 | 92.25 | 87.00 (1 trial) | 91.00 (1 trial) | not run |" in campaign
    assert "49.38" not in campaign and "49.38" not in last
    assert "| 0.3 | suboptimal | 84.47 | 92.25 | 87.00 (1 trial) | 90.00 (1 trial) | not run |" in last
    assert "| 0.3 | 100 | 2 | 123.04 | 95.00 | yes |" in tuning and "| 0.3 | 100 | 1.5 | 123.04 | 90.00 |  |" in tuning
    assert "not accounted" in tuning
    assert "parameters identical (max |difference| 0)" in tuning
    assert "| 0.3 | suboptimal | 84.47 | 92.25 | 49.38 (1 trial) | not run | not run |" in earlier


def test_job_rounds_are_the_runs_own_rounds() -> None:
    t = Tuned(steps=150, clip=1.0, learning_rate=2.0)
    assert fz.job_rounds(Job(KIND_TUNE, 0.3, "tuned", "gd", 0, t)) == (0, 150)
    assert fz.job_rounds(Job(KIND_TRIAL, 0.3, "tuned", "gd+renyi", 0, t)) == (0, 225)  # 1.5 T0 (module docstring)
    assert fz.job_rounds(Job(KIND_TRIAL, 0.3, "suboptimal", "gd+renyi", 0, t)) == (0, 150)
    # GDP branches at GD's last worst-case step: floor(150 / 1.5^2) = 66 (the rows above: GD 66 steps).
    assert fz.job_rounds(Job(KIND_TRIAL, 0.3, "suboptimal", "gdp", 0, t)) == (66, 150)
    assert fz.job_rounds(Job(KIND_TRIAL, 0.3, "tuned", "gdp", 0, t)) == (150, 225)


def test_progress_counts_the_steps_left_less_the_snapshots_and_the_trials_still_waiting() -> None:
    rows = all_tuned(0.9)  # every grid complete, the earliest point chosen (all tie)
    jobs = campaign_jobs(rows)
    first = jobs[13]  # seed 0, suboptimal, eps 0.3, T0 100
    gdp = next(j for j in jobs if j.method == "gdp")
    whole = sum(b - a for a, b in map(fz.job_rounds, jobs[13:]))
    # A snapshot past the end counts the job's whole run; a GDP snapshot before its branch counts none.
    p = fz.campaign_progress(rows, {first.key: 40, gdp.key: 3, tuning_jobs()[0].key: 99})
    assert (p.done, p.listed) == (len(tuning_jobs()), len(jobs))  # the prefix check is not done
    assert p.snapshot_steps == 40 and p.steps_left == whole - 40 + fz.job_rounds(fz.prefix_check_job())[1]
    assert p.waiting == {} and p.seconds_per_step is None
    assert "No campaign run on the CPU has finished yet" in fz.progress_text(p, workers=2)

    partial = [r for r in rows if r["job"] != tuning_jobs()[5].key]  # eps 0.5's grid not complete
    waiting = fz.campaign_progress(partial, {}).waiting
    leading = leading_tuning(partial, 0.5)
    assert leading is not None and set(waiting) == {0.5}
    assert waiting[0.5] == (leading, sum(b - a for a, b in map(fz.job_rounds, fz.trial_jobs({0.5: leading}))))
    assert "the trials at ε 0.5, which wait for its tuning grid" in fz.progress_text(
        fz.campaign_progress(partial, {}), workers=1
    )


def test_progress_counts_a_gdp_job_whose_twin_ran_elsewhere_from_round_1(tmp_path: Path) -> None:
    # A twin that ran on a lent GPU left its folder there: its GDP job runs from round 1, not from the branch.
    rows = all_tuned(0.9)
    gdp = next(j for j in campaign_jobs(rows) if j.method == "gdp" and j.regime == "suboptimal")
    source = fz.twin(gdp)
    start, _ = fz.job_rounds(gdp)
    twin_steps = fz.job_rounds(source)[1]
    before = fz.campaign_progress(rows, {}).steps_left
    here = tmp_path / "here"
    (here / "checkpoints").mkdir(parents=True)
    (here / "checkpoints" / f"round_{start:05d}.npz").write_bytes(b"")
    (here / "ledgers").mkdir()
    for pid in range(10):
        (here / "ledgers" / f"client{pid}.sqlite").write_bytes(b"")

    def finished_at(folder: Path) -> list[dict[str, Any]]:
        gd = trial_row(source, "gd", 0.9, out=str(folder), gd_steps=start)
        return [*rows, gd, trial_row(source, "renyi", 0.9, out=str(folder))]

    assert start > 0
    assert fz.campaign_progress(finished_at(here), {}).steps_left == before - twin_steps
    assert fz.campaign_progress(finished_at(tmp_path / "gone"), {}).steps_left == before - twin_steps + start


def test_progress_pace_is_wall_seconds_over_the_rounds_each_row_ran() -> None:
    rows = all_tuned(0.9)
    jobs = campaign_jobs(rows)
    job, gdp = jobs[13], next(j for j in jobs if j.method == "gdp" and j.regime == "suboptimal")
    tuned = {"tuned_steps": 100, "tuned_clip": 1.0, "tuned_learning_rate": 2.0}
    rows[0] |= {"wall_s": 500.0, "rounds_completed": 100, "finished_utc": "2026-11-27T01:00:00Z"}  # 100 rounds
    rows += [
        # GD's row shares the filtered run's wall time: not counted twice.
        trial_row(job, "gd", 0.9, wall_s=900.0, rounds_completed=44, finished_utc="2026-11-27T02:00:00Z"),
        trial_row(job, "renyi", 0.9, wall_s=600.0, rounds_completed=100, resumed_at_round=40)
        | {"finished_utc": "2026-11-27T02:00:00Z"},  # 60 rounds
        # A GDP run starts after GD's 44 steps (floor(100 / 1.5^2)): 56 rounds.
        trial_row(gdp, "gdp", 0.9, wall_s=560.0, rounds_completed=100, finished_utc="2026-11-27T03:00:00Z") | tuned,
        # A GPU run's pace is not this machine's.
        trial_row(job, "renyi", 0.9, wall_s=1.0, rounds_completed=100, device="cuda")
        | {"finished_utc": "2026-11-27T04:00:00Z"},
    ]
    p = fz.campaign_progress(rows, {})
    assert (p.seconds, p.seconds_steps) == (1660.0, 216)
    assert fz.campaign_progress(rows, {}, recent=1).seconds_steps == 56  # the newest CPU segment only
    hours = (p.steps_left * 1660.0 / 216) / 3600
    assert f"about {hours:,.0f} worker-hours, {hours / 2:,.0f} hours with 2 workers" in fz.progress_text(p, workers=2)


def test_report_command_counts_a_stopped_jobs_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from simulations.cli.reproduce import job_prefix

    rows = all_tuned(0.9)
    results, out = tmp_path / "r.jsonl", tmp_path / "out"
    append_results(results, rows)
    first = campaign_jobs(rows)[13]
    folder = out / "campaign" / f"{job_prefix(first)}-20261127-010000"
    (folder / fz.SNAPSHOT).parent.mkdir(parents=True)
    np.savez(folder / fz.SNAPSHOT, meta=np.array(json.dumps({"round": 30})))
    figs = ["--fig", str(tmp_path / "a.png"), "--accuracy-fig", str(tmp_path / "b.png")]
    base = ["reproduce", "fz-mnist-report", "--results", str(results), "--out", str(out), *figs]
    assert main(base) == 0
    assert "(30 already past in their snapshots)" in capsys.readouterr().out
    (folder / fz.SNAPSHOT).write_bytes(b"not a snapshot")
    assert main(base) == 2
    assert "expected a run's snapshot, could not read it" in capsys.readouterr().err
    assert main([*base, "--workers", "0"]) == 2
    assert "--workers: expected an integer >= 1, got 0" in capsys.readouterr().err


# --- the campaign command ------------------------------------------------------------------------------


def test_campaign_once_runs_one_job_stops_on_a_second_failure_and_when_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from simulations.cli import reproduce

    results, out = tmp_path / "r.jsonl", tmp_path / "out"
    ran: list[str] = []

    def fake_run(
        job: Job,
        *,
        out: Path,
        data_dir: Path | None,
        engine: str,
        rows: list[dict[str, Any]],
        resume: Path | None,
        device: str,
    ) -> Any:
        assert resume is None  # no earlier attempt left a snapshot
        assert device == "cpu"  # the default
        ran.append(job.key)
        if job.kind == KIND_TUNE:
            raise RuntimeError("diverged")
        return [
            {"kind": KIND_PREFIX, "job": job.key, "method": job.method, "epsilon": 0.3}
            | {"gd_steps": 8, "parameters_equal": True, "max_abs_difference": 0.0, "wall_s": 1.0}
        ]

    monkeypatch.setattr(reproduce, "run_job", fake_run)
    args = ["reproduce", "fz-mnist", "--campaign", "--once", "--results", str(results), "--out", str(out)]
    assert main(args) == 0  # the prefix check, appended
    assert [(r["job"], r["device"]) for r in load_results(results)] == [(fz.prefix_check_job().key, "cpu")]
    assert main(args) == 0  # the first tuning job fails once: tried again by the next call
    assert main(args) == reproduce.CAMPAIGN_STUCK  # fails twice: stop
    assert main(args) == reproduce.CAMPAIGN_STUCK and len(ran) == 3  # not tried a third time
    failures = (out / "campaign-failures.jsonl").read_text().splitlines()
    assert [json.loads(f)["job"] for f in failures] == [tuning_jobs()[0].key] * 2
    monkeypatch.setattr(reproduce, "campaign_jobs", lambda rows: [])
    assert main(args) == reproduce.CAMPAIGN_NOTHING_LEFT


def test_a_gdp_job_waits_until_its_gd_renyi_twin_has_finished() -> None:
    rows = [*fake_prefix_rows(fz.prefix_check_job()), *all_tuned()]
    jobs = campaign_jobs(rows)
    renyi = [j for j in jobs if j.kind == KIND_TRIAL and j.method == "gd+renyi"]
    late = renyi[-1]  # seed 2, tuned, epsilon 1.0: the last gd+renyi run
    rows += [trial_row(j, m, 0.9) for j in renyi[:-1] for m in j.row_methods]
    pending = pending_jobs(rows)
    waiting = Job(late.kind, late.epsilon, late.regime, "gdp", late.seed, late.tuned)
    assert fz.twin(waiting) == late
    # Another worker may start every GDP job but the one that would branch from the run not yet finished.
    assert late in pending and waiting not in pending
    assert [j.method for j in pending] == ["gd+renyi"] + ["gdp"] * 17
    rows += [trial_row(late, m, 0.9) for m in late.row_methods]
    assert waiting in pending_jobs(rows) and next_job(rows) == jobs[-18]  # the GDP column in order


def fake_prefix_rows(job: Job) -> list[dict[str, Any]]:
    return [
        {"kind": KIND_PREFIX, "job": job.key, "method": job.method, "epsilon": 0.3}
        | {"gd_steps": 8, "parameters_equal": True, "max_abs_difference": 0.0, "wall_s": 1.0}
    ]


def test_workers_sharing_a_campaign_take_different_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from simulations.cli import reproduce

    results, out = tmp_path / "r.jsonl", tmp_path / "out"
    ran: list[str] = []

    def fake_run(job: Job, **_: Any) -> list[dict[str, Any]]:
        ran.append(job.key)
        if job.kind == KIND_TUNE:
            return [tune_row(job, 0.9) | {"wall_s": 1.0}]
        return fake_prefix_rows(job)

    monkeypatch.setattr(reproduce, "run_job", fake_run)
    args = ["reproduce", "fz-mnist", "--campaign", "--once", "--results", str(results), "--out", str(out)]
    claims = out / "campaign" / "claims"
    first, second, third = fz.prefix_check_job(), *tuning_jobs()[:2]
    other = reproduce.claim(claims, first)  # another worker runs the first job
    assert other is not None and reproduce.claim(claims, first) is None  # held: no second hold, even here
    assert main(args) == 0 and ran == [second.key]  # this worker takes the next job
    held = [reproduce.claim(claims, j) for j in tuning_jobs()[1:]]
    assert all(h is not None for h in held)
    assert main(args) == reproduce.CAMPAIGN_ALL_HELD and ran == [second.key]  # nothing left to take now
    other.close()  # the other worker stops (or dies: the lock goes with its process)
    assert main(args) == 0 and ran == [second.key, first.key]
    for h in held:
        assert h is not None
        h.close()

    # A job another worker finishes between this worker's reading the rows and its taking the job is
    # not run again: the rows are read once more after the hold is taken.
    real_claim = reproduce.claim

    def finished_meanwhile(where: Path, job: Job) -> Any:
        if job == third:
            append_results(results, [tune_row(job, 0.9)])
        return real_claim(where, job)

    monkeypatch.setattr(reproduce, "claim", finished_meanwhile)
    assert main(args) == 0 and ran == [second.key, first.key, tuning_jobs()[2].key]
    keys = [r["job"] for r in load_results(results)]
    assert keys.count(third.key) == 1 and len(keys) == len(set(keys))


def test_only_takes_the_jobs_its_pattern_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from simulations.cli import reproduce

    results, out = tmp_path / "r.jsonl", tmp_path / "out"
    # The prefix check and epsilon 0.3's grid are in (tied: the first point, not on the T0 edge); the
    # other grids are not, so their tuning jobs come first in the order.
    eps03 = [tune_row(j, 0.9) for j in tuning_jobs() if j.epsilon == 0.3]
    append_results(results, [*fake_prefix_rows(fz.prefix_check_job()), *eps03])
    ran: list[str] = []

    def fake_run(job: Job, **_: Any) -> list[dict[str, Any]]:
        ran.append(job.key)
        return [trial_row(job, m, 0.9) | {"wall_s": 1.0} for m in job.row_methods]

    monkeypatch.setattr(reproduce, "run_job", fake_run)
    args = ["reproduce", "fz-mnist", "--campaign", "--once", "--results", str(results), "--out", str(out)]
    wanted = r"^trial/suboptimal/eps=0\.3/gd\+renyi/seed=2/"
    assert main([*args, "--only", wanted]) == 0
    assert len(ran) == 1 and ran[0].startswith("trial/suboptimal/eps=0.3/gd+renyi/seed=2/")
    # Every job it matches is done: nothing left for this worker, though tuning jobs are pending.
    assert main([*args, "--only", wanted]) == reproduce.CAMPAIGN_NOTHING_LEFT and len(ran) == 1
    assert any(j.kind == KIND_TUNE for j in pending_jobs(load_results(results)))
    assert main([*args, "--only", "(unclosed"]) == 2 and len(ran) == 1
    assert "--only: expected a regular expression, got '(unclosed'" in capsys.readouterr().err


def test_a_claim_goes_with_the_process_that_held_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    from simulations.cli import reproduce

    claims, job = tmp_path / "claims", fz.prefix_check_job()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from simulations.cli.reproduce import claim; "
            "from simulations.reproductions.fz_sec51 import prefix_check_job; "
            "h = claim(Path(sys.argv[1]), prefix_check_job()); print(h is not None, flush=True); time.sleep(60)",
            str(claims),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        assert reproduce.claim(claims, job) is None
    finally:
        holder.kill()
        holder.wait()
    hold = reproduce.claim(claims, job)  # killed mid-job (a session's end): no stale claim
    assert hold is not None
    hold.close()


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("gpu", "--device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        ("cuda:99", "--device: expected a CUDA device torch sees, got 'cuda:99'"),
    ],
)
def test_campaign_device_must_be_one_torch_sees(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], device: str, expected: str
) -> None:
    args = ["reproduce", "fz-mnist", "--campaign", "--once", "--device", device]
    assert main([*args, "--results", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "out")]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any job was taken


def test_campaign_threads_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["reproduce", "fz-mnist", "--campaign", "--once", "--threads", "0", "--results", str(tmp_path / "r.jsonl")]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert "--threads: expected an integer >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any job was taken
