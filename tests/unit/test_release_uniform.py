"""The agent's work does not depend on who stopped or which records are null (issue 12, finding 4).

A reply whose computation takes longer when more units are stopped, or when some record is
unusable, tells the coordinator what the monitor and the null-element rule hide (privacy.md
§1, §7, §8): an exhausted client answered 15-20 ms slower on ~150 ms, and an unusable record
cost an extra (n x d) copy. Timing tests are flaky and forbidden here, so this checks two
deterministic witnesses of the work instead, through the agent's real contribution and release
code:

- the exact sequence of executed lines in the project's own code (``sys.settrace``): a branch
  taken for some units, or a loop whose length depends on them, changes it;
- the numpy memory the computation allocates at its peak (``tracemalloc``): an extra copy of
  the rows, or index arrays as long as the stopped set, change it;
- the sequence of torch operators with their argument shapes and dtypes (a ``TorchDispatchMode``
  log, backward included): record-unit gradients are streamed in one fused pass per chunk
  (client_agent.streaming.fused_clipped_sum, run inside ``Agent.release``: forward, backward to
  the layers' outputs, each layer's per-record rows and norms, the filter's weights, the weighted
  sums of the same rows and outer products), and a pass that skipped stopped records, selected the
  admitted ones or branched per chunk would change the operators or their shapes. Torch's own
  allocations are not seen by ``tracemalloc``; the shapes of every operator's arguments bound
  them instead. Beyond the agent's logistic regression, the fused pass is traced directly on every
  kind of layer (convolutions, embedding, normalisation, a custom leaf, the whole-model fallback).
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from client_agent.agent import Agent
from client_agent.state import AgentState
from protocol import messages as wire
from tests.factories import build_agent, client_data, gradient_request

ROOT = Path(__file__).resolve().parents[2]
OWN = tuple(str(ROOT / pkg) for pkg in ("client_agent", "protocol"))
N, FEATURES = 400, 100  # rows of d = 202 floats: one copy of them is 323 KB
N_PARAMS = FEATURES * 2 + 2


def make_agent(tmp_path: Path, x: np.ndarray, y: np.ndarray, **over: Any) -> Agent:
    return build_agent(tmp_path, (x, y), **({"noise-seed": 1} | over))


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return client_data(N, FEATURES, seed=seed)


def decoded_request(l2_clip: float = 0.5, noise_std: float = 1.0, **fields: Any) -> wire.GradientRequest:
    """The gradient request as the agent sees it after decoding, at parameters 0.05 everywhere."""
    built = gradient_request(
        features=FEATURES,
        noise_std=noise_std,
        l2_clip=l2_clip,
        parameters=np.full(N_PARAMS, 0.05, np.float32),
        **fields,
    )
    request = wire.decode_request(wire.GRADIENT, *wire.encode_request(built))
    assert isinstance(request, wire.GradientRequest)
    return request


def traced_lines(fn: Callable[[], object], roots: tuple[str, ...] = OWN) -> list[tuple[str, int]]:
    """The lines of the project's own code that ``fn`` executes, in order."""
    lines: list[tuple[str, int]] = []

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        if not frame.f_code.co_filename.startswith(roots):
            return None
        if event == "line":
            lines.append((Path(frame.f_code.co_filename).name, frame.f_lineno))
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return lines


