"""TVC Fig. 2 as the ``realisation-survival`` preset of ``fedfilter simulate``.

The survival function P(T > t) of the stopping time T of the additive, RRUV, Rényi and
realisation-level filters for i.i.d. Gaussian counting queries. The realisation-level curve
comes from a real federation: every client holds one record equal to 1, answers every counting
query with contribution 1 under its own realisation filter (local trust), and its stopping round
is read back from its ledger. A Monte-Carlo of the same filter, run directly on
:mod:`protocol.realisation`, is drawn beside it, and the two are compared with the
Dvoretzky-Kiefer-Wolfowitz bound.

The preset returns a :class:`simulations.presets.base.Plan` whose ``post`` step runs after the
federation: it reads the clients' ledgers, computes the accounting, writes ``survival.csv`` and
``survival.png`` into the output folder, and returns the entries
:func:`simulations.presets.run.simulate` adds to ``summary.json`` under ``reproduction``.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from protocol.comparisons import gaussian_rounds
from protocol.filters import GaussianFilter
from protocol.realisation import RealisationFilter, RealisationState, advance, decide, realised_loss
from simulations.errors import SimulationError
from simulations.presets.base import Options, Plan, halt_rounds, pick
from simulations.reproductions.counting import counting_federation, fixed_options

# TVC's Fig. 2 setting: Gaussian counting queries of sensitivity 1 with noise std 2, at most 48.
# The paper does not state its (epsilon, delta); at (8, 1e-5) the mechanism-level filters stop
# between 0 and 11 queries and the realisation filter's stopping time spreads over 1..48.
TVC_EPSILON, TVC_DELTA, TVC_NOISE_STD, TVC_MAX_ROUNDS = 8.0, 1e-5, 2.0, 48
TVC_CLIENTS = 200
MC_TRIALS = 100_000
DKW_ALPHA = 1e-3  # each of the two empirical curves is within its DKW radius with probability 1 - DKW_ALPHA


def survival(times: np.ndarray, horizon: int) -> np.ndarray:
    """The empirical survival function P(T > t) for t = 0..horizon."""
    t = np.asarray(times)
    return np.array([np.count_nonzero(t > s) / t.size for s in range(horizon + 1)])


def dkw_radius(n: int, alpha: float) -> float:
    """r with P(sup_t |F_n(t) - F(t)| > r) <= alpha: sqrt(log(2/alpha) / (2n)) (DKW inequality, Massart's constant)."""
    return math.sqrt(math.log(2.0 / alpha) / (2.0 * n))


def realisation_stopping_times(
    filt: RealisationFilter, *, noise_std: float, l2_clip: float, trials: int, rng: np.random.Generator
) -> np.ndarray:
    """Monte-Carlo of TVC's filter on i.i.d. full-norm queries: the number of queries each trial answers.

    Runs :func:`protocol.realisation.decide` / :func:`protocol.realisation.advance` on ``trials``
    units at once, each contributing ``l2_clip`` every query and releasing it with its own
    N(0, noise_std^2) noise, exactly as the client agent does (privacy.md §6).
    """
    state = RealisationState.fresh(filt, trials)
    answered = np.zeros(trials, dtype=np.int64)
    contribution = np.full((trials, 1), float(l2_clip))
    mu = np.full(trials, l2_clip / noise_std)
    for _ in range(filt.max_rounds):
        step = decide(filt, state, mu=mu)
        answered += step.participating
        noise = rng.normal(0.0, noise_std, (trials, 1))
        losses = realised_loss(contribution=contribution, noise=noise, noise_std=noise_std)
        state = advance(state, step, losses=np.where(step.participating, losses, 0.0))
    return answered


def mechanism_rounds(*, epsilon: float, delta: float, noise_std: float, l2_clip: float) -> dict[str, Any]:
    """Queries the additive, RRUV, Rényi (best order) and GDP filters admit (:mod:`protocol.comparisons`)."""
    table = gaussian_rounds(noise_std=noise_std, l2_clip=l2_clip, epsilon=epsilon, delta=delta, additive=True, rdp=True)
    return {
        "additive": table["additive"],
        "rruv": table["rruv"],
        "rdp": table["rdp"],
        "gdp": {"rounds": table["gdp"], "mu_budget": table["budgets"]["mu_budget"]},  # type: ignore[index]
    }


def realisation_survival(opts: Options, out: Path) -> Plan:
    """TVC Fig. 2: a federation of client units under the realisation filter, plus the mechanism filters."""
    fixed_options(opts, "realisation-survival", trust="local", unit="client", filter="realisation", clip=1.0)
    eps, delta = pick(opts.epsilon, TVC_EPSILON), pick(opts.delta, TVC_DELTA)
    sigma, clip = pick(opts.noise_std, TVC_NOISE_STD), 1.0
    n_max, clients = pick(opts.rounds, TVC_MAX_ROUNDS), pick(opts.clients, TVC_CLIENTS)
    filt = RealisationFilter.create(epsilon=eps, delta=delta, max_rounds=n_max, mu_max=clip / sigma)
    if not RealisationState.fresh(filt, 1).accepting[0]:
        # Checked before any client is written: the federation would answer nothing to plot.
        head = eps - float(filt.margin(0.0))
        raise SimulationError(
            f"--epsilon: at sigma = {sigma:g} and N = {n_max} the realisation filter accepts no query below "
            f"epsilon = {head:.4g}; got {eps:g}"
        )
    per, cfg = counting_federation(
        opts,
        out,
        "realisation-survival",
        clients=clients,
        rounds=n_max,
        noise_std=sigma,
        l2_clip=clip,
        epsilon=eps,
        delta=delta,
        filter="realisation",
        realisation_max_rounds=n_max,
        policy_max_clip=clip,  # mu_max = C / sigma: the cap every query of this run meets
        policy_min_noise_std=sigma,
    )
    worst = GaussianFilter.gdp(epsilon=eps, delta=delta).full_norm_rounds(noise_std=sigma, l2_clip=clip)
    notes = {"paper": "TVC Fig. 2", "trials": clients, "max_rounds": n_max}

    def post(summary: dict[str, Any], out: Path) -> dict[str, Any]:
        return survival_report(
            summary, out, per, filt=filt, noise_std=sigma, l2_clip=clip, seed=opts.seed, engine=opts.engine
        )

    return Plan(cfg, per, None, worst, notes, post=post)


def survival_report(
    summary: dict[str, Any],
    out: Path,
    clients: Mapping[int, Mapping[str, Any]],
    *,
    filt: RealisationFilter,
    noise_std: float,
    l2_clip: float,
    seed: int,
    engine: str,
    trials: int = MC_TRIALS,
) -> dict[str, Any]:
    """The survival curves, their agreement, ``survival.csv`` and ``survival.png`` (post-run step)."""
    from simulations.reproductions.plots import plot_survival

    started = time.monotonic()
    n_max = filt.max_rounds
    if summary["rounds_completed"] != n_max:
        raise SimulationError(
            f"realisation-survival: expected the federation to ask all {n_max} queries, "
            f"it asked {summary['rounds_completed']} ({summary['stopped_because']})"
        )
    fed_times = halt_rounds(clients)
    if np.any(fed_times < 1):
        raise SimulationError(
            "realisation-survival: a client's ledger holds no halt round after all queries were asked"
        )
    mc_seed = [seed, 1]  # a stream apart from every client's noise seed
    mc_times = realisation_stopping_times(
        filt, noise_std=noise_std, l2_clip=l2_clip, trials=trials, rng=np.random.default_rng(mc_seed)
    )
    mech = mechanism_rounds(epsilon=filt.epsilon, delta=filt.delta, noise_std=noise_std, l2_clip=l2_clip)
    stops = {name: min(int(entry["rounds"]), n_max) for name, entry in mech.items()}
    t = np.arange(n_max + 1)
    s_fed, s_mc = survival(fed_times, n_max), survival(mc_times, n_max)
    sup = float(np.max(np.abs(s_fed - s_mc)))
    fed_radius = dkw_radius(fed_times.size, DKW_ALPHA)
    tolerance = fed_radius + dkw_radius(mc_times.size, DKW_ALPHA)
    best = max(stops.values())
    curves = {name: (t < k).astype(float) for name, k in stops.items()}

    csv_path = out / "survival.csv"
    with csv_path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["t", *stops, "realisation_monte_carlo", "realisation_federation"])
        for i in t:
            writer.writerow([int(i), *(f"{curves[n][i]:g}" for n in stops), f"{s_mc[i]:.6f}", f"{s_fed[i]:.6f}"])
    mu = l2_clip / noise_std
    title = (
        f"TVC Fig. 2: (ε, δ) = ({filt.epsilon:g}, {filt.delta:g}), σ = {noise_std:g}, μ = {mu:g} per query, N = {n_max}"
    )
    png = plot_survival(
        t,
        curves,
        s_mc,
        s_fed,
        band=fed_radius,
        labels={
            "mc": f"realisation, Monte-Carlo ({mc_times.size:,} trials)",
            "fed": f"realisation, federation ({fed_times.size} clients, {engine})",
            "band": f"DKW band (alpha = {DKW_ALPHA:g}) for the\nfederation's curve, around the Monte-Carlo",
        },
        title=title,
        path=out / "survival.png",
    )
    fed_median, mc_median = float(np.median(fed_times)), float(np.median(mc_times))
    p_max, p_beyond = float(np.mean(mc_times == n_max)), float(np.mean(mc_times > best))
    agrees = sup <= tolerance
    report: dict[str, Any] = {
        "paper": "TVC Fig. 2 (Taylor, Vippathalla & Coon, Realisation-Level Privacy Filtering)",
        "parameters": {
            "epsilon": filt.epsilon,
            "delta": filt.delta,
            "noise_std": noise_std,
            "l2_clip": l2_clip,
            "mu_per_query": mu,
            "max_rounds": n_max,
            "realisation_filter": {**filt.describe(), "kappa": filt.kappa(mu=mu)},
        },
        "mechanism_filters": mech,
        "mechanism_stops": stops,
        "federation": {
            "clients": int(fed_times.size),
            "engine": engine,
            "noise_seed": seed,
            "stopping_times": fed_times.tolist(),
            "median": fed_median,
            "survival": s_fed.tolist(),
        },
        "monte_carlo": {
            "trials": int(mc_times.size),
            "seed": mc_seed,
            "median": mc_median,
            "quantiles": {str(q): float(np.quantile(mc_times, q)) for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
            "p_reaches_max_rounds": p_max,
            f"p_beyond_best_mechanism_stop_{best}": p_beyond,
            "survival": s_mc.tolist(),
        },
        "agreement": {
            "sup_distance": sup,
            "tolerance": tolerance,
            "rule": f"DKW: each empirical curve within sqrt(log(2/alpha)/(2n)) of the truth, alpha = {DKW_ALPHA:g}",
            "agrees": agrees,
        },
        "files": [str(csv_path), png],
        "plots": [png],
        "wall_s": time.monotonic() - started,
    }
    report["headline"] = [
        f"TVC Fig. 2 at (epsilon, delta) = ({filt.epsilon:g}, {filt.delta:g}), sigma = {noise_std:g} (mu = {mu:g} per "
        f"query), N = {n_max}: the mechanism-level filters stop after "
        + " / ".join(f"{name} {k}" for name, k in stops.items())
        + " queries.",
        f"Realisation-level filter: median stopping time {fed_median:g} over {fed_times.size} clients ({engine}), "
        f"{mc_median:g} over {mc_times.size:,} Monte-Carlo trials; P(T > {best}) = {p_beyond:.3f}, "
        f"P(T = {n_max}) = {p_max:.3f} (Monte-Carlo).",
        f"Federation against Monte-Carlo: sup_t |S_fed - S_mc| = {sup:.3f}, DKW tolerance {tolerance:.3f}: "
        + ("they agree." if agrees else "they DISAGREE."),
    ]
    return report
