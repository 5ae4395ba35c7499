"""Paper reproductions as ``fedfilter simulate`` presets: TVC Fig. 2 and FZ Sec. 4.3.

- ``realisation-survival`` (TVC Fig. 2): the survival function P(T > t) of the stopping time T
  of the additive, RRUV, Rényi and realisation-level filters for i.i.d. Gaussian counting
  queries. The realisation-level curve comes from a real federation: every client holds one
  record equal to 1, answers every counting query with contribution 1 under its own
  realisation filter (local trust), and its stopping round is read back from its ledger. A
  Monte-Carlo of the same filter, run directly on :mod:`protocol.realisation`, is drawn beside
  it, and the two are compared with the Dvoretzky-Kiefer-Wolfowitz bound.
- ``filters-compare`` (FZ Sec. 4.3): rounds admitted by RRUV, FZ's DP filter (Thm 4.8) and the
  GDP filter over a grid of per-round costs, for pure eps_t-DP rounds and for Gaussian rounds
  (:mod:`protocol.comparisons`). The federation is a cross-check: clients at full norm under the
  GDP filter at one grid point must take exactly the number of full-norm rounds the table says.

Each preset returns a :class:`simulations.simulate.Plan` whose ``post`` step runs after the
federation: it reads the clients' ledgers, computes the accounting, writes CSV/JSON tables and
a PNG into the output folder, and returns the entries :func:`simulations.simulate.simulate`
adds to ``summary.json`` under ``reproduction``.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from protocol.comparisons import gaussian_rounds, pure_rounds
from protocol.filters import EXHAUSTED_FRACTION, GaussianFilter
from protocol.realisation import RealisationFilter, RealisationState, advance, decide, realised_loss
from simulations.federation import write_clients

if TYPE_CHECKING:
    from simulations.simulate import Options, Plan

# --- realisation-survival (TVC Fig. 2) ------------------------------------------------------

# TVC's Fig. 2 setting: Gaussian counting queries of sensitivity 1 with noise std 2, at most 48.
# The paper does not state its (epsilon, delta); at (8, 1e-5) the mechanism-level filters stop
# between 0 and 11 queries and the realisation filter's stopping time spreads over 1..48.
TVC_EPSILON, TVC_DELTA, TVC_NOISE_STD, TVC_MAX_ROUNDS = 8.0, 1e-5, 2.0, 48
TVC_CLIENTS = 200
MC_TRIALS = 100_000
DKW_ALPHA = 1e-3  # each of the two empirical curves is within its DKW radius with probability 1 - DKW_ALPHA

# --- filters-compare (FZ Sec. 4.3) ----------------------------------------------------------

# (3, 1e-5): the reference row of privacy.md §3 (GDP 51 / zCDP-BS 34 rounds at sigma = 10).
FZ_EPSILON, FZ_DELTA = 3.0, 1e-5
PURE_EPSILONS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
NOISE_STDS: tuple[float, ...] = (1.0, 2.0, 3.0, 5.0, 7.0, 10.0, 20.0, 30.0, 50.0, 70.0, 100.0)
CROSS_CHECK_NOISE_STD, CROSS_CHECK_CLIENTS = 10.0, 4


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _fixed(opts: Options, preset: str, **fixed: object) -> None:
    """Refuse command-line choices a preset fixes (its trust mode, unit, filter and the counting queries' clip 1)."""
    for name, value in fixed.items():
        given = getattr(opts, name)
        if given is not None and given != value:
            raise ValueError(f"--{name}: the {preset} preset runs with {name} {value!r}; got {given!r}")


def ones_parts(n_clients: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """One record per client with a single feature equal to 1: a counting query on column 0 counts it."""
    return [(np.ones((1, 1), dtype=np.float32), np.zeros(1, dtype=np.int64)) for _ in range(n_clients)]


def counting_config(
    *, clients: int, rounds: int, noise_std: float, l2_clip: float, run_id: str, out: Path, seed: int
) -> CoordinatorConfig:
    """Counting queries on column 0, every round, to client units in local trust (analyst 'cycle' over 1 column)."""
    return CoordinatorConfig(
        num_nodes=clients,
        n_public=clients,
        rounds=rounds,
        noise_std=noise_std,
        l2_clip=l2_clip,
        task="indicator",
        trust="local",
        unit="client",
        analyst="cycle",
        query_columns=1,
        seed=seed,
        run_id=run_id,
        output_dir=str(out),
        noise_seed=seed,
        round_timeout=600.0,
    )


def counting_federation(
    opts: Options, out: Path, preset: str, *, clients: int, rounds: int, noise_std: float, l2_clip: float, **agent: Any
) -> tuple[dict[int, dict[str, Any]], CoordinatorConfig]:
    """The clients (one record equal to 1 each, client units, local trust) and the counting-query run config."""
    per = write_clients(
        out / "clients",
        ones_parts(clients),
        ledger_dir=out / "ledgers",
        unit="client",
        trust="local",
        noise_seed=opts.seed,
        **agent,
    )
    cfg = counting_config(
        clients=clients,
        rounds=rounds,
        noise_std=noise_std,
        l2_clip=l2_clip,
        run_id=f"{preset}-{opts.seed}",
        out=out,
        seed=opts.seed,
    )
    return per, cfg


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
    from simulations.simulate import Plan

    _fixed(opts, "realisation-survival", trust="local", unit="client", filter="realisation", clip=1.0)
    eps, delta = _pick(opts.epsilon, TVC_EPSILON), _pick(opts.delta, TVC_DELTA)
    sigma, clip = _pick(opts.noise_std, TVC_NOISE_STD), 1.0
    n_max, clients = _pick(opts.rounds, TVC_MAX_ROUNDS), _pick(opts.clients, TVC_CLIENTS)
    filt = RealisationFilter.create(epsilon=eps, delta=delta, max_rounds=n_max, mu_max=clip / sigma)
    if not RealisationState.fresh(filt, 1).accepting[0]:
        # Checked before any client is written: the federation would answer nothing to plot.
        head = eps - float(filt.margin(0.0))
        raise ValueError(
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
    from simulations.reproduction_plots import plot_survival
    from simulations.simulate import halt_rounds

    started = time.monotonic()
    n_max = filt.max_rounds
    if summary["rounds_completed"] != n_max:
        raise ValueError(
            f"realisation-survival: expected the federation to ask all {n_max} queries, "
            f"it asked {summary['rounds_completed']} ({summary['stopped_because']})"
        )
    fed_times = halt_rounds(clients)
    if np.any(fed_times < 1):
        raise ValueError("realisation-survival: a client's ledger holds no halt round after all queries were asked")
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


# --- filters-compare ---------------------------------------------------------------------------


def comparison_tables(*, epsilon: float, delta: float, extra_noise_std: tuple[float, ...] = ()) -> dict[str, Any]:
    """FZ Sec. 4.3's comparison over the grids: one row per per-round cost (:mod:`protocol.comparisons`)."""
    pure = [pure_rounds(epsilon_round=e, epsilon=epsilon, delta=delta) for e in PURE_EPSILONS]
    sigmas = sorted(set(NOISE_STDS) | set(extra_noise_std))
    gaussian = [gaussian_rounds(noise_std=s, l2_clip=1.0, epsilon=epsilon, delta=delta) for s in sigmas]
    return {"epsilon": epsilon, "delta": delta, "pure": pure, "gaussian": gaussian}


def write_comparison_csv(tables: Mapping[str, Any], path: Path) -> str:
    """One CSV for both grids: kind, per-round cost, and the rounds of RRUV, FZ Thm 4.8 and GDP."""
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            [
                "rounds_kind",
                "epsilon_round",
                "noise_std",
                "mu_round",
                "rruv",
                "fz_thm_4_8",
                "gdp",
                "rruv_epsilon_round",
                "rruv_delta_filter",
            ]
        )
        for row in tables["pure"]:
            writer.writerow(
                [
                    "pure",
                    row["epsilon_round"],
                    "",
                    f"{row['gdp_mu_round']:.6g}",
                    row["rruv"],
                    row["fz"],
                    row["gdp"],
                    "",
                    "",
                ]
            )
        for row in tables["gaussian"]:
            rruv = row["rruv"]
            writer.writerow(
                [
                    "gaussian",
                    "",
                    row["noise_std"],
                    f"{row['mu_round']:.6g}",
                    rruv["rounds"],
                    row["fz"],
                    row["gdp"],
                    "" if rruv["epsilon_round"] is None else f"{rruv['epsilon_round']:.6g}",
                    "" if rruv["delta_filter"] is None else f"{rruv['delta_filter']:.3g}",
                ]
            )
    return str(path)


def full_norm_record(clients: Mapping[int, Mapping[str, Any]], *, l2_clip: float) -> list[dict[str, Any]]:
    """Per client, from its ledger: rounds at full norm, the partial round's norm, the halt round and the spend."""
    rows = []
    for node in clients.values():
        with Ledger.open_existing(Path(node["ledger-path"])) as ledger:
            releases = [rel for _, _, rel in ledger.releases() if str(rel["kind"]) == "indicator"]
            norms = np.array([float(rel["l2_norms"][0]) for rel in releases])
            state = ledger.state()
            threshold = float(ledger.config.params["filter"]["threshold"])  # type: ignore[index]
        full = norms >= l2_clip * (1.0 - 1e-6)  # clipping leaves a full-norm unit within 64 float32 ulps of C
        partial = norms[(norms > 0) & ~full]
        rows.append(
            {
                "full_norm_rounds": int(np.count_nonzero(full)),
                "partial_norms": partial.tolist(),
                "halt_round": int(state["halt_round"][0]),
                "spent": float(state["spent"][0]),
                "threshold": threshold,
            }
        )
    return rows


def filters_compare(opts: Options, out: Path) -> Plan:
    """FZ Sec. 4.3's comparison tables, with a GDP federation at one Gaussian grid point as a cross-check."""
    from simulations.simulate import Plan

    _fixed(opts, "filters-compare", trust="local", unit="client", filter="gdp", clip=1.0)
    eps, delta = _pick(opts.epsilon, FZ_EPSILON), _pick(opts.delta, FZ_DELTA)
    sigma, clip = _pick(opts.noise_std, CROSS_CHECK_NOISE_STD), 1.0
    clients = _pick(opts.clients, CROSS_CHECK_CLIENTS)
    filt = GaussianFilter.gdp(epsilon=eps, delta=delta)
    expected = filt.full_norm_rounds(noise_std=sigma, l2_clip=clip)
    rounds = _pick(opts.rounds, expected + 2)
    if rounds < expected + 1:
        raise ValueError(
            f"--rounds: expected at least {expected + 1} (the {expected} full-norm rounds the GDP filter admits at "
            f"sigma = {sigma:g}, and one more to see it stop), got {rounds}"
        )
    per, cfg = counting_federation(
        opts,
        out,
        "filters-compare",
        clients=clients,
        rounds=rounds,
        noise_std=sigma,
        l2_clip=clip,
        epsilon=eps,
        delta=delta,
        filter="gdp",
    )
    notes = {"paper": "FZ Sec. 4.3", "cross_check_noise_std": sigma}

    def post(summary: dict[str, Any], out: Path) -> dict[str, Any]:
        return comparison_report(out, per, epsilon=eps, delta=delta, noise_std=sigma, l2_clip=clip, filt=filt)

    return Plan(cfg, per, None, expected, notes, post=post)


def comparison_report(
    out: Path,
    clients: Mapping[int, Mapping[str, Any]],
    *,
    epsilon: float,
    delta: float,
    noise_std: float,
    l2_clip: float,
    filt: GaussianFilter,
) -> dict[str, Any]:
    """The tables, ``filters_compare.{csv,json,png}`` and the federation's cross-check (post-run step)."""
    from simulations.reproduction_plots import plot_filters_compare

    started = time.monotonic()
    tables = comparison_tables(epsilon=epsilon, delta=delta, extra_noise_std=(noise_std,))
    row = gaussian_rounds(noise_std=noise_std, l2_clip=l2_clip, epsilon=epsilon, delta=delta)
    expected = int(row["gdp"])  # type: ignore[call-overload]
    remainder = filt.threshold - expected * (l2_clip / noise_std) ** 2
    partial_expected = remainder > EXHAUSTED_FRACTION * filt.threshold
    observed = full_norm_record(clients, l2_clip=l2_clip)
    agrees = all(
        r["full_norm_rounds"] == expected
        and len(r["partial_norms"]) == int(partial_expected)
        and r["halt_round"] == expected + int(partial_expected)
        for r in observed
    )
    json_path = out / "filters_compare.json"
    json_path.write_text(json.dumps(tables, indent=1))
    csv_path = write_comparison_csv(tables, out / "filters_compare.csv")
    png = plot_filters_compare(tables, path=out / "filters_compare.png")
    pick_pure = [r for r in tables["pure"] if r["epsilon_round"] in (0.01, 0.1)]
    pick_gauss = [r for r in tables["gaussian"] if r["noise_std"] in (10.0, 100.0)]
    halts = sorted({r["halt_round"] for r in observed})
    report: dict[str, Any] = {
        "paper": "FZ Sec. 4.3 (Feldman & Zrnic, Individual Privacy Accounting via a Rényi Filter)",
        "parameters": {
            "epsilon": epsilon,
            "delta": delta,
            "pure_epsilons": list(PURE_EPSILONS),
            "noise_stds": list(NOISE_STDS),
        },
        "tables": tables,
        "cross_check": {
            "noise_std": noise_std,
            "l2_clip": l2_clip,
            "table_gdp_rounds": expected,
            "partial_round_expected": partial_expected,
            "clients": observed,
            "agrees": agrees,
        },
        "files": [str(json_path), csv_path, png],
        "plots": [png],
        "wall_s": time.monotonic() - started,
    }
    report["headline"] = [
        f"FZ Sec. 4.3 at (epsilon, delta) = ({epsilon:g}, {delta:g}); rounds admitted by RRUV / FZ Thm 4.8 / GDP:",
        *(f"  pure eps_t = {r['epsilon_round']:g}: {r['rruv']} / {r['fz']} / {r['gdp']}" for r in pick_pure),
        *(
            f"  Gaussian sigma = {r['noise_std']:g} (mu_t = {r['mu_round']:g}): "
            f"{r['rruv']['rounds']} / {r['fz']} / {r['gdp']}"
            for r in pick_gauss
        ),
        f"Cross-check, {len(observed)} clients at full norm under the GDP filter, sigma = {noise_std:g}: "
        f"{sorted({r['full_norm_rounds'] for r in observed})} full-norm rounds (table: {expected}), halted at round "
        f"{halts}: " + ("as the table says." if agrees else "MISMATCH with the table."),
    ]
    return report
