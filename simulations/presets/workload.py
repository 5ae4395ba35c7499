"""``workload``: a user's workload (``--workload package.module:object``) through its demo hook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.evaluation import model_evaluator
from simulations.errors import SimulationError
from simulations.federation import request_share
from simulations.presets.base import Options, Plan, pick, timeouts, worst_case_rounds
from workloads.registry import WorkloadError, load_workload


def workload_demo(opts: Options, out: Path) -> Plan:
    """A user's workload (``--workload``) through its ``demo`` hook: its data, model and defaults.

    The agents name the workload in their configuration and the coordinator builds the model from
    the same object, as a Flower app's two sides import one package. Gradient task, record units.
    """
    ref = opts.workload or ""
    try:
        workload = load_workload(ref)
    except WorkloadError as exc:
        raise SimulationError(f"--workload: {exc}") from exc
    if workload.demo is None:
        raise SimulationError(
            f"--workload: expected a workload with a demo hook (Workload(demo=...)), {ref!r} has none"
        )
    clients = pick(opts.clients, 3)
    demo = workload.demo(clients=clients, seed=opts.seed, root=(out / "clients").resolve())
    unit, trust = pick(opts.unit, "record"), pick(opts.trust, "central")
    eps, delta = pick(opts.epsilon, demo.epsilon), pick(opts.delta, 1e-5)
    sigma, clip = pick(opts.noise_std, demo.noise_std), pick(opts.clip, demo.l2_clip)
    ledgers = (out / "ledgers").resolve()
    ledgers.mkdir(parents=True, exist_ok=True)
    per: dict[int, dict[str, Any]] = {}
    records = 0
    for pid, path in enumerate(demo.clients):
        records += len(workload.open_data(path))
        per[pid] = {
            "ledger-path": str(ledgers / f"client{pid}.sqlite"),
            "data-path": str(path),
            "workload": ref,
            "epsilon": eps,
            "delta": delta,
            "unit": unit,
            "trust": trust,
            "filter": pick(opts.filter, "gdp"),
            "noise-seed": opts.seed * 1000 + pid,
            # The run's per-round cost, when above the default quarter of the budget (a few large rounds).
            "policy-max-request-share": request_share(
                str(pick(opts.filter, "gdp")), epsilon=eps, delta=delta, noise_std=sigma, clip=clip
            ),
        }
    n_units = records if unit == "record" else len(demo.clients)
    cfg = CoordinatorConfig(
        num_nodes=len(demo.clients),
        n_public=n_units,
        rounds=pick(opts.rounds, demo.rounds),
        noise_std=sigma,
        l2_clip=clip,
        learning_rate=demo.learning_rate,
        trust=trust,
        unit=unit,
        model=demo.model,
        model_args=json.dumps(dict(demo.model_args)),
        seed=opts.seed,
        run_id=f"workload-{workload.name}-{opts.seed}",
        eval_every=1 if demo.test is not None else 0,
        output_dir=str(out),
        noise_seed=opts.seed,
        workload=ref,
        **timeouts(len(demo.clients)),
    )
    evaluate = model_evaluator(cfg, *demo.test) if demo.test is not None else None
    return Plan(
        cfg,
        per,
        evaluate,
        worst_case_rounds(eps, delta, sigma, clip, 0.0, pick(opts.filter, "gdp")),
        {"workload": workload.describe()},
    )
