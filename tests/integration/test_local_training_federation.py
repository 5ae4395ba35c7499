"""A short cross-device federation with local training (DP-FedAvg) through the real agents, in process.

Every request goes through the agents' real path (decode, policy, local SGD, partial clipping,
charge, commit), as under Flower (simulations/inprocess.py); seeds fix the data and the noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from coordinator.evaluation import model_evaluator
from coordinator.rounds import run
from simulations.inprocess import InProcessTransport
from tests.factories import federation
from workloads.models import build_model, flatten_parameters

CLIENTS, RECORDS, FEATURES, ROUNDS = 5, 40, 5, 4


@pytest.mark.parametrize("trust", ["central", "local"])
def test_local_training_lowers_the_loss_and_charges_one_release_per_round(tmp_path: Path, trust: str) -> None:
    # A large budget and little noise: the noiseless-ish regime, where the loss must go down.
    per, x, y = federation(
        tmp_path,
        clients=CLIENTS,
        records=RECORDS,
        features=FEATURES,
        seed=0,
        separation=2.0,
        epsilon=1e4,
        delta=1e-5,
        unit="client",
        trust=trust,
        noise_seed=1,
    )
    cfg = CoordinatorConfig(
        num_nodes=CLIENTS,
        n_public=CLIENTS,
        rounds=ROUNDS,
        noise_std=0.05,
        l2_clip=5.0,
        trust=trust,
        unit="client",
        model="logreg",
        model_args=json.dumps({"in_features": FEATURES, "n_classes": 2}),
        noise_seed=2,
        progress=False,
        local_steps=5,
        local_lr=0.5,
        local_batch_size=8,
        server_lr=1.0,
        eval_every=1,
    )
    evaluate = model_evaluator(cfg, x, y)
    start = evaluate(flatten_parameters(build_model("logreg", seed=0, in_features=FEATURES, n_classes=2)))
    summary = run(InProcessTransport(per), cfg, evaluate=evaluate)
    assert summary["rounds_completed"] == ROUNDS and summary["errors_total"] == {}
    losses = [r["metrics"]["loss"] for r in summary["rounds"]]
    assert losses[-1] < 0.5 * start["loss"], (start, losses)
    assert summary["rounds"][-1]["metrics"]["accuracy"] > max(0.8, start["accuracy"])
    for node in per.values():
        with Ledger.open_existing(Path(node["ledger-path"])) as ledger:
            state = ledger.state()
            assert ledger.requests_answered() == ROUNDS  # one answered gradient request per round
            # One Gaussian release per round, each at most (C / sigma)^2 (privacy.md §2).
            assert 0 < state["spent"][0] <= ROUNDS * (cfg.l2_clip / cfg.noise_std) ** 2 + 1e-9


def test_simulate_quickstart_with_local_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from simulations.cli import main

    out = tmp_path / "qs"
    args = ["simulate", "--engine", "inprocess", "--rounds", "2", "--unit", "client", "--epsilon", "20"]
    local = ["--local-steps", "3", "--local-lr", "0.5", "--local-batch-size", "16"]
    assert main([*args, *local, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["local_steps"] == 3 and summary["config"]["server_lr"] == 1.0
    assert "3 local SGD steps (DP-FedAvg)" in summary["privacy"]["statement"]
    capsys.readouterr()
    assert main(["simulate", "--engine", "inprocess", *local, "--out", str(tmp_path / "bad")]) == 2
    assert "local training needs the gradient task and unit 'client'" in capsys.readouterr().err
