"""A seeded simulation stopped mid-run and resumed from its snapshot is the run that would have happened.

coordinator/resume.py: every ``snapshot_every`` rounds the coordinator saves the model, the selection's state,
the noise generator's state and the rounds so far; ``resume`` goes on with the same ledgers. The test stops
a run *after* its clients answered (and were charged for) a round the snapshot does not hold, resumes it, and
compares with the same run uninterrupted: the same model bit for bit, the same per-round log, the same
selection, and ledgers holding each release once (the replayed round was answered from the ledger, not
charged again).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from coordinator.rounds import run
from simulations.inprocess import InProcessTransport
from tests import factories

ROUNDS, SNAP_EVERY, STOP_AFTER = 9, 3, 5  # snapshots at rounds 3 and 6; the stop comes after round 5's answers


class Stopped(Exception):
    """The coordinator's process dies here."""


class StopsAfter(InProcessTransport):
    """Answers every request, then dies right after the clients answered round ``after``'s gradient."""

    def __init__(self, node_configs: Mapping[int, Mapping[str, Any]], after: int) -> None:
        super().__init__(node_configs)
        self.after = after

    def send(self, message_type: str, payloads: Mapping[int, Any], *, timeout: float) -> Any:
        out = super().send(message_type, payloads, timeout=timeout)
        rounds = {int(config["round"]) for config, _ in payloads.values()}
        if message_type.endswith("gradient") and rounds == {self.after}:
            raise Stopped
        return out


def _clients(root: Path) -> dict[int, dict[str, Any]]:
    per, _, _ = factories.federation(
        root,
        clients=3,
        records=8,
        features=4,
        seed=4,
        separation=1.0,
        epsilon=4.0,  # small: records stop during the run, so the filter's state matters after the stop
        delta=1e-5,
        trust="central",
        unit="record",
        filter="renyi",
    )
    return per


def _config(out: Path, **extra: Any) -> CoordinatorConfig:
    settings: dict[str, Any] = {
        "num_nodes": 3,
        "n_public": 24,
        "rounds": ROUNDS,
        "noise_std": 1.5,
        "l2_clip": 1.0,
        "learning_rate": 0.5,
        "model": "logreg",
        "model_args": json.dumps({"in_features": 4, "n_classes": 2}),
        "progress": False,
        "trust": "central",
        "noise_seed": 7,
        "run_id": "resume",
        "output_dir": str(out),
        "plateau_every": 2,
        "plateau_patience": ROUNDS,
    }
    return CoordinatorConfig(**(settings | extra))


def _spends(per: dict[int, dict[str, Any]]) -> list[tuple[list[str], np.ndarray]]:
    out = []
    for pid in sorted(per):
        with Ledger.open_existing(per[pid]["ledger-path"]) as ledger:
            out.append(([rid for rid, _, _ in ledger.releases()], np.array(ledger.state()["spent"])))
    return out


