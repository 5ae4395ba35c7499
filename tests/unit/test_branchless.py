"""Selections whose time does not depend on the mask (protocol/branchless.py, client_agent/layers/base.py).

A masked numpy or torch primitive (np.where, np.copyto(where=), np.putmask, boolean-mask assignment,
torch.where, masked_fill) branches per element: measured here over 65,536 float64, np.copyto(where=)
took 8 us with no unit refused and 337 us with half of them refused, so the filter's charge told the
coordinator, by its time, how many units were refused (privacy.md §8). The release path now selects
with integer bit operations only. These tests check that the bitwise selections are exactly the
masked ones (bit for bit), and a fourth witness of the release's work, beside the three of
tests/unit/test_release_uniform.py: that no masked primitive runs in it, for any stop pattern, and
that none is written in the release path's source (boolean-mask assignment cannot be seen at run time).
The timing itself is measured in benchmarks/timing_uniformity.py, not here.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from client_agent.agent import Agent
from client_agent.layers.base import or_zero as torch_or_zero
from client_agent.layers.base import or_zero_, rows_where
from client_agent.state import AgentState
from protocol.branchless import or_zero, select
from protocol.filters import FilterState, GaussianFilter, charge
from tests.unit.test_release_uniform import N, data, decoded_request, make_agent

ROOT = Path(__file__).resolve().parents[2]

SPECIALS = np.array([0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, 5e-324, -1e-310, 1.7e308], dtype=np.float64)


def _payload_nan() -> np.ndarray:
    """A NaN with a payload: a numeric select would not keep its bits."""
    return np.array([0x7FF8_0000_DEAD_BEEF], dtype=np.int64).view(np.float64)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64, np.int32, np.uint8, np.bool_])
def test_select_and_or_zero_are_np_where_bit_for_bit(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    n = 257
    if np.dtype(dtype).kind == "f":
        a = np.concatenate([SPECIALS, _payload_nan(), rng.normal(size=n - SPECIALS.size - 1)])
        with np.errstate(over="ignore"):  # 1.7e308 is inf in float32, as it should be
            a = a.astype(dtype)
    elif dtype is np.bool_:
        a = rng.random(n) < 0.5
    else:
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype)
    b = a[::-1].copy()
    for mask in (rng.random(n) < 0.5, np.zeros(n, bool), np.ones(n, bool)):
        got = select(mask, a, b)
        assert got.dtype == a.dtype
        assert np.array_equal(_bits(got), _bits(np.where(mask, a, b)))
        zero = np.zeros((), dtype=dtype)
        assert np.array_equal(_bits(or_zero(mask, a)), _bits(np.where(mask, a, zero)))


def test_select_broadcasts_and_promotes_as_np_where() -> None:
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(6, 4))
    mask = rng.random(6) < 0.5
    assert np.array_equal(or_zero(mask[:, None], rows), np.where(mask[:, None], rows, 0.0))
    got = select(mask, np.arange(6, dtype=np.int64), 2.5)  # int and float: float64, as np.where
    assert got.dtype == np.float64 and np.array_equal(got, np.where(mask, np.arange(6), 2.5))
    halt = np.array([-1, 3, -1, 7, -1, -1], dtype=np.int64)
    got = select(mask & (halt < 0), np.int64(9), halt)
    assert got.dtype == np.int64 and np.array_equal(got, np.where(mask & (halt < 0), 9, halt))
    assert select(np.zeros(0, bool), np.zeros(0), np.zeros(0)).shape == (0,)


def test_bad_masks_and_dtypes_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="expected a boolean array, got dtype int64"):
        or_zero(np.array([1, 0]), np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="expected boolean, integer or float arrays, got dtype <U1"):
        select(np.array([True]), np.array(["a"]), np.array(["b"]))
    with pytest.raises(TypeError, match="expected a boolean mask"):
        torch_or_zero(torch.tensor([1, 0]), torch.zeros(2))
    with pytest.raises(TypeError, match="expected a boolean mask and a float tensor"):
        or_zero_(torch.tensor([True]), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="carries no gradient"):  # torch.where would pass the gradient on
        torch_or_zero(torch.tensor([True]), torch.zeros(1, requires_grad=True))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
)
def test_torch_or_zero_is_torch_where_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        t = torch.randn(9, 5, generator=g).to(dtype)
        t[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0]).to(dtype)
    else:
        t = torch.randint(0, 200, (9, 5), generator=g).to(dtype)
    keep = torch.rand(9, generator=g) < 0.5
    keep[0] = False
    keep[1] = True
    zero = torch.zeros((), dtype=dtype)
    expected = torch.where(keep.reshape(-1, 1), t, zero)
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    assert torch.equal(rows_where(keep, t).view(word), expected.view(word))
    elementwise = torch.rand(9, 5, generator=g) < 0.5
    assert torch.equal(torch_or_zero(elementwise, t).view(word), torch.where(elementwise, t, zero).view(word))
    if dtype.is_floating_point:
        inplace = t.clone()
        assert or_zero_(keep.reshape(-1, 1), inplace) is inplace
        assert torch.equal(inplace.view(word), expected.view(word))
    flags = torch.rand(9, generator=g) < 0.5
    assert torch.equal(torch_or_zero(keep, flags), keep & flags)


# --- The fourth witness: no masked primitive runs in the release ------------------------------------

_NUMPY_MASKED = ("where", "copyto", "putmask", "place", "extract", "compress", "select", "choose", "piecewise")
_TORCH_MASKED = ("aten.where", "aten.masked_", "aten.nonzero", "aten.index_put", "aten.masked_select")


@contextmanager
def numpy_masked_calls() -> Iterator[list[str]]:
    """Log every call of numpy's masked primitives (np.where with a mask and values, np.copyto with where=, ...)."""
    calls: list[str] = []
    # numpy's own functions call its C primitives through its internal modules (np.nan_to_num calls
    # numpy._core.numeric.copyto three times with where=): those names are spied on too.
    spaces = [np, np._core.numeric, np._core.multiarray, np._core.fromnumeric]
    saved = {(space, name): getattr(space, name) for space in spaces for name in _NUMPY_MASKED if hasattr(space, name)}

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not (name == "where" and len(args) == 1) and not (name == "copyto" and "where" not in kwargs):
                calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    for (space, name), fn in saved.items():
        setattr(space, name, spy(name, fn))
    try:
        yield calls
    finally:
        for (space, name), fn in saved.items():
            setattr(space, name, fn)


