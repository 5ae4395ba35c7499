"""Client units through the agent's real release path (Agent.handle): a stopped client's data reaches none of
the owner's code, an id outside an embedding table makes the client's row the null element instead of an
uncharged refusal, and frozen parameters are released as exact zeros, noise included (privacy.md §2).

A hostile review (2026-11-26) drained a client, then binary-searched the table size ``vocab`` of a
coordinator-chosen embedding: sizes at or below the client's largest token id were refused (uncharged, after
the client had stopped), so the coordinator learned that id for free. These tests fail on that code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client_agent.agent import Agent
from client_agent.config import parse_agent_config
from protocol import messages as wire
from tests import isolation_workloads as probe
from tests.factories import gradient_request, indicator_request
from workloads.models import flatten_parameters, trainable_mask
from workloads.registry import layout_fingerprint

SECRET = 41  # one record holds token id 41; every other id is below 30
LOCAL = {"local_steps": 2, "local_lr": 0.1, "local_batch_size": 64}  # every record, every step


def _agent(tmp_path: Path, workload: str = "CLIENT_PROBE") -> Agent:
    rng = np.random.default_rng(0)
    x = rng.integers(1, 30, size=(50, 8))
    x[17, 3] = SECRET
    np.savez(tmp_path / "d.npz", x=x, y=rng.integers(0, 2, 50))
    lines = [
        'data-path = "d.npz"',
        'ledger-path = "ledger.sqlite"',
        "epsilon = 1.0",
        "delta = 1e-5",
        'unit = "client"',
        'trust = "local"',
        "policy-min-noise-std = 0.5",
        "policy-max-clip = 100.0",
        "policy-max-request-share = 1.0",
        f'workload = "tests.isolation_workloads:{workload}"',
    ]
    (tmp_path / "agent.toml").write_text("\n".join(lines) + "\n")
    return Agent(parse_agent_config({"agent-config": str(tmp_path / "agent.toml")}))


class _Asker:
    def __init__(self, agent: Agent) -> None:
        self.agent, self.n = agent, 0

    def gradient(self, *, vocab: int = 64, clip: float = 1.0, frozen: bool = False, local: bool = False) -> Any:
        self.n += 1
        args = {"vocab": vocab, "frozen": frozen}
        model = probe.CLIENT_PROBE.build_model("bag", **args)
        request = gradient_request(
            f"g{self.n}",
            round=self.n,
            noise_std=0.5,
            l2_clip=clip,
            unit="client",
            model="bag",
            model_args=json.dumps(args),
            parameters=flatten_parameters(model),
            layout=layout_fingerprint(model),
            **(LOCAL if local else {}),
        )
        return self.agent.handle(wire.GRADIENT, *wire.encode_request(request)), trainable_mask(model)

    def query(self) -> Any:
        self.n += 1
        request = indicator_request(f"q{self.n}", round=self.n, noise_std=0.5, unit="client", predicate="large")
        return self.agent.handle(wire.INDICATOR, *wire.encode_request(request))


def _spent(agent: Agent) -> tuple[float, bool]:
    state = agent.ledger.state()
    return float(state["spent"][0]), bool(state["stopped"][0])


def test_a_stopped_clients_records_reach_none_of_the_owners_code(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    ask = _Asker(agent)
    for _ in range(3):  # clip 100 at sigma 0.5: far over the budget; partial clipping spends the rest
        outcome, _ = ask.gradient(clip=100.0)
        assert not outcome.is_error, outcome.local_detail
    spent, stopped = _spent(agent)
    assert stopped
    probe.SEEN.clear()
    for outcome in (ask.gradient()[0], ask.gradient(local=True)[0], ask.query()):
        assert not outcome.is_error, outcome.local_detail
    assert probe.SEEN and max(probe.SEEN) == 0.0  # the model, local training and the query saw only zeros
    assert _spent(agent) == (spent, True)
    agent.close()


@pytest.mark.parametrize("workload", ["CLIENT_PROBE", "CLIENT_PROBE_VALID"])  # the second: a rule running the model
@pytest.mark.parametrize("local", [False, True], ids=["gradient", "local-training"])
def test_an_id_outside_a_coordinator_sized_table_nulls_the_clients_row_instead_of_refusing(
    tmp_path: Path, local: bool, workload: str
) -> None:
    agent = _agent(tmp_path, workload)
    ask = _Asker(agent)
    for vocab in (SECRET, 32, 8):  # every size at or below the largest id: answered, the row null, nothing paid
        outcome, _ = ask.gradient(vocab=vocab, local=local)
        assert not outcome.is_error and outcome.error_code == 0, outcome.local_detail
        assert _spent(agent) == (0.0, False)
    outcome, _ = ask.gradient(vocab=SECRET + 1, local=local)  # a table that holds every id: a real row, paid
    assert not outcome.is_error, outcome.local_detail
    assert _spent(agent)[0] > 0.0
    agent.close()


@pytest.mark.parametrize("local", [False, True], ids=["gradient", "local-training"])
def test_frozen_parameters_are_released_as_exact_zeros_noise_included(tmp_path: Path, local: bool) -> None:
    agent = _agent(tmp_path)
    outcome, trainable = _Asker(agent).gradient(frozen=True, local=local)
    assert not outcome.is_error, outcome.local_detail
    released = np.asarray(outcome.arrays["total"])
    assert (~trainable).sum() == 64 * 4 and released.shape == trainable.shape
    assert np.all(released[~trainable] == 0.0)  # the table: not released
    assert np.count_nonzero(released[trainable]) == trainable.sum()  # the head: contribution plus noise
    agent.close()


def test_client_units_read_integer_features_as_int64(tmp_path: Path) -> None:
    """As the record engine reads them: float32 would round ids above 2^24 to other ids."""
    agent = _agent(tmp_path)
    ask = _Asker(agent)
    probe.DTYPES.clear()
    for local in (False, True):
        outcome, _ = ask.gradient(local=local)
        assert not outcome.is_error, outcome.local_detail
    assert probe.DTYPES and set(probe.DTYPES) == {torch.int64}
    agent.close()
