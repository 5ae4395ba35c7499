"""scripts/gpu_campaign.py: the lent GPU's driver reads each job's pace and stops the job that cannot finish.

A lent machine's call is the only place the driver runs for real (docs/results.md, the H200 call of
2026-11-27); these tests check its decisions on recorded paces, with stand-in processes.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_campaign", ROOT / "scripts" / "gpu_campaign.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_campaign"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gc = _driver()


class _Proc:
    def __init__(self, rc: int | None = None) -> None:
        self.returncode = rc
        self.pid = -1

    def poll(self) -> int | None:
        return self.returncode


def _job(key: str, last: int, seen: list[tuple[float, int]], rc: int | None = None) -> Any:
    return gc.Running(key, key.replace("/", "_"), 0, last, _Proc(rc), None, 0.0, list(seen))  # type: ignore[arg-type]


def test_pace_is_read_over_the_last_window_and_waits_for_enough_record() -> None:
    assert gc.pace(_job("a", 100, [(10.0, 1)]), 60) is None  # one point
    assert gc.pace(_job("a", 100, [(10.0, 1), (30.0, 9)]), 60) is None  # 20 s of record: under half the window
    steady = _job("a", 100, [(10.0 * i, 5 * i) for i in range(1, 12)])  # 0.5 rounds a second throughout
    assert gc.pace(steady, 60) == pytest.approx(0.5)
    faster = _job("a", 100, [(0.0, 0), (60.0, 6), (120.0, 66)])  # 0.1/s, then 1/s: the last window counts
    assert gc.pace(faster, 60) == pytest.approx(1.0)


def test_the_job_with_most_rounds_left_among_those_that_cannot_finish_is_stopped() -> None:
    # As in the H200 call: at 0.33-0.40 rounds a second and 450 s left, 750-round jobs cannot finish.
    short = _job("sub/0.3", 150, [(0.0, 0), (60.0, 22)])
    mid = _job("sub/1", 500, [(0.0, 0), (60.0, 19)])
    long = _job("tuned/1", 750, [(0.0, 0), (60.0, 12)])
    done = _job("tuned/0.3", 900, [(0.0, 0), (60.0, 5)], rc=0)  # exited: never chosen
    late = gc.too_late([short, mid, long, done], 450.0, 60)
    assert late is not None and late[0] is long
    assert late[1] == "738 rounds left at 0.20/s, 450 s to the deadline"
    late = gc.too_late([short, mid, done], 450.0, 60)
    assert late is not None and late[0] is mid  # 481 rounds at 0.32/s: 1,519 s
    assert gc.too_late([short, done], 450.0, 60) is None  # 128 rounds at 0.37/s: 349 s
    assert gc.too_late([_job("new", 150, [(0.0, 1)])], 10.0, 60) is None  # no pace yet: never stopped blind


def test_the_round_reached_is_the_newest_folders_last_complete_line(tmp_path: Path) -> None:
    campaign = tmp_path / "campaign"
    assert gc.reached(tmp_path, "trial_x") is None
    (campaign / "trial_x-20261127-120000").mkdir(parents=True)
    assert gc.reached(tmp_path, "trial_x") is None  # no round yet
    rounds = campaign / "trial_x-20261127-120000" / "rounds.jsonl"
    rounds.write_text("".join(json.dumps({"round": r, "task": "gradient"}) + "\n" for r in (1, 2, 3)) + '{"rou')
    assert gc.reached(tmp_path, "trial_x") == 3  # a line still being written is skipped
    (campaign / "trial_xy-20261127-130000").mkdir()  # another job's prefix is not this one's ("-" follows)
    (campaign / "trial_xy-20261127-130000" / "rounds.jsonl").write_text(json.dumps({"round": 40}) + "\n")
    assert gc.reached(tmp_path, "trial_x") == 3
