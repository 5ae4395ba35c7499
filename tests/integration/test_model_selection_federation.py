"""Private model selection for client units with local training (issue 24), through the real agents.

Each accuracy check is an indicator request with ``reduce`` 'mean': every client answers the fraction
of its records the broadcast model classifies correctly, clipped to 1, with the check's own noise, and
its filter charges it like any release. The run keeps the selected round's model and returns it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from coordinator.evaluation import model_evaluator
from coordinator.report import load_checkpoint
from coordinator.rounds import run
from simulations.inprocess import InProcessTransport
from simulations.presets.base import Options
from simulations.presets.run import headline, simulate
from tests.factories import federation

CLIENTS, RECORDS, FEATURES, ROUNDS, CHECK_SIGMA = 5, 40, 5, 5, 2.0


def test_client_units_select_their_model_with_charged_fraction_checks(tmp_path: Path) -> None:
    per, x, y = federation(
        tmp_path / "fed",
        clients=CLIENTS,
        records=RECORDS,
        features=FEATURES,
        seed=0,
        separation=2.0,
        epsilon=50.0,
        delta=1e-5,
        unit="client",
        trust="central",
        noise_seed=1,
    )
    cfg = CoordinatorConfig(
        num_nodes=CLIENTS,
        n_public=CLIENTS,
        rounds=ROUNDS,
        noise_std=1.0,
        l2_clip=1.0,
        trust="central",
        unit="client",
        model="logreg",
        model_args=json.dumps({"in_features": FEATURES, "n_classes": 2}),
        noise_seed=2,
        progress=False,
        local_steps=3,
        local_lr=0.5,
        local_batch_size=8,
        eval_every=1,
        plateau_every=1,
        plateau_start=2,
        plateau_patience=ROUNDS,
        plateau_noise_std=CHECK_SIGMA,
        plateau_rule="guarded",
        output_dir=str(tmp_path / "out"),
    )
    evaluate = model_evaluator(cfg, x, y)
    summary = run(InProcessTransport(per), cfg, evaluate=evaluate)
    assert summary["rounds_completed"] == ROUNDS and summary["errors_total"] == {}
    selection = summary["selection"]
    assert [c["round"] for c in selection["checks"]] == [2, 3, 4, 5]
    # Released with the noise the clients were charged for (the check's own, not the run's 1.0).
    assert {c["release_noise_std"] for c in selection["checks"]} == {CHECK_SIGMA}
    assert selection["round"] in (2, 3, 4, 5) and selection["rule"] == "guarded"
    # The returned model is the selected round's: the checkpoint written for it, its logged metrics.
    rnd, saved = load_checkpoint(selection["checkpoint"])
    assert rnd == selection["round"] and Path(selection["checkpoint"]).name == f"selected_{rnd:05d}.npz"
    np.testing.assert_array_equal(saved, summary["selected_parameters"])
    assert selection["metrics"] == {k: v for k, v in evaluate(saved).items()}
    # Every client paid for every check: one indicator release a check, its norm the client's fraction
    # (at most 1) and its noise the check's own; the ledger's releases replay to the stored spend.
    for node in per.values():
        with Ledger.open_existing(Path(node["ledger-path"])) as ledger:
            releases = list(ledger.releases())
            spent = float(ledger.state()["spent"][0])
        checks = [rel for rid, _, rel in releases if ":plateau:" in rid]
        assert len(checks) == 4 and all(str(rel["kind"]) == "indicator" for rel in checks)
        for rel in checks:
            norm, sigma = float(np.asarray(rel["l2_norms"])[0]), float(np.asarray(rel["noise_std"])[0])
            assert sigma == CHECK_SIGMA and 0.0 < norm <= 1.0 + 1e-6
        replayed = sum(
            float(np.asarray(rel["l2_norms"])[0]) ** 2 / float(np.asarray(rel["noise_std"])[0]) ** 2
            for *_, rel in releases
        )
        assert spent == pytest.approx(replayed, rel=1e-9)


def test_the_quickstart_fits_its_monitor_and_selects_for_client_units(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """20 client units: an SVT monitor (epsilon 0.1, threshold 2) would stop a run with everybody active
    most of the time (P = 0.92), so the quickstart runs none and says why; the run selects its model from
    the worst-case stop on."""
    caplog.set_level(logging.WARNING, logger="fedfilter.coordinator")
    opts = Options(
        clients=20,
        rounds=4,
        unit="client",
        trust="central",
        local_steps=2,
        local_lr=0.5,
        local_batch_size=16,
        engine="inprocess",
        out=str(tmp_path / "run"),
    )
    summary = simulate("quickstart", opts)
    assert summary["config"]["monitor"] == "none" and "monitor_reliability" not in summary
    assert summary["simulation"]["monitor"].startswith("no active-set monitor: SVT monitor (epsilon_svt = 0.1")
    worst = summary["simulation"]["worst_case_rounds"]
    assert summary["config"]["plateau_start"] == worst == 3  # 4 full-norm rounds, one set aside for the check
    assert [c["round"] for c in summary["selection"]["checks"]] == [3]
    assert any(
        line.startswith("Private model selection (guarded rule, 1 checks) returned round 3")
        for line in headline(summary)
    )
    assert not [r for r in caplog.records if r.name == "fedfilter.coordinator"]
