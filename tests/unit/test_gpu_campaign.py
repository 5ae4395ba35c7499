"""scripts/gpu_campaign.py: the lent GPU's driver reads each job's pace and stops the job that cannot finish.

A lent machine's call is the only place the driver runs for real (docs/results.md, the H200 call of
2026-11-27); these tests check its decisions on recorded paces, with stand-in processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
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


def test_pace_is_read_up_to_now_over_the_last_window() -> None:
    assert gc.pace(_job("a", 100, [(10.0, 1)]), 60, now=30.0) is None  # 20 s of record: under half the window
    steady = _job("a", 100, [(10.0 * i, 5 * i) for i in range(1, 12)])  # 0.5 rounds a second to t = 110
    assert gc.pace(steady, 60, now=110.0) == pytest.approx(0.5)
    faster = _job("a", 100, [(0.0, 0), (60.0, 6), (120.0, 66)])  # 0.1/s, then 1/s: the last window counts
    assert gc.pace(faster, 60, now=120.0) == pytest.approx(1.0)
    # A job that stops moving slows down (it kept its last pace before), down to 0 a window later.
    assert gc.pace(faster, 60, now=150.0) == pytest.approx(60 / 90)
    assert gc.pace(faster, 60, now=181.0) == 0.0
    # No round yet: no pace while it sets up, 0 after three windows.
    assert gc.pace(_job("b", 100, []), 60, now=179.0) is None
    assert gc.pace(_job("b", 100, []), 60, now=180.0) == 0.0


def test_the_job_with_most_rounds_left_among_those_that_cannot_finish_is_stopped() -> None:
    # As in the H200 call: at 0.2-0.37 rounds a second and 450 s left, 750- and 500-round jobs cannot finish.
    short = _job("sub/0.3", 150, [(0.0, 0), (60.0, 22)])
    mid = _job("sub/1", 500, [(0.0, 0), (60.0, 19)])
    long = _job("tuned/1", 750, [(0.0, 0), (60.0, 12)])
    done = _job("tuned/0.3", 900, [(0.0, 0), (60.0, 5)], rc=0)  # exited: never chosen
    late = gc.too_late([short, mid, long, done], 450.0, 60, now=60.0)
    assert late is not None and late[0] is long
    assert late[1] == "738 rounds left at 0.20/s, 450 s to the deadline"
    late = gc.too_late([short, mid, done], 450.0, 60, now=60.0)
    assert late is not None and late[0] is mid  # 481 rounds at 0.32/s: 1,519 s
    assert gc.too_late([short, done], 450.0, 60, now=60.0) is None  # 128 rounds at 0.37/s: 349 s
    assert gc.too_late([_job("new", 150, [(0.0, 1)])], 10.0, 60, now=10.0) is None  # no pace yet: never blind
    # A job at its last round is writing its end: never stopped, even past the margin (a review).
    assert gc.too_late([_job("end", 150, [(0.0, 100), (60.0, 150)])], -5.0, 60, now=60.0) is None
    # A job that hangs is stopped once its pace has fallen to what it can no longer make up.
    hung = _job("hung", 150, [(0.0, 0), (60.0, 60)])
    assert gc.too_late([hung], 200.0, 60, now=60.0) is None  # 90 rounds at 1/s: 90 s
    late = gc.too_late([hung], 100.0, 60, now=160.0)
    assert late is not None and late[0] is hung and late[1].startswith("90 rounds left at 0.00/s")


def test_stopping_ends_the_whole_process_group_even_a_member_that_ignores_sigterm(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    script = f"trap '' TERM; sleep 300 & echo $! > {pidfile}; wait; wait"
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    try:
        for _ in range(100):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.05)
        child = int(pidfile.read_text())
        job = gc.Running("k", "k", 0, 10, proc, None, 0.0)  # type: ignore[arg-type]
        gc.stop([job], "deadline", grace=0.5)
        assert proc.returncode is not None and job.stopped == "deadline"
        for _ in range(100):  # the child is gone (SIGKILL to the group), not left behind
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"process {child} of the stopped job's group is still running")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_round_reached_is_the_newest_folders_last_complete_line(tmp_path: Path) -> None:
    campaign = tmp_path / "campaign"
    assert gc.reached(tmp_path, "trial_x") is None
    (campaign / "trial_x-20261127-120000").mkdir(parents=True)
    assert gc.reached(tmp_path, "trial_x") is None  # no round yet
    rounds = campaign / "trial_x-20261127-120000" / "rounds.jsonl"
    rounds.write_text("".join(json.dumps({"round": r, "task": "gradient"}) + "\n" for r in (1, 2, 3)) + '{"rou')
    assert gc.reached(tmp_path, "trial_x") == 3  # a line still being written is skipped
    # Another job whose key begins like this one's is not this one (its name goes on before the stamp).
    (campaign / "trial_x-y-20261127-130000").mkdir()
    (campaign / "trial_x-y-20261127-130000" / "rounds.jsonl").write_text(json.dumps({"round": 40}) + "\n")
    assert gc.reached(tmp_path, "trial_x") == 3
    # Of this job's attempts, the newest by its stamp.
    (campaign / "trial_x-20261127-140000").mkdir()
    (campaign / "trial_x-20261127-140000" / "rounds.jsonl").write_text(json.dumps({"round": 7}) + "\n")
    assert gc.reached(tmp_path, "trial_x") == 7


def test_only_whole_rows_come_back() -> None:
    assert gc.whole_row(b'{"job": "a", "final_accuracy": 0.9}')
    assert not gc.whole_row(b'{"job": "a", "final_acc')  # a write cut short
    assert not gc.whole_row(b"[1, 2]") and not gc.whole_row(b"")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--budget", "nan"], "--budget: expected a finite number of seconds above 0, got nan"),
        (["--budget", "-5"], "--budget: expected a finite number of seconds above 0, got -5.0"),
        (["--budget", "60", "--window", "inf"], "--window: expected a finite number of seconds above 0, got inf"),
        (["--budget", "60", "--max-jobs", "0"], "--max-jobs and --threads: expected at least 1, got 0 and 2"),
        (["--budget", "60", "--only", "(["], "--only: expected a regular expression, got '(['"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_job_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    common = ["--only", "x", "--data-dir", str(tmp_path), "--results", str(tmp_path / "r.jsonl")]
    common += ["--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as stopped:
        gc.main(common + args)
    assert stopped.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()
