"""Per-record gradient contributions, streamed chunk by chunk: memory bounded by a chunk, never by n x d.

One fused pass over the records (the book-keeping method of Bu et al. 2022, "Differentially
Private Optimization on Large Model at Small Cost"; ghost norms: Goodfellow 2015, Lee & Kifer
2021, Li et al. 2022; Opacus ``utils/fast_gradient_clipping_utils.py`` and the ``grad_sample``
norm samplers). Per chunk, :func:`fused_clipped_sum`:

1. one forward, capturing the input ``a`` of every leaf module that owns parameters (forward
   hooks), and one backward with respect to those modules' outputs (their backprops ``g``; no
   parameter gradient is formed);
2. each record's gradient L2 norm from the captured (a, g): ``nn.Linear`` on (b, in):
   ||g a^T||^2 = ||a||^2 ||g||^2; on sequences (b, T, in): sum((a a^T) * (g g^T)) (T x T Gram,
   float64) or the explicit (b, out, in) gradient, whichever is smaller; ``nn.Conv1d``/
   ``nn.Conv2d`` (groups 1, zero padding): the Gram of the unfolded input (float64), or the
   explicit float32 gradient of each record as a batched matmul, in cache-sized blocks of records;
   ``nn.Embedding``: the Gram over positions with equal indices, or the explicit scatter; any
   other leaf (``nn.LayerNorm``, ``nn.GroupNorm``, custom): ``torch.func`` vmap over the vjp of
   that one module at its captured input and backprop. Squared norms are summed in float64;
3. the chunk's weights w_i from the caller (``weights(start, norms)``: Agent.release's clip scale
   x admitted, each record's from its own norm and its state before the request);
4. sum_i w_i g_i from the same (a, g), with no second forward or backward (:func:`_layer_sum`):
   Linear (w g)^T a, convolutions their weight-gradient kernel with w g as output gradient,
   Embedding an index_add, other leaves one vjp of that module alone with cotangent w g;
   accumulated in float64 in the flat layout of :func:`protocol.models.flatten_parameters`.

A model the hooks cannot see completely falls back to vmap(grad) of the whole model per
sub-batch: the per-record gradients formed for the norms are weighted and summed.
:func:`record_norms` (norms only) and :func:`weighted_gradient_sum` (a weighted backward pass)
remain as the two-pass path: :class:`StreamedGradients`' ``norms``/``scale``/``weighted_sum``, and
the reference the fused pass is tested against.

Privacy notes (privacy.md §1, §2, §8):

- The null element: a record whose features are not finite, or that the workload's ``valid``
  rule rejects (e.g. a label the model cannot take), gets zero features, target 0 and weight 0
  in the loss, so its norm is 0 and its contribution exactly zero. In the sum, a record whose
  weight is 0, or whose norm is not finite or is 0, enters as exact zeros in both ``a`` and ``g``
  (a torch.where on every record; 0 * inf would be NaN), whatever weight the caller gave it, so
  every record that contributes anything was charged for it. The null element's own gradient is
  checked to be finite once per request (a data-independent check); a sum that is still not
  finite raises :class:`NonFiniteSumError` before anything is charged.
- Float error: a record's float64 norm and the norm of what the float32 sum adds for it differ
  by rounding (both come from the same float32 (a, g)). The engine declares a relative bound
  :data:`NORM_REL_ERROR`; the release clips to bound / (1 + E) and charges norm * scale * (1 + E)
  >= the clipped contribution's norm (tests/unit/test_streaming.py shows observed errors below
  1e-7, E / 1000). E is an empirical bound, not a proof: float32 cancellation inside one record's
  gradient could in principle exceed it (as it could in the float32 sum itself).
- The work does not depend on who stopped: every record goes through the same operations; a
  stopped record has weight 0, never a skipped branch.
- Records must not interact: BatchNorm (and Dropout in training mode) are rejected. A custom leaf
  module that reads another module's parameters is not seen by the hooks: the first chunk's hook
  gradients are checked against autograd's (relative 1e-3), and a mismatch switches the engine to
  the whole-model fallback.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.func import functional_call, vjp, vmap

from client_agent.gradients import LossFn, check_no_batch_norm, example_gradients_fn

# Relative bound on |a record's norm - ||what the sum adds for it||| / ||what the sum adds||. The
# norm is float64 over the float32 activations and backprops (or over the explicit float32
# gradient); the sum is float32 kernels over the same (a, g). Both are within a few float32 ulps
# per operation of the exact gradient at the float32 activations (relative ~1e-7 in
# tests/unit/test_streaming.py at every tested layer), so 1e-4 leaves a margin of about 100.
NORM_REL_ERROR = 1e-4
# Floats per sub-batch for the explicit per-record paths (torch.func leaves, the whole-model
# fallback): 2^25 floats is 128 MiB in float32, 256 MiB in float64.
_EXPLICIT_FLOATS = 1 << 25
_BLOCK_ROWS = 256  # rows per block for materialised rows: float64 temporaries of a few MB
# Floats per block of records for the convolutions' norms (patches and per-record gradients of a
# block): 2^19 floats is 2 MiB in float32, about what stays in a core's cache.
_BLOCK_FLOATS = 1 << 19


class NonFiniteSumError(ArithmeticError):
    """The clipped sum is not finite: nothing may be released or charged."""


class RecordSource(Protocol):
    """Records that can be read twice, in the same order, chunk by chunk."""

    def __len__(self) -> int: ...

    def batches(self, size: int) -> Iterator[tuple[Any, Any]]: ...


class ArraySource:
    """In-memory numpy arrays ``x`` (n, ...) and ``y`` (n,) as a :class:`RecordSource`."""

    def __init__(self, x: NDArray[Any], y: NDArray[Any]) -> None:
        if len(x) != len(y):
            raise ValueError(f"x and y: expected the same number of records, got {len(x)} and {len(y)}")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def batches(self, size: int) -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        for start in range(0, len(self.x), size):
            yield self.x[start : start + size], self.y[start : start + size]


# -- the chunk as both passes see it -------------------------------------------------------------


Validity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def finite_records(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The default validity rule: finite features (and finite float targets)."""
    ok = torch.ones(len(x), dtype=torch.bool, device=x.device)
    if x.is_floating_point():
        ok &= torch.isfinite(x.reshape(len(x), -1)).all(dim=1)
    if y.is_floating_point():
        ok &= torch.isfinite(y.reshape(len(y), -1)).all(dim=1)
    return ok


def batch_tensor(v: Any) -> torch.Tensor:
    """A batch as a tensor; a memory-mapped (read-only) slice is copied, one batch at a time, since torch
    does not take non-writable arrays."""
    return v if isinstance(v, torch.Tensor) else torch.from_numpy(np.require(v, requirements=["C", "W"]))


def _as_tensor(v: Any) -> torch.Tensor:
    t = batch_tensor(v)
    return t.to(dtype=torch.float32 if t.is_floating_point() else torch.int64)


def _chunk_tensors(
    x: Any, y: Any, keep: torch.Tensor | None, *, valid: Validity | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, weight) on ``device``: records not ``valid`` (or not in ``keep``) become the null element.

    Validity is decided on the source's side (``valid`` sees the chunk where the source gave it),
    then the chunk moves to ``device``. The same torch.where on every record: zero features, zero
    target, weight 0.
    """
    xt, yt = _as_tensor(x), _as_tensor(y)
    usable = finite_records(xt, yt)
    if valid is not None:
        usable &= valid(xt, yt).to(usable.device)
    if keep is not None:
        usable &= keep.to(usable.device)
    xt, yt, usable = xt.to(device), yt.to(device), usable.to(device)
    xt = torch.where(usable.reshape(-1, *([1] * (xt.ndim - 1))), xt, torch.zeros((), dtype=xt.dtype, device=device))
    yt = torch.where(usable.reshape(-1, *([1] * (yt.ndim - 1))), yt, torch.zeros((), dtype=yt.dtype, device=device))
    return xt, yt, usable.to(torch.float32)


def _on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` itself if its parameters and buffers are on ``device``, else a copy moved there (d floats)."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device == device for t in tensors):
        return model
    return copy.deepcopy(model).to(device)


def _leaves(model: nn.Module, device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Detached copies of the parameters that require grad (the model's own are left untouched), and buffers."""
    params = {name: p.detach().to(device).requires_grad_(True) for name, p in model.named_parameters()}
    buffers = {name: b.detach().to(device) for name, b in model.named_buffers()}
    return params, buffers


