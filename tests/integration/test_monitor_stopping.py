"""The active-set monitor stops the run near the true crossing of its threshold, over several seeds.

Real client agents (ledger, filter, monitor replies) answer through the in-process transport,
so many seeded federations fit in the default test run; the same pairing runs under Flower in
tests/integration/test_coordinator_flower.py. Records fall into four groups whose budgets run
out at known rates (simulations.datasets.scenarios.staircase); the true crossing is read back from the
clients' ledgers (each unit's halt round).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from coordinator.rounds import run
from protocol.conversions import mu_budget
from simulations.datasets.scenarios import staircase
from simulations.federation import write_clients
from simulations.inprocess import InProcessTransport

CLIENTS, RECORDS, THRESHOLD, ROUNDS = 10, 200, 1250, 64


def crossing(per: dict) -> tuple[int, list[dict]]:
    halts, configs = [], []
    for pid in per:
        with Ledger.open_existing(Path(per[pid]["ledger-path"])) as ledger:
            halts.append(ledger.state()["halt_round"])
            configs.append(json.loads(ledger.config.to_json()))
    h = np.concatenate(halts)
    for t in range(1, ROUNDS + 1):
        if np.count_nonzero((h < 0) | (h > t)) < THRESHOLD:
            return t, configs
    return ROUNDS + 1, configs


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("trust", ["local", "central"])
def test_monitor_stops_near_the_true_crossing(tmp_path: Path, trust: str, seed: int) -> None:
    monitor = (
        {"monitor": "tree", "monitor_noise_std": 8.0, "monitor_max_rounds": ROUNDS}
        if trust == "local"
        else {"monitor": "svt", "monitor_epsilon": 1.0}
    )
    per = write_clients(
        tmp_path,
        staircase(CLIENTS, RECORDS),
        epsilon=3.0,
        delta=1e-5,
        unit="record",
        trust=trust,
        noise_seed=seed,
        **monitor,
        policy_max_request_share=1.0,
    )
    cfg = CoordinatorConfig(
        num_nodes=CLIENTS,
        n_public=CLIENTS * RECORDS,
        rounds=ROUNDS,
        noise_std=3.0,
        l2_clip=1.0,
        task="indicator",
        trust=trust,
        unit="record",
        analyst="cycle",
        query_columns=4,
        monitor=monitor["monitor"],
        monitor_threshold=THRESHOLD,
        monitor_epsilon=monitor.get("monitor_epsilon", 0.0),
        noise_seed=100 + seed,
        progress=False,
    )
    summary = run(InProcessTransport(per), cfg)
    true_round, ledgers = crossing(per)
    assert true_round <= ROUNDS
    assert summary["stopped_because"] == "monitor"
    assert abs(summary["rounds_completed"] - true_round) <= 2

    # The cost reserved on every client equals the design (privacy.md §7).
    for ledger in ledgers:
        described = ledger["params"]["filter"]
        if trust == "local":
            levels = int(np.ceil(np.log2(ROUNDS))) + 1
            assert described["reserved"] == pytest.approx(levels / 8.0**2)
            assert described["threshold"] == pytest.approx(mu_budget(epsilon=3.0, delta=1e-5) ** 2 - levels / 64)
        else:
            assert described["reserved"] == 0.0
            assert described["epsilon"] == pytest.approx(2.0)  # (epsilon - epsilon_svt, delta) for the filter
            assert described["threshold"] == pytest.approx(mu_budget(epsilon=2.0, delta=1e-5) ** 2)
    assert summary["privacy"]["epsilon"] == 3.0  # the stated guarantee includes the monitor
