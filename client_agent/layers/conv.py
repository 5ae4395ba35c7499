"""``nn.Conv1d`` / ``nn.Conv2d`` (groups 1, zero padding, numeric padding): the backprop times the unfolded input.

Each record's weight gradient is its backprop (C_out, L) times its unfolded input (L, C k), one
batched matmul per block of about :data:`_BLOCK_FLOATS` floats of patches and rows, so that a block
stays in cache (on a GPU, :data:`_DEVICE_BLOCK_FLOATS`: there a block is bounded by memory, and each
matmul costs a launch). The rows are in patch order; ``to_param`` permutes a summed row to the weight's
(C_out, C, *kernel) layout. A Conv1d is a Conv2d of height 1.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from client_agent.layers.base import DenseRows, Rows

# Floats per block of records for the patches and per-record gradients: 2^19 floats is 2 MiB in
# float32, about what stays in a core's cache.
_BLOCK_FLOATS = 1 << 19
# On another device (a GPU): 2^25 floats (128 MiB of float32 patches and rows) a block, a few blocks a chunk.
_DEVICE_BLOCK_FLOATS = 1 << 25

Pair = tuple[int, int]


def _geometry(m: nn.Module) -> tuple[Pair, Pair, Pair, Pair]:
    """Kernel size, dilation, padding and stride as pairs (a Conv1d has height 1)."""
    if isinstance(m, nn.Conv1d):
        return (1, m.kernel_size[0]), (1, m.dilation[0]), (0, cast(tuple[int], m.padding)[0]), (1, m.stride[0])
    c = cast(nn.Conv2d, m)
    return cast(Pair, c.kernel_size), cast(Pair, c.dilation), cast(Pair, c.padding), cast(Pair, c.stride)


def patches(a: torch.Tensor, k: Pair, d: Pair, p: Pair, s: Pair) -> torch.Tensor:
    """The unfolded input (b, L, k C): each patch's features in (kernel row, column, channel) order.

    The input is copied once channels-last (unless it is channels-last already, as a channels-last
    model's activations are; nor is it padded without padding), then one strided copy gathers the patches
    with each channel run contiguous (faster than the (C, k) order of ``F.unfold``). Both choices depend
    on the layer's geometry and the model's layout only.
    """
    padded = a if p == (0, 0) else nn.functional.pad(a, (p[1], p[1], p[0], p[0]))
    b, c, h, w = padded.shape
    oh, ow = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1, (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
    last = padded.permute(0, 2, 3, 1)
    if not last.is_contiguous():
        last = torch.empty((b, h, w, c), dtype=a.dtype, device=a.device).copy_(last)
    sb, sh, sw, sc = last.stride()
    view = last.as_strided((b, oh, ow, k[0], k[1], c), (sb, sh * s[0], sw * s[1], sh * d[0], sw * d[1], sc))
    return view.reshape(b, oh * ow, c * k[0] * k[1])


def block_records(device: torch.device, inputs: int, positions: int, c_out: int) -> int:
    """Records per block of patches (positions x inputs) and rows (c_out x inputs): :data:`_BLOCK_FLOATS` of
    them on a CPU, :data:`_DEVICE_BLOCK_FLOATS` elsewhere; at least one. Fixed by the device and the layer's
    geometry, never by the data."""
    block = _BLOCK_FLOATS if device.type == "cpu" else _DEVICE_BLOCK_FLOATS
    return max(1, block // (inputs * (positions + c_out)))


class ConvKind:
    name = "conv"

    def supports(self, m: nn.Module) -> bool:
        if type(m) not in (nn.Conv1d, nn.Conv2d):
            return False
        c = cast(nn.Conv1d | nn.Conv2d, m)
        return c.groups == 1 and c.padding_mode == "zeros" and not isinstance(c.padding, str)

    def rows(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> Rows:
        b = a.shape[0]
        spatial = 1 if isinstance(m, nn.Conv1d) else 2
        # (B, [k,] C, *spatial) -> (B k, C, H, W): an unbatched input is a batch of one.
        inner = a.shape[1 : a.ndim - spatial - 1]
        a2 = a.reshape(-1, *a.shape[a.ndim - spatial - 1 :])
        g2 = g.reshape(-1, *g.shape[g.ndim - spatial - 1 :])
        if spatial == 1:
            a2, g2 = a2.unsqueeze(2), g2.unsqueeze(2)
        k, d, p, s = _geometry(m)
        c_in, c_out = a2.shape[1], g2.shape[1]
        positions, inputs = g2.shape[2] * g2.shape[3], c_in * k[0] * k[1]
        gb = g2.reshape(-1, c_out, positions)
        weight = torch.empty(gb.shape[0], c_out, inputs, dtype=a.dtype, device=a.device)
        step = block_records(a.device, inputs, positions, c_out)
        for i in range(0, gb.shape[0], step):
            torch.bmm(gb[i : i + step], patches(a2[i : i + step], k, d, p, s), out=weight[i : i + step])
        shape = cast(torch.Tensor, m.weight).shape
        per = 1
        for n in inner:
            per *= n

        def to_param(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(c_out, k[0], k[1], c_in).permute(0, 3, 1, 2).reshape(shape)

        rows = {"weight": weight if per == 1 else weight.reshape(b, per, c_out, inputs).sum(dim=1)}
        if getattr(m, "bias", None) is not None:
            rows["bias"] = gb.sum(dim=2).reshape(b, per, c_out).sum(dim=1)
        return DenseRows(rows, {"weight": to_param})

    def row_floats(self, m: nn.Module, a_shape: tuple[int, ...]) -> int:
        """The record's rows as :meth:`rows` forms them: a record whose forward folds ``per`` items into the
        convolution's batch (input ``(per, C, *spatial)``) has ``per`` weight rows before they are summed."""
        spatial = 1 if isinstance(m, nn.Conv1d) else 2
        per = 1
        for n in a_shape[: max(0, len(a_shape) - spatial - 1)]:
            per *= int(n)
        return max(1, per) * sum(p.numel() for p in m.parameters(recurse=False))


KIND = ConvKind()