def _losses(loss_fn: LossFn, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    losses = loss_fn(outputs, y)
    b = y.shape[0]
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (b,):
        got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(f"loss_fn: expected per-example losses of shape ({b},) (reduction='none'), got {got}")
    return losses


def check_model(model: nn.Module) -> None:
    """Reject models whose records interact (BatchNorm) or whose two passes would differ (Dropout in training)."""
    check_no_batch_norm(model)
    dropout = nn.modules.dropout._DropoutNd
    dropouts = [name for name, m in model.named_modules() if isinstance(m, dropout) and m.training]
    if dropouts:
        raise ValueError(
            f"model: Dropout in training mode is not supported for per-record norms (its masks differ "
            f"between the passes), found {dropouts}; call model.eval()"
        )


# -- norms: per-layer squared norms from activations and backprops --------------------------------


def _gram_or_explicit(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum_i ||sum_t g_it a_it^T||^2 per record for a (b, T, p), g (b, T, q), float64 (b,)."""
    t, p, q = a.shape[1], a.shape[2], g.shape[2]
    if t * t <= p * q:
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))
    return torch.bmm(g.transpose(1, 2), a).square().sum(dim=(1, 2))


Pair = tuple[int, int]


def _conv_geometry(
    m: nn.Conv1d | nn.Conv2d, a: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Pair, Pair, Pair, Pair]:
    """A Conv1d as a Conv2d of height 1: the input and output gradient with a height axis, and the
    kernel size, dilation, padding and stride as pairs (numeric padding: string padding falls back)."""
    if isinstance(m, nn.Conv1d):
        pad = cast(tuple[int], m.padding)
        return a.unsqueeze(2), g.unsqueeze(2), (1, m.kernel_size[0]), (1, m.dilation[0]), (0, pad[0]), (1, m.stride[0])
    pad2 = cast(Pair, m.padding)
    k, d, s = cast(Pair, m.kernel_size), cast(Pair, m.dilation), cast(Pair, m.stride)
    return a, g, k, d, pad2, s


def _linear_sq(m: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    b = a.shape[0]
    if a.ndim == 2:  # ||g a^T||^2 = ||a||^2 ||g||^2, norms accumulated in float64 in one fused pass each
        a_sq = torch.linalg.vector_norm(a, dim=1, dtype=torch.float64).square()
        g_sq = torch.linalg.vector_norm(g, dim=1, dtype=torch.float64).square()
        sq: torch.Tensor = a_sq * g_sq
        if m.bias is not None:
            sq = sq + g_sq
        return sq
    a64, g64 = a.reshape(b, -1, a.shape[-1]).double(), g.reshape(b, -1, g.shape[-1]).double()
    out = _gram_or_explicit(a64, g64)
    if m.bias is not None:
        out = out + g64.sum(dim=1).square().sum(dim=1)
    return out


def _conv_supported(m: nn.Module, a: torch.Tensor) -> bool:
    if not isinstance(m, nn.Conv1d | nn.Conv2d) or isinstance(m, nn.modules.conv._ConvTransposeNd):
        return False
    spatial = 1 if isinstance(m, nn.Conv1d) else 2
    return m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str) and a.ndim == spatial + 2


def _patches(
    a: torch.Tensor,
    k: tuple[int, int],
    d: tuple[int, int],
    p: tuple[int, int],
    s: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The unfolded input (b, L, k C) in ``dtype``: each patch's features in (kernel row, column, channel) order.

    The weight's per-record gradient is the linear layer's on these patches, with its input
    features permuted; only norms are computed from them, which do not depend on the order. The
    input is copied once channels-last, then one strided copy gathers the patches with each
    channel run contiguous (faster than the (C, k) order of ``F.unfold``).
    """
    padded = nn.functional.pad(a, (p[1], p[1], p[0], p[0]))
    b, c, h, w = padded.shape
    oh, ow = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1, (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
    last = torch.empty((b, h, w, c), dtype=dtype, device=a.device)
    last.copy_(padded.permute(0, 2, 3, 1))
    sb, sh, sw, sc = last.stride()
    view = last.as_strided((b, oh, ow, k[0], k[1], c), (sb, sh * s[0], sw * s[1], sh * d[0], sw * d[1], sc))
    return view.reshape(b, oh * ow, c * k[0] * k[1])


def _conv_sq(m: nn.Conv1d | nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-record squared norm of a convolution's gradient: Gram over output positions, or explicit.

    The weight's per-record gradient is the linear layer's on the unfolded input (L positions of
    C k inputs). When the float64 L x L Gram (2 L^2 (C k + C_out) work, float64 counted twice) is
    cheaper than the explicit float32 (C_out, C k) gradient (L C_out C k), the Gram; else the
    explicit gradient, one batched matmul per block of records, its squares summed in float64.
    Records are taken in blocks of about :data:`_BLOCK_FLOATS` floats, so that the patches and
    gradients of a block stay in cache (an unblocked chunk of them is memory-bound, several times
    slower).
    """
    b = a.shape[0]
    a2, g2, k, d, p, s = _conv_geometry(m, a, g)
    c_in, c_out = a2.shape[1], g2.shape[1]
    positions, inputs = g2.shape[2] * g2.shape[3], c_in * k[0] * k[1]
    gb = g2.reshape(b, c_out, positions)
    out = torch.empty(b, dtype=torch.float64, device=a.device)
    if 2 * positions * (inputs + c_out) <= c_out * inputs:
        step = max(1, _BLOCK_FLOATS // (2 * positions * (inputs + c_out + positions)))
        for i in range(0, b, step):
            u = _patches(a2[i : i + step], k, d, p, s, torch.float64)
            out[i : i + step] = _gram_or_explicit(u, gb[i : i + step].transpose(1, 2).double())
    else:
        step = max(1, _BLOCK_FLOATS // (inputs * (positions + c_out)))
        for i in range(0, b, step):
            grads = torch.bmm(gb[i : i + step], _patches(a2[i : i + step], k, d, p, s, a.dtype))
            out[i : i + step] = torch.linalg.vector_norm(grads.flatten(1), dim=1, dtype=torch.float64).square()
    if m.bias is not None:
        out = out + g2.double().sum(dim=(2, 3)).square().sum(dim=1)
    return out


def _embedding_supported(m: nn.Module) -> bool:
    return isinstance(m, nn.Embedding) and m.max_norm is None and not m.scale_grad_by_freq


def _embedding_sq(m: nn.Embedding, idx: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum over positions s, t with equal indices of g_s . g_t (the padding index gets no gradient)."""
    b = idx.shape[0]
    idx2 = idx.reshape(b, -1)
    g64 = g.reshape(b, idx2.shape[1], -1).double()
    if m.padding_idx is not None:
        g64 = g64 * (idx2 != m.padding_idx).unsqueeze(-1)
    t, v, dim = idx2.shape[1], m.num_embeddings, g64.shape[2]
    if t * t <= v * dim:
        same = (idx2.unsqueeze(2) == idx2.unsqueeze(1)).to(torch.float64)
        return (same * torch.bmm(g64, g64.transpose(1, 2))).sum(dim=(1, 2))
    explicit = torch.zeros(b, v, dim, dtype=torch.float64, device=g.device)
    explicit.scatter_add_(1, idx2.unsqueeze(-1).expand(-1, -1, dim), g64)
    return explicit.square().sum(dim=(1, 2))


def _module_sq(m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-record squared norm of the gradient of ``m``'s own parameters, by torch.func (vmap over vjp)."""
    params = {name: p.detach() for name, p in m.named_parameters(recurse=False)}
    per_record = max(1, sum(p.numel() for p in params.values()))

    def one(ai: torch.Tensor, gi: torch.Tensor) -> torch.Tensor:
        pull = vjp(lambda p: functional_call(m, p, (ai.unsqueeze(0),)), params)[1]
        (grads,) = pull(gi.unsqueeze(0))
        return sum((gr.double().square().sum() for gr in grads.values()), torch.zeros((), dtype=torch.float64))

    step = max(1, _EXPLICIT_FLOATS // per_record)
    return torch.cat([vmap(one)(a[i : i + step], g[i : i + step]) for i in range(0, a.shape[0], step)])


def _layer_sq(m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if isinstance(m, nn.Linear) and a.is_floating_point():
        return _linear_sq(m, a, g)
    if _conv_supported(m, a):
        return _conv_sq(m, a, g)  # type: ignore[arg-type]
    if _embedding_supported(m):
        return _embedding_sq(m, a, g)  # type: ignore[arg-type]
    return _module_sq(m, a, g)


# -- the fused sum: each layer's weighted parameter gradient from the same (a, g) -------------------


def _rows_where(keep: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` for the records in ``keep``, exact zeros for the others: the same torch.where on every record."""
    return torch.where(keep.reshape(-1, *([1] * (t.ndim - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _layer_sum(
    m: nn.Module, a: torch.Tensor, g: torch.Tensor, w: torch.Tensor, keep: torch.Tensor
) -> dict[str, torch.Tensor]:
    """sum_i w_i (record i's gradient of ``m``'s own parameters), from the input ``a`` and backprop ``g``.

    No forward or backward of the model: ``nn.Linear`` (w g)^T a over records and positions;
    ``nn.Conv1d``/``nn.Conv2d`` the convolution's weight-gradient kernel (``convolution_backward``
    with the weighted backprop as output gradient, no input gradient); ``nn.Embedding`` an
    index_add of the weighted backprop rows; any other leaf one vjp of that module alone at ``a``
    with cotangent w g (a gradient is linear in its cotangent: the batch vjp is the weighted sum of
    the per-record ones). A record outside ``keep`` enters as zeros in both ``a`` and ``g``
    (0 * inf would be NaN), by the same torch.where on every record.
    """
    gw = _rows_where(keep, g * w.reshape(-1, *([1] * (g.ndim - 1))))
    if isinstance(m, nn.Linear) and a.is_floating_point():
        a2, g2 = _rows_where(keep, a).reshape(-1, a.shape[-1]), gw.reshape(-1, gw.shape[-1])
        out = {"weight": torch.mm(g2.t(), a2)}
        if m.bias is not None:
            out["bias"] = g2.sum(dim=0)
        return out
    if _conv_supported(m, a):
        conv: nn.Conv1d | nn.Conv2d = m  # type: ignore[assignment]
        has_bias = conv.bias is not None
        _, weight, bias = torch.ops.aten.convolution_backward(
            gw,
            _rows_where(keep, a),
            conv.weight.detach(),
            [conv.out_channels] if has_bias else None,
            list(conv.stride),
            list(conv.padding),
            list(conv.dilation),
            False,
            [0] * len(conv.stride),
            conv.groups,
            [False, True, has_bias],
        )
        return {"weight": weight, "bias": bias} if has_bias else {"weight": weight}
    if _embedding_supported(m):
        emb: nn.Embedding = m  # type: ignore[assignment]
        idx = a.reshape(-1)
        rows = gw.reshape(idx.numel(), -1)
        if emb.padding_idx is not None:  # the padding index gets no gradient
            rows = _rows_where(idx != emb.padding_idx, rows)
        return {"weight": torch.zeros_like(emb.weight.detach()).index_add_(0, idx, rows)}
    params = {name: p.detach() for name, p in m.named_parameters(recurse=False)}
    pull = vjp(lambda p: functional_call(m, p, (_rows_where(keep, a),)), params)[1]
    (grads,) = pull(gw)
    return dict(grads)


class _Unsupported(Exception):
    """The hooks cannot see this model completely: use the whole-model fallback."""


@dataclass
class _Capture:
    """Forward hooks on the leaf modules that own parameters: each call's input and output."""

    modules: list[nn.Module]
    calls: dict[int, list[tuple[torch.Tensor, torch.Tensor, int, int]]] = field(default_factory=dict)
    problem: str = ""
    active: bool = False

    def hook(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if not self.active:
            return
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            self.problem = f"{type(m).__name__} called with other than one tensor in and one tensor out"
            return
        self.calls.setdefault(id(m), []).append((args[0], out, args[0]._version, out._version))


def _hooked_modules(model: nn.Module) -> list[nn.Module]:
    """The leaf modules that own parameters; raises _Unsupported if some parameter is owned elsewhere."""
    owners: dict[int, str] = {}
    modules = []
    for name, m in model.named_modules(remove_duplicate=False):
        own = [p for p in m._parameters.values() if p is not None]
        if not own:
            continue
        if any(True for _ in m.children()):
            raise _Unsupported(f"module {name!r} owns parameters and has children")
        for p in own:
            if id(p) in owners and owners[id(p)] != name:
                raise _Unsupported(f"parameter shared by {owners[id(p)]!r} and {name!r}")
            owners[id(p)] = name
        if m not in modules:
            modules.append(m)
    if any(id(p) not in owners for p in model.parameters()):
        raise _Unsupported("a parameter is not owned by a leaf module")
    return modules


Captured = list[tuple[nn.Module, torch.Tensor, torch.Tensor]]


def _hooked_chunk(
    model: nn.Module,
    loss_fn: LossFn,
    capture: _Capture,
    leaves: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    *,
    check: bool,
) -> tuple[torch.Tensor, Captured]:
    """One chunk's per-record squared norms from hooks, and each used module's (module, a, g).

    One forward, one backward with respect to the modules' outputs (no parameter gradient, except
    on a ``check`` chunk, which also validates the hooks against autograd).
    """
    capture.calls.clear()
    capture.problem = ""
    capture.active = True
    try:
        total = (_losses(loss_fn, functional_call(model, (leaves, buffers), (x,)), y) * w).sum()
    finally:
        capture.active = False
    if capture.problem:
        raise _Unsupported(capture.problem)
    seen = [(m, capture.calls.get(id(m), [])) for m in capture.modules]
    if any(len(calls) > 1 for _, calls in seen):
        raise _Unsupported("a module with parameters is called more than once per forward")
    used = [(m, calls[0]) for m, calls in seen if calls]
    for _, (a, out, va, vo) in used:
        if a._version != va or out._version != vo:
            raise _Unsupported("a module's input or output is modified in place")
    outs = [out for _, (_, out, _, _) in used]
    wanted = outs + (list(leaves.values()) if check else [])
    grads = torch.autograd.grad(total, wanted, allow_unused=True) if wanted else ()
    sq = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    captured: Captured = []
    for (m, (a, _out, _, _)), g in zip(used, grads[: len(outs)], strict=True):
        if g is not None:  # None: the module's output does not reach the loss, its gradient is 0
            captured.append((m, a.detach(), g.detach()))
            sq += _layer_sq(m, a.detach(), g.detach())
    if check:
        _check_hooks(model, used, grads[: len(outs)], dict(zip(leaves, grads[len(outs) :], strict=True)))
    capture.calls.clear()
    return sq, captured


def _check_hooks(
    model: nn.Module,
    used: Sequence[tuple[nn.Module, tuple[torch.Tensor, torch.Tensor, int, int]]],
    out_grads: Sequence[torch.Tensor | None],
    autograd_grads: dict[str, torch.Tensor | None],
) -> None:
    """The batch gradient the hooked calls imply must be autograd's: else a parameter is used unseen."""
    implied: dict[int, torch.Tensor] = {}
    for (m, (a, _, _, _)), g in zip(used, out_grads, strict=True):
        params = {name: p.detach() for name, p in m.named_parameters(recurse=False)}
        if g is None:
            continue
        pull = vjp(lambda p, m=m, a=a: functional_call(m, p, (a.detach(),)), params)[1]
        (grads,) = pull(g.detach())
        for name, p in m.named_parameters(recurse=False):
            implied[id(p)] = grads[name]
    names = dict(model.named_parameters())
    for name, got in autograd_grads.items():
        want = implied.get(id(names[name]))
        want = torch.zeros_like(names[name]) if want is None else want
        got = torch.zeros_like(want) if got is None else got
        scale = float(want.double().norm() + got.double().norm())
        if not float((want.double() - got.double()).norm()) <= 1e-3 * scale + 1e-30:
            raise _Unsupported(f"parameter {name!r} gets gradient the module hooks do not see")


def _per_example_rows(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
) -> Iterator[tuple[int, dict[str, torch.Tensor], torch.Tensor]]:
    """vmap(grad) rows of the whole model, per sub-batch of bounded memory: (offset, rows, squared norms)."""
    grads_fn, params = example_gradients_fn(model, loss_fn, x.device)
    d = max(1, sum(p.numel() for p in params.values()))
    step = max(1, _EXPLICIT_FLOATS // d)
    for i in range(0, x.shape[0], step):
        grads = grads_fn(params, x[i : i + step], y[i : i + step], w[i : i + step])
        sq = torch.zeros(min(step, x.shape[0] - i), dtype=torch.float64, device=x.device)
        for g in grads.values():
            sq = sq + g.reshape(g.shape[0], -1).double().square().sum(dim=1)
        yield i, grads, sq


def _fallback_chunk_sq(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """Per-record squared norms by vmap(grad) of the whole model, in sub-batches of bounded memory."""
    return torch.cat([sq for _, _, sq in _per_example_rows(model, loss_fn, x, y, w)])


def record_norms(
    model: nn.Module,
    loss_fn: LossFn,
    source: RecordSource,
    *,
    valid: Validity | None = None,
    chunk_size: int = 1024,
    device: str = "cpu",
    ghost: bool = True,
) -> tuple[NDArray[np.float64], str]:
    """The norms pass alone: each record's gradient L2 norm (float64, (n,)) and the method ("hooks" or "fallback").

    A null record's norm is exactly 0; a record whose gradient overflows has a non-finite norm.
    """
    check_model(model)
    chunk_size = _chunk_size(chunk_size)
    dev = torch.device(device)
    model = _on_device(model, dev)
    n = len(source)
    out = torch.empty(n, dtype=torch.float64)
    leaves, buffers = _leaves(model, dev)
    try:
        capture: _Capture | None = _Capture(_hooked_modules(model)) if ghost else None
    except _Unsupported:
        capture = None
    handles = [m.register_forward_hook(capture.hook, with_kwargs=True) for m in capture.modules] if capture else []
    try:
        start = 0
        first = True
        for xb, yb in source.batches(chunk_size):
            x, y, w = _chunk_tensors(xb, yb, None, valid=valid, device=dev)
            sq = None
            if capture is not None:
                try:
                    sq = _hooked_chunk(model, loss_fn, capture, leaves, buffers, x, y, w, check=first)[0]
                except _Unsupported:
                    if not first:  # the structure of the forward changed from chunk to chunk
                        raise
                    capture = None
            if sq is None:
                sq = _fallback_chunk_sq(model, loss_fn, x, y, w)
            out[start : start + len(sq)] = sq.detach().cpu()
            start += len(sq)
            first = False
    finally:
        for h in handles:
            h.remove()
    if start != n:
        raise ValueError(f"source: expected {n} records from batches(), got {start}")
    return out.sqrt_().numpy(), "hooks" if capture is not None else "fallback"


# -- the fused pass: norms, weights, and the weighted sum from one forward and one backward --------


WeightsFn = Callable[[int, NDArray[np.float64]], NDArray[np.floating]]
"""``weights(start, norms) -> w``: the weights of records ``start .. start + len(norms) - 1`` from their norms.

Called once for every record, in order, on consecutive runs of records (a chunk, or a sub-batch of
the fallback); each record's weight may depend only on its own norm (and on state fixed before
the pass). ``norms`` are float64, non-finite for a record whose gradient overflows.
"""


class _Weigher:
    """Asks ``weights`` for each run of records, checks the answer, and gives it back as float32 weights and a mask.

    A record's mask is ``w != 0`` and a finite, non-zero norm: a record outside it enters the sum as
    exact zeros, whatever the weight said (the same torch.where on every record).
    """

    def __init__(self, weights: WeightsFn, n: int, device: torch.device) -> None:
        self.weights, self.n, self.device, self.next = weights, n, device, 0

    def __call__(self, start: int, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if start != self.next:
            raise RuntimeError(f"weights: records {self.next}.. expected next, asked for {start}..")
        raw = norms.detach().to("cpu", torch.float64).numpy()
        w = np.asarray(self.weights(start, raw), dtype=np.float64)
        if w.shape != raw.shape or not bool(np.isfinite(w).all()):
            raise ValueError(f"weights: expected {raw.size} finite values, got shape {w.shape}")
        self.next = start + raw.size
        wt = torch.from_numpy(w).to(device=self.device, dtype=torch.float32)
        keep = (wt != 0) & torch.isfinite(norms) & (norms > 0)
        return wt, keep.to(self.device)


def _fallback_chunk(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    usable: torch.Tensor,
    weigh: _Weigher,
    start: int,
    add: Callable[[str, torch.Tensor], None],
) -> torch.Tensor:
    """The whole-model fallback, fused: per sub-batch, vmap(grad) rows, their norms, weights, weighted sum."""
    parts = []
    for i, grads, sq in _per_example_rows(model, loss_fn, x, y, usable):
        norms = sq.sqrt()
        w, keep = weigh(start + i, norms)
        for name, g in grads.items():
            add(name, torch.tensordot(w, _rows_where(keep, g), dims=1))
        parts.append(norms)
    return torch.cat(parts)


def fused_clipped_sum(
    model: nn.Module,
    loss_fn: LossFn,
    source: RecordSource,
    weights: WeightsFn,
    *,
    valid: Validity | None = None,
    chunk_size: int = 1024,
    device: str = "cpu",
    ghost: bool = True,
) -> tuple[NDArray[np.float64], NDArray[np.float64], str]:
    """One pass: each record's gradient norm, and sum_i w_i g_i with the weights ``weights`` gives from the norms.

    Returns (norms float64 (n,), the sum float64 (d,), the method: "hooks" or "fallback"). Per
    chunk: one forward, one backward with respect to the hooked modules' outputs, the norms from
    the captured (a, g) as :func:`record_norms` computes them, ``weights`` for the chunk's records,
    then each module's weighted parameter gradient from the same (a, g) (:func:`_layer_sum`); the
    fallback forms per-record gradients by vmap(grad) per sub-batch and weights those. A record
    with weight 0, a non-finite or a zero norm (a null record included) contributes exact zeros;
    a sum that is still not finite (or a null element whose gradient is not) raises
    :class:`NonFiniteSumError`. Memory is bounded by one chunk.
    """
    check_model(model)
    chunk_size = _chunk_size(chunk_size)
    dev = torch.device(device)
    model = _on_device(model, dev)
    n = len(source)
    norms_out = torch.empty(n, dtype=torch.float64)
    leaves, buffers = _leaves(model, dev)
    offsets: dict[str, tuple[int, int]] = {}
    for name, p in leaves.items():
        offsets[name] = (sum(size for _, size in offsets.values()), p.numel())
    total = torch.zeros(sum(size for _, size in offsets.values()), dtype=torch.float64, device=dev)

    def add(name: str, grad: torch.Tensor) -> None:
        offset, size = offsets[name]
        total[offset : offset + size] += grad.reshape(-1).double()

    full_names = {id(p): name for name, p in model.named_parameters()}
    try:
        capture: _Capture | None = _Capture(_hooked_modules(model)) if ghost else None
    except _Unsupported:
        capture = None
    owned = {
        (id(m), local): full_names[id(p)]
        for m in (capture.modules if capture else [])
        for local, p in m.named_parameters(recurse=False)
    }
    handles = [m.register_forward_hook(capture.hook, with_kwargs=True) for m in capture.modules] if capture else []
    weigh = _Weigher(weights, n, dev)
    try:
        start = 0
        first = True
        for xb, yb in source.batches(chunk_size):
            x, y, usable = _chunk_tensors(xb, yb, None, valid=valid, device=dev)
            if first:  # data-independent: the null element at these parameters
                _check_null_element(model, loss_fn, leaves, buffers, x[:1], y[:1])
            norms = None
            if capture is not None:
                try:
                    sq, captured = _hooked_chunk(model, loss_fn, capture, leaves, buffers, x, y, usable, check=first)
                except _Unsupported:
                    if not first:  # the structure of the forward changed from chunk to chunk
                        raise
                    capture = None
                else:
                    norms = sq.sqrt()
                    w, keep = weigh(start, norms)
                    for m, a, g in captured:
                        for local, grad in _layer_sum(m, a, g, w, keep).items():
                            add(owned[(id(m), local)], grad)
                    del captured
            if norms is None:
                norms = _fallback_chunk(model, loss_fn, x, y, usable, weigh, start, add)
            norms_out[start : start + len(norms)] = norms.detach().cpu()
            start += len(norms)
            first = False
    finally:
        for h in handles:
            h.remove()
    if start != n or weigh.next != n:
        raise ValueError(f"source: expected {n} records from batches(), got {start}")
    out = total.cpu().numpy()
    if not np.isfinite(out).all():
        raise NonFiniteSumError(f"the clipped gradient sum over {len(offsets)} tensors is not finite")
    return norms_out.numpy(), out, "hooks" if capture is not None else "fallback"


# -- pass 2 of the two-pass path (the reference; Contributions.weighted_sum) -------------------------


def weighted_gradient_sum(
    model: nn.Module,
    loss_fn: LossFn,
    source: RecordSource,
    weights: NDArray[np.floating],
    *,
    keep: NDArray[np.bool_] | None = None,
    valid: Validity | None = None,
    chunk_size: int = 1024,
    device: str = "cpu",
) -> NDArray[np.float64]:
    """The two-pass path's second pass: sum_i weights_i g_i, float64 (d,), one weighted backward pass per chunk.

    A record outside ``keep`` (and any null record) is the null element: zero features, label 0,
    weight 0, by the same torch.where on every record. Raises :class:`NonFiniteSumError` if the
    null element's own gradient or the sum is not finite.
    """
    chunk_size = _chunk_size(chunk_size)
    n = len(source)
    w_all = np.asarray(weights, dtype=np.float64)
    if w_all.shape != (n,) or not np.isfinite(w_all).all():
        raise ValueError(f"weights: expected {n} finite values, got shape {w_all.shape}")
    keep_all = np.ones(n, dtype=np.bool_) if keep is None else np.asarray(keep, dtype=np.bool_)
    dev = torch.device(device)
    model = _on_device(model, dev)
    leaves, buffers = _leaves(model, dev)
    names = list(leaves)
    sizes = [p.numel() for p in leaves.values()]
    total = torch.zeros(sum(sizes), dtype=torch.float64, device=dev)
    start = 0
    null_checked = False
    for xb, yb in source.batches(chunk_size):
        b = len(yb)
        keep_b = torch.from_numpy(keep_all[start : start + b])
        x, y, usable = _chunk_tensors(xb, yb, keep_b, valid=valid, device=dev)
        if not null_checked:  # data-independent: the null element at these parameters
            _check_null_element(model, loss_fn, leaves, buffers, x[:1], y[:1])
            null_checked = True
        w = usable * torch.from_numpy(w_all[start : start + b]).to(device=dev, dtype=torch.float32)
        loss = (_losses(loss_fn, functional_call(model, (leaves, buffers), (x,)), y) * w).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        offset = 0
        for size, g in zip(sizes, grads, strict=True):
            if g is not None:
                total[offset : offset + size] += g.reshape(-1).double()
            offset += size
        start += b
    if start != n:
        raise ValueError(f"source: expected {n} records from batches(), got {start}")
    out = total.cpu().numpy()
    if not np.isfinite(out).all():
        raise NonFiniteSumError(f"the clipped gradient sum over {len(names)} tensors is not finite")
    return out


def _check_null_element(
    model: nn.Module,
    loss_fn: LossFn,
    leaves: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """The null element (zero features, label 0) must have a finite gradient, else weight 0 gives NaN, not 0."""
    xn, yn = torch.zeros_like(x), torch.zeros_like(y)
    loss = _losses(loss_fn, functional_call(model, (leaves, buffers), (xn,)), yn).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
        raise NonFiniteSumError("the null element's gradient is not finite at these parameters")


def _chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected an integer > 0, got {chunk_size!r}")
    return chunk_size


# -- contributions: what Agent.release clips, prices and sums -------------------------------------


class Contributions(Protocol):
    """Each unit's unclipped contribution, as the release kernel uses it (same work on every unit).

    ``norm_rel_error``: the relative error of :meth:`norms` against what :meth:`weighted_sum` adds
    up; the release clips to bound / (1 + norm_rel_error).
    """

    n_units: int
    dim: int
    norm_rel_error: float

    def norms(self) -> NDArray[np.float64]:
        """Each unit's L2 norm (float64; non-finite for a unit that overflows)."""
        ...

    def scale(self, scales: NDArray[np.float64]) -> NDArray[np.float64]:
        """Scale unit i by ``scales[i]`` (0 for a non-finite unit); return the norms to charge, >= the true ones."""
        ...

    def weighted_sum(self, weights: NDArray[Any]) -> NDArray[np.float64]:
        """sum_i weights[i] * (scaled unit i), float64 (d,)."""
        ...


class RowContributions:
    """Materialised float32 rows (n, d): indicators and client units. Scaled in place, measured after scaling."""

    norm_rel_error = 0.0

    def __init__(self, rows: NDArray[np.float32]) -> None:
        self.rows = rows if rows.flags.writeable else rows.copy()
        self.n_units, self.dim = self.rows.shape

    def norms(self) -> NDArray[np.float64]:
        """Each row's L2 norm in float64 (the values of ``np.linalg.norm(rows.astype(float64), axis=1)``).

        A row holding a NaN or an infinity has a non-finite norm, so this one pass also finds them.
        """
        rows = self.rows
        out = np.empty(len(rows), dtype=np.float64)
        for start in range(0, len(rows), _BLOCK_ROWS):
            out[start : start + _BLOCK_ROWS] = np.linalg.norm(
                rows[start : start + _BLOCK_ROWS].astype(np.float64), axis=1
            )
        return out

    def scale(self, scales: NDArray[np.float64]) -> NDArray[np.float64]:
        """Scale every row in place by its factor and return the scaled rows' norms (float64).

        Every row is multiplied, a factor of 1 included (exact in float32), and every entry passes
        through ``nan_to_num``: a non-finite row carries the factor 0, so it ends as the zero row
        (0 * inf is NaN, then 0). Rows with finite values and a factor in [0, 1] stay finite.
        """
        rows = self.rows
        factors = scales.astype(np.float32)[:, None]
        out = np.empty(len(rows), dtype=np.float64)
        for start in range(0, len(rows), _BLOCK_ROWS):
            block = rows[start : start + _BLOCK_ROWS]
            np.multiply(block, factors[start : start + _BLOCK_ROWS], out=block)
            np.nan_to_num(block, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
            out[start : start + _BLOCK_ROWS] = np.linalg.norm(block.astype(np.float64), axis=1)
        return out

    def weighted_sum(self, weights: NDArray[Any]) -> NDArray[np.float64]:
        """Multiply every row by its weight, in place, and return the sum of all rows (float64).

        The same multiply and add on every row: a unit left out is multiplied by 0, not skipped.
        """
        rows = self.rows
        factors = np.asarray(weights).astype(np.float32)[:, None]
        total = np.zeros(rows.shape[1], dtype=np.float64)
        for start in range(0, len(rows), _BLOCK_ROWS):
            block = rows[start : start + _BLOCK_ROWS]
            np.multiply(block, factors[start : start + _BLOCK_ROWS], out=block)
            total += block.sum(axis=0, dtype=np.float64)
        return total


class StreamedGradients:
    """Per-record gradients of ``loss_fn`` streamed from ``source``.

    :meth:`clipped_sum` is the fused pass (norms and the weighted sum in one pass; what
    Agent.release runs), after which :meth:`norms` is free. The two-pass path stays: :meth:`norms`
    alone runs the norms pass, :meth:`weighted_sum` a weighted backward pass.

    Privacy note: :meth:`scale` charges norm * scale * (1 + NORM_REL_ERROR) >= the norm of what
    the sum adds for the record; a record whose norm is not finite or is 0 contributes exact
    zeros, so nothing contributes that was not charged.
    """

    norm_rel_error = NORM_REL_ERROR

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        source: RecordSource,
        *,
        valid: Validity | None = None,
        chunk_size: int = 1024,
        device: str = "cpu",
        ghost: bool = False,
    ) -> None:
        """``ghost``: ghost norms and the book-keeping sum from hooks (fast). Off by default, and off in
        the agent: a hostile review found that the hooks' norm and sum can disagree far beyond
        NORM_REL_ERROR when one record's per-position terms cancel (float32 accumulation), that
        the hooks' first-chunk check can switch the method on one record's data (timing), and that
        a leaf with a NaN gradient at zero input fails on stopped records. Off, each record's
        gradient is formed by vmap(grad) per sub-batch, its norm and its weighted contribution
        come from that same row, and memory stays bounded by a sub-batch."""
        check_model(model)
        self.model, self.loss_fn, self.source = model, loss_fn, source
        self.valid, self.chunk_size, self.device = valid, _chunk_size(chunk_size), device
        self.ghost = ghost
        self.n_units = len(source)
        self.dim = sum(p.numel() for p in model.parameters())
        self.method = ""
        self._norms: NDArray[np.float64] | None = None
        self._scales: NDArray[np.float64] | None = None

    def norms(self) -> NDArray[np.float64]:
        if self._norms is None:
            self._norms, self.method = record_norms(
                self.model,
                self.loss_fn,
                self.source,
                valid=self.valid,
                chunk_size=self.chunk_size,
                device=self.device,
                ghost=self.ghost,
            )
        return self._norms

    def _sendable(self) -> NDArray[np.bool_]:
        norms = self.norms()
        return np.isfinite(norms) & (norms > 0.0)

    @staticmethod
    def charged_norms(norms: NDArray[np.float64], scales: NDArray[np.float64]) -> NDArray[np.float64]:
        """The norms to charge for records of ``norms`` scaled by ``scales``: norm * scale * (1 + E), 0 if not sendable.

        Elementwise, so a run of records gets exactly the values the whole array would: the fused
        pass's weights (:meth:`clipped_sum`) and the charge (:meth:`scale`) are computed alike.
        """
        norms = np.asarray(norms, dtype=np.float64)
        ok = np.isfinite(norms) & (norms > 0.0)
        kept = np.where(ok, np.asarray(scales, dtype=np.float64), 0.0)
        return np.where(ok, norms, 0.0) * kept * (1.0 + NORM_REL_ERROR)

    def scale(self, scales: NDArray[np.float64]) -> NDArray[np.float64]:
        ok = self._sendable()
        self._scales = np.where(ok, np.asarray(scales, dtype=np.float64), 0.0)
        return self.charged_norms(self.norms(), scales)

    def clipped_sum(self, weights: WeightsFn) -> NDArray[np.float64]:
        """The fused pass (:func:`fused_clipped_sum`): sum_i w_i g_i, w from ``weights``; then :meth:`norms` is free.

        This is how :meth:`client_agent.agent.Agent.release` uses record gradients: the filter's
        decision for a record depends only on its own norm and its state before the request, so
        ``weights`` decides it chunk by chunk, and the charge, computed afterwards from
        :meth:`norms` and :meth:`scale` over all records, must record exactly those weights.
        """
        self._norms, total, self.method = fused_clipped_sum(
            self.model,
            self.loss_fn,
            self.source,
            weights,
            valid=self.valid,
            chunk_size=self.chunk_size,
            device=self.device,
            ghost=self.ghost,
        )
        return total

    def weighted_sum(self, weights: NDArray[Any]) -> NDArray[np.float64]:
        scales = np.ones(self.n_units) if self._scales is None else self._scales
        return weighted_gradient_sum(
            self.model,
            self.loss_fn,
            self.source,
            scales * np.asarray(weights, dtype=np.float64),
            keep=self._sendable(),
            valid=self.valid,
            chunk_size=self.chunk_size,
            device=self.device,
        )


def contributions_of(rows_or_contributions: Contributions | NDArray[np.float32]) -> Contributions:
    """A :class:`Contributions`: materialised rows are wrapped in :class:`RowContributions`."""
    if isinstance(rows_or_contributions, np.ndarray):
        return RowContributions(rows_or_contributions)
    return rows_or_contributions


__all__ = [
    "NORM_REL_ERROR",
    "ArraySource",
    "Contributions",
    "NonFiniteSumError",
    "RecordSource",
    "RowContributions",
    "StreamedGradients",
    "WeightsFn",
    "contributions_of",
    "fused_clipped_sum",
    "record_norms",
    "weighted_gradient_sum",
]
