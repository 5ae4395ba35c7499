"""Per-example gradients (torch.func) against a slow per-example autograd loop, and the model table."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from client_agent.gradients import per_example_gradients, summed_gradient
from workloads.models import (
    MODELS,
    build_model,
    flatten_parameters,
    load_flat_parameters,
    parameter_count,
    parameter_shapes,
)

LOSS = functools.partial(F.cross_entropy, reduction="none")
Batch = tuple[nn.Module, torch.Tensor, torch.Tensor]


def loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The slow oracle: one ordinary backward pass per example."""
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def cnn_batch(n: int = 16) -> Batch:
    g = torch.Generator().manual_seed(1)
    return (
        build_model("opacus_mnist_cnn", seed=0),
        torch.randn(n, 1, 28, 28, generator=g),
        torch.randint(0, 10, (n,), generator=g),
    )


def mlp_batch(n: int = 16) -> Batch:
    g = torch.Generator().manual_seed(2)
    model = build_model("mlp", seed=0, in_features=20, hidden=(32, 16), out_features=5)
    return model, torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.parametrize("make", [cnn_batch, mlp_batch], ids=["cnn", "mlp"])
def test_vmap_matches_per_example_loop(make: Callable[[], Batch]) -> None:
    model, x, y = make()
    got = per_example_gradients(model, LOSS, x, y)
    assert got.shape == (x.shape[0], parameter_count(model)) and got.dtype == torch.float32
    torch.testing.assert_close(got, loop_gradients(model, x, y), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [cnn_batch, mlp_batch], ids=["cnn", "mlp"])
def test_rows_sum_to_summed_gradient(make: Callable[[], Batch]) -> None:
    model, x, y = make()
    summed = summed_gradient(model, LOSS, x, y)
    assert summed.shape == (parameter_count(model),)
    torch.testing.assert_close(per_example_gradients(model, LOSS, x, y).sum(0), summed, atol=1e-5, rtol=1e-5)


def test_chunking_gives_identical_rows() -> None:
    """Same rows whatever the chunking: bit for bit when the chunk is the same, else to float32 rounding.

    (BLAS blocks a batched matmul differently for different batch sizes, so sums may round differently.)
    """
    model, x, y = mlp_batch(n=37)
    whole = per_example_gradients(model, LOSS, x, y)
    for chunk_size in (37, 1000):
        assert torch.equal(per_example_gradients(model, LOSS, x, y, chunk_size=chunk_size), whole)
    for chunk_size in (1, 5, 36):
        chunked = per_example_gradients(model, LOSS, x, y, chunk_size=chunk_size)
        torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)


def test_gradients_leave_model_untouched() -> None:
    model, x, y = mlp_batch()
    before = flatten_parameters(model)
    per_example_gradients(model, LOSS, x, y)
    summed_gradient(model, LOSS, x, y)
    np.testing.assert_array_equal(flatten_parameters(model), before)
    assert all(p.grad is None for p in model.parameters())


def test_bad_inputs_raise() -> None:
    model, x, y = mlp_batch()
    with pytest.raises(ValueError, match=r"x and y: expected the same number of examples, got 16 and 15"):
        per_example_gradients(model, LOSS, x, y[:15])
    bad = x.clone()
    bad[3, 0] = float("nan")
    for fn in (per_example_gradients, summed_gradient):
        with pytest.raises(ValueError, match=r"x: expected finite values, got 1 NaN/inf"):
            fn(model, LOSS, bad, y)
    with pytest.raises(ValueError, match=r"chunk_size: expected an integer > 0, got 0"):
        per_example_gradients(model, LOSS, x, y, chunk_size=0)
    with pytest.raises(ValueError, match=r"loss_fn: expected per-example losses of shape \(16,\)"):
        summed_gradient(model, F.cross_entropy, x, y)
    with pytest.raises(ValueError, match=r"loss_fn: expected per-example losses of shape \(1,\)"):
        per_example_gradients(model, F.cross_entropy, x, y)
    with pytest.raises(ValueError, match=r"x: expected a torch.Tensor, got ndarray"):
        per_example_gradients(model, LOSS, x.numpy(), y)  # type: ignore[arg-type]


