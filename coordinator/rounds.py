"""The coordinator's run: enrolment, then a template loop over rounds until the first stop.

The loop has the shape of Flower's ``Strategy.start`` (flwr/serverapp/strategy/strategy.py):
each round the task (coordinator/tasks.py) configures a release, the release step collects it
(coordinator/release.py; in secagg trust a secure-aggregation session per release,
coordinator/secagg.py), the task aggregates it, and the monitor (coordinator/monitor.py) observes
the active set. The run stops at the first of: the task has nothing more to ask, the monitor
says fewer than T units are active, the task's own stop (the private plateau), max rounds.

Robust rounds: missing replies and error replies (counted by the code's name) do not stop a
round; n is public, so the privacy statement does not change. A client's error text is never
kept or logged: it may carry data-dependent detail (coordinator/transport.py).

Secagg trust: every release (the round's, the plateau count's, the tree monitor's) is one
secure-aggregation session; the coordinator learns only the sum of at least m clients' masked
inputs, each holding its noise share N(0, sigma^2 / m). A session with fewer than m survivors
releases nothing: the round takes no step and answers nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import asdict, replace
from typing import Any, TextIO

import numpy as np

from coordinator.analysts import Analyst
from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from coordinator.enrolment import Enrolment, enrol
from coordinator.monitor import Monitor, SvtMonitor, Verdict, build_monitor, svt_reliability
from coordinator.release import PlainRelease, Released, ReleaseStep
from coordinator.report import Progress, RoundLog, RunWriter, load_checkpoint
from coordinator.resume import ReleaseGuard, load_snapshot, save_snapshot
from coordinator.secagg import SecaggRelease
from coordinator.tasks import TASKS, Evaluate, GradientTask, RoundContext
from coordinator.transport import Transport

__all__ = ["noise_rng", "run"]

LOG = logging.getLogger("fedfilter.coordinator")


def noise_rng(cfg: CoordinatorConfig) -> np.random.Generator:
    """Central-trust and SVT noise: OS entropy unless a simulation fixed ``noise_seed``."""
    return np.random.default_rng() if cfg.noise_seed is None else np.random.default_rng(cfg.noise_seed)


def run(
    transport: Transport,
    cfg: CoordinatorConfig,
    *,
    analyst: Analyst | None = None,
    evaluate: Evaluate | None = None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Run the configured task to its stop; returns the summary (also written to ``output_dir``)."""
    started = time.monotonic()
    if cfg.session:  # two runs given one session would share request ids (privacy.md §9)
        raise CoordinatorConfigError("session: each run draws its own (a resumed run takes its snapshot's); got one")
    snapshot = load_snapshot(cfg) if cfg.resume else None
    # Central trust: a session of its own (a resumed run: its snapshot's), so no request id of another run is
    # reused: a stored exact sum is noised once, or again with the same noise by the run that resumes it.
    cfg = replace(cfg, session=snapshot.session) if snapshot is not None else cfg.in_session()
    rng = noise_rng(cfg)
    task = TASKS[cfg.task].build(cfg, analyst=analyst, evaluate=evaluate)  # before enrolment: a bad model fails first
    if snapshot is not None:
        assert isinstance(task, GradientTask)  # config: resume takes the gradient task
        task.restore(snapshot.task_state, snapshot.task_arrays)
    enrolment = enrol(transport, cfg)  # before any output is written: a refused run leaves no partial files
    writer = RunWriter(cfg.output_dir, None if snapshot is None else snapshot.logs)
    release: ReleaseStep = (
        PlainRelease(transport, cfg, enrolment.nodes, rng)
        if enrolment.secagg is None
        else SecaggRelease(transport, cfg, enrolment.nodes, enrolment.secagg)
    )
    if cfg.snapshot_every or cfg.resume:  # every release fingerprinted; a resumed one must match (resume.py)
        release = ReleaseGuard(release, cfg.output_dir, snapshot)
    monitor = build_monitor(cfg, rng)
    reliability: dict[str, Any] = {}
    if isinstance(monitor, SvtMonitor):
        # Public arithmetic on the run's own settings (no data): can this monitor tell the enrolled
        # population from its threshold? Said before the first round, and kept in the summary.
        rel = svt_reliability(
            epsilon=cfg.monitor_epsilon,
            threshold=cfg.monitor_threshold,
            population=max(enrolment.units_enrolled, 1),
            rounds=cfg.rounds,
        )
        warning = rel.warning()
        reliability = asdict(rel) | {"separates": rel.separates, "warning": warning}
        if warning is not None:
            LOG.warning("monitor: %s", warning)
    progress = Progress(cfg.rounds, stream=progress_stream, enabled=cfg.progress)
    logs: list[RoundLog] = []
    errors_total: Counter[str] = Counter()
    stopped_because = "max_rounds"
    # A run started from a saved model goes on after the checkpoint's round (the task loaded its parameters).
    first = load_checkpoint(cfg.initial_checkpoint)[0] + 1 if cfg.initial_checkpoint else 1
    if snapshot is not None:
        # The noise goes on where it stopped: a round the clients replay gets the noise it had (resume.py).
        rng.bit_generator.state = snapshot.rng_state
        logs, errors_total, first = snapshot.round_logs(), Counter(snapshot.errors_total), snapshot.round + 1
    for rnd in range(first, cfg.rounds + 1):
        t0 = time.monotonic()
        ask = task.configure(rnd)
        if ask is None:
            stopped_because = task.stop_reason() or "task_done"
            break
        released = release.release(ask)
        ctx = RoundContext(rnd, _round_log(cfg, rnd, released), released.errors, release, writer)
        task.aggregate(released, ctx)
        verdict = None if monitor is None else _observe(monitor, ctx)
        ctx.log.errors, ctx.log.duration_s = dict(ctx.errors), time.monotonic() - t0
        errors_total.update(ctx.errors)
        logs.append(ctx.log)
        writer.round(asdict(ctx.log))
        progress.update(rnd, _progress_fields(verdict, ctx))
        stop = "monitor" if verdict is not None and verdict.below else task.stop_reason()
        if cfg.snapshot_every and rnd % cfg.snapshot_every == 0 and stop is None and rnd < cfg.rounds:
            assert isinstance(task, GradientTask)  # config: snapshots take the gradient task
            save_snapshot(cfg, rnd=rnd, rng=rng, logs=logs, errors_total=errors_total, task=task)
        if stop is not None:
            stopped_because = stop
            break
    summary = _summary(cfg, enrolment, logs, stopped_because, errors_total, started)
    if reliability:
        summary["monitor_reliability"] = reliability
    summary.update(task.summarise(logs, writer, enrolment))
    writer.summary(summary)
    progress.finish(
        f"run {cfg.wire_run_id}: {len(logs)} rounds, stopped because {stopped_because}; "
        f"({enrolment.privacy['epsilon']:g}, {enrolment.privacy['delta']:g})-DP per {cfg.unit}"
    )
    summary.update(task.result())
    summary["rounds"] = [asdict(log) for log in logs]
    return summary


