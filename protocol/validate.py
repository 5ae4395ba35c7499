"""Validation of privacy and noise parameters at construction and at the wire.

Every check raises :class:`PrivacyParameterError` naming the parameter, what was
expected and the value received (house style: a bad parameter is an error, never
a default; privacy.md section 3, last rule). :func:`integer` takes the error class
of the caller's package (``ProtocolError`` at the wire, ``SecaggError``, ...).
"""

from __future__ import annotations

import math
from numbers import Real

from protocol.errors import PrivacyParameterError as PrivacyParameterError


def as_float(name: str, value: int | float, *, error: type[Exception] = PrivacyParameterError) -> float:
    """``float(value)``, refusing with ``error`` an integer too large for a float.

    JSON reads an integer of any length (a wire header's ``10**400``), and ``float`` of it raises
    ``OverflowError``, which no caller expects: it is refused as infinity would be, the message giving the
    integer's size, not its digits. Callers check the type (a real number, not a bool) first.
    """
    try:
        return float(value)
    except OverflowError:
        size = f"an integer of {value.bit_length()} bits" if isinstance(value, int) else "a number too large"
        raise error(f"{name}: expected a finite number, got {size}") from None


def real(name: str, value: object, *, error: type[Exception] = PrivacyParameterError) -> float:
    """Return ``value`` as a finite float: a real number (a bool is not), finite once converted.

    Example:
        >>> real("noise_std", 2)
        2.0
        >>> real("noise_std", 10**400)
        Traceback (most recent call last):
        ...
        protocol.errors.PrivacyParameterError: noise_std: expected a finite number, got an integer of 1329 bits
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise error(f"{name}: expected a real number, got {value!r:.80} ({type(value).__name__})")
    out = as_float(name, value, error=error)  # type: ignore[arg-type]
    if not math.isfinite(out):
        raise error(f"{name}: expected a finite number, got {value!r}")
    return out


def positive(name: str, value: object) -> float:
    """Return ``value`` as a float if it is finite and > 0."""
    out = real(name, value)
    if out <= 0.0:
        raise PrivacyParameterError(f"{name}: expected a finite number > 0, got {value!r}")
    return out


def non_negative(name: str, value: object) -> float:
    """Return ``value`` as a float if it is finite and >= 0."""
    out = real(name, value)
    if out < 0.0:
        raise PrivacyParameterError(f"{name}: expected a finite number >= 0, got {value!r}")
    return out


def open_unit(name: str, value: object) -> float:
    """Return ``value`` as a float if it lies in the open interval (0, 1)."""
    out = real(name, value)
    if not 0.0 < out < 1.0:
        raise PrivacyParameterError(f"{name}: expected a number in (0, 1), got {value!r}")
    return out


def order_above_one(name: str, value: object) -> float:
    """Return a Rényi order as a float if it is finite and > 1."""
    out = real(name, value)
    if out <= 1.0:
        raise PrivacyParameterError(f"{name}: expected a Rényi order > 1, got {value!r}")
    return out


def integer(
    name: str,
    value: object,
    *,
    at_least: int | None = None,
    at_most: int | None = None,
    error: type[Exception] = PrivacyParameterError,
) -> int:
    """Return ``value`` if it is an int (a bool is not) within ``[at_least, at_most]``; raise ``error`` otherwise.

    The message names the parameter, the integers expected and the value received.

    Example:
        >>> integer("max_rounds", 3, at_least=1)
        3
        >>> integer("max_rounds", True, at_least=1)
        Traceback (most recent call last):
        ...
        protocol.errors.PrivacyParameterError: max_rounds: expected an integer >= 1, got True (bool)
    """
    if at_least is not None and at_most is not None:
        expected = f"an integer in [{at_least}, {at_most}]"
    elif at_least is not None:
        expected = f"an integer >= {at_least}"
    elif at_most is not None:
        expected = f"an integer <= {at_most}"
    else:
        expected = "an integer"
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")
    if (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
        raise error(f"{name}: expected {expected}, got {value!r}")
    return value


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1."""
    return integer(name, value, at_least=1)
