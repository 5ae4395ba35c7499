"""The streaming per-record gradient engine against the slow materialising path (client_agent.gradients).

Each path of the hooks (outer products for Linear on 2-D inputs; per-record rows for Linear on
sequences, Conv1d/Conv2d with strides, dilations and padding, Embedding with repeated tokens and a
padding index; the torch.func rows for LayerNorm, GroupNorm and a custom leaf; the whole-model
fallback) is checked against ``per_example_gradients`` (vmap(grad), one row per
record): norms and clipped sums to 1e-5 relative, and the observed norm error far below the
declared NORM_REL_ERROR. The fused pass (``fused_clipped_sum``: norms, weights and the weighted sum
from one forward and one backward) is checked on every case against the same loop and against the
two-pass sum, with weights that depend on each record's norm (partial clipping) and stopped records.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from client_agent import streaming
from client_agent.gradients import per_example_gradients
from client_agent.layers import conv
from client_agent.records import GaussianRecord
from client_agent.state import AgentState
from client_agent.streaming import (
    NORM_REL_ERROR,
    ArraySource,
    NonFiniteSumError,
    RowContributions,
    StreamedGradients,
    fused_clipped_sum,
    record_norms,
    weighted_gradient_sum,
)
from workloads.models import build_model

LOSS = functools.partial(F.cross_entropy, reduction="none")
ROOT = Path(__file__).resolve().parents[2]


class Affine(nn.Module):
    """A custom leaf with its own parameters: the torch.func (vmap over vjp) path."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.linspace(0.5, 1.5, k))
        self.beta = nn.Parameter(torch.linspace(-0.2, 0.2, k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.alpha + self.beta)


class Tokens(nn.Module):
    """Embedding -> sequence Linear -> LayerNorm -> mean over positions -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=1)  # T = 12 positions, repeated tokens
        self.emb_small = nn.Embedding(5, 4)
        self.seq_a = nn.Linear(12, 16)
        self.seq_b = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.emb(x), self.emb_small(x % 5)], dim=-1)
        h = self.norm(self.seq_b(torch.relu(self.seq_a(h))))
        return self.head(h.mean(dim=1))


class Convs(nn.Module):
    """Conv2d, GroupNorm, Conv1d (strides, dilations, padding), a custom leaf, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.c2 = nn.Conv2d(8, 32, 3, stride=2)
        self.c3 = nn.Conv1d(32, 32, 3, stride=1, dilation=2, padding=1)
        self.c4 = nn.Conv1d(32, 2, 2, stride=2, dilation=2, padding=2)
        self.c5 = nn.Conv1d(32, 2, 2, dilation=3, padding=1)
        self.act = Affine(2)
        self.head = nn.Linear(2 * (5 + 6), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.gn(self.c1(x)))
        h = torch.relu(self.c2(h))  # (b, 32, 3, 3)
        h = self.c3(h.flatten(2))  # (b, 32, 7)
        h = torch.cat([self.c4(h), self.c5(h)], dim=2)  # (b, 2, 5 + 6)
        h = self.act(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h.flatten(1))


class Tempered(nn.Module):
    """A parameter owned by a module with children: the hooks cannot see it, the whole-model fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.temperature


class Borrowing(nn.Module):
    """A leaf that reads another module's weight: seen by the first-chunk check, the fallback."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(3))
        object.__setattr__(self, "other", other)  # not registered: the hooks do not know

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.other.weight) + self.bias


class Borrower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.tied = Borrowing(self.lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.tied(torch.sin(x))


def _cases() -> dict[str, tuple[nn.Module, np.ndarray, np.ndarray, str]]:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    n = 13
    ln_mlp = nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3))
    tokens = rng.integers(0, 20, size=(n, 12))
    tokens[:, -2:] = 1  # padding positions get no embedding gradient
    return {
        "mlp+layernorm": (ln_mlp, rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, n), "rows"),
        "tokens": (Tokens(), tokens, rng.integers(0, 3, n), "rows"),
        "convs": (Convs(), rng.normal(size=(n, 2, 8, 8)).astype(np.float32), rng.integers(0, 3, n), "rows"),
        "mnist-cnn": (
            build_model("opacus_mnist_cnn", seed=0),
            rng.normal(size=(n, 1, 28, 28)).astype(np.float32),
            rng.integers(0, 10, n),
            "rows",
        ),
        "fallback": (Tempered(), rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, n), "rows"),
        "borrowed": (Borrower(), rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, n), "direct"),
    }


CASES = _cases()


def reference_rows(model: nn.Module, x: np.ndarray, y: np.ndarray) -> torch.Tensor:
    return per_example_gradients(model, LOSS, torch.from_numpy(x), torch.from_numpy(y)).double()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("case", sorted(CASES))
def test_norms_and_clipped_sum_match_the_per_example_loop(case: str) -> None:
    model, x, y, method = CASES[case]
    rows = reference_rows(model, x, y)
    want = rows.norm(dim=1).numpy()
    got, used = record_norms(model, LOSS, ArraySource(x, y), chunk_size=5)
    assert used == method
    errors = np.abs(got - want) / want
    assert errors.max() <= 1e-5  # two float32 computations of the same gradient (the norm's own error: test_isolation)
    scales = np.minimum(1.0, 0.5 * np.median(want) / want)  # about half the records clipped
    total = weighted_gradient_sum(model, LOSS, ArraySource(x, y), scales, chunk_size=5)
    assert rel(total, (rows * torch.from_numpy(scales)[:, None]).sum(0).numpy()) <= 1e-5


