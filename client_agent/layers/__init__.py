"""Per-record gradient rows by layer kind, one module per kind behind :class:`LayerKind` (as Opacus's
``grad_sample/``): a new kind is one new file and one entry in :data:`KINDS`.

Every other module's parameters get their per-record gradients directly from ``torch.func``
(:mod:`client_agent.isolation`); a kind here is only a faster way to the same values.
"""

from __future__ import annotations

from torch import nn

from client_agent.layers import conv, embedding, linear
from client_agent.layers.base import DenseRows, LayerKind, Rows, rows_where, squared_norms

KINDS: tuple[LayerKind, ...] = (linear.KIND, conv.KIND, embedding.KIND)


def kind_of(m: nn.Module) -> LayerKind | None:
    """The kind whose rows ``m``'s parameters get, or None (their gradients are taken directly)."""
    return next((k for k in KINDS if k.supports(m)), None)


__all__ = ["KINDS", "DenseRows", "LayerKind", "Rows", "kind_of", "rows_where", "squared_norms"]
