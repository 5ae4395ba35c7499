"""A simulation on an existing two-node Ray cluster (issue 24): Flower's simulation engine joins it.

The test starts a Ray head and a worker node on 127.0.0.1 with Ray's own CLI (``ray start --block``,
one CPU each, so Flower places one ClientApp actor on each node), runs the real coordinator and
agents through :func:`simulations.engine.run_flower` with ``address=`` the head, and checks:

- both nodes answered requests (an observing ClientApp mod records the Ray node of each answer);
- every client's ledger was written by the process that ran it, at its node config's path, and
  holds one charged release per round; the run's rounds completed with every unit charged;
- ``fedfilter simulate --ray-address`` reaches the same cluster (the README's command).

Both Ray nodes are stopped by their process groups' ids at the end, whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from simulations.engine import backend_config, run_flower
from simulations.federation import write_clients
from tests.e2e.common import cannot_run, make_parts

CLIENTS, RECORDS, ROUNDS = 4, 20, 2
RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(RAY), "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped with every process it started
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait_for_nodes(
    address: str, count: int, procs: list[subprocess.Popen[bytes]], log: Path, timeout: float = 90.0
) -> None:
    code = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(1 for n in ray.nodes() if n['Alive'])); ray.shutdown()"
    )
    deadline = time.monotonic() + timeout
    found = ""
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            raise AssertionError(f"a Ray node exited while starting; its log ends: {log.read_text()[-1500:]}")
        run = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=60)
        found = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-300:]
        if found == str(count):
            return
        time.sleep(1.0)
    raise AssertionError(f"expected {count} live Ray nodes at {address}, found {found!r}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    if not RAY.exists():
        cannot_run(f"needs Ray's CLI next to the interpreter ({RAY}); it comes with flwr[simulation]")
    # Ray's Unix sockets live under its temp folder, and AF_UNIX paths are at most 107 bytes: a short one.
    tmp_path = Path(tempfile.mkdtemp(prefix="ffray-", dir="/tmp"))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    head = _start(
        ["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={tmp_path / 'ray'}"],
        tmp_path / "head.log",
    )
    procs = [head]
    try:
        _wait_for_nodes(address, 1, procs, tmp_path / "head.log")
        procs.append(_start([f"--address={address}"], tmp_path / "worker.log"))
        _wait_for_nodes(address, 2, procs, tmp_path / "worker.log")
        yield address
    finally:
        for proc in reversed(procs):
            _stop(proc)
        # Ray's address file names the stopped cluster; left behind, a later ray.init() without an
        # address would try to join it (fedfilter's own engine passes "local", other code may not).
        for folder in (tmp_path / "ray", Path("/tmp/ray")):
            address_file = folder / "ray_current_cluster"
            if address_file.exists() and address_file.read_text().strip().endswith(f":{port}"):
                address_file.unlink()
        shutil.rmtree(tmp_path, ignore_errors=True)


def _observer(out: Path) -> Callable[..., Any]:
    """A ClientApp mod that notes which Ray node and process answered each message (observation only)."""

    def mod(msg: Any, context: Any, call_next: Callable[..., Any]) -> Any:
        import ray

        reply = call_next(msg, context)
        node = ray.get_runtime_context().get_node_id()
        pid = int(context.node_config["partition-id"])
        with (out / f"{pid}.{os.getpid()}.{msg.metadata.message_type}.{time.monotonic_ns()}").open("w") as f:
            f.write(node)
        return reply

    return mod


def test_a_simulation_runs_on_an_existing_two_node_ray_cluster(cluster: str, tmp_path: Path) -> None:
    per = write_clients(
        tmp_path / "clients",
        make_parts(CLIENTS, RECORDS, seed=3),
        epsilon=50.0,
        delta=1e-5,
        unit="record",
        trust="central",
        noise_seed=0,
    )
    seen = tmp_path / "seen"
    seen.mkdir()
    cfg = CoordinatorConfig(
        num_nodes=CLIENTS,
        n_public=CLIENTS * RECORDS,
        rounds=ROUNDS,
        noise_std=4.0,
        l2_clip=1.0,
        learning_rate=0.5,
        trust="central",
        unit="record",
        model="logreg",
        model_args=json.dumps({"in_features": 4, "n_classes": 2}),
        run_id="ray-cluster",
        output_dir=str(tmp_path / "out"),
        noise_seed=0,
        progress=False,
    )
    config = backend_config(address=cluster)
    assert config["init_args"]["address"] == cluster and "num_cpus" not in config["init_args"]
    # the product's engine, with an observing mod in front of the one that adds each node's config
    results = run_flower(cfg, per, address=cluster, mods=[_observer(seen)])
    assert results["rounds_completed"] == ROUNDS, results.get("stopped_because")

    nodes = {p.read_text() for p in seen.iterdir()}
    assert len(nodes) == 2, f"expected both Ray nodes to answer, found {nodes}"
    answered_by = {int(p.name.split(".")[0]) for p in seen.iterdir() if ".train." in p.name}
    assert answered_by == set(range(CLIENTS))
    driver = os.getpid()
    assert all(int(p.name.split(".")[1]) != driver for p in seen.iterdir())  # the actors answered, not this process
    for i in range(CLIENTS):
        with Ledger.open_existing(per[i]["ledger-path"]) as ledger:
            releases = list(ledger.releases())
            state = ledger.state()
        assert len(releases) == ROUNDS
        assert np.all(state["spent"] > 0)


@pytest.mark.slow  # the engine's join is the test above's; this adds the CLI's flag (test budget, issue 24)
def test_simulate_cli_joins_the_cluster(cluster: str, tmp_path: Path) -> None:
    """``fedfilter simulate --ray-address`` (README): the quickstart on the cluster, ledgers in --out."""
    out = tmp_path / "run"
    env = os.environ | {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulations.cli",
            "simulate",
            "--clients",
            "4",
            "--rounds",
            "1",
            "--ray-address",
            cluster,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 1
    assert len(list((out / "ledgers").glob("*.sqlite"))) == 4


def test_the_engine_joins_a_cluster_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an address Ray starts here ("local"), even when a stopped cluster left its address file."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init = backend_config(num_cpus=2)["init_args"]
    assert init["address"] == "local" and init["num_cpus"] == 2
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert backend_config()["init_args"] == {"address": "127.0.0.1:1", "logging_level": "ERROR", "log_to_driver": False}
