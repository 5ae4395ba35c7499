"""``fedfilter reproduce``: paper reproductions that take long (:mod:`simulations.reproductions.fz_sec51`)."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import re
import subprocess
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from simulations.cli.arguments import Subparsers
from simulations.errors import SimulationError
from simulations.reproductions.fz_sec51 import (
    DEFAULT_RESULTS,
    EPSILONS,
    METHODS,
    REGIMES,
    SNAPSHOT,
    Job,
    append_result,
    append_results,
    campaign_jobs,
    campaign_progress,
    cell,
    current_trials,
    finished,
    job_summary,
    load_results,
    pending_jobs,
    plot_accuracy,
    plot_fig1,
    progress_text,
    report_markdown,
    run_job,
    run_trial,
    snapshot_round,
)

log = logging.getLogger(__name__)

DEFAULT_OUT = Path("fedfilter-out/fz-mnist")  # the campaign's --out, where the report finds its snapshots

# ``fz-mnist --campaign --once`` exit codes: a shell loop runs it until it returns non-zero.
CAMPAIGN_NOTHING_LEFT = 3
CAMPAIGN_STUCK = 4  # the same job failed twice: stop rather than loop on it
CAMPAIGN_ALL_HELD = 5  # every job that can start now is held by another worker (try again later)
COMMIT_ATTEMPTS = 10


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
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help="trial folders go here")
    run.add_argument("--data-dir", type=Path, help="folder with the MNIST IDX files")
    run.add_argument("--engine", choices=["flower", "inprocess"], help="default: flower (--campaign: inprocess)")
    run.add_argument(
        "--campaign",
        action="store_true",
        help="issue 26: jobs in order (prefix check, tuning grid, seed 0, seeds 1-2, GDP), skipping those in --results",
    )
    run.add_argument("--once", action="store_true", help="--campaign: run the next unfinished job, then exit")
    run.add_argument(
        "--commit", action="store_true", help="--campaign: git commit --results after every job (nothing else)"
    )
    run.add_argument(
        "--only",
        metavar="REGEX",
        help=(
            "--campaign: take only jobs whose key (e.g. trial/suboptimal/eps=0.3/gd+renyi/seed=2/T0=150,C0=1,lr=2) "
            "this regular expression matches (re.search); the others are left to other workers"
        ),
    )
    run.add_argument(
        "--device",
        default="cpu",
        help="where the agents' per-record engine runs: cpu (default), cuda or cuda:N (recorded in each row)",
    )
    run.add_argument(
        "--threads",
        type=int,
        help=(
            "--campaign: torch threads (default: one per core). Workers sharing --out and --results take "
            "different jobs: on 2 cores, two workers at 1 thread each ran 1.25x the steps of one at 2 (docs/results.md)"
        ),
    )
    run.set_defaults(handler=run_cells)
    rep = rsub.add_parser(
        "fz-mnist-report", help="the table (markdown), Fig. 1 and accuracy against step (PNG) from the results file"
    )
    rep.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    rep.add_argument("--fig", type=Path, default=Path("docs/img/fz_fig1_active.png"))
    rep.add_argument("--accuracy-fig", type=Path, default=Path("docs/img/fz_sec51_accuracy.png"))
    rep.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="the campaign's --out: jobs stopped mid-run count the steps their snapshots hold",
    )
    rep.add_argument(
        "--workers", type=int, default=2, help="campaign workers sharing the machine, for the time left (default 2)"
    )
    rep.set_defaults(handler=run_report)


def run_cells(args: argparse.Namespace) -> int:
    """Run the trials of every cell asked for, appending each to ``--results`` as it finishes."""
    if args.campaign:
        return run_campaign(args)
    if args.trials < 1:
        raise SimulationError(f"--trials: expected an integer >= 1, got {args.trials}")
    check_device(args.device)
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
            record = run_trial(
                c, seed=seed, out=out, data_dir=args.data_dir, engine=args.engine or "flower", device=args.device
            )
            append_result(args.results, {**record, "device": args.device})
            log.info(
                "fz-mnist: test accuracy %.2f%% after %d steps (%.0f s); appended to %s",
                *(100 * record["final_accuracy"], record["rounds_completed"], record["wall_s"], args.results),
            )
    return 0


def check_device(device: str) -> None:
    """``--device`` names a device torch sees here, or the run stops before any job is taken."""
    import torch

    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
        raise SimulationError(f"--device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    index = int(device.split(":")[1]) if ":" in device else 0
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device != "cpu" and index >= seen:
        raise SimulationError(f"--device: expected a CUDA device torch sees, got {device!r} (torch sees {seen})")


def run_campaign(args: argparse.Namespace) -> int:
    """Issue 26's campaign: the next unfinished job (``--once``) or all of them, each appended when done.

    Several workers may share ``--out`` and ``--results``: each holds the job it runs (:func:`claim`),
    and appends and commits under one lock. Exit codes with ``--once``: 0 after a job (or its first
    failure, so that a shell loop tries it again), CAMPAIGN_NOTHING_LEFT when every job (``--only``: every
    job it matches) is done, CAMPAIGN_STUCK when the next job has failed twice, CAMPAIGN_ALL_HELD when every
    job that can start is another worker's.
    """
    import torch

    if args.threads is not None and args.threads < 1:
        raise SimulationError(f"--threads: expected an integer >= 1, got {args.threads}")
    check_device(args.device)
    try:
        only = None if args.only is None else re.compile(args.only)
    except re.error as exc:
        raise SimulationError(f"--only: expected a regular expression, got {args.only!r}: {exc}") from exc

    def mine(job: Job) -> bool:
        return only is None or only.search(job.key) is not None

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    engine = args.engine or "inprocess"
    failures_path = args.out / "campaign-failures.jsonl"
    while True:
        rows = load_results(args.results)
        if all(finished(j, rows) for j in campaign_jobs(rows) if mine(j)):
            log.info("fz-mnist campaign: every job is in %s", args.results)
            return CAMPAIGN_NOTHING_LEFT
        taken = _take_job(args, rows, failures_path, mine)
        if isinstance(taken, int):
            return taken
        job, hold, rows = taken
        with hold:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
            prefix = job_prefix(job)
            earlier = resumable_attempt(args.out / "campaign", prefix)
            out = earlier if earlier is not None else args.out / "campaign" / f"{prefix}-{stamp}"
            log.info(
                "fz-mnist campaign: %s -> %s (engine %s on %s, %d torch threads)%s",
                job.key,
                out,
                engine,
                args.device,
                torch.get_num_threads(),
                "" if earlier is None else ", going on from its snapshot",
            )
            try:
                resume = None if earlier is None else earlier / SNAPSHOT
                new = run_job(
                    job, out=out, data_dir=args.data_dir, engine=engine, rows=rows, resume=resume, device=args.device
                )
                new = [{**r, "device": args.device} for r in new]
            except Exception as exc:  # recorded, then tried once more by the next call
                log.info("fz-mnist campaign: %s failed: %s\n%s", job.key, exc, traceback.format_exc())
                _record_failure(failures_path, job, exc)
                if _failures(failures_path, job) >= 2:
                    return CAMPAIGN_STUCK
                if args.once:
                    return 0
                continue
            line = job_summary(job, new)
            with _locked(args.out / "campaign" / "results.lock"):  # one worker's rows and commit at a time
                append_results(args.results, new)
                log.info("fz-mnist campaign: done %s (%.0f s); appended to %s", line, new[-1]["wall_s"], args.results)
                if args.commit:
                    commit_results(args.results, f"fz-mnist campaign: {line}")
        if args.once:
            return 0


def _take_job(
    args: argparse.Namespace, rows: list[dict[str, Any]], failures_path: Path, mine: Callable[[Job], bool]
) -> tuple[Job, BinaryIO, list[dict[str, Any]]] | int:
    """The first job that can start, is ``mine`` (``--only``) and no other worker holds, held (with the rows
    read after taking it); or the exit code when there is none: CAMPAIGN_STUCK (it failed twice) or
    CAMPAIGN_ALL_HELD."""
    for job in filter(mine, pending_jobs(rows)):
        if _failures(failures_path, job) >= 2:
            log.info("fz-mnist campaign: %s failed twice (%s); stopping", job.key, failures_path)
            return CAMPAIGN_STUCK
        hold = claim(args.out / "campaign" / "claims", job)
        if hold is None:
            continue
        now = load_results(args.results)  # another worker may have finished it since ``rows`` was read
        if finished(job, now):
            hold.close()
            continue
        return job, hold, now
    log.info("fz-mnist campaign: every job that can start now is held by another worker")
    return CAMPAIGN_ALL_HELD


def job_prefix(job: Job) -> str:
    """The start of the names of ``job``'s folders and of its claim (its key, without '/' and ',')."""
    return job.key.replace("/", "_").replace(",", "_")


