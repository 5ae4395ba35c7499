"""Per-record gradient contributions, streamed chunk by chunk: memory bounded by a chunk, never by n x d.

One fused pass over the records, on the activations and backprops of the model's layers (as in
the book-keeping method of Bu et al. 2022, "Differentially Private Optimization on Large Model at
Small Cost", and Opacus's ``grad_sample`` layers and fast gradient clipping). Per chunk,
:func:`fused_clipped_sum`:

1. one forward, capturing the input ``a`` of every leaf module that owns parameters (forward
   hooks), and one backward with respect to those modules' outputs (their backprops ``g``; no
   parameter gradient is formed);
2. ``nn.Linear`` on (b, in): each record's gradient is the outer product g a^T, its norm
   ||a|| ||g|| (float64), and its weighted sum over records (w g)^T a is formed in float64 at the
   end of the chunk (each entry a sum over records of one product each: no cancellation inside
   a record is possible);
3. every other layer, per block of records: each record's own gradient of that layer, the
   *rows* (:class:`_Rows`): ``nn.Linear`` on sequences one bmm g^T a; ``nn.Conv1d``/``nn.Conv2d``
   (groups 1, zero padding) the backprop times the unfolded input, in cache-sized blocks;
   ``nn.Embedding`` each token's summed backprop at its first position; any other leaf
   (``nn.LayerNorm``, ``nn.GroupNorm``, custom) ``torch.func`` vmap over the vjp of that one
   module. The block's norms (float64, over the rows and the outer products), its weights w_i
   from the caller (``weights(start, norms)``: Agent.release's clip scale x admitted, each record's
   from its own norm and its state before the request), then sum_i w_i rows_i in float64.

Each record's norm is computed from exactly the values its weighted contribution is summed from.
(Ghost norms, the Gram of a and g, are not used: a review found that a record whose per-position
terms cancel gets a float64 Gram norm that disagrees with a float32 book-keeping sum by 10^4x.)

A model the hooks cannot see completely falls back to vmap(grad) of the whole model per sub-batch:
the per-record gradients formed for the norms are weighted and summed. Which method runs is
decided once per request on a data-independent batch. :func:`record_norms` is the fused pass with
every weight 0; :func:`weighted_gradient_sum` (a weighted backward pass) is the two-pass path's
second pass, the reference the fused pass is tested against.

Privacy notes (privacy.md §1, §2, §8):

- The null element: a record whose features are not finite, or that the workload's ``valid``
  rule rejects (e.g. a label the model cannot take), gets zero features, target 0 and weight 0
  in the loss, so its norm is 0 and its contribution exactly zero. In the sum, a record whose
  weight is 0, or whose norm is not finite or is 0, enters as exact zeros (a torch.where on its
  rows, or on its a and g: 0 * inf would be NaN), whatever weight the caller gave it, so every
  record that contributes anything was charged for it. Nothing is evaluated at a stopped record's
  zeroed input. The null element's own gradient is checked to be finite once per request (a
  data-independent check); a sum that is still not finite raises :class:`NonFiniteSumError`
  before anything is charged.
- Float error: the norm is float64 over the released float32 values, the sum float64 products and
  additions of them, so a record's norm and the norm of what the sum adds for it differ by a few
  float64 roundings per entry (relative error below d x 2^-52), far inside the declared
  :data:`NORM_REL_ERROR`; the release clips to bound / (1 + E) and charges norm * scale * (1 + E).
  The float64 accumulation across records adds at most gamma_n x sum_i (charged norm_i) over n
  records (gamma_n = n 2^-53 / (1 - n 2^-53): below 10^-11 of the charged total at n = 60,000),
  not attributed to any record. On CUDA, TF32 is off for the pass.
- The work does not depend on who stopped: every record goes through the same operations; a
  stopped record has weight 0, never a skipped branch.
- Records must not interact: BatchNorm (and Dropout in training mode) are rejected. A custom leaf
  module that reads another module's parameters is not seen by the hooks: on the data-independent
  batch the hooks' gradients are checked against autograd's (relative 1e-3), and a mismatch
  selects the whole-model fallback for the request.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.func import functional_call, vjp, vmap

from client_agent.gradients import LossFn, check_no_batch_norm, example_gradients_fn
from protocol.errors import FedfilterError

# Declared relative bound on |a record's norm - ||what the sum adds for it||| / ||what the sum adds||.
# Both are float64 over the same float32 values (module docstring), so the true difference is a few
# float64 roundings per entry, below d x 2^-52 (2 x 10^-7 at d = 10^9): 1e-4 is a wide margin.
NORM_REL_ERROR = 1e-4
# Floats per sub-batch for the explicit per-record paths (torch.func leaves, the whole-model
# fallback): 2^25 floats is 128 MiB in float32, 256 MiB in float64.
_EXPLICIT_FLOATS = 1 << 25
_SYNTHETIC = 3  # records in the data-independent batch that chooses the method
_SUM_RECORDS = 64  # records of rows converted to float64 at a time for the weighted sum
_BLOCK_ROWS = 256  # rows per block for materialised rows: float64 temporaries of a few MB
# Floats per block of records for the convolutions' norms (patches and per-record gradients of a
# block): 2^19 floats is 2 MiB in float32, about what stays in a core's cache.
_BLOCK_FLOATS = 1 << 19


class NonFiniteSumError(FedfilterError, ArithmeticError):
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

    Validity is decided on the source's side (``valid`` sees the chunk as the source gave it, its
    own dtype and device; finiteness is also checked after the conversion to float32 / int64),
    then the chunk moves to ``device``. The same torch.where on every record: zero features, zero
    target, weight 0.
    """
    x0, y0 = batch_tensor(x), batch_tensor(y)
    xt, yt = _as_tensor(x0), _as_tensor(y0)
    usable = finite_records(xt, yt)
    if valid is not None:  # on the source's own values: a float64 label 2.0000001 is not rounded to class 2 first
        usable &= valid(x0, y0).to(usable.device)
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


