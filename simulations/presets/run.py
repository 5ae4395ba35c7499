"""``fedfilter simulate``: a federation on one machine, on Flower's simulation engine (Ray).

Every preset builds the clients' data and agent configurations under ``--out``, runs the
real ServerApp and ClientApps through :func:`simulations.engine.run_engine`, and leaves
``summary.json``, ``rounds.jsonl``, PNG plots and the clients' ledgers (``ledgers/``,
readable with ``fedfilter ledger show``) in the output directory.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from coordinator.report import write_json_atomic
from simulations.engine import run_engine
from simulations.errors import SimulationError
from simulations.plots import plot_run
from simulations.presets import load_preset
from simulations.presets.base import Options, active_per_round


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
    build = load_preset(preset)
    out = Path(opts.out) if opts.out else default_out(preset)
    spent = sorted((out / "ledgers").glob("client*.sqlite"))
    if spent:
        # Never start a simulated federation over ledgers that already hold spend: that would
        # read as a budget reset. A new run needs a new folder.
        raise SimulationError(
            f"--out: {out / 'ledgers'} already holds {len(spent)} client ledgers from an earlier run; "
            "choose a new --out (or leave it out for a fresh folder)"
        )
    out.mkdir(parents=True, exist_ok=True)
    plan = build(opts, out)
    started = time.monotonic()
    summary = run_engine(opts.engine, plan.cfg, plan.clients, evaluate=plan.evaluate, address=opts.ray_address)
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
        selection = summary.get("selection")
        if selection and selection["round"] is not None:
            chosen = selection["metrics"].get("accuracy")
            said = "" if chosen is None else f", test accuracy {chosen:.4f}"
            lines.append(
                f"Private model selection ({selection['rule']} rule, {len(selection['checks'])} checks) returned "
                f"round {selection['round']}{said} (checkpoints/selected_{selection['round']:05d}.npz)."
            )
    else:
        lines.append(
            f"Queries answered: {summary['queries_answered']}; worst-case accounting: {summary['worst_case_queries']} "
            f"({summary['queries_answered'] / max(summary['worst_case_queries'], 1):.1f}x)."
        )
    warning = summary.get("monitor_reliability", {}).get("warning")
    if warning:
        lines.append(f"Warning: {warning}")
    lines.extend(summary.get("reproduction", {}).get("headline", []))
    return lines