def clipping_weights(
    bound: float, stopped: np.ndarray, seen: list[tuple[int, int]] | None = None
) -> Callable[[int, np.ndarray], np.ndarray]:
    """Partial clipping's weights: min(1, bound / norm) from each record's own norm, 0 for a stopped record."""

    def weights(start: int, norms: np.ndarray) -> np.ndarray:
        if seen is not None:
            seen.append((start, norms.size))
        scale = np.minimum(1.0, bound / np.where(norms > 0, norms, 1.0))
        return np.where(stopped[start : start + norms.size], 0.0, scale)

    return weights


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fused_pass_matches_the_per_example_loop_and_the_two_pass_sum(case: str) -> None:
    model, x, y, method = CASES[case]
    rows = reference_rows(model, x, y)
    want = rows.norm(dim=1).numpy()
    stopped = np.arange(len(x)) % 4 == 1
    seen: list[tuple[int, int]] = []
    weights = clipping_weights(float(np.median(want)), stopped, seen)  # about half clipped
    norms, total, used = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights, chunk_size=5)
    assert used == method
    # Every record asked once, in order, in consecutive runs (chunks, or the fallback's sub-batches).
    assert [start for start, _ in seen] == list(np.cumsum([0] + [size for _, size in seen])[:-1])
    assert sum(size for _, size in seen) == len(x)
    # The same norms as the norms-only pass (the same operations on the same (a, g)).
    np.testing.assert_array_equal(norms, record_norms(model, LOSS, ArraySource(x, y), chunk_size=5)[0])
    assert np.max(np.abs(norms - want) / want) <= 1e-6  # against another float32 computation of the gradient
    w = weights(0, norms)
    assert np.all(w[stopped] == 0.0) and np.any((w > 0.0) & (w < 1.0)) and np.any(w == 1.0)
    assert rel(total, (rows * torch.from_numpy(w)[:, None]).sum(0).numpy()) <= 1e-5
    two_pass = weighted_gradient_sum(model, LOSS, ArraySource(x, y), w, chunk_size=5)
    assert rel(total, two_pass) <= 1e-5


@pytest.mark.parametrize("case", ["convs", "tokens", "mnist-cnn"])
def test_the_fused_pass_does_not_depend_on_chunks_or_blocks(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, y, _ = CASES[case]
    weights = clipping_weights(0.1, np.arange(len(x)) % 3 == 0)
    base_n, base_s, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights, chunk_size=len(x))
    for chunk, block in ((1, 1 << 19), (4, 1), (7, 1000)):
        monkeypatch.setattr(conv, "_BLOCK_FLOATS", block)  # 1: one record per block of the conv rows
        monkeypatch.setattr(streaming, "_EXPLICIT_FLOATS", block * 64)  # small: many blocks of rows a chunk
        n, total, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights, chunk_size=chunk)
        np.testing.assert_allclose(n, base_n, rtol=1e-6)
        assert rel(total, base_s) <= 1e-6


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize(("pad", "stride", "dilation"), [((0, 0), (2, 2), (1, 1)), ((3, 1), (1, 2), (2, 1))])
def test_conv_patches_are_the_unfolded_input_in_either_layout(
    layout: torch.memory_format, pad: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]
) -> None:
    """``patches`` skips its channels-last copy for a channels-last input and its pad without padding;
    every branch (and a slice of a batch, as the blocks take) gives F.unfold's patches, (kernel, channel)
    reordered."""
    a = torch.randn(7, 3, 11, 9, generator=torch.Generator().manual_seed(2)).contiguous(memory_format=layout)
    k = (3, 2)
    for part in (a, a[2:5]):
        got = conv.patches(part, k, dilation, pad, stride)
        want = F.unfold(part, k, dilation=dilation, padding=pad, stride=stride)  # (b, C k, L), C outermost
        want = want.reshape(len(part), 3, k[0] * k[1], -1).permute(0, 3, 2, 1).reshape(len(part), -1, 3 * k[0] * k[1])
        assert torch.equal(got, want)


def test_the_fused_pass_gives_stopped_records_exact_zeros_whatever_their_data() -> None:
    model, x, y, _ = CASES["convs"]
    stopped = np.zeros(len(x), dtype=np.bool_)
    stopped[[0, 3, 8]] = True
    weights = clipping_weights(0.2, stopped)
    _, total, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights, chunk_size=5)
    x2, y2 = x.copy(), y.copy()
    x2[stopped] = np.random.default_rng(9).normal(size=x2[stopped].shape) * 100
    y2[stopped] = (y2[stopped] + 1) % 3
    _, total2, _ = fused_clipped_sum(model, LOSS, ArraySource(x2, y2), weights, chunk_size=5)
    assert np.array_equal(total2, total)
    keep = np.flatnonzero(~stopped)
    rows = reference_rows(model, x[keep], y[keep])
    w = np.minimum(1.0, 0.2 / rows.norm(dim=1).numpy())
    assert rel(total, (rows * torch.from_numpy(w)[:, None]).sum(0).numpy()) <= 1e-5


def test_the_fused_pass_null_records_and_overflow_contribute_exactly_zero() -> None:
    model, x, y, _ = CASES["mlp+layernorm"]
    x, y = x.copy(), y.copy()
    x[2, 1] = np.nan
    y[5] = 7  # not a class of this 3-class model

    def valid(xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        return (yt >= 0) & (yt < 3)

    def ones(start: int, norms: np.ndarray) -> np.ndarray:
        return np.ones(norms.size)  # even for the null records: the engine keeps them zero

    norms, total, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), ones, valid=valid, chunk_size=4)
    assert norms[2] == 0.0 and norms[5] == 0.0 and np.all(np.delete(norms, [2, 5]) > 0)
    keep = np.delete(np.arange(len(x)), [2, 5])
    assert np.isfinite(total).all() and rel(total, reference_rows(model, x[keep], y[keep]).sum(0).numpy()) <= 1e-5

    lin, x, y = overflow_case()
    norms, total, _ = fused_clipped_sum(lin, LOSS, ArraySource(x, y), ones, chunk_size=4)
    assert not np.isfinite(norms[4]) and np.isfinite(np.delete(norms, 4)).all()
    keep = np.delete(np.arange(9), 4)
    assert np.isfinite(total).all() and rel(total, reference_rows(lin, x[keep], y[keep]).sum(0).numpy()) <= 1e-5


