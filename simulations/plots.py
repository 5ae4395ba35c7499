"""PNG plots of a run: its metrics per round and its active units per round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_run(summary: dict[str, Any], out: Path) -> list[str]:
    """Write ``metrics.png`` and ``active_units.png`` under ``out``; returns their paths."""
    rounds = summary["rounds"]
    sim = summary.get("simulation", {})
    worst = sim.get("worst_case_rounds")
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.6))
    if summary["task"] == "gradient":
        pts = [(r["round"], r["metrics"]["accuracy"]) for r in rounds if "accuracy" in r["metrics"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label="test accuracy (server-side data)")
        ax.set_ylabel("test accuracy")
    else:
        ax.errorbar(
            [r["round"] for r in rounds],
            [r["answer"] for r in rounds],
            yerr=[r["bound"] for r in rounds],
            fmt=".",
            capsize=2,
            label="noisy count ± stated bound",
        )
        ax.set_ylabel("answer")
    if worst:
        ax.axvline(worst, color="grey", linestyle="--", label=f"worst-case stop (round {worst})")
    ax.set_xlabel("round")
    ax.set_title(f"{summary['run_id']}: {summary['task']} task")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = out / "metrics.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(str(path))

    active = sim.get("active_units_per_round")
    if active:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.step(range(len(active)), active, where="post", label="active units (simulation ground truth)")
        estimates = [(r["round"], r["monitor"].get("active_estimate")) for r in rounds if r.get("monitor")]
        estimates = [e for e in estimates if e[1] is not None]
        if estimates:
            ax.plot([e[0] for e in estimates], [e[1] for e in estimates], ".", label="monitor's private estimate")
        threshold = summary["config"].get("monitor_threshold")
        if threshold:
            ax.axhline(threshold, color="red", linewidth=0.8, label=f"monitor threshold {threshold}")
        if worst:
            ax.axvline(worst, color="grey", linestyle="--", label="worst-case stop")
        ax.set_xlabel("round")
        ax.set_ylabel("active units")
        ax.set_ylim(bottom=0)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = out / "active_units.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths
