"""Each unit's unclipped contribution to a request, one float32 row per unit.

- gradient (``record`` units): the per-record loss gradient at the broadcast parameters,
  streamed by :mod:`client_agent.streaming` (norms, then the clipped sum); (``client``
  units): the gradient of the client's mean loss, one row.
- indicator (``record`` units): each record's 0/1 predicate value; (``client`` units):
  the client's count of records for which it holds (or, with ``reduce`` 'mean', the fraction), one row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from client_agent.gradients import per_example_gradients, summed_gradient
from client_agent.layers import rows_where
from client_agent.layers.base import or_zero as where_or_zero
from client_agent.model_cache import MODELS
from client_agent.streaming import (
    Contributions,
    RecordSource,
    RowContributions,
    StreamedGradients,
    batch_tensor,
    check_model,
    chunk_for_budget,
    finite_records,
    record_shapes,
)
from protocol import messages as wire
from protocol.branchless import or_zero
from workloads.builtin import BUILTIN
from workloads.models import load_flat_parameters, trainable_mask
from workloads.registry import DataSource, QueryArgs, Workload, WorkloadError, bounded_rows

# Records per chunk of a record-unit gradient pass (each chunk is read, moved and validated at once), at most:
# 1,024 on a CPU; on another device (a GPU) 8,192, so that a chunk can fill a block of rows there
# (streaming._DEVICE_EXPLICIT_FLOATS) and a client of a few thousand records is a pass of few launches. The
# owner's policy-max-activation-mb lowers either (the MNIST CNN at the default 2048: 4,889 on a GPU). Fixed by
# the device, the model's shape and the policy, never by the data.
CHUNK_RECORDS = 1024
DEVICE_CHUNK_RECORDS = 8192


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The built-in workload's loss (workloads.builtin.cross_entropy)."""
    return BUILTIN.loss(logits, targets)


def _loaded_model(
    kind: str,
    name: str,
    model_args: str,
    parameters: NDArray[np.float32],
    *,
    workload: Workload | None = None,
    layout: str | None = None,
) -> torch.nn.Module:
    """The request's model from ``workload``'s registry (default: the built-in one) with its parameters loaded.

    A name the workload does not register, arguments its factory does not take, a layout other than the
    coordinator's (``layout``, when the request carries one) or a parameter count that does not fit is
    malformed.
    """
    registry = workload if workload is not None else BUILTIN
    try:  # count first, allocate nothing (a meta build, once per process): model_args may name huge layers
        shape = MODELS.shape(registry, name, model_args or "{}")
    except WorkloadError as exc:
        raise wire.ProtocolError(f"{kind}: model {name!r} with {model_args}: {exc}") from exc
    if layout is not None and layout != shape.layout:
        raise wire.ProtocolError(
            f"{kind}: model {name!r}: expected the coordinator's parameter layout {layout[:16]}..., "
            f"this client builds {shape.layout[:16]}..."
        )
    if parameters.size != shape.count:
        raise wire.ProtocolError(
            f"{kind}: 'parameters' must hold {shape.count} values for model {name!r}, got {parameters.size}"
        )
    model = MODELS.fresh(registry, name, model_args or "{}")  # this request's own module
    load_flat_parameters(model, parameters)
    return model


