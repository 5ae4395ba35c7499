"""The root of fedfilter's error tree.

Every error fedfilter raises on purpose derives from :class:`FedfilterError` and also from the
standard category it belongs to (``ValueError`` for bad input, ``RuntimeError`` for a state that
cannot go on, ``OSError`` for the filesystem and sockets), so ``except ValueError`` keeps working
while ``except FedfilterError`` catches exactly fedfilter's own errors (the shape of Hypothesis's
``errors.py`` and httpx's ``_exceptions.py``).

This module imports the standard library only.
"""

from __future__ import annotations


class FedfilterError(Exception):
    """Base class of every error fedfilter raises on purpose."""
