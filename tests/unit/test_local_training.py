"""Local training for client units (DP-FedAvg): the wire fields, the SGD loop, the agent's release and charge.

Sources: McMahan et al. 2018 (DP-FedAvg, Alg. 1 ``UserUpdate``) for the update; privacy.md §2 (one
Gaussian release per client per round, cost ||clipped Delta||^2 / sigma^2), §4 (partial clipping to
the remainder, averaging by the public n) and §8 (a stopped client does the same work).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import client_agent.workloads as workloads
from client_agent.agent import Agent
from client_agent.config import AgentConfigError, Policy
from client_agent.local_training import local_update
from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from coordinator.rounds import run
from coordinator.transport import Payload, RoundReplies
from protocol import messages as wire
from tests.factories import N_PARAMS, build_agent, client_data, gradient_request, gradient_run, status
from workloads.models import build_model, flatten_parameters, load_flat_parameters

LOCAL = {"local_steps": 3, "local_lr": 0.5, "local_batch_size": 4}
# What every agent here is: one client unit in central trust, with a policy and seeded noise.
CLIENT = {
    "unit": "client",
    "trust": "central",
    "policy-min-noise-std": 1.0,
    "policy-max-model-params": 100,
    "noise-seed": 3,
}


def make_agent(tmp_path: Path, data: tuple[np.ndarray, np.ndarray] | None = None, **overrides: Any) -> Agent:
    return build_agent(tmp_path, data, **(CLIENT | overrides))


def start_params(seed: int = 1) -> np.ndarray:
    return flatten_parameters(build_model("logreg", seed=seed, in_features=3, n_classes=2)).astype(np.float32)


def request(request_id: str = "r1", **fields: Any) -> wire.GradientRequest:
    base: dict[str, Any] = dict(trust="central", unit="client", parameters=start_params(), **LOCAL)
    return gradient_request(request_id, **(base | fields))


# --- wire -------------------------------------------------------------------------------------


def test_wire_round_trip_and_old_messages_unchanged() -> None:
    config, arrays = wire.encode_request(request())
    assert {k: config[k] for k in LOCAL} == LOCAL
    decoded = wire.decode_request(wire.GRADIENT, config, arrays)
    assert isinstance(decoded, wire.GradientRequest)
    assert (decoded.local_steps, decoded.local_lr, decoded.local_batch_size) == (3, 0.5, 4)
    assert wire.encode_request(decoded)[0] == config
    plain = request(local_steps=0, local_lr=None, local_batch_size=None)
    config, arrays = wire.encode_request(plain)
    assert not set(LOCAL) & set(config)  # a gradient request has the same wire form as before
    decoded = wire.decode_request(wire.GRADIENT, config, arrays)
    assert isinstance(decoded, wire.GradientRequest) and decoded.local_steps == 0 and decoded.local_lr is None


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"unit": "record"}, r"per-record units cannot train locally"),
        ({"local_lr": 0.0}, r"'local_lr' must be a finite number > 0, got 0.0"),
        ({"local_lr": -0.1}, r"'local_lr' must be a finite number > 0, got -0.1"),
        ({"local_lr": float("nan")}, r"'local_lr' must be a finite number > 0, got nan"),
        ({"local_lr": float("inf")}, r"'local_lr' must be a finite number > 0, got inf"),
        ({"local_lr": "0.1"}, r"'local_lr' must be a number, got '0.1'"),
        ({"local_lr": 10**400}, r"'local_lr': expected a finite number, got an integer of 1329 bits"),
        ({"local_steps": wire.MAX_WIRE_INT + 1}, r"'local_steps': expected an integer in \[1, 9007199254740992\]"),
        ({"local_steps": 0}, r"'local_steps': expected .*got 0$"),  # 0 is written by leaving the keys out
        ({"local_steps": True}, r"'local_steps': expected an integer in \[1, .*got True \(bool\)"),
        ({"local_steps": 2.0}, r"'local_steps': expected an integer in \[1, .*got 2.0 \(float\)"),
        ({"local_batch_size": 0}, r"'local_batch_size': expected an integer in \[1, .*got 0$"),
        ({"local_batch_size": wire.MAX_WIRE_INT + 1}, r"'local_batch_size': expected an integer in \[1, "),
        ({"local_lr": None}, r"missing key 'local_lr'"),
        ({"local_batch_size": None}, r"missing key 'local_batch_size'"),
        ({"local_steps": None}, r"given without 'local_steps'"),
    ],
)
def test_wire_refuses_bad_local_training_fields(over: dict[str, Any], message: str) -> None:
    config, arrays = wire.encode_request(request())
    config = {k: v for k, v in (config | over).items() if v is not None}
    with pytest.raises(wire.ProtocolError, match=message):
        wire.decode_request(wire.GRADIENT, config, arrays)


def test_agent_refusals_spend_nothing(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, **{"policy-max-local-steps": 5})
    assert json.loads(agent.status_json())["policy"]["max_local_steps"] == 5
    before = agent.ledger.requests_answered(), agent.ledger.state()["spent"].tobytes()
    cases = [
        (request("a", local_steps=6), wire.ERR_POLICY, "local_steps 6 asked; the policy allows at most 5"),
        (request("b", local_lr=-1.0), wire.ERR_MALFORMED, "'local_lr' must be a finite number > 0"),
        (request("c", unit="record"), wire.ERR_MALFORMED, "per-record units cannot train locally"),
    ]
    for req, code, detail in cases:
        outcome = agent.handle(wire.GRADIENT, *wire.encode_request(req))
        assert outcome.error_code == code and detail in outcome.local_detail
        assert outcome.error_reason == wire.ERROR_TEXT[code]
    assert (agent.ledger.requests_answered(), agent.ledger.state()["spent"].tobytes()) == before
    agent.close()


def test_policy_key_is_parsed_and_checked(tmp_path: Path) -> None:
    assert Policy().max_local_steps == 100
    with pytest.raises(AgentConfigError, match=r"policy-max-local-steps: expected an integer >= 0"):
        make_agent(tmp_path, **{"policy-max-local-steps": -1})
    agent = make_agent(tmp_path, **{"policy-max-local-steps": 0})  # 0: no local training at all
    outcome = agent.handle(wire.GRADIENT, *wire.encode_request(request(local_steps=1)))
    assert outcome.error_code == wire.ERR_POLICY
    agent.close()


# --- the SGD loop -----------------------------------------------------------------------------


def reference_logreg_sgd(
    w: np.ndarray,
    b: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    usable: np.ndarray,
    *,
    steps: int,
    lr: float,
    batch: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Minibatch SGD on softmax cross-entropy, by hand in float64 (null records: weight 0)."""
    w, b = w.astype(np.float64), b.astype(np.float64)
    x = np.where(usable[:, None], x, 0.0)
    y = np.where(usable, y, 0)
    n = len(y)
    size = min(batch, n)
    for _ in range(steps):
        idx = rng.choice(n, size=size, replace=False)
        logits = x[idx] @ w.T + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(size), y[idx]] -= 1.0  # d loss_i / d logits_i
        p *= usable[idx, None] / size
        w, b = w - lr * p.T @ x[idx], b - lr * p.sum(axis=0)
    return w, b