def test_batchnorm_rejected() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"BatchNorm is not supported for per-example gradients.*\['1'\]"):
        per_example_gradients(model, LOSS, torch.randn(4, 4), torch.randint(0, 3, (4,)))


def test_opacus_cnn_layout() -> None:
    model = build_model("opacus_mnist_cnn")
    assert parameter_shapes(model) == [
        ("0.weight", (16, 1, 8, 8)),
        ("0.bias", (16,)),
        ("3.weight", (32, 16, 4, 4)),
        ("3.bias", (32,)),
        ("7.weight", (32, 512)),
        ("7.bias", (32,)),
        ("9.weight", (10, 32)),
        ("9.bias", (10,)),
    ]
    # Opacus's examples/mnist.py SampleConvNet: conv 16x1x8x8+16, conv 32x16x4x4+32, fc 512x32+32, fc 32x10+10.
    assert parameter_count(model) == 1040 + 8224 + 16416 + 330 == 26_010
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_seeded_init_is_deterministic_and_leaves_global_rng() -> None:
    state = torch.get_rng_state()
    a = flatten_parameters(build_model("logreg", seed=7, in_features=5, n_classes=3))
    assert torch.equal(torch.get_rng_state(), state)
    np.testing.assert_array_equal(a, flatten_parameters(build_model("logreg", seed=7, in_features=5, n_classes=3)))
    assert not np.array_equal(a, flatten_parameters(build_model("logreg", seed=8, in_features=5, n_classes=3)))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    np.testing.assert_array_equal(
        flatten_parameters(build_model("opacus_mnist_cnn", seed=g1)),
        flatten_parameters(build_model("opacus_mnist_cnn", seed=g2)),
    )


def test_flatten_load_round_trip() -> None:
    model = build_model("mlp", seed=0, in_features=6, hidden=(4,), out_features=2)
    flat = np.arange(parameter_count(model), dtype=np.float32) / 10
    load_flat_parameters(model, flat)
    out = flatten_parameters(model)
    assert out.dtype == np.float32 and out.shape == (parameter_count(model),)
    np.testing.assert_array_equal(out, flat)
    other = build_model("mlp", seed=1, in_features=6, hidden=(4,), out_features=2)
    load_flat_parameters(other, out)
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), other(x), atol=0, rtol=0)


def test_load_flat_rejects_bad_vectors() -> None:
    model = build_model("logreg", in_features=3, n_classes=2)  # d = 8
    with pytest.raises(ValueError, match=r"^flat parameters: expected 8 values, got 7$"):
        load_flat_parameters(model, np.zeros(7, dtype=np.float32))
    with pytest.raises(ValueError, match=r"expected shape \(8,\), got \(2, 4\)"):
        load_flat_parameters(model, np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(ValueError, match=r"expected dtype float32, got float64"):
        load_flat_parameters(model, np.zeros(8))
    for value in (np.nan, np.inf):
        bad = np.zeros(8, dtype=np.float32)
        bad[2] = value
        with pytest.raises(ValueError, match=r"expected finite values, got 1 NaN/inf"):
            load_flat_parameters(model, bad)


def test_unknown_model_name_and_bad_params() -> None:
    assert set(MODELS) == {"opacus_mnist_cnn", "mlp", "logreg"}
    with pytest.raises(
        ValueError, match=r"model: expected one of \['logreg', 'mlp', 'opacus_mnist_cnn'\], got 'resnet'"
    ):
        build_model("resnet")
    with pytest.raises(ValueError, match=r"model 'logreg': expected parameters \['in_features', 'n_classes'\]"):
        build_model("logreg", in_features=3)
    with pytest.raises(ValueError, match=r"hidden\[1\]: expected an integer > 0, got 0"):
        build_model("mlp", in_features=3, hidden=(4, 0), out_features=2)
    with pytest.raises(TypeError):
        MODELS["cnn"] = build_model  # type: ignore[index]
