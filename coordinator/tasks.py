"""What a run does each round, as a :class:`Task` the round loop drives (the shape of Flower's ``Strategy``).

The loop (coordinator/rounds.py) asks the task to configure the round's release, has the release
step collect it (coordinator/release.py, or a secagg session per release), hands it back to the
task to aggregate, and at the end asks the task to summarise. Tasks are registered by name (the
run config's ``task``); a deployer may register another with :func:`register_task`.

Gradient task (:class:`GradientTask`): federated GD with filtering (FZ Alg. 3 over units). Each
round broadcasts the model, collects each client's sum of its units' clipped gradients, adds
N(0, sigma^2 I) once in central trust (in local trust every client did), divides by the public
number of enrolled units n (never by a count of who is active, privacy.md §4) and takes a step.
With local steps (client units, DP-FedAvg, McMahan et al. 2018; :class:`LocalTrainingTask`) each
client's row is its model update after local SGD instead of its gradient, clipped and charged the
same way; the model moves by server_lr * (sum + noise) / n.

Indicator task (:class:`IndicatorTask`): adaptive sparse counting queries (FZ Thm 1.2; the
Gaussian filter of FZ Cor. 4.7). An analyst maps past answers to the next predicate; each round
releases the noisy count. Each answer carries the error bound for the units still active: the
released value minus the sum of the active units' (clipped) indicators is the sum of the Gaussian
noise, of std sigma_rel (sigma in central trust, sigma sqrt(#clients that added noise) in local),
so with the union bound over the run's at most ``rounds`` queries every answer is within
sigma_rel z(beta / (2 rounds)) of that sum, all together with probability >= 1 - beta.
(Derived from the Gaussian tail and a union bound; a unit that has stopped contributes 0, and a
unit in its last, partially clipped round contributes its clipped value.)
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from coordinator.analysts import Analyst, Answer, Query, build_analyst
from coordinator.monitor import gaussian_bound
from coordinator.release import Ask, Released, ReleaseStep
from coordinator.report import RoundLog, RunWriter
from protocol import messages as wire
from workloads.registry import layout_fingerprint

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig
    from coordinator.enrolment import Enrolment

Evaluate = Callable[[np.ndarray], dict[str, float]]
# The clip of a training-accuracy check: each unit's value (a 0/1 indicator, or a client's fraction) is at most 1.
PLATEAU_CLIP = 1.0


@functools.lru_cache(maxsize=64)
def _one_sided_z(p: float) -> float:
    """z with P(N(0, 1) > z) = p."""
    from scipy.stats import norm  # on first use: scipy.stats takes most of a second to import

    return float(norm.isf(p))


def plateau_noise_std(cfg: CoordinatorConfig) -> float:
    """The accuracy checks' noise std: ``plateau_noise_std``, or noise_std / l2_clip, so that a check (clip 1)
    costs a unit at most (C / sigma)^2, one full-norm round, whatever C is."""
    return float(cfg.plateau_noise_std or cfg.noise_std / cfg.l2_clip)


def plateau_round(cfg: CoordinatorConfig, rnd: int) -> bool:
    """Whether round ``rnd`` asks an accuracy check: rounds start, start + every, ... (every, 2 every, ...
    when start is 0), so with start at the worst-case horizon the first check sees that round's model."""
    every, start = cfg.plateau_every, cfg.plateau_start
    return bool(every) and rnd >= max(start, 1) and (rnd - start) % every == 0


