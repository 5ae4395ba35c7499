"""Each record's forward, loss and backward computed with that record alone: isolation by construction.

The per-record engine (:mod:`client_agent.streaming`) never runs the owner's model, loss or
validity rule on a batch of records. :func:`per_record` wraps one function of *one* record (a
batch of one through ``functional_call``) and runs it over a block of records with
``torch.func.vmap``. vmap computes exactly what the function gives for each record on its own: no operator in
the owner's code (a batch mean, a batch maximum, attention across the batch) can see another
record, so a record's contribution, and whether it counts as the null element, depend on that
record's data alone (privacy.md §2). A forward that depends on data through Python control flow
cannot run under vmap at all: such a model (or validity rule) is refused, decided on synthetic
records, never on data (run record by record, its work would depend on the data, and Python state
on a module would carry one record into the next). Inside the function, an id outside an
embedding's table makes its record the null element instead of an error (a refusal would answer,
uncharged, a question about one record).

Inside the per-record function, forward hooks on the modules of a known layer kind
(:mod:`client_agent.layers`) record each module's input ``a`` and add a zero *probe* to its output:
the gradient with respect to the probe is the record's backprop ``g`` at that module, from which
the kind forms the record's parameter gradient (no parameter gradient is formed for those modules).
Every other trainable parameter's per-record gradient is taken directly (``grad`` with respect to
it). :func:`plan_for` decides, structurally and on synthetic records only, which modules are tapped:
a module of a known kind, its parameters its own, called exactly once per record with one tensor in
and one out; the plan's per-record gradients are then checked against the direct gradient of every
parameter on those synthetic records (a module whose parameters are also used outside its own
forward would fail this; the direct path is used instead). That check is a correctness diagnostic
only: whatever the plan, every value comes from one record's own computation.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from client_agent.layers import DenseRows, LayerKind, Rows, kind_of
from client_agent.layers.base import or_zero
from client_agent.layers.recurrent import unrolled
from protocol.errors import FedfilterError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Validity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SYNTHETIC = 3  # records in the data-independent batch that decides the plan
_PLANS_KEPT = 32  # plans kept per agent process and federation, keyed on public request fields (PerRecord.decide)
_Shape = tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]  # a record's output shape and dtype, input shape
# One table per federation (client_agent.model_cache.current_scope), each with its own bound: a hit or
# an eviction never depends on another coordinator's requests (privacy.md §8, §11).
_PLANS: dict[str, OrderedDict[Hashable, tuple[tuple[tuple[str, _Shape], ...], tuple[str, ...]]]] = {}
_CHECK_RTOL = 1e-3  # the plan's gradients against the direct ones, on the synthetic records


class StructureError(FedfilterError, ValueError):
    """The model's forward differs from what its plan saw on the synthetic records (a structural change)."""


class UnbatchableModelError(FedfilterError, ValueError):
    """vmap cannot run the model on one record at a time: refused, decided on synthetic records.

    A forward vmap cannot run branches in Python on values (``float(x.max())``, ``if x.sum() > 0``) or
    calls an operator with no batching rule. Run record by record instead, its work would depend on the
    data (a branch taken for some records), so on a stopped record's data or on who stopped, and Python
    state kept on a module would carry one record's data into the next (a hostile review found both).
    """


@dataclass(frozen=True)
class Tapped:
    """A module whose per-record gradient its layer kind forms from its input and its output's backprop."""

    name: str
    module: nn.Module
    kind: LayerKind
    out_shape: tuple[int, ...]  # one record's output of the module (as that record's forward sees it)
    dtype: torch.dtype
    in_shape: tuple[int, ...]  # one record's input of the module
    released: tuple[str, ...]  # its local parameter names that are trainable (frozen ones are not released)


