"""The client agent on hostile and bad requests, and what its replies reveal (privacy.md §8-9)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client_agent.agent import Agent
from client_agent.config import AgentConfigError, parse_agent_config
from client_agent.ledger import LedgerError
from client_agent.state import AgentState
from protocol import messages as wire
from tests.factories import MODEL_ARGS, N_PARAMS, build_agent, gradient_request, indicator_request

# What every agent here adds to the factory's node config: a policy, and seeded noise.
POLICY = {
    "policy-min-noise-std": 1.0,
    "policy-max-clip": 2.0,
    "policy-max-model-params": 100,
    "policy-max-rounds-per-run": 5,
    "noise-seed": 3,
}


def make_agent(tmp_path: Path, data: tuple[np.ndarray, np.ndarray] | None = None, **overrides: Any) -> Agent:
    return build_agent(tmp_path, data, **(POLICY | overrides))


def gradient(request_id: str = "r1", **fields: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    return wire.encode_request(gradient_request(request_id, **fields))


def ledger_snapshot(agent: Agent) -> tuple[int, bytes]:
    return agent.ledger.requests_answered(), agent.ledger.state()["spent"].tobytes()


HOSTILE = [
    (
        "noise under the policy",
        lambda c, a: (c | {"noise_std": 0.5}, a),
        wire.ERR_POLICY,
        r"noise_std 0.5 asked; the policy requires noise_std >= 1.0",
    ),
    (
        "clip over the policy",
        lambda c, a: (c | {"l2_clip": 3.0}, a),
        wire.ERR_POLICY,
        r"l2_clip 3.0 asked; the policy allows at most 2.0",
    ),
    (
        "NaN in the model",
        lambda c, a: (c, {"parameters": np.full(N_PARAMS, np.nan, np.float32)}),
        wire.ERR_MALFORMED,
        r"'parameters' contains NaN or infinite values",
    ),
    (
        "inf in the model",
        lambda c, a: (c, {"parameters": np.full(N_PARAMS, np.inf, np.float32)}),
        wire.ERR_MALFORMED,
        r"'parameters' contains NaN or infinite values",
    ),
    (
        "wrong shape",
        lambda c, a: (c, {"parameters": np.zeros(N_PARAMS + 1, np.float32)}),
        wire.ERR_MALFORMED,
        r"'parameters' must hold 8 values for model 'logreg', got 9",
    ),
    (
        "2-d parameters",
        lambda c, a: (c, {"parameters": np.zeros((2, 4), np.float32)}),
        wire.ERR_MALFORMED,
        r"must be 1-dimensional, got shape \(2, 4\)",
    ),
    (
        "oversized",
        lambda c, a: (c, {"parameters": np.zeros(1000, np.float32)}),
        wire.ERR_POLICY,
        r"model size 1000 parameters asked; the policy allows at most 100",
    ),
    (
        "wrong dtype",
        lambda c, a: (c, {"parameters": np.zeros(N_PARAMS)}),
        wire.ERR_MALFORMED,
        r"must have dtype float32, got float64",
    ),
    (
        "budget change",
        lambda c, a: (c | {"epsilon": 100.0}, a),
        wire.ERR_MALFORMED,
        r"unexpected key 'epsilon'.*budgets are fixed in the client's ledger and are never changed",
    ),
    ("reset", lambda c, a: (c | {"reset": True}, a), wire.ERR_MALFORMED, r"unexpected key 'reset'"),
    (
        "other trust",
        lambda c, a: (c | {"trust": "central"}, a),
        wire.ERR_POLICY,
        r"trust 'central' asked; this client's ledger is fixed to trust 'local'",
    ),
    (
        "unknown trust",
        lambda c, a: (c | {"trust": "none"}, a),
        wire.ERR_MALFORMED,
        r"'trust' must be one of \('local', 'central', 'secagg'\), got 'none'",
    ),
    ("unknown model", lambda c, a: (c | {"model": "os.system"}, a), wire.ERR_MALFORMED, r"model 'os.system'"),
    (
        "missing key",
        lambda c, a: ({k: v for k, v in c.items() if k != "noise_std"}, a),
        wire.ERR_MALFORMED,
        r"missing key 'noise_std'",
    ),
    ("string sigma", lambda c, a: (c | {"noise_std": "10"}, a), wire.ERR_MALFORMED, r"'noise_std' must be a number"),
    # JSON reads an integer of any length; float() of this one overflows (an internal error before)
    (
        "sigma past float",
        lambda c, a: (c | {"noise_std": 10**400}, a),
        wire.ERR_MALFORMED,
        r"'noise_std': expected a finite number, got an integer of 1329 bits",
    ),
    (
        "clip past float",
        lambda c, a: (c | {"l2_clip": -(10**400)}, a),
        wire.ERR_MALFORMED,
        r"'l2_clip': expected a finite number, got an integer of 1329 bits",
    ),
]


@pytest.mark.parametrize(("name", "mutate", "code", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_refused_and_ledger_unchanged(
    tmp_path: Path, name: str, mutate: Any, code: int, message: str
) -> None:
    agent = make_agent(tmp_path)
    before = ledger_snapshot(agent)
    config, arrays = mutate(*gradient())
    outcome = agent.handle(wire.GRADIENT, config, arrays)
    assert outcome.error_code == code
    assert __import__("re").search(message, outcome.local_detail), outcome.local_detail
    assert outcome.error_reason == wire.ERROR_TEXT[code]  # the wire carries the code's fixed text only
    assert ledger_snapshot(agent) == before


def test_unknown_kind_refused(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    outcome = agent.handle("train.evil", *gradient())
    assert outcome.error_code == wire.ERR_MALFORMED
    assert "message type: expected one of" in outcome.local_detail


def test_id_reused_with_other_content_is_refused(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    first = agent.handle(wire.GRADIENT, *gradient())
    assert not first.is_error
    before = ledger_snapshot(agent)
    again = agent.handle(wire.GRADIENT, *gradient(noise_std=4.0))
    assert again.error_code == wire.ERR_REPLAY
    assert "was answered before with other content" in again.local_detail
    assert ledger_snapshot(agent) == before
    same = agent.handle(wire.GRADIENT, *gradient())
    assert same.arrays is not None and first.arrays is not None
    assert same.arrays["total"].tobytes() == first.arrays["total"].tobytes()
    assert ledger_snapshot(agent) == before


def test_rounds_per_run_limit(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    for i in range(5):
        assert not agent.handle(wire.GRADIENT, *gradient(f"r{i}", round=i + 1)).is_error
    refused = agent.handle(wire.GRADIENT, *gradient("r5", round=6))
    assert refused.error_code == wire.ERR_POLICY
    assert "the policy allows at most 5 requests per run" in refused.local_detail


def test_exhausted_local_reply_has_same_shape(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    active = agent.handle(wire.GRADIENT, *gradient("a", parameters=np.ones(N_PARAMS, np.float32)))
    for i in range(30):  # spend everything
        agent.handle(wire.GRADIENT, *gradient(f"b{i}", round=2, run_id=f"spend{i}"))
    assert agent.ledger.state()["stopped"].all()
    spent = agent.ledger.state()["spent"].copy()
    exhausted = agent.handle(wire.GRADIENT, *gradient("c", run_id="late"))
    assert active.config is not None and exhausted.config is not None
    assert active.arrays is not None and exhausted.arrays is not None
    assert set(active.config) == set(exhausted.config)
    assert exhausted.config["status"] == wire.REPLY_OK
    assert set(active.arrays) == set(exhausted.arrays)
    for key in active.arrays:
        assert active.arrays[key].shape == exhausted.arrays[key].shape
        assert active.arrays[key].dtype == exhausted.arrays[key].dtype
    assert np.any(exhausted.arrays["total"] != 0)  # noise only, not an all-zero tell-tale
    np.testing.assert_array_equal(agent.ledger.state()["spent"], spent)  # and nothing charged


def test_mismatched_ledger_refuses_to_answer(tmp_path: Path) -> None:
    make_agent(tmp_path).close()
    with pytest.raises(LedgerError, match="epsilon"):
        make_agent(tmp_path, epsilon=5.0)


def test_corrupt_ledger_is_never_reset(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    agent.handle(wire.GRADIENT, *gradient())
    agent.close()
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(LedgerError, match="corrupt"):
        make_agent(tmp_path)
    assert len(path.read_bytes()) == 1000


def test_bad_agent_config() -> None:
    with pytest.raises(AgentConfigError, match=r"unknown keys \['budget'\]"):
        parse_agent_config({"ledger-path": "x", "data-path": "y", "epsilon": 1.0, "delta": 1e-5, "budget": 3})
    with pytest.raises(AgentConfigError, match="epsilon: expected a finite number > 0"):
        parse_agent_config({"ledger-path": "x", "data-path": "y", "epsilon": -1.0, "delta": 1e-5})
    base = {"ledger-path": "/tmp/l.sqlite", "data-path": "y", "epsilon": 1.0, "delta": 1e-5}
    refused = [
        # A relative ledger path in a flat node config would open a fresh ledger wherever the ClientApp runs.
        ({"ledger-path": "client.sqlite"}, "ledger-path: expected an absolute path"),
        # NaN limits compare False with everything: they would switch the policy off.
        ({"policy-min-noise-std": float("nan")}, "policy-min-noise-std: expected a finite number >= 0, got nan"),
        ({"policy-max-clip": float("nan")}, "policy-max-clip: expected a number > 0"),
        ({"policy-max-rounds-per-run": 0}, "policy-max-rounds-per-run: expected an integer >= 1, got 0"),
        ({"policy-allowed-kinds": 5}, "'policy-allowed-kinds' must be a comma-separated string or a list, got 5"),
        ({"noise-seed": -1}, "noise-seed: expected an integer >= 0, got -1"),
    ]
    for override, message in refused:
        with pytest.raises(AgentConfigError, match=re.escape(message)):
            parse_agent_config(base | override, simulation=True)


# JSON reads integers of any length: the last strategy draws ones past float's range (about 1.8e308)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10**12),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.integers(2**1024, 10**400) | st.integers(-(10**400), -(2**1024)),
)
keys = st.sampled_from(
    [
        "request_id",
        "run_id",
        "round",
        "noise_std",
        "l2_clip",
        "trust",
        "unit",
        "model",
        "model_args",
        "predicate",
        "column",
        "value",
        "epsilon",
    ]
) | st.text(max_size=8)
arrays = st.dictionaries(
    st.sampled_from(["parameters", "x"]),
    st.sampled_from(
        [np.zeros(3, np.float32), np.full(2, np.nan, np.float32), np.zeros((2, 2), np.float32), np.zeros(3)]
    ),
    max_size=2,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mtype=st.sampled_from([*wire.MESSAGE_TYPES, "train", "query.x", ""]),
    config=st.dictionaries(keys, scalars, max_size=12),
    arrs=arrays,
)
def test_decoder_fuzz(mtype: str, config: dict[str, Any], arrs: dict[str, np.ndarray]) -> None:
    """Any input either decodes to a valid request or raises ProtocolError (never anything else)."""
    try:
        request = wire.decode_request(mtype, config, arrs)
    except wire.ProtocolError as exc:
        assert str(exc)
        return
    again = wire.decode_request(wire.message_type_of(request), *wire.encode_request(request))
    assert wire.encode_request(again)[0] == wire.encode_request(request)[0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mtype=st.sampled_from([wire.GRADIENT, wire.INDICATOR]), key=keys, value=scalars)
def test_decoder_fuzz_one_field_of_a_valid_request(mtype: str, key: str, value: Any) -> None:
    """A valid request with one field set to anything decodes or raises ProtocolError (never anything else)."""
    if mtype == wire.GRADIENT:
        config, arrs = gradient()
    else:
        config, arrs = indicator("i1", predicate="threshold", value=0.0)
    try:
        request = wire.decode_request(mtype, config | {key: value}, arrs)
    except wire.ProtocolError as exc:
        assert str(exc)
        return
    again = wire.decode_request(wire.message_type_of(request), *wire.encode_request(request))
    assert wire.encode_request(again)[0] == wire.encode_request(request)[0]


def test_ledger_show_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from simulations.cli import main

    agent = make_agent(tmp_path)
    for i in range(4):
        agent.handle(wire.GRADIENT, *gradient(f"r{i}", round=i + 1, parameters=np.full(N_PARAMS, 0.1 * i, np.float32)))
    agent.close()
    path = str(tmp_path / "ledger.sqlite")
    assert main(["ledger", "show", path, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    required = {
        "filter",
        "unit",
        "trust",
        "epsilon",
        "delta",
        "units_total",
        "units_active",
        "units_exhausted",
        "spent_max",
        "spent_mean",
        "threshold",
        "requests_answered",
    }
    assert required <= set(shown)
    assert shown["units_total"] == 10 and shown["requests_answered"] == 4
    assert shown["units_active"] + shown["units_exhausted"] == 10
    assert 0 < shown["spent_max"] <= shown["threshold"]
    assert main(["ledger", "verify", path]) == 0
    assert "ok" in capsys.readouterr().out


def test_ledger_verify_detects_tampered_spend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from client_agent.ledger_report import verify_ledger

    agent = make_agent(tmp_path)
    agent.handle(wire.GRADIENT, *gradient())
    # Commit a state whose spend went down (as a buggy writer would), through the ledger's own API.
    state = agent.ledger.state()
    lowered = dict(state, spent=state["spent"] * 0.5)
    agent.ledger.commit(
        request_id="forged",
        message_type=wire.STATUS,
        run_id="x",
        digest="0" * 64,
        release={"kind": np.array("status")},
        new_state=lowered,
        reply=b"",
    )
    agent.close()
    problems = verify_ledger(tmp_path / "ledger.sqlite")
    assert problems and "stored spend" in problems[0]


def indicator(request_id: str, **fields: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    return wire.encode_request(indicator_request(request_id, **({"run_id": "q", "noise_std": 2.0} | fields)))


def test_indicator_query_charges_only_positive_units(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    x = np.load(tmp_path / "data.npz")["x"]
    outcome = agent.handle(wire.INDICATOR, *indicator("i1", predicate="threshold", value=0.0, noise_std=4.0))
    assert not outcome.is_error and outcome.arrays is not None
    assert outcome.arrays["total"].shape == (1,)
    spent = agent.ledger.state()["spent"]
    positive = x[:, 0] > 0
    np.testing.assert_allclose(spent[positive], 1 / 16)  # mu^2 = (C / sigma)^2 = (1/4)^2
    np.testing.assert_array_equal(spent[~positive], 0.0)  # a zero contribution costs nothing


def test_indicator_value_past_float_range_is_malformed(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    before = ledger_snapshot(agent)
    config, arrays = indicator("i1", predicate="threshold", value=0.0)
    outcome = agent.handle(wire.INDICATOR, config | {"value": 10**400}, arrays)  # JSON reads any integer
    assert outcome.error_code == wire.ERR_MALFORMED, outcome.local_detail
    assert "'value': expected a finite number, got an integer of 1329 bits" in outcome.local_detail
    assert outcome.error_reason == wire.ERROR_TEXT[wire.ERR_MALFORMED]
    assert ledger_snapshot(agent) == before


def test_client_units_one_filter(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, unit="client")
    outcome = agent.handle(
        wire.INDICATOR, *indicator("i1", unit="client", predicate="threshold", value=0.0, noise_std=4.0)
    )
    assert not outcome.is_error
    state = agent.ledger.state()
    assert state["spent"].shape == (1,)
    # The count (about 5) is clipped to C = 1, 64 float32 ulps under the bound.
    assert state["spent"][0] == pytest.approx(1 / 16, rel=1e-4)
    assert state["spent"][0] <= 1 / 16


def test_client_accuracy_is_the_fraction_of_its_records_and_costs_its_square(tmp_path: Path) -> None:
    # Private model selection for client units (issue 24): reduce 'mean' makes a client's row the
    # fraction of its records the model classifies correctly, a value in [0, 1] whatever the client's
    # size, charged (fraction / sigma)^2 like any release; 'sum' (the wire default) is the count.
    agent = make_agent(tmp_path, unit="client", trust="central")
    data = np.load(tmp_path / "data.npz")
    params = np.zeros(N_PARAMS, np.float32)
    params[0] = -1.0  # predicts class 1 exactly when x0 > 0
    logits = np.stack([-data["x"][:, 0], np.zeros(len(data["x"]))], axis=1)
    fraction = float(np.mean(logits.argmax(axis=1) == data["y"]))
    assert 0.0 < fraction <= 1.0
    model = {"predicate": "correct", "model": "logreg", "model_args": MODEL_ARGS, "parameters": params}
    mean = indicator_request("acc", run_id="q", unit="client", trust="central", noise_std=4.0, reduce="mean", **model)
    config, arrays = wire.encode_request(mean)
    assert config["reduce"] == "mean" and wire.decode_request(wire.INDICATOR, config, arrays).reduce == "mean"
    outcome = agent.handle(wire.INDICATOR, config, arrays)
    assert not outcome.is_error and outcome.arrays is not None
    assert outcome.arrays["total"][0] == pytest.approx(fraction, rel=1e-6)  # central trust: no client noise
    spent = agent.ledger.state()["spent"]
    assert spent[0] == pytest.approx((fraction * (1 + 1e-6) / 4.0) ** 2, rel=1e-5)
    # 'sum' is left off the wire (one encoding per request); any other value is malformed.
    assert "reduce" not in wire.encode_request(replace(mean, reduce="sum"))[0]
    for bad in ("sum", "max", ""):
        with pytest.raises(wire.ProtocolError, match="'reduce'"):
            wire.decode_request(wire.INDICATOR, config | {"reduce": bad}, arrays)


REALISATION = {"realisation-max-rounds": 6, "epsilon": 5.0, "policy-max-clip": 1.0, "policy-min-noise-std": 2.0}


def test_realisation_filter_refuses_record_units(tmp_path: Path) -> None:
    # privacy.md §6: records share their client's noise, so one record's data would move the
    # others' realised losses and stopping times (issue 12, finding 1). Only client units.
    with pytest.raises(AgentConfigError, match="'realisation' needs unit 'client'"):
        make_agent(tmp_path, filter="realisation", unit="record", **REALISATION)
    assert not (tmp_path / "ledger.sqlite").exists()  # refused before any ledger is created


def test_realisation_filter_has_no_share_cap_and_refuses_one(tmp_path: Path) -> None:
    # Its request is capped by mu_max (the policy's clip and noise floor), not by a share of an additive budget:
    # the status reply says there is no share cap, and an owner who asks for one is told so, not ignored.
    agent = make_agent(tmp_path, filter="realisation", unit="client", **REALISATION)
    status = json.loads(agent.status_json())
    assert status["policy"]["max_request_share"] == 1.0
    with pytest.raises(AgentConfigError, match=r"realisation filter caps a request by mu_max .* got 0.25"):
        make_agent(tmp_path, filter="realisation", unit="client", **REALISATION, **{"policy-max-request-share": 0.25})


def test_realisation_filter_through_the_agent(tmp_path: Path) -> None:
    # mu_max = policy-max-clip / policy-min-noise-std = 0.5; one client unit, its count clipped to 1.
    agent = make_agent(tmp_path, filter="realisation", unit="client", **REALISATION)
    for r in range(1, 9):
        request = indicator(f"i{r}", round=r, run_id=f"q{r}", predicate="threshold", unit="client")
        outcome = agent.handle(wire.INDICATOR, *request)
        assert not outcome.is_error, outcome.error_reason
    state = agent.ledger.state()
    assert int(state["answered"][0]) == 8
    assert not state["accepting"].any()  # N = 6 requests at most
    taken = sum(rel["participating"].astype(int) for _, _, rel in agent.ledger.releases())
    assert taken.max() <= 6  # no unit took part in more than N requests (TVC Alg. 1)
    released = [rel["participating"].sum() for _, _, rel in agent.ledger.releases()]
    assert max(released) > 0 and released[-1] == 0
    with_losses = sum(rel["losses"] for _, _, rel in agent.ledger.releases())
    np.testing.assert_allclose(with_losses, state["loss"])


def test_monitor_tree_reserved_and_reported_once(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = make_agent(tmp_path / "a", epsilon=3.0)
    with_monitor = make_agent(
        tmp_path / "b",
        monitor="tree",
        epsilon=3.0,
        **{"monitor-noise-std": 4.0, "monitor-max-rounds": 16},
    )
    assert plain.gaussian is not None and with_monitor.gaussian is not None
    # S_m = L / sigma_m^2 with L = ceil(log2 16) + 1 = 5 (privacy.md §7), reserved at enrolment.
    assert with_monitor.gaussian.reserved == pytest.approx(5 / 16)
    assert with_monitor.gaussian.threshold == pytest.approx(plain.gaussian.threshold - 5 / 16)
    request = wire.encode_request(wire.MonitorRequest(request_id="m1", run_id="run", round=1, trust="local"))
    first = with_monitor.handle(wire.MONITOR, *request)
    assert not first.is_error and first.arrays is not None and first.arrays["total"].shape == (5,)
    again = wire.encode_request(wire.MonitorRequest(request_id="m1b", run_id="run", round=1, trust="local"))
    refused = with_monitor.handle(wire.MONITOR, *again)
    assert refused.error_code == wire.ERR_POLICY and "already reported" in refused.local_detail
    assert plain.handle(wire.MONITOR, *request).error_code == wire.ERR_POLICY  # no reservation, no monitor


def test_status_reveals_no_spend_and_no_data_fingerprint(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    agent.handle(wire.GRADIENT, *gradient())
    status = agent.handle(wire.STATUS, {"request_id": "s", "run_id": "run", "round": 0}, {})
    assert status.config is not None
    text = status.config["description"]
    fingerprint = agent.ledger_config.params["data_sha256"]
    assert isinstance(fingerprint, str) and fingerprint not in text
    assert "spent" not in text and "data_sha256" not in text
    described = json.loads(text)
    assert described["ledger"]["epsilon"] == 1.0 and described["policy"]["min_noise_std"] == 1.0


def test_unexpected_failure_is_a_typed_error_and_spends_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = make_agent(tmp_path)
    before = ledger_snapshot(agent)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("simulated failure in the gradient computation")

    monkeypatch.setattr(agent, "contributions", broken)
    outcome = agent.handle(wire.GRADIENT, *gradient())
    assert outcome.error_code == wire.ERR_INTERNAL
    # Fixed text: an exception's message may depend on the client's data and the error goes back uncharged.
    assert outcome.error_reason == wire.ERROR_TEXT[wire.ERR_INTERNAL]
    assert "simulated failure" in outcome.local_detail
    assert ledger_snapshot(agent) == before


def test_overflowing_records_contribute_zero_instead_of_an_uncharged_error(tmp_path: Path) -> None:
    # Finite but extreme parameters make a record with a large feature overflow to inf/NaN.
    # Erroring would tell the coordinator, for free, that such a record exists; instead the
    # record contributes the null element's zero and pays nothing, and the reply goes out as usual.
    agent = make_agent(tmp_path)
    params = np.zeros(N_PARAMS, np.float32)
    params[0] = 3e38  # weight of feature 0 for class 0
    outcome = agent.handle(wire.GRADIENT, *gradient("big", parameters=params))
    assert not outcome.is_error and outcome.arrays is not None
    assert np.all(np.isfinite(outcome.arrays["total"]))
    x = np.load(tmp_path / "data.npz")["x"]
    spent = agent.ledger.state()["spent"]
    overflow = x[:, 0] * 3e38 > np.finfo(np.float32).max  # logit +inf: softmax gives NaN
    assert overflow.any() and not overflow.all()
    assert np.all(spent[overflow] == 0.0)  # the overflowing records paid nothing
    assert np.all(spent[~overflow] > 0.0)
    assert agent.ledger.requests_answered() == 1


@pytest.mark.parametrize("unit", ["record", "client"])
def test_records_the_model_cannot_take_are_null_not_an_uncharged_error(tmp_path: Path, unit: str) -> None:
    # The coordinator chooses the class count: a label >= n_classes (or a feature that is NaN) must
    # not turn into an error that answers "does some record have label >= k?" for free.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    y[3] = 5  # outside a 2-class model
    x[7, 1] = np.nan
    agent = make_agent(tmp_path, data=(x, y), unit=unit)
    outcome = agent.handle(wire.GRADIENT, *gradient("odd", unit=unit))
    assert not outcome.is_error, outcome.error_reason
    assert np.all(np.isfinite(outcome.arrays["total"]))
    spent = agent.ledger.state()["spent"]
    if unit == "record":
        assert spent[3] == 0.0 and spent[7] == 0.0  # the null element pays nothing
        assert np.all(np.delete(spent, [3, 7]) > 0.0)
    else:
        assert spent[0] > 0.0
    assert agent.ledger.requests_answered() == 1


def test_state_whose_spend_goes_down_is_never_committed(tmp_path: Path) -> None:
    from client_agent.agent import check_monotone

    agent = make_agent(tmp_path)
    agent.handle(wire.GRADIENT, *gradient())
    state = AgentState.from_arrays(agent.ledger.state())
    assert state.spent is not None and state.stopped is not None
    with pytest.raises(LedgerError, match="went down"):
        check_monotone(state, replace(state, spent=state.spent * 0.5))
    with pytest.raises(LedgerError, match="restarted"):
        check_monotone(
            replace(state, stopped=np.ones_like(state.stopped)), replace(state, stopped=np.zeros_like(state.stopped))
        )
    check_monotone(state, state)  # unchanged is fine


def test_correct_predicate_counts_correctly_classified_records(tmp_path: Path) -> None:
    # Training accuracy for the private plateau test: each record's indicator is "the model is right".
    agent = make_agent(tmp_path)
    data = np.load(tmp_path / "data.npz")
    params = np.zeros(N_PARAMS, np.float32)
    params[0] = -1.0  # logit_0 = -x0, logit_1 = 0: predicts class 1 exactly when x0 > 0, the label rule
    request = indicator(
        "acc1", predicate="correct", model="logreg", model_args=MODEL_ARGS, parameters=params, noise_std=10.0
    )
    outcome = agent.handle(wire.INDICATOR, *request)
    assert not outcome.is_error
    spent = agent.ledger.state()["spent"]
    np.testing.assert_allclose(spent, 0.01)  # every record is right, so every record pays (1 / 10)^2
    assert len(data["y"]) == spent.size


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"predicate": "correct"}, "missing key 'model'"),
        # Any query may carry a model on the wire; the client's workload says whether this one takes it.
        (
            {
                "predicate": "column",
                "model": "logreg",
                "model_args": MODEL_ARGS,
                "parameters": np.zeros(N_PARAMS, np.float32),
            },
            "unexpected key 'model'",
        ),
        (
            {
                "predicate": "correct",
                "model": "logreg",
                "model_args": MODEL_ARGS,
                "parameters": np.zeros(N_PARAMS + 1, np.float32),
            },
            f"'parameters' must hold {N_PARAMS} values",
        ),
    ],
)
def test_correct_predicate_needs_exactly_its_model(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    agent = make_agent(tmp_path)
    outcome = agent.handle(wire.INDICATOR, *indicator("bad", **fields))
    assert outcome.error_code == wire.ERR_MALFORMED and message in outcome.local_detail
    assert agent.ledger.requests_answered() == 0


def test_svt_reservation_belongs_to_the_first_run(tmp_path: Path) -> None:
    # One reserved sparse vector per ledger: a second run asking for exact counts would start an
    # unreserved second SVT on the same units (privacy.md §7).
    agent = make_agent(tmp_path, trust="central", epsilon=3.0, monitor="svt", **{"monitor-epsilon": 1.0})

    def ask(run_id: str, rnd: int) -> Any:
        request = wire.MonitorRequest(request_id=f"{run_id}-m{rnd}", run_id=run_id, round=rnd, trust="central")
        return agent.handle(wire.MONITOR, *wire.encode_request(request))

    first = ask("run-a", 1)
    assert not first.is_error and first.arrays is not None and first.arrays["total"].tolist() == [10.0]
    assert not ask("run-a", 2).is_error
    refused = ask("run-b", 3)
    assert refused.error_code == wire.ERR_POLICY and "belongs to an earlier run" in refused.local_detail
    assert not ask("run-a", 4).is_error


def test_huge_model_args_are_refused_before_allocating(tmp_path: Path) -> None:
    # 10^10 parameters named in model_args, counted on the meta device and never allocated:
    # 100,000 x 100,000 + 100,000 (hidden layer) + 100,000 x 10 + 10 (output) = 10,001,100,010.
    agent = make_agent(tmp_path)
    huge = json.dumps({"in_features": 100_000, "hidden": [100_000], "out_features": 10})
    outcome = agent.handle(wire.GRADIENT, *gradient("huge", model="mlp", model_args=huge))
    assert outcome.error_code == wire.ERR_MALFORMED
    assert "'parameters' must hold 10001100010 values" in outcome.local_detail
    assert agent.ledger.requests_answered() == 0


def test_damaged_stored_reply_is_a_ledger_error_never_a_fresh_answer(tmp_path: Path) -> None:
    import sqlite3

    agent = make_agent(tmp_path)
    assert not agent.handle(wire.GRADIENT, *gradient()).is_error
    agent.close()
    conn = sqlite3.connect(tmp_path / "ledger.sqlite", isolation_level=None)
    conn.execute("UPDATE requests SET reply = ? WHERE request_id = 'r1'", (b"not an npz",))
    conn.close()
    agent = make_agent(tmp_path)
    before = ledger_snapshot(agent)
    outcome = agent.handle(wire.GRADIENT, *gradient())  # the repeat of r1 must replay, and cannot
    assert outcome.error_code == wire.ERR_LEDGER and "stored reply does not decode" in outcome.local_detail
    assert ledger_snapshot(agent) == before


def test_garbage_flower_array_is_a_protocol_error() -> None:
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from protocol.records import decode_content

    content = RecordDict(
        {
            wire.CONFIG: ConfigRecord({}),
            wire.ARRAYS: ArrayRecord({"x": Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=b"junk")}),
        }
    )
    with pytest.raises(wire.ProtocolError, match="array 'x': expected a numpy-serialised array"):
        decode_content(content)