def test_local_update_matches_a_hand_written_loop() -> None:
    x, y = client_data(12, seed=5)
    x[2, 1] = np.nan  # null records: a non-finite feature, a label outside the classes
    y[7] = 5
    usable = np.ones(12, dtype=bool)
    usable[[2, 7]] = False
    model = build_model("logreg", seed=4, in_features=3, n_classes=2)
    before = flatten_parameters(model)
    delta = local_update(
        model, workloads._cross_entropy, x, y, steps=7, lr=0.3, batch_size=5, rng=np.random.default_rng(9)
    )
    assert delta.dtype == np.float32 and delta.shape == (N_PARAMS,)
    np.testing.assert_array_equal(flatten_parameters(model), before)  # the model itself is untouched
    w0, b0 = before[:6].reshape(2, 3), before[6:]
    x64 = np.nan_to_num(x).astype(np.float64)
    w, b = reference_logreg_sgd(w0, b0, x64, y, usable, steps=7, lr=0.3, batch=5, rng=np.random.default_rng(9))
    np.testing.assert_allclose(delta, np.concatenate([(w - w0).ravel(), b - b0]), atol=1e-6, rtol=0)


def test_a_workload_rule_and_loss_give_the_same_update_as_the_default() -> None:
    from workloads.builtin import BUILTIN

    x, y = client_data(12, seed=5)
    x[2, 1], y[7] = np.inf, -1
    model = build_model("logreg", seed=4, in_features=3, n_classes=2)
    common: dict[str, Any] = {"steps": 4, "lr": 0.3, "batch_size": 5}
    default = local_update(model, workloads._cross_entropy, x, y, rng=np.random.default_rng(2), **common)
    rule = local_update(model, BUILTIN.loss, x, y, rng=np.random.default_rng(2), valid=BUILTIN.valid, **common)
    np.testing.assert_array_equal(default, rule)