def peak_allocation(fn: Callable[[], object]) -> int:
    """The peak of the memory ``fn`` allocates through Python's and numpy's allocators (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class _OpLog(TorchDispatchMode):
    """Every torch operator run under it, with its tensor arguments' shapes and dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[tuple[int, ...], str], ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves, _ = tree_flatten((args, kwargs or {}))
        shapes = tuple((tuple(t.shape), str(t.dtype)) for t in leaves if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def torch_ops(fn: Callable[[], object]) -> list[tuple[str, tuple[tuple[tuple[int, ...], str], ...]]]:
    """The torch operators ``fn`` runs, in order, with their arguments' shapes and dtypes."""
    log = _OpLog()
    with log:
        fn()
    return log.ops


def witness(fn: Callable[[], object]) -> tuple[list[tuple[str, int]], int, list[Any]]:
    """The three witnesses of ``fn``'s work, after warm-up runs (first imports and caches are not its work)."""
    for _ in range(2):
        fn()
    return traced_lines(fn), peak_allocation(fn), torch_ops(fn)


def release_witness(agent: Agent, state: AgentState, request: wire.GradientRequest) -> Any:
    def run() -> None:
        agent.release(request, agent.contributions(request), state)

    return witness(run)


def assert_same_work(a: Any, b: Any) -> None:
    lines_a, peak_a, ops_a = a
    lines_b, peak_b, ops_b = b
    assert len(lines_a) == len(lines_b), (len(lines_a), len(lines_b))
    assert lines_a == lines_b
    assert len(ops_a) == len(ops_b), (len(ops_a), len(ops_b))
    assert ops_a == ops_b
    # The same arrays are allocated; allow 16 KiB (5% of one copy of the rows) for small Python
    # objects whose lifetimes differ from run to run.
    assert abs(peak_a - peak_b) <= 16 * 1024, (peak_a, peak_b)


@pytest.mark.parametrize(
    ("filter_kind", "l2_clip", "noise_std"),
    # Record norms are about 7. At sigma 100 the partial clip sigma sqrt(T - S) is above them (only
    # stopped units and the ten near their end are scaled); at sigma 1 every row is clipped.
    [("gdp", 100.0, 100.0), ("renyi", 100.0, 100.0), ("gdp", 0.05, 1.0)],
)
def test_release_work_does_not_depend_on_who_stopped(
    tmp_path: Path, filter_kind: str, l2_clip: float, noise_std: float
) -> None:
    agent = make_agent(tmp_path, *data(), filter=filter_kind)
    request = decoded_request(l2_clip, noise_std)
    fresh = AgentState.from_arrays(agent.ledger.state())
    assert agent.gaussian is not None
    threshold = agent.gaussian.threshold
    rng = np.random.default_rng(5)
    states = []
    for stopped_fraction in (0.0, 0.5, 1.0):
        stopped = rng.random(N) < stopped_fraction
        spent = np.where(stopped, threshold, rng.random(N) * threshold * 0.5)
        # A unit near its end: partial clipping shrinks it, so clipped rows differ as well.
        spent[:10] = np.where(stopped[:10], threshold, threshold * 0.999)
        states.append(replace(fresh, spent=spent, stopped=stopped))
    witnesses = [release_witness(agent, s, request) for s in states]
    for other in witnesses[1:]:
        assert_same_work(witnesses[0], other)
    agent.close()


def test_release_work_does_not_depend_on_unusable_records(tmp_path: Path) -> None:
    x, y = data()
    request = decoded_request()
    witnesses = []
    for case in ("usable", "label", "nonfinite"):
        xc, yc = x.copy(), y.copy()
        if case == "label":
            yc[::7] = 5  # outside the coordinator's 2 classes: the null element
        elif case == "nonfinite":
            xc[::11, 3] = np.inf
        folder = tmp_path / case
        folder.mkdir()
        agent = make_agent(folder, xc, yc)
        witnesses.append(release_witness(agent, AgentState.from_arrays(agent.ledger.state()), request))
        agent.close()
    for other in witnesses[1:]:
        assert_same_work(witnesses[0], other)


def test_realisation_release_work_does_not_depend_on_acceptance(tmp_path: Path) -> None:
    x, y = data()
    agent = make_agent(
        tmp_path,
        x,
        y,
        filter="realisation",
        unit="client",
        epsilon=5.0,
        **{"realisation-max-rounds": 8, "policy-max-clip": 1.0, "policy-min-noise-std": 1.0},
    )
    request = decoded_request(unit="client")
    fresh = AgentState.from_arrays(agent.ledger.state())
    stopped = replace(fresh, accepting=np.zeros(1, dtype=np.bool_), loss=np.array([3.0]))
    assert_same_work(release_witness(agent, fresh, request), release_witness(agent, stopped, request))
    agent.close()


def test_witness_sees_a_loop_over_the_stopped_set() -> None:
    """The witness has power: a kernel that touches only the rows it scales, as the old one did, is caught."""
    rows = np.ones((64, 8), np.float32)

    def old_kernel(stopped: np.ndarray) -> Callable[[], object]:
        def run() -> object:
            scales = np.where(stopped, 0.0, 1.0).astype(np.float32)
            shrink = np.flatnonzero(scales != 1.0)
            for start in range(0, shrink.size, 16):
                idx = shrink[start : start + 16]
                rows[idx] *= scales[idx, None]
            return rows

        return run

    here = (str(Path(__file__).resolve()),)
    none = traced_lines(old_kernel(np.zeros(64, dtype=np.bool_)), roots=here)
    half = traced_lines(old_kernel(np.arange(64) % 2 == 0), roots=here)
    assert none != half


def test_op_witness_sees_a_pass_that_skips_stopped_records() -> None:
    """The operator witness has power: a weighted pass over the admitted records only is caught."""
    from client_agent.streaming import ArraySource, weighted_gradient_sum

    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype(np.float32), rng.integers(0, 2, 16)
    loss = torch.nn.CrossEntropyLoss(reduction="none")

    def skipping(weights: np.ndarray) -> Callable[[], object]:
        def run() -> object:
            keep = np.flatnonzero(weights)  # a branch on who is admitted
            return weighted_gradient_sum(model, loss, ArraySource(x[keep], y[keep]), weights[keep], chunk_size=8)

        return run

    def uniform(weights: np.ndarray) -> Callable[[], object]:
        return lambda: weighted_gradient_sum(model, loss, ArraySource(x, y), weights, chunk_size=8)

    some, half = np.ones(16), np.where(np.arange(16) % 2 == 0, 1.0, 0.0)
    assert torch_ops(skipping(some)) != torch_ops(skipping(half))
    assert torch_ops(uniform(some)) == torch_ops(uniform(half))


class _Scale(torch.nn.Module):
    """A custom leaf with its own parameter (the torch.func path of the fused pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.alpha)


class _Tempered(torch.nn.Module):
    """A parameter the hooks cannot see: the whole-model fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
        self.temperature = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.temperature


class _Tokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, padding_idx=0)
        self.seq = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.seq(self.emb(x))).mean(dim=1))


