"""``nn.Linear``: each record's gradient is sum over its positions of g_t a_t^T.

One position per record (the usual (1, in) input of a batch of one): the gradient is the outer
product g a^T, its norm ||a|| ||g|| (float64) and the records' weighted sum (w g)^T a one float64
matmul, each entry a sum over records of one product each (no cancellation inside a record is
possible). Several positions (sequences): one bmm g^T a per record.

The factored norm needs factors of float32 or narrower: their squares, at least 2^-298, are normal in
float64, so ||a||^2 ||g||^2 is within a few roundings. Factors of float64 (an owner's float64 model) are
materialised as g a^T instead: a subnormal ||a||^2 carries only a few bits, and a review (2026-11-27)
charged a record 2.7 % less than the product it added (a saturated sigmoid before the layer, a large
backprop after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from client_agent.layers.base import DenseRows, Rows, View, rows_where


@dataclass
class OuterRows:
    """Records' gradients g_i a_i^T (and g_i for the bias) kept as their factors a (B, in) and g (B, out)."""

    a: torch.Tensor
    g: torch.Tensor
    names: tuple[str, ...]

    def drop(self, names: frozenset[str]) -> None:
        self.names = tuple(n for n in self.names if n not in names)

    def sq(self, b: int, device: torch.device) -> torch.Tensor:
        """||g a^T||^2 = ||a||^2 ||g||^2 (+ ||g||^2 for the bias), float64."""
        g_sq = torch.linalg.vector_norm(self.g, dim=1, dtype=torch.float64).square()
        out = torch.zeros(b, dtype=torch.float64, device=device)
        if "weight" in self.names:
            out += torch.linalg.vector_norm(self.a, dim=1, dtype=torch.float64).square() * g_sq
        if "bias" in self.names:
            out += g_sq
        return out

    def add(self, wk: torch.Tensor, keep: torch.Tensor, view: View) -> None:
        gw = rows_where(keep, self.g).to(torch.float64) * wk.unsqueeze(1)
        if "weight" in self.names:
            view("weight").add_(torch.mm(gw.t(), rows_where(keep, self.a).to(torch.float64)))
        if "bias" in self.names:
            view("bias").add_(gw.sum(dim=0))


def _factored(dtype: torch.dtype) -> bool:
    """Whether a factor of this dtype keeps its square normal in float64 (float32 and narrower)."""
    return dtype.itemsize <= 4


class LinearKind:
    name = "linear"

    def supports(self, m: nn.Module) -> bool:
        return type(m) is nn.Linear or isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear)

    def rows(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> Rows:
        b = a.shape[0]
        a3, g3 = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
        names = ("weight",) + (("bias",) if getattr(m, "bias", None) is not None else ())
        if a3.shape[1] == 1 and _factored(a.dtype) and _factored(g.dtype):
            return OuterRows(a3[:, 0], g3[:, 0], names)
        rows = {"weight": torch.bmm(g3.transpose(1, 2), a3)}
        if "bias" in names:
            rows["bias"] = g3.sum(dim=1)
        return DenseRows(rows)

    def row_floats(self, m: nn.Module, a_shape: tuple[int, ...]) -> int:
        positions = 1
        for s in a_shape[:-1]:
            positions *= s
        if positions == 1 and _factored(cast(nn.Linear, m).weight.dtype):  # kept as factors
            return int(a_shape[-1]) + int(cast(nn.Linear, m).out_features)
        return sum(p.numel() for p in m.parameters(recurse=False))


KIND = LinearKind()
