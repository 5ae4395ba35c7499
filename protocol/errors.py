"""The root of fedfilter's error tree.

Every error fedfilter raises on purpose derives from :class:`FedfilterError` and also from the
standard category it belongs to (``ValueError`` for bad input, ``RuntimeError`` for a state that
cannot go on, ``OSError`` for the filesystem and sockets), so ``except ValueError`` keeps working
while ``except FedfilterError`` catches exactly fedfilter's own errors (the shape of Hypothesis's
``errors.py`` and httpx's ``_exceptions.py``).

The errors shared by both sides of the wire live here; each package's own errors live beside
their code (``client_agent.ledger.LedgerError``, ``client_agent.config.PolicyError``,
``workloads.registry.WorkloadError``, ...) and derive from :class:`FedfilterError` the same way.
The client agent turns an exception into a wire code through one table
(``client_agent.agent.EXCEPTION_CODES``); what crosses the wire is the code's fixed text, never
an exception's message (privacy.md §8).

This module imports the standard library only.
"""

from __future__ import annotations


class FedfilterError(Exception):
    """Base class of every error fedfilter raises on purpose."""


class PrivacyParameterError(FedfilterError, ValueError):
    """A privacy, noise or budget parameter is missing, non-finite or out of range."""


class ProtocolError(FedfilterError, ValueError):
    """A message that does not decode: unknown type, missing or unexpected key, bad value or shape."""


class SecaggError(FedfilterError, ValueError):
    """Secure-aggregation material that is malformed, inconsistent, replayed or from the wrong keys."""


class FixedPointOverflow(SecaggError):
    """A value outside the fixed-point range it must fit (an error, never a wrap-around)."""
