"""FZ Sec. 4.3 as the ``filters-compare`` preset of ``fedfilter simulate``.

Rounds admitted by RRUV, FZ's DP filter (Thm 4.8) and the GDP filter over a grid of per-round
costs, for pure eps_t-DP rounds and for Gaussian rounds (:mod:`protocol.comparisons`). The
federation is a cross-check: clients at full norm under the GDP filter at one grid point must
take exactly the number of full-norm rounds the table says. The plan's ``post`` step writes
``filters_compare.{csv,json,png}`` and returns the entries added to ``summary.json``.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from client_agent.ledger import Ledger
from client_agent.records import contribution_from_arrays
from client_agent.state import AgentState
from protocol.comparisons import gaussian_rounds, pure_rounds
from protocol.filters import EXHAUSTED_FRACTION, GaussianFilter
from simulations.errors import SimulationError
from simulations.presets.base import Options, Plan, pick
from simulations.reproductions.counting import counting_federation, fixed_options

# (3, 1e-5): the reference row of privacy.md §3 (GDP 51 / zCDP-BS 34 rounds at sigma = 10).
FZ_EPSILON, FZ_DELTA = 3.0, 1e-5
PURE_EPSILONS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
NOISE_STDS: tuple[float, ...] = (1.0, 2.0, 3.0, 5.0, 7.0, 10.0, 20.0, 30.0, 50.0, 70.0, 100.0)
CROSS_CHECK_NOISE_STD, CROSS_CHECK_CLIENTS = 10.0, 4


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
            records = [contribution_from_arrays(rel) for _, _, rel in ledger.releases()]
            norms = np.array([float(r.l2_norms[0]) for r in records if r is not None and r.kind == "indicator"])
            state = AgentState.from_arrays(ledger.state())
            threshold = float(ledger.config.params["filter"]["threshold"])  # type: ignore[index]
        full = norms >= l2_clip * (1.0 - 1e-6)  # clipping leaves a full-norm unit within 64 float32 ulps of C
        partial = norms[(norms > 0) & ~full]
        rows.append(
            {
                "full_norm_rounds": int(np.count_nonzero(full)),
                "partial_norms": partial.tolist(),
                "halt_round": int(state.halt_round[0]),
                "spent": float(state.filter_state().spent[0]),
                "threshold": threshold,
            }
        )
    return rows


def filters_compare(opts: Options, out: Path) -> Plan:
    """FZ Sec. 4.3's comparison tables, with a GDP federation at one Gaussian grid point as a cross-check."""
    fixed_options(opts, "filters-compare", trust="local", unit="client", filter="gdp", clip=1.0)
    eps, delta = pick(opts.epsilon, FZ_EPSILON), pick(opts.delta, FZ_DELTA)
    sigma, clip = pick(opts.noise_std, CROSS_CHECK_NOISE_STD), 1.0
    clients = pick(opts.clients, CROSS_CHECK_CLIENTS)
    filt = GaussianFilter.gdp(epsilon=eps, delta=delta)
    expected = filt.full_norm_rounds(noise_std=sigma, l2_clip=clip)
    rounds = pick(opts.rounds, expected + 2)
    if rounds < expected + 1:
        raise SimulationError(
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
    from simulations.reproductions.plots import plot_filters_compare

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