def _fused_models() -> dict[str, tuple[torch.nn.Module, np.ndarray]]:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    convs = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.GroupNorm(2, 4),
        torch.nn.ReLU(),
        torch.nn.Conv2d(4, 16, 3, stride=2),  # one output position
        torch.nn.Flatten(),
        torch.nn.Unflatten(1, (4, 4)),
        torch.nn.Conv1d(4, 4, 2),
        torch.nn.Flatten(),
        torch.nn.Linear(12, 4),
        _Scale(),
        torch.nn.Linear(4, 3),
    )
    return {
        "convs": (convs, rng.normal(size=(16, 1, 4, 4)).astype(np.float32)),
        "tokens": (_Tokens(), rng.integers(0, 20, size=(16, 5))),
        "fallback": (_Tempered(), rng.normal(size=(16, 4, 4)).astype(np.float32)),
    }


def _fused_run(model: torch.nn.Module, x: np.ndarray, stopped: np.ndarray) -> Callable[[], object]:
    from client_agent.streaming import ArraySource, fused_clipped_sum

    y = np.arange(len(x)) % 3
    loss = torch.nn.CrossEntropyLoss(reduction="none")

    def weights(start: int, norms: np.ndarray) -> np.ndarray:
        scale = np.minimum(1.0, 0.5 / np.where(norms > 0, norms, 1.0))  # partial clipping: from the norm
        return np.where(stopped[start : start + norms.size], 0.0, scale)

    return lambda: fused_clipped_sum(model, loss, ArraySource(x, y), weights, chunk_size=8)


@pytest.mark.parametrize("name", ["convs", "tokens", "fallback"])
def test_fused_pass_work_does_not_depend_on_who_stopped(name: str) -> None:
    model, x = _fused_models()[name]
    n = len(x)
    patterns = [np.zeros(n, dtype=np.bool_), np.arange(n) % 2 == 0, np.ones(n, dtype=np.bool_)]
    witnesses = [witness(_fused_run(model, x, stopped)) for stopped in patterns]
    for other in witnesses[1:]:
        assert_same_work(witnesses[0], other)


def test_op_witness_sees_a_fused_pass_that_skips_stopped_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator witness has power over the fused pass: layer sums over the admitted records only are caught."""
    from client_agent.layers import linear

    model, x = _fused_models()["convs"]
    none, half = np.zeros(len(x), dtype=np.bool_), np.arange(len(x)) % 2 == 0
    assert torch_ops(_fused_run(model, x, none)) == torch_ops(_fused_run(model, x, half))
    real = linear.OuterRows.add

    def skipping(self: Any, wk: torch.Tensor, keep: torch.Tensor, view: Callable[[str], torch.Tensor]) -> None:
        idx = torch.nonzero(keep).reshape(-1)  # a branch on who is admitted: select them
        real(linear.OuterRows(self.a[idx], self.g[idx], self.names), wk[idx], keep[idx], view)

    monkeypatch.setattr(linear.OuterRows, "add", skipping)
    assert torch_ops(_fused_run(model, x, none)) != torch_ops(_fused_run(model, x, half))


def test_op_witness_sees_a_rows_sum_that_skips_stopped_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same power over the per-record rows (convolutions, GroupNorm, a custom leaf): summing only the
    admitted records' rows is caught."""
    from client_agent.layers import base

    model, x = _fused_models()["convs"]
    none, half = np.zeros(len(x), dtype=np.bool_), np.arange(len(x)) % 2 == 0
    real = base.DenseRows.add

    def skipping(self: Any, wk: torch.Tensor, keep: torch.Tensor, view: Callable[[str], torch.Tensor]) -> None:
        idx = torch.nonzero(keep).reshape(-1)  # a branch on who is admitted: select them
        picked = base.DenseRows({k: t[idx] for k, t in self.tensors.items()}, self.to_param, self.index)
        real(picked, wk[idx], keep[idx], view)

    monkeypatch.setattr(base.DenseRows, "add", skipping)
    assert torch_ops(_fused_run(model, x, none)) != torch_ops(_fused_run(model, x, half))
