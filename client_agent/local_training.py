"""Local training for ``client`` units: the client's model update after a few steps of minibatch SGD.

DP-FedAvg (McMahan, Ramage, Talwar & Zhang, "Learning differentially private recurrent language
models", ICLR 2018, Alg. 1 ``UserUpdate``): the client starts from the broadcast parameters theta,
runs ``steps`` steps of SGD on its own records and returns Delta = theta_local - theta, flattened
in the layout of :func:`workloads.models.flatten_parameters`.

Privacy note: Delta is the client's one row v_t(u). It is not released here: the agent's release
path clips it to the client's remainder (partial clipping, FZ Alg. 3), charges ||clipped Delta||^2 /
sigma^2 as one Gaussian release and adds the noise (privacy.md §2, §4), exactly as for the
client-unit gradient row; the noise covers any function of the client's data whose clipped norm is
priced, so the number of local steps does not change the charge. The work done here depends on the
request and on the number of records only: never on the filter's state (every client that answers
runs the same steps, privacy.md §8), and never on which records are null (a record the model cannot
take goes through every step with loss weight 0, as in :func:`client_agent.workloads.gradient_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.func import functional_call

from client_agent.gradients import LossFn, _check_losses
from client_agent.layers import rows_where
from client_agent.streaming import RowContributions, finite_records
from protocol import messages as wire
from protocol.branchless import or_zero
from protocol.validate import integer
from workloads.models import trainable_mask

if TYPE_CHECKING:  # pragma: no cover
    from workloads.registry import Workload

# valid(x, y, model) -> (n,) bool tensor: which records are usable (workloads.registry.Workload.valid).
ValidFn = Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor]


def null_as_zero(
    model: nn.Module, x: NDArray[Any], y: NDArray[Any], *, valid: ValidFn | None = None, keep: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features, targets and loss weights with every null record (privacy.md §1) as zeros, target 0 and weight 0.

    ``valid`` (a workload's rule) says which records are usable; by default a record is null when a
    feature is not finite or its label is outside the model's classes (which the coordinator
    chooses), the rule of :func:`client_agent.workloads.gradient_rows`. Refusing a null record
    would answer a question about it for free. ``keep`` False (the client is stopped): every record is
    the null element before the validity rule or the model sees it (privacy.md §2). Float features are
    read as float32, integer ones as int64 (as the record engine reads them).
    """
    from client_agent.workloads import _unit_tensors

    xt, y_read = _unit_tensors(np.asarray(x), np.asarray(y))
    finite = finite_records(xt, y_read) & torch.tensor(bool(keep))
    safe_x = rows_where(finite, xt)
    if valid is None:
        labels = np.asarray(y)
        with torch.no_grad():
            classes = int(model(torch.zeros_like(xt[:1])).shape[-1])
        usable = finite.numpy() & (labels >= 0) & (labels < classes)
        yt = torch.from_numpy(or_zero(usable, labels.astype(np.int64)))
        weights = torch.from_numpy(usable.astype(np.float32))
    else:
        yt = rows_where(finite, y_read)
        mask = finite & valid(safe_x, yt, model).reshape(-1).to(torch.bool)
        yt = rows_where(mask, yt)
        weights = mask.to(torch.float32)
    xt = rows_where(weights > 0, xt)
    return xt, yt, weights