def test_the_fused_pass_refuses_a_non_finite_null_element_and_bad_weights() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    x, y = np.ones((4, 3), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="weights: expected 4 finite values"):
        fused_clipped_sum(model, LOSS, ArraySource(x, y), lambda start, norms: np.full(norms.size, np.nan))
    with torch.no_grad():
        model[0].bias[0] = float("inf")
    with pytest.raises(NonFiniteSumError, match="null element"):
        fused_clipped_sum(model, LOSS, ArraySource(x, y), lambda start, norms: np.ones(norms.size))


def test_the_fused_release_charges_what_it_sums(tmp_path: Path) -> None:
    """Agent.release on streamed gradients (fused) against the same release on the materialised rows."""
    from protocol import messages as wire
    from tests.factories import build_agent

    rng = np.random.default_rng(4)
    n, features = 40, 6
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    x[7, 1], y[9] = np.nan, 5  # null records
    agent = build_agent(tmp_path, (x, y), trust="central")
    args = f'{{"in_features": {features}, "n_classes": 2}}'
    params = rng.normal(size=features * 2 + 2).astype(np.float32)
    request = wire.GradientRequest("r1", "run", 1, 0.4, 0.3, "central", "record", "logreg", args, params)
    assert agent.gaussian is not None
    threshold = agent.gaussian.threshold
    state = AgentState.from_arrays(agent.ledger.state())
    spent = rng.random(n) * threshold * 0.5
    spent[:12] = threshold * (1 - rng.random(12) * 1e-3)  # near the end: partial clips below the norms
    stopped = np.arange(n) % 5 == 0
    state = replace(state, spent=np.where(stopped, threshold, spent), stopped=stopped)
    streamed = agent.contributions(request)
    assert isinstance(streamed, StreamedGradients)
    reply, new_state, release, _ = agent.release(request, streamed, state)
    from client_agent.workloads import gradient_rows

    rows = gradient_rows(request, x, y, unit="record")
    reply_rows, state_rows, release_rows, _ = agent.release(request, rows, state)
    assert isinstance(release, GaussianRecord) and isinstance(release_rows, GaussianRecord)
    assert new_state.spent is not None and new_state.stopped is not None
    charged = release.l2_norms > 0
    assert np.array_equal(charged, release_rows.l2_norms > 0)
    assert not charged[stopped].any() and not charged[[7, 9]].any()
    assert charged.sum() >= n // 2
    partial = charged & (release.l2_norms < 0.3 * 0.99)
    assert partial[:12].any()  # some units spent their exact remainder
    np.testing.assert_allclose(release.l2_norms, release_rows.l2_norms, rtol=2 * NORM_REL_ERROR)
    assert np.all(new_state.spent <= threshold) and np.array_equal(new_state.stopped, state_rows.stopped)
    assert rel(reply.total.astype(np.float64), reply_rows.total.astype(np.float64)) <= 1e-4
    agent.close()


def test_the_charge_is_never_below_the_clipped_norm() -> None:
    model, x, y, _ = CASES["convs"]
    rows = reference_rows(model, x, y)
    units = StreamedGradients(model, LOSS, ArraySource(x, y), chunk_size=4)
    norms = units.norms()
    scales = np.minimum(1.0, 0.3 * np.median(norms) / norms)
    charged = units.scale(scales)
    true = (rows * torch.from_numpy(scales)[:, None]).norm(dim=1).numpy()
    assert np.all(charged >= true) and np.all(charged <= true * (1 + 2 * NORM_REL_ERROR))


def test_chunk_size_does_not_change_results() -> None:
    model, x, y, _ = CASES["tokens"]
    w = np.linspace(0.0, 1.0, len(x))
    base_n, _ = record_norms(model, LOSS, ArraySource(x, y), chunk_size=len(x))
    base_s = weighted_gradient_sum(model, LOSS, ArraySource(x, y), w, chunk_size=len(x))
    for chunk in (1, 4, 7):
        n, _ = record_norms(model, LOSS, ArraySource(x, y), chunk_size=chunk)
        np.testing.assert_allclose(n, base_n, rtol=1e-6)
        assert rel(weighted_gradient_sum(model, LOSS, ArraySource(x, y), w, chunk_size=chunk), base_s) <= 1e-6


def test_the_engine_keeps_a_channels_last_model_in_its_layout_and_gives_the_nchw_values() -> None:
    """The built-in MNIST CNN is channels-last with exact strides (a one-channel weight too, else the first
    convolution picks the slow NCHW kernels); the engine's parameters and the agent's fresh, loaded copy keep
    that layout; norms and clipped sum equal the NCHW model's and the per-example loop's (float32 rounding)."""
    from client_agent.isolation import PerRecord
    from client_agent.model_cache import ModelCache
    from workloads.builtin import BUILTIN
    from workloads.models import flatten_parameters, load_flat_parameters

    model = build_model("opacus_mnist_cnn", seed=0)  # Conv2d(1, 16, 8) and Conv2d(16, 32, 4), max pooling
    convs = ("0.weight", "3.weight")
    last = {n: torch.empty_like(model.get_parameter(n), memory_format=torch.channels_last).stride() for n in convs}
    assert all(model.get_parameter(n).stride() == last[n] for n in convs)
    fresh = ModelCache().fresh(BUILTIN, "opacus_mnist_cnn", "{}")  # as the agent builds a request's model
    load_flat_parameters(fresh, flatten_parameters(model))
    engine = PerRecord(fresh, LOSS, torch.device("cpu"))
    assert all(engine.params[n].stride() == last[n] for n in convs)
    nchw = copy.deepcopy(model).to(memory_format=torch.contiguous_format)
    assert nchw.get_parameter("0.weight").stride() != last["0.weight"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), nchw.parameters(), strict=True))

    def weights(start: int, norms: np.ndarray) -> np.ndarray:  # partial clipping: weights depend on the norm
        return np.minimum(1.0, 0.5 / np.maximum(norms, 1e-12))

    x = torch.randn(40, 1, 28, 28, generator=torch.Generator().manual_seed(3)).numpy()
    y = np.arange(40) % 10
    norms, total, _ = fused_clipped_sum(fresh, LOSS, ArraySource(x, y), weights)
    nchw_norms, nchw_total, _ = fused_clipped_sum(nchw, LOSS, ArraySource(x, y), weights)
    np.testing.assert_allclose(norms, nchw_norms, rtol=1e-5)
    assert rel(total, nchw_total) <= 1e-5
    rows = per_example_gradients(nchw, LOSS, torch.from_numpy(x), torch.from_numpy(y)).double().numpy()
    np.testing.assert_allclose(norms, np.linalg.norm(rows, axis=1), rtol=1e-5)
    assert rel(total, weights(0, norms) @ rows) <= 1e-5


