"""Benchmark: one vectorised filter update over 1,000,000 record units against a plain numpy
sum of squares over the same array, measured in this script (issue 24: at most 3x).

The filter update is :func:`protocol.filters.charge` (check, charge, stop) given the units'
clipped norms: the compiled pass (protocol/fused_charge.py) when numba is installed
(``fedfilter[fast]``), and numpy's blocked path (``FEDFILTER_FUSED_CHARGE=0``), both timed.
Baselines, over the same 1e6-element float64 array of norms:
  - ``np.square(x).sum()``: the plain numpy sum of squares (the ratio's denominator);
  - ``x @ x``: the BLAS dot product, the fastest way numpy has (printed for honesty).
Also printed: the partial-clip bound computation that precedes a round.

The candidates run interleaved, one call each per repeat, so drift in the machine's speed
and in what the caches hold touches them alike; each figure is the best and the median over
the repeats. The last line is ``accounting_ratio=<charge / sum of squares, best>`` for the path ``charge``
takes here (the compiled one when numba is installed).

Run: .venv/bin/python benchmarks/accounting.py [--units N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from protocol.filters import FilterState, GaussianFilter, _fused_kernel, charge, partial_clip


def interleaved(candidates: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    filt = GaussianFilter.gdp(epsilon=3.0, delta=1e-5)
    state = FilterState(spent=rng.uniform(0, filt.threshold * 0.9, args.units), stopped=rng.random(args.units) < 0.05)
    # A realistic round: each unit's norm is clipped to its partial-clip bound (0 once stopped).
    norms = np.minimum(rng.uniform(0, 1.0, args.units), partial_clip(filt, state, noise_std=10.0, l2_clip=1.0))

    fused = _fused_kernel() is not None
    if fused:
        charge(filt, state, noise_std=10.0, l2_norms=norms)  # compiled (or loaded from numba's cache) once

    def numpy_charge() -> object:
        os.environ["FEDFILTER_FUSED_CHARGE"] = "0"
        try:
            return charge(filt, state, noise_std=10.0, l2_norms=norms)
        finally:
            os.environ.pop("FEDFILTER_FUSED_CHARGE")

    candidates: dict[str, Callable[[], object]] = {
        "np.square(x).sum()": lambda: np.square(norms).sum(),
        "x @ x (BLAS)": lambda: norms @ norms,
        "filter charge": lambda: charge(filt, state, noise_std=10.0, l2_norms=norms),
        "charge, numpy path": numpy_charge,
        "partial-clip bounds": lambda: partial_clip(filt, state, noise_std=10.0, l2_clip=1.0),
    }
    if not fused:
        del candidates["charge, numpy path"]
    times = interleaved(candidates, args.repeats)
    best = {name: min(ts) for name, ts in times.items()}
    median = {name: statistics.median(ts) for name, ts in times.items()}
    path = "compiled (numba)" if fused else "numpy (numba not installed)"
    print(f"units: {args.units:,}, repeats: {args.repeats}, interleaved (best / median, ms); charge: {path}")
    for name in times:
        print(f"  {name:22s} {best[name] * 1e3:8.3f} / {median[name] * 1e3:8.3f}")
    base, base_med = best["np.square(x).sum()"], median["np.square(x).sum()"]
    ratio = best["filter charge"] / base
    print(f"ratio charge / sum of squares (best): {ratio:.2f}   (median: {median['filter charge'] / base_med:.2f})")
    print(f"ratio charge / BLAS dot (best):       {best['filter charge'] / best['x @ x (BLAS)']:.2f}")
    if fused:
        print(f"ratio numpy path / sum of squares:    {best['charge, numpy path'] / base:.2f}")
    print(f"ratio partial clip / sum of squares:  {best['partial-clip bounds'] / base:.2f}")
    print(f"accounting_ratio={ratio:.2f}")


if __name__ == "__main__":
    main()
