"""Per-record gradient contributions, streamed chunk by chunk: memory bounded by a chunk, never by n x d.

Isolation by construction (privacy.md §2): every record's forward, loss, backward and validity
are computed with that record alone, a batch of one through ``functional_call``, run over a block
of records by ``torch.func.vmap`` (:mod:`client_agent.isolation`). No operator in the owner's model,
loss or validity rule can see another record, whatever the model does, so a record's contribution
depends on its own data alone and a stopped record's data reaches only its own zero-weighted rows.

Per block of records, :func:`fused_clipped_sum`: each record's gradient rows (modules of a known
kind from their input and backprop, :mod:`client_agent.layers`; every other trainable parameter's
gradient directly), each record's norm from exactly those rows (float64), its weight from the
caller (``weights(start, norms)``: Agent.release's clip scale x admitted, each record's from its own
norm and its state before the request), then sum_i w_i rows_i in float64. Which modules are tapped
is decided on synthetic records (a model vmap cannot run is refused), kept per agent process.

Privacy notes (privacy.md §1, §2, §8):

- The null element: a record whose features are not finite, or that the workload's ``valid``
  rule (applied to that record alone) rejects, gets zero features, target 0 and weight 0 in the
  loss, so its norm is 0 and its contribution exactly zero. In the sum, a record whose weight is 0,
  or whose norm is not finite or is 0, enters as exact zeros (a torch.where on its rows: 0 * inf
  would be NaN), whatever weight the caller gave it, so every record that contributes anything was
  charged for it. The null element's own gradient is checked to be finite once per request (a
  data-independent check); a sum that is still not finite raises :class:`NonFiniteSumError`
  before anything is charged.
- Float error (:data:`NORM_REL_ERROR`): a record's norm is computed from the very float32 values
  its contribution is summed from; the only error is the norm's own rounding (see the constant);
  the release clips to bound / (1 + E) and charges norm * scale * (1 + E). The float64
  accumulation across records adds at most gamma_n x sum_i (charged norm_i) over n records
  (gamma_n = n 2^-53 / (1 - n 2^-53): below 10^-11 of the charged total at n = 60,000), not
  attributed to any record. On CUDA, TF32 is off for the pass.
- The work does not depend on who stopped: every record goes through the same operations; a
  stopped record has weight 0, never a skipped branch.
- Only trainable parameters (``requires_grad``) are released and charged: a frozen parameter's
  entries of the sum are exactly zero and enter no norm.
- BatchNorm and Dropout with p > 0 in training mode are refused (a batch of one has no batch
  statistics; a random mask per record would not be replayable); ``fedfilter agent check`` names them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.func import functional_call

from client_agent.gradients import LossFn
from client_agent.isolation import PerRecord, check_validity_vmaps, per_record_validity
from client_agent.layers import rows_where
from client_agent.layers.base import or_zero as where_or_zero
from protocol.branchless import or_zero
from protocol.errors import FedfilterError
from workloads.models import trainable_mask

# Declared relative bound on |a record's norm - ||what the sum adds for it||| / ||what the sum adds||.
# The sum adds w_i x (the record's rows), each product rounded once in float64 (2^-53); the norm is
# layers.base.squared_norms over the same rows, converted exactly to float64 and summed there, so the
# squared norm's relative error is at most gamma_d = d u / (1 - d u), u = 2^-53 (Higham, "Accuracy and
# Stability of Numerical Algorithms", Lemma 3.1): below 2^-20 = 9.5e-7 for rows of d <= 2^33 entries,
# and the norm's at most half that, 4.8e-7. Linear's outer rows (||a|| ||g||, float64 over the float32
# factors) are exact to a few float64 roundings. 1e-6 is twice the bound; tests/unit/test_isolation_audit.py
# and test_streaming.py check observed errors against it (privacy.md §2).
NORM_REL_ERROR = 1e-6
# Floats of per-record rows per block of records: 2^25 floats is 128 MiB in float32, on a CPU. On another
# device (a GPU) a block costs a fixed few hundred launches and one host round trip (its weights), about
# 20 ms from Python whatever its size, while its arithmetic is a few ms: 2^27 floats (512 MiB) there, so that
# a chunk is one block (the MNIST CNN: up to 7,514 records; a campaign client of 6,000 records, in chunks of
# 4,889 at the default policy-max-activation-mb, is two blocks, not six) (benchmarks/campaign_step.py prints the
# step with both sizes on the device, and their ratio). The bound is on floats: a float64 model's rows take
# twice the bytes, and a record whose own rows exceed it is a block alone.
_EXPLICIT_FLOATS = 1 << 25
_DEVICE_EXPLICIT_FLOATS = 1 << 27


def block_records(device: torch.device, row_floats: int) -> int:
    """Records per block of explicit rows: :data:`_EXPLICIT_FLOATS` of rows on a CPU,
    :data:`_DEVICE_EXPLICIT_FLOATS` elsewhere, at least one. Fixed by the device and the model's shape,
    never by the data: every record, null or not, is in a block of the same size."""
    cap = _EXPLICIT_FLOATS if device.type == "cpu" else _DEVICE_EXPLICIT_FLOATS
    return max(1, cap // max(1, row_floats))


_BLOCK_ROWS = 256  # rows per block for materialised rows (RowContributions): float64 temporaries of a few MB


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
    x: Any,
    y: Any,
    keep: torch.Tensor | None,
    *,
    valid: Validity | None,
    device: torch.device,
    nulls: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, weight) on ``device``: records not ``valid`` (or not in ``keep``) become the null element.

    A record outside ``keep`` (a stopped unit) is replaced by zeros first, before anything reads it.
    Validity is then decided on the source's side, for each record alone (``valid`` sees one record
    as the source gave it, its own dtype and device, :func:`client_agent.isolation.per_record_validity`;
    finiteness is also checked after the conversion to float32 / int64), then the chunk moves to
    ``device``. The same torch.where on every record: zero features, zero target, weight 0.
    """
    x0, y0 = batch_tensor(x), batch_tensor(y)
    kept = torch.ones(len(x0), dtype=torch.bool) if keep is None else keep.to(torch.bool).cpu()
    if keep is not None:
        x0 = rows_where(kept.to(x0.device), x0)
        y0 = rows_where(kept.to(y0.device), y0)
    xt, yt = _as_tensor(x0), _as_tensor(y0)
    usable = finite_records(xt, yt)
    accepted = torch.ones_like(usable)
    if valid is not None:  # on the source's own values: a float64 label 2.0000001 is not rounded to class 2 first
        accepted = per_record_validity(valid, x0, y0, vmapped=True).to(usable.device)
    if nulls is not None:  # the owner's log (client_agent.agent): kept records that were null, and why
        nulls["not_finite"] = nulls.get("not_finite", 0) + int((kept & ~usable).sum())
        nulls["rejected"] = nulls.get("rejected", 0) + int((kept & usable & ~accepted).sum())
    usable &= accepted & kept.to(usable.device)
    xt, yt, usable = xt.to(device), yt.to(device), usable.to(device)
    xt, yt = rows_where(usable, xt), rows_where(usable, yt)
    return xt, yt, usable.to(torch.float32)


