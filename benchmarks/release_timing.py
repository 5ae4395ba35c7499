"""Benchmark: does a client's compute time tell the coordinator who stopped, or which records are null?

The agent's contribution and release path (per-record gradients, partial clipping, the filter's
charge, the clipped sum, the noise) is timed through the real ``Agent.contributions`` and
``Agent.release`` for one record-unit gradient request, with the ledger I/O left out (it is the
same for every request). Each scenario runs interleaved with the baseline, pair by pair:

    baseline     every unit active, every record usable
    half stopped half the units exhausted (partial clip 0)
    all stopped  every unit exhausted: the reply is noise only
    10% null     a tenth of the records with a label outside the coordinator's classes

For each scenario it prints the median time, the median of the per-pair ratios to the baseline,
and the share of pairs in which the scenario was slower. A private release shows ratios near
1.00 and about half of the pairs slower; issue 12 measured an exhausted client 15-20 ms slower
on ~150 ms in 77-83 % of pairs, and null records +18-25 ms in 80-85 %.

Run: .venv/bin/python benchmarks/release_timing.py [--records N] [--pairs P]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from client_agent.agent import Agent
from client_agent.config import parse_agent_config
from client_agent.state import AgentState
from protocol import messages as wire

FEATURES, CLASSES = 784, 10


def make_agent(root: Path, x: np.ndarray, y: np.ndarray) -> Agent:
    root.mkdir(parents=True, exist_ok=True)
    np.savez(root / "data.npz", x=x, y=y)
    cfg = {
        "ledger-path": str(root / "ledger.sqlite"),
        "data-path": str(root / "data.npz"),
        "epsilon": 2.0,
        "delta": 1e-5,
        "unit": "record",
        "trust": "local",
    }
    return Agent(parse_agent_config(cfg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    if args.records < 10 or args.pairs < 3:
        parser.error("--records must be >= 10 and --pairs >= 3")
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="fedfilter-timing-"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.records, FEATURES)).astype(np.float32) * 0.1
    y = rng.integers(0, CLASSES, args.records)
    agent = make_agent(root / "usable", x, y)
    y_null = y.copy()
    y_null[::10] = CLASSES + 3  # outside the model's classes: the null element
    null_agent = make_agent(root / "null", x, y_null)
    config, arrays = wire.encode_request(
        wire.GradientRequest(
            request_id="t1",
            run_id="timing",
            round=1,
            noise_std=10.0,  # sigma sqrt(T) is above most norms: clipping does not hide the stopped set
            l2_clip=5.0,
            trust="local",
            unit="record",
            model="logreg",
            model_args=json.dumps({"in_features": FEATURES, "n_classes": CLASSES}),
            parameters=np.zeros(FEATURES * CLASSES + CLASSES, np.float32),
        )
    )
    request = wire.decode_request(wire.GRADIENT, config, arrays)
    assert isinstance(request, wire.GradientRequest)
    fresh = AgentState.from_arrays(agent.ledger.state())
    assert agent.gaussian is not None
    threshold = agent.gaussian.threshold

    def stopped_state(fraction: float) -> AgentState:
        stopped = np.random.default_rng(1).random(args.records) < fraction
        return replace(fresh, spent=np.where(stopped, threshold, 0.0), stopped=stopped)

    def step(a: Agent, state: AgentState) -> Callable[[], None]:
        def run() -> None:
            a.release(request, a.contributions(request), state)

        return run

    baseline = step(agent, fresh)
    scenarios = {
        "half stopped": step(agent, stopped_state(0.5)),
        "all stopped": step(agent, stopped_state(1.0)),
        "10% null": step(null_agent, AgentState.from_arrays(null_agent.ledger.state())),
    }
    for fn in (baseline, *scenarios.values()):
        fn()  # warm-up
    d = FEATURES * CLASSES + CLASSES
    print(f"{args.records} records, logreg {FEATURES}x{CLASSES} ({d:,} parameters), record units, local trust")
    print(f"{args.pairs} interleaved pairs per scenario; torch threads: 2; times exclude the ledger commit")
    base_times: list[float] = []
    for name, fn in scenarios.items():
        times: list[float] = []
        ratios: list[float] = []
        slower = 0
        for i in range(args.pairs):
            order = (baseline, fn) if i % 2 == 0 else (fn, baseline)
            measured = {}
            for f in order:
                t0 = time.perf_counter()
                f()
                measured[f] = time.perf_counter() - t0
            base_times.append(measured[baseline])
            times.append(measured[fn])
            ratios.append(measured[fn] / measured[baseline])
            slower += measured[fn] > measured[baseline]
        print(
            f"  {name:13s} median {statistics.median(times) * 1e3:8.1f} ms   ratio to baseline "
            f"{statistics.median(ratios):5.3f}   slower in {slower}/{args.pairs} pairs"
        )
    print(f"  {'baseline':13s} median {statistics.median(base_times) * 1e3:8.1f} ms")
    agent.close()
    null_agent.close()


if __name__ == "__main__":
    main()
