"""The per-process cache of what a request's public model fields determine (client_agent/model_cache.py, issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client_agent.agent_cache import AgentCache
from client_agent.direct import answer_request
from client_agent.model_cache import MODELS, ModelCache, scope
from protocol import messages as wire
from simulations.federation import write_clients
from tests import factories
from workloads.builtin import BUILTIN
from workloads.models import build_model, flatten_parameters
from workloads.registry import Workload, WorkloadError

MODEL_ARGS = json.dumps({"in_features": 4, "n_classes": 3}, sort_keys=True)


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros(1))


def counting_workload(calls: list[int]) -> Workload:
    def factory() -> nn.Module:
        calls.append(1)
        return Counted()

    return Workload(name="counted", models={"counted": factory}, loss=BUILTIN.loss, data=BUILTIN.data)


def test_fresh_models_equal_a_seeded_build_and_share_nothing() -> None:
    cache = ModelCache()
    calls: list[int] = []
    workload = counting_workload(calls)
    first = cache.fresh(workload, "counted", "{}")
    reference = workload.build_model("counted")
    calls.clear()
    first.linear.weight.data.fill_(7.0)  # what a request does to its own module
    first.seen += 1
    second = cache.fresh(workload, "counted", "{}")
    third = cache.fresh(workload, "counted", "{}")
    assert calls == []  # no build after the first: copies of the pristine one
    for model in (second, third):
        for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
            assert torch.equal(got, want), name
    assert second is not third and second.linear.weight.data_ptr() != third.linear.weight.data_ptr()


def test_shape_is_the_meta_builds_layout_and_count_and_errors_are_not_kept() -> None:
    cache = ModelCache()
    shape = cache.shape(BUILTIN, "logreg", MODEL_ARGS)
    model = build_model("logreg", **json.loads(MODEL_ARGS))
    assert shape.count == flatten_parameters(model).size == 15
    from workloads.registry import layout_fingerprint

    assert shape.layout == layout_fingerprint(model)
    misses = cache.misses
    assert cache.shape(BUILTIN, "logreg", MODEL_ARGS) == shape and cache.misses == misses
    for _ in range(2):  # a failing build raises every time: nothing cached
        with pytest.raises(WorkloadError, match="expected parameters"):
            cache.shape(BUILTIN, "logreg", json.dumps({"width": 3}))
    assert cache.misses == misses


def test_entries_are_per_scope_per_workload_object_and_bounded() -> None:
    cache = ModelCache(max_entries=2)
    computed: list[str] = []

    def compute(tag: str) -> str:
        computed.append(tag)
        return tag

    with scope("alpha"):
        cache.memo("k", BUILTIN, ("m",), lambda: compute("alpha"))
    with scope("beta"):  # another federation: its own entry (no timing hint of what alpha asked)
        assert cache.memo("k", BUILTIN, ("m",), lambda: compute("beta")) == "beta"
    with scope("alpha"):
        assert cache.memo("k", BUILTIN, ("m",), lambda: compute("again")) == "alpha"
    assert computed == ["alpha", "beta"]
    other = counting_workload([])  # another workload object never sees this one's entries
    with scope("alpha"):
        assert cache.memo("k", other, ("m",), lambda: compute("other")) == "other"
        # alpha's table holds its two entries; a third evicts alpha's own oldest, never beta's
        assert cache.memo("k", BUILTIN, ("n",), lambda: compute("third")) == "third"
    with scope("beta"):  # beta's entry is still there whatever alpha did: no timing hint either way
        assert cache.memo("k", BUILTIN, ("m",), lambda: compute("beta again")) == "beta"
    assert computed == ["alpha", "beta", "other", "third"]
    assert sorted(len(t) for t in cache._values.values()) == [1, 2]  # bounded per federation


def test_an_agent_builds_the_requests_model_once_across_requests_and_agents(tmp_path: Path) -> None:
    """Two clients of one process, three requests each: one real build, one meta build (issue 24)."""
    MODELS.clear()
    rng = np.random.default_rng(0)
    parts = [(rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(2)]
    per = write_clients(tmp_path, parts, epsilon=50.0, delta=1e-5, unit="record", trust="central", noise_seed=0)
    params = flatten_parameters(build_model("logreg", **json.loads(MODEL_ARGS)))
    cache = AgentCache()
    misses = MODELS.misses
    for client in (0, 1):
        for i in range(3):
            request = factories.gradient_request(
                f"r{i}", features=4, n_classes=3, round=i + 1, noise_std=8.0, trust="central", parameters=params
            )
            outcome = answer_request(
                per[client], wire.GRADIENT, *wire.encode_request(request), cache=cache, simulation=True
            )
            assert not outcome.is_error, outcome.local_detail
    # shape, pristine model and chunk size: three entries, each computed once for six requests
    assert MODELS.misses - misses == 3
    cache.clear()
