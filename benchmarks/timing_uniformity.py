"""Benchmark: does the release path's time depend on who stopped? (privacy.md §8)

Times, interleaved, the same computation over masks that say different things about the units
(none stopped / 5% / a random half / all), and prints each one's best time and the spread
(slowest mask's best / fastest mask's best). A masked numpy or torch primitive branches per
element, so its spread is large; the project's bitwise selections (protocol/branchless.py,
client_agent/layers/base.py) and the filter's charge should show a spread near 1 (what remains
is the machine's noise: compare with the spread of a mask-free operation, printed first).

Rows:
  - ``np.add`` (mask-free, the noise floor);
  - ``np.copyto(where=)``, ``np.where``, ``torch.where`` (the masked primitives);
  - ``branchless.select`` / ``or_zero`` and torch ``or_zero`` (their replacements);
  - ``filters.charge`` over --units units whose refused fraction follows the mask (the
    function every agent runs on every request: compiled when numba is installed and there are
    at least 65,536 units), its numpy path, and the agent's ``charge_with_quota``.

The last line is ``timing_spread_charge=<spread>`` (the charge's spread, issue 24 / privacy.md §8).

Run: .venv/bin/python benchmarks/timing_uniformity.py [--units N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from client_agent.agent import charge_with_quota
from client_agent.layers.base import or_zero as torch_or_zero
from protocol.branchless import or_zero, select
from protocol.filters import FilterState, GaussianFilter, charge

MASKS = ("none", "5%", "half", "all")


def masks(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "none": np.zeros(n, dtype=bool),
        "5%": rng.random(n) < 0.05,
        "half": rng.random(n) < 0.5,
        "all": np.ones(n, dtype=bool),
    }


def spread_of(make: Callable[[str], Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best time per mask over ``repeats`` interleaved rounds."""
    fns = {name: make(name) for name in MASKS}
    best = dict.fromkeys(MASKS, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=1 << 16)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.units
    rng = np.random.default_rng(0)
    mk = masks(n, rng)
    tmk = {k: torch.from_numpy(v) for k, v in mk.items()}
    a, b = rng.normal(size=n), rng.normal(size=n)
    out = np.empty(n)
    ta, tz = torch.from_numpy(a.astype(np.float32)), torch.zeros((), dtype=torch.float32)

    filt = GaussianFilter.gdp(epsilon=1.0, delta=1e-5)
    sigma = 2.0
    norms = np.full(n, sigma * np.sqrt(0.5 * filt.threshold))  # costs half the budget
    # A unit is refused when its spend leaves less than a norm's cost: the mask picks the refused units.
    states = {
        k: FilterState(spent=np.where(m, filt.threshold, filt.threshold * 0.2), stopped=np.zeros(n, bool))
        for k, m in mk.items()
    }
    quota = GaussianFilter.gdp(epsilon=2.0, delta=1e-5)
    qstate = FilterState(spent=np.zeros(n), stopped=np.zeros(n, bool))

    def numpy_path(state: FilterState) -> object:
        os.environ["FEDFILTER_FUSED_CHARGE"] = "0"
        try:
            return charge(filt, state, noise_std=sigma, l2_norms=norms)
        finally:
            os.environ.pop("FEDFILTER_FUSED_CHARGE")

    rows: dict[str, Callable[[str], Callable[[], object]]] = {
        "np.add (no mask)": lambda k: lambda: np.add(a, b, out=out),
        "np.copyto(where=)": lambda k: lambda: np.copyto(out, a, where=mk[k]),
        "np.where": lambda k: lambda: np.where(mk[k], a, b),
        "torch.where": lambda k: lambda: torch.where(tmk[k], ta, tz),
        "branchless.select": lambda k: lambda: select(mk[k], a, b),
        "branchless.or_zero": lambda k: lambda: or_zero(mk[k], a),
        "torch or_zero": lambda k: lambda: torch_or_zero(tmk[k], ta),
        "filters.charge": lambda k: lambda: charge(filt, states[k], noise_std=sigma, l2_norms=norms),
        "charge, numpy path": lambda k: partial(numpy_path, states[k]),
        "charge_with_quota": lambda k: (
            lambda: charge_with_quota(filt, states[k], quota, qstate, noise_std=sigma, l2_norms=norms)
        ),
    }
    refused = {k: int(charge(filt, states[k], noise_std=sigma, l2_norms=norms).refused.sum()) for k in MASKS}
    print(f"units: {n:,}; repeats: {args.repeats}, interleaved; best time per mask (us); cores {os.cpu_count()}")
    print(f"refused units per mask in the charge rows: {refused}")
    print(f"  {'':22s}" + "".join(f"{m:>10s}" for m in MASKS) + "    spread")
    spreads = {}
    for label, make in rows.items():
        best = spread_of(make, args.repeats)
        spreads[label] = max(best.values()) / min(best.values())
        cells = "".join(f"{best[m] * 1e6:10.1f}" for m in MASKS)
        print(f"  {label:22s}{cells}    {spreads[label]:.2f}")
    print(f"timing_spread_charge={spreads['filters.charge']:.2f}")


if __name__ == "__main__":
    main()