def gradient_contributions(
    request: wire.GradientRequest,
    source: RecordSource,
    *,
    unit: str,
    workload: Workload | None = None,
    device: str = "cpu",
    activation_budget: int | None = None,
    stopped: NDArray[np.bool_] | None = None,
) -> Contributions:
    """The request's per-unit gradients as the release kernel uses them.

    ``record`` units: :class:`client_agent.streaming.StreamedGradients` over ``source``, one fused
    pass over the records, memory bounded by a chunk, never an (n, d) matrix; with
    ``activation_budget`` (bytes: the agent's policy-max-activation-mb), chunks sized to it (stopped records
    enter as the null element in the pass the release runs). ``client`` units: the one row of
    :func:`client_gradient_row`, with the workload's loss and validity rule; ``stopped`` (one flag, the
    client's): a stopped client's records enter as the null element before the model sees them.

    Privacy note: the null element as in :func:`gradient_rows`: a record the workload's ``valid``
    rule rejects (a feature that is not finite, a label outside the model's classes) has zero
    features, target 0 and weight 0, so it contributes exactly zero and pays nothing.
    """
    registry = workload if workload is not None else BUILTIN
    model = _loaded_model(
        wire.GRADIENT,
        request.model,
        request.model_args,
        request.parameters,
        workload=registry,
        layout=getattr(request, "layout", None),
    )

    def valid(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return registry.valid(x, y, model)

    if unit != "record":
        row = client_gradient_row(model, registry.loss, source, valid=valid, keep=client_kept(stopped))
        return RowContributions(row, trainable=trainable_mask(model))
    chunk = CHUNK_RECORDS if torch.device(device).type == "cpu" else DEVICE_CHUNK_RECORDS
    if activation_budget is not None:  # the owner's budget: chunks sized to it, or a policy refusal
        # Public fields only (the model, the budget, the records' shapes): measured once per process.
        budget, most = activation_budget, chunk
        chunk = MODELS.memo(
            "chunk",
            registry,
            (request.model, request.model_args, budget, most, *record_shapes(source)),
            lambda: chunk_for_budget(model, registry.loss, source, budget_bytes=budget, most=most),
        )
    # Public fields only: the per-record plan for this model is decided once per agent process.
    key = (registry.name, id(registry), request.model, request.model_args)
    return StreamedGradients(model, registry.loss, source, valid=valid, device=device, chunk_size=chunk, plan_key=key)


def client_gradient_row(
    model: torch.nn.Module,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    source: RecordSource,
    *,
    valid: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    keep: bool = True,
) -> NDArray[np.float32]:
    """A client unit's row: the gradient of its mean loss over all its records, read batch by batch.

    The workload's ``loss`` and ``valid`` rule; a record it rejects is the null element (zero
    features, a zero target of the target's own dtype and shape, weight 0) by the same computation
    as every other record. The sum is divided by the public record count ``len(source)``.

    The unit is the client, so (privacy.md §2):
    - ``keep`` False (the client is stopped): every record enters as the null element before any of the
      owner's code (model, loss, validity rule) sees it; the same work runs, on no data;
    - an id outside an embedding's table is looked up as 0 and makes the whole row the null element
      (:class:`client_agent.isolation.GuardedTables`), never an error: a refusal would answer, uncharged,
      "does this client hold an id >= k?" for a table size the coordinator chose;
    - a frozen parameter's entries are exact zeros (only trainable parameters are released and charged).
    Integer features stay integers (int64), as the record engine reads them.
    """
    from client_agent.isolation import GuardedTables

    kept = torch.tensor(bool(keep))
    total: torch.Tensor | None = None
    with GuardedTables(model) as tables:
        for bx, by in source.batches(_QUERY_BATCH):
            xt, yt = _unit_tensors(bx, by)
            finite = kept & finite_records(xt, yt)
            safe_x, safe_y = rows_where(finite, xt), rows_where(finite, yt)
            usable = finite & valid(safe_x, safe_y).to(torch.bool)
            weights = usable.to(torch.float32)
            xt, yt = rows_where(usable, xt), rows_where(usable, yt)
            part = summed_gradient(model, loss, xt, yt, weights=weights).to(torch.float64)
            total = part if total is None else total + part
    assert total is not None
    trainable = torch.from_numpy(trainable_mask(model))
    row = where_or_zero(trainable & ~tables.bad, total / len(source))
    return row.reshape(1, -1).numpy().astype(np.float32)


def client_kept(stopped: NDArray[np.bool_] | None) -> bool:
    """Whether a client unit may contribute: not stopped (``stopped``: its one flag, or None before any filter)."""
    return stopped is None or not bool(np.asarray(stopped).reshape(-1)[0])


def _unit_tensors(bx: Any, by: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the client-unit paths read it: float features as float32, integer ones as int64 (the record
    engine's reading), integer targets as int64 (class labels, as the loss takes them)."""
    xt, yt = batch_tensor(bx), batch_tensor(by)
    xt = xt.to(torch.float32 if xt.is_floating_point() else torch.int64)
    return xt, yt if yt.is_floating_point() else yt.to(torch.int64)


def gradient_rows(request: wire.GradientRequest, x: NDArray[Any], y: NDArray[Any], *, unit: str) -> NDArray[np.float32]:
    """Per-unit gradients of the cross-entropy loss at the request's parameters, materialised (n, d).

    The release path streams record units (:func:`gradient_contributions`); the (n, d) rows here
    are the slow reference for record units and the one row of client units.

    Privacy note: a record the request's model cannot take (a feature that is not finite, or a
    label outside the model's classes, which the coordinator chooses) counts as the null element:
    its row is zero and it pays nothing. Refusing the request instead would answer, uncharged, a
    question about one record's value, e.g. "is some label >= k?" (privacy.md §1, §2).
    """
    model = _loaded_model(wire.GRADIENT, request.model, request.model_args, request.parameters)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    labels = np.asarray(y)
    with torch.no_grad():
        classes = int(model(torch.zeros_like(xt[:1])).shape[-1])
    usable = np.isfinite(xt.reshape(len(xt), -1).numpy()).all(axis=1) & (labels >= 0) & (labels < classes)
    # Every record goes through the same computation, usable or not (the work must not depend on
    # which records are null, privacy.md §8): a null record gets zero features, label 0 and the
    # loss weight 0, so its gradient row is exactly zero and it pays nothing.
    weights = torch.from_numpy(usable.astype(np.float32))
    xt = rows_where(torch.from_numpy(usable), xt)
    yt = torch.from_numpy(or_zero(usable, labels.astype(np.int64)))
    if unit == "record":
        return per_example_gradients(model, _cross_entropy, xt, yt, weights=weights).numpy()
    total = summed_gradient(model, _cross_entropy, xt, yt, weights=weights)
    return (total / len(labels)).reshape(1, -1).numpy().astype(np.float32)


_QUERY_BATCH = 4096  # records per batch of an indicator query


class OneRecordAtATime(torch.nn.Module):
    """The request's model with every record's forward computed from that record alone (record units).

    A query that runs the model (the accuracy check's 'correct') is one release per record: record i's
    row must depend on record i only, or one record could move other records' answers beyond the cost
    each is charged (privacy.md §2). As in the gradient engine (client_agent.isolation):
    - the forward of a batch of one runs over the batch under ``torch.func.vmap``: no operator in the
      owner's model can see another record, and a forward with data-dependent control flow cannot run;
    - each call runs on a fresh copy of the model, so nothing the forward keeps on a module carries one
      block's records into the next;
    - an id outside an ``nn.Embedding``/``nn.EmbeddingBag`` table is looked up as 0 and marks its record
      (``bad``, answered as the null element), never an error (which would answer, uncharged, "does some
      record hold an id >= k?" for a table size the coordinator chose);
    - recurrent layers run unrolled and attention by its math kernel (what vmap can batch).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.bad: torch.Tensor | None = None  # per record of the calls since the last reset: an id outside a table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import copy

        from torch.func import functional_call, vmap

        from client_agent.isolation import _math_attention, guarded_ids
        from client_agent.layers.recurrent import unrolled

        model = copy.deepcopy(self.inner)
        state = (
            {n: p.detach() for n, p in model.named_parameters()},
            {n: b.detach() for n, b in model.named_buffers()},
        )
        flags: list[torch.Tensor] = []

        def guard(m: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            guarded = guarded_ids(m, args, kwargs)
            if guarded is None:
                return None
            call, bad = guarded
            flags.append(bad)
            return call

        def one(xi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            flags.clear()
            with _math_attention(), unrolled(model):
                out = functional_call(model, state, (xi.unsqueeze(0),))
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"model: expected one output tensor for a query, got {type(out).__name__}")
            bad = torch.zeros((), dtype=torch.bool)
            for flag in flags:
                bad = bad | flag
            return out.squeeze(0), bad

        tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag)]
        handles = [m.register_forward_pre_hook(guard, with_kwargs=True) for m in tables]
        try:
            with torch.no_grad():
                result, bad = vmap(one, randomness="error")(x)
        finally:
            for h in handles:
                h.remove()
        self.bad = bad if self.bad is None else self.bad | bad
        out: torch.Tensor = result
        return out


def _synthetic_pass(query: Any, args: QueryArgs, bx: NDArray[Any], by: NDArray[Any]) -> None:
    """Run the query on synthetic records of the data's shapes and dtypes: a model or query it cannot run
    (vmap's refusals, a tuple output) is refused here, the same for every client, never on data."""
    from client_agent.isolation import UnbatchableModelError, synthetic_records

    xs, ys = synthetic_records(batch_tensor(bx), batch_tensor(by))
    try:
        query.rows(xs.numpy(), ys.numpy(), args)
    except Exception as exc:
        raise UnbatchableModelError(
            f"query: the request's model cannot answer it one record at a time ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc


def _kept_records(
    registry: Workload,
    model: torch.nn.Module,
    bx: NDArray[Any],
    by: NDArray[Any],
    keep: NDArray[np.bool_],
    *,
    isolated: bool,
) -> tuple[NDArray[Any], NDArray[np.bool_]]:
    """The batch with every record that may not reach the model zeroed, and which may: a stopped unit's
    records (``keep`` False: the null element enters before the forward, as in the gradient engine), records
    with non-finite features, and records the workload's validity rule rejects (each judged alone under
    vmap in record units, ``isolated``, as client_agent.isolation.per_record_validity does)."""
    from client_agent.isolation import per_record_validity

    xt, yt = batch_tensor(bx), batch_tensor(by)
    if not yt.is_floating_point():
        yt = yt.to(torch.int64)
    flat = xt.reshape(len(xt), -1)
    finite = torch.isfinite(flat).all(dim=1) if xt.is_floating_point() else torch.ones(len(xt), dtype=torch.bool)
    finite = finite & torch.from_numpy(np.ascontiguousarray(keep, dtype=np.bool_))
    safe, safe_y = rows_where(finite, xt), rows_where(finite, yt)
    inner = model.inner if isinstance(model, OneRecordAtATime) else model

    def valid(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return registry.valid(xs, ys, inner)

    with torch.no_grad():
        checked = per_record_validity(valid, safe, safe_y, vmapped=True) if isolated else valid(safe, safe_y).bool()
    mask: NDArray[np.bool_] = (finite & checked).numpy()
    zeroed = or_zero(mask.reshape(-1, *([1] * (bx.ndim - 1))), np.asarray(bx))
    return zeroed, mask


def indicator_rows(
    request: wire.IndicatorRequest,
    x: NDArray[Any] | DataSource,
    y: NDArray[Any] | None = None,
    *,
    unit: str,
    workload: Workload | None = None,
    stopped: NDArray[np.bool_] | None = None,
) -> NDArray[np.float32]:
    """Per-unit rows of the request's query, looked up in ``workload``'s registry (default: the built-in one).

    ``x`` and ``y`` are the records as arrays, or ``x`` is a data source (``y`` None), read in batches.
    ``record`` units: one row of the query's ``dim`` per record, each within the query's declared L2
    bound (workloads.registry.bounded_rows); ``client`` units: the sum of the client's rows, one row
    (with ``reduce`` 'mean', their mean over all its records: within the same bound).
    A query that runs the request's model (privacy.md §4, the accuracy checks) runs it as the gradient
    engine does: each record alone (:class:`OneRecordAtATime`, in client units too), after a pass on synthetic
    records (so a model the query cannot run is refused whatever the data); the records of a unit in
    ``stopped`` (one flag per unit), with non-finite features, rejected by the workload's validity rule, or
    holding an id outside an embedding table are the null element: zeroed before the forward, answered 0.
    A name the workload does not register, or a ``column`` beyond the features, is malformed.
    """
    registry = workload if workload is not None else BUILTIN
    try:
        query = registry.query(request.predicate)
    except WorkloadError as exc:
        raise wire.ProtocolError(f"{wire.INDICATOR}: query {request.predicate!r}: {exc}") from exc
    model = None
    if query.needs_model:
        if request.model is None or request.model_args is None or request.parameters is None:
            raise wire.ProtocolError(f"{wire.INDICATOR}: query {request.predicate!r} needs the request's model")
        model = _loaded_model(
            wire.INDICATOR,
            request.model,
            request.model_args,
            request.parameters,
            workload=registry,
            layout=request.layout,
        )
    isolated = unit == "record"
    if model is not None:
        if isolated:
            check_model(model)  # what the per-record engine refuses (BatchNorm, training-mode dropout)
        # Client units too: the embedding guard keeps an id outside a table from refusing the request
        # (uncharged) on one record's value, and a fresh model per call keeps no state between calls.
        model = OneRecordAtATime(model)
    args = QueryArgs(column=request.column, value=request.value, model=model)
    batches = ((x, y),) if y is not None else x.batches(_QUERY_BATCH)  # type: ignore[union-attr]
    parts: list[NDArray[np.float32]] = []
    done = 0
    for bx, by in batches:
        bx = bx.numpy() if isinstance(bx, torch.Tensor) else np.asarray(bx)
        by = by.numpy() if isinstance(by, torch.Tensor) else np.asarray(by)
        features = int(np.prod(bx.shape[1:], dtype=np.int64))
        if query.column_bound and request.column >= features:
            raise wire.ProtocolError(
                f"{wire.INDICATOR}: 'column' must be < {features} (the client's feature count), got {request.column}"
            )
        keep = np.ones(len(bx), dtype=np.bool_)
        if stopped is not None:
            keep = ~(stopped[done : done + len(bx)] if isolated else np.repeat(stopped[:1], len(bx)))
        if model is not None:
            if not done:  # before any data reaches the model: the same query on synthetic records
                _synthetic_pass(query, args, bx, by)
            bx, kept = _kept_records(registry, model, bx, by, keep, isolated=isolated)
            if isinstance(model, OneRecordAtATime):
                model.bad = None
        else:  # a stopped unit's records reach no query either (privacy.md §2): the null element, zeros
            bx, kept = or_zero(keep.reshape(-1, *([1] * (bx.ndim - 1))), bx), keep
        by = or_zero(kept.reshape(-1, *([1] * (by.ndim - 1))), by)  # nor their targets
        rows = bounded_rows(query, query.rows(bx, by, args), len(bx))
        if isinstance(model, OneRecordAtATime) and model.bad is not None:
            kept = kept & ~model.bad.numpy()
        rows = or_zero(kept.reshape(-1, 1), np.asarray(rows, dtype=np.float32))
        parts.append(rows)
        done += len(bx)
    values = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if unit == "record":
        return values
    summed = values.sum(axis=0, keepdims=True, dtype=np.float64)
    if request.reduce == "mean":
        summed /= max(len(values), 1)
    out: NDArray[np.float32] = summed.astype(np.float32)
    return out