class _MaskedOps(TorchDispatchMode):
    """Torch's masked operators run under it, each with whether its mask held one value throughout.

    torch's own decompositions select too (nll_loss under vmap masks ``target != ignore_index``); a mask
    that holds one value throughout is predicted every time, so its timing says nothing, and that is
    what the release's masks must be when they come from torch and not from the project's code."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith(_TORCH_MASKED):
            masks = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.bool]
            self.ops.append((name, all(bool(m.all()) or not bool(m.any()) for m in masks) and bool(masks)))
        return func(*args, **(kwargs or {}))


def masked_work(fn: Callable[[], object]) -> tuple[list[str], list[str]]:
    """(numpy masked calls, torch masked operators whose mask varies) that ``fn`` runs, after a warm-up run."""
    fn()
    log = _MaskedOps()
    with numpy_masked_calls() as calls, log:
        fn()
    return calls, [op for op, uniform in log.ops if not uniform]


@pytest.mark.parametrize(("filter_kind", "l2_clip", "noise_std"), [("gdp", 100.0, 100.0), ("gdp", 0.05, 1.0)])
def test_no_masked_primitive_runs_in_the_record_release(
    tmp_path: Path, filter_kind: str, l2_clip: float, noise_std: float
) -> None:
    x, y = data()
    x[::11, 3] = np.inf  # unusable records too: their mask is data as well
    agent = make_agent(tmp_path, x, y, filter=filter_kind)
    request = decoded_request(l2_clip, noise_std)
    fresh = AgentState.from_arrays(agent.ledger.state())
    assert agent.gaussian is not None
    threshold = agent.gaussian.threshold
    rng = np.random.default_rng(3)
    stopped = rng.random(N) < 0.5
    spent = np.where(stopped, threshold, rng.random(N) * threshold)  # the test's own setup, not the release
    state = replace(fresh, spent=spent, stopped=stopped)
    calls, ops = masked_work(lambda: agent.release(request, agent.contributions(request), state))
    assert calls == [] and ops == []
    agent.close()


def _release(agent: Agent, request: Any, state: AgentState) -> object:
    return agent.release(request, agent.contributions(request), state)


def test_no_masked_primitive_runs_in_the_client_unit_releases(tmp_path: Path) -> None:
    x, y = data()
    for kind, extra in (
        ("gdp", {}),
        ("realisation", {"realisation-max-rounds": 8, "policy-max-clip": 1.0, "policy-min-noise-std": 1.0}),
    ):
        folder = tmp_path / kind
        folder.mkdir()
        agent = make_agent(folder, x, y, filter=kind, unit="client", epsilon=5.0, **extra)
        request = decoded_request(unit="client")
        state = AgentState.from_arrays(agent.ledger.state())
        calls, ops = masked_work(partial(_release, agent, request, state))
        assert calls == [] and ops == [], kind
        agent.close()


def test_the_masked_witness_sees_the_old_charge() -> None:
    """It has power: the charge as it was (np.copyto(where=refused) to undo refused units) is caught."""
    filt = GaussianFilter.gdp(epsilon=1.0, delta=1e-5)
    state = FilterState(spent=np.full(8, filt.threshold * 0.9), stopped=np.zeros(8, bool))
    norms = np.full(8, 10.0)

    def old_undo() -> None:
        result = charge(filt, state, noise_std=1.0, l2_norms=norms)
        cost = np.array(result.state.spent)
        np.copyto(cost, state.spent, where=result.refused)

    calls, _ = masked_work(old_undo)
    assert calls == ["copyto"]
    calls, _ = masked_work(lambda: charge(filt, state, noise_std=1.0, l2_norms=norms))
    assert calls == []
    _, ops = masked_work(lambda: torch.where(torch.tensor([True, False]), torch.ones(2), torch.zeros(2)))
    assert ops == ["aten.where.self"]
    _, ops = masked_work(lambda: torch.where(torch.tensor([True, True]), torch.ones(2), torch.zeros(2)))
    assert ops == []  # one value throughout: nothing to predict wrongly


# The modules every reply's computation runs through. Boolean-mask assignment (a[mask] = v) cannot be
# seen at run time, so the source is read: no masked primitive and no assignment through a mask.
RELEASE_PATH = (
    "client_agent/agent.py",
    "client_agent/streaming.py",
    "client_agent/workloads.py",
    "client_agent/local_training.py",
    "client_agent/isolation.py",
    "client_agent/gradients.py",
    "client_agent/layers",
    "protocol/filters.py",
    "protocol/releases.py",
    "protocol/branchless.py",
    "protocol/realisation.py",
    "protocol/secagg.py",
    "workloads/registry.py",
)
_MASKED_NAMES = {"where", "putmask", "place", "masked_fill", "masked_fill_", "masked_scatter", "masked_select"}


def _is_mask(node: ast.expr) -> bool:
    """A comparison, a negation (~) or a boolean combination (&, |, ^; not a type union with None)."""
    if isinstance(node, ast.Compare) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert)):
        return True
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.BitAnd | ast.BitOr | ast.BitXor)
        and not any(isinstance(side, ast.Constant) and side.value is None for side in (node.left, node.right))
    )


def masked_source(path: Path) -> list[str]:
    """Masked primitives and assignments through a comparison or a boolean expression, in line order.

    A heuristic: an assignment through a mask held in a variable (``a[stopped] = 0``) is not told from
    one through an index, so the run-time witness above and the reviews carry that case."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in _MASKED_NAMES and not (name == "where" and len(node.args) < 2):
                found.append((node.lineno, f"{path.name}:{node.lineno} {name}"))
            if name == "copyto" and any(k.arg == "where" for k in node.keywords):
                found.append((node.lineno, f"{path.name}:{node.lineno} copyto(where=)"))
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript) and _is_mask(target.slice):
                found.append((node.lineno, f"{path.name}:{node.lineno} assignment through a mask"))
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_mask(node.slice):
            found.append((node.lineno, f"{path.name}:{node.lineno} read through a mask"))
    return [text for _, text in sorted(found)]


def _release_files() -> list[Path]:
    out: list[Path] = []
    for entry in RELEASE_PATH:
        path = ROOT / entry
        out.extend(sorted(path.glob("*.py")) if path.is_dir() else [path])
    return out


def test_the_release_path_source_has_no_masked_primitive() -> None:
    found = [hit for path in _release_files() for hit in masked_source(path)]
    assert found == []


def test_the_source_witness_sees_masked_code(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import numpy as np\n"
        "def f(a, b, m, halt):\n"
        "    np.copyto(a, b, where=m)\n"
        "    halt[m & (halt < 0)] = 3\n"
        "    z = a[b > 0].sum()\n"
        "    x = np.where(m, a, 0.0)\n"
        "    y = np.where(m)\n"  # indices of a public mask: not a select
        "    return x.masked_fill(m, 0), y\n"
    )
    assert [hit.split(" ", 1)[1] for hit in masked_source(sample)] == [
        "copyto(where=)",
        "assignment through a mask",
        "read through a mask",
        "where",
        "masked_fill",
    ]
