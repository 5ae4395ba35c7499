"""Selections whose running time does not depend on the mask: bitwise, never a branch per element.

numpy's masked primitives take time that depends on what the mask holds: measured on this
project's 2-core machine over 65,536 float64 (``benchmarks/timing_uniformity.py``), ``np.where``
takes 47 us on an all-False mask and 275 us on a random half, ``np.copyto(..., where=)`` 8 us
against 337 us, ``np.putmask`` and boolean-mask assignment likewise: the loop branches per
element, and a mispredicted branch costs the same whatever the element. In the release path the
masks are "which units are stopped, admitted, refused", so such a primitive lets the reply's
timing tell the coordinator how many units stopped, the very thing privacy.md §7-§8 hide.

These helpers do the same selections with integer bit operations over whole arrays: the mask
becomes an all-ones / all-zeros word per element (0 - m), and ``b ^ ((a ^ b) & m)`` picks ``a``
or ``b`` bit for bit (NaN payloads, infinities and the sign of zero included). Every element
costs the same; the time depends on the arrays' sizes only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

_INT_OF = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _word_mask(mask: ArrayLike, shape: tuple[int, ...], itemsize: int) -> NDArray[Any]:
    """All bits set where ``mask`` holds, none elsewhere: one integer word of ``itemsize`` bytes per element."""
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"mask: expected a boolean array, got dtype {m.dtype}")
    # True is the byte 1: negated as int8 it is -1 (all ones), which widening keeps (sign extension).
    return np.broadcast_to(np.negative(m.view(np.int8)), shape).astype(_INT_OF[itemsize])


def _words(a: NDArray[Any], dtype: np.dtype[Any], shape: tuple[int, ...]) -> NDArray[Any]:
    """``a`` as ``dtype``, broadcast to ``shape``, seen as integer words (no copy when it already is ``dtype``)."""
    return np.broadcast_to(a.astype(dtype, copy=False), shape).view(_INT_OF[dtype.itemsize])


def select(mask: ArrayLike, a: ArrayLike, b: ArrayLike) -> NDArray[Any]:
    """``a`` where ``mask``, else ``b`` (as ``np.where``, broadcast alike), in time independent of ``mask``.

    ``a`` and ``b`` are converted to their common numeric dtype (float64 for a float and an int);
    a boolean ``a`` and ``b`` give a boolean result.
    """
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a_arr, b_arr)
    if dtype.kind not in "biuf":
        raise TypeError(f"select: expected boolean, integer or float arrays, got dtype {dtype}")
    shape = np.broadcast_shapes(np.shape(mask), a_arr.shape, b_arr.shape)
    a_words, b_words = _words(a_arr, dtype, shape), _words(b_arr, dtype, shape)
    out: NDArray[Any] = np.bitwise_xor(a_words, b_words)  # a fresh C-ordered array of words
    np.bitwise_and(out, _word_mask(mask, shape, dtype.itemsize), out=out)
    np.bitwise_xor(out, b_words, out=out)
    return out.view(dtype)


def or_zero(mask: ArrayLike, a: ArrayLike) -> NDArray[Any]:
    """``a`` where ``mask``, exact zeros (+0.0) elsewhere, in time independent of ``mask``."""
    a_arr = np.asarray(a)
    if a_arr.dtype.kind not in "biuf":
        raise TypeError(f"or_zero: expected a boolean, integer or float array, got dtype {a_arr.dtype}")
    shape = np.broadcast_shapes(np.shape(mask), a_arr.shape)
    out = _word_mask(mask, shape, a_arr.dtype.itemsize)  # a fresh array: the result is formed in it
    np.bitwise_and(out, _words(a_arr, a_arr.dtype, shape), out=out)
    return out.view(a_arr.dtype)
