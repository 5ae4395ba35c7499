"""A dry run of the owner's workload on a few of the owner's own records, before the agent serves
(``fedfilter agent check``): every registered model, loss, validity rule, query and the data source.

Everything runs locally on the first :data:`SAMPLE` records; nothing leaves the machine and nothing is
charged. A model the per-record engine refuses (BatchNorm, Dropout with p > 0 in training mode,
attention dropout in training mode, ``Embedding(max_norm=...)``, a forward vmap cannot run) is a
problem, named with what to do instead (``fedfilter agent check`` exits 2); a model that does not
run on the owner's records (say, the built-in MNIST CNN on tabular data) is a warning, and a query
that fails on them a problem; a validity rule that would
treat more than :data:`NULL_WARNING` of the sample as the null element is warned about (a rule that
silently nulls a data set spends no budget and learns nothing).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from torch import nn

SAMPLE = 16
NULL_WARNING = 0.01


def model_problems(model: nn.Module) -> list[str]:
    """What the per-record engine refuses in ``model``, one message per module, each naming the fix."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    problems = []
    for name, m in model.named_modules():
        where = f"module {name or '(root)'!r} ({type(m).__name__})"
        if isinstance(m, _BatchNorm):
            problems.append(
                f"{where}: BatchNorm is not supported for per-example gradients (a record alone has no batch "
                "statistics); use GroupNorm or LayerNorm"
            )
        elif isinstance(m, _DropoutNd) and m.training and m.p > 0:
            problems.append(
                f"{where}: Dropout with p > 0 in training mode (p = {m.p}); build it with p = 0 or call .eval() "
                "in the workload's factory"
            )
        elif isinstance(m, nn.Embedding) and m.max_norm is not None:
            problems.append(
                f"{where}: max_norm renormalises the table in place during the forward, so records would see each "
                "other's lookups; drop max_norm (renormalise in the loss or between rounds)"
            )
        elif isinstance(m, nn.MultiheadAttention) and m.training and m.dropout > 0:
            problems.append(
                f"{where}: attention dropout {m.dropout} in training mode; build it with dropout = 0 or call .eval()"
            )
    return problems


def _required_arguments(factory: Any) -> list[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.kind in kinds]


def _first_records(source: Any, n: int) -> tuple[Any, Any]:
    x, y = next(iter(source.batches(n)))
    return x, y


def dry_run(workload: Any, source: Any, *, unit: str, sample: int = SAMPLE) -> dict[str, Any]:
    """The dry run's report: ``data``, ``models`` and ``queries`` (each name -> status and message), and
    ``problems`` (what must be fixed before serving) and ``warnings``."""
    from client_agent.isolation import UnbatchableModelError, per_record_validity
    from client_agent.streaming import ArraySource, StreamedGradients, batch_tensor
    from client_agent.workloads import client_gradient_row
    from workloads.registry import QueryArgs, bounded_rows

    problems: list[str] = []
    warnings: list[str] = []
    report: dict[str, Any] = {"models": {}, "queries": {}}
    try:
        x, y = _first_records(source, min(sample, len(source)))
    except Exception as exc:  # the owner's data source: whatever it raises is the finding
        problems.append(f"data: the first records do not load: {type(exc).__name__}: {exc}")
        return report | {"data": "fails", "problems": problems, "warnings": warnings}
    report["data"] = {"records": len(source), "x": f"{np.asarray(x).dtype} {tuple(np.asarray(x).shape[1:])}"}
    report["data"]["y"] = f"{np.asarray(y).dtype} {tuple(np.asarray(y).shape[1:])}"
    ran: nn.Module | None = None
    for name, factory in workload.models.items():
        required = _required_arguments(factory)
        if required:
            report["models"][name] = {"status": "not run", "why": f"its factory needs model_args {required}"}
            continue
        try:
            model = workload.build_model(name, seed=0)
        except Exception as exc:
            problems.append(f"model {name!r}: its factory fails: {exc}")
            report["models"][name] = {"status": "fails"}
            continue
        refused = model_problems(model)
        if refused:
            problems.extend(f"model {name!r}: {p}" for p in refused)
            report["models"][name] = {"status": "refused", "why": refused}
            continue

        def valid(xb: Any, yb: Any, model: nn.Module = model) -> Any:
            return workload.valid(xb, yb, model)

        try:
            usable = per_record_validity(valid, batch_tensor(x), batch_tensor(y), vmapped=False)
            null = int((~usable).sum())
            if unit == "record":
                units = StreamedGradients(model, workload.loss, ArraySource(np.asarray(x), np.asarray(y)), valid=valid)
                units.clipped_sum(lambda start, norms: np.ones(norms.size))
                entry: dict[str, Any] = {"status": "ok", "method": units.method, "null_records": null}
            else:
                client_gradient_row(model, workload.loss, ArraySource(np.asarray(x), np.asarray(y)), valid=valid)
                entry = {"status": "ok", "null_records": null}
        except UnbatchableModelError as exc:  # the engine refuses it, whatever the data: fix before serving
            problems.append(f"model {name!r}: {exc}")
            report["models"][name] = {"status": "refused"}
            continue
        except Exception as exc:  # e.g. a model for other record shapes (the built-in CNN on tabular data)
            warnings.append(
                f"model {name!r} does not run on your records ({type(exc).__name__}: {exc}); "
                "requests for it will be refused"
            )
            report["models"][name] = {"status": "fails"}
            continue
        if null > NULL_WARNING * len(usable):
            warnings.append(
                f"model {name!r}: the validity rule treats {null} of {len(usable)} sampled records as the null element "
                "(they would contribute nothing and learn nothing)"
            )
        report["models"][name] = entry
        ran = ran or model
    for qname, query in workload.queries.items():
        if query.needs_model and ran is None:
            report["queries"][qname] = {"status": "not run", "why": "it needs a model, and no model ran"}
            continue
        try:
            args = QueryArgs(column=0, value=0.0, model=ran if query.needs_model else None)
            bounded_rows(query, query.rows(np.asarray(x), np.asarray(y), args), len(x))
            report["queries"][qname] = {"status": "ok"}
        except Exception as exc:
            problems.append(f"query {qname!r}: fails on your records: {type(exc).__name__}: {exc}")
            report["queries"][qname] = {"status": "fails"}
    return report | {"problems": problems, "warnings": warnings}
