"""Per-unit gradients at the current model, in the flat layout of :func:`workloads.models.flatten_parameters`.

Privacy note: these are the raw contributions v_t(u) before clipping; a row is one record's
gradient (record units) and :func:`summed_gradient` is one client's gradient (client units).
Nothing here is released; the filter clips and the client noises what leaves the machine.

``loss_fn(logits, targets)`` must return per-example losses of shape ``(b,)`` for a batch of
``b`` (e.g. ``functools.partial(torch.nn.functional.cross_entropy, reduction="none")``), so the
summed loss is unambiguous; a mean-reduced loss would silently rescale gradients and is rejected.
Gradients are taken with respect to every parameter, whatever its ``requires_grad``; the model's
parameters and ``.grad`` fields are left untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_inputs(x: torch.Tensor, y: torch.Tensor) -> int:
    """Return the number of examples after checking types, lengths and finiteness."""
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.ndim == 0:
            raise ValueError(f"{name}: expected a batch with a leading example dimension, got a 0-d tensor")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: expected finite values, got {int((~torch.isfinite(t)).sum())} NaN/inf")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y: expected the same number of examples, got {x.shape[0]} and {y.shape[0]}")
    return int(x.shape[0])


def _check_losses(losses: torch.Tensor, b: int) -> torch.Tensor:
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (b,):
        got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(f"loss_fn: expected per-example losses of shape ({b},) (reduction='none'), got {got}")
    return losses


def _detached_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    return params, buffers


def _checked_weights(weights: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if weights is None:
        return None
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (n,) or not weights.is_floating_point():
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"weights: expected a float tensor of shape ({n},), got {got}")
    if not bool(torch.isfinite(weights).all()):
        raise ValueError("weights: expected finite values")
    return weights


def check_no_batch_norm(model: nn.Module) -> None:
    """Reject BatchNorm: batch statistics mix examples, so there is no per-example gradient."""
    batch_norms = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if batch_norms:
        raise ValueError(
            f"model: BatchNorm is not supported for per-example gradients (it mixes examples), found {batch_norms}"
        )


def example_gradients_fn(
    model: nn.Module, loss_fn: LossFn, device: torch.device | str | None = None
) -> tuple[Callable[..., dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """``(fn, params)``: ``fn(params, x, y, w)`` gives each example's gradient of ``w_i * loss_i``, by vmap(grad)."""
    params, buffers = _detached_state(model)
    if device is not None:
        params = {name: p.to(device) for name, p in params.items()}
        buffers = {name: b.to(device) for name, b in buffers.items()}

    def example_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor, wi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return _check_losses(loss_fn(logits, yi.unsqueeze(0)), 1).sum() * wi

    return vmap(grad(example_loss), in_dims=(None, 0, 0, 0)), params


def per_example_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Gradient of each example's loss, shape ``(n, d)`` float32, via ``vmap(grad(...))`` over chunks.

    ``weights`` (shape ``(n,)``) multiplies each example's loss: weight 0 gives that example the
    zero row by the same computation as every other example (the null element, privacy.md §1).

    Memory is bounded by ``chunk_size`` examples' gradients at a time plus the ``(n, d)`` result:
    the slow reference of :mod:`client_agent.streaming`, which never forms the ``(n, d)`` matrix.
    Models with BatchNorm are rejected: batch statistics mix examples, so there is no per-example
    gradient (use GroupNorm/LayerNorm instead).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected an integer > 0, got {chunk_size!r}")
    check_no_batch_norm(model)
    n = _check_inputs(x, y)
    w = _checked_weights(weights, n)
    if w is None:
        w = torch.ones(n, dtype=torch.float32, device=x.device)
    example_grads, params = example_gradients_fn(model, loss_fn)
    d = sum(p.numel() for p in params.values())
    out = torch.empty((n, d), dtype=torch.float32, device=x.device)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        grads = example_grads(params, x[start:stop], y[start:stop], w[start:stop])
        offset = 0
        for name in params:  # straight into the result, no concatenated copy of the chunk
            g = grads[name].reshape(stop - start, -1)
            out[start:stop, offset : offset + g.shape[1]] = g
            offset += g.shape[1]
    return out


def summed_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, *, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of the (``weights``-weighted) summed loss over the batch, shape ``(d,)`` float32, one backward pass."""
    n = _check_inputs(x, y)
    w = _checked_weights(weights, n)
    params, buffers = _detached_state(model)
    leaves = {name: p.requires_grad_(True) for name, p in params.items()}  # detached leaves, not the model's
    losses = _check_losses(loss_fn(functional_call(model, (leaves, buffers), (x,)), y), n)
    total = losses.sum() if w is None else (losses * w).sum()
    grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(leaves.values(), grads, strict=True)]
    ).to(torch.float32)
