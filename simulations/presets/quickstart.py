"""``quickstart``: the default preset, a small synthetic federation that shows individual filtering at work."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.config import CoordinatorConfig
from coordinator.evaluation import model_evaluator
from coordinator.monitor import svt_reliability
from simulations.datasets.synthetic import synthetic_classification
from simulations.errors import SimulationError
from simulations.presets.base import (
    Options,
    Plan,
    client_files,
    local_training,
    pick,
    timeouts,
    worst_case_rounds,
)

# The quickstart's SVT monitor in central trust: epsilon_svt and threshold (a tenth of the units).
MONITOR_EPSILON = 0.1
# Client units: a private accuracy check every this many rounds from the worst-case horizon on, and
# the run stops after this many checks without a new best (coordinator/tasks.py, 'guarded' rule).
SELECT_EVERY, SELECT_PATIENCE = 2, 3


def fitted_monitor(trust: str, n_units: int, rounds: int) -> tuple[dict[str, Any], str]:
    """The monitor the quickstart runs, and why: in central trust the SVT monitor (epsilon 0.1, threshold
    n/10) when it tells the population from its threshold (both error probabilities below 5%,
    coordinator.monitor.svt_reliability), else none; in local trust none (the tree monitor's noise grows
    with the clients). A monitor that cannot separate would stop runs with everybody active."""
    if trust != "central":
        return {"monitor": "none"}, f"no active-set monitor in {trust} trust"
    threshold = max(1, n_units // 10)
    rel = svt_reliability(epsilon=MONITOR_EPSILON, threshold=threshold, population=n_units, rounds=rounds)
    if rel.separates:
        return {"monitor": "svt", "monitor_epsilon": MONITOR_EPSILON, "monitor_threshold": threshold}, rel.describe()
    return {"monitor": "none"}, f"no active-set monitor: {rel.describe()}"


def check_noise_std(sigma: float, clip: float) -> float:
    """sigma / C, rounded up until a check's cost (1 / sigma_s)^2 is at most a round's (C / sigma)^2 in floating
    point: the agents' per-request cap is sized from the round's cost (simulations.federation.request_share)."""
    check = sigma / clip
    while (1.0 / check) ** 2 > (clip / sigma) ** 2:
        check = math.nextafter(check, math.inf)
    return check


def selection_plan(
    epsilon: float, delta: float, sigma: float, clip: float, monitor_epsilon: float, filter_kind: str = "gdp"
) -> tuple[dict[str, Any], int, int]:
    """Private model selection for client units: (CoordinatorConfig keys, its worst-case stop, the stop without it).

    Each check is sent with clip 1 (a client's accuracy is a fraction) and noise sigma / C, so it costs a
    client at most (C / sigma)^2, one full-norm round. The first check comes at the worst-case horizon with
    one check set aside, H = floor((T - (C / sigma)^2) / (C / sigma)^2): there every client has spent at most
    H (C / sigma)^2 and can answer it in full, which the guarded rule needs (coordinator/tasks.py).
    H < 1 (the budget holds one round at most) leaves selection off.
    """
    without = worst_case_rounds(epsilon, delta, sigma, clip, monitor_epsilon, filter_kind)
    horizon = without - 1
    if horizon < 1:
        return {}, without, without
    keys = {
        "plateau_every": SELECT_EVERY,
        "plateau_start": horizon,
        "plateau_patience": SELECT_PATIENCE,
        "plateau_noise_std": check_noise_std(sigma, clip),
        "plateau_rule": "guarded",
    }
    return keys, horizon, without


def quickstart(opts: Options, out: Path) -> Plan:
    """Synthetic two-class data, logistic regression, record units, central trust, SVT monitor.

    Features are scaled to unit norm, so a record the model already classifies well has a
    small gradient and spends little: such records keep training long after the round where
    worst-case accounting (every record at full norm C every round) would have stopped.

    With client units the run selects its model privately (:func:`selection_plan`), and the monitor
    is the one that fits the population (:func:`fitted_monitor`).
    """
    clients = pick(opts.clients, 10)
    records = 100
    eps, delta = pick(opts.epsilon, 1.0), pick(opts.delta, 1e-5)
    sigma, clip = pick(opts.noise_std, 8.0), pick(opts.clip, 1.0)
    trust, unit = pick(opts.trust, "central"), pick(opts.unit, "record")
    rounds = pick(opts.rounds, 30)
    filter_kind = pick(opts.filter, "gdp")
    x, y = synthetic_classification(clients * records + 2000, 20, 2, seed=opts.seed, separation=2.5)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    parts = [(x[i * records : (i + 1) * records], y[i * records : (i + 1) * records]) for i in range(clients)]
    n_units = clients * records if unit == "record" else clients
    monitor, monitor_note = fitted_monitor(trust, n_units, rounds)
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
        filter=filter_kind,
        noise_seed=opts.seed,
        **{k: v for k, v in monitor.items() if k != "monitor_threshold"},
    )
    monitor_eps = monitor.get("monitor_epsilon", 0.0)
    worst = worst_case_rounds(eps, delta, sigma, clip, monitor_eps, filter_kind)
    notes: dict[str, Any] = {"data": "synthetic, 20 features, 2 classes", "monitor": monitor_note}
    selection: dict[str, Any] = {}
    if unit == "client":
        selection, worst, without = selection_plan(eps, delta, sigma, clip, monitor_eps, filter_kind)
        notes["selection"] = (
            f"a private accuracy check every {SELECT_EVERY} rounds from round {worst} (the worst-case stop with one "
            f"check set aside; {without} full-norm rounds without it), guarded rule"
            if selection
            else f"no model selection: the budget holds {without} full-norm round(s), none left for a check"
        )
    cfg = CoordinatorConfig(
        num_nodes=clients,
        n_public=n_units,
        rounds=rounds,
        noise_std=sigma,
        l2_clip=clip,
        learning_rate=1.0,
        trust=trust,
        unit=unit,
        model="logreg",
        model_args=json.dumps({"in_features": 20, "n_classes": 2}),
        seed=opts.seed,
        run_id=f"quickstart-{opts.seed}",
        eval_every=1,
        output_dir=str(out),
        noise_seed=opts.seed,
        **monitor,
        **selection,
        **local_training(opts),
        **timeouts(clients),
    )
    test_x, test_y = x[clients * records :], y[clients * records :]
    return Plan(cfg, per, model_evaluator(cfg, test_x, test_y), worst, notes)