def test_a_gpus_run_lengths_give_the_cpus_norms_and_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the float64 runs and the conv blocks are long (few launches a request); forced on the CPU
    they give the same norms (bit for bit at these shapes; in general to float64 rounding, torch may split
    a long row's reduction differently) and the same sum to float64 rounding: the run length orders float64
    roundings only, and a record's row and norm are its own whatever run it is in."""
    from client_agent.layers import base

    assert base.sum_records(torch.empty(300, 26_010)) == base._SUM_RECORDS  # a CPU: a run that stays in cache
    on_gpu = base.sum_records(torch.empty(300, 26_010, device="meta"))  # any other device: by floats
    assert on_gpu == base._DEVICE_SUM_FLOATS // 26_010 == 645
    assert base.sum_records(torch.empty(3, 1 << 26, device="meta")) == 1  # a row over the cap: one at a time
    # The first convolution of the MNIST CNN (8x8 kernel, 1 channel in, 16 out, 14x14 positions).
    assert conv.block_records(torch.device("cpu"), 64, 196, 16) == (1 << 19) // (64 * 212) == 38
    assert conv.block_records(torch.device("meta"), 64, 196, 16) == (1 << 25) // (64 * 212) == 2473
    assert conv.block_records(torch.device("meta"), 1 << 20, 1 << 10, 16) == 1

    model = build_model("opacus_mnist_cnn", seed=0)
    x = torch.randn(300, 1, 28, 28, generator=torch.Generator().manual_seed(5)).numpy()
    y = np.arange(300) % 10

    def weights(start: int, norms: np.ndarray) -> np.ndarray:
        return np.minimum(1.0, 0.5 / np.maximum(norms, 1e-12))

    norms, total, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights)
    real, runs = base.sum_records, []

    def gpu_runs(t: torch.Tensor) -> int:  # the GPU's run lengths, here
        runs.append(real(t.to("meta")))
        return runs[-1]

    monkeypatch.setattr(base, "sum_records", gpu_runs)
    real_block, blocks = conv.block_records, []

    def gpu_blocks(device: torch.device, inputs: int, positions: int, c_out: int) -> int:
        blocks.append(real_block(torch.device("meta"), inputs, positions, c_out))
        return blocks[-1]

    monkeypatch.setattr(conv, "block_records", gpu_blocks)
    long_norms, long_total, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights)
    assert runs and min(runs) >= 300 and blocks and min(blocks) >= 300  # every layer's rows in one run, one block
    np.testing.assert_array_equal(long_norms, norms)
    assert rel(long_total, total) <= 1e-14


def test_a_gpus_blocks_and_chunks_give_the_cpus_norms_and_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a chunk of records is one block of rows (a block costs launches and a host round trip whatever
    its size); on a CPU blocks stay at 128 MiB of rows. The sizes come from the device, the model's shape and
    the owner's activation budget only, and forced on the CPU the GPU's sizes give the same norms and sum: a
    record's rows are its own whatever block it is in, the block orders the float64 roundings only."""
    from client_agent import isolation, workloads
    from client_agent.streaming import chunk_for_budget
    from protocol import messages as wire

    # The MNIST CNN's rows: 17,860 floats a record (its tapped layers' rows, inputs and outputs).
    assert streaming.block_records(torch.device("cpu"), 17_860) == (1 << 25) // 17_860 == 1_878
    assert streaming.block_records(torch.device("meta"), 17_860) == (1 << 27) // 17_860 == 7_514
    assert streaming.block_records(torch.device("meta"), 1 << 30) == 1  # a row over the cap: one at a time
    # The chunk the agent's record-unit pass reads, by device (a CUDA device, named without touching one).
    request = wire.GradientRequest(
        "r", "run", 1, 1.0, 0.5, "local", "record", "logreg", '{"in_features": 5, "n_classes": 3}',
        np.zeros(18, dtype=np.float32),
    )  # fmt: skip
    source = ArraySource(np.zeros((3, 5), dtype=np.float32), np.zeros(3, dtype=np.int64))
    on = {d: workloads.gradient_contributions(request, source, unit="record", device=d) for d in ("cpu", "cuda")}
    assert [on[d].chunk_size for d in ("cpu", "cuda")] == [workloads.CHUNK_RECORDS, workloads.DEVICE_CHUNK_RECORDS]
    assert (workloads.CHUNK_RECORDS, workloads.DEVICE_CHUNK_RECORDS) == (1024, 8192)

    model = build_model("opacus_mnist_cnn", seed=0)
    n = 6_000  # a campaign client
    x = torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(6)).numpy()
    y = np.arange(n) % 10
    x[5] = np.nan  # a null record
    # The agent's chunk at the default policy-max-activation-mb (2048): 211,756 bytes of activations for two
    # records, as activation_bytes counts them on the meta device (checked here: 4 copies of half of it a
    # record), and a record's copies: 784 float32 features and an int64 label, 2 copies as the source holds
    # them and 3 converted (SOURCE_COPIES, CONVERTED_COPIES).
    two = torch.from_numpy(x[:2].copy()), torch.from_numpy(y[:2].copy())
    assert streaming.activation_bytes(model, LOSS, *two) == 211_756
    budget = 2048 << 20
    per_record = 4 * 211_756 // 2 + 784 * (2 * 4 + 3 * 4) + (2 * 8 + 3 * 8)
    cpu_chunk = chunk_for_budget(model, LOSS, ArraySource(x, y), budget_bytes=budget, most=workloads.CHUNK_RECORDS)
    gpu_chunk = chunk_for_budget(
        model, LOSS, ArraySource(x, y), budget_bytes=budget, most=workloads.DEVICE_CHUNK_RECORDS
    )
    assert (cpu_chunk, gpu_chunk) == (1_024, budget // per_record) == (1_024, 4_889)

    def weights(start: int, norms: np.ndarray) -> np.ndarray:
        return np.minimum(1.0, 0.5 / np.maximum(norms, 1e-12))

    real_rows, blocks = isolation.PerRecord.rows, []

    def counted(self: isolation.PerRecord, xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor) -> Any:
        blocks.append(xb.shape[0])
        return real_rows(self, xb, yb, wb)

    real_decide, decided = isolation.PerRecord.decide, []

    def decide(self: isolation.PerRecord, xd: torch.Tensor, yd: torch.Tensor, **kw: Any) -> Any:
        decided.append(xd.untyped_storage().nbytes())
        return real_decide(self, xd, yd, **kw)

    monkeypatch.setattr(isolation.PerRecord, "rows", counted)
    monkeypatch.setattr(isolation.PerRecord, "decide", decide)
    norms, total, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights, chunk_size=cpu_chunk)
    assert decided == [784 * 4]  # one record's storage, not a view keeping the chunk alive for the pass
    # The plan's check on synthetic records first, then a block a chunk, each under a CPU block (1,878).
    assert blocks == [isolation.SYNTHETIC] + [1_024] * 5 + [880]
    blocks.clear()
    real_block = streaming.block_records
    monkeypatch.setattr(streaming, "block_records", lambda device, row: real_block(torch.device("meta"), row))
    gpu_norms, gpu_total, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights, chunk_size=gpu_chunk)
    assert blocks == [isolation.SYNTHETIC, 4_889, 1_111]  # a GPU block a chunk: two, not six
    assert norms[5] == gpu_norms[5] == 0.0
    np.testing.assert_allclose(gpu_norms, norms, rtol=streaming.NORM_REL_ERROR)
    assert rel(gpu_total, total) <= 1e-12  # the float64 sums' order only (9e-16 seen)