# -- per-record rows: each layer's per-record gradient, exactly the values that are released ------


@dataclass
class _Rows:
    """A block of records' gradients of one module's own parameters: their norms are taken from these
    values, and their weighted sum is what is released, so the two cannot disagree.

    ``tensors``: local parameter name -> (B, ...) rows; ``to_param``: maps a summed row to the
    parameter's layout (a convolution's rows are in patch order); ``index`` (embeddings): the
    token id of each row position, (B, T), the rows being (B, T, dim) with each token's gradient
    at its first position in the record and zeros at its repeats.
    """

    tensors: dict[str, torch.Tensor]
    to_param: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    index: torch.Tensor | None = None

    def sq(self, b: int, device: torch.device) -> torch.Tensor:
        """Each record's squared norm over these rows, float64 (B,), by :func:`_squared_norms`."""
        out = torch.zeros(b, dtype=torch.float64, device=device)
        for t in self.tensors.values():
            out += _squared_norms(t.reshape(b, -1))
        return out

    def add(self, wk: torch.Tensor, keep: torch.Tensor, view: Callable[[str], torch.Tensor]) -> None:
        """view(name) += sum_i wk_i rows_i; a record outside ``keep`` enters as exact zeros.

        The rows are zeroed in place outside ``keep`` (the same masked fill on every record: a
        non-finite row times 0 would be NaN), then summed weighted in float64, a run of
        :data:`_SUM_RECORDS` records converted at a time (small enough to stay in cache): each
        product is exact to float64 rounding, and including or leaving out a record changes the
        rounding of the others' sum by float64 amounts only (a float32 sum of a run would let it move
        by about 2^-24 of the run's total, which a tiny record's charge does not cover).
        """
        for name, t in self.tensors.items():
            t.masked_fill_(~keep.reshape(-1, *([1] * (t.ndim - 1))), 0.0)
            if self.index is not None:
                weighted = t.to(torch.float64) * wk.reshape(-1, *([1] * (t.ndim - 1)))
                view(name).index_add_(0, self.index.reshape(-1), weighted.reshape(-1, t.shape[-1]))
                continue
            flat = t.reshape(t.shape[0], -1)
            summed = torch.zeros(flat.shape[1], dtype=torch.float64, device=flat.device)
            for i in range(0, flat.shape[0], _SUM_RECORDS):
                summed += torch.mv(flat[i : i + _SUM_RECORDS].t().to(torch.float64), wk[i : i + _SUM_RECORDS])
            summed_shaped = summed.view(t.shape[1:])
            view(name).add_(self.to_param[name](summed_shaped) if name in self.to_param else summed_shaped)


