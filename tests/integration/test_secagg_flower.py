"""Secagg trust on Flower's simulation engine: 10 clients, federated GD, accuracy of central trust.

With m = n every sum carries noise of variance n sigma^2 / m = sigma^2, exactly the central
coordinator's noise, so a secagg run's final accuracy is a draw from the same distribution
as a central run's at the same sigma. Statistical criterion: the Flower secagg run's accuracy
lies within 4 standard deviations (+ 0.01) of the mean over 5 central runs with other noise
seeds. Control: local trust at the same sigma (noise sqrt(n) sigma in the sum) is worse on
average by more than 0.03. That comparison (15 Flower rounds and 10 in-process runs) runs on request
(`pytest -m slow`); the default run keeps a two-round secagg run on Flower with every step's counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flwr.simulation  # noqa: F401  (flwr[simulation] is pinned: a broken install must fail, not skip)
import numpy as np
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.evaluation import model_evaluator
from coordinator.rounds import run
from simulations.datasets.synthetic import synthetic_classification
from simulations.engine import run_flower
from simulations.federation import write_clients
from simulations.inprocess import InProcessTransport

pytestmark = pytest.mark.flower

N_CLIENTS, RECORDS, SIGMA = 10, 30, 25.0


def federation(
    tmp_path: Path, trust: str, seed: int, rounds: int = 15
) -> tuple[CoordinatorConfig, dict[int, dict[str, Any]], Any]:
    x, y = synthetic_classification(N_CLIENTS * RECORDS + 1000, 10, 2, seed=3, separation=1.5)
    parts = [(x[i * RECORDS : (i + 1) * RECORDS], y[i * RECORDS : (i + 1) * RECORDS]) for i in range(N_CLIENTS)]
    per = write_clients(
        tmp_path / f"{trust}{seed}",
        parts,
        epsilon=50.0,
        delta=1e-5,
        unit="record",
        trust=trust,
        noise_seed=seed,
        policy_max_request_share=1.0,
    )
    cfg = CoordinatorConfig(
        num_nodes=N_CLIENTS,
        n_public=N_CLIENTS * RECORDS,
        rounds=rounds,
        noise_std=SIGMA,
        l2_clip=1.0,
        learning_rate=2.0,
        trust=trust,
        unit="record",
        model="logreg",
        model_args=json.dumps({"in_features": 10, "n_classes": 2}),
        run_id=f"{trust}-{seed}",
        noise_seed=seed,
        progress=False,
        secagg_min_clients=N_CLIENTS,
    )
    return cfg, per, model_evaluator(cfg, x[-1000:], y[-1000:])


def in_process_accuracy(tmp_path: Path, trust: str, seed: int) -> float:
    cfg, per, evaluate = federation(tmp_path, trust, seed)
    return float(run(InProcessTransport(per), cfg, evaluate=evaluate)["final_metrics"]["accuracy"])


def check_secagg_rounds(summary: dict[str, Any], rounds: int) -> None:
    assert summary["rounds_completed"] == rounds and summary["privacy"]["trust"] == "secagg"
    for log in summary["rounds"]:
        assert log["secagg"] == {"advertised": 10, "shared": 10, "masked": 10, "checked": 10, "unmasked": 10}, log
        assert log["release_noise_std"] == pytest.approx(SIGMA) and not log["errors"]


def test_secagg_runs_every_step_on_flower(tmp_path: Path) -> None:
    cfg, per, evaluate = federation(tmp_path, "secagg", 1, rounds=2)
    check_secagg_rounds(run_flower(cfg, per, evaluate=evaluate), 2)


@pytest.mark.slow
def test_secagg_reaches_central_accuracy_at_the_same_sigma(tmp_path: Path) -> None:
    cfg, per, evaluate = federation(tmp_path, "secagg", 1)
    summary = run_flower(cfg, per, evaluate=evaluate)
    check_secagg_rounds(summary, 15)
    secagg = float(summary["final_metrics"]["accuracy"])
    central = np.array([in_process_accuracy(tmp_path, "central", seed) for seed in range(11, 16)])
    local = np.array([in_process_accuracy(tmp_path, "local", seed) for seed in range(11, 16)])
    spread = 4 * central.std(ddof=1) + 0.01
    print(f"accuracy: secagg {secagg:.4f}; central {central.round(4).tolist()}; local {local.round(4).tolist()}")
    assert abs(secagg - central.mean()) <= spread, (secagg, central.tolist())
    assert local.mean() < central.mean() - 0.03, (local.tolist(), central.tolist())
