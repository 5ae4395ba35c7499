"""The filter's charge as one compiled pass over the units (numba), when numba is installed (``fedfilter[fast]``).

:func:`protocol.filters.charge` runs a dozen numpy operations per block of units; this kernel does
the same arithmetic for one unit at a time in one loop, so the units' arrays are read and written
once (issue 24: the charge over 1e6 units at most 3x a numpy sum of squares). It is the numpy
path's arithmetic, operation for operation and in the same order, so the results are the same bit
for bit (tests/unit/test_fused_charge.py checks it against the numpy path, special values included):

    inc  = (norm / sigma) * (norm / sigma)
    cost = spent + inc
    fits = cost <= T and not stopped_before
    S'   = spent + inc * fits          (S + 0 = S for a unit that does not fit)
    stop = cost >= low or not fits;  refused = norm > 0 and not fits;  admitted = fits and norm > 0

Every unit takes the same instructions whatever its outcome: the selections are arithmetic on
0 / 1 values, never a branch (privacy.md §8; benchmarks/timing_uniformity.py times it). The
validation outputs are whether some norm is negative and whether some cost is NaN or infinite;
the caller raises as the numpy path does.

Compiled on first use and cached on disk (numba's ``cache=True``, beside this file or in the
user's cache directory); importing this module needs numba, so :mod:`protocol.filters` imports
it only for filters of at least ``FUSED_MIN_UNITS`` units, and falls back to numpy without it.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numpy.typing import NDArray

from protocol.filters import ChargeParts, charge_outputs

_LARGEST = float(np.finfo(np.float64).max)


def _kernel_source(
    norms: NDArray[np.float64],
    spent: NDArray[np.float64],
    was_stopped: NDArray[np.bool_],
    sigma: float,
    threshold: float,
    low: float,
    new_spent: NDArray[np.float64],
    admitted: NDArray[np.bool_],
    refused: NDArray[np.bool_],
    stopped: NDArray[np.bool_],
) -> tuple[bool, bool]:  # pragma: no cover (compiled; tested through charge)
    # The validation flags are integer OR-reductions, which the compiler vectorises (a float min
    # reduction it may not reorder, and the loop ran at a third of the speed).
    negative = False
    not_finite = False
    for i in range(norms.size):
        x = norms[i]
        old = spent[i]
        c = x / sigma
        inc = c * c
        cost = old + inc
        negative |= x < 0.0
        not_finite |= not (cost <= _LARGEST)  # NaN or infinity
        fits = (cost <= threshold) & (not was_stopped[i])
        want = x > 0.0
        new_spent[i] = old + inc * fits
        stopped[i] = (cost >= low) | (not fits)
        refused[i] = want & (not fits)
        admitted[i] = fits & want
    return negative, not_finite


def _compiled() -> Any:
    """The kernel, cached on disk where numba can write; compiled in memory where it cannot.

    An agent run as its own service user from a read-only install has no cache locator (numba raises
    RuntimeError when the function is decorated): it then compiles once per process, about a second.
    """
    try:
        return numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")(_kernel_source)
    except RuntimeError:
        return numba.njit(cache=False, nogil=True, boundscheck=False, error_model="numpy")(_kernel_source)


_kernel = _compiled()


def fused_charge(
    norms: NDArray[np.float64],
    spent: NDArray[np.float64],
    was_stopped: NDArray[np.bool_],
    *,
    sigma: float,
    threshold: float,
    low: float,
) -> ChargeParts:
    """The charge in one compiled pass (:data:`protocol.filters.ChargeParts`)."""
    new_spent, admitted, refused, stopped = charge_outputs(norms.size)
    negative, not_finite = _kernel(
        np.ascontiguousarray(norms, dtype=np.float64),
        np.ascontiguousarray(spent, dtype=np.float64),
        np.ascontiguousarray(was_stopped, dtype=np.bool_),
        float(sigma),
        float(threshold),
        float(low),
        new_spent,
        admitted,
        refused,
        stopped,
    )
    return new_spent, admitted, refused, stopped, bool(negative), bool(not_finite)
