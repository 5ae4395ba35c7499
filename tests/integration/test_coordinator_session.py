"""An unseeded central-trust coordinator run is a session of its own: a run started again under the same run_id
is charged afresh, never answered from what the clients stored for the earlier run (privacy.md §8, "One session
per run id").

Before sessions, every run named its requests '<run_id>:<purpose>:r<round>' (run_id 'run' by default). A
client answers a request id it already answered from its ledger, uncharged, which is right for a resumed run
(its coordinator adds the same noise again). An unseeded coordinator started again draws fresh noise, so in
central trust a second run under the same run_id published a second noisy look at each stored exact sum that
it asked again (round 1 from the same initial model: two releases, one charge), and its monitor went on with
the one sparse vector every client had reserved, under fresh threshold noise (a hostile review, 2026-11-27).
Both through the real path: the coordinator's `run` and the agents behind the in-process transport.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from coordinator.rounds import run
from simulations.datasets.scenarios import staircase
from simulations.federation import write_clients
from simulations.inprocess import InProcessTransport
from tests.factories import central_clients, gradient_run

CLIENTS, RECORDS = 3, 40


def spent(per: dict[int, dict]) -> np.ndarray:
    out = []
    for pid in sorted(per):
        with Ledger.open_existing(Path(per[pid]["ledger-path"])) as ledger:
            out.append(np.asarray(ledger.state()["spent"], dtype=np.float64))
    return np.concatenate(out)


# Unseeded (the deployment's default); seeded with two seeds (fresh noise on a replayed sum, as unseeded); one seed
# twice (the same noise only while the settings and every reply are the same: a reply lost in the first run, or
# a plateau check added, and the two releases' difference is exact data; a second review, 2026-11-27).
@pytest.mark.parametrize("seeds", [(None, None), (1, 2), (3, 3)])
def test_a_central_run_started_again_under_its_run_id_is_charged_again_not_replayed(
    tmp_path: Path, seeds: tuple[int | None, int | None]
) -> None:
    per = central_clients(tmp_path, CLIENTS, RECORDS)
    cfg = gradient_run(num_nodes=CLIENTS, n_public=CLIENTS * RECORDS)
    assert cfg.run_id == "run" and cfg.noise_seed is None and cfg.session == ""
    first = run(InProcessTransport(per), replace(cfg, noise_seed=seeds[0]))
    after_first = spent(per)
    assert after_first.min() > 0  # every record paid for round 1
    second = run(InProcessTransport(per), replace(cfg, noise_seed=seeds[1]))  # the same initial model
    after_second = spent(per)
    # Round 1 asked again from the same model: answered afresh and charged again (before: replayed, uncharged,
    # and noised afresh by the coordinator, so the two published models cost twice what the ledgers hold).
    np.testing.assert_allclose(after_second, 2 * after_first, rtol=1e-12)
    assert first["run_id"] == second["run_id"] == "run"
    assert first["wire_run_id"].startswith("run#") and second["wire_run_id"].startswith("run#")
    assert first["wire_run_id"] != second["wire_run_id"]
    for pid in per:
        with Ledger.open_existing(Path(per[pid]["ledger-path"])) as ledger:
            ids = [row["request_id"] for row in ledger.recent(10)]
        assert {i.split(":", 1)[0] for i in ids} == {first["wire_run_id"], second["wire_run_id"]}


@pytest.mark.parametrize("seeds", [(None, None), (1, 2)])
def test_a_second_run_cannot_go_on_with_the_reserved_sparse_vector(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seeds: tuple[int | None, int | None]
) -> None:
    per = write_clients(
        tmp_path,
        staircase(CLIENTS, RECORDS),
        epsilon=3.0,
        delta=1e-5,
        unit="record",
        trust="central",
        monitor="svt",
        monitor_epsilon=1.0,
        policy_max_request_share=1.0,
    )
    cfg = CoordinatorConfig(
        num_nodes=CLIENTS,
        n_public=CLIENTS * RECORDS,
        rounds=3,
        noise_std=3.0,
        l2_clip=1.0,
        task="indicator",
        trust="central",
        unit="record",
        analyst="cycle",
        query_columns=4,
        monitor="svt",
        monitor_threshold=1,
        monitor_epsilon=1.0,
        progress=False,
    )
    first = run(InProcessTransport(per), replace(cfg, rounds=2, noise_seed=seeds[0]))
    assert [log["errors"] for log in first["rounds"]] == [{}, {}]  # the first run owns the sparse vector
    second = run(InProcessTransport(per), replace(cfg, noise_seed=seeds[1]))
    # Fresh request ids, so nothing is replayed to the second run's fresh threshold noise; its rounds 1-2 were
    # reported to the first run (once each), and from round 3 on every client refuses it: the one reserved sparse
    # vector is the first session's (before: rounds 3 on got fresh exact counts, a second SVT on one reservation).
    assert [log["errors"].get("monitor-policy", 0) for log in second["rounds"]] == [CLIENTS] * 3
    owned = [r.getMessage() for r in caplog.records if "belongs to an earlier run" in r.getMessage()]
    assert len(owned) == CLIENTS and all(f"'{second['wire_run_id']}:monitor:r3'" in m for m in owned), owned


def test_a_session_is_drawn_never_configured() -> None:
    base = dict(num_nodes=1, n_public=1, rounds=1, noise_std=1.0, l2_clip=1.0, trust="central", progress=False)
    with pytest.raises(CoordinatorConfigError, match=r"unknown keys \['session'\]"):
        CoordinatorConfig.from_run_config({k.replace("_", "-"): v for k, v in base.items()} | {"session": "0" * 16})
    with pytest.raises(CoordinatorConfigError, match="expected '' or 16 hex digits"):
        CoordinatorConfig(**base, session="not-hex")
    for other in ({"trust": "local"}, {"trust": "secagg"}):
        with pytest.raises(CoordinatorConfigError, match="only a central-trust run has one"):
            CoordinatorConfig(**(base | other), session="0" * 16)
        # In local and secagg trust a replayed reply is the release already made (its noise is in it).
        plain = CoordinatorConfig(**(base | other))
        assert plain.in_session() is plain and plain.wire_run_id == "run"
    # A seeded central run has one too: a seed gives the same noise only for the same settings and replies.
    assert len(CoordinatorConfig(**base, noise_seed=1).in_session().session) == 16
    with pytest.raises(CoordinatorConfigError, match=r"without '\|' or '#'"):
        CoordinatorConfig(**(base | {"run_id": "run#0123456789abcdef"}))  # another run's wire_run_id
    with pytest.raises(CoordinatorConfigError, match="each run draws its own"):  # a run given one (the Python API)
        run(InProcessTransport({}), CoordinatorConfig(**base, session="0" * 16))
    drawn = CoordinatorConfig(**base).in_session()
    assert len(drawn.session) == 16 and drawn.wire_run_id == f"run#{drawn.session}"
    assert drawn.in_session() is drawn and CoordinatorConfig(**base).in_session().session != drawn.session
