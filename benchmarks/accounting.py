"""Benchmark: one vectorised filter update over 1,000,000 record units against a plain numpy
sum of squares over the same array, measured in this script (issue: aim for a ratio under 3).

The filter update is :func:`protocol.filters.charge` (check, charge, stop) given the units'
clipped norms. Baselines, over the same 1e6-element float64 array of norms:
  - ``np.square(x).sum()``: the plain numpy sum of squares;
  - ``x @ x``: the BLAS dot product, the fastest way numpy has (printed for honesty).
Also printed: the partial-clip bound computation that precedes a round.

Run: .venv/bin/python benchmarks/accounting.py [--units N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from protocol.filters import FilterState, GaussianFilter, charge, partial_clip


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    filt = GaussianFilter.gdp(epsilon=3.0, delta=1e-5)
    state = FilterState(spent=rng.uniform(0, filt.threshold * 0.9, args.units), stopped=rng.random(args.units) < 0.05)
    # A realistic round: each unit's norm is clipped to its partial-clip bound (0 once stopped).
    norms = np.minimum(rng.uniform(0, 1.0, args.units), partial_clip(filt, state, noise_std=10.0, l2_clip=1.0))

    (sq_best, sq_med) = best_of(lambda: np.square(norms).sum(), args.repeats)
    (dot_best, dot_med) = best_of(lambda: norms @ norms, args.repeats)
    (ch_best, ch_med) = best_of(lambda: charge(filt, state, noise_std=10.0, l2_norms=norms), args.repeats)
    (pc_best, pc_med) = best_of(lambda: partial_clip(filt, state, noise_std=10.0, l2_clip=1.0), args.repeats)

    print(f"units: {args.units:,}, repeats: {args.repeats} (best / median, ms)")
    print(f"  np.square(x).sum()     {sq_best * 1e3:8.3f} / {sq_med * 1e3:8.3f}")
    print(f"  x @ x (BLAS)           {dot_best * 1e3:8.3f} / {dot_med * 1e3:8.3f}")
    print(f"  filter charge          {ch_best * 1e3:8.3f} / {ch_med * 1e3:8.3f}")
    print(f"  partial-clip bounds    {pc_best * 1e3:8.3f} / {pc_med * 1e3:8.3f}")
    print(f"ratio charge / sum of squares (best): {ch_best / sq_best:.2f}   (median: {ch_med / sq_med:.2f})")
    print(f"ratio charge / BLAS dot (best):       {ch_best / dot_best:.2f}")
    print(f"ratio partial clip / sum of squares:  {pc_best / sq_best:.2f}")


if __name__ == "__main__":
    main()
