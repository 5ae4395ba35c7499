"""Crash safety: the agent, in a subprocess, is killed with SIGKILL at each step of answering.

Steps (client_agent.agent): ``after_compute`` (contributions computed, nothing charged,
nothing sent), ``after_commit`` (charge, new state and exact reply bytes committed in
one transaction: "after charging" and "after storing the reply" are the same durable
point), ``before_send`` (about to hand the reply to Flower). On restart, the same
request is sent again. Invariants (privacy.md §9):
- every reply that could have left was charged (it is in the ledger with its charge);
- no spend went down;
- the repeated request returns the identical stored reply, with no second charge.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from client_agent.agent import unpack_reply
from client_agent.ledger import Ledger
from protocol import messages as wire
from tests import factories
from tests.factories import spent

CHILD = r"""
import json, pickle, sys
from client_agent.direct import answer_request
node_config, message_type, config, arrays = pickle.loads(sys.stdin.buffer.read())
outcome = answer_request(node_config, message_type, config, arrays)
sys.stdout.buffer.write(pickle.dumps((outcome.error_code, outcome.error_reason, outcome.config, outcome.arrays)))
"""


def setup(tmp_path: Path) -> tuple[dict[str, object], tuple[str, dict[str, object], dict[str, np.ndarray]]]:
    # The deployed ClientApp's path (no simulation switch): a deployed agent states its noise floor and clip.
    policy = {"policy-min-noise-std": 0.5, "policy-max-clip": 5.0}
    node_config = factories.node_config(tmp_path, factories.client_data(20), epsilon=3.0, **policy)
    config, arrays = wire.encode_request(factories.gradient_request("run:r1:n1", noise_std=5.0))
    return node_config, (wire.GRADIENT, config, arrays)


def run_child(payload: object, fault: str | None) -> subprocess.CompletedProcess[bytes]:
    env = {"FEDFILTER_FAULT": fault} if fault else {}
    import os

    return subprocess.run(
        [sys.executable, "-c", CHILD],
        input=pickle.dumps(payload),
        capture_output=True,
        timeout=120,
        env={**os.environ, **env},
        check=False,
    )


# before_send leaves the ledger as after_commit does (the commit is done; only the agent's close lies
# between): it runs on request (`pytest -m slow`), keeping the default run under its time budget.
@pytest.mark.parametrize("step", ["after_compute", "after_commit", pytest.param("before_send", marks=pytest.mark.slow)])
def test_sigkill_at_each_step(tmp_path: Path, step: str) -> None:
    node_config, (mtype, config, arrays) = setup(tmp_path)
    ledger_path = Path(str(node_config["ledger-path"]))
    payload = (node_config, mtype, config, arrays)

    crashed = run_child(payload, step)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr.decode()[-2000:]
    assert crashed.stdout == b""  # nothing was sent

    with Ledger.open_existing(ledger_path) as ledger:
        stored = ledger.lookup(config["request_id"])  # type: ignore[arg-type]
        before = ledger.state()["spent"]
    if step == "after_compute":
        assert stored is None  # nothing charged, and nothing could have left
        assert np.all(before == 0)
    else:
        assert stored is not None  # the reply that could have left is charged
        assert np.all(before > 0)

    again = run_child(payload, None)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    code, reason, reply_config, reply_arrays = pickle.loads(again.stdout)
    assert code == 0, reason
    after = spent(ledger_path)
    assert np.all(after >= before)  # no spend went down
    with Ledger.open_existing(ledger_path) as ledger:
        stored = ledger.lookup(config["request_id"])  # type: ignore[arg-type]
        assert stored is not None
        assert ledger.requests_answered() == 1
    stored_config, stored_arrays = unpack_reply(stored.reply)
    assert reply_config == stored_config
    np.testing.assert_array_equal(reply_arrays["total"], stored_arrays["total"])
    if step != "after_compute":
        np.testing.assert_array_equal(after, before)  # the replay charged nothing more

    third = run_child(payload, None)  # and once more: byte-identical, no new charge
    assert pickle.loads(third.stdout)[3]["total"].tobytes() == reply_arrays["total"].tobytes()
    np.testing.assert_array_equal(spent(ledger_path), after)
