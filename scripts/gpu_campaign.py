"""Issue 26's campaign on a lent GPU machine, in one call of the device tool (scripts/gpu_campaign.sh runs it).

Every chosen job starts at once, each in a process of its own (``fedfilter reproduce fz-mnist --campaign
--once --only '^<key>$'``), all sharing the GPU. A job the call cannot finish is lost (its snapshot stays on
the lent machine, which is given back), so the driver watches each job's rounds and, while some job's pace
says it will not reach its last round before ``--budget`` runs out, stops the one with the most rounds
left: the GPU and CPU it held go to the others. At the deadline every job still running is stopped.

What it leaves in ``--out``: ``new-rows.jsonl`` (the finished trials' rows: append them to
docs/results/fz_sec51.jsonl here and commit them), ``progress.jsonl`` (every job's round against time,
and each stop with its reason), ``workers.log`` (the jobs' logs) and ``rounds.tgz`` (each job's rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Running:
    key: str
    prefix: str
    first: int  # the round the job starts from (a branch or a snapshot: > 0)
    last: int  # its last round
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    started: float
    seen: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, round reached)
    stopped: str = ""

    def left(self) -> int:
        return self.last - (self.seen[-1][1] if self.seen else self.first)


def reached(work: Path, prefix: str) -> int | None:
    """The last round in the rounds.jsonl of the job's newest folder ``<prefix>-<YYYYmmdd-HHMMSS>`` (None before
    its first round; another job's folders, whose keys only begin like this one's, are not read)."""
    name = re.compile(re.escape(prefix) + r"-\d{8}-\d{6}")
    folders = sorted(p for p in (work / "campaign").glob(f"{prefix}-*") if name.fullmatch(p.name))
    if not folders or not (folders[-1] / "rounds.jsonl").exists():
        return None
    last = None
    with open(folders[-1] / "rounds.jsonl", "rb") as fh:
        for line in fh:
            try:
                last = int(json.loads(line)["round"])
            except (ValueError, KeyError, TypeError):
                continue  # a line still being written
    return last


def pace(job: Running, window: float, now: float) -> float | None:
    """Rounds per second from ``window`` seconds before ``now`` (seconds since the start) to ``now``: a job
    that stops moving slows down. None while its record is under half a window; 0 for a job with no round
    ``3 * window`` seconds after it started."""
    if not job.seen:
        return 0.0 if now - job.started >= 3 * window else None
    r_now = job.seen[-1][1]
    earlier = [(t, r) for t, r in job.seen if now - t >= window]
    t0, r0 = earlier[-1] if earlier else job.seen[0]
    if now - t0 < window / 2:
        return None
    return (r_now - r0) / (now - t0)


def too_late(jobs: list[Running], left_s: float, window: float, now: float) -> tuple[Running, str] | None:
    """The running job to stop, and why: of those whose pace (:func:`pace`) says they cannot reach their last
    round in ``left_s`` seconds, the one with most rounds left (ties: the later key); None when all can. A job
    at its last round (only its end to write) is never stopped."""
    late = []
    for j in jobs:
        rate = pace(j, window, now)
        if j.proc.poll() is not None or rate is None or j.left() <= 0:
            continue
        if rate <= 0 or j.left() / rate > left_s:
            late.append((j.left(), j.key, j, rate))
    if not late:
        return None
    _, _, j, rate = max(late, key=lambda x: (x[0], x[1]))
    return j, f"{j.left()} rounds left at {rate:.2f}/s, {max(left_s, 0):.0f} s to the deadline"


def whole_row(line: bytes) -> bool:
    """Whether ``line`` is a whole JSON object (not a write cut short)."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def gpu_use() -> str:
    """' | GPU <busy %>, <memory used>' from nvidia-smi, or '' without one."""
    try:
        got = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f" | GPU {got}" if got else ""