def plateau_checks(cfg: CoordinatorConfig) -> int:
    """How many accuracy checks the run can ask (:func:`plateau_round` over rounds 1..rounds)."""
    every, start = cfg.plateau_every, cfg.plateau_start
    if not every:
        return 0
    first = start if start >= 1 else every
    return max((cfg.rounds - first) // every + 1, 0) if first <= cfg.rounds else 0


@dataclass(frozen=True)
class Needs:
    """What a task asks of every client's workload (checked at enrolment)."""

    model: bool  # the run's model, built with the coordinator's parameter layout
    queries: frozenset[str]  # counting queries by name


@dataclass
class RoundContext:
    """One round in progress: its number, its log line and error counts, the run's release step and writer."""

    rnd: int
    log: RoundLog
    errors: Counter[str]
    release: ReleaseStep
    writer: RunWriter


class Task(Protocol):
    """One run's task: configure each round's release, aggregate what it released, summarise the run."""

    def configure(self, rnd: int) -> Ask | None:
        """Round ``rnd``'s release, or None when the task has nothing more to ask (see :meth:`stop_reason`)."""
        ...

    def aggregate(self, released: Released, ctx: RoundContext) -> None:
        """Fold the round's release into the task's state and log (and any release of its own, on ``ctx``)."""
        ...

    def stop_reason(self) -> str | None:
        """Why the run stops now, or None to go on."""
        ...

    def summarise(self, logs: list[RoundLog], writer: RunWriter, enrolment: Enrolment) -> dict[str, Any]:
        """The task's fields of ``summary.json`` (after its last round)."""
        ...

    def result(self) -> dict[str, Any]:
        """What ``run()`` returns besides the summary (the model's parameters)."""
        ...


class TaskType(Protocol):
    """A registered task: built before enrolment (so a bad model fails before any client is asked)."""

    def build(self, cfg: CoordinatorConfig, *, analyst: Analyst | None, evaluate: Evaluate | None) -> Task: ...

    def needs(self, cfg: CoordinatorConfig) -> Needs: ...


TASKS: dict[str, TaskType] = {}  # the run config's ``task`` names (coordinator.config checks them)
_T = TypeVar("_T", bound=TaskType)


def register_task(name: str) -> Callable[[_T], _T]:
    """Register a task class under ``name``."""

    def register(task: _T) -> _T:
        TASKS[name] = task
        return task

    return register


# --- requests -----------------------------------------------------------------------------


def common_fields(cfg: CoordinatorConfig, purpose: str, rnd: int) -> dict[str, Any]:
    """Fields every contribution request of this run carries.

    The id names the run, purpose and round, never Flower's node id: the simulation engine draws
    node ids at random, and a seeded client (noise-seed) mixes the id into its noise, so an id
    with the node in it would make seeded runs differ from one run to the next. Each client
    keeps its own ledger, so the id need not be unique across clients.
    """
    return {
        "request_id": f"{cfg.wire_run_id}:{purpose}:r{rnd}",
        "run_id": cfg.wire_run_id,
        "round": rnd,
        "noise_std": cfg.noise_std,
        "l2_clip": cfg.l2_clip,
        "trust": cfg.trust,
        "unit": cfg.unit,
    }


@functools.lru_cache(maxsize=8)
def _layout_of(workload: str, model: str, model_args: str) -> str:
    import torch

    from workloads.registry import load_workload

    with torch.device("meta"):  # shapes only
        return layout_fingerprint(load_workload(workload).build_model(model, **json.loads(model_args)))


def model_layout(cfg: CoordinatorConfig) -> str:
    """The parameter layout of the run's model (workloads.registry.layout_fingerprint), sent with every model."""
    return _layout_of(cfg.workload, cfg.model, cfg.canonical_model_args)


def indicator_request(
    cfg: CoordinatorConfig,
    purpose: str,
    rnd: int,
    query: Query,
    secagg: wire.SecaggInput | None = None,
    *,
    parameters: np.ndarray | None = None,
    reduce: str = "sum",
    noise_std: float | None = None,
    l2_clip: float | None = None,
) -> wire.IndicatorRequest:
    """A counting query; the 'correct' predicate also carries the model it evaluates.

    ``noise_std`` and ``l2_clip`` (default: the run's) set the query's own noise and clip.
    """
    model: dict[str, Any] = {}
    if parameters is not None:
        model = {
            "model": cfg.model,
            "model_args": cfg.canonical_model_args,
            "parameters": parameters,
            "layout": model_layout(cfg),
        }
    fields = common_fields(cfg, purpose, rnd)
    fields.update({k: v for k, v in (("noise_std", noise_std), ("l2_clip", l2_clip)) if v is not None})
    return wire.IndicatorRequest(
        **fields,
        predicate=query.predicate,
        column=query.column,
        value=float(query.value),
        **model,
        secagg=secagg,
        reduce=reduce,
    )


# --- tasks --------------------------------------------------------------------------------


@register_task("gradient")
class GradientTask:
    """Federated GD: broadcast the model, step by the noisy sum of clipped gradients over the public n.

    Every ``plateau_every`` rounds (from round ``plateau_start`` on) it also releases a noisy training
    accuracy (:meth:`_plateau`, a counting release every filter charges) and keeps the best round's
    model by ``plateau_rule`` (private model selection, FZ Sec. 5.1); it evaluates on the server's test
    data every ``eval_every`` rounds and checkpoints every ``checkpoint_every``.
    """

    def __init__(
        self,
        cfg: CoordinatorConfig,
        parameters: np.ndarray,
        evaluate: Evaluate | None,
        trainable: np.ndarray | None = None,
    ) -> None:
        self.cfg, self.parameters, self.evaluate = cfg, parameters, evaluate
        # Frozen entries (workloads.models.trainable_mask) never move: the agents release zeros there
        # and, in central trust, the noise added there is discarded.
        self.trainable = np.ones(parameters.size, dtype=np.bool_) if trainable is None else trainable
        self.metrics: dict[str, float] = {}
        self.checkpoint: str | None = None
        self.plateau_best, self.plateau_stale = -math.inf, 0
        self.first_check: tuple[float, float] | None = None  # the first complete check: value, noise std / n
        self.checks: list[dict[str, Any]] = []  # every accuracy check: round, private accuracy, noise bound
        self.selected: tuple[int, np.ndarray] | None = None  # the best check's round and model

    @classmethod
    def build(cls, cfg: CoordinatorConfig, *, analyst: Analyst | None, evaluate: Evaluate | None) -> GradientTask:
        from workloads.models import flatten_parameters, trainable_mask  # torch: only tasks that build a model

        model = cfg.load_workload().build_model(cfg.model, seed=cfg.seed, **json.loads(cfg.model_args))
        parameters = flatten_parameters(model).astype(np.float32)
        if cfg.initial_checkpoint:
            parameters = _saved_parameters(cfg, parameters.size)
        task = LocalTrainingTask if cfg.local_steps else GradientTask
        return task(cfg, parameters, evaluate, trainable_mask(model))

    @staticmethod
    def needs(cfg: CoordinatorConfig) -> Needs:
        return Needs(model=True, queries=frozenset({"correct"} if cfg.plateau_every else ()))

    def configure(self, rnd: int) -> Ask:
        build = partial(self._request, rnd, self.parameters)
        return Ask(rnd, "gradient", wire.GRADIENT, build, self.parameters.size)

    def _request(self, rnd: int, parameters: np.ndarray, secagg: wire.SecaggInput | None) -> wire.GradientRequest:
        cfg = self.cfg
        return wire.GradientRequest(
            **common_fields(cfg, "gradient", rnd),
            model=cfg.model,
            model_args=cfg.canonical_model_args,
            parameters=parameters,
            secagg=secagg,
            layout=model_layout(cfg),
            **self._local_fields(),
        )

    def _local_fields(self) -> dict[str, Any]:
        return {}

    def _moved(self, total: np.ndarray) -> np.ndarray:
        """theta - learning_rate (sum + noise) / n, on the trainable entries only."""
        step = np.where(self.trainable, self.cfg.learning_rate * total / self.cfg.n_public, 0.0)
        return self.parameters.astype(np.float64) - step

    def aggregate(self, released: Released, ctx: RoundContext) -> None:
        cfg, rnd = self.cfg, ctx.rnd
        if released.total is not None:  # None: the secagg session released nothing, the model stays
            step = self._moved(released.total)
            if np.all(np.isfinite(step)) and np.all(np.abs(step) <= np.finfo(np.float32).max):
                self.parameters = step.astype(np.float32)
            else:  # a reply far out of range (a faulty or hostile client); post-processing, no privacy cost
                ctx.errors["non-finite-step"] += 1
        if plateau_round(cfg, rnd):
            self._plateau(ctx)
        if self.evaluate is not None and cfg.eval_every and rnd % cfg.eval_every == 0:
            self.metrics = self.evaluate(self.parameters)
            ctx.log.metrics.update(self.metrics)
        if cfg.checkpoint_every and rnd % cfg.checkpoint_every == 0:
            self.checkpoint = ctx.writer.checkpoint(rnd, self.parameters)

    def _plateau(self, ctx: RoundContext) -> None:
        """A noisy training accuracy of the current model; a new best replaces the selected model, else stale.

        Each unit's value is at most 1: a record's 0/1 indicator that the model classifies it correctly
        (record units), or the fraction of a client's records it classifies correctly (client units,
        ``reduce`` 'mean'). So the check is sent with clip 1 and its own noise (:func:`plateau_noise_std`);
        each filter charges it like any release, and a unit that has stopped answers the null element.
        The noisy sum is divided by the public n (privacy.md §4).

        ``plateau_rule`` 'guarded': the first complete check (a_1, noise std s_1 = its release's noise std
        / n) is the baseline; a later check j may be selected only when a_j - a_1 > m_j + min_delta, with
        m_j = sqrt(s_j^2 + s_1^2) z(alpha / K) for the K checks the run can ask, and among those the
        highest a_j is. With probability >= 1 - alpha every later check's noise exceeds the first's by
        at most m_j (the difference of two Gaussians, one-sided, a union bound over K); on that event a
        selected check's expected value beats the first's. A check's expected value is at most the
        model's training accuracy (a stopped or partially clipped unit answers less than its fraction),
        and the first check's is all of it when every unit can still answer it in full (the run's first
        check at its worst-case horizon, with one check's cost set aside). So the selected model's
        training accuracy is at least the first check's model's, w.p. >= 1 - alpha. A check that does not
        sum every enrolled unit (``Released.complete``) is never selected on; when the first one is such,
        its model is returned whatever later checks say. 'best' is FZ's rule, the highest noisy value.
        """
        cfg = self.cfg
        build = partial(
            indicator_request,
            cfg,
            "plateau",
            ctx.rnd,
            Query("correct"),
            parameters=self.parameters,
            reduce="mean" if cfg.unit == "client" else "sum",
            noise_std=plateau_noise_std(cfg),
            l2_clip=PLATEAU_CLIP,
        )
        released = ctx.release.release(Ask(ctx.rnd, "plateau", wire.INDICATOR, build, 1))
        ctx.errors.update({f"plateau-{name}": count for name, count in released.errors.items()})
        accuracy = math.nan if released.total is None else float(released.total[0]) / cfg.n_public
        # JSON has no NaN: an aborted secagg count is logged as null.
        ctx.log.metrics["train_accuracy_private"] = None if math.isnan(accuracy) else accuracy
        # A check some client did not answer (an error, a refusal, no reply, a secagg step it missed, an
        # aborted session) sums fewer units than it divides by: logged, never selected on.
        complete = released.complete and not math.isnan(accuracy)
        std = math.sqrt(released.noise_var) / cfg.n_public
        guarded = cfg.plateau_rule == "guarded"
        first = not self.checks
        margin = 0.0
        if guarded and complete and self.first_check is not None:
            margin = math.hypot(std, self.first_check[1]) * _one_sided_z(cfg.plateau_alpha / plateau_checks(cfg))
        self.checks.append(
            {
                "round": ctx.rnd,
                "train_accuracy_private": None if math.isnan(accuracy) else accuracy,
                "release_noise_std": math.sqrt(released.noise_var),
                "margin": margin,
                "complete": complete,
            }
        )
        if guarded and first:
            # The first scheduled check's model (the worst-case stop's) is the one to beat; if the check is
            # incomplete there is no sound baseline, and that model is returned whatever later checks say.
            self.selected = (ctx.rnd, self.parameters.copy())
            if complete:
                self.first_check, self.plateau_best = (accuracy, std), accuracy
            return
        if not complete or (guarded and self.first_check is None):
            self.plateau_stale += 1 if guarded and self.first_check is None else 0
            return
        if guarded:
            assert self.first_check is not None
            better = accuracy - self.first_check[0] > margin + cfg.plateau_min_delta and accuracy > self.plateau_best
        else:
            better = accuracy > self.plateau_best + cfg.plateau_min_delta
        if better or self.selected is None:
            self.plateau_best, self.plateau_stale = accuracy, 0
            self.selected = (ctx.rnd, self.parameters.copy())
        else:
            self.plateau_stale += 1

    def stop_reason(self) -> str | None:
        stale = self.cfg.plateau_every and self.plateau_stale >= self.cfg.plateau_patience
        return "plateau" if stale else None

    def snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What a resumed run needs of this task (coordinator/resume.py): the model, the selection's state and
        the last metrics; all of it computed from released sums and the server's own data."""
        state = {
            "plateau_best": None if self.plateau_best == -math.inf else self.plateau_best,
            "plateau_stale": self.plateau_stale,
            "first_check": None if self.first_check is None else list(self.first_check),
            "checks": self.checks,
            "metrics": self.metrics,
            "checkpoint": self.checkpoint,
            "selected_round": None if self.selected is None else self.selected[0],
        }
        arrays = {"parameters": self.parameters}
        if self.selected is not None:
            arrays["selected_parameters"] = self.selected[1]
        return state, arrays

    def restore(self, state: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """The state :meth:`snapshot` saved; the model must have this run's size and type."""
        from coordinator.config import CoordinatorConfigError

        for name in ("parameters", *(("selected_parameters",) if state["selected_round"] is not None else ())):
            found = arrays.get(name)
            if found is None or found.shape != self.parameters.shape or found.dtype != self.parameters.dtype:
                shape = None if found is None else (found.shape, str(found.dtype))
                raise CoordinatorConfigError(
                    f"resume: expected {name} of shape {self.parameters.shape} and type {self.parameters.dtype}, "
                    f"found {shape}"
                )
        self.parameters = np.array(arrays["parameters"])
        best = state["plateau_best"]
        self.plateau_best = -math.inf if best is None else float(best)
        self.plateau_stale = int(state["plateau_stale"])
        first = state["first_check"]
        self.first_check = None if first is None else (float(first[0]), float(first[1]))
        self.checks = list(state["checks"])
        self.metrics = dict(state["metrics"])
        self.checkpoint = state["checkpoint"]
        rnd = state["selected_round"]
        self.selected = None if rnd is None else (int(rnd), np.array(arrays["selected_parameters"]))

    def summarise(self, logs: list[RoundLog], writer: RunWriter, enrolment: Enrolment) -> dict[str, Any]:
        """The final metrics (evaluated now unless the last round was) and the last checkpoint."""
        if logs:
            if self.evaluate is not None and not set(logs[-1].metrics) - {"train_accuracy_private"}:
                self.metrics = self.evaluate(self.parameters)
                logs[-1].metrics.update(self.metrics)
            if self.cfg.output_dir:
                self.checkpoint = writer.checkpoint(logs[-1].round, self.parameters)
        out: dict[str, Any] = {"final_metrics": self.metrics}
        if self.checkpoint:
            out["checkpoint"] = self.checkpoint
        if self.cfg.plateau_every:
            out["selection"] = self._selection(logs, writer)
        return out

    def _selection(self, logs: list[RoundLog], writer: RunWriter) -> dict[str, Any]:
        """The private model selection: its rule, every check, the selected round, its model's metrics."""
        cfg = self.cfg
        out: dict[str, Any] = {
            "rule": cfg.plateau_rule,
            "every": cfg.plateau_every,
            "start": cfg.plateau_start,
            "noise_std": plateau_noise_std(cfg),
            "alpha": cfg.plateau_alpha if cfg.plateau_rule == "guarded" else None,
            "checks": self.checks,
            "round": None,
            "metrics": {},
        }
        if self.selected is None:  # no check was answered
            return out
        rnd, parameters = self.selected
        out["round"] = rnd
        out["train_accuracy_private"] = next(c["train_accuracy_private"] for c in self.checks if c["round"] == rnd)
        logged = next((log.metrics for log in logs if log.round == rnd), {})
        metrics: dict[str, Any] = {k: v for k, v in logged.items() if k != "train_accuracy_private"}
        if not metrics and self.evaluate is not None:
            metrics = dict(self.evaluate(parameters))
        out["metrics"] = metrics
        if cfg.output_dir:
            out["checkpoint"] = writer.checkpoint(rnd, parameters, name="selected")
        return out

    def result(self) -> dict[str, Any]:
        selected = {} if self.selected is None else {"selected_parameters": self.selected[1]}
        return {"parameters": self.parameters, **selected}


def _saved_parameters(cfg: CoordinatorConfig, size: int) -> np.ndarray:
    """The initial checkpoint's parameters, checked against the model's size and the run's rounds."""
    from coordinator.config import CoordinatorConfigError
    from coordinator.report import load_checkpoint

    rnd, parameters = load_checkpoint(cfg.initial_checkpoint)
    if parameters.size != size:
        raise CoordinatorConfigError(
            f"initial_checkpoint: expected {size} parameters (model {cfg.model!r}), found {parameters.size}"
        )
    if not 0 <= rnd < cfg.rounds:
        raise CoordinatorConfigError(f"initial_checkpoint: expected a round in [0, rounds={cfg.rounds}), found {rnd}")
    return parameters


class LocalTrainingTask(GradientTask):
    """Client units with local steps (DP-FedAvg): each row is a client's update after local SGD.

    The update is clipped and charged as one Gaussian release, as a gradient row would be; the
    model moves by server_lr * (sum + noise) / n.
    """

    def _local_fields(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "local_steps": cfg.local_steps,
            "local_lr": float(cfg.local_lr),
            "local_batch_size": cfg.local_batch_size,
        }

    def _moved(self, total: np.ndarray) -> np.ndarray:
        """theta + server_lr (sum + noise) / n: the noisy sum of clipped updates, averaged by the public n
        (trainable entries only)."""
        step = np.where(self.trainable, self.cfg.server_lr * total / self.cfg.n_public, 0.0)
        return self.parameters.astype(np.float64) + step


@register_task("indicator")
class IndicatorTask:
    """Adaptive counting queries: the analyst's next query each round, answered with its error bound."""

    def __init__(self, cfg: CoordinatorConfig, analyst: Analyst) -> None:
        self.cfg, self.analyst = cfg, analyst
        self.answers: list[Answer] = []
        self.query: Query | None = None

    @classmethod
    def build(cls, cfg: CoordinatorConfig, *, analyst: Analyst | None, evaluate: Evaluate | None) -> IndicatorTask:
        if analyst is None:
            analyst = build_analyst(cfg.analyst, rounds=cfg.rounds, columns=cfg.query_columns or cfg.rounds)
        return cls(cfg, analyst)

    @staticmethod
    def needs(cfg: CoordinatorConfig) -> Needs:
        return Needs(model=False, queries=frozenset({"column"}))  # the analysts' counting queries

    def configure(self, rnd: int) -> Ask | None:
        self.query = self.analyst(list(self.answers))
        if self.query is None:
            return None
        build = partial(indicator_request, self.cfg, "indicator", rnd, self.query)
        return Ask(rnd, "indicator", wire.INDICATOR, build, 1)

    def aggregate(self, released: Released, ctx: RoundContext) -> None:
        assert self.query is not None
        ctx.log.query = asdict(self.query)  # asked, and answered only if something was released
        if released.total is not None:
            cfg = self.cfg
            bound = gaussian_bound(noise_std=ctx.log.release_noise_std, queries=cfg.rounds, beta=cfg.accuracy_beta)
            answer = Answer(ctx.rnd, self.query, float(released.total[0]), bound)
            self.answers.append(answer)
            ctx.log.answer, ctx.log.bound = answer.value, bound

    def stop_reason(self) -> str | None:
        return "analyst_done" if self.query is None else None

    def summarise(self, logs: list[RoundLog], writer: RunWriter, enrolment: Enrolment) -> dict[str, Any]:
        """The answers with their bounds, and how many queries worst-case accounting would have allowed."""
        cfg = self.cfg
        sensitivity = min(cfg.l2_clip, 1.0) if cfg.unit == "record" else cfg.l2_clip
        return {
            "queries_answered": len(self.answers),
            "worst_case_queries": enrolment.worst_case_rounds((sensitivity / cfg.noise_std) ** 2),
            "accuracy": {
                "beta": cfg.accuracy_beta,
                "rule": "answer - (sum of the active units' clipped indicators) is within bound, "
                "for all answers together with probability >= 1 - beta (Gaussian tail, union bound over rounds)",
            },
            "answers": [
                {"round": a.round, **asdict(a.query), "value": a.value, "bound": a.bound} for a in self.answers
            ],
            "final_metrics": {"queries_answered": float(len(self.answers))},
        }

    def result(self) -> dict[str, Any]:
        return {}
