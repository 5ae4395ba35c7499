"""A deployed-style agent (the Agent class, a TOML naming a user's workload): answers, status, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client_agent.agent import Agent
from client_agent.config import parse_agent_config
from client_agent.direct import answer_request
from coordinator.config import CoordinatorConfig
from coordinator.enrolment import EnrolmentError, enrol
from examples.gn_regression import workload as example
from protocol import messages as wire
from simulations.inprocess import InProcessTransport
from tests.workload_fixtures import RECORDS, REF, deployed_agent, histogram, model_request, write_agent
from workloads.models import flatten_parameters
from workloads.registry import WorkloadError


def test_status_describes_the_workload_by_names(tmp_path: Path) -> None:
    agent = deployed_agent(tmp_path)
    assert agent.workload.name == "gn_regression" and len(agent.source) == RECORDS
    assert agent.n_units == RECORDS
    outcome = agent.handle(wire.STATUS, *wire.encode_request(wire.StatusRequest("s", "run", 0)))
    described = json.loads(outcome.config["description"])["workload"]  # type: ignore[index]
    assert described == {
        "name": "gn_regression",
        "models": ["gn_cnn"],
        "queries": {
            "clipped_target": {"dim": 1, "l2_bound": 2.0, "needs_model": False},
            "target_histogram": {"dim": 8, "l2_bound": 1.0, "needs_model": False},
        },
    }
    agent.close()


def test_a_gradient_request_is_answered_with_the_workloads_model_and_loss(tmp_path: Path) -> None:
    agent = deployed_agent(tmp_path)
    outcome = agent.handle(wire.GRADIENT, *model_request())
    assert not outcome.is_error, outcome.local_detail
    d = flatten_parameters(example.gn_cnn()).size
    assert outcome.arrays["total"].shape == (d,)  # type: ignore[index]
    spent = agent.ledger.state()["spent"]
    assert spent.shape == (RECORDS,) and np.all(spent > 0)  # every record's MSE gradient is non-zero
    agent.close()


def _refused(agent: Agent, kind: str, payload: Any, code: int, detail: str) -> None:
    before = agent.ledger.requests_answered()
    outcome = agent.handle(kind, *payload)
    assert outcome.error_code == code, outcome.local_detail
    assert detail in outcome.local_detail, outcome.local_detail
    assert outcome.error_reason == wire.ERROR_TEXT[code]  # fixed text on the wire, no names of the client's
    assert agent.ledger.requests_answered() == before


def test_unknown_model_unknown_query_and_a_layout_mismatch_are_refused(tmp_path: Path) -> None:
    agent = deployed_agent(tmp_path)
    config, arrays = model_request()
    _refused(agent, wire.GRADIENT, (config | {"model": "logreg"}, arrays), wire.ERR_MALFORMED, "model 'logreg'")
    _refused(agent, wire.INDICATOR, histogram(predicate="column"), wire.ERR_MALFORMED, "query 'column'")
    _refused(agent, wire.INDICATOR, histogram(predicate="os.system"), wire.ERR_MALFORMED, "query 'os.system'")
    # The coordinator's model has another layout (3 outputs) than the client's build of the same request.
    mismatch = model_request("g2", layout_outputs=3)
    _refused(agent, wire.GRADIENT, mismatch, wire.ERR_MALFORMED, "layout")
    bad_hex = model_request("g3", layout="xyz")
    _refused(agent, wire.GRADIENT, bad_hex, wire.ERR_MALFORMED, "'layout' must be 64 lowercase hex digits")
    bad_name = histogram(predicate="import os")
    _refused(agent, wire.INDICATOR, bad_name, wire.ERR_MALFORMED, "must be a name of at most 64")
    agent.close()


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        ("examples.gn_regression.workload", "expected 'package.module:object' or an entry point"),
        ("examples.gn_regression.workload:make_records", "expected a workloads.registry.Workload, found"),
        ("examples.gn_regression.workload:NOPE", "has no attribute 'NOPE'"),
    ],
)
def test_a_malformed_workload_reference_stops_the_agent(tmp_path: Path, workload: str, message: str) -> None:
    path = write_agent(tmp_path, workload=workload)
    with pytest.raises(WorkloadError, match=message):
        Agent(parse_agent_config({"agent-config": str(path)}))
    # Through the ClientApp's path: a ledger/configuration refusal with its fixed text; nothing created.
    outcome = answer_request({"agent-config": str(path)}, wire.STATUS, {"request_id": "s"}, {}, cache=None)
    assert outcome.error_code == wire.ERR_LEDGER and outcome.error_reason == wire.ERROR_TEXT[wire.ERR_LEDGER]
    assert not (tmp_path / "ledger.sqlite").exists()


def test_enrolment_refuses_clients_whose_workload_lacks_the_runs_model(tmp_path: Path) -> None:
    path = write_agent(tmp_path)
    transport = InProcessTransport({0: {"agent-config": str(path)}})
    cfg = CoordinatorConfig(
        num_nodes=1,
        n_public=RECORDS,
        rounds=1,
        noise_std=1.0,
        l2_clip=1.0,
        model="logreg",
        model_args=json.dumps({"in_features": 64, "n_classes": 2}),
    )
    with pytest.raises(EnrolmentError, match="model 'logreg' asked; a client's workload does not register it"):
        enrol(transport, cfg)
    ok = CoordinatorConfig(**{**cfg.__dict__, "model": "gn_cnn", "model_args": "{}", "workload": REF})
    assert enrol(transport, ok).units_enrolled == RECORDS


def test_the_agent_answers_its_workloads_histogram_query(tmp_path: Path) -> None:
    agent = deployed_agent(tmp_path)
    outcome = agent.handle(wire.INDICATOR, *histogram())
    assert not outcome.is_error, outcome.local_detail
    assert outcome.arrays["total"].shape == (8,)  # type: ignore[index]
    # One-hot rows (norm 1) at sigma 1 cost 1 each; partial clipping spends what is left (T), less the
    # 64 float32 ulps clip_scales keeps under the bound: (1 - 64 eps)^2 ~ 1 - 1.5e-5 of T.
    assert agent.gaussian is not None
    spent = agent.ledger.state()["spent"]
    T = agent.gaussian.threshold
    assert T < 1.0 and np.all(spent <= T) and np.allclose(spent, T, rtol=2e-5)
    agent.close()


def test_indicator_rows_read_the_workloads_query_over_the_source(tmp_path: Path) -> None:
    from client_agent.workloads import indicator_rows

    agent = deployed_agent(tmp_path)
    request = wire.decode_request(wire.INDICATOR, *histogram())
    assert isinstance(request, wire.IndicatorRequest)
    rows = indicator_rows(request, agent.source, unit="record", workload=agent.workload)
    assert rows.shape == (RECORDS, 8) and np.allclose(rows.sum(axis=1), 1.0)
    client = indicator_rows(request, agent.source, unit="client", workload=agent.workload)
    np.testing.assert_allclose(client, rows.sum(axis=0, keepdims=True))
    with pytest.raises(wire.ProtocolError, match="query 'column'"):
        other = wire.decode_request(wire.INDICATOR, *histogram("q2", "column"))
        indicator_rows(other, agent.source, unit="record", workload=agent.workload)  # type: ignore[arg-type]
    agent.close()


def test_the_device_key_is_checked_against_what_torch_sees(tmp_path: Path) -> None:
    from client_agent.config import AgentConfigError

    with pytest.raises(AgentConfigError, match="device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        deployed_agent(tmp_path, device="gpu")
    if torch.cuda.is_available():  # a GPU machine: the agent runs its engine there
        agent = deployed_agent(tmp_path, device="cuda")
        assert agent.config.device == "cuda"
        outcome = agent.handle(wire.GRADIENT, *model_request())
        assert not outcome.is_error, outcome.local_detail
        agent.close()
    else:
        with pytest.raises(AgentConfigError, match="device: 'cuda' asked; torch sees no such CUDA device"):
            deployed_agent(tmp_path, device="cuda")


def test_enrolment_refuses_a_client_whose_model_has_another_parameter_layout(tmp_path: Path) -> None:
    """The coordinator's and the client's workloads both register 'gn_cnn', built differently: enrolment
    compares the layout fingerprints (names, shapes, dtypes) and refuses before any data is touched."""
    import dataclasses

    from client_agent.agent import _name_index
    from examples.gn_regression import workload as example

    agent = deployed_agent(tmp_path)
    wider = dataclasses.replace(
        example.WORKLOAD, models={"gn_cnn": lambda **kw: example.gn_cnn(channels=16, **kw)}
    )  # the client's own build of the same name
    agent.workload, agent.workloads = wider, (wider,)
    agent._by_model, agent._by_query = _name_index(agent.workloads)
    status = agent.handle(wire.STATUS, *wire.encode_request(wire.StatusRequest("s", "run", 0, "gn_cnn", "{}")))
    layout = json.loads(status.config["description"])["layout"]  # type: ignore[index]
    assert layout["model"] == "gn_cnn" and len(layout["fingerprint"]) == 64
    cfg = CoordinatorConfig(
        num_nodes=1,
        n_public=RECORDS,
        rounds=1,
        noise_std=1.0,
        l2_clip=1.0,
        model="gn_cnn",
        model_args="{}",
        workload=REF,
    )

    class One:
        def node_ids(self, count: int, *, timeout: float) -> list[int]:
            return [0]

        def send(self, message_type: str, payloads: dict, *, timeout: float) -> Any:
            from coordinator.transport import RoundReplies

            out = RoundReplies()
            for node, (c, a) in payloads.items():
                o = agent.handle(message_type, dict(c), dict(a))
                out.replies[node] = (o.config, o.arrays)
            return out

    with pytest.raises(
        EnrolmentError, match="model 'gn_cnn' with \\{\\} asked; a client's workload builds it with another"
    ):
        enrol(One(), cfg)  # type: ignore[arg-type]
    agent.workload, agent.workloads = example.WORKLOAD, (example.WORKLOAD,)
    agent._by_model, agent._by_query = _name_index(agent.workloads)
    assert enrol(One(), cfg).units_enrolled == RECORDS  # the same build: enrolled
    agent.close()


def test_the_activation_budget_sizes_chunks_and_refuses_a_model_too_wide_for_one_record(tmp_path: Path) -> None:
    """Review finding: coordinator-chosen model_args (an MLP with a wide hidden layer) could make one chunk's
    activations take gigabytes with few parameters. The agent measures the model's activations per record on
    the meta device (no memory, no values read), sizes its chunks to policy-max-activation-mb, and refuses,
    as policy and before any work or charge, a model one record of which exceeds it."""
    from client_agent.streaming import StreamedGradients
    from tests.factories import build_agent, client_data, gradient_request

    features, wide = 8, 1 << 16  # one hidden layer of 65,536 units: 256 KiB of activations per record each way
    args = json.dumps({"in_features": features, "hidden": [wide], "out_features": 2})
    params = np.zeros(features * wide + wide + wide * 2 + 2, np.float32)
    request = gradient_request(features=features, model="mlp", model_args=args, parameters=params)

    agent = build_agent(tmp_path, client_data(40, features), **{"policy-max-activation-mb": 16})
    units = agent.contributions(request)
    assert isinstance(units, StreamedGradients)
    assert 1 <= units.chunk_size < 1024  # sized to 16 MiB: about 2 x 256 KiB x 3 copies per record
    per_record = 3 * 2 * wide * 4  # activations, backprops and captured inputs of the hidden layer (float32)
    assert units.chunk_size <= (16 << 20) // per_record
    out = agent.handle(wire.GRADIENT, *wire.encode_request(request))
    assert not out.is_error
    agent.close()

    tight = tmp_path / "tight"
    tight.mkdir()
    agent = build_agent(tight, client_data(40, features), **{"policy-max-activation-mb": 1})
    before = agent.ledger.state()["spent"].copy()
    out = agent.handle(wire.GRADIENT, *wire.encode_request(request))
    assert out.is_error and out.error_code == wire.ERR_POLICY
    assert out.error_reason == wire.ERROR_TEXT[wire.ERR_POLICY]  # fixed text on the wire
    assert "policy-max-activation-mb" in out.local_detail  # the detail stays in the client's log
    np.testing.assert_array_equal(agent.ledger.state()["spent"], before)
    agent.close()
