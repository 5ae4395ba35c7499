"""``fedfilter run``: a run-config typo is named before anything is submitted; failure is a non-zero exit."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from simulations.cli import main as cli_main
from simulations.deploy import run as deployed_run

APP = Path(__file__).resolve().parents[2]


def test_a_typo_in_a_run_config_key_names_the_key_and_the_known_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", str(APP), "nowhere", "-c", "rounds=2 noise-sdt=3.0"]) == 2
    err = capsys.readouterr().err
    assert "run config: unknown keys ['noise-sdt']; the app's keys are [" in err and "'noise-std'" in err


def test_a_value_the_coordinator_refuses_is_named_before_submission(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", str(APP), "nowhere", "-c", "noise-std=-1.0"]) == 2
    assert "noise_std" in capsys.readouterr().err


def test_exit_code_follows_flowers_run_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """flwr run --stream exits 0 when the ServerApp fails: the wrapper asks Flower for the run's status."""

    class FakeRun:
        def __init__(self, argv: list[str], **kwargs: Any) -> None:
            self.stdout = iter(["Successfully started run 42\n", "... ServerApp failed ...\n"])

        def wait(self) -> int:
            return 0  # as flwr 1.41 does, whatever happened

    monkeypatch.setattr(subprocess, "Popen", FakeRun)
    for status, expected in (("finished:failed", 1), ("finished:completed", 0)):
        monkeypatch.setattr(deployed_run, "run_status", lambda *a, s=status: {"status": s, "status-details": "x"})
        assert deployed_run.run(APP, "conn", ["rounds=2"]) == expected
    assert "run 42 ended 'finished:failed'" in capsys.readouterr().err
