"""``nn.Embedding`` (no max_norm, no scale_grad_by_freq): each token's summed backprop at its first position.

Each record's gradient as (T, dim) rows: at each token's first position the sum of its positions'
backprops, zeros at its repeats (the padding index gets no gradient). Per record, a stable sort of
the ids groups each token's positions, a scatter-add sums each group, and a scatter puts each sum
back at the first position: memory linear in T (a T x T equality matrix would take T^2 per record).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from client_agent.layers.base import DenseRows, Rows, or_zero


class EmbeddingKind:
    name = "embedding"

    def supports(self, m: nn.Module) -> bool:
        return type(m) is nn.Embedding and m.max_norm is None and not m.scale_grad_by_freq

    def rows(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> Rows:
        e = cast(nn.Embedding, m)
        b = a.shape[0]
        idx2 = a.reshape(b, -1)
        g3 = g.reshape(b, idx2.shape[1], -1)
        if e.padding_idx is not None:
            g3 = or_zero((idx2 != e.padding_idx).unsqueeze(-1), g3)
        ids, order = idx2.sort(dim=1, stable=True)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        group = (starts.cumsum(dim=1) - 1).unsqueeze(-1).expand_as(g3)
        wide = order.unsqueeze(-1).expand_as(g3)
        sums = torch.zeros_like(g3).scatter_add_(1, group, g3.gather(1, wide))
        at_start = or_zero(starts.unsqueeze(-1), sums.gather(1, group))
        rows = torch.zeros_like(g3).scatter_(1, wide, at_start)
        return DenseRows({"weight": rows}, index=idx2)

    def row_floats(self, m: nn.Module, a_shape: tuple[int, ...]) -> int:
        t = 1
        for s in a_shape:
            t *= s
        return max(1, t) * cast(nn.Embedding, m).embedding_dim


KIND = EmbeddingKind()