class _FoldedConv(nn.Module):
    """A record of 8 patches (8, 16, 3, 3), folded into a wide convolution's batch: 8 weight rows of 2,320
    floats a record, summed, against 1,280 floats of the record's own input and output there."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        h = torch.relu(self.conv(x.reshape(b * 8, 16, 3, 3)))
        return self.head(h.reshape(b, 8, 16).sum(dim=1))


def test_a_records_folded_conv_rows_are_counted_before_they_are_summed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: a record that folds items into a convolution's batch forms one weight row per item
    before summing them, and the blocks were sized to one row a record (a model of the coordinator's choice
    could then take many times the block's memory). The block now counts every item's row, and the rows the
    pass forms stay within it."""
    from client_agent.isolation import PerRecord

    torch.manual_seed(0)
    model = _FoldedConv()
    x = torch.randn(30, 8, 16, 3, 3, generator=torch.Generator().manual_seed(1)).numpy()
    y = np.arange(30) % 3
    engine = PerRecord(model, LOSS, torch.device("cpu"))
    engine.decide(torch.from_numpy(x[:2]), torch.from_numpy(y[:2]))
    (tapped,) = [t for t in engine.plan.tapped if t.name == "conv"]  # type: ignore[union-attr]
    assert tapped.in_shape == (8, 16, 3, 3)
    assert conv.KIND.row_floats(tapped.module, tapped.in_shape) == 8 * (16 * 16 * 9 + 16)
    assert conv.KIND.row_floats(nn.Conv2d(16, 16, 3), (1, 16, 3, 3)) == 16 * 16 * 9 + 16  # one item: one row

    cap = 3 * engine.row_floats()  # three records a block
    monkeypatch.setattr(streaming, "_EXPLICIT_FLOATS", cap)
    formed: list[int] = []
    real_rows = conv.ConvKind.rows

    def spy(self: conv.ConvKind, m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> Any:
        formed.append(a.shape[0] * a.shape[1] * g.shape[2] * a.shape[2] * 9)  # B x per x c_out x (C k k)
        return real_rows(self, m, a, g)

    monkeypatch.setattr(conv.ConvKind, "rows", spy)
    weights = clipping_weights(0.5, np.zeros(30, dtype=bool))
    norms, total, _ = fused_clipped_sum(model, LOSS, ArraySource(x, y), weights)
    assert formed and max(formed) <= cap  # before the fix: 5x the rows the block was sized for
    rows = reference_rows(model, x, y).numpy()
    np.testing.assert_allclose(norms, np.linalg.norm(rows, axis=1), rtol=1e-5)
    assert rel(total, weights(0, norms) @ rows) <= 1e-5


@pytest.mark.parametrize(("dtype", "want"), [(np.float32, 4), (np.float64, 3)])
def test_a_chunk_counts_its_records_own_bytes_not_only_the_models_activations(dtype: type, want: int) -> None:
    """Review finding: a model that pools its input first measures almost no activations, and on a GPU a chunk
    of 8,192 records of 3 x 512 x 512 would hold 24 GiB of inputs per copy, outside policy-max-activation-mb.
    The chunk now pays for each record's copies as well: SOURCE_COPIES in the source's dtype (a float64 source
    costs more), CONVERTED_COPIES as the pass converts them (float32 features, int64 labels)."""
    from client_agent.streaming import (
        ACTIVATION_COPIES,
        CONVERTED_COPIES,
        SOURCE_COPIES,
        activation_bytes,
        chunk_for_budget,
    )

    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2))
    x, y = np.zeros((4, 3, 64, 64), dtype), np.zeros(4, np.int64)
    measured = activation_bytes(model, LOSS, torch.zeros(2, 3, 64, 64), torch.zeros(2, dtype=torch.long))
    assert measured is not None and measured < 1_000  # the pooled model's own tensors: a few hundred bytes
    size = np.dtype(dtype).itemsize
    record = 3 * 64 * 64 * (SOURCE_COPIES * size + CONVERTED_COPIES * 4) + (SOURCE_COPIES + CONVERTED_COPIES) * 8
    budget = 1 << 20
    chunk = chunk_for_budget(model, LOSS, ArraySource(x, y), budget_bytes=budget, most=8192)
    assert chunk == budget // (ACTIVATION_COPIES * measured // 2 + record) == want  # without the records: 8,192
    assert chunk * record <= budget


