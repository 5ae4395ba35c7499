"""One agent, one ledger, two federations on Flower's deployment engine (issue 23, privacy.md §11).

Two coordinators (two SuperLinks, each with its own SuperNode) reach one agent service through two
sockets, one per federation, with quotas 0.4 ("alpha") and 0.8 ("beta") of every record's budget.
The agent has two workloads on the same records: ``builtin`` (logistic regression, cross-entropy) and
``workloads.regression`` (linear regression, squared error).

1. alpha's coordinator is hostile: it asks the largest requests the agent's policy allows (each at the
   per-request cap, a quarter of the budget) until its quota is spent; its records stop *for alpha*;
2. beta goes on: a regression run on the same records is answered with every record active, and
   each record's spend is the sum of what the two federations spent, within its budget;
3. the walk-through's drain (noise 1e-6, clip 1e6; the agent's floor and clip limit allow it), sent over
   beta's socket as its SuperNode's proxy forwards requests, is refused by the default per-request cap
   with the fixed text and charges nothing;
4. a third local user, in the sockets' group (so the file mode lets it connect), is refused at both
   sockets by the peer check before a byte is read;
5. ``fedfilter ledger verify``, ``ledger requests`` and ``ledger report`` work on the ledger.

Every process is started in its own session and stopped by PID. Needs root and ``setpriv`` for step 4;
skipped otherwise, except under ``CI=true``, where it fails with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.ledger import Ledger
from client_agent.state import AgentState
from protocol.filters import GaussianFilter
from simulations.deploy.agent_files import write_agent_toml
from simulations.deploy.keys import make_node_keys
from simulations.deploy.local import LocalDeployment, Service, stage_app
from tests.e2e.common import cannot_run, make_parts

pytestmark = pytest.mark.flower

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

RECORDS = 24
EPSILON, DELTA = 2.0, 1e-5
QUOTAS = {"alpha": 0.4, "beta": 0.8}
SOCKET_GID, THIRD_UID = 64030, 64031  # the sockets' group; a local user who is neither federation's peer
THRESHOLD = GaussianFilter.gdp(epsilon=EPSILON, delta=DELTA).threshold
# alpha's hostile rounds cost (clip / noise)^2 = a quarter of the budget, exactly the default cap.
HOSTILE_NOISE = float(1.0 / np.sqrt(0.25 * THRESHOLD)) * (1 + 1e-9)


def run_config(run_id: str, rounds: int, *, noise_std: float, l2_clip: float = 1.0, **over: Any) -> dict[str, Any]:
    return {
        "task": "gradient",
        "num-nodes": 1,
        "n-public": RECORDS,
        "rounds": rounds,
        "noise-std": noise_std,
        "l2-clip": l2_clip,
        "learning-rate": 0.5,
        "trust": "local",
        "unit": "record",
        "model": "logreg",
        "model-args": json.dumps({"in_features": 4, "n_classes": 2}),
        "run-id": run_id,
        "round-timeout": 120.0,
        "enrol-timeout": 120.0,
    } | over


@dataclass
class Setup:
    root: Path
    ledger: Path
    sockets: dict[str, Path]
    deps: dict[str, LocalDeployment]
    app: Path
    service: Service


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("setpriv") is None:
        cannot_run("needs root and setpriv (util-linux): a third local user probes both sockets")
    root = tmp_path_factory.mktemp("federations")
    x, y = make_parts(1, RECORDS, seed=5)[0]
    np.savez(root / "data.npz", x=x, y=y)
    # Outside pytest's root-only folder, so that the third user reaches the sockets as far as the file modes go.
    outside = Path(tempfile.mkdtemp(prefix="fedfilter-federations-"))
    outside.chmod(0o755)
    sockets_dir = outside / "sockets"
    sockets_dir.mkdir()
    os.chown(sockets_dir, 0, SOCKET_GID)
    sockets_dir.chmod(0o2750)  # setgid: each socket (mode 0660) is in the sockets' group
    root.chmod(0o755)
    sockets = {name: sockets_dir / f"{name}.sock" for name in QUOTAS}
    toml = write_agent_toml(
        root / "agent.toml",
        {
            "ledger-path": str(root / "ledger.sqlite"),
            "data-path": str(root / "data.npz"),
            "epsilon": EPSILON,
            "delta": DELTA,
            "unit": "record",
            "trust": "local",
            "workloads": ["workloads.regression:REGRESSION"],
            # The walk-through's agent: a floor and a clip limit that let the drain through to the cap.
            "policy-min-noise-std": 1e-6,
            "policy-max-clip": 1e6,
        },
    )
    with toml.open("a") as handle:
        for name, quota in QUOTAS.items():
            handle.write(f'\n[federations.{name}]\nsocket = "{sockets[name]}"\nquota = {quota}\nsocket-peers = ["0"]\n')
    deps = {name: LocalDeployment(root / f"dep-{name}") for name in QUOTAS}
    try:
        app = stage_app(root / "app")
        service = deps["alpha"].start_agent_service("owner", toml)
        for name, dep in deps.items():
            dep.start_superlink()
            key = make_node_keys(root / "keys" / name).private
            node_id = dep.register(key.with_name(key.name + ".pub"))
            node = dep.start_agent(f"node-{name}", toml, key, agent=service, socket=sockets[name])
            assert node.node_id == node_id
        yield Setup(root, root / "ledger.sqlite", sockets, deps, app, service)
    finally:
        for dep in deps.values():
            dep.stop_all()
        shutil.rmtree(outside, ignore_errors=True)
        assert all(dep.survivors() == [] for dep in deps.values())


def spends(ledger_path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    with Ledger.open_existing(ledger_path) as ledger:
        state = AgentState.from_arrays(ledger.state())
        quotas = {name: ledger.quota_state(name) for name in QUOTAS}
    assert state.spent is not None
    return state.spent, quotas


def test_a_hostile_federation_drains_its_own_quota_while_the_other_goes_on(setup: Setup) -> None:
    alpha, beta = setup.deps["alpha"], setup.deps["beta"]
    alpha.run(setup.app, run_config("alpha-drain", 3, noise_std=HOSTILE_NOISE), timeout=600)
    spent, quotas = spends(setup.ledger)
    assert quotas["alpha"] is not None and quotas["beta"] is None
    # Drained: round 1 costs a quarter of the budget, round 2 the rest of the quota (partial clipping) for
    # every record whose gradient still reaches the clip; those stop for alpha. None goes past its quota.
    assert quotas["alpha"]["stopped"].mean() >= 0.5
    assert quotas["alpha"]["spent"].max() == pytest.approx(QUOTAS["alpha"] * THRESHOLD, rel=1e-3)
    assert np.all(quotas["alpha"]["spent"] <= QUOTAS["alpha"] * THRESHOLD)
    np.testing.assert_array_equal(spent, quotas["alpha"]["spent"])
    summary = beta.run(
        setup.app,
        run_config(
            "beta-regression",
            1,
            noise_std=8.0,
            model="linreg",
            **{"model-args": json.dumps({"in_features": 4}), "workload": "workloads.regression:REGRESSION"},
        ),
        timeout=600,
    )
    assert summary  # the run finished and wrote its summary
    spent, quotas = spends(setup.ledger)
    assert quotas["beta"] is not None and not quotas["beta"]["stopped"].any()  # every record still active for beta
    assert np.all(quotas["beta"]["spent"] > 0)
    np.testing.assert_allclose(spent, quotas["alpha"]["spent"] + quotas["beta"]["spent"], rtol=1e-12)
    assert np.all(spent <= THRESHOLD)


def test_the_default_cap_refuses_the_walkthroughs_drain(setup: Setup) -> None:
    """The drain, as beta's SuperNode's proxy would forward it (the agent service's real path, over beta's socket)."""
    from client_agent.client_app import forward
    from protocol import messages as wire

    with Ledger.open_existing(setup.ledger) as ledger:
        before = ledger.requests_answered()
        spent_before = ledger.state()["spent"].copy()
    drain = wire.GradientRequest(
        request_id="drain:gradient:r1",
        run_id="drain",
        round=1,
        noise_std=1e-6,
        l2_clip=1e6,
        trust="local",
        unit="record",
        model="logreg",
        model_args=json.dumps({"in_features": 4, "n_classes": 2}),
        parameters=np.zeros(10, np.float32),
    )
    code, reason, _, _ = forward(str(setup.sockets["beta"]), wire.GRADIENT, *wire.encode_request(drain), timeout=120)
    assert (code, reason) == (wire.ERR_POLICY, wire.ERROR_TEXT[wire.ERR_POLICY])  # fixed text on the wire
    with Ledger.open_existing(setup.ledger) as ledger:
        assert ledger.requests_answered() == before and ledger.requests_in_run("drain", "beta") == 0
        np.testing.assert_array_equal(ledger.state()["spent"], spent_before)
    assert "policy-max-request-share = 0.25" in setup.service.log_text()


PROBE = """
import json, socket, struct, sys
out = {}
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        s.sendall(struct.pack(">Q", 4) + b"ping")
        out[path] = "reply" if s.recv(16) else "closed"
    except (ConnectionResetError, BrokenPipeError):  # closed with our bytes unread: refused all the same
        out[path] = "closed"
    except OSError as exc:
        out[path] = type(exc).__name__
    s.close()