def _round_log(cfg: CoordinatorConfig, rnd: int, released: Released) -> RoundLog:
    """The round's log line as its release left it (errors and duration are filled at the round's end)."""
    return RoundLog(
        round=rnd,
        task=cfg.task,
        replies=len(released.replies.replies),
        errors={},
        errors_by_code=dict(released.replies.errors),
        missing=released.replies.missing,
        noise_std=cfg.noise_std,
        release_noise_std=math.sqrt(released.noise_var),
        duration_s=0.0,
        secagg=released.secagg,
    )


def _observe(monitor: Monitor, ctx: RoundContext) -> Verdict:
    """The monitor's verdict on this round's reports; what it left out is counted under 'monitor-'."""
    reports = ctx.release.reports(ctx.rnd)
    verdict = monitor.observe(ctx.rnd, reports)
    ctx.errors.update({f"monitor-{name}": count for name, count in reports.errors.items()})
    ctx.log.monitor = {"kind": monitor.kind, **asdict(verdict)}
    return verdict


def _progress_fields(verdict: Verdict | None, ctx: RoundContext) -> dict[str, Any]:
    return {
        "active~": None if verdict is None else verdict.active_estimate,
        "below": None if verdict is None else verdict.below,
        **ctx.log.metrics,
        "errors": sum(ctx.errors.values()) or None,
    }


def _summary(
    cfg: CoordinatorConfig,
    enrolment: Enrolment,
    logs: list[RoundLog],
    stopped_because: str,
    errors_total: Counter[str],
    started: float,
) -> dict[str, Any]:
    """The fields of ``summary.json`` every task shares (each task adds its own)."""
    return {
        "run_id": cfg.run_id,
        "wire_run_id": cfg.wire_run_id,  # the run as the clients' ledgers and audit logs name it
        "task": cfg.task,
        "privacy": enrolment.privacy,
        "rounds_completed": len(logs),
        "stopped_because": stopped_because,
        "final_metrics": {},
        "n_public": cfg.n_public,
        "units_enrolled": enrolment.units_enrolled,
        "clients_excluded": enrolment.excluded,
        "errors_total": dict(errors_total),
        "duration_s": time.monotonic() - started,
        "config": {k: v for k, v in asdict(cfg).items() if k != "noise_seed"},
    }
