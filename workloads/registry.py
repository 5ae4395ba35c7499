"""Bring your own workload: models, loss, data, record validity and queries, registered by name.

A :class:`Workload` is a frozen object the data owner (and, for the coordinator side, the run's
submitter) writes in their own package and names by reference: ``"package.module:object"`` or
the name of an entry point in the group ``fedfilter.workloads``. The agent loads it from its own
TOML (``workload = ...``); the coordinator loads the same object. What crosses the wire is only
names (a model name, its JSON arguments, a query name and the public ``column``/``value``): a
request never names code, and a name the client's workload does not register is refused
(privacy.md §10; the registries follow Opacus's ``register_grad_sampler``).

Privacy notes:
- Record validity (``valid``) defines the null element ⊥ (privacy.md §1): a record it rejects
  contributes the zero vector and pays nothing, by the same computation as every other record.
- A :class:`Query` declares the L2 bound of each record's vector. The agent scales any row above
  the bound down to it (and a non-finite row to zero), so the declaration holds whatever the
  user's function returns; the request's ``l2_clip`` and partial clipping (privacy.md §4) then
  clip further, and each unit pays ||clipped row||^2 / noise_std^2 as for any release (§2).

Importing this module loads neither torch nor flwr: they are imported inside the functions that
need them, so a coordinator or a checker can read a workload's description cheaply.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from protocol.branchless import or_zero
from protocol.errors import FedfilterError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

ENTRY_POINT_GROUP = "fedfilter.workloads"
BUILTIN_REF = "workloads.builtin:BUILTIN"
# Names that may cross the wire: model and query names are looked up, never imported.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")


class WorkloadError(FedfilterError, ValueError):
    """A workload reference, object, name or factory that is not what the agent or coordinator expects."""


@runtime_checkable
class DataSource(Protocol):
    """A client's records, read in batches: a stable public count, re-iterable batches, a fingerprint.

    ``batches(size)`` yields ``(x, y)`` pairs (numpy arrays or torch tensors) of at most ``size``
    records, in the same order every time (it is read more than once per request). ``fingerprint()``
    is the SHA-256 of the data (written to the ledger as ``data_sha256``), hashed in chunks.
    """

    def __len__(self) -> int: ...

    def batches(self, size: int) -> Iterator[tuple[Any, Any]]: ...

    def fingerprint(self) -> str: ...


@dataclass(frozen=True)
class QueryArgs:
    """A query's public arguments from the request: ``column``, ``value`` and the request's model (or None)."""

    column: int
    value: float
    model: nn.Module | None = None


@dataclass(frozen=True)
class Query:
    """A per-record vector query: ``rows(x, y, args) -> (b, dim)`` for a batch of b records.

    ``l2_bound`` is the declared bound on each record's vector (0/1 predicate: 1; one-hot histogram
    over k bins: 1; a numeric value clipped to c: c). The agent enforces it. ``needs_model``: the
    request must carry a model (its parameters), given to ``rows`` as ``args.model``.
    """

    rows: Callable[[Any, Any, QueryArgs], Any]
    dim: int = 1
    l2_bound: float = 1.0
    needs_model: bool = False
    column_bound: bool = False  # 'column' indexes the flattened features: refused when >= their count
    doc: str = ""

    def __post_init__(self) -> None:
        if not callable(self.rows):
            raise WorkloadError(f"query: expected a callable rows(x, y, args), got {type(self.rows).__name__}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise WorkloadError(f"query: expected an integer dim >= 1, got {self.dim!r}")
        bound = self.l2_bound
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound) or bound <= 0:
            raise WorkloadError(f"query: expected a finite l2_bound > 0, got {bound!r}")

    def describe(self) -> dict[str, Any]:
        return {"dim": self.dim, "l2_bound": float(self.l2_bound), "needs_model": self.needs_model}


def finite_features(x: torch.Tensor, y: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
    """The default validity rule: a record is usable when its features (and float targets) are finite.

    Written without in-place operations, so that the agent can apply it to each record alone under
    ``torch.func.vmap`` (client_agent.isolation.per_record_validity). ``model`` is accepted for the
    rule's signature and not used: token ids are checked where they are looked up, by the agent's
    guard on every ``nn.Embedding``/``nn.EmbeddingBag`` (client_agent.isolation), which makes a record
    holding an id outside the table it reaches the null element (zero contribution, no charge), never
    an error, which would answer, uncharged, "does some record hold a token id >= k?" (privacy.md §2).
    (This rule used to null every record with an id beyond the smallest table of the model, so a
    positional or category table nulled whole data sets; the guard nulls only the records it must.)
    Labels and any other bound the loss needs are the workload's own rule's job (the built-in
    classifier's rule, ``workloads.builtin.classification_records``, checks labels).
    """
    import torch

    b = x.shape[0]
    ok = torch.isfinite(x.reshape(b, -1)).all(dim=1) if x.is_floating_point() else torch.ones(b, dtype=torch.bool)
    if y.is_floating_point():
        ok = ok & torch.isfinite(y.reshape(y.shape[0], -1)).all(dim=1)
    return ok


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise WorkloadError(
            f"workload: expected a {what} name of letters, digits, '_', '.', '-' (at most 64), got {name!r}"
        )
    return name


@dataclass(frozen=True)
class Demo:
    """What ``fedfilter simulate --workload`` needs from a workload's ``demo`` hook (simulations only).

    ``clients``: each client's data path (what the agent's ``data-path`` will be); ``model`` and
    ``model_args``: the coordinator's model; ``test``: optional public ``(x, y)`` for the server-side
    evaluation (the workload's ``evaluate``); the rest are the run's defaults.
    """

    clients: list[Path]
    model: str
    model_args: Mapping[str, Any] = field(default_factory=dict)
    learning_rate: float = 0.1
    noise_std: float = 4.0
    l2_clip: float = 1.0
    epsilon: float = 3.0
    rounds: int = 10
    test: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class Workload:
    """A user's workload: what the agent may compute, registered by name (the wire names, never codes).

    - ``models``: factories by name, ``models[name](**model_args) -> nn.Module``;
    - ``loss(outputs, targets) -> (b,)``: per-example losses (reduction none);
    - ``data(data_path) -> DataSource``: the client's records (:mod:`workloads.data_sources`);
    - ``valid(x, y, model) -> (b,) bool``: which records are usable; the others are the null element;
    - ``queries``: per-record vector queries by name (:class:`Query`);
    - ``evaluate``: optional server-side evaluation ``evaluate(model, x, y) -> metrics``;
    - ``demo``: optional simulation hook for ``fedfilter simulate --workload`` (:class:`Demo`).
    """

    name: str
    models: Mapping[str, Callable[..., nn.Module]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    data: Callable[[Path], DataSource]
    valid: Callable[..., torch.Tensor] = finite_features
    queries: Mapping[str, Query] = field(default_factory=dict)
    evaluate: Callable[..., dict[str, float]] | None = None
    demo: Callable[..., Demo] | None = None

    def __post_init__(self) -> None:
        _check_name("workload", self.name)
        for what, table in (("models", self.models), ("queries", self.queries)):
            if not isinstance(table, Mapping):
                raise WorkloadError(f"workload {self.name!r}: expected {what} as a mapping, got {type(table).__name__}")
            for key in table:
                _check_name(what[:-1] if what == "models" else "query", key)
        for key, factory in self.models.items():
            if not callable(factory):
                raise WorkloadError(f"workload {self.name!r}: model {key!r}: expected a callable factory")
        for key, query in self.queries.items():
            if not isinstance(query, Query):
                raise WorkloadError(
                    f"workload {self.name!r}: query {key!r}: expected a workloads.registry.Query, "
                    f"got {type(query).__name__}"
                )
        for what in ("loss", "data", "valid"):
            if not callable(getattr(self, what)):
                raise WorkloadError(f"workload {self.name!r}: expected a callable {what}")
        for what in ("evaluate", "demo"):
            hook = getattr(self, what)
            if hook is not None and not callable(hook):
                raise WorkloadError(f"workload {self.name!r}: expected {what} to be callable or None")
        # Read-only tables: a registry is fixed once the workload is built.
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        object.__setattr__(self, "queries", MappingProxyType(dict(self.queries)))

    # -- registries -------------------------------------------------------------------------------

    def model_factory(self, name: str) -> Callable[..., nn.Module]:
        if name not in self.models:
            raise WorkloadError(f"model: expected one of {sorted(self.models)} (workload {self.name!r}), got {name!r}")
        return self.models[name]

    def query(self, name: str) -> Query:
        if name not in self.queries:
            raise WorkloadError(f"query: expected one of {sorted(self.queries)} (workload {self.name!r}), got {name!r}")
        return self.queries[name]

    def build_model(self, name: str, *, seed: int | Any = 0, **params: object) -> nn.Module:
        """Model ``name`` built by its factory with ``params``, PyTorch's default init drawn from ``seed``.

        An unknown name, arguments the factory does not take, a factory that raises or returns
        something other than an ``nn.Module``: a :class:`WorkloadError` naming what was expected.
        """
        from workloads.models import build_with

        try:
            return build_with(self.model_factory(name), name, seed=seed, **params)
        except WorkloadError:
            raise
        except ValueError as exc:
            raise WorkloadError(str(exc)) from exc

    def describe(self) -> dict[str, Any]:
        """The public description a status reply carries: names, never code."""
        return {
            "name": self.name,
            "models": sorted(self.models),
            "queries": {name: q.describe() for name, q in sorted(self.queries.items())},
        }

    def open_data(self, data_path: Path | str) -> DataSource:
        """The client's records from the workload's data factory, checked against :class:`DataSource`."""
        source = self.data(Path(data_path))
        missing = [m for m in ("__len__", "batches", "fingerprint") if not callable(getattr(source, m, None))]
        if missing:
            raise WorkloadError(
                f"workload {self.name!r}: data: expected a source with __len__, batches(size) and fingerprint(), "
                f"got {type(source).__name__} without {missing}"
            )
        return source


# --- loading -------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def load_workload(ref: str) -> Workload:
    """The workload named by ``"package.module:object"`` or by an entry point in ``fedfilter.workloads``.

    The reference comes from the owner's own configuration (the agent's TOML) or the coordinator's
    run config, never from a request.
    """
    if not isinstance(ref, str) or not ref.strip():
        raise WorkloadError(f"workload: expected 'package.module:object' or an entry point name, got {ref!r}")
    ref = ref.strip()
    if ":" in ref:
        module_name, _, attr = ref.partition(":")
        if not module_name or not attr or ":" in attr:
            raise WorkloadError(f"workload: expected 'package.module:object', got {ref!r}")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise WorkloadError(f"workload {ref!r}: expected an importable module {module_name!r}: {exc}") from exc
        obj: Any = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise WorkloadError(f"workload {ref!r}: module {module_name!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
    else:
        from importlib.metadata import entry_points

        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == ref]
        if not found:
            names = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
            raise WorkloadError(
                f"workload: expected 'package.module:object' or an entry point of group {ENTRY_POINT_GROUP!r} "
                f"(installed: {names}), got {ref!r}"
            )
        try:
            obj = found[0].load()
        except Exception as exc:
            raise WorkloadError(f"workload {ref!r}: the entry point does not load: {exc!r}") from exc
    if not isinstance(obj, Workload):
        raise WorkloadError(f"workload {ref!r}: expected a workloads.registry.Workload, found {type(obj).__name__}")
    return obj


# --- query rows ------------------------------------------------------------------------------------


def bounded_rows(query: Query, values: Any, b: int) -> np.ndarray:
    """A query's rows for a batch of ``b`` as float32 ``(b, dim)``, each within the declared L2 bound.

    A non-finite row becomes the zero row (the null element's contribution); a row above the
    bound is scaled down to it. The same arithmetic runs on every row.
    """
    rows = np.asarray(values.detach().cpu().numpy() if hasattr(values, "detach") else values, dtype=np.float64)
    if rows.ndim == 1 and query.dim == 1:
        rows = rows.reshape(-1, 1)
    if rows.shape != (b, query.dim):
        raise WorkloadError(f"query: expected rows of shape ({b}, {query.dim}), got {rows.shape}")
    finite = np.asarray(np.isfinite(rows).all(axis=1))
    rows = or_zero(finite[:, None], rows)
    norms = np.linalg.norm(rows, axis=1)
    scale = np.minimum(1.0, query.l2_bound / np.maximum(norms, np.finfo(np.float64).tiny))
    out: np.ndarray = (rows * scale[:, None]).astype(np.float32)
    return out


def layout_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the ordered ``(name, shape, dtype, trainable)`` of ``model.named_parameters()``: the flat layout.

    Two models with the same fingerprint read and write the wire's flat parameter vector the same
    way (workloads.models.flatten_parameters) and agree on which entries are trainable (frozen ones
    are neither released nor moved). Works on a model built on the meta device.
    """
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        frozen = "" if p.requires_grad else "|frozen"
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}{frozen}\n".encode())
    return h.hexdigest()


def model_layout(workload: Workload, name: str, model_args: str) -> str | None:
    """The layout fingerprint of model ``name`` with JSON ``model_args`` as ``workload`` builds it, on the
    meta device (nothing allocated); None when the workload does not register it or cannot build it."""
    import json

    import torch

    try:
        with torch.device("meta"):
            return layout_fingerprint(workload.build_model(name, **json.loads(model_args)))
    except (WorkloadError, ValueError, TypeError):
        return None