def test_null_records_have_norm_zero_and_contribute_nothing() -> None:
    model, x, y, _ = CASES["mlp+layernorm"]
    x, y = x.copy(), y.copy()
    x[2, 1] = np.nan
    y[5] = 7  # not a class of this 3-class model

    def valid(xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        return (yt >= 0) & (yt < 3)

    norms, _ = record_norms(model, LOSS, ArraySource(x, y), valid=valid, chunk_size=4)
    assert norms[2] == 0.0 and norms[5] == 0.0 and np.all(np.delete(norms, [2, 5]) > 0)
    total = weighted_gradient_sum(model, LOSS, ArraySource(x, y), np.ones(len(x)), valid=valid, chunk_size=4)
    keep = np.delete(np.arange(len(x)), [2, 5])
    want = reference_rows(model, x[keep], y[keep]).sum(0).numpy()
    assert np.isfinite(total).all() and rel(total, want) <= 1e-5


def overflow_case() -> tuple[nn.Module, np.ndarray, np.ndarray]:
    """A linear model whose record 4 overflows (logit +inf, gradient NaN); the other 8 are finite."""
    model = nn.Sequential(nn.Linear(3, 2))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
        model[0].weight[0, 0] = 3e38
    rng = np.random.default_rng(1)
    x = rng.normal(size=(9, 3)).astype(np.float32)
    x[:, 0] = np.abs(x[:, 0]) * 0.001
    x[4, 0] = 10.0  # logit +inf: its gradient is NaN
    return model, x, rng.integers(0, 2, 9)


def test_a_record_whose_norm_overflows_contributes_exactly_zero() -> None:
    model, x, y = overflow_case()
    units = StreamedGradients(model, LOSS, ArraySource(x, y), chunk_size=4)
    norms = units.norms()
    assert not np.isfinite(norms[4]) and np.isfinite(np.delete(norms, 4)).all()
    charged = units.scale(np.where(np.isfinite(norms), 1.0, 0.0))
    assert charged[4] == 0.0
    total = units.weighted_sum(np.ones(9, dtype=np.bool_))
    keep = np.delete(np.arange(9), 4)
    assert np.isfinite(total).all()
    assert rel(total, reference_rows(model, x[keep], y[keep]).sum(0).numpy()) <= 1e-5


def test_a_non_finite_null_element_is_an_error_before_any_sum() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    with torch.no_grad():
        model[0].bias[0] = float("inf")  # finite inputs or not: the null element's loss is not finite
    x, y = np.ones((4, 3), np.float32), np.zeros(4, np.int64)
    with pytest.raises(NonFiniteSumError, match="null element"):
        weighted_gradient_sum(model, LOSS, ArraySource(x, y), np.ones(4))


def test_weight_zero_records_contribute_exactly_zero_whatever_their_data() -> None:
    model, x, y, _ = CASES["convs"]
    w = np.ones(len(x))
    w[[0, 3, 8]] = 0.0
    total = weighted_gradient_sum(model, LOSS, ArraySource(x, y), w, chunk_size=5)
    x2, y2 = x.copy(), y.copy()
    x2[[0, 3, 8]] = np.random.default_rng(9).normal(size=x2[[0, 3, 8]].shape) * 100
    y2[[0, 3, 8]] = (y2[[0, 3, 8]] + 1) % 3
    assert np.array_equal(weighted_gradient_sum(model, LOSS, ArraySource(x2, y2), w, chunk_size=5), total)
    keep = np.flatnonzero(w)
    assert rel(total, reference_rows(model, x[keep], y[keep]).sum(0).numpy()) <= 1e-5


def test_batch_norm_and_training_dropout_are_rejected() -> None:
    x, y = np.ones((4, 3), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="BatchNorm is not supported"):
        record_norms(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)), LOSS, ArraySource(x, y))
    with pytest.raises(ValueError, match="Dropout with p > 0 in training mode"):
        StreamedGradients(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1), nn.Linear(4, 2)), LOSS, ArraySource(x, y))


def test_rows_and_streamed_contributions_agree() -> None:
    model, x, y, _ = CASES["mlp+layernorm"]
    rows = RowContributions(reference_rows(model, x, y).float().numpy())
    streamed = StreamedGradients(model, LOSS, ArraySource(x, y), chunk_size=4)
    np.testing.assert_allclose(streamed.norms(), rows.norms(), rtol=1e-5)
    scales = np.minimum(1.0, 0.5 / rows.norms())
    rows.scale(scales)
    streamed.scale(scales)
    admitted = np.arange(len(x)) % 3 != 0
    assert rel(streamed.weighted_sum(admitted), rows.weighted_sum(admitted)) <= 1e-5


_MEMORY_PROBE = """
import resource, sys, numpy as np, torch, functools
from torch import nn
from torch.nn import functional as F
from client_agent.streaming import StreamedGradients, ArraySource
n = int(sys.argv[1])
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 384), nn.ReLU(), nn.Linear(384, 10))  # d = 102,538
x = np.random.default_rng(0).normal(size=(n, 256)).astype(np.float32)
y = np.random.default_rng(1).integers(0, 10, n)
loss = functools.partial(F.cross_entropy, reduction="none")
units = StreamedGradients(model, loss, ArraySource(x, y), chunk_size=256)
units.clipped_sum(lambda start, norms: np.minimum(1.0, 1.0 / norms))  # the fused pass, as Agent.release runs it
units.scale(np.minimum(1.0, 1.0 / units.norms()))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 - x.nbytes // 2**20)
"""