@dataclass(frozen=True)
class Plan:
    """What runs for one model and one record shape; decided from structure and synthetic records only.

    ``tapped``: modules whose rows their kind forms; ``direct``: trainable parameters whose
    per-record gradients are taken directly; together exactly the trainable parameters.
    """

    tapped: tuple[Tapped, ...]
    direct: tuple[str, ...]
    trainable: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def method(self) -> str:
        """``rows`` (kinds' rows, any rest direct) or ``direct`` (every gradient taken directly)."""
        return "rows" if self.tapped else "direct"


@dataclass
class _Tap:
    """The forward hooks: in ``shape`` mode they count calls and shapes; in ``tap`` mode they record inputs and
    add probes."""

    modules: dict[int, int]  # id(module) -> its index among the candidates
    mode: str = ""
    probes: list[torch.Tensor] = field(default_factory=list)
    inputs: list[torch.Tensor | None] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    shapes: list[_Shape | None] = field(default_factory=list)
    single: list[bool] = field(default_factory=list)
    tapped: frozenset[int] = frozenset()
    bad: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.bool))

    def reset(self, n: int) -> None:
        self.bad = torch.zeros((), dtype=torch.bool)
        self.inputs = [None] * n
        self.calls = [0] * n
        self.shapes = [None] * n
        self.single = [True] * n

    def guard(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An id outside ``[0, num_embeddings)`` makes its record the null element (its loss times 0) and is
        looked up as id 0 (:func:`guarded_ids`)."""
        if not self.mode:
            return None
        guarded = guarded_ids(m, args, kwargs)
        if guarded is None:
            return None
        call, bad = guarded
        self.bad = self.bad | bad
        return call

    def hook(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        k = self.modules.get(id(m))
        if k is None or not self.mode:
            return None
        self.calls[k] += 1
        one_tensor = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
        if not one_tensor or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            self.single[k] = False
            return None
        if self.mode == "shape":
            self.shapes[k] = (tuple(out.shape), out.dtype, tuple(args[0].shape))
            return None
        if k not in self.tapped:
            return None
        if self.calls[k] != 1:
            raise StructureError(f"model: module {k} was called more than once for one record")
        # A copy: the owner's forward may modify the input in place after the module read it.
        self.inputs[k] = args[0].detach().clone()
        return out + self.probes[k]


def guarded_ids(
    m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[tuple[Any, ...], dict[str, Any]], torch.Tensor] | None:
    """A forward pre-hook's body for ``nn.Embedding`` / ``nn.EmbeddingBag`` (ids by position or as ``input=``):
    the call with every id outside ``[0, num_embeddings)`` looked up as id 0, and whether there was one (a 0-d
    bool: its unit becomes the null element); None if the call passes no id tensor. An error there would
    refuse the request, uncharged, for one unit's value (e.g. "is some category >= k?" for a table size the
    coordinator chose). The same operations for every id, in range or not."""
    keyword = not args and isinstance(kwargs.get("input"), torch.Tensor)
    ids = kwargs["input"] if keyword else (args[0] if args else None)
    if not isinstance(ids, torch.Tensor):
        return None
    bad = (ids < 0) | (ids >= cast(nn.Embedding, m).num_embeddings)
    safe = or_zero(~bad, ids)
    call = (args, {**kwargs, "input": safe}) if keyword else ((safe, *args[1:]), kwargs)
    return call, bad.any()


class GuardedTables:
    """Within ``with GuardedTables(model) as g:``, every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model`` looks
    an id outside its table up as 0 and ``g.bad`` says whether any call since entering had one (a 0-d bool).

    For forwards over a whole unit at once (client units: the unit is every record the client holds), where
    an id outside a table makes the whole unit's contribution the null element, as :class:`_Tap` does for one
    record.
    """

    def __init__(self, model: nn.Module) -> None:
        self.tables = [m for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)]
        self.bad = torch.zeros((), dtype=torch.bool)
        self._handles: list[Any] = []

    def _hook(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ids = kwargs.get("input", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(ids):
            return None  # inside the owner's own vmap or grad: its flag could not leave it (unguarded, as before)
        guarded = guarded_ids(m, args, kwargs)
        if guarded is None:
            return None
        call, bad = guarded
        self.bad = self.bad | bad.detach()
        return call

    def __enter__(self) -> GuardedTables:
        self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.tables]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _candidates(model: nn.Module, trainable: set[str]) -> list[tuple[str, nn.Module, LayerKind]]:
    """Modules of a known kind whose parameters are their own (not shared), appearing once in the model."""
    owners: dict[int, set[str]] = {}
    seen: dict[int, int] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(name)
    out = []
    for name, m in model.named_modules():
        kind = kind_of(m)
        own = [p for p in m._parameters.values() if p is not None]
        if kind is None or not own or seen[id(m)] != 1 or any(len(owners[id(p)]) != 1 for p in own):
            continue
        if not any(f"{name}.{local}" in trainable for local, p in m._parameters.items() if p is not None):
            continue  # all frozen: nothing to release from it
        out.append((name, m, kind))
    return out


def synthetic_records(x: torch.Tensor, y: torch.Tensor, n: int = SYNTHETIC) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` data-independent records of ``x``'s and ``y``'s per-record shapes and dtypes: seeded standard
    normal float features, zero integer features, zero targets."""
    shape = (n, *x.shape[1:])
    if x.is_floating_point():
        xs = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(x.device, x.dtype)
    else:
        xs = torch.zeros(shape, dtype=x.dtype, device=x.device)
    return xs, torch.zeros((n, *y.shape[1:]), dtype=y.dtype, device=y.device)