def claim(claims: Path, job: Job) -> BinaryIO | None:
    """This process's hold on ``job`` (an exclusive lock on its file in ``claims``), or None when another
    worker holds it. Closing the file lets it go; so does the process's end, so a worker stopped mid-job
    (a session's end) leaves no stale claim, and its snapshot is taken up by whoever holds the job next."""
    claims.mkdir(parents=True, exist_ok=True)
    hold = (claims / f"{job_prefix(job)}.lock").open("ab")
    try:
        fcntl.flock(hold.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        hold.close()
        return None
    return hold


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing) while the block runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield


_STAMP = re.compile(r"\d{8}-\d{6}")  # a campaign folder's time stamp, YYYYmmdd-HHMMSS (UTC)


def resumable_attempt(campaign: Path, prefix: str) -> Path | None:
    """The newest earlier attempt ``<prefix>-<stamp>`` of a job that left a snapshot (its process stopped mid-run)."""
    stamped = (p for p in campaign.glob(f"{prefix}-*") if _STAMP.fullmatch(p.name[len(prefix) + 1 :]))
    found = sorted(p for p in stamped if (p / SNAPSHOT).is_file())
    return found[-1] if found else None


def snapshot_rounds(out: Path, rows: list[dict[str, Any]]) -> dict[str, int]:
    """Each unfinished job's key -> the round of the snapshot its last stopped attempt under ``out`` left."""
    found = {}
    for job in campaign_jobs(rows):
        attempt = None if finished(job, rows) else resumable_attempt(out / "campaign", job_prefix(job))
        if attempt is not None:
            try:
                found[job.key] = snapshot_round(attempt / SNAPSHOT)
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
                raise SimulationError(
                    f"{attempt / SNAPSHOT}: expected a run's snapshot, could not read it: {exc}"
                ) from exc
    return found