def test_memory_is_bounded_by_the_chunk_not_by_the_records() -> None:
    """Peak RSS (less the data) of a fresh process at n = 1,000 and 20,000: (n, d) rows would be 0.4 and 8 GB."""
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", PYTHONPATH=str(ROOT))
    peaks = [
        int(
            subprocess.run(
                [sys.executable, "-c", _MEMORY_PROBE, str(n)], env=env, capture_output=True, text=True, check=True
            ).stdout.split()[-1]
        )
        for n in (1_000, 20_000)
    ]
    assert peaks[1] - peaks[0] <= 64, peaks  # MiB; the materialised rows would add 7,800 MiB


def test_the_agents_record_gradients_stream_and_match_the_materialised_rows() -> None:
    """workloads.gradient_contributions (what Agent.release gets) against the (n, d) rows of gradient_rows."""
    from client_agent.workloads import gradient_contributions, gradient_rows
    from protocol import messages as wire

    rng = np.random.default_rng(3)
    x = rng.normal(size=(11, 5)).astype(np.float32)
    y = rng.integers(0, 3, 11)
    x[4, 2], y[7] = np.inf, 3  # the null element: a feature that is not finite, a label outside 3 classes
    params = rng.normal(size=5 * 3 + 3).astype(np.float32)
    request = wire.GradientRequest(
        "r", "run", 1, 1.0, 0.5, "local", "record", "logreg", '{"in_features": 5, "n_classes": 3}', params
    )
    streamed = gradient_contributions(request, ArraySource(x, y), unit="record")
    assert isinstance(streamed, StreamedGradients)
    rows = RowContributions(gradient_rows(request, x, y, unit="record"))
    np.testing.assert_allclose(streamed.norms(), rows.norms(), rtol=1e-5)
    assert streamed.norms()[4] == 0.0 and streamed.norms()[7] == 0.0
    scales = np.minimum(1.0, 0.3 / np.maximum(rows.norms(), 1e-12))
    streamed.scale(scales)
    rows.scale(scales)
    admitted = np.ones(11, dtype=np.bool_)
    assert rel(streamed.weighted_sum(admitted), rows.weighted_sum(admitted)) <= 1e-5