def test_one_full_batch_step_is_minus_lr_times_the_client_gradient() -> None:
    x, y = client_data(10)
    y[3] = 9  # a null record counts in the mean as the zero contribution, in both paths
    params = start_params()
    gradient = workloads.gradient_rows(
        request(local_steps=0, local_lr=None, local_batch_size=None, parameters=params), x, y, unit="client"
    )
    model = build_model("logreg", in_features=3, n_classes=2)
    load_flat_parameters(model, params)
    for batch in (10, 1000):  # a batch larger than the client's data is all of it
        delta = local_update(
            model, workloads._cross_entropy, x, y, steps=1, lr=0.7, batch_size=batch, rng=np.random.default_rng(0)
        )
        np.testing.assert_allclose(delta, -0.7 * gradient[0], atol=1e-6, rtol=1e-5)


def test_zero_steps_is_the_zero_update_and_bad_arguments_are_refused() -> None:
    model = build_model("logreg", in_features=3, n_classes=2)
    x, y = client_data()
    rng = np.random.default_rng(0)
    assert not local_update(model, workloads._cross_entropy, x, y, steps=0, lr=0.1, batch_size=2, rng=rng).any()
    for kw, message in (
        ({"steps": -1}, "steps: expected an integer >= 0"),
        ({"lr": float("nan")}, "lr: expected a finite number > 0"),
        ({"batch_size": 0}, "batch_size: expected an integer >= 1"),
    ):
        args: dict[str, Any] = {"steps": 1, "lr": 0.1, "batch_size": 2, "rng": rng} | kw
        with pytest.raises(ValueError, match=message):
            local_update(model, workloads._cross_entropy, x, y, **args)


# --- the agent: release, charge, stopped clients ---------------------------------------------------