def local_update(
    model: nn.Module,
    loss_fn: LossFn,
    x: NDArray[Any],
    y: NDArray[Any],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    rng: np.random.Generator,
    valid: ValidFn | None = None,
    keep: bool = True,
) -> NDArray[np.float32]:
    """Delta = theta_local - theta after ``steps`` steps of minibatch SGD from ``model``'s parameters, float32 (d,).

    Step k draws b = min(batch_size, n) distinct records uniformly, ``rng.choice(n, b, replace=False)``,
    and sets theta <- theta - lr * grad( sum_{i in batch} w_i loss_fn(f_theta(x_i), y_i) / b ), with
    w_i = 0 for a null record and 1 otherwise (the divisor b counts null records too, as the
    gradient path's mean counts them). ``loss_fn`` returns per-example losses (shape (b,));
    ``valid`` is the workload's usable-record rule (default: :func:`null_as_zero`'s).
    ``model``'s own parameters, buffers and ``.grad`` are left untouched: the steps run on copies.
    A step that overflows leaves a non-finite Delta, which the release treats as the null element.
    ``keep`` False (the client is stopped): every record is the null element (:func:`null_as_zero`), the same
    steps run. An id outside an embedding's table is looked up as 0 and makes Delta the null element
    (exact zeros; :class:`client_agent.isolation.GuardedTables`), never an error. Frozen parameters
    (``requires_grad`` False) are not moved: their entries of Delta are exact zeros.
    """
    from client_agent.isolation import GuardedTables

    integer("steps", steps, at_least=0, error=ValueError)
    integer("batch_size", batch_size, at_least=1, error=ValueError)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr: expected a finite number > 0, got {lr!r}")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    start = {name: p.detach().clone().to(torch.float32) for name, p in model.named_parameters()}
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    params = dict(start)
    with GuardedTables(model) as tables:  # the validity rule may run the model too
        xt, yt, weights = null_as_zero(model, x, y, valid=valid, keep=keep)
        n = len(yt)
        b = min(batch_size, n)
        for _ in range(steps):
            idx = torch.from_numpy(rng.choice(n, size=b, replace=False).astype(np.int64))
            leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
            losses = _check_losses(loss_fn(functional_call(model, (leaves, buffers), (xt[idx],)), yt[idx]), b)
            loss = (losses * weights[idx]).sum() / b
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
            with torch.no_grad():
                params = {
                    name: p.detach() if g is None or name not in trainable else p.detach() - lr * g
                    for (name, p), g in zip(leaves.items(), grads, strict=True)
                }
    with torch.no_grad():
        delta = torch.cat([(params[name] - start[name]).reshape(-1) for name in start])
    return or_zero((~tables.bad).numpy(), delta.numpy().astype(np.float32, copy=False))


def local_rows(
    request: wire.GradientRequest,
    x: NDArray[Any],
    y: NDArray[Any],
    *,
    rng: np.random.Generator,
    loss_fn: LossFn | None = None,
    workload: Workload | None = None,
    stopped: NDArray[np.bool_] | None = None,
) -> RowContributions:
    """The client's one row for a gradient request with ``local_steps`` > 0: its local update, shape (1, d),
    with the model's trainable entries (frozen ones are released as exact zeros, noise included).

    With ``workload``, the model comes from its registry (checked against the request's layout) and
    the loss and usable-record rule are its own; without, the built-in model table, the gradient
    path's per-example cross-entropy and its null rule. ``loss_fn`` overrides the loss. ``stopped`` (one
    flag, the client's): a stopped client trains on the null element (:func:`local_update`'s ``keep``).
    """
    from client_agent.workloads import _cross_entropy, _loaded_model, client_kept

    if request.local_steps < 1 or request.local_lr is None or request.local_batch_size is None:
        raise wire.ProtocolError(f"{wire.GRADIENT}: local training needs local_steps >= 1, local_lr and batch size")
    if request.unit != "client":
        raise wire.ProtocolError(f"{wire.GRADIENT}: per-record units cannot train locally, got unit {request.unit!r}")
    registry: dict[str, Any] = {}
    if workload is not None:
        registry = {"workload": workload, "layout": getattr(request, "layout", None)}
    model = _loaded_model(wire.GRADIENT, request.model, request.model_args, request.parameters, **registry)
    if loss_fn is None:
        loss_fn = workload.loss if workload is not None else _cross_entropy
    delta = local_update(
        model,
        loss_fn,
        x,
        y,
        steps=request.local_steps,
        lr=request.local_lr,
        batch_size=request.local_batch_size,
        rng=rng,
        valid=workload.valid if workload is not None else None,
        keep=client_kept(stopped),
    )
    return RowContributions(delta.reshape(1, -1), trainable=trainable_mask(model))
