"""``fedfilter reproduce``: paper reproductions that take long (:mod:`simulations.reproductions.fz_sec51`)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from simulations.cli.arguments import Subparsers
from simulations.errors import SimulationError
from simulations.reproductions.fz_sec51 import (
    DEFAULT_RESULTS,
    EPSILONS,
    METHODS,
    REGIMES,
    append_result,
    cell,
    load_results,
    plot_accuracy,
    plot_fig1,
    run_trial,
    table_markdown,
)

log = logging.getLogger(__name__)


def add_parser(sub: Subparsers) -> None:
    """``fedfilter reproduce fz-mnist`` (run trials, append them) and ``fedfilter reproduce fz-mnist-report``."""
    p = sub.add_parser(
        "reproduce",
        help="paper reproductions that take long (FZ Sec. 5.1 table and Fig. 1 on MNIST)",
        description="Long reproductions; each finished trial is appended to a results file.",
    )
    rsub = p.add_subparsers(dest="reproduction", required=True)
    run = rsub.add_parser(
        "fz-mnist",
        help="trials of one or more cells of FZ's Sec. 5.1 table (10 silos, Flower simulation engine)",
        description=(
            "Private GD against GD with individual filtering on MNIST (FZ Sec. 5.1). Each trial is a federation of "
            "10 silos x 6,000 records; about 20 s per step on 2 CPU cores. Results are appended to --results."
        ),
    )
    run.add_argument("--epsilon", type=float, nargs="+", default=list(EPSILONS), help="default: 0.3 0.5 1.0")
    run.add_argument("--regime", nargs="+", default=["suboptimal"], choices=REGIMES, help="default: suboptimal")
    run.add_argument("--method", nargs="+", default=list(METHODS), choices=METHODS, help="default: gd renyi gdp")
    run.add_argument("--trials", type=int, default=1, help="trials per cell (seeds --seed, --seed+1, ...)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help=f"JSON lines file (default {DEFAULT_RESULTS})"
    )
    run.add_argument("--out", type=Path, default=Path("fedfilter-out/fz-mnist"), help="trial folders go here")
    run.add_argument("--data-dir", type=Path, help="folder with the MNIST IDX files")
    run.add_argument("--engine", default="flower", choices=["flower", "inprocess"])
    run.set_defaults(handler=run_cells)
    rep = rsub.add_parser(
        "fz-mnist-report", help="the table (markdown), Fig. 1 and accuracy against step (PNG) from the results file"
    )
    rep.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    rep.add_argument("--fig", type=Path, default=Path("docs/img/fz_fig1_active.png"))
    rep.add_argument("--accuracy-fig", type=Path, default=Path("docs/img/fz_sec51_accuracy.png"))
    rep.set_defaults(handler=run_report)


def run_cells(args: argparse.Namespace) -> int:
    """Run the trials of every cell asked for, appending each to ``--results`` as it finishes."""
    if args.trials < 1:
        raise SimulationError(f"--trials: expected an integer >= 1, got {args.trials}")
    cells = [cell(e, r, m) for r in args.regime for e in args.epsilon for m in args.method]
    # Before hours of training: the results file must be readable and writable, or say why now.
    load_results(args.results)
    try:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        with args.results.open("a"):
            pass
    except OSError as exc:
        raise SimulationError(f"--results: expected a writable JSON lines file, got {args.results}: {exc}") from exc
    for k in range(args.trials):
        seed = args.seed + k
        for c in cells:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
            out = args.out / f"eps{c.epsilon}-{c.regime}-{c.method}-seed{seed}-{stamp}"
            log.info(
                "fz-mnist: eps=%s %s %s: %d steps, C=%g, sigma=%.3f, lr=%g, seed %d -> %s",
                *(c.epsilon, c.regime, c.method, c.steps, c.clip, c.noise_std, c.learning_rate, seed, out),
            )
            record = run_trial(c, seed=seed, out=out, data_dir=args.data_dir, engine=args.engine)
            append_result(args.results, record)
            log.info(
                "fz-mnist: test accuracy %.2f%% after %d steps (%.0f s); appended to %s",
                *(100 * record["final_accuracy"], record["rounds_completed"], record["wall_s"], args.results),
            )
    return 0


def run_report(args: argparse.Namespace) -> int:
    """The table (markdown, printed) and the figures (PNG) from ``--results``."""
    rows = load_results(args.results)
    print(table_markdown(rows))
    fig = plot_fig1(rows, args.fig)
    acc = plot_accuracy(rows, args.accuracy_fig)
    print(f"\n{len(rows)} trials in {args.results}; Fig. 1: {fig if fig else 'no filtered run at eps 0.3/0.5 yet'}")
    print(f"accuracy against step: {acc if acc else 'no full-scale trial yet'}")
    return 0
