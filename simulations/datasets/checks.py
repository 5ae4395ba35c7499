"""Checks of the datasets' parameters: each names the parameter and the value it got."""

from __future__ import annotations

import math

import numpy as np

from protocol.errors import FedfilterError


class DataParameterError(FedfilterError, ValueError):
    """A data or partition parameter is unknown, non-finite or out of range."""


def int_at_least(name: str, value: object, lower: int) -> int:
    """``value`` as an int, refusing bools, non-integers and values below ``lower``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise DataParameterError(f"{name}: expected an int >= {lower}, got {value!r} ({type(value).__name__})")
    if int(value) < lower:
        raise DataParameterError(f"{name}: expected an int >= {lower}, got {value!r}")
    return int(value)


def finite_positive(name: str, value: object) -> float:
    """``value`` as a float, refusing bools, non-numbers, NaN, infinities and values <= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise DataParameterError(f"{name}: expected a finite number > 0, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out) or out <= 0.0:
        raise DataParameterError(f"{name}: expected a finite number > 0, got {value!r}")
    return out
