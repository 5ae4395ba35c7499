"""Benchmark: one deployed request, from ClientApp process start to reply, proxy against in-bundle agent.

Flower 1.41 starts a fresh ClientApp process for every message. What that process pays:

    in-bundle agent (before issue 13): import the agent (and torch), load and fingerprint the
        client's data, open the ledger with every check, answer, close (WAL checkpoint):
        ``client_agent.direct.answer_request(node_config, ..., cache=None)``;
    proxy (now): import the proxy (flwr, grpc, numpy; no torch), forward the request over the
        Unix socket to ``fedfilter agent serve``, which keeps data, ledger and torch loaded:
        ``client_agent.client_app.forward``.

Each sample is a new Python process (as Flower starts one), timed from spawn to exit, for the
same gradient request shape (fresh request ids); the two kinds run interleaved. Printed: the
median per kind, their ratio, and the agent service's own answer time for comparison.

Run: .venv/bin/python benchmarks/proxy_cost.py [--records N] [--samples K]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from simulations.deploy.agent_files import write_agent_toml

ENV = os.environ | {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
FEATURES, CLASSES = 784, 10

REQUEST = """
import json, sys, time, numpy as np
from protocol import messages as wire
rid = sys.argv[2]
config, arrays = wire.encode_request(wire.GradientRequest(
    request_id=rid, run_id="bench", round=int(rid.split("-")[1]), noise_std=5.0, l2_clip=1.0, trust="local",
    unit="record", model="logreg", model_args=json.dumps({{"in_features": {f}, "n_classes": {c}}}),
    parameters=np.zeros({d}, np.float32)))
"""

PROXY = (
    REQUEST
    + """
from client_agent.client_app import forward
code, reason, _, _ = forward(sys.argv[1], wire.GRADIENT, config, arrays)
assert code == 0, reason
"""
)

IN_BUNDLE = (
    REQUEST
    + """
from client_agent.direct import answer_request
outcome = answer_request({{"agent-config": sys.argv[1]}}, wire.GRADIENT, config, arrays, cache=None)
assert not outcome.is_error, outcome.local_detail
"""
)


def timed(code: str, target: str, request_id: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, target, request_id], env=ENV, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=600)
    parser.add_argument("--samples", type=int, default=7)
    args = parser.parse_args()
    if args.records < 2 or args.samples < 1:
        parser.error("--records must be >= 2 and --samples >= 1")
    root = Path(tempfile.mkdtemp(prefix="fedfilter-proxy-"))
    rng = np.random.default_rng(0)
    d = FEATURES * CLASSES + CLASSES
    tomls = {}
    for kind in ("proxy", "in-bundle"):
        folder = root / kind
        folder.mkdir()
        x = rng.normal(size=(args.records, FEATURES)).astype(np.float32)
        np.savez(folder / "data.npz", x=x, y=rng.integers(0, CLASSES, args.records))
        tomls[kind] = write_agent_toml(
            folder / "agent.toml",
            {
                "ledger-path": str(folder / "ledger.sqlite"),
                "data-path": str(folder / "data.npz"),
                "agent-socket": str(folder / "agent.sock"),
                "epsilon": 1e6,
                "delta": 1e-5,
                "unit": "record",
                "trust": "local",
            },
        )
    sock = root / "proxy" / "agent.sock"
    service = subprocess.Popen(
        [sys.executable, "-m", "simulations.cli", "agent", "serve", str(tomls["proxy"])],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            if service.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("agent service did not start")
            time.sleep(0.1)
        proxy = PROXY.format(f=FEATURES, c=CLASSES, d=d)
        bundle = IN_BUNDLE.format(f=FEATURES, c=CLASSES, d=d)
        timed(proxy, str(sock), "w-0")  # warm-up: the service's first gradient imports torch
        timed(bundle, str(tomls["in-bundle"]), "w-0")
        times: dict[str, list[float]] = {"proxy": [], "in-bundle": []}
        for i in range(1, args.samples + 1):
            times["proxy"].append(timed(proxy, str(sock), f"r-{i}"))
            times["in-bundle"].append(timed(bundle, str(tomls["in-bundle"]), f"r-{i}"))
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=60)
    p, b = statistics.median(times["proxy"]), statistics.median(times["in-bundle"])
    print(f"{args.records} records, logreg {FEATURES}x{CLASSES} ({d:,} parameters), record units, local trust")
    print(f"{args.samples} samples each, interleaved; each sample is a new Python process, spawn to exit")
    best = {kind: min(values) * 1e3 for kind, values in times.items()}
    print(f"  in-bundle agent (cold, per message)   median {b * 1e3:8.0f} ms   best {best['in-bundle']:8.0f} ms")
    print(f"  proxy to agent service                median {p * 1e3:8.0f} ms   best {best['proxy']:8.0f} ms")
    print(f"  ratio in-bundle / proxy               {b / p:8.2f}")
    print(json.dumps({"records": args.records, "proxy_s": p, "in_bundle_s": b}))


if __name__ == "__main__":
    main()
