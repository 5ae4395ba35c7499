"""The ``flwr-clientapp`` shim (simulations/deploy/clientapp_sandbox.py): nothing a ClientApp starts outlives it.

The shim's own file, with Flower's entry point swapped for a hostile stand-in (it forks a daemon
in its own session, ignores SIGTERM and SIGINT and never returns), run as a subprocess:

- SIGTERM to the shim: after its grace period the whole PID namespace is killed, daemon included;
- the stand-in's FLWR_HOME is a fresh folder, removed when the run ends.

The end-to-end version, on Flower's deployment engine with a hostile bundle, is in
tests/e2e/test_hostile_bundle.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulations.deploy import clientapp_sandbox

MARK = "fedfilter-sandbox-test-daemon"
HOSTILE = (
    "import json, os, signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', "
    f"'{MARK}'], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL)\n"
    "open(sys.argv[-1], 'w').write(json.dumps({'flwr_home': os.environ['FLWR_HOME'], 'pid': os.getpid()}))\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


def marked() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if MARK.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_clientapp_that_ignores_stop_signals_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    why = clientapp_sandbox.namespaces_work("unshare")
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"this test must run in CI and cannot: no PID namespaces here ({why})")
        pytest.skip(f"no PID namespaces here: {why}")
    source = Path(clientapp_sandbox.__file__).read_text()
    source = source.replace("GRACE_S = 10.0", "GRACE_S = 2.0")
    source = source.replace("RUN_FLOWER = (", f"RUN_FLOWER = {HOSTILE!r}\n_UNUSED = (")
    shim = tmp_path / "shim.py"
    shim.write_text(source + "\n\nif __name__ == '__main__':\n    raise SystemExit(main())\n")
    report = tmp_path / "report.json"
    proc = subprocess.Popen([sys.executable, str(shim), str(report)], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not report.exists() or not marked():
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.1)
        home = Path(json.loads(report.read_text())["flwr_home"])
        assert home.parent.name.startswith("fedfilter-clientapp-") and home.parent.exists()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)  # the grace period (2 s here), then the namespace is killed
        time.sleep(0.5)
        assert marked() == []  # the daemon went with it
        assert not home.parent.exists()  # and its fresh folders
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in marked():
            os.kill(pid, signal.SIGKILL)
