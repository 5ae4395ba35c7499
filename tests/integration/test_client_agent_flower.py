"""The client agent through Flower's simulation engine (Ray), real ClientApp and ServerApp.

Spend survives a new Flower run and new node ids: two runs against the same ledger
directory; the second starts where the first stopped, and units exhausted in the first
contribute nothing in the second. Flower's node ids differ between the runs; the ledger
is keyed by the node's own configuration, never by Flower state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from simulations.federation import write_clients

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
import flwr.simulation  # noqa: F401  (flwr[simulation] is pinned: a broken install must fail, not skip)

from simulations.engine import run_engine

pytestmark = pytest.mark.flower

N_CLIENTS = 4
RECORDS = 30


def make_clients(root: Path, *, trust: str) -> dict[int, dict[str, object]]:
    rng = np.random.default_rng(7)
    parts = []
    for _ in range(N_CLIENTS):
        x = rng.normal(size=(RECORDS, 4)).astype(np.float32)
        # Half the records of each client have near-zero features: small gradients, long-lived units.
        x[RECORDS // 2 :] *= 0.01
        parts.append((x, (x[:, 0] > 0).astype(np.int64)))
    return write_clients(
        root, parts, epsilon=2.0, delta=1e-5, unit="record", trust=trust, noise_seed=1, policy_max_request_share=1.0
    )


def run(
    per: dict[int, dict[str, object]], *, run_id: str, rounds: int, trust: str, engine: str = "flower"
) -> dict[str, object]:
    cfg = CoordinatorConfig(
        num_nodes=N_CLIENTS,
        n_public=N_CLIENTS * RECORDS,
        rounds=rounds,
        noise_std=3.0,
        l2_clip=1.0,
        learning_rate=0.5,
        trust=trust,
        unit="record",
        model="logreg",
        model_args=json.dumps({"in_features": 4, "n_classes": 2}),
        run_id=run_id,
        progress=False,
    )
    return run_engine(engine, cfg, per)


def ledger_states(per: dict[int, dict[str, object]]) -> list[dict[str, np.ndarray]]:
    out = []
    for pid in range(N_CLIENTS):
        with Ledger.open_existing(Path(str(per[pid]["ledger-path"]))) as ledger:
            out.append(ledger.state())
    return out


# On request (`pytest -m slow`, both trust modes; test budget: two Ray starts, 39 s). By default the same
# property runs on Flower's deployment engine: three `flwr run`s against the same ledgers, spend only
# growing (tests/e2e/test_hostile_bundle.py), and two federations' runs summed on one ledger
# (tests/e2e/test_federations_deployed.py).
#
# With the first run in this process (the in-process engine), its agents stay open in this process's
# cache while the test reads the ledgers and Ray's actors answer the second run: before ledger._HeldFiles
# the reads dropped those agents' locks, the actors deleted the WAL, and the ledgers read as corrupt.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("trust", "first_engine"), [("local", "flower"), ("central", "flower"), ("local", "inprocess")]
)
def test_spend_survives_new_run_and_node_ids(tmp_path: Path, trust: str, first_engine: str) -> None:
    per = make_clients(tmp_path, trust=trust)
    first = run(per, run_id="run-1", rounds=4, trust=trust, engine=first_engine)
    assert first["rounds_completed"] == 4
    assert all(r["replies"] == N_CLIENTS and not r["errors"] for r in first["rounds"])  # type: ignore[index]
    after_first = ledger_states(per)
    spent1 = np.concatenate([s["spent"] for s in after_first])
    stopped1 = np.concatenate([s["stopped"] for s in after_first])
    assert spent1.min() > 0  # every unit was charged
    assert stopped1.any() and not stopped1.all()  # large-gradient units ran out, small ones did not

    second = run(per, run_id="run-2", rounds=4, trust=trust)
    assert second["rounds_completed"] == 4
    after_second = ledger_states(per)
    spent2 = np.concatenate([s["spent"] for s in after_second])
    stopped2 = np.concatenate([s["stopped"] for s in after_second])
    assert np.all(spent2 >= spent1)  # no spend went down, nothing was reset
    np.testing.assert_array_equal(spent2[stopped1], spent1[stopped1])  # exhausted units contributed nothing
    assert np.any(spent2[~stopped1] > spent1[~stopped1])  # the others went on from where they were
    assert np.all(stopped2[stopped1])
    for pid in range(N_CLIENTS):
        with Ledger.open_existing(Path(str(per[pid]["ledger-path"]))) as ledger:
            assert ledger.requests_in_run("run-1") == 4
            assert ledger.requests_in_run("run-2") == 4
