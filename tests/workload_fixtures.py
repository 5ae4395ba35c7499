"""The example workload (examples/gn_regression) as a deployed agent's TOML, and requests for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from client_agent.agent import Agent
from client_agent.config import parse_agent_config
from examples.gn_regression import workload as example
from protocol import messages as wire
from tests.factories import gradient_request, indicator_request
from workloads.models import flatten_parameters
from workloads.registry import layout_fingerprint

REF = "examples.gn_regression.workload:WORKLOAD"
RECORDS = 12


def write_agent(tmp_path: Path, *, workload: str = REF, **extra: Any) -> Path:
    x, y = example.make_records(RECORDS, seed=1)
    example.write_records(tmp_path / "grid.f32", x, y)
    lines = [
        'data-path = "grid.f32"',  # relative to the TOML file, as the owner writes it
        'ledger-path = "ledger.sqlite"',
        "epsilon = 3.0",
        "delta = 1e-5",
        'unit = "record"',
        'trust = "local"',
        "policy-min-noise-std = 0.5",
        "policy-max-clip = 100.0",
        "policy-max-request-share = 1.0",
        f"workload = {json.dumps(workload)}",
        *(f"{k} = {json.dumps(v)}" for k, v in extra.items()),
    ]
    path = tmp_path / "agent.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def deployed_agent(tmp_path: Path, **kw: Any) -> Agent:
    return Agent(parse_agent_config({"agent-config": str(write_agent(tmp_path, **kw))}))


def model_request(request_id: str = "g1", *, outputs: int = 2, layout_outputs: int | None = None, **fields: Any) -> Any:
    model = example.WORKLOAD.build_model("gn_cnn", outputs=outputs)
    with torch.device("meta"):
        layout_model = example.WORKLOAD.build_model("gn_cnn", outputs=layout_outputs or outputs)
    request = gradient_request(
        request_id,
        noise_std=1.0,
        model="gn_cnn",
        model_args=json.dumps({"outputs": outputs}),
        parameters=flatten_parameters(model),
        layout=layout_fingerprint(layout_model),
    )
    config, arrays = wire.encode_request(request)
    return config | fields, arrays


def histogram(request_id: str = "q1", predicate: str = "target_histogram") -> Any:
    return wire.encode_request(indicator_request(request_id, predicate=predicate))