def _on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` itself if its parameters and buffers are on ``device``, else a copy moved there (d floats)."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device == device for t in tensors):
        return model
    return copy.deepcopy(model).to(device)


def _losses(loss_fn: LossFn, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    losses = loss_fn(outputs, y)
    b = y.shape[0]
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (b,):
        got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(f"loss_fn: expected per-example losses of shape ({b},) (reduction='none'), got {got}")
    return losses


def check_model(model: nn.Module) -> None:
    """Refuse what the per-record engine cannot run (client_agent.workload_check.model_problems): BatchNorm (a
    record alone has no batch statistics), Dropout or attention dropout with p > 0 in training mode (a random
    mask per record is neither reproducible nor replayable); p = 0 or eval mode is fine."""
    from client_agent.workload_check import model_problems

    problems = model_problems(model)
    if problems:
        raise ValueError("model: " + "; ".join(problems))


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
        return where_or_zero(keep, wt), keep


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
    nulls: dict[str, int] | None = None,
    plan_key: Hashable | None = None,
    keep: NDArray[np.bool_] | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64], str]:
    """One pass: each record's gradient norm, and sum_i w_i g_i with the weights ``weights`` gives from the norms.

    Returns (norms float64 (n,), the sum float64 (d,) over every parameter, frozen ones exactly 0,
    the method: :attr:`client_agent.isolation.Plan.method`). Per block of records: each record's
    rows computed with that record alone (:class:`client_agent.isolation.PerRecord`), its norm from
    exactly those rows, the block's weights, the rows' weighted sum. ``hooks`` off: every gradient
    taken directly (no layer kind), the reference the kinds are tested against. A record with weight
    0, a non-finite or a zero norm (a null record included) contributes exact zeros; a sum that is
    still not finite (or a null element whose gradient is not) raises :class:`NonFiniteSumError`.
    Memory is bounded by one chunk and one block of rows. ``nulls``, if given, receives how many records
    were the null element and why: ``not_finite`` features or targets, ``rejected`` by ``valid``.
    ``plan_key``: public request fields naming the model (PerRecord.decide): its plan is reused.
    ``keep``: records outside it (stopped units, known before the pass) enter as the null element, before
    the forward: their data reaches no computation at all, so neither the result, nor an error, nor the
    work can depend on it (under vmap every record runs the same operations, null or not).
    """
    check_model(model)
    chunk_size = _chunk_size(chunk_size)
    dev = torch.device(device)
    model = _on_device(model, dev)
    n = len(source)
    norms_out = torch.empty(n, dtype=torch.float64)
    engine = PerRecord(model, loss_fn, dev)
    total = torch.zeros(sum(p.numel() for p in engine.params.values()), dtype=torch.float64, device=dev)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for name, p in engine.params.items():
        views[name] = total[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()

    def view_of(module: str | None) -> Callable[[str], torch.Tensor]:
        if module is None:  # the direct parameters' rows are keyed by full names
            return views.__getitem__
        prefix = f"{module}." if module else ""
        return lambda local: views[prefix + local]

    weigh = _Weigher(weights, n, dev)
    method = ""
    keep_all = None if keep is None else torch.from_numpy(np.asarray(keep, dtype=np.bool_))
    if keep_all is not None and keep_all.shape != (n,):
        raise ValueError(f"keep: expected {n} flags, got shape {tuple(keep_all.shape)}")
    with _full_precision(dev):
        start = 0
        for xb, yb in source.batches(chunk_size):
            if not method:  # data-independent: the plan, then the null element, on synthetic records
                # One record's shapes and dtypes (its values are never read), converted alone: not a view that
                # would keep the whole converted chunk alive for the pass.
                xs, ys = _as_tensor(batch_tensor(xb[:1])).to(dev), _as_tensor(batch_tensor(yb[:1])).to(dev)
                plan = engine.decide(xs, ys, key=plan_key)
                if not hooks:
                    plan = engine.plan = engine.direct_plan()
                method = plan.method
                if valid is not None:
                    check_validity_vmaps(valid, batch_tensor(xb), batch_tensor(yb))
                leaves = {name: p.detach().requires_grad_(True) for name, p in engine.params.items()}
                _check_null_element(model, loss_fn, leaves, engine.buffers, xs[:1], ys[:1])
            kept = None if keep_all is None else keep_all[start : start + len(yb)]
            x, y, usable = _chunk_tensors(xb, yb, kept, valid=valid, device=dev, nulls=nulls)
            step = block_records(dev, engine.row_floats())
            for i in range(0, x.shape[0], step):
                blocks = engine.rows(x[i : i + step], y[i : i + step], usable[i : i + step])
                b = min(step, x.shape[0] - i)
                sq = torch.zeros(b, dtype=torch.float64, device=dev)
                for _, rows in blocks:
                    sq += rows.sq(b, dev)
                norms = sq.sqrt()
                wk, sent = weigh(start + i, norms)
                for module, rows in blocks:
                    rows.add(wk, sent, view_of(module))
                norms_out[start + i : start + i + b] = norms.detach().cpu()
                del blocks
            start += x.shape[0]
            del x, y, usable  # before the next chunk's copies are made (chunk_for_budget counts one chunk)
    if start != n or weigh.next != n:
        raise ValueError(f"source: expected {n} records from batches(), got {start}")
    out = total.cpu().numpy()
    if not np.isfinite(out).all():
        raise NonFiniteSumError(f"the clipped gradient sum over {len(views)} tensors is not finite")
    return norms_out.numpy(), out, method or "none"


# -- a batched weighted backward: the reference for models whose records do not mix (tests only) -----


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
    """sum_i weights_i g_i, float64 (d,), one weighted backward pass per *batch*: the independent reference the
    isolated engine is tested against on models whose records do not mix. Never on a release path: a
    batched forward lets a model that mixes records (a batch mean) make one record's data move another's.

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
    leaves = {name: p.detach().to(dev).requires_grad_(True) for name, p in model.named_parameters()}
    buffers = {name: b.detach().to(dev) for name, b in model.named_buffers()}
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
# A chunk's records themselves (_chunk_tensors), at most: in the source's own dtype, a writable copy of a
# read-only batch and the copy with its stopped records zeroed; converted (float32 features, int64 ids and
# targets), the converted chunk and, on the device, the moved one and the one with its null records zeroed.
# The pass drops a chunk's tensors before it reads the next.
SOURCE_COPIES = 2
CONVERTED_COPIES = 3


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


def record_shapes(source: RecordSource) -> tuple[object, ...]:
    """The per-record shapes and dtypes of ``source`` (from its first record), () when it is empty: public
    facts the chunk size depends on, a cache key (:mod:`client_agent.model_cache`), never the values."""
    if len(source) == 0:
        return ()
    xb, yb = next(iter(source.batches(1)))
    x1, y1 = batch_tensor(xb), batch_tensor(yb)  # the source's own dtypes: the chunk's copies are sized by them
    return (tuple(x1.shape[1:]), str(x1.dtype), tuple(y1.shape[1:]), str(y1.dtype))


def chunk_for_budget(
    model: nn.Module, loss_fn: LossFn, source: RecordSource, *, budget_bytes: int, most: int = 1024
) -> int:
    """The most records per chunk (at most ``most``) whose activations, backprops, captured inputs and
    temporaries (:func:`activation_bytes` of two records of the source's shapes, :data:`ACTIVATION_COPIES`),
    and the records' own copies (:data:`SOURCE_COPIES` and :data:`CONVERTED_COPIES`), fit ``budget_bytes``.

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
    xs0, ys0 = batch_tensor(xb), batch_tensor(yb)  # the source's own dtypes
    x1, y1 = _as_tensor(xs0), _as_tensor(ys0)
    x2, y2 = x1[:1].expand(2, *x1.shape[1:]), y1[:1].expand(2, *y1.shape[1:])
    measured = activation_bytes(model, loss_fn, x2, y2)
    if measured is None:
        return 1
    # A record's copies (SOURCE_COPIES in the source's dtypes, CONVERTED_COPIES as _as_tensor gives them).
    record = sum(
        s[:1].numel() * (SOURCE_COPIES * s.element_size() + CONVERTED_COPIES * c.element_size())
        for s, c in ((xs0, x1), (ys0, y1))
    )
    per_record = max(1, ACTIVATION_COPIES * measured // 2 + record)
    chunk = min(most, budget_bytes // per_record)
    if chunk < 1:
        raise PolicyError(
            f"model: one record's activations and copies need about {per_record >> 20} MiB, above "
            f"policy-max-activation-mb ({budget_bytes >> 20} MiB)"
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
    up; the release clips to bound / :meth:`clip_margins` (at most 1 + norm_rel_error). ``trainable``: which
    of the ``dim`` entries are a trainable parameter's (None: all); the others are released as exact zeros,
    noise included.
    """

    n_units: int
    dim: int
    norm_rel_error: float
    trainable: NDArray[np.bool_] | None

    def norms(self) -> NDArray[np.float64]:
        """Each unit's L2 norm (float64; non-finite for a unit that overflows)."""
        ...

    def clip_margins(
        self, norms: NDArray[np.float64], bounds: NDArray[np.float64], headroom: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """Each unit's clip margin: the release clips unit i to bounds[i] / margins[i] (after :meth:`norms`);
        ``headroom``: sigma sqrt(T - S), the most the filters (and the cap) let unit i be charged."""
        ...

    def scale(self, scales: NDArray[np.float64]) -> NDArray[np.float64]:
        """Scale unit i by ``scales[i]`` (0 for a non-finite unit); return the norms to charge, >= the true ones."""
        ...

    def weighted_sum(self, weights: NDArray[Any]) -> NDArray[np.float64]:
        """sum_i weights[i] * (scaled unit i), float64 (d,)."""
        ...


_EXPONENT = np.uint32(0x7F800000)
_F32_TINY = float(np.finfo(np.float32).tiny)  # 2^-126, float32's smallest normal


def _flush_subnormals(rows: NDArray[np.float32]) -> None:
    """Zero, in place and bitwise, every float32 entry whose exponent bits are 0 (subnormals; zeros stay +0).
    Integer operations only: a float32 multiply with a subnormal operand took 8x as long on this project's CPU
    (2.78 against 0.36 ms for 2,048 rows of 128 at weight 1 and 0, a review), so rows of subnormals set the
    reply's timing by who stopped. Infinities and NaN stay (their rows' norms are not finite: null elements)."""
    bits = rows.view(np.uint32)
    bits &= np.negative(((bits & _EXPONENT) != 0).astype(np.uint32))  # all ones where kept, zero elsewhere


def _exact_norms(rows: NDArray[np.float64]) -> NDArray[np.bool_]:
    """Which rows (float64 copies of float32 values) have an exactly computed L2 norm: one value (sqrt(x^2) = |x|),
    or integers whose squares sum below 2^52 (every square and partial sum an integer float64 holds, in any
    order) to the square of an integer (so the correctly rounded square root is exact). Branch-free."""
    if rows.shape[1] == 1:
        return np.asarray(np.isfinite(rows[:, 0]))
    squares = np.einsum("ij,ij->i", rows, rows)
    roots = np.sqrt(squares)
    with np.errstate(invalid="ignore"):
        # A count, not np.all (which may stop at a row's first fraction): NaN counts; an infinity fails below.
        whole = np.count_nonzero(rows != np.trunc(rows), axis=1) == 0
        return np.asarray(whole & (squares < 2.0**52) & (roots == np.trunc(roots)) & (roots * roots == squares))


class RowContributions:
    """Materialised float32 rows (n, d): indicators and client units. Scaled in place, measured after scaling.

    ``norm_rel_error`` (E): the measured norm is the float64 norm of the float32 row, whose squares are
    exact and whose sum and square root are rounded, below gamma_d / 2 + u relative (u = 2^-53; see
    :data:`NORM_REL_ERROR`), so :meth:`scale` charges it times (1 + E) with E = NORM_REL_ERROR, and the
    release clips to bound / (1 + E). Exact rows pay no margin: a row of one value (sqrt(x^2) = |x|: E = 0,
    so a count pays exactly (1 / sigma)^2), and a row of integers whose squares sum below 2^52 to a perfect
    square (every partial sum an integer float64 holds, the square root an integer), e.g. a one-hot
    histogram row, left unscaled: so such a row at norm C is not scaled by 1 / (1 + E), and counts stay
    whole. (E was 0 for every row: a review found the float64 norm below the exact one, by up to 3.6e-16
    relative, on about half of random rows of 4,096 values.)
    """

    def __init__(self, rows: NDArray[np.float32], *, trainable: NDArray[np.bool_] | None = None) -> None:
        """``trainable`` (client-unit gradients and updates: the flat layout's trainable entries,
        workloads.models.trainable_mask): the frozen entries are released as exact zeros, noise included."""
        # float32 (another dtype is converted; a float64 array read as float32 words lost its low bits, a review)
        self.rows = rows if rows.dtype == np.float32 and rows.flags.writeable else rows.astype(np.float32)
        _flush_subnormals(self.rows)
        self.n_units, self.dim = self.rows.shape
        self.norm_rel_error = 0.0 if self.dim == 1 else NORM_REL_ERROR
        self._exact: NDArray[np.bool_] | None = None  # rows whose measured norm is exact (set by norms())
        self.trainable = trainable
        if trainable is not None:
            if trainable.shape != (self.dim,):
                raise ValueError(f"trainable: expected {self.dim} flags, got shape {trainable.shape}")
            self.rows[:, ~trainable] = 0.0  # a public mask: frozen parameters are not released

    def norms(self) -> NDArray[np.float64]:
        """Each row's L2 norm in float64 (the values of ``np.linalg.norm(rows.astype(float64), axis=1)``).

        A row holding a NaN or an infinity has a non-finite norm, so this one pass also finds them.
        """
        rows = self.rows
        out = np.empty(len(rows), dtype=np.float64)
        exact = np.empty(len(rows), dtype=np.bool_)
        for start in range(0, len(rows), _BLOCK_ROWS):
            block = rows[start : start + _BLOCK_ROWS].astype(np.float64)
            out[start : start + _BLOCK_ROWS] = np.linalg.norm(block, axis=1)
            exact[start : start + _BLOCK_ROWS] = _exact_norms(block)
        self._exact = exact
        return out

    def clip_margins(
        self, norms: NDArray[np.float64], bounds: NDArray[np.float64], headroom: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """1 for a row whose norm is exact, within its bound and at least 1 + NORM_REL_ERROR under its
        ``headroom`` (sigma sqrt(T - S), the filters' and the cap's: left as it is, it is charged its exact
        norm, which the filter's own rounding then admits), 1 + NORM_REL_ERROR otherwise (a row of one value
        too, near its headroom: a review found one-hot rows charged exactly a bound sigma sqrt(T - S) rounded
        up to C refused by the filter's S + (C / sigma)^2 > T). The same operations on every row."""
        exact = self._exact if self._exact is not None else np.zeros(self.n_units, dtype=np.bool_)
        within = exact & (norms <= bounds) & (norms * (1.0 + NORM_REL_ERROR) <= headroom)
        margins: NDArray[np.float64] = 1.0 + NORM_REL_ERROR * (~within).astype(np.float64)
        return margins

    def scale(self, scales: NDArray[np.float64]) -> NDArray[np.float64]:
        """Scale every row in place by its factor and return the norms to charge: the scaled rows' float64
        norms times (1 + :attr:`norm_rel_error`), at least the exact norms of what the sum adds.

        Every row is multiplied, a factor of 1 included, in float64: the rows hold no float32 subnormal, and a
        factor below float32's smallest normal is 0 (the row is then the null element and pays 0), so every
        nonzero product is at least 2^-252, normal in float64. Products below float32's smallest normal and
        non-finite ones (a non-finite row carries the factor 0: 0 * inf is NaN) are zeroed bitwise before the
        cast back to float32, so no float32 subnormal is an operand or a result anywhere (a review: a multiply
        in float32 that made subnormals took 3.4x as long, and a stopped row's factor 0 did not, so the time
        counted who stopped; a float32 factor rounded from a float64 one below 2^-126 charged a row up to 1.4x
        its bound). The norm is measured after, from the float32 values the sum adds.
        """
        rows = self.rows
        factors = np.asarray(scales, dtype=np.float64)
        factors = or_zero(factors >= _F32_TINY, factors)[:, None]
        out = np.empty(len(rows), dtype=np.float64)
        for start in range(0, len(rows), _BLOCK_ROWS):
            block = rows[start : start + _BLOCK_ROWS]
            with np.errstate(invalid="ignore"):  # 0 * inf: zeroed below, and no warning for some rows only
                products = block.astype(np.float64) * factors[start : start + _BLOCK_ROWS]
            bits = products.view(np.uint64)
            exponent = (bits >> np.uint64(52)) & np.uint64(0x7FF)
            keep = (exponent >= np.uint64(1023 - 126)) & (exponent != np.uint64(0x7FF))
            bits &= np.negative(keep.astype(np.uint64))  # all ones where kept, zero elsewhere
            block[...] = products
            out[start : start + _BLOCK_ROWS] = np.linalg.norm(block.astype(np.float64), axis=1)
        # An exact row left as it is keeps its exact norm; a scaled row's norm carries the rounding margin.
        exact = self._exact if self._exact is not None else np.zeros(self.n_units, dtype=np.bool_)
        kept = exact & (np.asarray(scales) == 1.0)
        charged: NDArray[np.float64] = out * (1.0 + self.norm_rel_error * (~kept).astype(np.float64))
        return charged

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
        plan_key: Hashable | None = None,
    ) -> None:
        """``hooks`` (the default, and the agent's path): modules of a known layer kind get their rows from
        their per-record input and backprop; off, every per-record gradient is taken directly. Either
        way each record is computed alone, its norm and its weighted contribution come from the same
        values, and memory stays bounded by a chunk."""
        check_model(model)
        self.model, self.loss_fn, self.source = model, loss_fn, source
        self.valid, self.chunk_size, self.device = valid, _chunk_size(chunk_size), device
        self.hooks, self.plan_key = hooks, plan_key
        self.n_units = len(source)
        self.dim = sum(p.numel() for p in model.parameters())
        # The flat layout's trainable entries (workloads.models.trainable_mask): frozen ones are released as 0.
        self.trainable: NDArray[np.bool_] | None = trainable_mask(model)
        self.method = ""
        self.nulls: dict[str, int] = {}  # null records of the last pass, by reason (the owner's log)
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

    def clip_margins(
        self, norms: NDArray[np.float64], bounds: NDArray[np.float64], headroom: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """1 + E for every record (the fused pass clips to bound / (1 + E) before any norm exists)."""
        return np.full(np.shape(norms), 1.0 + NORM_REL_ERROR)

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
        kept = or_zero(ok, np.asarray(scales, dtype=np.float64))
        out: NDArray[np.float64] = or_zero(ok, norms) * kept * (1.0 + NORM_REL_ERROR)
        return out

    def scale(self, scales: NDArray[np.float64]) -> NDArray[np.float64]:
        ok = self._sendable()
        self._scales = or_zero(ok, np.asarray(scales, dtype=np.float64))
        return self.charged_norms(self.norms(), scales)

    def clipped_sum(self, weights: WeightsFn, *, keep: NDArray[np.bool_] | None = None) -> NDArray[np.float64]:
        """The fused pass (:func:`fused_clipped_sum`): sum_i w_i g_i, w from ``weights``; then :meth:`norms` is free.

        This is how :meth:`client_agent.agent.Agent.release` uses record gradients: the filter's
        decision for a record depends only on its own norm and its state before the request, so
        ``weights`` decides it chunk by chunk, and the charge, computed afterwards from
        :meth:`norms` and :meth:`scale` over all records, must record exactly those weights.
        """
        self.nulls = {}
        self._norms, total, self.method = fused_clipped_sum(
            self.model,
            self.loss_fn,
            self.source,
            weights,
            valid=self.valid,
            chunk_size=self.chunk_size,
            device=self.device,
            hooks=self.hooks,
            nulls=self.nulls,
            plan_key=self.plan_key,
            keep=keep,
        )
        return total

    def weighted_sum(self, weights: NDArray[Any]) -> NDArray[np.float64]:
        """sum_i weights_i x (scaled record i): the same isolated pass with fixed weights (the two-pass path)."""
        scales = np.ones(self.n_units) if self._scales is None else self._scales
        fixed = or_zero(self._sendable(), scales * np.asarray(weights, dtype=np.float64))
        _, total, _ = fused_clipped_sum(
            self.model,
            self.loss_fn,
            self.source,
            lambda start, norms: fixed[start : start + norms.size],
            valid=self.valid,
            chunk_size=self.chunk_size,
            device=self.device,
            hooks=self.hooks,
        )
        return total


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
