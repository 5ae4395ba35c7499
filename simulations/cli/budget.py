"""``fedfilter budget``: the privacy calculator, each filter's budget and the full-norm rounds it allows."""

from __future__ import annotations

import argparse
import json

from protocol.validate import open_unit, positive, positive_int
from simulations.cli.arguments import Subparsers, number


def add_parser(sub: Subparsers) -> None:
    """``fedfilter budget``."""
    p = sub.add_parser(
        "budget",
        help="each filter's budget and the full-norm rounds it allows",
        description=(
            "Privacy calculator. For a target (epsilon, delta) per unit and Gaussian rounds of noise std S "
            "with clip C, prints each filter's budget and how many rounds at full norm it allows."
        ),
    )
    p.add_argument("--epsilon", type=number, required=True, help="target epsilon per unit (> 0)")
    p.add_argument("--delta", type=number, required=True, help="target delta per unit, in (0, 1)")
    p.add_argument("--noise-std", type=number, required=True, help="Gaussian noise std per round (> 0)")
    p.add_argument("--clip", type=number, required=True, help="L2 clip norm C (> 0)")
    p.add_argument("--max-rounds", type=int, default=None, help="N, for the realisation-level filter (TVC)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # Validate under the names the user typed, so the error names the argument.
    positive("--epsilon", args.epsilon)
    open_unit("--delta", args.delta)
    positive("--noise-std", args.noise_std)
    positive("--clip", args.clip)
    if args.max_rounds is not None:
        positive_int("--max-rounds", args.max_rounds)
    from protocol.budget import budget_report  # scipy: loaded when the command runs, not to build the parser

    report = budget_report(
        epsilon=args.epsilon,
        delta=args.delta,
        noise_std=args.noise_std,
        l2_clip=args.clip,
        max_rounds=args.max_rounds,
    )
    if args.json:
        print(json.dumps(report))
        return 0
    filters = report["filters"]
    assert isinstance(filters, dict)
    mu = args.clip / args.noise_std
    print(f"target ({args.epsilon:g}, {args.delta:g})-DP per unit; Gaussian rounds with noise std {args.noise_std:g},")
    print(f"clip {args.clip:g}: sensitivity mu = {mu:.6g} per full-norm round")
    print()
    print(f"{'filter':<34}{'budget':>22}{'full-norm rounds':>18}")
    rows = [
        ("GDP (default)", f"mu_B = {filters['gdp']['mu_budget']:.6f}", filters["gdp"]["rounds"]),
        ("zCDP, CKS conversion", f"rho_B = {filters['zcdp_cks']['rho_budget']:.6f}", filters["zcdp_cks"]["rounds"]),
        (
            "zCDP, BS conversion (FZ Thm 4.8)",
            f"rho_B = {filters['zcdp_bs']['rho_budget']:.6f}",
            filters["zcdp_bs"]["rounds"],
        ),
        ("Rényi, best order fixed in advance", f"order = {filters['rdp']['order']:.4f}", filters["rdp"]["rounds"]),
    ]
    for name, budget, rounds in rows:
        print(f"{name:<34}{budget:>22}{rounds:>18}")
    if "realisation" in filters:
        r = filters["realisation"]
        print()
        print(
            f"realisation-level filter (TVC), N = {r['max_rounds']}: continue while |L| <= kappa = {r['kappa']:.6f} "
            f"(delta~ = {r['delta_tilde']:.3g}, theta = {r['theta']:.3g})"
        )
        from protocol.realisation import RealisationFilter, RealisationState

        real = RealisationFilter.create(
            epsilon=args.epsilon, delta=args.delta, max_rounds=r["max_rounds"], mu_max=args.clip / args.noise_std
        )
        if not RealisationState.fresh(real, 1).accepting[0]:
            print("  at this sigma and (epsilon, delta) the realisation filter accepts no request at all")
        elif r["kappa"] <= 0:
            print("  kappa <= 0: at this sigma and (epsilon, delta) the realisation filter stops after one request")
    print()
    print("Units whose realised contributions are smaller than C keep going after these rounds (FZ Prop. 5.1).")
    return 0
