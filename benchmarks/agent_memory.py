"""What a request can cost the agent service in memory (issue 25, item 3).

Starts ``fedfilter agent serve`` on a Unix socket (policy-max-model-params = --params, so the largest
request frame it accepts is 4 * params + 16 MiB) and reads its resident memory from /proc:

- idle: after a first status request (imports done);
- the largest allowed frame: one request of exactly the bound (a gradient request whose parameters
  fill it, refused after decoding: the wrong size for the model), its peak over idle;
- a flood: --flood concurrent connections, each sending a frame of the bound with malformed content;
  at most MAX_CONNECTIONS are read at once, the rest are told "busy" unread;
- an oversized announcement: one connection announcing 1 GiB, refused before a byte is read.

Peaks come from VmHWM after resetting it (``echo 5 > /proc/PID/clear_refs``). The last line:
``agent_memory_peak_over_frame=<r> flood_peak_over_frame=<f> max_connections=<k>``: (peak - idle) / frame
bytes for one largest frame (before this issue a malformed 256 MiB frame raised the peak by 1.25 GiB:
4.9) and for the flood (bounded by k frames held at once).

    .venv/bin/python benchmarks/agent_memory.py [--params 8000000] [--flood 16]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client_agent import local_wire
from client_agent.service import MAX_CONNECTIONS, REQUEST_HEADROOM_BYTES
from protocol import messages as wire
from simulations.deploy.agent_files import write_agent_toml
from tests.factories import gradient_request

MIB = 1 << 20


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def send(sock_path: Path, frame: bytes) -> int | str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(300)
            conn.connect(str(sock_path))
            local_wire.send(conn, frame)
            code, _, _, _ = local_wire.unpack_reply(local_wire.receive(conn, local_wire.MAX_FRAME_BYTES))
            return code
    except OSError as exc:
        return type(exc).__name__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=8_000_000, help="policy-max-model-params (default 8e6)")
    parser.add_argument("--flood", type=int, default=16, help="concurrent malformed frames (default 16)")
    args = parser.parse_args()
    bound = 4 * args.params + REQUEST_HEADROOM_BYTES
    env = os.environ | {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(50, 4)).astype(np.float32)
        np.savez(root / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
        toml = write_agent_toml(
            root / "agent.toml",
            {
                "ledger-path": str(root / "ledger.sqlite"),
                "data-path": str(root / "data.npz"),
                "agent-socket": str(root / "agent.sock"),
                "epsilon": 2.0,
                "delta": 1e-5,
                "policy-min-noise-std": 1.0,
                "policy-max-clip": 10.0,
                "policy-max-model-params": args.params,
            },
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "simulations.cli", "agent", "serve", str(toml)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        sock = root / "agent.sock"
        try:
            deadline = time.monotonic() + 120
            status = local_wire.pack_request(wire.STATUS, {"request_id": "s", "run_id": "r", "round": 0}, {})
            while send(sock, status) != 0:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"agent did not start: {proc.stdout.read() if proc.stdout else ''}")
                time.sleep(0.2)
            idle = status_kib(proc.pid, "VmRSS") * 1024
            print(f"frame bound {bound / MIB:.1f} MiB (policy-max-model-params {args.params})")
            print(f"idle RSS {idle / MIB:.1f} MiB")

            # The largest allowed frame: a gradient request whose parameters fill the bound.
            fill = (bound - 64 * 1024) // 4
            config, arrays = wire.encode_request(gradient_request("big", features=4))
            arrays["parameters"] = np.zeros(fill, np.float32)
            big = local_wire.pack_request(wire.GRADIENT, config, arrays)
            assert len(big) <= bound, (len(big), bound)
            reset_peak(proc.pid)
            code = send(sock, big)
            peak_big = status_kib(proc.pid, "VmHWM") * 1024
            print(
                f"largest frame ({len(big) / MIB:.1f} MiB, answered with code {code}): peak {peak_big / MIB:.1f} MiB, "
                f"{(peak_big - idle) / len(big):.2f}x the frame over idle"
            )

            # A flood of malformed frames of the bound's size (a valid prefix, then junk).
            junk = b"\0" * len(big)
            reset_peak(proc.pid)
            results: list[int | str] = []
            threads = [threading.Thread(target=lambda: results.append(send(sock, junk))) for _ in range(args.flood)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            peak_flood = status_kib(proc.pid, "VmHWM") * 1024
            busy = sum(1 for r in results if r == wire.ERR_UNAVAILABLE)
            print(
                f"flood of {args.flood} malformed frames: {results.count(wire.ERR_MALFORMED)} refused as malformed, "
                f"{busy} told busy, {len(results) - busy - results.count(wire.ERR_MALFORMED)} cut; peak "
                f"{peak_flood / MIB:.1f} MiB, {(peak_flood - idle) / len(big):.2f}x one frame over idle "
                f"(bound: {MAX_CONNECTIONS} frames at once)"
            )

            # An announcement above the bound: refused unread.
            before = status_kib(proc.pid, "VmRSS") * 1024
            reset_peak(proc.pid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(60)
                conn.connect(str(sock))
                conn.sendall(struct.pack(">4sQ", local_wire.MAGIC, 1 << 30))
                code, _, _, _ = local_wire.unpack_reply(local_wire.receive(conn, local_wire.MAX_FRAME_BYTES))
            peak_over = status_kib(proc.pid, "VmHWM") * 1024
            rise = max(0.0, (peak_over - before) / MIB)
            print(f"1 GiB announced: code {code}, peak {rise:.1f} MiB over the RSS before it (refused unread)")
            single = (peak_big - idle) / len(big)
            flood = (peak_flood - idle) / len(big)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(
        f"agent_memory_peak_over_frame={single:.2f} flood_peak_over_frame={flood:.2f} max_connections={MAX_CONNECTIONS}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
