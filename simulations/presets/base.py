"""``fedfilter simulate``: a federation on one machine, on Flower's simulation engine (Ray).

Every preset builds the clients' data and agent configurations under ``--out``, runs the
real ServerApp and ClientApps through :func:`simulations.engine.run_flower`, and leaves
``summary.json``, ``rounds.jsonl``, PNG plots and the clients' ledgers (``ledgers/``,
readable with ``fedfilter ledger show``) in the output directory.

The plots' "active units" curve is read from the simulated clients' ledgers after the run:
ground truth that only a simulation has. It is never released to the coordinator, which
sees only the monitor's private verdicts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from coordinator.evaluation import model_evaluator
from coordinator.rounds import Evaluate
from protocol.filters import GaussianFilter
from simulations.data import mnist_silos, synthetic_classification
from simulations.federation import write_clients
from simulations.reproductions import filters_compare, realisation_survival
from simulations.scenarios import sparse_counting


@dataclass(frozen=True)
class Options:
    """What the command line may change; None keeps the preset's value."""

    clients: int | None = None
    rounds: int | None = None
    epsilon: float | None = None
    delta: float | None = None
    noise_std: float | None = None
    clip: float | None = None
    trust: str | None = None
    unit: str | None = None
    filter: str | None = None
    seed: int = 0
    data_dir: str | None = None
    download: bool = False  # fetch missing dataset files from the canonical mirrors
    out: str | None = None  # default: fedfilter-out/<preset>-<UTC time>, a new folder per run
    engine: str = "flower"
    # The ``workload`` preset: "package.module:object" (protocol/workload.py); both sides load it.
    workload: str | None = None
    # Local training (quickstart with unit 'client'; DP-FedAvg): CoordinatorConfig's local_* and server_lr.
    local_steps: int | None = None
    local_lr: float | None = None
    local_batch_size: int | None = None
    server_lr: float | None = None


@dataclass(frozen=True)
class Plan:
    """A ready run: the coordinator's config, each client's agent config, and the server-side evaluation."""

    cfg: CoordinatorConfig
    clients: dict[int, dict[str, Any]]
    evaluate: Evaluate | None
    worst_case_rounds: int
    notes: dict[str, Any]
    # Paper reproductions: after the run, (summary, out) -> entries added to summary.json under
    # "reproduction" (their "plots" join the run's plots, their "headline" lines the headline).
    post: Callable[[dict[str, Any], Path], dict[str, Any]] | None = None


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _local_training(opts: Options) -> dict[str, Any]:
    """The CoordinatorConfig keys of local training that the command line set (validated there)."""
    keys = ("local_steps", "local_lr", "local_batch_size", "server_lr")
    return {k: getattr(opts, k) for k in keys if getattr(opts, k) is not None}


def _worst_case_rounds(
    epsilon: float, delta: float, noise_std: float, clip: float, monitor_epsilon: float = 0.0
) -> int:
    """Rounds worst-case GDP accounting allows at full sensitivity, with the monitor's share set aside."""
    return GaussianFilter.gdp(epsilon=epsilon - monitor_epsilon, delta=delta).full_norm_rounds(
        noise_std=noise_std, l2_clip=clip
    )


def quickstart(opts: Options, out: Path) -> Plan:
    """Synthetic two-class data, logistic regression, record units, central trust, SVT monitor.

    Features are scaled to unit norm, so a record the model already classifies well has a
    small gradient and spends little: such records keep training long after the round where
    worst-case accounting (every record at full norm C every round) would have stopped.
    """
    clients = _pick(opts.clients, 10)
    records = 100
    eps, delta = _pick(opts.epsilon, 1.0), _pick(opts.delta, 1e-5)
    sigma, clip = _pick(opts.noise_std, 8.0), _pick(opts.clip, 1.0)
    trust, unit = _pick(opts.trust, "central"), _pick(opts.unit, "record")
    x, y = synthetic_classification(clients * records + 2000, 20, 2, seed=opts.seed, separation=2.5)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    parts = [(x[i * records : (i + 1) * records], y[i * records : (i + 1) * records]) for i in range(clients)]
    n_units = clients * records if unit == "record" else clients
    monitor: dict[str, Any] = {"monitor": "svt", "monitor_epsilon": 0.1} if trust == "central" else {"monitor": "none"}
    if eps <= monitor.get("monitor_epsilon", 0.0):
        raise ValueError(
            f"--epsilon: the quickstart reserves epsilon {monitor['monitor_epsilon']} for its monitor in central "
            f"trust; expected more than that, got {eps:g}"
        )
    per = _clients(
        out,
        parts,
        epsilon=eps,
        delta=delta,
        unit=unit,
        trust=trust,
        filter=_pick(opts.filter, "gdp"),
        noise_seed=opts.seed,
        **monitor,
    )
    cfg = CoordinatorConfig(
        num_nodes=clients,
        n_public=n_units,
        rounds=_pick(opts.rounds, 30),
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
        **_local_training(opts),
    )
    test_x, test_y = x[clients * records :], y[clients * records :]
    worst = _worst_case_rounds(eps, delta, sigma, clip, monitor.get("monitor_epsilon", 0.0))
    return Plan(cfg, per, model_evaluator(cfg, test_x, test_y), worst, {"data": "synthetic, 20 features, 2 classes"})