class _SequenceLinear(nn.Module):
    """One Linear applied at every position of a (b, T, 1) input: a record's gradient sums T terms."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[..., 0]


@pytest.mark.parametrize("hooks", [True, False])
def test_the_agents_path_releases_no_more_than_it_charges_when_a_records_terms_cancel(hooks: bool) -> None:
    """Review finding: a record whose per-position terms are 2^40, -(2^40 - 2^16), -(2^16 - 3) has gradient 3.
    The old ghost path's float64 Gram norm (3) and its float32 book-keeping sum disagreed by about 10^4,
    far beyond NORM_REL_ERROR. Both methods now take the norm from the very values they sum (the hooks'
    per-record rows, or the fallback's vmap(grad) row), so what is released is never above the charge."""
    big, step = 2.0**40, 2.0**16
    x = np.array([[[big], [-(big - step)], [-(step - 3)]]], dtype=np.float32)
    y = np.zeros(1, dtype=np.int64)
    model = _SequenceLinear()
    with torch.no_grad():
        model.lin.weight.fill_(1.0)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out.sum(dim=1)

    units = StreamedGradients(model, loss, ArraySource(x, y), hooks=hooks)
    assert StreamedGradients(model, loss, ArraySource(x, y)).hooks  # the default, what the agent builds
    clip = 1.0 / (1.0 + NORM_REL_ERROR)

    def weights(start: int, norms: np.ndarray) -> np.ndarray:
        return np.minimum(1.0, clip / norms)

    total = units.clipped_sum(weights)
    charged = units.charged_norms(units.norms(), weights(0, units.norms()))
    assert units.method == ("rows" if hooks else "direct")
    assert np.linalg.norm(total) <= charged[0] * (1 + 1e-12)


class _Tokens(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(dim=1))


def test_a_token_id_beyond_the_vocabulary_is_the_null_element_not_an_error() -> None:
    """Review finding: with the default validity rule, a record holding a token id >= the vocabulary the
    coordinator chose made the forward raise, an uncharged internal error; the coordinator could
    binary-search the client's largest token id. The record is now the null element: norm 0, no charge."""
    from workloads.registry import finite_features

    x = torch.tensor([[1, 2, 3], [4, 45, 6], [7, 8, 9], [-1, 2, 3]])  # 45 and -1: outside a table of 40
    y = torch.tensor([0, 1, 0, 1])
    model = _Tokens(40)

    def valid(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return finite_features(xb, yb, model)

    units = StreamedGradients(model, LOSS, ArraySource(x.numpy(), y.numpy()), valid=valid)
    norms = units.norms()  # the agent's embedding guard: the records holding them are null, not an error
    assert norms[1] == 0.0 and norms[3] == 0.0 and norms[0] > 0.0 and norms[2] > 0.0
    wide = StreamedGradients(_Tokens(64), LOSS, ArraySource(x[:3].numpy(), y[:3].numpy()), valid=valid)
    assert np.all(wide.norms() > 0.0)  # a table of 64 takes id 45


def test_the_method_is_chosen_on_synthetic_records_not_on_the_data() -> None:
    """Review finding: the hooks were checked on the first chunk's real records, so a chunk whose records made
    a hidden parameter's gradient vanish (here sin(0) = 0 for the borrowed weight) chose the fast method and
    any other chunk the slow one: the timing told the coordinator something about the first records."""
    model, x, y, _ = CASES["borrowed"]
    zeros = np.zeros_like(x)
    for data in (x, zeros, np.nan * zeros):  # real records, records that hide the borrowing, all null
        assert record_norms(model, LOSS, ArraySource(data, y), chunk_size=5)[1] == "direct"
    for case in ("convs", "tokens"):
        model, x, y, _ = CASES[case]
        assert record_norms(model, LOSS, ArraySource(np.zeros_like(x), y), chunk_size=5)[1] == "rows"


class _LogLeaf(nn.Module):
    """A custom leaf whose parameter gradient, log|a|, is infinite at a = 0."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.linspace(0.5, 1.5, k))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return torch.log(a.abs()) * self.alpha


def test_a_stopped_record_is_never_evaluated_at_a_zeroed_input() -> None:
    """Review finding: the old book-keeping sum evaluated custom leaves at the stopped records' zeroed inputs,
    where log|0| made the sum NaN: an error exactly when some record had stopped. Now every record's rows
    come from its real input and a stopped record's rows are replaced by zeros."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 3), _LogLeaf(3), nn.Linear(3, 2))
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(10, 4)).astype(np.float32), rng.integers(0, 2, 10)
    stopped = np.arange(10) % 3 == 0
    _, total, method = fused_clipped_sum(model, LOSS, ArraySource(x, y), clipping_weights(0.5, stopped))
    assert method == "rows" and np.isfinite(total).all()
    keep = np.flatnonzero(~stopped)
    rows = reference_rows(model, x[keep], y[keep])
    w = np.minimum(1.0, 0.5 / rows.norm(dim=1).numpy())
    assert rel(total, (rows * torch.from_numpy(w)[:, None]).sum(0).numpy()) <= 1e-5


def test_validity_sees_the_sources_own_values_before_the_float32_conversion() -> None:
    """Review finding: float64 labels were rounded to float32 before the validity rule, so 2.0000001 passed the
    built-in classifier's 'integer label' check as class 2. The rule now sees the source's own values."""
    from workloads.builtin import BUILTIN

    model = BUILTIN.build_model("logreg", seed=0, in_features=3, n_classes=3)
    x = np.ones((4, 3), np.float32)
    y = np.array([0.0, 2.0000001, 2.0, 1.0])  # float64: 2.0000001 is not an integer label
    assert np.float32(y[1]) == 2.0  # what the old path saw

    def valid(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return BUILTIN.valid(xb, yb, model)

    norms = record_norms(model, BUILTIN.loss, ArraySource(x, y), valid=valid)[0]
    assert norms[1] == 0.0 and np.all(np.delete(norms, 1) > 0)


class _Offset(nn.Module):
    """A learned offset through a Linear on a constant: its input is shared by the batch, not per record."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.offset = nn.Linear(1, 3)
        self.register_buffer("one", torch.ones(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.offset(self.one)


class _Positional(nn.Module):
    """Positional embeddings on arange(T): an input shared by the batch, of T rows."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.t = t
        self.pos = nn.Embedding(t, 2)
        self.head = nn.Linear(2 * t, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.pos(torch.arange(self.t))).flatten(1))


@pytest.mark.parametrize("case", ["offset", "positional-3", "positional-4"])
def test_a_module_whose_input_the_batch_shares_gets_each_records_own_gradient(case: str) -> None:
    """Review finding: a module fed an input shared by the batch (a constant, arange(T)) got as backprop the sum
    over every record, which the old batched hooks broadcast to each record: a stopped record's data moved
    the released sum (by 1.19 here) with no charge. Each record now runs alone, so the module's backprop
    is that record's own and the tapped rows are exact."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model: nn.Module
    if case == "offset":
        model, x = _Offset(), rng.normal(size=(6, 4)).astype(np.float32)
    else:
        t = int(case.split("-")[1])
        model, x = _Positional(t), rng.normal(size=(6, t, 2)).astype(np.float32)
    y = rng.integers(0, 3, 6)

    def only_first(start: int, norms: np.ndarray) -> np.ndarray:
        return np.where(np.arange(start, start + norms.size) == 0, 1.0, 0.0)

    norms, total, method = fused_clipped_sum(model, LOSS, ArraySource(x, y), only_first, chunk_size=6)
    assert method == "rows"
    x2 = x.copy()
    x2[1] *= 50.0  # a stopped record (weight 0) changes
    _, total2, _ = fused_clipped_sum(model, LOSS, ArraySource(x2, y), only_first, chunk_size=6)
    assert np.array_equal(total, total2)
    np.testing.assert_allclose(norms, reference_rows(model, x, y).norm(dim=1).numpy(), rtol=1e-5)


def test_including_a_tiny_record_moves_the_sum_by_no_more_than_its_charge() -> None:
    """Review finding: rows were summed in float32 runs of 64 records, so including one record changed the
    rounding of the others' sum by about 2^-24 of the run's total: a record with a tiny gradient moved the
    released sum 17% beyond its charge. The runs are now summed in float64."""
    from examples.gn_regression.workload import WORKLOAD, make_records

    torch.manual_seed(0)
    model = WORKLOAD.build_model("gn_cnn", channels=8, outputs=2).eval()
    x, y = make_records(64, seed=0)
    with torch.no_grad():
        out = model(torch.from_numpy(x)).numpy()
    j = 63
    with_j, without_j = np.ones(64), np.ones(64)
    without_j[j] = 0.0

    def weights(w: np.ndarray) -> Callable[[int, np.ndarray], np.ndarray]:
        return lambda start, norms: w[start : start + norms.size]

    for residual in (1e-5, 3e-7, 3e-8):
        yy = y.copy()
        yy[j] = out[j] + np.float32(residual)  # record j: a tiny residual, so a tiny gradient
        source = ArraySource(x, yy)
        norms, s1, method = fused_clipped_sum(model, WORKLOAD.loss, source, weights(with_j))
        _, s0, _ = fused_clipped_sum(model, WORKLOAD.loss, source, weights(without_j))
        assert method == "rows"
        charge = StreamedGradients.charged_norms(norms, with_j)[j]
        assert np.linalg.norm(s1 - s0) <= charge