def _squared_norms(flat: torch.Tensor) -> torch.Tensor:
    """Each row's squared L2 norm, float64 (B,), with a relative error below 2^-17.

    Float32 sums of squares over runs of at most 64 entries (relative error at most gamma_65 =
    65 x 2^-24 / (1 - 65 x 2^-24), about 3.9e-6: every term is >= 0, so no cancellation), the runs
    accumulated in float64: as fast as a float32 norm, and rigorously inside NORM_REL_ERROR (a
    float32 norm over the whole row has the bound gamma_d, above 1e-4 from d = 1,700). A row too
    short or oddly sized for runs of 8 or more is summed in float64 directly. (Entries below 2^-63
    in magnitude may underflow when squared in float32: an absolute error below sqrt(d) 2^-74 in
    the norm, far below any noise.)
    """
    b, d = flat.shape
    run = 64
    while run >= 8 and d % run:
        run //= 2
    if run < 8:
        out: torch.Tensor = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64).square()
        return out
    runs: torch.Tensor = torch.linalg.vector_norm(flat.reshape(b, d // run, run), dim=2)
    return runs.to(torch.float64).square().sum(dim=1)


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


def _is_outer(m: nn.Module, a: torch.Tensor) -> bool:
    """``nn.Linear`` on (b, in): each record's gradient g a^T is an outer product, its norm ||a|| ||g||."""
    return isinstance(m, nn.Linear) and a.is_floating_point() and a.ndim == 2


def _outer_sq(m: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||g a^T||^2 = ||a||^2 ||g||^2 (+ ||g||^2 for the bias), float64 (b,): no sum over positions."""
    a_sq = torch.linalg.vector_norm(a, dim=1, dtype=torch.float64).square()
    g_sq = torch.linalg.vector_norm(g, dim=1, dtype=torch.float64).square()
    sq: torch.Tensor = a_sq * g_sq
    if m.bias is not None:
        sq = sq + g_sq
    return sq


def _outer_sum(
    m: nn.Linear, a: torch.Tensor, g: torch.Tensor, wk: torch.Tensor, keep: torch.Tensor
) -> dict[str, torch.Tensor]:
    """sum_i wk_i g_i a_i^T (and sum_i wk_i g_i), float64: each entry a sum over records of one product each."""
    gw = _rows_where(keep, g).to(torch.float64) * wk.unsqueeze(1)
    out = {"weight": torch.mm(gw.t(), _rows_where(keep, a).to(torch.float64))}
    if m.bias is not None:
        out["bias"] = gw.sum(dim=0)
    return out


def _linear_rows(m: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> _Rows:
    """``nn.Linear`` on sequences (b, ..., in): each record's sum over positions of g_t a_t^T, one bmm."""
    b = a.shape[0]
    a3, g3 = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
    rows = {"weight": torch.bmm(g3.transpose(1, 2), a3)}
    if m.bias is not None:
        rows["bias"] = g3.sum(dim=1)
    return _Rows(rows)


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
) -> torch.Tensor:
    """The unfolded input (b, L, k C): each patch's features in (kernel row, column, channel) order.

    The input is copied once channels-last, then one strided copy gathers the patches with each
    channel run contiguous (faster than the (C, k) order of ``F.unfold``).
    """
    padded = nn.functional.pad(a, (p[1], p[1], p[0], p[0]))
    b, c, h, w = padded.shape
    oh, ow = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1, (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
    last = torch.empty((b, h, w, c), dtype=a.dtype, device=a.device)
    last.copy_(padded.permute(0, 2, 3, 1))
    sb, sh, sw, sc = last.stride()
    view = last.as_strided((b, oh, ow, k[0], k[1], c), (sb, sh * s[0], sw * s[1], sh * d[0], sw * d[1], sc))
    return view.reshape(b, oh * ow, c * k[0] * k[1])


def _conv_rows(m: nn.Conv1d | nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> _Rows:
    """Each record's convolution weight gradient: its backprop (C_out, L) times its unfolded input (L, C k).

    One batched matmul per block of about :data:`_BLOCK_FLOATS` floats of patches and rows, so that
    a block stays in cache (an unblocked chunk is memory-bound, several times slower). The rows
    are in patch order; ``to_param`` permutes a summed row to the weight's (C_out, C, *kernel).
    """
    b = a.shape[0]
    a2, g2, k, d, p, s = _conv_geometry(m, a, g)
    c_in, c_out = a2.shape[1], g2.shape[1]
    positions, inputs = g2.shape[2] * g2.shape[3], c_in * k[0] * k[1]
    gb = g2.reshape(b, c_out, positions)
    weight = torch.empty(b, c_out, inputs, dtype=a.dtype, device=a.device)
    step = max(1, _BLOCK_FLOATS // (inputs * (positions + c_out)))
    for i in range(0, b, step):
        torch.bmm(gb[i : i + step], _patches(a2[i : i + step], k, d, p, s), out=weight[i : i + step])
    shape = m.weight.shape

    def to_param(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(c_out, k[0], k[1], c_in).permute(0, 3, 1, 2).reshape(shape)

    rows = {"weight": weight}
    if m.bias is not None:
        rows["bias"] = gb.sum(dim=2)
    return _Rows(rows, {"weight": to_param})


def _embedding_supported(m: nn.Module) -> bool:
    return isinstance(m, nn.Embedding) and m.max_norm is None and not m.scale_grad_by_freq


def _embedding_rows(m: nn.Embedding, idx: torch.Tensor, g: torch.Tensor) -> _Rows:
    """Each record's embedding gradient as (T, dim) rows: at each token's first position, the sum of its
    positions' backprops; zeros at its repeats (the padding index gets no gradient).

    Per record, a stable sort of the ids groups each token's positions (the first of a group is
    the token's first position), a scatter-add sums each group, and a scatter puts each sum back at
    the first position: memory linear in T (a T x T equality matrix would take T^2 per record).
    """
    b = idx.shape[0]
    idx2 = idx.reshape(b, -1)
    g3 = g.reshape(b, idx2.shape[1], -1)
    if m.padding_idx is not None:
        g3 = torch.where((idx2 != m.padding_idx).unsqueeze(-1), g3, torch.zeros((), dtype=g3.dtype, device=g3.device))
    ids, order = idx2.sort(dim=1, stable=True)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    group = (starts.cumsum(dim=1) - 1).unsqueeze(-1).expand_as(g3)
    wide = order.unsqueeze(-1).expand_as(g3)
    sums = torch.zeros_like(g3).scatter_add_(1, group, g3.gather(1, wide))
    at_start = torch.where(
        starts.unsqueeze(-1), sums.gather(1, group), torch.zeros((), dtype=g3.dtype, device=g3.device)
    )
    rows = torch.zeros_like(g3).scatter_(1, wide, at_start)
    return _Rows({"weight": rows}, index=idx2)


def _module_rows(m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> _Rows:
    """Any other leaf (``nn.LayerNorm``, ``nn.GroupNorm``, custom): torch.func vmap over the vjp of that one module."""
    params = {name: p.detach() for name, p in m.named_parameters(recurse=False)}
    per_record = max(1, sum(p.numel() for p in params.values()))

    def one(ai: torch.Tensor, gi: torch.Tensor) -> dict[str, torch.Tensor]:
        pull = vjp(lambda p: functional_call(m, p, (ai.unsqueeze(0),)), params)[1]
        (grads,) = pull(gi.unsqueeze(0))
        return cast(dict[str, torch.Tensor], grads)

    step = max(1, _EXPLICIT_FLOATS // per_record)
    parts = [vmap(one)(a[i : i + step], g[i : i + step]) for i in range(0, a.shape[0], step)]
    return _Rows({name: torch.cat([part[name] for part in parts]) for name in params})


def _rows_of(m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> _Rows:
    if isinstance(m, nn.Linear) and a.is_floating_point():
        return _linear_rows(m, a, g)
    if _conv_supported(m, a):
        return _conv_rows(m, a, g)  # type: ignore[arg-type]
    if _embedding_supported(m):
        return _embedding_rows(m, a, g)  # type: ignore[arg-type]
    return _module_rows(m, a, g)


def _row_floats(m: nn.Module, a: torch.Tensor) -> int:
    """Floats of one record's rows of ``m``: its own parameters, or (T, dim) for an embedding."""
    if _embedding_supported(m):
        return max(1, a[0].numel()) * cast(nn.Embedding, m).embedding_dim
    return sum(p.numel() for p in m.parameters(recurse=False))


def _rows_where(keep: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` for the records in ``keep``, exact zeros for the others: the same torch.where on every record."""
    return torch.where(keep.reshape(-1, *([1] * (t.ndim - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


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
) -> Captured:
    """One chunk's (module, a, g) for every module with parameters that the loss reaches.

    One forward, one backward with respect to the modules' outputs (no parameter gradient, except
    on a ``check`` batch, which also validates the hooks against autograd).
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
        if a.ndim == 0 or out.ndim == 0 or a.shape[0] != x.shape[0] or out.shape[0] != x.shape[0]:
            # An input shared by the batch (a learned offset on a constant, positional embeddings on
            # arange(T)): its backprop sums every record's, so it has no per-record rows here.
            raise _Unsupported("a module with parameters takes or gives other than one row per record")
    outs = [out for _, (_, out, _, _) in used]
    wanted = outs + (list(leaves.values()) if check else [])
    grads = torch.autograd.grad(total, wanted, allow_unused=True) if wanted else ()
    captured: Captured = [
        (m, a.detach(), g.detach())
        for (m, (a, _out, _, _)), g in zip(used, grads[: len(outs)], strict=True)
        if g is not None  # None: the module's output does not reach the loss, its gradient is 0
    ]
    if check:
        _check_hooks(model, used, grads[: len(outs)], dict(zip(leaves, grads[len(outs) :], strict=True)))
    capture.calls.clear()
    return captured


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


def _checked_capture(
    model: nn.Module,
    loss_fn: LossFn,
    leaves: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> _Capture | None:
    """Hooks on the model's leaf modules if they see every parameter's gradient, else None (the fallback).

    Decided once per request on a data-independent batch (:data:`_SYNTHETIC` records of seeded
    standard-normal features, zeros for integer features, target 0, of the chunk's shapes), never
    on a record: which method runs, and so how long it takes, says nothing about the data. The
    hooks must see every parameter's gradient (against autograd's batch gradient), one row per
    record at every module, and each record's norm must be its per-example gradient's (against
    vmap(grad), relative 1e-3): a module that mixes records selects the fallback.
    """
    try:
        capture = _Capture(_hooked_modules(model))
    except _Unsupported:
        return None
    shape = (_SYNTHETIC, *x.shape[1:])
    if x.is_floating_point():
        xs = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(x.device, x.dtype)
    else:
        xs = torch.zeros(shape, dtype=x.dtype, device=x.device)
    ys = torch.zeros((_SYNTHETIC, *y.shape[1:]), dtype=y.dtype, device=y.device)
    handles = [m.register_forward_hook(capture.hook, with_kwargs=True) for m in capture.modules]
    ones = torch.ones(_SYNTHETIC, device=x.device)
    try:
        captured = _hooked_chunk(model, loss_fn, capture, leaves, buffers, xs, ys, ones, check=True)
        sq = torch.zeros(_SYNTHETIC, dtype=torch.float64, device=x.device)
        for m, a, g in captured:
            sq += _outer_sq(cast(nn.Linear, m), a, g) if _is_outer(m, a) else _rows_of(m, a, g).sq(_SYNTHETIC, x.device)
    except _Unsupported:
        return None
    finally:
        for h in handles:
            h.remove()
    # Each record's norm from the hooks must be its own (autograd's per-example gradient): a module
    # that mixes records passes the batch-gradient check above but not this one.
    want = torch.cat([part for _, _, part in _per_example_rows(model, loss_fn, xs, ys, ones)]).sqrt()
    got = sq.sqrt()
    if not bool((torch.abs(got - want) <= 1e-3 * want + 1e-30).all()):
        return None
    return capture


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


def record_norms(
    model: nn.Module,
    loss_fn: LossFn,
    source: RecordSource,
    *,
    valid: Validity | None = None,
    chunk_size: int = 1024,
    device: str = "cpu",
    hooks: bool = True,
) -> tuple[NDArray[np.float64], str]:
    """The norms alone: each record's gradient L2 norm (float64, (n,)) and the method ("hooks" or "fallback").

    The fused pass with every weight 0, so the norms are exactly those :func:`fused_clipped_sum`
    computes. A null record's norm is exactly 0; a record whose gradient overflows has a non-finite norm.
    """
    norms, _, method = fused_clipped_sum(
        model,
        loss_fn,
        source,
        lambda start, norms: np.zeros(norms.size),
        valid=valid,
        chunk_size=chunk_size,
        device=device,
        hooks=hooks,
    )
    return norms, method


# -- the fused pass: norms, weights, and the weighted sum from one forward and one backward --------


WeightsFn = Callable[[int, NDArray[np.float64]], NDArray[np.floating]]
"""``weights(start, norms) -> w``: the weights of records ``start .. start + len(norms) - 1`` from their norms.

Called once for every record, in order, on consecutive runs of records (a block of a chunk, or a
sub-batch of the fallback); each record's weight may depend only on its own norm (and on state
fixed before the pass). ``norms`` are float64, non-finite for a record whose gradient overflows.
"""


class _Weigher:
    """Asks ``weights`` for each run of records, checks the answer, and gives back float64 weights
    that are exactly 0 outside the mask, and the mask.

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
        wt = torch.from_numpy(w).to(device=self.device)
        keep = ((wt != 0) & torch.isfinite(norms) & (norms > 0)).to(self.device)
        return torch.where(keep, wt, torch.zeros((), dtype=wt.dtype, device=self.device)), keep


def _fallback_chunk(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    usable: torch.Tensor,
    weigh: _Weigher,
    start: int,
    view: Callable[[str], torch.Tensor],
) -> torch.Tensor:
    """The whole-model fallback, fused: per sub-batch, vmap(grad) rows, their norms, weights, weighted sum (float64)."""
    parts = []
    for i, grads, sq in _per_example_rows(model, loss_fn, x, y, usable):
        norms = sq.sqrt()
        wk, keep = weigh(start + i, norms)
        for name, g in grads.items():
            view(name).add_(torch.tensordot(wk, _rows_where(keep, g).to(torch.float64), dims=1))
        parts.append(norms)
    return torch.cat(parts)


def _hooked_sum(
    captured: Captured, b: int, weigh: _Weigher, start: int, view: Callable[[nn.Module, str], torch.Tensor]
) -> torch.Tensor:
    """One chunk's norms and weighted sum from its captured (a, g): rows per block of records, then the outer products.

    Per block of records: each non-``_is_outer`` module's per-record rows (:class:`_Rows`), the
    records' norms (with the outer modules' ||a|| ||g||), their weights, and the rows' weighted
    sum. After the blocks, the outer modules' weighted sums (w g)^T a in float64.
    """
    device = captured[0][1].device if captured else torch.device("cpu")
    outer = [(m, a, g) for m, a, g in captured if _is_outer(m, a)]
    rowed = [(m, a, g) for m, a, g in captured if not _is_outer(m, a)]
    sq_outer = torch.zeros(b, dtype=torch.float64, device=device)
    for m, a, g in outer:
        sq_outer += _outer_sq(cast(nn.Linear, m), a, g)
    step = max(1, _EXPLICIT_FLOATS // max(1, sum(_row_floats(m, a) for m, a, _ in rowed))) if rowed else max(1, b)
    norms = torch.empty(b, dtype=torch.float64, device=device)
    wk_all = torch.empty(b, dtype=torch.float64, device=device)
    keep_all = torch.empty(b, dtype=torch.bool, device=device)
    for i in range(0, b, step):
        blocks = [(m, _rows_of(m, a[i : i + step], g[i : i + step])) for m, a, g in rowed]
        sq = sq_outer[i : i + step].clone()
        for _, rows in blocks:
            sq += rows.sq(sq.shape[0], device)
        norms[i : i + step] = sq.sqrt()
        wk, keep = weigh(start + i, norms[i : i + step])
        for m, rows in blocks:
            rows.add(wk, keep, functools.partial(view, m))
        wk_all[i : i + step], keep_all[i : i + step] = wk, keep
    for m, a, g in outer:
        for local, grad in _outer_sum(cast(nn.Linear, m), a, g, wk_all, keep_all).items():
            view(m, local).add_(grad)
    return norms


@contextmanager
def _full_precision(device: torch.device) -> Iterator[None]:
    """Float32 matmuls and convolutions in full float32 on CUDA (TF32 off) for the duration of a pass."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def fused_clipped_sum(
    model: nn.Module,
    loss_fn: LossFn,
    source: RecordSource,
    weights: WeightsFn,
    *,
    valid: Validity | None = None,
    chunk_size: int = 1024,
    device: str = "cpu",
    hooks: bool = True,
) -> tuple[NDArray[np.float64], NDArray[np.float64], str]:
    """One pass: each record's gradient norm, and sum_i w_i g_i with the weights ``weights`` gives from the norms.

    Returns (norms float64 (n,), the sum float64 (d,), the method: "hooks" or "fallback"). Per
    chunk: one forward, one backward with respect to the hooked modules' outputs, then
    :func:`_hooked_sum` (each record's norm from the very values its weighted contribution is
    summed from); the fallback (``hooks`` off, or a model the hooks cannot see, decided on a
    data-independent batch) forms per-record gradients by vmap(grad) per sub-batch and weights
    those. A record with weight 0, a non-finite or a zero norm (a null record included)
    contributes exact zeros; a sum that is still not finite (or a null element whose gradient is
    not) raises :class:`NonFiniteSumError`. Memory is bounded by one chunk.
    """
    check_model(model)
    chunk_size = _chunk_size(chunk_size)
    dev = torch.device(device)
    model = _on_device(model, dev)
    n = len(source)
    norms_out = torch.empty(n, dtype=torch.float64)
    leaves, buffers = _leaves(model, dev)
    total = torch.zeros(sum(p.numel() for p in leaves.values()), dtype=torch.float64, device=dev)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for name, p in leaves.items():
        views[name] = total[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    full_names = {id(p): name for name, p in model.named_parameters()}

    def module_view(m: nn.Module, local: str) -> torch.Tensor:
        return views[full_names[id(m._parameters[local])]]

    weigh = _Weigher(weights, n, dev)
    capture: _Capture | None = None
    handles: list[Any] = []
    with _full_precision(dev):
        try:
            start = 0
            first = True
            for xb, yb in source.batches(chunk_size):
                x, y, usable = _chunk_tensors(xb, yb, None, valid=valid, device=dev)
                if first:  # data-independent: the null element, then the method, on synthetic records
                    _check_null_element(model, loss_fn, leaves, buffers, x[:1], y[:1])
                    capture = _checked_capture(model, loss_fn, leaves, buffers, x, y) if hooks else None
                    if capture is not None:
                        handles = [m.register_forward_hook(capture.hook, with_kwargs=True) for m in capture.modules]
                    first = False
                if capture is not None:
                    try:
                        captured = _hooked_chunk(model, loss_fn, capture, leaves, buffers, x, y, usable, check=False)
                    except _Unsupported as exc:  # the model's structure depends on its input
                        raise ValueError(f"model: its forward changed structure between chunks ({exc})") from None
                    norms = _hooked_sum(captured, x.shape[0], weigh, start, module_view)
                    del captured
                else:
                    norms = _fallback_chunk(model, loss_fn, x, y, usable, weigh, start, views.__getitem__)
                norms_out[start : start + len(norms)] = norms.detach().cpu()
                start += len(norms)
        finally:
            for h in handles:
                h.remove()
    if start != n or weigh.next != n:
        raise ValueError(f"source: expected {n} records from batches(), got {start}")
    out = total.cpu().numpy()
    if not np.isfinite(out).all():
        raise NonFiniteSumError(f"the clipped gradient sum over {len(views)} tensors is not finite")
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


ACTIVATION_COPIES = 4  # a chunk holds its activations, their backprops, the captured inputs and float64 temporaries


def activation_bytes(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> int | None:
    """Bytes of the tensors (views not counted again) the forward and the loss produce for ``x``, ``y``.

    Measured on the meta device (no memory is used, no value is read); a model that cannot run
    there (a forward that reads values, e.g. ``.item()``) is measured on zeros of the same shapes
    (data-independent); None if it cannot run on those either.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):  # type: ignore[no-untyped-call]
        total = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and not t._is_view():
                    self.total += t.numel() * t.element_size()
            return out

    named = [*model.named_parameters(), *model.named_buffers()]
    for device in ("meta", None):
        state = {name: torch.empty_like(t, device="meta") if device else t.detach().clone() for name, t in named}
        xm = torch.empty_like(x, device="meta") if device else torch.zeros_like(x)
        ym = torch.empty_like(y, device="meta") if device else torch.zeros_like(y)
        counter = Count()  # type: ignore[no-untyped-call]
        try:
            with torch.no_grad(), counter:
                loss_fn(functional_call(model, state, (xm,)), ym)
        except Exception:  # any failure means: not measurable this way
            continue
        return counter.total
    return None


def chunk_for_budget(
    model: nn.Module, loss_fn: LossFn, source: RecordSource, *, budget_bytes: int, most: int = 1024
) -> int:
    """The most records per chunk (at most ``most``) whose activations, backprops, captured inputs and
    temporaries fit ``budget_bytes``, from two records of the source's shapes (:func:`activation_bytes`).

    The coordinator chooses the model and its arguments (e.g. a wide hidden layer repeated): the
    chunk shrinks to the owner's budget, and a model whose single record exceeds it is refused
    (:class:`client_agent.config.PolicyError`, before anything is computed or charged). The answer
    depends on the model and the records' shapes only, never on their values. A model that cannot
    be measured gets chunks of one record.
    """
    from client_agent.config import PolicyError

    if len(source) == 0:
        return most
    xb, yb = next(iter(source.batches(1)))
    x1, y1 = _as_tensor(xb), _as_tensor(yb)
    x2, y2 = x1[:1].expand(2, *x1.shape[1:]), y1[:1].expand(2, *y1.shape[1:])
    measured = activation_bytes(model, loss_fn, x2, y2)
    if measured is None:
        return 1
    per_record = max(1, ACTIVATION_COPIES * measured // 2)
    chunk = min(most, budget_bytes // per_record)
    if chunk < 1:
        raise PolicyError(
            f"model: one record's activations need about {per_record >> 20} MiB, above policy-max-activation-mb "
            f"({budget_bytes >> 20} MiB)"
        )
    return int(chunk)


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
        hooks: bool = True,
    ) -> None:
        """``hooks`` (the default, and the agent's path): the fused pass on the activations and backprops
        the module hooks capture (:func:`_hooked_sum`); off, or for a model the hooks cannot see,
        each record's whole gradient by vmap(grad) per sub-batch. Either way a record's norm and its
        weighted contribution come from the same values, and memory stays bounded by a chunk."""
        check_model(model)
        self.model, self.loss_fn, self.source = model, loss_fn, source
        self.valid, self.chunk_size, self.device = valid, _chunk_size(chunk_size), device
        self.hooks = hooks
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
                hooks=self.hooks,
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
            hooks=self.hooks,
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
