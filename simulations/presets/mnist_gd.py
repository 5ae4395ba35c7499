"""``mnist-gd``: full-batch private GD of Opacus's MNIST CNN over 10 silos, with individual filtering."""

from __future__ import annotations

from pathlib import Path

from coordinator.config import CoordinatorConfig
from coordinator.evaluation import model_evaluator
from simulations.datasets.partition import mnist_silos
from simulations.presets.base import Options, Plan, client_files, pick, worst_case_rounds


def mnist_gd(opts: Options, out: Path) -> Plan:
    """The CNN of Opacus's MNIST example on MNIST: record units, central trust, 10 silos (full-batch GD)."""
    clients = pick(opts.clients, 10)
    data_dir = Path(opts.data_dir) if opts.data_dir else None
    parts, test_x, test_y = mnist_silos(clients, seed=opts.seed, data_dir=data_dir, download=opts.download)
    eps, delta = pick(opts.epsilon, 1.0), pick(opts.delta, 1e-5)
    sigma, clip = pick(opts.noise_std, 400.0), pick(opts.clip, 1.0)
    per = client_files(
        out,
        parts,
        plan=(sigma, clip),
        epsilon=eps,
        delta=delta,
        unit="record",
        trust="central",
        filter=pick(opts.filter, "gdp"),
        noise_seed=opts.seed,
    )
    cfg = CoordinatorConfig(
        num_nodes=clients,
        n_public=sum(len(p[0]) for p in parts),
        rounds=pick(opts.rounds, 60),
        noise_std=sigma,
        l2_clip=clip,
        learning_rate=2.0,
        trust="central",
        unit="record",
        model="opacus_mnist_cnn",
        seed=opts.seed,
        run_id=f"mnist-{opts.seed}",
        eval_every=5,
        output_dir=str(out),
        noise_seed=opts.seed,
        round_timeout=3600.0,
    )
    return Plan(
        cfg,
        per,
        model_evaluator(cfg, test_x, test_y),
        worst_case_rounds(eps, delta, sigma, clip, 0.0, pick(opts.filter, "gdp")),
        {},
    )
