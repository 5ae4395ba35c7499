"""The interface of a layer kind and the per-record rows every kind produces.

A layer kind (:class:`LayerKind`) turns one module's per-record input ``a`` and per-record
backprop ``g`` into that record's gradient of the module's own parameters (:class:`Rows`). Both
``a`` and ``g`` come from a forward and backward computed with that record alone
(:mod:`client_agent.isolation`); a kind only does the algebra. Each record's norm is taken from
exactly the values its weighted contribution is summed from (:meth:`Rows.sq`, :meth:`Rows.add`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

_SUM_RECORDS = 64  # records of rows converted to float64 at a time (weighted sum, squared norms) on a CPU
# On another device (a GPU) each operation costs a launch, tens of microseconds from Python whatever its
# size: runs of up to 2^24 floats of float64 rows (128 MiB, the size of the engine's float32 block of rows,
# streaming._EXPLICIT_FLOATS), so that the runs of a request are a few operations rather than thousands
# (benchmarks/engine_ops.py).
_DEVICE_SUM_FLOATS = 1 << 24


def sum_records(t: torch.Tensor) -> int:
    """Records (rows of ``t``, shape (B, ...)) per float64 run: :data:`_SUM_RECORDS` on a CPU, where a run
    stays in cache; elsewhere as many as fit :data:`_DEVICE_SUM_FLOATS` (at least one). Fixed by the
    device and the shape of a row, never by the data; the run length changes only the order of float64
    roundings (each square is exact in float64, each weighted product rounded once), never which records
    enter or how."""
    if t.device.type == "cpu":
        return _SUM_RECORDS
    row = 1
    for n in t.shape[1:]:
        row *= int(n)
    return max(1, _DEVICE_SUM_FLOATS // max(1, row))


View = Callable[[str], torch.Tensor]


class LayerKind(Protocol):
    """One kind of module whose per-record gradient is formed from its input and its output's backprop."""

    name: str

    def supports(self, m: nn.Module) -> bool:
        """Structural: the module's type and settings, never a value."""
        ...

    def rows(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> Rows:
        """Records' gradients of ``m``'s own parameters from ``a`` (B, *input) and ``g`` (B, *output).

        ``a`` and ``g`` are per record as that record's own forward saw them: (B, 1, ...) for a
        batch of one, (B, ...) for an input the record does not batch (positional ids).
        """
        ...

    def row_floats(self, m: nn.Module, a_shape: tuple[int, ...]) -> int:
        """Floats of one record's rows of ``m`` for per-record inputs of shape ``a_shape`` (without B)."""
        ...


class Rows(Protocol):
    """A block of records' gradients of one module's parameters."""

    def sq(self, b: int, device: torch.device) -> torch.Tensor:
        """Each record's squared norm over these rows, float64 (B,)."""
        ...

    def add(self, wk: torch.Tensor, keep: torch.Tensor, view: View) -> None:
        """view(name) += sum_i wk_i rows_i (float64); a record outside ``keep`` enters as exact zeros."""
        ...

    def drop(self, names: frozenset[str]) -> None:
        """Forget the rows of these local parameter names (frozen parameters are neither released nor charged)."""
        ...


@dataclass
class DenseRows:
    """Materialised rows: local parameter name -> (B, ...) per-record gradients.

    ``to_param`` maps a summed row to the parameter's layout (a convolution's rows are in patch
    order); ``index`` (embeddings): the token id of each row position, (B, T), the rows being
    (B, T, dim) with each token's gradient at its first position in the record, zeros at repeats.
    """

    tensors: dict[str, torch.Tensor]
    to_param: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    index: torch.Tensor | None = None

    def drop(self, names: frozenset[str]) -> None:
        self.tensors = {k: v for k, v in self.tensors.items() if k not in names}

    def sq(self, b: int, device: torch.device) -> torch.Tensor:
        out = torch.zeros(b, dtype=torch.float64, device=device)
        for t in self.tensors.values():
            out += squared_norms(t.reshape(b, -1))
        return out

    def add(self, wk: torch.Tensor, keep: torch.Tensor, view: View) -> None:
        """The rows are zeroed in place outside ``keep`` (the same bitwise AND on every record: a non-finite
        row times 0 would be NaN), then summed weighted in float64, a run of :func:`sum_records` records
        converted at a time: each product is rounded once in float64, and including or leaving out a
        record changes the rounding of the others' sum by float64 amounts only."""
        for name, t in self.tensors.items():
            or_zero_(keep.reshape(-1, *([1] * (t.ndim - 1))), t)
            if self.index is not None:
                weighted = t.to(torch.float64) * wk.reshape(-1, *([1] * (t.ndim - 1)))
                view(name).index_add_(0, self.index.reshape(-1), weighted.reshape(-1, t.shape[-1]))
                continue
            flat = t.reshape(t.shape[0], -1)
            summed = torch.zeros(flat.shape[1], dtype=torch.float64, device=flat.device)
            run = sum_records(flat)
            for i in range(0, flat.shape[0], run):
                summed += torch.mv(flat[i : i + run].t().to(torch.float64), wk[i : i + run])
            shaped = summed.view(t.shape[1:])
            view(name).add_(self.to_param[name](shaped) if name in self.to_param else shaped)


def squared_norms(flat: torch.Tensor) -> torch.Tensor:
    """Each row's squared L2 norm, float64 (B,), with a relative error below gamma_d in float64.

    Each run of :func:`sum_records` rows is converted to float64 (exactly: float32, bfloat16 and
    float16 values are float64 values) and its squares summed there: no float32 square can underflow
    (a review found float32 squares of entries below 2^-63 lost, and half-precision runs rounded to 8
    bits), and the only error is float64 rounding, gamma_d = d 2^-53 / (1 - d 2^-53) relative for a row of
    d entries (Higham, "Accuracy and Stability of Numerical Algorithms", Lemma 3.1), below 2^-20 for
    d <= 2^33. The streaming engine's NORM_REL_ERROR is set from this bound (client_agent/streaming.py).
    """
    out = torch.empty(flat.shape[0], dtype=torch.float64, device=flat.device)
    run = sum_records(flat)
    for i in range(0, flat.shape[0], run):
        # A copy even of float64 rows (``to`` would return them), squared in place: one float64 run at a time.
        out[i : i + run] = flat[i : i + run].to(torch.float64, copy=True).square_().sum(dim=1)
    return out


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def or_zero(keep: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` where ``keep`` (broadcast against ``t``), exact zeros elsewhere, in time independent of ``keep``.

    A bitwise AND with an all-ones / all-zeros word per element, never a branch: torch.where's CPU
    loop is not branch-free for every layout (over 65,536 float32 with a per-element mask it took 47 us
    on an all-False mask and 242 us on a random half), so a mask saying which records stopped or were
    null would set the reply's timing (privacy.md §8; protocol/branchless.py does the same in numpy).
    Bit for bit: NaN payloads and infinities are kept where ``keep`` holds and become +0 elsewhere.
    """
    if keep.dtype != torch.bool:
        raise TypeError(f"keep: expected a boolean mask, got {keep.dtype}")
    if t.requires_grad:
        raise TypeError("or_zero: a bitwise selection carries no gradient; expected a tensor without requires_grad")
    if t.dtype == torch.bool:
        return t & keep
    if t.is_complex():
        raise TypeError(f"or_zero: expected a real or integer tensor, got {t.dtype}")
    word = t.dtype if not t.is_floating_point() else _WORD[t.element_size()]
    return torch.bitwise_and(t.view(word), _ones_where(keep, word)).view(t.dtype)


def _ones_where(keep: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """All bits set where ``keep``, none elsewhere, in the integer dtype ``word``."""
    return keep.to(word).neg_() if word != torch.uint8 else keep.to(word).mul_(255)


def or_zero_(keep: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """In place :func:`or_zero` for a real tensor: its entries outside ``keep`` become +0, bitwise."""
    if keep.dtype != torch.bool or not t.is_floating_point():
        raise TypeError(f"or_zero_: expected a boolean mask and a float tensor, got {keep.dtype} and {t.dtype}")
    word = _WORD[t.element_size()]
    t.view(word).bitwise_and_(_ones_where(keep, word))
    return t


def rows_where(keep: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` for the records in ``keep``, exact zeros for the others: the same bitwise AND on every record."""
    return or_zero(keep.reshape(-1, *([1] * (t.ndim - 1))), t)
