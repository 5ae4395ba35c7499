"""``fedfilter ledger report``: the owner's figures (PNG) and one self-contained HTML page.

Figures, from one replay of the ledger (:func:`client_agent.ledger_report.ledger_timeline`):

- ``spend_share.png``: quantiles (min, 10%, 50%, 90%, max) over units of the share of the budget T spent,
  after each request;
- ``epsilon.png``: the same quantiles of the odometer's epsilon at the ledger's delta
  (:mod:`client_agent.odometer`: a bound valid at any stopping time), Gaussian filters only;
- ``units_stopped.png``: units stopped (globally) after each request, and each federation's stops now;
- ``spend_by_federation.png``: each federation's and each run's spend (mean and max share of T).

``report.html`` embeds them (base64) with the ledger's summary and its most recent requests: one file,
no scripts, no external links. Run ids and request ids are the senders' strings: they are escaped
everywhere (HTML, and matplotlib's mathtext in labels). Plotting style as :mod:`simulations.plots`.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from client_agent.ledger_report import QUANTILES, Timeline, ledger_summary, ledger_timeline

RECENT_REQUESTS = 100  # rows of the HTML page's request table (``fedfilter ledger requests`` lists them all)
MAX_RUNS = 25  # runs shown in the by-run panel (the largest by mean share)
_LABEL_CHARS = 40


def printable(text: str) -> str:
    """``text`` with non-printable characters escaped (a sender's id may hold control characters)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _label(text: str) -> str:
    """A sender's string as a matplotlib label: printable, shortened, and never read as mathtext."""
    shown = printable(text)
    if len(shown) > _LABEL_CHARS:
        shown = shown[: _LABEL_CHARS - 1] + "…"
    return shown.replace("$", r"\$")


def write_report(path: Path, out: Path) -> list[Path]:
    """Write the figures and ``report.html`` under ``out`` (created if needed); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    summary = ledger_summary(path)
    timeline = ledger_timeline(path)
    written: list[Path] = []
    figures = [
        ("spend_share.png", _spend_share(timeline, summary)),
        *([("epsilon.png", _epsilon(timeline, summary))] if summary["odometer"] is not None else []),
        ("units_stopped.png", _units_stopped(timeline, summary)),
        ("spend_by_federation.png", _by_federation(timeline, summary)),
    ]
    for name, fig in figures:
        target = out / name
        fig.savefig(target, dpi=120)
        plt.close(fig)
        written.append(target)
    page = out / "report.html"
    page.write_text(_html(path, summary, timeline, written), encoding="utf-8")
    written.append(page)
    return written


# --------------------------------------------------------------------------- figures


def _time_axis(ax: Axes, timeline: Timeline) -> None:
    """Request seq below; the commit time (UTC) of a few requests on a second axis above."""
    ax.set_xlabel("request (commit order in the ledger)")
    if not timeline.seq:
        return
    picks = sorted({int(i) for i in np.linspace(0, len(timeline.seq) - 1, min(5, len(timeline.seq)))})
    top = ax.secondary_xaxis("top")
    top.set_xticks(
        [timeline.seq[i] for i in picks], labels=[timeline.time[i].strftime("%m-%d %H:%M:%S") for i in picks]
    )
    top.tick_params(labelsize=7)
    top.set_xlabel("time (UTC)", fontsize=8)


def _quantile_bands(ax: Axes, timeline: Timeline, values: Sequence[Sequence[float]], what: str) -> None:
    q = np.asarray(values, dtype=np.float64).reshape(-1, len(QUANTILES))
    x = np.asarray(timeline.seq)
    ax.fill_between(x, q[:, 0], q[:, 4], step="post", alpha=0.18, color="C0", label=f"{what}: min to max")
    ax.fill_between(x, q[:, 1], q[:, 3], step="post", alpha=0.35, color="C0", label=f"{what}: 10% to 90%")
    ax.step(x, q[:, 2], where="post", color="C0", label=f"{what}: median")
    ax.step(x, q[:, 4], where="post", color="C3", linewidth=0.8, label=f"{what}: max (worst unit)")


def _empty(ax: Axes, timeline: Timeline) -> bool:
    if timeline.seq:
        return False
    ax.text(0.5, 0.5, "no request answered yet", ha="center", va="center", transform=ax.transAxes)
    return True


def _spend_share(timeline: Timeline, summary: dict[str, Any]) -> Figure:
    fig, ax = plt.subplots(figsize=(7, 4))
    if not _empty(ax, timeline):
        _quantile_bands(ax, timeline, timeline.share_quantiles, "share of T")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8, label="budget T: a unit stops here")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of each unit's budget T spent")
    ax.set_title(f"Per-unit spend over time ({summary['units_total']} {summary['unit']} units)", fontsize=10)
    _time_axis(ax, timeline)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    return fig


def _epsilon(timeline: Timeline, summary: dict[str, Any]) -> Figure:
    odometer = summary["odometer"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if not _empty(ax, timeline):
        _quantile_bands(ax, timeline, timeline.epsilon_quantiles, "ε so far")
    full = float(odometer["epsilon_at_full_budget"])
    target = float(odometer["filter_epsilon"])
    ax.axhline(full, color="C3", linestyle="--", linewidth=0.8, label=f"odometer at the full budget: ε = {full:.3g}")
    ax.axhline(target, color="grey", linestyle=":", linewidth=0.8, label=f"filter's target ε = {target:.3g}")
    ax.set_ylim(0, 1.08 * max(full, target))
    ax.set_ylabel(f"ε spent so far at δ = {summary['delta']:g}")
    ax.set_title("Privacy odometer: ε so far per unit (valid whenever one stops)", fontsize=10)
    _time_axis(ax, timeline)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    return fig


def _units_stopped(timeline: Timeline, summary: dict[str, Any]) -> Figure:
    fig, ax = plt.subplots(figsize=(7, 4))
    total = int(summary["units_total"])
    if not _empty(ax, timeline):
        ax.step(timeline.seq, timeline.stopped, where="post", color="C0", label="units stopped (global budget)")
        last = timeline.seq[-1]
        for i, fed in enumerate(summary["federations"]):
            ax.plot(
                [last],
                [fed["units_stopped"]],
                marker="o",
                linestyle="none",
                color=f"C{(i + 1) % 10}",
                label=f"stopped for federation {_label(fed['federation'])} now: {fed['units_stopped']}",
            )
    ax.axhline(total, color="grey", linestyle="--", linewidth=0.8, label=f"all {total} units")
    ax.set_ylim(0, total * 1.08)
    ax.set_ylabel("units stopped")
    ax.set_title("Units stopped over time", fontsize=10)
    _time_axis(ax, timeline)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    return fig


def _by_federation(timeline: Timeline, summary: dict[str, Any]) -> Figure:
    threshold = float(summary["threshold"])
    runs = sorted(timeline.by_run.items(), key=lambda kv: -float(kv[1].mean()))[:MAX_RUNS]
    feds = summary["federations"]
    height = max(3.6, 1.2 + 0.28 * max(len(runs), len(feds)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, height), gridspec_kw={"width_ratios": [1, 1.6]})
    width = 0.38
    x = np.arange(len(feds))
    left.bar(x - width / 2, [f["share_mean"] for f in feds], width, color="C0", label="mean over units")
    left.bar(x + width / 2, [f["share_max"] for f in feds], width, color="C3", label="max over units (worst unit)")
    left.set_xticks(x, labels=[_label(f["federation"]) for f in feds], rotation=20, ha="right", fontsize=8)
    left.set_ylabel("share of each unit's budget T spent")
    left.set_title("By federation (its quota's spend)", fontsize=10)
    left.set_ylim(0, 1.05)
    left.legend(loc="upper left", fontsize=7)
    y = np.arange(len(runs))
    mean = [float(v.mean()) / threshold for _, v in runs]
    worst = [float(v.max()) / threshold for _, v in runs]
    right.barh(y - width / 2, mean, width, color="C0", label="mean over units")
    right.barh(y + width / 2, worst, width, color="C3", label="max over units")
    labels = [f"{_label(f)} / {_label(r)} ({timeline.requests_by_run[(f, r)]} req.)" for (f, r), _ in runs]
    right.set_yticks(y, labels=labels, fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("share of each unit's budget T spent by the run's releases")
    shown = "" if len(timeline.by_run) <= MAX_RUNS else f" (the {MAX_RUNS} largest of {len(timeline.by_run)})"
    right.set_title(f"By run: federation / run id{shown}", fontsize=10)
    right.set_xlim(0, 1.05)
    right.legend(loc="lower right", fontsize=7)
    if not runs:
        right.text(0.5, 0.5, "no release charged yet", ha="center", va="center", transform=right.transAxes)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- the page


def _table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    thead = f"<thead><tr>{head}</tr></thead>" if any(header) else ""
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(printable(_cell(c)))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def _cell(value: object) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


_CAPTIONS = {
    "spend_share.png": "Share of each unit's budget T spent after each request: the band is min to max over "
    "units, the darker band 10% to 90%, the line the median; the red line is the worst unit.",
    "epsilon.png": "The privacy odometer's ε after each request, at the ledger's δ: for each unit, the ε of the "
    "smallest of a ladder of filters fixed in advance whose budget covers its spend (Lécuyer 2021; Whitehouse, "
    "Ramdas, Rogers & Wu 2023), valid at whatever time one stops. It is a little above the filter's own "
    "conversion, which holds only for a budget fixed in advance.",
    "units_stopped.png": "Units the global filter has stopped after each request; the dots are the units each "
    "federation may no longer draw on now (its quota's stops and the global ones).",
    "spend_by_federation.png": "What each federation's releases (its quota state) and each run's releases took of "
    "every unit's budget T: mean and worst unit.",
}


def _html(path: Path, summary: dict[str, Any], timeline: Timeline, figures: Sequence[Path]) -> str:
    odometer = summary["odometer"]
    units = f"{summary['units_total']} ({summary['units_active']} / {summary['units_exhausted']})"
    share_max, share_mean = summary["spent_max"] / summary["threshold"], summary["spent_mean"] / summary["threshold"]
    facts: list[tuple[str, object]] = [
        ("ledger", str(path)),
        ("filter", summary["filter"]),
        ("target (ε, δ)", f"({summary['epsilon']:g}, {summary['delta']:g})"),
        ("unit / trust", f"{summary['unit']} / {summary['trust']}"),
        ("units (active / stopped)", units),
        ("threshold T", summary["threshold"]),
        ("spend: max / mean share of T", f"{share_max:.4g} / {share_mean:.4g}"),
        ("requests answered", summary["requests_answered"]),
    ]
    if odometer is not None:
        facts.append(("odometer at the full budget", f"ε = {odometer['epsilon_at_full_budget']:.4g}"))
        facts.append(("odometer levels", f"{odometer['levels']}, budget ratio {odometer['ratio']:.4g}, δ/2^(k+1)"))
    sections = []
    for figure in figures:
        data = base64.b64encode(figure.read_bytes()).decode("ascii")
        caption = html.escape(_CAPTIONS.get(figure.name, figure.name))
        sections.append(
            f'<figure><img alt="{html.escape(figure.name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{caption}</figcaption></figure>"
        )
    feds = [
        (f["federation"], f["requests"], f["share_mean"], f["share_max"], f["units_stopped"], f["source"])
        for f in summary["federations"]
    ]
    threshold = float(summary["threshold"])
    runs = [
        (fed, run, timeline.requests_by_run[(fed, run)], float(v.mean()) / threshold, float(v.max()) / threshold)
        for (fed, run), v in sorted(timeline.by_run.items(), key=lambda kv: -float(kv[1].mean()))
    ]
    recent = [
        (
            r["seq"],
            r["time"],
            r["federation"],
            r["run_id"],
            r["request_id"],
            r["round"],
            r["kind"],
            r["noise_std"],
            r["units_charged"],
            r["cost_max_share"],
            r["cost_mean_share"],
            r["units_newly_stopped"],
            r["reply_bytes"],
        )
        for r in reversed(timeline.requests[-RECENT_REQUESTS:])
    ]
    request_header = [
        "seq", "time (UTC)", "federation", "run", "request", "round", "kind", "noise std", "units charged",
        "cost max / T", "cost mean / T", "newly stopped", "reply bytes",
    ]  # fmt: skip
    generated = datetime.now(UTC).isoformat(timespec="seconds")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fedfilter ledger report</title>
<style>
body {{ font-family: sans-serif; max-width: 1100px; margin: 1em auto; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 2px 6px; text-align: left; }}
th {{ background: #f2f2f2; }}
img {{ max-width: 100%; }}
figcaption {{ font-size: 0.85em; color: #555; margin-bottom: 1.5em; }}
</style></head><body>
<h1>fedfilter ledger report</h1>
<p>Generated {html.escape(generated)} from the ledger itself (read only; nothing was sent anywhere).</p>
{_table(facts, ["", ""])}
<h2>Figures</h2>
{"".join(sections)}
<h2>Federations</h2>
{_table(feds, ["federation", "requests", "mean share of T", "max share of T", "units stopped for it", "from"])}
<h2>Runs</h2>
{_table(runs, ["federation", "run", "requests", "mean share of T", "max share of T"])}
<h2>Most recent requests (newest first, at most {RECENT_REQUESTS})</h2>
{_table(recent, request_header)}
</body></html>
"""