def sparse_queries(opts: Options, out: Path) -> Plan:
    """FZ Thm 1.2 on one machine: each record positive on at most s of k counting queries, local trust."""
    clients = _pick(opts.clients, 10)
    records, k = 100, _pick(opts.rounds, 100)
    s = min(6, k)
    eps, delta = _pick(opts.epsilon, 3.0), _pick(opts.delta, 1e-5)
    sigma = _pick(opts.noise_std, 4.0)
    trust = _pick(opts.trust, "local")
    parts = sparse_counting(clients, records, k_queries=k, s_max=s, seed=opts.seed, profile="heavy_tailed")
    per = _clients(
        out,
        parts,
        epsilon=eps,
        delta=delta,
        unit="record",
        trust=trust,
        filter=_pick(opts.filter, "gdp"),
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
    )
    truth = np.concatenate([p[0] for p in parts]).sum(axis=0)
    np.save(out / "true_counts.npy", truth)
    return Plan(cfg, per, None, _worst_case_rounds(eps, delta, sigma, 1.0), {"k": k, "s_max": s})


def mnist_gd(opts: Options, out: Path) -> Plan:
    """The CNN of Opacus's MNIST example on MNIST: record units, central trust, 10 silos (full-batch GD)."""
    clients = _pick(opts.clients, 10)
    data_dir = Path(opts.data_dir) if opts.data_dir else None
    parts, test_x, test_y = mnist_silos(clients, seed=opts.seed, data_dir=data_dir, download=opts.download)
    eps, delta = _pick(opts.epsilon, 1.0), _pick(opts.delta, 1e-5)
    sigma, clip = _pick(opts.noise_std, 400.0), _pick(opts.clip, 1.0)
    per = _clients(
        out,
        parts,
        epsilon=eps,
        delta=delta,
        unit="record",
        trust="central",
        filter=_pick(opts.filter, "gdp"),
        noise_seed=opts.seed,
    )
    cfg = CoordinatorConfig(
        num_nodes=clients,
        n_public=sum(len(p[0]) for p in parts),
        rounds=_pick(opts.rounds, 60),
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
    return Plan(cfg, per, model_evaluator(cfg, test_x, test_y), _worst_case_rounds(eps, delta, sigma, clip), {})


def workload_demo(opts: Options, out: Path) -> Plan:
    """A user's workload (``--workload``) through its ``demo`` hook: its data, model and defaults.

    The agents name the workload in their configuration and the coordinator builds the model from
    the same object, as a Flower app's two sides import one package. Gradient task, record units.
    """
    from protocol.workload import WorkloadError, load_workload

    ref = opts.workload or ""
    try:
        workload = load_workload(ref)
    except WorkloadError as exc:
        raise ValueError(f"--workload: {exc}") from exc
    if workload.demo is None:
        raise ValueError(f"--workload: expected a workload with a demo hook (Workload(demo=...)), {ref!r} has none")
    clients = _pick(opts.clients, 3)
    demo = workload.demo(clients=clients, seed=opts.seed, root=(out / "clients").resolve())
    unit, trust = _pick(opts.unit, "record"), _pick(opts.trust, "central")
    eps, delta = _pick(opts.epsilon, demo.epsilon), _pick(opts.delta, 1e-5)
    sigma, clip = _pick(opts.noise_std, demo.noise_std), _pick(opts.clip, demo.l2_clip)
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
            "filter": _pick(opts.filter, "gdp"),
            "noise-seed": opts.seed * 1000 + pid,
        }
    n_units = records if unit == "record" else len(demo.clients)
    cfg = CoordinatorConfig(
        num_nodes=len(demo.clients),
        n_public=n_units,
        rounds=_pick(opts.rounds, demo.rounds),
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
    )
    evaluate = model_evaluator(cfg, *demo.test) if demo.test is not None else None
    return Plan(cfg, per, evaluate, _worst_case_rounds(eps, delta, sigma, clip), {"workload": workload.describe()})


def _clients(out: Path, parts: list[tuple[np.ndarray, np.ndarray]], **agent: Any) -> dict[int, dict[str, Any]]:
    """Data under ``out/clients``, ledgers under ``out/ledgers`` (checked empty by :func:`simulate`)."""
    return write_clients(out / "clients", parts, ledger_dir=out / "ledgers", **agent)


PRESETS: dict[str, Callable[[Options, Path], Plan]] = {
    "quickstart": quickstart,
    "sparse-queries": sparse_queries,
    "mnist-gd": mnist_gd,
    "realisation-survival": realisation_survival,
    "filters-compare": filters_compare,
    "workload": workload_demo,
}


def halt_rounds(clients: Mapping[int, Mapping[str, Any]]) -> np.ndarray:
    """Every unit's halt round (its last round with data; -1: still active), from the simulated clients' ledgers."""
    halts = []
    for node in clients.values():
        with Ledger.open_existing(Path(node["ledger-path"])) as ledger:
            halts.append(ledger.state()["halt_round"])
    return np.concatenate(halts)


def active_per_round(clients: dict[int, dict[str, Any]], rounds: int) -> np.ndarray:
    """Active units after each round 0..rounds, from the simulated clients' ledgers (ground truth)."""
    h = halt_rounds(clients)
    return np.array([np.count_nonzero((h < 0) | (h > t)) for t in range(rounds + 1)])


def default_out(preset: str) -> Path:
    """``fedfilter-out/<preset>-<UTC time>``: a new folder for every run."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = Path("fedfilter-out") / f"{preset}-{stamp}"
    out, k = base, 1
    while out.exists():
        k += 1
        out = base.with_name(f"{base.name}-{k}")
    return out


def simulate(preset: str, opts: Options) -> dict[str, Any]:
    """Run a preset; returns the coordinator's summary with the simulation's ground truth added."""
    if preset not in PRESETS:
        raise ValueError(f"--preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    out = Path(opts.out) if opts.out else default_out(preset)
    spent = sorted((out / "ledgers").glob("client*.sqlite"))
    if spent:
        # Never start a simulated federation over ledgers that already hold spend: that would
        # read as a budget reset. A new run needs a new folder.
        raise ValueError(
            f"--out: {out / 'ledgers'} already holds {len(spent)} client ledgers from an earlier run; "
            "choose a new --out (or leave it out for a fresh folder)"
        )
    out.mkdir(parents=True, exist_ok=True)
    plan = PRESETS[preset](opts, out)
    started = time.monotonic()
    from simulations.engine import run_engine

    summary = run_engine(opts.engine, plan.cfg, plan.clients, evaluate=plan.evaluate)
    wall = time.monotonic() - started
    active = active_per_round(plan.clients, summary["rounds_completed"])
    truth: dict[str, Any] = {
        "preset": preset,
        "engine": opts.engine,
        "wall_s": wall,
        "worst_case_rounds": plan.worst_case_rounds,
        "active_units_per_round": active.tolist(),
        "note": "ground truth read from the simulated clients' ledgers; never released to the coordinator",
        **plan.notes,
    }
    truth["out"] = str(out)
    summary["simulation"] = truth
    if plan.post is not None:
        summary["reproduction"] = plan.post(summary, out)
    from coordinator.report import write_json_atomic
    from simulations.plots import plot_run

    written = {k: v for k, v in summary.items() if k not in ("parameters", "rounds")}
    write_json_atomic(out / "summary.json", written)
    summary["plots"] = plot_run(summary, out) + list(summary.get("reproduction", {}).get("plots", []))
    return summary


def headline(summary: dict[str, Any]) -> list[str]:
    """What the run showed, in a few lines for the terminal."""
    sim = summary["simulation"]
    rounds = summary["rounds"]
    worst = sim["worst_case_rounds"]
    active = sim["active_units_per_round"]
    lines = [summary["privacy"]["statement"]]
    lines.append(
        f"{summary['rounds_completed']} rounds ({summary['stopped_because']}); worst-case accounting at the same "
        f"(epsilon, delta) allows {worst} full-norm rounds."
    )
    if len(active) > 1:
        lines.append(
            f"Units still active after round {len(active) - 1}: {active[-1]} of {active[0]} "
            f"({100 * active[-1] / max(active[0], 1):.0f}%; simulation ground truth)."
        )
    if summary["task"] == "gradient":
        acc = {r["round"]: r["metrics"].get("accuracy") for r in rounds if r["metrics"].get("accuracy") is not None}
        if worst in acc and acc:
            last = max(acc)
            lines.append(
                f"Test accuracy at the worst-case stop (round {worst}): {acc[worst]:.4f}; "
                f"at round {last} with individual filtering: {acc[last]:.4f}."
            )
    else:
        lines.append(
            f"Queries answered: {summary['queries_answered']}; worst-case accounting: {summary['worst_case_queries']} "
            f"({summary['queries_answered'] / max(summary['worst_case_queries'], 1):.1f}x)."
        )
    lines.extend(summary.get("reproduction", {}).get("headline", []))
    return lines