class PerRecord:
    """The per-record function of one model and loss, and how to run it over a block of records."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, device: torch.device) -> None:
        self.model, self.loss_fn, self.device = model, loss_fn, device
        named = dict(model.named_parameters())
        self.trainable = tuple(n for n, p in named.items() if p.requires_grad)
        self.params = {n: p.detach().to(device) for n, p in named.items()}
        self.buffers = {n: b.detach().to(device) for n, b in model.named_buffers()}
        self.candidates = _candidates(model, set(self.trainable))
        self.tap = _Tap({id(m): k for k, (_, m, _) in enumerate(self.candidates)})
        self.plan: Plan | None = None

    @contextmanager
    def _hooks(self) -> Iterator[None]:
        """The tap's forward hooks on the candidate modules, for the duration of one pass."""
        handles = [m.register_forward_hook(self.tap.hook, with_kwargs=True) for _, m, _ in self.candidates]
        guarded = [m for m in self.model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)]
        handles += [m.register_forward_pre_hook(self.tap.guard, with_kwargs=True) for m in guarded]
        try:
            yield
        finally:
            self.tap.mode = ""
            for h in handles:
                h.remove()

    # -- the function of one record -----------------------------------------------------------

    def _one(
        self,
        probes: list[torch.Tensor],
        direct: dict[str, torch.Tensor],
        xi: torch.Tensor,
        yi: torch.Tensor,
        wi: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """w_i x loss of record i alone (a batch of one), and the tapped modules' inputs."""
        assert self.plan is not None
        self.tap.reset(len(self.candidates))
        self.tap.probes = [torch.zeros(0)] * len(self.candidates)
        for k, t in zip(self._tapped_index, probes, strict=True):
            self.tap.probes[k] = t
        self.tap.tapped = frozenset(self._tapped_index)
        losses = self._losses("tap", direct, xi, yi)
        inputs = []
        for k in self._tapped_index:
            a = self.tap.inputs[k]
            if a is None or self.tap.calls[k] != 1 or not self.tap.single[k]:
                raise StructureError("model: a tapped module was not called once with one tensor for this record")
            inputs.append(a)
        usable = (~self.tap.bad).to(losses.dtype)  # an id no embedding can take: the null element
        return losses.sum() * wi * usable, inputs

    def _losses(self, mode: str, params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        """The loss of record i alone (a batch of one, shape (1,)), with the tap in ``mode`` during the forward."""
        self.tap.mode = mode
        try:
            with _math_attention(), unrolled(self.model):
                out = functional_call(self.model, ({**self.params, **params}, self.buffers), (xi.unsqueeze(0),))
            losses = self.loss_fn(out, yi.unsqueeze(0))
        finally:
            self.tap.mode = ""
        return _check_losses(losses)

    @property
    def _tapped_index(self) -> list[int]:
        assert self.plan is not None
        names = [t.name for t in self.plan.tapped]
        return [k for k, (name, _, _) in enumerate(self.candidates) if name in names]

    def _probes(self) -> list[torch.Tensor]:
        assert self.plan is not None
        return [torch.zeros(t.out_shape, dtype=t.dtype, device=self.device) for t in self.plan.tapped]

    def gradients(
        self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[torch.Tensor]]:
        """For a block of records: each tapped module's per-record backprops (B, *out), the direct parameters'
        per-record gradients (B, *shape), and the tapped modules' per-record inputs (B, *in)."""
        assert self.plan is not None
        direct = {n: self.params[n] for n in self.plan.direct}
        fn = grad(self._one, argnums=(0, 1), has_aux=True)
        probes = self._probes()
        before = self._versions()
        with self._hooks():
            (g_probe, g_direct), inputs = vmap(fn, in_dims=(None, None, 0, 0, 0), randomness="error")(
                probes, direct, x, y, w
            )
        if self._versions() != before:  # e.g. an embedding's max_norm renormalising the shared table in place
            raise StructureError("model: its forward modified a parameter or buffer in place")
        return list(g_probe), dict(g_direct), list(inputs)

    def _versions(self) -> list[int]:
        return [t._version for t in (*self.params.values(), *self.buffers.values())]

    def rows(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> list[tuple[str | None, Rows]]:
        """A block's per-record rows: (the tapped module's name, its rows), then (None, the direct parameters')."""
        assert self.plan is not None
        g_probe, g_direct, inputs = self.gradients(x, y, w)
        out: list[tuple[str | None, Rows]] = []
        for t, g, a in zip(self.plan.tapped, g_probe, inputs, strict=True):
            rows = t.kind.rows(t.module, a, g)
            local = {n for n, p in t.module._parameters.items() if p is not None}
            rows.drop(frozenset(local - set(t.released)))
            out.append((t.name, rows))
        if g_direct:
            out.append((None, DenseRows(g_direct)))
        return out

    def row_floats(self) -> int:
        """Floats of one record's rows, over every tapped module and direct parameter (sizes the blocks)."""
        assert self.plan is not None
        total = sum(self.params[n].numel() for n in self.plan.direct)
        for t in self.plan.tapped:  # the rows, and the record's input and backprop they come from
            total += t.kind.row_floats(t.module, t.in_shape) + math.prod(t.in_shape) + math.prod(t.out_shape)
        return max(1, total)

    # -- the plan: structural, decided on synthetic records ----------------------------------------

    def decide(self, x: torch.Tensor, y: torch.Tensor, *, key: Hashable | None = None) -> Plan:
        """The plan for records of ``x``'s and ``y``'s shapes, decided on synthetic records only.

        ``key``: public request fields that fix the model's structure (workload, model name and
        arguments, parameter layout); with it, the plan is kept per agent process and reused by the next
        request with the same key and record shapes (it depends on nothing else: never on data, nor on
        who stopped), so the synthetic passes run once, not per request.
        """
        from client_agent.model_cache import current_scope

        full = None if key is None else (key, tuple(x.shape[1:]), x.dtype, tuple(y.shape[1:]), y.dtype, self.trainable)
        plans = _PLANS.setdefault(current_scope(), OrderedDict())
        if full is not None and full in plans:
            shapes, notes_kept = plans[full]
            plans.move_to_end(full)
            kept = dict(shapes)
            tapped = [
                t for t in self._tapped_from([kept.get(name) for name, _, _ in self.candidates]) if t.name in kept
            ]
            self.plan = self._plan(tapped, list(notes_kept))
            return self.plan
        plan = self._decide(x, y)
        if full is not None:
            plans[full] = (tuple((t.name, (t.out_shape, t.dtype, t.in_shape)) for t in plan.tapped), plan.notes)
            while len(plans) > _PLANS_KEPT:
                plans.popitem(last=False)
        return plan

    def _tapped_from(self, shapes: list[_Shape | None], *, counted: bool = False) -> list[Tapped]:
        """Tapped modules from per-candidate shapes; ``counted``: only those the last shape pass saw called once."""
        tapped = []
        for k, (name, m, kind) in enumerate(self.candidates):
            once = self.tap.calls[k] == 1 and self.tap.single[k] if counted else True
            if once and shapes[k] is not None:
                shape, dtype, in_shape = shapes[k]  # type: ignore[misc]
                released = tuple(
                    local for local, p in m._parameters.items() if p is not None and f"{name}.{local}" in self.trainable
                )
                tapped.append(Tapped(name, m, kind, shape, dtype, in_shape, released))
        return tapped

    def _decide(self, x: torch.Tensor, y: torch.Tensor) -> Plan:
        xs, ys = synthetic_records(x, y)
        ws = torch.ones(xs.shape[0], device=self.device)
        notes: list[str] = []
        try:
            try:
                shapes = self._shape_pass(xs, ys)
            except (StructureError, UnbatchableModelError):
                raise
            except Exception as exc:  # vmap cannot run it on synthetic records: refused, whatever the data
                self._forward_alone(xs[0], ys[0])  # a model that fails on a record of these shapes at all says so
                raise UnbatchableModelError(
                    f"model: torch.func.vmap cannot run it one record at a time ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); write value-dependent branches with torch.where, and keep no state "
                    "on modules between calls"
                ) from exc
            tapped = self._tapped_from(shapes, counted=True)
            plan = self._plan(tapped, notes)
            if tapped:
                self.plan = plan
                try:
                    ok = self._agrees_with_direct(xs, ys, ws)
                except StructureError:
                    ok = False
                if not ok:
                    notes.append("a tapped module's parameters are also used outside it: every gradient taken directly")
                    plan = self._plan([], notes)
            self.plan = plan
            return plan
        finally:
            self.tap.mode = ""

    def _forward_alone(self, xi: torch.Tensor, yi: torch.Tensor) -> None:
        """The per-record forward and loss on one synthetic record, without vmap: its own error, if any."""
        self.tap.reset(len(self.candidates))
        with torch.no_grad():
            self._losses("", {}, xi, yi)

    def direct_plan(self) -> Plan:
        """The decided plan with no tapped module: every trainable parameter's gradient taken directly."""
        assert self.plan is not None
        return self._plan([], list(self.plan.notes))

    def _plan(self, tapped: list[Tapped], notes: list[str]) -> Plan:
        owned = {f"{t.name}.{local}" for t in tapped for local in t.released}
        direct = tuple(n for n in self.trainable if n not in owned)
        return Plan(tuple(tapped), direct, self.trainable, tuple(notes))

    def _shape_pass(self, xs: torch.Tensor, ys: torch.Tensor) -> list[_Shape | None]:
        """Each candidate's per-record output shape and calls, from the per-record forward on synthetic records."""

        def forward(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            self.tap.reset(len(self.candidates))
            return self._losses("shape", params, xi, yi).sum()

        # Under grad, as the real pass runs: some operators batch only there (nn.LSTM's autograd path).
        trainable = {n: self.params[n] for n in self.trainable}
        with self._hooks():
            vmap(grad(forward), in_dims=(None, 0, 0), randomness="error")(trainable, xs, ys)
        return list(self.tap.shapes)

    def _agrees_with_direct(self, xs: torch.Tensor, ys: torch.Tensor, ws: torch.Tensor) -> bool:
        """The plan's per-record gradients against the direct gradient of every trainable parameter."""
        assert self.plan is not None
        planned = self.plan
        released = {t.name: t.released for t in planned.tapped}
        blocks = self.rows(xs, ys, ws)
        n = xs.shape[0]
        got: dict[str, list[torch.Tensor]] = {name: [] for name in self.trainable}
        for r in range(n):
            one_hot = torch.zeros(n, dtype=torch.float64, device=self.device)
            one_hot[r] = 1.0
            for name, rows in blocks:
                prefix = f"{name}." if name else ""  # the root module's parameters have no prefix
                locals_ = planned.direct if name is None else released[name]
                targets = {
                    local: torch.zeros_like(self.params[prefix + local], dtype=torch.float64) for local in locals_
                }
                _add_copy(rows, one_hot, one_hot > 0, targets)
                for local, t in targets.items():
                    got[prefix + local].append(t.reshape(-1).cpu())
        self.plan = self._plan([], [])
        try:
            _, want, _ = self.gradients(xs, ys, ws)
        finally:
            self.plan = planned
        for name in self.trainable:
            g = torch.stack(got[name])
            e = want[name].reshape(n, -1).double().cpu()
            scale = float(e.norm() + g.norm())
            if not float((g - e).norm()) <= _CHECK_RTOL * scale + 1e-30:
                return False
        return True


def _add_copy(rows: Rows, wk: torch.Tensor, keep: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
    """``rows.add`` into ``targets`` on a copy (``add`` zeroes the rows outside ``keep`` in place)."""
    clone = copy.copy(rows)
    if isinstance(clone, DenseRows):
        clone.tensors = {k: v.clone() for k, v in clone.tensors.items()}
    clone.add(wk, keep, targets.__getitem__)


def _math_attention() -> Any:
    """scaled_dot_product_attention by its math backend (matmuls and a softmax, which vmap batches), not the
    fused CPU kernel that vmap runs one record at a time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _check_losses(losses: Any) -> torch.Tensor:
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (1,):
        got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(
            f"loss_fn: expected per-example losses of shape (1,) for one record (reduction='none'), got {got}"
        )
    return losses


def per_record_validity(valid: Validity, x: torch.Tensor, y: torch.Tensor, *, vmapped: bool) -> torch.Tensor:
    """``valid`` applied to each record alone (a batch of one): under vmap (the agent's path), or in a loop over
    the records (``fedfilter agent check`` counting null records locally)."""

    def one(xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = valid(xi.unsqueeze(0), yi.unsqueeze(0))
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"valid: expected one bool per record, got {got} for one record")
        return out.reshape(()).to(torch.bool)

    if x.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    if vmapped:
        result: torch.Tensor = vmap(one, randomness="error")(x, y)
        return result
    return torch.stack([one(x[i], y[i]) for i in range(x.shape[0])])


def check_validity_vmaps(valid: Validity, x: torch.Tensor, y: torch.Tensor) -> None:
    """Refuse a validity rule vmap cannot run (:class:`UnbatchableModelError`), decided on synthetic records of
    ``x``'s and ``y``'s shapes and dtypes: run record by record, its state could carry one record into the next."""
    xs, ys = synthetic_records(x, y)
    try:
        per_record_validity(valid, xs, ys, vmapped=True)
    except Exception as exc:
        raise UnbatchableModelError(
            f"valid: torch.func.vmap cannot run the workload's validity rule one record at a time "
            f"({type(exc).__name__}: {str(exc)[:200]}); write it with tensor operations, without in-place updates"
        ) from exc


__all__ = [
    "SYNTHETIC",
    "PerRecord",
    "Plan",
    "StructureError",
    "UnbatchableModelError",
    "check_validity_vmaps",
    "per_record_validity",
    "synthetic_records",
]
