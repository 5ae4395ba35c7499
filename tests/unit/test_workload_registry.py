"""The workload registry (workloads/registry.py): loading, validation, model factories, built-ins, layouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from protocol import messages as wire
from workloads.builtin import BUILTIN
from workloads.models import MODELS, build_model
from workloads.registry import (
    BUILTIN_REF,
    Query,
    QueryArgs,
    Workload,
    WorkloadError,
    bounded_rows,
    layout_fingerprint,
    load_workload,
)

EXAMPLE = "examples.gn_regression.workload:WORKLOAD"

NOT_A_WORKLOAD = {"models": {}}  # loaded by reference in a test below


def broken_factory() -> nn.Module:
    raise RuntimeError("out of cheese")


def not_a_module() -> object:
    return object()


TINY = Workload(
    name="tiny",
    models={"lin": lambda *, width=2: nn.Linear(width, 1), "broken": broken_factory, "odd": not_a_module},
    loss=lambda out, y: ((out - y) ** 2).sum(dim=1),
    data=lambda path: None,  # type: ignore[arg-type,return-value]
)


def test_importing_the_workload_module_loads_neither_torch_nor_flwr() -> None:
    code = "import sys, workloads.registry; print(sorted(m for m in ('torch', 'flwr') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path.cwd())
    assert out.stdout.strip() == "[]"


def test_load_by_module_and_object_and_by_entry_point_name() -> None:
    assert load_workload(BUILTIN_REF) is BUILTIN
    assert load_workload(EXAMPLE).name == "gn_regression"
    assert load_workload(f"{__name__}:TINY") is TINY


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("", r"workload: expected 'package.module:object' or an entry point name, got ''"),
        ("no_such_module_xyz:W", r"expected an importable module 'no_such_module_xyz'"),
        ("workloads.builtin:NOPE", r"module 'workloads.builtin' has no attribute 'NOPE'"),
        (f"{__name__}:NOT_A_WORKLOAD", r"expected a workloads.registry.Workload, found dict"),
        ("workloads.builtin:", r"expected 'package.module:object', got"),
        ("not-an-entry-point", r"group 'fedfilter.workloads' \(installed: .*\), got 'not-an-entry-point'"),
    ],
)
def test_malformed_references_name_what_was_expected(ref: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(ref)


def test_a_workload_is_validated_at_construction() -> None:
    base = {"name": "w", "models": {}, "loss": print, "data": print}
    with pytest.raises(WorkloadError, match="expected a workload name"):
        Workload(**{**base, "name": "bad name!"})
    with pytest.raises(WorkloadError, match=r"query 'q': expected a workloads.registry.Query, got int"):
        Workload(**base, queries={"q": 3})  # type: ignore[dict-item]
    with pytest.raises(WorkloadError, match="model 'm': expected a callable factory"):
        Workload(**{**base, "models": {"m": 3}})  # type: ignore[dict-item]
    with pytest.raises(WorkloadError, match="expected a callable loss"):
        Workload(**{**base, "loss": None})  # type: ignore[arg-type]
    with pytest.raises(WorkloadError, match="expected an integer dim >= 1, got 0"):
        Query(print, dim=0)
    with pytest.raises(WorkloadError, match="expected a finite l2_bound > 0, got inf"):
        Query(print, l2_bound=float("inf"))
    with pytest.raises(TypeError):
        TINY.models["new"] = print  # type: ignore[index]  # registries are read-only once built


def test_model_factories_unknown_failing_or_not_a_module() -> None:
    assert isinstance(TINY.build_model("lin", width=3), nn.Linear)
    with pytest.raises(WorkloadError, match=r"expected one of \['broken', 'lin', 'odd'\] \(workload 'tiny'\), got 'x'"):
        TINY.build_model("x")
    with pytest.raises(WorkloadError, match=r"model 'lin': expected parameters \['width'\], got \['depth'\]"):
        TINY.build_model("lin", depth=2)
    with pytest.raises(WorkloadError, match=r"model 'broken': the factory failed .*RuntimeError: out of cheese"):
        TINY.build_model("broken")
    with pytest.raises(WorkloadError, match=r"model 'odd': expected the factory to return a torch\.nn\.Module, got"):
        TINY.build_model("odd")
    with pytest.raises(WorkloadError, match=r"query: expected one of \[\] \(workload 'tiny'\), got 'column'"):
        TINY.query("column")


def test_the_builtins_go_through_the_registry() -> None:
    assert dict(BUILTIN.models) == dict(MODELS)
    assert set(BUILTIN.queries) == set(wire.PREDICATES)
    assert all(q.dim == 1 and q.l2_bound == 1.0 for q in BUILTIN.queries.values())
    assert BUILTIN.queries["correct"].needs_model and not BUILTIN.queries["label"].needs_model
    args = {"in_features": 3, "n_classes": 2}
    same = [build_model("logreg", seed=4, **args), BUILTIN.build_model("logreg", seed=4, **args)]
    assert torch.equal(same[0][1].weight, same[1][1].weight)
    described = BUILTIN.describe()
    assert described["models"] == ["logreg", "mlp", "opacus_mnist_cnn"]
    assert described["queries"]["column"] == {"dim": 1, "l2_bound": 1.0, "needs_model": False}
    json.dumps(described)  # crosses the wire as JSON: names and numbers only


def test_builtin_validity_rule_is_the_classification_null_element() -> None:
    model = BUILTIN.build_model("logreg", in_features=2, n_classes=3)
    x = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [1.0, 1.0], [1.0, 1.0], [0.5, 0.5]])
    y = torch.tensor([0, 1, 3, -1, 2])
    assert BUILTIN.valid(x, y, model).tolist() == [True, False, False, False, True]


def test_layout_fingerprint_is_names_shapes_and_dtypes() -> None:
    a = BUILTIN.build_model("mlp", in_features=4, hidden=[3], out_features=2)
    with torch.device("meta"):
        b = BUILTIN.build_model("mlp", in_features=4, hidden=[3], out_features=2, seed=9)
    c = BUILTIN.build_model("mlp", in_features=4, hidden=[5], out_features=2)
    assert layout_fingerprint(a) == layout_fingerprint(b)  # the values and the device do not matter
    assert layout_fingerprint(a) != layout_fingerprint(c)
    assert layout_fingerprint(a) != layout_fingerprint(a.double())
    assert len(layout_fingerprint(a)) == wire.LAYOUT_HEX


def test_query_rows_are_kept_within_the_declared_bound() -> None:
    query = Query(lambda x, y, a: x, dim=2, l2_bound=1.0)
    rows = bounded_rows(query, np.array([[3.0, 4.0], [0.3, 0.4], [np.nan, 1.0]]), 3)
    np.testing.assert_allclose(rows, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], rtol=1e-6)
    with pytest.raises(WorkloadError, match=r"expected rows of shape \(3, 2\), got \(3, 1\)"):
        bounded_rows(query, np.zeros((3, 1)), 3)


def test_example_workload_histogram_and_clipped_queries() -> None:
    example = load_workload(EXAMPLE)
    y = np.array([[-5.0, 0.0], [-1.9, 0.0], [0.1, 0.0], [9.0, 0.0]])
    args = QueryArgs(column=0, value=0.0)
    hist = bounded_rows(example.query("target_histogram"), example.query("target_histogram").rows(None, y, args), 4)
    assert hist.shape == (4, 8) and hist.argmax(axis=1).tolist() == [0, 0, 4, 7]
    assert np.allclose(np.linalg.norm(hist, axis=1), 1.0)
    clipped = example.query("clipped_target")
    np.testing.assert_allclose(bounded_rows(clipped, clipped.rows(None, y, args), 4)[:, 0], [-2, -1.9, 0.1, 2])
    model = example.build_model("gn_cnn", outputs=2)
    out = model(torch.zeros(5, 1, 8, 8))
    assert example.loss(out, torch.zeros(5, 2)).shape == (5,)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert SimpleNamespace(**example.describe()).queries["target_histogram"]["dim"] == 8
