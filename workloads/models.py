"""Model architectures both sides of the federation agree on, and their flat parameter layout.

The flat layout (``model.parameters()`` order, each tensor flattened row-major, float32) is part
of the wire contract: the coordinator sends it, clients load it and return gradients in it.
Models are looked up in a workload's registry (:mod:`workloads.registry`; the built-ins of
:data:`MODELS` are :mod:`workloads.builtin`), never imported by a name taken from data.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import cast

import numpy as np
import torch
from torch import nn


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name}: expected an integer > 0, got {value!r}")
    return int(value)


def opacus_mnist_cnn() -> nn.Module:
    """The ``SampleConvNet`` of Opacus's ``examples/mnist.py``; input (N, 1, 28, 28), 10 logits.

    Its convolution weights are channels-last (PyTorch's ``model.to(memory_format=torch.channels_last)``;
    the same values): the convolutions then give channels-last outputs and the max pooling runs PyTorch's
    vectorised channels-last CPU kernel, 1.18-1.24x on the agent's per-record pass over MNIST
    (``benchmarks/conv_layout.py``). The per-record engine keeps whatever layout a model comes in.
    """
    model = nn.Sequential(
        nn.Conv2d(1, 16, 8, 2, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )
    to = cast(Callable[..., nn.Module], model.to)  # Module.to(memory_format=...): not in torch's type stubs
    return to(memory_format=torch.channels_last)


def mlp(*, in_features: int, hidden: tuple[int, ...], out_features: int) -> nn.Module:
    """Fully connected ReLU network ``in_features -> *hidden -> out_features`` (input is flattened)."""
    widths = [_positive_int("in_features", in_features)]
    widths += [_positive_int(f"hidden[{i}]", h) for i, h in enumerate(tuple(hidden))]
    widths.append(_positive_int("out_features", out_features))
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def logreg(*, in_features: int, n_classes: int) -> nn.Module:
    """Multinomial logistic regression: one linear layer giving ``n_classes`` logits (input is flattened)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(_positive_int("in_features", in_features), _positive_int("n_classes", n_classes))
    )


MODELS: Mapping[str, Callable[..., nn.Module]] = MappingProxyType(
    {"opacus_mnist_cnn": opacus_mnist_cnn, "mlp": mlp, "logreg": logreg}
)


def build_model(name: str, *, seed: int | torch.Generator = 0, **params: object) -> nn.Module:
    """Build model ``name`` of the built-in workload (:mod:`workloads.builtin`), init drawn from ``seed``.

    The built-ins go through the same registry as any user's workload; see :func:`build_with`.
    """
    from workloads.builtin import BUILTIN

    if name not in BUILTIN.models:
        raise ValueError(f"model: expected one of {sorted(BUILTIN.models)}, got {name!r}")
    return build_with(BUILTIN.models[name], name, seed=seed, **params)


def build_with(
    builder: Callable[..., nn.Module], name: str, *, seed: int | torch.Generator = 0, **params: object
) -> nn.Module:
    """``builder(**params)`` with PyTorch's default init drawn from ``seed``; errors name what was expected.

    The global torch RNG is left untouched; the same ``name``, ``params`` and seed give the same
    parameters. A ``torch.Generator`` is consumed for one 63-bit seed. Arguments the factory does
    not take, a factory that raises, or one that returns no ``nn.Module`` is a ValueError.
    """
    try:
        inspect.signature(builder).bind(**params)
    except TypeError as exc:
        expected = list(inspect.signature(builder).parameters)
        raise ValueError(f"model {name!r}: expected parameters {expected}, got {sorted(params)} ({exc})") from None
    if isinstance(seed, torch.Generator):
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=seed).item())
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int or torch.Generator, got {seed!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = builder(**params)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(f"model {name!r}: the factory failed with {params}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        found = type(model).__name__
        raise ValueError(f"model {name!r}: expected the factory to return a torch.nn.Module, got {found}")
    return model


def parameter_count(model: nn.Module) -> int:
    """Number of scalar parameters ``d`` in the flat layout."""
    return sum(p.numel() for p in model.parameters())


def trainable_mask(model: nn.Module) -> np.ndarray:
    """Which entries of the flat layout are trainable (``requires_grad``): bool ``(d,)``.

    Frozen parameters are part of the model a request carries, not of the gradient: the agent
    releases zeros for them and charges nothing for them, and the coordinator never moves them.
    """
    return np.concatenate(
        [np.full(p.numel(), p.requires_grad, dtype=np.bool_) for p in model.parameters()] or [np.zeros(0, np.bool_)]
    )


def parameter_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of each parameter, in flat-layout order."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def flatten_parameters(model: nn.Module) -> np.ndarray:
    """All parameters as one float32 vector of shape ``(d,)`` in flat-layout order."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32).cpu() for p in model.parameters()])
    return flat.numpy().copy()


def load_flat_parameters(model: nn.Module, flat: np.ndarray) -> None:
    """Copy a flat float32 vector of shape ``(d,)`` into ``model``'s parameters, in place."""
    d = parameter_count(model)
    if not isinstance(flat, np.ndarray):
        raise ValueError(f"flat parameters: expected a numpy array, got {type(flat).__name__}")
    if flat.dtype != np.float32:
        raise ValueError(f"flat parameters: expected dtype float32, got {flat.dtype}")
    if flat.size != d:
        raise ValueError(f"flat parameters: expected {d} values, got {flat.size}")
    if flat.shape != (d,):
        raise ValueError(f"flat parameters: expected shape ({d},), got {flat.shape}")
    if not np.isfinite(flat).all():
        raise ValueError(f"flat parameters: expected finite values, got {int((~np.isfinite(flat)).sum())} NaN/inf")
    src = torch.from_numpy(flat)
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(src[offset : offset + n].view_as(p))
            offset += n
