"""``quickstart``: the default preset, a small synthetic federation that shows individual filtering at work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.config import CoordinatorConfig
from coordinator.evaluation import model_evaluator
from simulations.datasets.synthetic import synthetic_classification
from simulations.errors import SimulationError
from simulations.presets.base import Options, Plan, client_files, local_training, pick, worst_case_rounds


def quickstart(opts: Options, out: Path) -> Plan:
    """Synthetic two-class data, logistic regression, record units, central trust, SVT monitor.

    Features are scaled to unit norm, so a record the model already classifies well has a
    small gradient and spends little: such records keep training long after the round where
    worst-case accounting (every record at full norm C every round) would have stopped.
    """
    clients = pick(opts.clients, 10)
    records = 100
    eps, delta = pick(opts.epsilon, 1.0), pick(opts.delta, 1e-5)
    sigma, clip = pick(opts.noise_std, 8.0), pick(opts.clip, 1.0)
    trust, unit = pick(opts.trust, "central"), pick(opts.unit, "record")
    x, y = synthetic_classification(clients * records + 2000, 20, 2, seed=opts.seed, separation=2.5)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    parts = [(x[i * records : (i + 1) * records], y[i * records : (i + 1) * records]) for i in range(clients)]
    n_units = clients * records if unit == "record" else clients
    monitor: dict[str, Any] = {"monitor": "svt", "monitor_epsilon": 0.1} if trust == "central" else {"monitor": "none"}
    if eps <= monitor.get("monitor_epsilon", 0.0):
        raise SimulationError(
            f"--epsilon: the quickstart reserves epsilon {monitor['monitor_epsilon']} for its monitor in central "
            f"trust; expected more than that, got {eps:g}"
        )
    per = client_files(
        out,
        parts,
        plan=(sigma, clip),
        epsilon=eps,
        delta=delta,
        unit=unit,
        trust=trust,
        filter=pick(opts.filter, "gdp"),
        noise_seed=opts.seed,
        **monitor,
    )
    cfg = CoordinatorConfig(
        num_nodes=clients,
        n_public=n_units,
        rounds=pick(opts.rounds, 30),
        noise_std=sigma,
        l2_clip=clip,
        learning_rate=1.0,
        trust=trust,
        unit=unit,
        model="logreg",
        model_args=json.dumps({"in_features": 20, "n_classes": 2}),
        seed=opts.seed,
        run_id=f"quickstart-{opts.seed}",
        monitor=monitor["monitor"],
        monitor_epsilon=monitor.get("monitor_epsilon", 0.0),
        monitor_threshold=max(1, n_units // 10) if monitor["monitor"] != "none" else 0,
        eval_every=1,
        output_dir=str(out),
        noise_seed=opts.seed,
        **local_training(opts),
    )
    test_x, test_y = x[clients * records :], y[clients * records :]
    worst = worst_case_rounds(eps, delta, sigma, clip, monitor.get("monitor_epsilon", 0.0))
    return Plan(cfg, per, model_evaluator(cfg, test_x, test_y), worst, {"data": "synthetic, 20 features, 2 classes"})