def _failures(path: Path, job: Job) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("job") == job.key)


def _record_failure(path: Path, job: Job, exc: BaseException) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps({"job": job.key, "error": repr(exc), "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ")}) + "\n")


def commit_results(path: Path, message: str) -> bool:
    """``git commit -m message -- path`` (that file only), retried while another git holds the index lock."""
    for attempt in range(COMMIT_ATTEMPTS):
        done = subprocess.run(
            ["git", "commit", "-q", "-m", message, "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode == 0:
            return True
        if "index.lock" not in done.stderr:
            log.info("fz-mnist campaign: git commit failed: %s", (done.stderr or done.stdout).strip())
            return False
        time.sleep(1 + attempt)
    log.info("fz-mnist campaign: git commit gave up: the index stayed locked")
    return False


def run_report(args: argparse.Namespace) -> int:
    """The report (markdown, printed) and the figures (PNG) from ``--results``: the campaign's rows, with the
    tuning grid, the prefix check and the earlier (T0 = 40) trials apart."""
    if args.workers < 1:
        raise SimulationError(f"--workers: expected an integer >= 1, got {args.workers}")
    rows = load_results(args.results)
    print(report_markdown(rows))
    print("\n" + progress_text(campaign_progress(rows, snapshot_rounds(args.out, rows)), workers=args.workers))
    trials = current_trials(rows)
    fig = plot_fig1([r for r in trials if r["regime"] == "tuned"], args.fig)
    acc = plot_accuracy(trials, args.accuracy_fig)
    print(f"\n{len(rows)} rows ({len(trials)} campaign trials at the chosen tuning) in {args.results}")
    print(f"Fig. 1: {fig if fig else 'no tuned filtered run at eps 0.3/0.5 yet'}")
    print(f"accuracy against step: {acc if acc else 'no full-scale campaign trial yet'}")
    return 0
