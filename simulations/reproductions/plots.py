"""PNG plots of the paper reproductions: TVC Fig. 2's survival curves and FZ Sec. 4.3's rounds per filter."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

_MECHANISM_LABELS = {
    "additive": "additive (basic composition)",
    "rruv": "advanced (RRUV filter)",
    "rdp": "Rényi DP, best order fixed in advance",
    "gdp": "GDP filter (this project; not in TVC Fig. 2)",
}


def plot_survival(
    t: np.ndarray,
    mechanism: Mapping[str, np.ndarray],
    monte_carlo: np.ndarray,
    federation: np.ndarray,
    *,
    band: float,
    labels: Mapping[str, str],
    title: str,
    path: Path,
) -> str:
    """P(T > t) of each filter's stopping time: steps for the mechanism filters, the realisation filter's curves.

    ``labels`` names the Monte-Carlo curve ("mc"), the federation's points ("fed") and the band of
    half-width ``band`` drawn around the Monte-Carlo curve ("band").
    """
    fig, ax = plt.subplots(figsize=(10, 4.2))
    styles = {"additive": ":", "rruv": "-.", "rdp": "--", "gdp": (0, (5, 1, 1, 1))}
    for name, curve in mechanism.items():
        # Shifted a little apart so that curves stopping at the same round stay visible.
        offset = 0.012 * (list(mechanism).index(name) - 1.5)
        ax.step(
            t, curve + offset, where="post", linestyle=styles.get(name, "-"), label=_MECHANISM_LABELS.get(name, name)
        )
    ax.step(t, monte_carlo, where="post", color="black", linewidth=1.6, label=labels["mc"])
    ax.fill_between(
        t,
        np.clip(monte_carlo - band, 0, 1),
        np.clip(monte_carlo + band, 0, 1),
        step="post",
        color="grey",
        alpha=0.2,
        label=labels["band"],
    )
    ax.plot(t, federation, "o", color="tab:red", markersize=3.5, label=labels["fed"])
    ax.set_xlabel("t (queries)")
    ax.set_ylabel("P(T > t)")
    ax.set_xlim(0, t[-1])
    ax.set_ylim(-0.03, 1.05)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_filters_compare(tables: Mapping[str, Any], *, path: Path) -> str:
    """Rounds admitted by RRUV, FZ Thm 4.8 and GDP against the per-round cost, log-log, one panel per kind of round."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    pure = tables["pure"]
    gaussian = tables["gaussian"]
    names = (("rruv", "RRUV filter"), ("fz", "FZ DP filter (Thm 4.8)"), ("gdp", "GDP filter"))
    markers = {"rruv": "s", "fz": "o", "gdp": "^"}
    for key, label in names:
        xs = [r["epsilon_round"] for r in pure]
        ys = [r[key] for r in pure]
        _loglog(left, xs, ys, marker=markers[key], label=label)
        xs = [r["mu_round"] for r in gaussian]
        ys = [r[key]["rounds"] if isinstance(r[key], dict) else r[key] for r in gaussian]
        _loglog(right, xs, ys, marker=markers[key], label=label)
    left.set_xlabel("ε_t per round (pure DP)")
    right.set_xlabel("μ_t = 1/σ per round (Gaussian, sensitivity 1)")
    for ax in (left, right):
        ax.set_ylabel("rounds admitted")
        ax.grid(True, which="both", linewidth=0.3)
        ax.legend(fontsize=8)
    left.set_title("pure ε_t-DP rounds; GDP via μ_t = 2Φ⁻¹(e^ε/(1+e^ε))", fontsize=9)
    right.set_title("Gaussian rounds; RRUV with an (ε_t, δ_t) split", fontsize=9)
    fig.suptitle(
        f"FZ Sec. 4.3 at (ε, δ) = ({tables['epsilon']:g}, {tables['delta']:g}); zero rounds not drawn", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _loglog(ax: Any, xs: list[float], ys: list[int], *, marker: str, label: str) -> None:
    """Points with at least one round, on log axes (a log axis has no place for zero)."""
    kept = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
    ax.loglog([p[0] for p in kept], [p[1] for p in kept], marker=marker, markersize=4, label=label)
