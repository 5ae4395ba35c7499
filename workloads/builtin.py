"""The built-in workload ``builtin``: today's models, cross-entropy, the ``.npz`` data and four predicates.

It is registered like any user's workload (:mod:`workloads.registry`); presets, demos and tests go
through this same registry. Queries (0/1 predicates, so each record's vector has L2 bound 1):

- ``column``    X[:, column] != 0     (sparse counting queries, FZ Thm 1.2)
- ``label``     y == value
- ``threshold`` X[:, column] > value
- ``correct``   the request's model classifies the record correctly (needs the model)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from workloads.models import MODELS
from workloads.registry import DataSource, Query, QueryArgs, Workload, finite_features

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy (reduction none) of integer class targets."""
    import torch

    return torch.nn.functional.cross_entropy(logits, targets.long(), reduction="none")


def classification_records(x: torch.Tensor, y: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
    """Usable records for a classifier: finite features and an integer label in [0, classes).

    Privacy note: the coordinator chooses the model and so the number of classes; a record whose
    label the model cannot take is the null element (zero contribution, no charge), never a refusal,
    which would answer, uncharged, "is some label >= k?" (privacy.md §1, §2).
    """
    import torch

    ok = finite_features(x, y)
    if model is None:
        return ok
    with torch.no_grad():  # zeros of one record's shape, not derived from x: one forward, whatever the batch
        kind = torch.float32 if x.is_floating_point() else torch.int64  # as the agent's engine feeds the model
        classes = int(model(torch.zeros((1, *x.shape[1:]), dtype=kind, device=x.device)).shape[-1])
    labels = y.reshape(y.shape[0], -1)[:, 0] if y.ndim > 1 else y
    whole = labels == torch.floor(labels) if labels.is_floating_point() else torch.ones_like(ok)
    return ok & whole & (labels >= 0) & (labels < classes)


# MNIST's customary per-pixel mean and std (of x / 255): the built-in models take standardised images
# (the simulations' datasets use the same pair, simulations.datasets.idx.NORMALISATION; a test checks).
MNIST_NORMALISATION = (0.1307, 0.3081)


def npz_data(path: Path) -> DataSource:
    """``.npz`` / ``.npy`` pairs as stored; MNIST IDX files as standardised float32 ``(n, 1, 28, 28)`` images."""
    from workloads.data_sources import open_source

    return open_source(path, normalise=MNIST_NORMALISATION)


def _flat(x: Any) -> Any:
    return x.reshape(len(x), -1)


def _column(x: Any, y: Any, args: QueryArgs) -> Any:
    return (_flat(x)[:, args.column] != 0).astype("float32")


def _threshold(x: Any, y: Any, args: QueryArgs) -> Any:
    return (_flat(x)[:, args.column] > args.value).astype("float32")


def _label(x: Any, y: Any, args: QueryArgs) -> Any:
    return (y.reshape(len(y)) == args.value).astype("float32")


def _correct(x: Any, y: Any, args: QueryArgs) -> Any:
    import numpy as np
    import torch

    assert args.model is not None
    with torch.no_grad():
        logits = args.model(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
    return (logits.argmax(dim=1).numpy() == np.asarray(y).reshape(len(y))).astype("float32")


BUILTIN = Workload(
    name="builtin",
    models=MODELS,
    loss=cross_entropy,
    data=npz_data,
    valid=classification_records,
    queries={
        "column": Query(_column, dim=1, l2_bound=1.0, column_bound=True, doc="X[:, column] != 0"),
        "label": Query(_label, dim=1, l2_bound=1.0, doc="y == value"),
        "threshold": Query(_threshold, dim=1, l2_bound=1.0, column_bound=True, doc="X[:, column] > value"),
        "correct": Query(_correct, dim=1, l2_bound=1.0, needs_model=True, doc="argmax model(x) == y"),
    },
)
