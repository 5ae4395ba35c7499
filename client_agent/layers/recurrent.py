"""``nn.LSTM`` and ``nn.GRU`` written out step by step in plain tensor operations, for the per-record function.

PyTorch's fused recurrent kernels have no vmap batching rule (``nn.GRU`` cannot run under vmap at all,
``nn.LSTM`` only record by record), so inside the per-record function (client_agent.isolation) each
recurrent module's ``forward`` is replaced, for the duration of the pass, by the same equations
(PyTorch's documentation of ``nn.LSTM`` and ``nn.GRU``; gate order i, f, g, o and r, z, n) over its
own parameters: matmuls and elementwise operations, which vmap batches. Supported: any number of
layers, bidirectional, ``batch_first``, with or without bias, batched or unbatched input; not
``proj_size`` > 0 nor inter-layer dropout in training (the original forward runs then). The
parameters' per-record gradients are taken directly (``torch.func.grad``), as for any module without
a layer kind; tests/unit/test_model_zoo.py checks them against a per-record loop of ``nn.LSTM`` itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _supported(m: nn.Module) -> bool:
    if type(m) not in (nn.LSTM, nn.GRU):
        return False
    rnn: Any = m
    return int(getattr(rnn, "proj_size", 0)) == 0 and not (rnn.training and rnn.dropout > 0 and rnn.num_layers > 1)


def _cell(kind: type, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, w: list[torch.Tensor | None]) -> Any:
    w_ih, w_hh, b_ih, b_hh = w
    gi = x @ w_ih.t()  # type: ignore[union-attr]
    gh = h @ w_hh.t()  # type: ignore[union-attr]
    if b_ih is not None:
        gi = gi + b_ih
    if b_hh is not None:
        gh = gh + b_hh
    if kind is nn.LSTM:
        i, f, g, o = (gi + gh).chunk(4, dim=-1)
        assert c is not None
        c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c2), c2
    ir, iz, in_ = gi.chunk(3, dim=-1)
    hr, hz, hn = gh.chunk(3, dim=-1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    n = torch.tanh(in_ + r * hn)
    return (1 - z) * n + z * h, None


def unrolled_forward(m: nn.Module, x: torch.Tensor, hx: Any = None) -> tuple[torch.Tensor, Any]:
    """What ``m(x, hx)`` returns for an ``nn.LSTM`` or ``nn.GRU``, computed step by step."""
    rnn: Any = m
    kind = type(m)
    unbatched = x.dim() == 2
    if unbatched:
        x = x.unsqueeze(1 if not rnn.batch_first else 0)
    if rnn.batch_first:
        x = x.transpose(0, 1)  # (T, B, F)
    steps, batch = x.shape[0], x.shape[1]
    dirs = 2 if rnn.bidirectional else 1
    zeros = x.new_zeros(rnn.num_layers * dirs, batch, rnn.hidden_size)
    if hx is None:
        h0, c0 = zeros, (zeros if kind is nn.LSTM else None)
    elif kind is nn.LSTM:
        h0, c0 = hx
        if unbatched:
            h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
    else:
        h0, c0 = (hx.unsqueeze(1) if unbatched else hx), None
    layer_in = x
    h_n, c_n = [], []
    for layer in range(rnn.num_layers):
        outs = []
        for d in range(dirs):
            suffix = f"_l{layer}" + ("_reverse" if d else "")
            w = [
                getattr(rnn, f"weight_ih{suffix}"),
                getattr(rnn, f"weight_hh{suffix}"),
                getattr(rnn, f"bias_ih{suffix}") if rnn.bias else None,
                getattr(rnn, f"bias_hh{suffix}") if rnn.bias else None,
            ]
            k = layer * dirs + d
            h, c = h0[k], (c0[k] if c0 is not None else None)
            seq: list[torch.Tensor] = []
            order = range(steps - 1, -1, -1) if d else range(steps)
            for t in order:
                h, c = _cell(kind, layer_in[t], h, c, w)
                seq.append(h)
            if d:
                seq.reverse()
            outs.append(torch.stack(seq))
            h_n.append(h)
            if c is not None:
                c_n.append(c)
        layer_in = torch.cat(outs, dim=-1) if dirs == 2 else outs[0]
    out = layer_in.transpose(0, 1) if rnn.batch_first else layer_in
    hn = torch.stack(h_n)
    state: Any = (hn, torch.stack(c_n)) if kind is nn.LSTM else hn
    if unbatched:
        out = out.squeeze(0 if rnn.batch_first else 1)
        state = (state[0].squeeze(1), state[1].squeeze(1)) if kind is nn.LSTM else state.squeeze(1)
    return out, state


@contextmanager
def unrolled(model: nn.Module) -> Iterator[None]:
    """Every supported ``nn.LSTM`` / ``nn.GRU`` of ``model`` runs :func:`unrolled_forward` for the duration."""
    swapped = [m for m in model.modules() if _supported(m)]
    for m in swapped:
        m.forward = lambda x, hx=None, m=m: unrolled_forward(m, x, hx)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward
