"""Validation of privacy and noise parameters at construction and at the wire.

Every check raises :class:`PrivacyParameterError` naming the parameter, what was
expected and the value received (house style: a bad parameter is an error, never
a default; privacy.md section 3, last rule).
"""

from __future__ import annotations

import math
from numbers import Real


class PrivacyParameterError(ValueError):
    """A privacy, noise or budget parameter is missing, non-finite or out of range."""


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise PrivacyParameterError(f"{name}: expected a real number, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out):
        raise PrivacyParameterError(f"{name}: expected a finite number, got {value!r}")
    return out


def positive(name: str, value: object) -> float:
    """Return ``value`` as a float if it is finite and > 0."""
    out = _as_float(name, value)
    if out <= 0.0:
        raise PrivacyParameterError(f"{name}: expected a finite number > 0, got {value!r}")
    return out


def non_negative(name: str, value: object) -> float:
    """Return ``value`` as a float if it is finite and >= 0."""
    out = _as_float(name, value)
    if out < 0.0:
        raise PrivacyParameterError(f"{name}: expected a finite number >= 0, got {value!r}")
    return out


def open_unit(name: str, value: object) -> float:
    """Return ``value`` as a float if it lies in the open interval (0, 1)."""
    out = _as_float(name, value)
    if not 0.0 < out < 1.0:
        raise PrivacyParameterError(f"{name}: expected a number in (0, 1), got {value!r}")
    return out


def order_above_one(name: str, value: object) -> float:
    """Return a Rényi order as a float if it is finite and > 1."""
    out = _as_float(name, value)
    if out <= 1.0:
        raise PrivacyParameterError(f"{name}: expected a Rényi order > 1, got {value!r}")
    return out


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PrivacyParameterError(f"{name}: expected an integer >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise PrivacyParameterError(f"{name}: expected an integer >= 1, got {value!r}")
    return value
