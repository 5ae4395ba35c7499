"""A second built-in workload, ``regression``: least squares on the same ``.npz`` records as ``builtin``.

Its one model, ``linreg`` (``in_features`` -> 1), is trained with the squared error of the record's
target ``y`` read as a real number (for 0/1 labels: the linear probability model). It shows what one
budget per person means (privacy.md §11): an agent names it beside ``builtin`` (``workloads =
["workloads.regression:REGRESSION"]``) and a classifier and a regression on the same records, with two
different losses, charge one filter per record in one ledger. Its data source is ``builtin``'s, so the
records and their order (their identities in the ledger) are the same whichever workload asks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workloads.builtin import npz_data
from workloads.registry import Workload

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


def linreg(*, in_features: int) -> nn.Module:
    """One linear output, PyTorch's default initialisation."""
    from torch import nn

    return nn.Linear(in_features, 1)


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-example squared error (reduction none) of a real-valued target."""
    return (outputs.reshape(len(outputs)) - targets.reshape(len(targets)).to(outputs.dtype)) ** 2


REGRESSION = Workload(name="regression", models={"linreg": linreg}, loss=squared_error, data=npz_data)