print(json.dumps(out))
"""


def test_a_third_local_user_is_refused_at_both_sockets(setup: Setup) -> None:
    from tests.e2e.test_hostile_bundle import node_python

    python = node_python()  # a python an unprivileged user can execute (a pyenv under /root is not)
    if python is None:
        cannot_run(f"needs a python{sys.version_info[0]}.{sys.version_info[1]} that an unprivileged user can execute")
    assert python is not None
    probe = subprocess.run(
        ["setpriv", f"--reuid={THIRD_UID}", f"--regid={THIRD_UID}", f"--groups={SOCKET_GID}"]
        + ["/usr/bin/env", "-i", python, "-I", "-c", PROBE]
        + [str(p) for p in setup.sockets.values()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0 and "Permission denied" in probe.stderr and "python" in probe.stderr:
        cannot_run(f"the interpreter {sys.executable} is not executable by uid {THIRD_UID}: {probe.stderr}")
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == {str(p): "closed" for p in setup.sockets.values()}
    log = setup.service.log_text()
    assert log.count(f"refused a connection from uid {THIRD_UID}") == 2
    for name in QUOTAS:
        assert f"on federation {name!r}'s socket: not among its peers" in log


def test_the_owner_reads_the_ledger_verify_requests_and_report(setup: Setup) -> None:
    from simulations.cli import main as cli_main

    assert cli_main(["ledger", "verify", str(setup.ledger)]) == 0
    out = setup.root / "report"
    assert cli_main(["ledger", "report", str(setup.ledger), "--out", str(out)]) == 0
    assert any(out.glob("*.html")) and any(p.stat().st_size > 0 for p in out.glob("*.png"))
    listed = subprocess.run(
        [sys.executable, "-m", "simulations.cli", "ledger", "requests", str(setup.ledger), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(listed.stdout)
    assert {row["federation"] for row in rows} >= {"alpha", "beta"}
    audit = (setup.ledger.parent / "ledger.sqlite.audit.jsonl").read_text().splitlines()
    assert any('"outcome": "refused: policy"' in line for line in audit)
    assert any('"workload": "regression"' in line for line in audit)
