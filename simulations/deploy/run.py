"""``fedfilter run APP CONNECTION -c ...``: ``flwr run --stream`` with a checked config and an honest exit code.

Two things a script cannot get from ``flwr run`` in flwr 1.41: a run-config key Flower does not
know is answered only with ``[code: 15] Invalid run configuration``, and ``flwr run --stream``
exits 0 even when the ServerApp fails. This wrapper

1. checks every ``-c`` key against the app's ``[tool.flwr.app.config]`` and the coordinator's own
   configuration (:class:`coordinator.config.CoordinatorConfig`) before anything is submitted,
   naming an unknown key and the known ones;
2. runs ``flwr run APP CONNECTION -c ... --stream``, passing its output through;
3. reads the run's final status with ``flwr ls CONNECTION --run-id N --format json`` and exits
   0 only for ``finished:completed`` (1 otherwise, with Flower's status details).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protocol.errors import FedfilterError

_STARTED = re.compile(r"Successfully started run (\d+)")


class RunConfigError(FedfilterError, ValueError):
    """A run configuration the app or the coordinator would refuse."""


def app_run_config(app: Path) -> dict[str, Any]:
    """The app's default run configuration, ``[tool.flwr.app.config]`` of ``APP/pyproject.toml``."""
    path = app / "pyproject.toml"
    try:
        project = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise RunConfigError(f"app: expected a Flower app with {path}, found none") from exc
    config = project.get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if not isinstance(config, dict):
        raise RunConfigError(f"app: expected [tool.flwr.app.config] in {path}, found none")
    return config


def checked_run_config(app: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """The run configuration ``flwr run`` would build, after the checks the coordinator would make."""
    from flwr.common.config import parse_config_args

    from coordinator.config import CoordinatorConfig, CoordinatorConfigError

    defaults = app_run_config(app)
    try:
        asked = parse_config_args(list(overrides)) if overrides else {}
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise RunConfigError(f"-c: expected key=value pairs in TOML syntax, found {list(overrides)}: {exc}") from exc
    unknown = sorted(set(asked) - set(defaults))
    if unknown:
        raise RunConfigError(f"run config: unknown keys {unknown}; the app's keys are {sorted(defaults)}")
    merged = {**defaults, **asked}
    try:
        CoordinatorConfig.from_run_config(merged)
    except (CoordinatorConfigError, ValueError) as exc:
        raise RunConfigError(f"run config: {exc}") from exc
    return merged


def run_status(flwr: str, connection: str, run_id: int) -> dict[str, Any]:
    """Flower's record of a run (``flwr ls --run-id --format json``): status and details."""
    out = subprocess.run(
        [flwr, "ls", connection, "--run-id", str(run_id), "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        runs = json.loads(out.stdout).get("runs", [])
    except json.JSONDecodeError:
        runs = []
    if not runs:
        return {"status": "unknown", "status-details": (out.stdout + out.stderr).strip()[-500:]}
    return dict(runs[0])


def run(app: Path, connection: str, overrides: Sequence[str]) -> int:
    """Check (a :class:`RunConfigError` before anything is submitted), run, and return 0 only if Flower
    records the run as completed.
    """
    checked_run_config(app, overrides)
    flwr = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
    argv = [flwr, "run", str(app), connection, *[a for o in overrides for a in ("-c", o)], "--stream"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_id = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if run_id is None and (found := _STARTED.search(line)):
            run_id = int(found.group(1))
    code = proc.wait()
    if run_id is None:
        print(f"fedfilter run: error: the run was not started (flwr run exited {code})", file=sys.stderr)
        return 1
    status = run_status(flwr, connection, run_id)
    if status.get("status") != "finished:completed":
        print(
            f"fedfilter run: run {run_id} ended {status.get('status')!r}: {status.get('status-details', '')}",
            file=sys.stderr,
        )
        return 1
    print(f"fedfilter run: run {run_id} completed")
    return 0