def test_a_stopped_run_resumed_from_its_snapshot_is_the_uninterrupted_run(tmp_path: Path) -> None:
    whole_clients = _clients(tmp_path / "whole-clients")
    whole = run(InProcessTransport(whole_clients), _config(tmp_path / "whole", snapshot_every=SNAP_EVERY))

    per = _clients(tmp_path / "clients")
    out = tmp_path / "run"
    with pytest.raises(Stopped):
        run(StopsAfter(per, STOP_AFTER), _config(out, snapshot_every=SNAP_EVERY))
    snapshot = out / "checkpoints" / "snapshot.npz"
    lines = (out / "rounds.jsonl").read_text().splitlines()
    assert len(lines) == STOP_AFTER - 1  # round 5 was answered and charged, never logged
    releases_before = {rid for rids, _ in _spends(per) for rid in rids}

    resumed = run(InProcessTransport(per), _config(out, snapshot_every=SNAP_EVERY, resume=str(snapshot)))
    # The clients paid for round 5 before the stop, under the session the resumed run goes on with (its snapshot's).
    wire = resumed["wire_run_id"]
    assert wire.startswith("resume#") and f"{wire}:gradient:r5" in releases_before
    assert whole["wire_run_id"] != wire  # another run, another session

    assert resumed["rounds_completed"] == whole["rounds_completed"] == ROUNDS
    np.testing.assert_array_equal(resumed["parameters"], whole["parameters"])
    strip = ("duration_s",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in resumed["rounds"]] == [
        {k: v for k, v in r.items() if k not in strip} for r in whole["rounds"]
    ]
    assert resumed["selection"]["checks"] == whole["selection"]["checks"]
    assert resumed["selection"]["round"] == whole["selection"]["round"]
    np.testing.assert_array_equal(resumed["selected_parameters"], whole["selected_parameters"])
    rounds_file = [json.loads(line)["round"] for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds_file == list(range(1, ROUNDS + 1))
    # each release charged once: the same release ids and the same spend as the uninterrupted run's ledgers
    for (rids, spent), (whole_rids, whole_spent) in zip(_spends(per), _spends(whole_clients), strict=True):
        assert all(r.startswith(f"{wire}:") for r in rids)
        assert [r.split(":", 1)[1] for r in rids] == [r.split(":", 1)[1] for r in whole_rids]
        np.testing.assert_array_equal(spent, whole_spent)
    assert any(np.any(s > 0) for _, s in _spends(per))


def test_a_fresh_noise_stream_on_resume_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The witness: resuming without restoring the generator's state gives round 4's replayed sum other
    noise. The release guard refuses it (the stopped process released round 4 with the saved noise), and
    without the guard the run would differ from the uninterrupted one (what the first test would see)."""
    from coordinator import resume

    whole = run(InProcessTransport(_clients(tmp_path / "w")), _config(tmp_path / "whole"))
    real = resume.load_snapshot

    def fresh_noise(*args: Any, **kwargs: Any) -> resume.Snapshot:
        snap = real(*args, **kwargs)
        other = np.random.default_rng(12345).bit_generator.state
        return resume.Snapshot(**{**snap.__dict__, "rng_state": other})

    monkeypatch.setattr("coordinator.rounds.load_snapshot", fresh_noise)
    for guarded in (True, False):
        per = _clients(tmp_path / f"clients-{guarded}")
        out = tmp_path / f"run-{guarded}"
        with pytest.raises(Stopped):
            run(StopsAfter(per, STOP_AFTER), _config(out, snapshot_every=SNAP_EVERY))
        resumed_cfg = _config(out, resume=str(out / "checkpoints" / "snapshot.npz"))
        if guarded:
            with pytest.raises(resume.ResumeDriftError, match="round 4's gradient release differs"):
                run(InProcessTransport(per), resumed_cfg)
        else:
            monkeypatch.setattr(resume.ReleaseGuard, "release", lambda self, ask: self.inner.release(ask))
            resumed = run(InProcessTransport(per), resumed_cfg)
            assert not np.array_equal(resumed["parameters"], whole["parameters"])


class LosesAReply(StopsAfter):
    """As StopsAfter, and round ``lost``'s gradient reply from the first node never arrives (the client answered
    and was charged; the coordinator released the sum without it)."""

    def __init__(self, node_configs: Mapping[int, Mapping[str, Any]], after: int, lost: int) -> None:
        super().__init__(node_configs, after)
        self.lost = lost

    def send(self, message_type: str, payloads: Mapping[int, Any], *, timeout: float) -> Any:
        out = super().send(message_type, payloads, timeout=timeout)
        rounds = {int(config["round"]) for config, _ in payloads.values()}
        if message_type.endswith("gradient") and rounds == {self.lost}:
            del out.replies[min(out.replies)]
            out.missing += 1
        return out


def test_a_resumed_release_that_differs_from_the_stopped_ones_is_refused_before_use(tmp_path: Path) -> None:
    """Round 5's sum lacked a client's answer before the stop; after it the client's stored answer is
    replayed, so the same noise would fall on another sum: the run stops before that release is used."""
    from coordinator.resume import ResumeDriftError

    per = _clients(tmp_path / "clients")
    out = tmp_path / "run"
    with pytest.raises(Stopped):
        run(LosesAReply(per, STOP_AFTER + 1, lost=STOP_AFTER), _config(out, snapshot_every=SNAP_EVERY))
    logged = [json.loads(line)["round"] for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5]
    with pytest.raises(ResumeDriftError, match="round 5's gradient release differs"):
        run(
            InProcessTransport(per),
            _config(out, snapshot_every=SNAP_EVERY, resume=str(out / "checkpoints" / "snapshot.npz")),
        )
    # round 4 was made again alike; nothing of round 5's differing release was used or logged
    assert [json.loads(line)["round"] for line in (out / "rounds.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_resume_without_the_stopped_runs_fingerprints_is_refused(tmp_path: Path) -> None:
    """The same lost reply as above, resumed where the guard has nothing to compare (a hostile review,
    2026-11-27): into another output_dir (the fingerprints stay beside the snapshot), or with the fingerprint
    file gone or cut short. Either would add round 5's restored noise to a sum that now holds the lost answer,
    and the two releases' difference would be that client's exact sum. Refused before any request is charged."""
    from coordinator.resume import ResumeDriftError

    per = _clients(tmp_path / "clients")
    out = tmp_path / "run"
    with pytest.raises(Stopped):
        run(LosesAReply(per, STOP_AFTER + 1, lost=STOP_AFTER), _config(out, snapshot_every=SNAP_EVERY))
    before = _spends(per)
    snapshot = str(out / "checkpoints" / "snapshot.npz")
    with pytest.raises(CoordinatorConfigError, match="expected the snapshot in this run's own folder"):
        run(InProcessTransport(per), _config(tmp_path / "elsewhere", snapshot_every=SNAP_EVERY, resume=snapshot))
    fingerprints = out / "checkpoints" / "releases.jsonl"
    lines = fingerprints.read_text().splitlines(keepends=True)
    for kept, found in (([], "none"), (lines[:2], "rounds up to 2")):  # the snapshot is round 3's
        fingerprints.write_text("".join(kept))
        with pytest.raises(ResumeDriftError, match=f"rounds up to 3 in .*, found {found}"):
            run(InProcessTransport(per), _config(out, snapshot_every=SNAP_EVERY, resume=snapshot))
    fingerprints.unlink()
    with pytest.raises(ResumeDriftError, match="found none"):
        run(InProcessTransport(per), _config(out, snapshot_every=SNAP_EVERY, resume=snapshot))
    for (rids, spent), (was_rids, was_spent) in zip(_spends(per), before, strict=True):
        assert rids == was_rids
        np.testing.assert_array_equal(spent, was_spent)


def test_a_run_with_other_settings_may_not_resume_a_snapshot(tmp_path: Path) -> None:
    per = _clients(tmp_path / "clients")
    out = tmp_path / "run"
    with pytest.raises(Stopped):
        run(StopsAfter(per, STOP_AFTER), _config(out, snapshot_every=SNAP_EVERY))
    snapshot = str(out / "checkpoints" / "snapshot.npz")
    with pytest.raises(CoordinatorConfigError, match="made with other settings"):
        run(InProcessTransport(per), _config(out, learning_rate=0.25, resume=snapshot))


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"noise_seed": None}, "only a simulation with noise_seed"),
        ({"monitor": "svt", "monitor_threshold": 1, "monitor_epsilon": 0.5}, "without local steps, monitor or secure"),
        ({"output_dir": ""}, "snapshots need output_dir"),
    ],
)
def test_snapshots_are_refused_outside_seeded_gradient_runs(
    tmp_path: Path, extra: dict[str, Any], expected: str
) -> None:
    with pytest.raises(CoordinatorConfigError, match=expected):
        _config(tmp_path, **{"snapshot_every": 2, **extra})


def test_a_snapshot_of_another_run_or_a_damaged_one_is_refused(tmp_path: Path) -> None:
    per = _clients(tmp_path / "clients")
    out = tmp_path / "run"
    with pytest.raises(Stopped):
        run(StopsAfter(per, STOP_AFTER), _config(out, snapshot_every=SNAP_EVERY))
    snapshot = out / "checkpoints" / "snapshot.npz"
    other = CoordinatorConfig(**{**_config(out).__dict__, "run_id": "other", "resume": str(snapshot)})
    with pytest.raises(CoordinatorConfigError, match="the snapshot is run 'resume'"):
        run(InProcessTransport(per), other)
    damaged = tmp_path / "damaged.npz"
    damaged.write_bytes(snapshot.read_bytes()[:100])
    with pytest.raises(CoordinatorConfigError, match="cannot read the snapshot"):
        run(InProcessTransport(per), _config(out, resume=str(damaged)))
