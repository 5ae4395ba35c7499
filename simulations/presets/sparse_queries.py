"""``sparse-queries``: FZ Thm 1.2's sparse counting queries, each record positive on few of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from coordinator.config import CoordinatorConfig
from simulations.datasets.scenarios import sparse_counting
from simulations.presets.base import Options, Plan, client_files, pick, timeouts, worst_case_rounds


def sparse_queries(opts: Options, out: Path) -> Plan:
    """FZ Thm 1.2 on one machine: each record positive on at most s of k counting queries, local trust."""
    clients = pick(opts.clients, 10)
    records, k = 100, pick(opts.rounds, 100)
    s = min(6, k)
    eps, delta = pick(opts.epsilon, 3.0), pick(opts.delta, 1e-5)
    sigma = pick(opts.noise_std, 4.0)
    trust = pick(opts.trust, "local")
    parts = sparse_counting(clients, records, k_queries=k, s_max=s, seed=opts.seed, profile="heavy_tailed")
    per = client_files(
        out,
        parts,
        plan=(sigma, 1.0),
        epsilon=eps,
        delta=delta,
        unit="record",
        trust=trust,
        filter=pick(opts.filter, "gdp"),
        noise_seed=opts.seed,
    )
    cfg = CoordinatorConfig(
        num_nodes=clients,
        n_public=clients * records,
        rounds=k,
        noise_std=sigma,
        l2_clip=1.0,
        task="indicator",
        trust=trust,
        unit="record",
        analyst="sweep",
        query_columns=k,
        seed=opts.seed,
        run_id=f"sparse-{opts.seed}",
        output_dir=str(out),
        noise_seed=opts.seed,
        **timeouts(clients),
    )
    truth = np.concatenate([p[0] for p in parts]).sum(axis=0)
    np.save(out / "true_counts.npy", truth)
    return Plan(
        cfg, per, None, worst_case_rounds(eps, delta, sigma, 1.0, 0.0, pick(opts.filter, "gdp")), {"k": k, "s_max": s}
    )