def expected_delta(agent: Agent, req: wire.GradientRequest, data: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The update the agent computes, from its own minibatch stream (a child of its noise source)."""
    model = build_model("logreg", in_features=3, n_classes=2)
    load_flat_parameters(model, req.parameters)
    assert req.local_lr is not None and req.local_batch_size is not None
    rng = agent.rng(req).spawn(1)[0]
    steps, lr, batch_size = req.local_steps, req.local_lr, req.local_batch_size
    return local_update(model, workloads._cross_entropy, *data, steps=steps, lr=lr, batch_size=batch_size, rng=rng)


@pytest.mark.parametrize("epsilon", [50.0, 0.05])  # room for the whole update; only a part of it
def test_release_is_the_update_clipped_to_the_remainder_and_charged_its_norm(tmp_path: Path, epsilon: float) -> None:
    data = client_data()
    agent = make_agent(tmp_path, data, epsilon=epsilon)
    threshold = agent.gaussian.threshold if agent.gaussian is not None else 0.0
    req = request(noise_std=1.0, l2_clip=100.0, local_lr=2.0)
    delta = expected_delta(agent, req, data)
    outcome = agent.handle(wire.GRADIENT, *wire.encode_request(req))
    assert not outcome.is_error, outcome.local_detail
    assert outcome.arrays is not None and outcome.config is not None
    reply = wire.ContributionReply.decode(outcome.config, outcome.arrays)
    released = reply.total.astype(np.float64)  # central trust: the exact clipped update, no noise
    room = np.sqrt(threshold) * req.noise_std
    norm = float(np.linalg.norm(delta.astype(np.float64)))
    np.testing.assert_allclose(released, delta * min(1.0, room / norm), rtol=1e-5, atol=1e-7)
    spent = float(agent.ledger.state()["spent"][0])
    # GDP filter accounting: S = sum_t mu_t^2 with mu_t = ||clipped Delta|| / sigma (privacy.md §2, §3).
    assert spent == pytest.approx(float(np.linalg.norm(released)) ** 2 / req.noise_std**2, rel=1e-5)
    if norm < room:
        assert spent < threshold and not agent.ledger.state()["stopped"][0]
    else:
        assert spent == pytest.approx(threshold, rel=1e-4)  # exactly the remainder (partial clipping)
    agent.close()


def test_a_stopped_client_runs_the_same_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    cross_entropy = torch.nn.functional.cross_entropy

    def counting(logits: torch.Tensor, targets: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append(len(targets))  # one call per loss evaluation, whichever workload's loss calls it
        return cross_entropy(logits, targets, **kw)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", counting)
    agent = make_agent(tmp_path, epsilon=0.05, trust="local")  # a tiny budget: the first round spends it all
    shapes = []
    for rnd in (1, 2):
        calls.clear()
        req = request(f"r{rnd}", round=rnd, trust="local", noise_std=1.0, l2_clip=100.0, local_lr=2.0)
        outcome = agent.handle(wire.GRADIENT, *wire.encode_request(req))
        assert not outcome.is_error, outcome.local_detail
        assert outcome.arrays is not None
        shapes.append((outcome.arrays["total"].shape, sorted(outcome.config or {})))
        assert calls == [LOCAL["local_batch_size"]] * LOCAL["local_steps"]
        assert bool(agent.ledger.state()["stopped"][0])  # stopped after round 1, still stopped in round 2
    assert shapes[0] == shapes[1]  # a noise-only reply of the same shape (privacy.md §8)
    agent.close()


# --- the coordinator -----------------------------------------------------------------------------------


def coordinator(**over: Any) -> CoordinatorConfig:
    local = dict(local_steps=4, local_lr=0.1, local_batch_size=8, server_lr=0.5)
    return gradient_run(**(dict(num_nodes=2, n_public=2, unit="client", noise_seed=11, **local) | over))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"unit": "record", "n_public": 20}, r"local training needs the gradient task and unit 'client'"),
        ({"task": "indicator"}, r"local training needs the gradient task and unit 'client'"),
        ({"local_lr": 0.0}, r"local_lr: expected a finite number > 0 with local_steps"),
        ({"local_lr": float("nan")}, r"local_lr: expected a finite number > 0"),
        ({"local_batch_size": 0}, r"local_batch_size: expected an integer >= 1 with local_steps"),
        ({"local_steps": -1}, r"local_steps: expected an integer >= 0"),
        ({"local_steps": wire.MAX_WIRE_INT + 1}, r"expected at most 9007199254740992"),
        ({"server_lr": 0.0}, r"server_lr: expected a finite number > 0"),
        ({"local_steps": 0}, r"local_lr, local_batch_size, server_lr: set only with local_steps >= 1"),
    ],
)
def test_bad_local_training_config(over: dict[str, Any], message: str) -> None:
    with pytest.raises(CoordinatorConfigError, match=message):
        coordinator(**over)


def test_run_config_keys() -> None:
    base = {"num-nodes": 2, "n-public": 2, "rounds": 1, "noise-std": 1.0, "l2-clip": 1.0, "unit": "client"}
    local = {"local-steps": 2, "local-lr": 0.05, "local-batch-size": 16, "server-lr": 1.0}
    cfg = CoordinatorConfig.from_run_config(base | local)
    assert (cfg.local_steps, cfg.local_lr, cfg.local_batch_size, cfg.server_lr) == (2, 0.05, 16, 1.0)


class Updates:
    """Status from two client-unit ledgers; every gradient request answered with ``update`` (central trust)."""

    def __init__(self, update: np.ndarray) -> None:
        self.update = update
        self.sent: list[tuple[dict[str, Any], dict[str, np.ndarray]]] = []

    def node_ids(self, count: int, *, timeout: float) -> list[int]:
        return [1, 2, 3][:count]

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        out = RoundReplies()
        for node, (config, arrays) in payloads.items():
            if message_type == wire.STATUS:
                description = status(trust="central", unit="client", n_units=1)
                out.replies[node] = wire.StatusReply(config["request_id"], description).encode()
                continue
            self.sent.append((dict(config), dict(arrays)))
            if node == 1:  # one client answers; the other does not: the divisor stays n = 2
                reply = wire.ContributionReply(config["request_id"], wire.REPLY_OK, "central", 0.0, self.update)
                out.replies[node] = reply.encode()
        return out


def test_coordinator_sends_local_fields_and_steps_by_server_lr_over_public_n() -> None:
    from coordinator.rounds import noise_rng

    update = np.linspace(-1, 1, N_PARAMS)  # a central-trust reply: float64 (wire.reply_dtype)
    transport = Updates(update)
    cfg = coordinator()
    summary = run(transport, cfg)
    config, _ = transport.sent[0]
    assert {k: config[k] for k in LOCAL} == {"local_steps": 4, "local_lr": 0.1, "local_batch_size": 8}
    params0 = flatten_parameters(build_model("logreg", seed=0, in_features=3, n_classes=2))
    noise = noise_rng(cfg).normal(0.0, cfg.noise_std, N_PARAMS)
    expected = (params0 + 0.5 * (update.astype(np.float64) + noise) / 2).astype(np.float32)
    np.testing.assert_allclose(summary["parameters"], expected, rtol=1e-6)
    assert "4 local SGD steps (DP-FedAvg)" in summary["privacy"]["statement"]
    assert "one Gaussian release" in summary["privacy"]["statement"]
