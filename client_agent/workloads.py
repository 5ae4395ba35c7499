"""Each unit's unclipped contribution to a request, one float32 row per unit.

- gradient (``record`` units): the per-record loss gradient at the broadcast parameters,
  by ``torch.func`` (vmap over grad); (``client`` units): the gradient of the client's
  mean loss, one row.
- indicator (``record`` units): each record's 0/1 predicate value; (``client`` units):
  the client's count of records for which it holds, one row of length 1.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from client_agent.gradients import per_example_gradients, summed_gradient
from protocol import messages as wire
from protocol.models import build_model, load_flat_parameters, parameter_count


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, targets, reduction="none")


def _loaded_model(kind: str, name: str, model_args: str, parameters: NDArray[np.float32]) -> torch.nn.Module:
    """The request's model with its parameters loaded; a name, argument or size that does not fit is malformed."""
    try:
        with torch.device("meta"):  # count first, allocate nothing: model_args may name huge layers
            expected = parameter_count(build_model(name, **json.loads(model_args)))
    except (ValueError, TypeError) as exc:
        raise wire.ProtocolError(f"{kind}: model {name!r} with {model_args}: {exc}") from exc
    if parameters.size != expected:
        raise wire.ProtocolError(
            f"{kind}: 'parameters' must hold {expected} values for model {name!r}, got {parameters.size}"
        )
    model = build_model(name, **json.loads(model_args))
    load_flat_parameters(model, parameters)
    return model


def gradient_rows(request: wire.GradientRequest, x: NDArray[Any], y: NDArray[Any], *, unit: str) -> NDArray[np.float32]:
    """Per-unit gradients of the cross-entropy loss at the request's parameters.

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
    xt = torch.where(weights.reshape(-1, *([1] * (xt.ndim - 1))) > 0, xt, torch.zeros((), dtype=xt.dtype))
    yt = torch.from_numpy(np.where(usable, labels, 0).astype(np.int64))
    if unit == "record":
        return per_example_gradients(model, _cross_entropy, xt, yt, weights=weights).numpy()
    total = summed_gradient(model, _cross_entropy, xt, yt, weights=weights)
    return (total / len(labels)).reshape(1, -1).numpy().astype(np.float32)


def indicator_rows(
    request: wire.IndicatorRequest, x: NDArray[Any], y: NDArray[Any], *, unit: str
) -> NDArray[np.float32]:
    """Per-unit indicator of the request's predicate (closed table :data:`protocol.messages.PREDICATES`)."""
    flat = x.reshape(len(x), -1)
    if request.predicate in ("column", "threshold") and request.column >= flat.shape[1]:
        raise wire.ProtocolError(
            f"{wire.INDICATOR}: 'column' must be < {flat.shape[1]} (the client's feature count), got {request.column}"
        )
    if request.predicate == "column":
        hits = flat[:, request.column] != 0
    elif request.predicate == "threshold":
        hits = flat[:, request.column] > request.value
    elif request.predicate == "correct":
        assert request.model is not None and request.model_args is not None and request.parameters is not None
        model = _loaded_model(wire.INDICATOR, request.model, request.model_args, request.parameters)
        with torch.no_grad():
            logits = model(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
        hits = logits.argmax(dim=1).numpy() == np.asarray(y)
    else:
        hits = np.asarray(y) == request.value
    values = hits.astype(np.float32).reshape(-1, 1)
    if unit == "record":
        return values
    return values.sum(axis=0, keepdims=True)
