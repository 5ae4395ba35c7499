"""What an agent derives from a request's public model fields, computed once per process (issue 24).

Every gradient or indicator request names a model and its arguments. Before this cache an agent
built that model three times per request (twice on the meta device to check the layout and the
parameter count, once for real, each with a seeded init) and measured its activations on the
meta device to size chunks: about 10 ms of a 100-record request, against 1 ms of gradient work.
Here each of these is computed once per (workload, model name, model arguments) and reused:

- :meth:`ModelCache.shape`: the parameter layout fingerprint and the parameter count (meta build);
- :meth:`ModelCache.fresh`: a model as the workload's factory builds it with seed 0, as a deep copy
  of one pristine build, so each request gets its own module and nothing a request does to it
  (its parameters loaded, buffers updated) reaches another request;
- :meth:`ModelCache.memo`: any other value derived from public fields alone (the activation bytes
  of two records of the data's shape).

Privacy note: keys hold public request fields only (the workload object, the model name and
argument text, record shapes and dtypes), never the data or the filter state, so what is cached
and when a lookup misses depend on which models were asked for, never on the data or on who
stopped (privacy.md §8). Each federation that asks (:func:`scope`) has its own tables with their
own bounds, so one coordinator cannot learn from a faster or slower reply what another asked for:
neither a hit on another's entry nor an eviction by another's requests. Each table is bounded
(least recently used dropped first), so a coordinator that varies model arguments costs rebuilds,
not memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from workloads.models import parameter_count
from workloads.registry import Workload, layout_fingerprint

T = TypeVar("T")

_SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar("fedfilter_model_scope", default="")


def current_scope() -> str:
    """The federation whose request is being answered ("" outside :func:`scope`)."""
    return _SCOPE.get()


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Lookups inside this block see only entries made inside a block of the same ``name`` (a federation)."""
    token = _SCOPE.set(name)
    try:
        yield
    finally:
        _SCOPE.reset(token)


@dataclass(frozen=True)
class ModelShape:
    """A model's parameter layout fingerprint (:func:`workloads.registry.layout_fingerprint`) and size."""

    layout: str
    count: int


class ModelCache:
    """Bounded, thread-safe, per-process, one set of tables per federation; see the module docstring."""

    def __init__(self, *, max_entries: int = 256, max_models: int = 8) -> None:
        self.max_entries = max_entries
        self.max_models = max_models
        self._values: dict[str, OrderedDict[Hashable, tuple[Workload, object]]] = {}
        self._models: dict[str, OrderedDict[Hashable, tuple[Workload, nn.Module | None]]] = {}
        self._lock = threading.Lock()
        self.misses = 0

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._models.clear()

    def _get(
        self, tables: dict[str, OrderedDict[Hashable, tuple[Workload, Any]]], key: Hashable, workload: Workload
    ) -> Any:
        with self._lock:
            table = tables.get(_SCOPE.get())
            entry = None if table is None else table.get(key)
            if table is None or entry is None or entry[0] is not workload:  # an id reused by another workload object
                return _MISSING
            table.move_to_end(key)
            return entry[1]

    def _put(
        self,
        tables: dict[str, OrderedDict[Hashable, tuple[Workload, Any]]],
        key: Hashable,
        workload: Workload,
        value: Any,
        most: int,
    ) -> None:
        with self._lock:
            self.misses += 1
            table = tables.setdefault(_SCOPE.get(), OrderedDict())
            table[key] = (workload, value)
            table.move_to_end(key)
            while len(table) > most:
                table.popitem(last=False)

    def memo(self, kind: str, workload: Workload, key: tuple[Hashable, ...], compute: Callable[[], T]) -> T:
        """``compute()`` once per (scope, ``kind``, ``workload``, ``key``); ``key`` must hold public fields only.

        An exception from ``compute`` is raised and nothing is kept, so a failure is recomputed (and
        raised again) at the next request.
        """
        full = (kind, id(workload), workload.name, *key)
        found = self._get(self._values, full, workload)
        if found is not _MISSING:
            return found  # type: ignore[no-any-return]
        value = compute()
        self._put(self._values, full, workload, value, self.max_entries)
        return value

    def shape(self, workload: Workload, name: str, model_args: str) -> ModelShape:
        """The layout and parameter count of ``name`` built with JSON ``model_args`` (WorkloadError as the build)."""

        def build() -> ModelShape:
            with torch.device("meta"):  # names and shapes only: model_args may name huge layers
                model = workload.build_model(name, **json.loads(model_args or "{}"))
            return ModelShape(layout=layout_fingerprint(model), count=parameter_count(model))

        return self.memo("shape", workload, (name, model_args), build)

    def fresh(self, workload: Workload, name: str, model_args: str) -> nn.Module:
        """A new module equal to ``workload.build_model(name, **args)`` (seed 0): a copy of one pristine build.

        A model that cannot be deep-copied is built afresh every time (the cache remembers that).
        """
        key = (id(workload), workload.name, name, model_args)
        pristine = self._get(self._models, key, workload)
        if pristine is _MISSING:
            built = workload.build_model(name, **json.loads(model_args or "{}"))
            try:
                kept: nn.Module | None = copy.deepcopy(built)
            except Exception:
                kept = None
            self._put(self._models, key, workload, kept, self.max_models)
            return built
        if pristine is None:
            return workload.build_model(name, **json.loads(model_args or "{}"))
        copied: nn.Module = copy.deepcopy(pristine)
        return copied


_MISSING = object()

# The process's cache: agents kept open and agents reopened share it (a Ray actor answers for many clients).
MODELS = ModelCache()