def stop(jobs: list[Running], why: str, grace: float = 10.0) -> None:
    """Stop ``jobs`` together: SIGTERM to each process group, ``grace`` seconds for all of them, then SIGKILL
    to every group (a member that ignores SIGTERM, or outlives its leader, goes too)."""
    for j in jobs:
        j.stopped = j.stopped or why
        with contextlib.suppress(ProcessLookupError):
            os.killpg(j.proc.pid, signal.SIGTERM)
    until = time.monotonic() + grace
    for j in jobs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            j.proc.wait(timeout=max(until - time.monotonic(), 0.01))
    for j in jobs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(j.proc.pid, signal.SIGKILL)
        j.proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, required=True, help="seconds from now to the deadline")
    p.add_argument("--only", required=True, help="regular expression: the pending jobs to run (re.search on keys)")
    p.add_argument("--max-jobs", type=int, default=8, help="at most this many jobs (the first pending ones)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per job")
    p.add_argument("--device", default="cuda")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True, help="the jobs' --out")
    p.add_argument("--out", type=Path, required=True, help="what comes back")
    p.add_argument("--margin", type=float, default=20.0, help="seconds a job needs after its last round")
    p.add_argument("--window", type=float, default=60.0, help="seconds of record a job's pace is read over")
    p.add_argument("--dry-run", action="store_true", help="print the jobs and exit")
    args = p.parse_args(argv)
    for name in ("budget", "window", "margin"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{name}: expected a finite number of seconds above 0, got {value!r}")
    if args.max_jobs < 1 or args.threads < 1:
        p.error(f"--max-jobs and --threads: expected at least 1, got {args.max_jobs} and {args.threads}")
    try:
        only = re.compile(args.only)
    except re.error as exc:
        p.error(f"--only: expected a regular expression, got {args.only!r}: {exc}")
    start = time.monotonic()
    deadline = start + args.budget
    sys.path.insert(0, str(ROOT))
    from simulations.cli.reproduce import job_prefix
    from simulations.reproductions.fz_sec51 import job_rounds, load_results, pending_jobs

    before = set(args.results.read_bytes().splitlines())  # the rows already there (each names its job and time)
    chosen = [j for j in pending_jobs(load_results(args.results)) if only.search(j.key)][: args.max_jobs]
    for j in chosen:
        first, last = job_rounds(j)
        print(f"job {j.key}: rounds {first + 1}..{last}", flush=True)
    if args.dry_run or not chosen:
        return 0 if chosen else 3
    args.out.mkdir(parents=True, exist_ok=True)
    progress = open(args.out / "progress.jsonl", "w")

    def note(**kw: Any) -> None:
        progress.write(json.dumps({"t": round(time.monotonic() - start, 1), **kw}) + "\n")
        progress.flush()

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    jobs: list[Running] = []
    for j in chosen:
        first, last = job_rounds(j)
        args.work.mkdir(parents=True, exist_ok=True)
        log = open(args.work / f"gpu-job-{len(jobs)}.log", "wb")
        cmd = [sys.executable, "-m", "simulations.cli", "reproduce", "fz-mnist", "--campaign", "--once"]
        cmd += ["--device", args.device, "--threads", str(args.threads), "--only", f"^{re.escape(j.key)}$"]
        cmd += ["--data-dir", str(args.data_dir), "--results", str(args.results), "--out", str(args.work)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        jobs.append(Running(j.key, job_prefix(j), first, last, proc, log, time.monotonic() - start))
        note(job=j.key, event="start", first=first, last=last)
        time.sleep(2)

    def ended(j: Running) -> None:
        if not j.stopped:
            j.stopped = f"exited rc {j.proc.returncode}"
            note(job=j.key, event="exit", rc=j.proc.returncode)

    last_stop = 0.0
    while time.monotonic() < deadline and any(j.proc.poll() is None for j in jobs):
        time.sleep(10)
        now = time.monotonic() - start
        line = []
        for j in jobs:
            if j.proc.poll() is not None:
                ended(j)
                continue
            r = reached(args.work, j.prefix)
            if r is not None and (not j.seen or r != j.seen[-1][1]):
                j.seen.append((now, r))
                note(job=j.key, round=r)
            rate = pace(j, args.window, now)
            line.append(
                f"{j.key.split('/')[1][:3]} {j.key.split('/')[2]} s{j.key.split('seed=')[1][0]}: "
                f"{j.seen[-1][1] if j.seen else '-'}/{j.last}" + (f" {rate:.2f}/s" if rate else "")
            )
        print(f"{now:5.0f} s | " + " | ".join(line) + gpu_use(), flush=True)
        # The jobs that cannot finish at their present pace; stop the one with most rounds left, then wait for
        # the others' pace to show what it freed.
        if now - last_stop < args.window:
            continue
        late = too_late(jobs, deadline - time.monotonic() - args.margin, args.window, now)
        if late is not None:
            j, why = late
            print(f"stopping {j.key}: {why}", flush=True)
            stop([j], why)
            note(job=j.key, event="stopped", why=why)
            last_stop = now
    for j in jobs:
        if j.proc.poll() is not None:
            ended(j)  # a job that exited since the last look
    running = [j for j in jobs if j.proc.poll() is None]
    stop(running, "deadline")
    for j in running:
        note(job=j.key, event="stopped", why="deadline")
    for j in jobs:
        j.log.close()
    progress.close()
    lines = [x + b"\n" for x in args.results.read_bytes().splitlines() if x not in before and whole_row(x)]
    (args.out / "new-rows.jsonl").write_bytes(b"".join(lines))
    landed = {json.loads(x).get("job") for x in lines}
    for j in jobs:
        if j.key in landed:
            j.stopped = "landed"
        elif j.stopped.startswith("exited"):  # else the driver stopped it, for the reason it gave
            j.stopped += " without a row (workers.log says why)"
    with open(args.out / "workers.log", "w") as fh:
        for i, j in enumerate(jobs):
            text = (args.work / f"gpu-job-{i}.log").read_bytes().decode(errors="replace").replace("\r", "\n")
            fh.write(f"==== {j.key} ({j.stopped})\n")
            fh.write("\n".join(x for x in text.splitlines() if not x.startswith("[#")) + "\n")
    with tarfile.open(args.out / "rounds.tgz", "w:gz") as tar:
        for f in sorted((args.work / "campaign").glob("*/rounds.jsonl")):
            tar.add(f, arcname=f"{f.parent.name}/rounds.jsonl")
    print(f"{len(lines)} new rows; " + "; ".join(f"{j.key}: {j.stopped}" for j in jobs), flush=True)
    return 0 if all(not j.stopped.startswith("exited") for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
