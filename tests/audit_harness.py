"""Empirical privacy audit through the client agent's real release path.

Unlike ``tests/property/test_audit.py``, which plays the filter functions directly, this
harness drives :meth:`client_agent.agent.Agent.handle` end to end (wire decode, policy,
``contributions``, ``release`` with clipping, filter and noise, ledger commit, reply), so
it also audits how the agent wires units, noise and filter state together (privacy.md §2, §6).

Game (privacy.md §1: neighbours differ in one unit, replaced by the null element ⊥):

- D: the client's records, the target record among them; D': the same client with the
  target replaced by ⊥ (``record`` units: the target's label is one no predicate asks
  about, so its every contribution is 0), or the whole client replaced by ⊥ (``client``
  units: every record's label is one no predicate asks about).
- Local trust, indicator requests (d = 1). An adaptive coordinator picks the next request
  from the noisy replies so far: ``label == 1`` (the target answers 1) when the last reply
  was above a threshold, else ``label == 2``, and a larger noise std when it was far below.
- Two agents in lockstep on fresh ledgers: one on D, one on D'. One world W (D or D') is
  sampled: its agent gets xi_t ~ N(0, sigma_t^2), injected through ``Agent.rng``, and its
  reply y_t is the transcript. The other agent must produce the *same* y_t: its mean s'_t
  (the clipped contribution sum, fixed by its filter before any noise is drawn; TVC Alg. 1)
  is read with a probe (``contributions`` + ``release`` with zero noise, nothing committed),
  then it answers the real request with the noise y_t - s'_t injected, and its reply is
  checked to equal y_t.
- Because each world's mean is a deterministic function of its data and y_{<t}, the
  transcript's privacy loss is exact (Gaussian likelihood ratio):

      L_W = sum_t (||y_t - s_other,t||^2 - ||y_t - s_W,t||^2) / (2 sigma_t^2).

- (epsilon, delta)-DP of the transcript is exactly E_W[(1 - e^{epsilon - L_W})_+] <= delta in
  both directions (hockey-stick divergence; Balle et al. 2018 Thm 5), estimated by Monte Carlo.
  For the Gaussian filters the same losses are also compared with the sqrt(T)-GDP curve at
  smaller epsilons (:func:`curve_bound`), where delta is large enough to measure.

Run as a script, e.g. ``python -m tests.audit_harness --filter realisation --unit record --others 1``.
``filter = realisation`` with ``unit = record`` is refused by the product (privacy.md §6); the
harness builds it anyway, the way the old code allowed, to show that the audit detects its leak.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import multiprocessing.context
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import special

from client_agent.agent import Agent
from client_agent.config import AgentConfig, parse_agent_config
from client_agent.state import AgentState
from protocol import messages as wire

TARGET_LABEL = 1  # the target record's label in D: it answers 1 to ``label == 1``
NULL_LABEL = 0  # a label no predicate of the adversary asks about: every contribution is 0 (⊥)
ASKED_LABELS = (1, 2)
FLOAT32_EPS = float(np.finfo(np.float32).eps)


class AuditError(AssertionError):
    """The lockstep broke: an agent refused, or the injected noise did not give the shared transcript."""


@dataclass(frozen=True)
class Setup:
    """One audited configuration: the agent's filter and unit, the client's data, the game's length."""

    filter: str
    unit: str = "record"
    others: int = 3  # records the client holds besides the target
    epsilon: float = 6.0
    delta: float = 1e-3
    sigma: float = 2.0  # the usual noise std (= policy-min-noise-std)
    sigma_alt: float = 3.0  # the adversary's other choice, within policy
    clip: float = 1.0  # l2_clip of every request (= policy-max-clip); indicators have norm <= 1
    max_rounds: int = 30  # realisation-max-rounds (N)
    rounds: int = 30  # requests per trial

    @property
    def refused_by_product(self) -> bool:
        """privacy.md §6: the realisation filter needs one unit per noise draw."""
        return self.filter == "realisation" and self.unit == "record"

    def other_labels(self) -> list[int]:
        """The other records' labels, mixed: 1, 2, 1, 2, ... (one other record: label 1, like the target)."""
        return [ASKED_LABELS[i % 2] for i in range(self.others)]

    def labels(self, world: str) -> NDArray[np.int64]:
        """Labels of the client's records in ``data`` (D) or ``null`` (D') world; the target is record 0."""
        others = self.other_labels()
        if world == "data":
            return np.array([TARGET_LABEL, *others], dtype=np.int64)
        if self.unit == "client":  # the unit is the whole client: every record becomes ⊥
            return np.full(1 + self.others, NULL_LABEL, dtype=np.int64)
        return np.array([NULL_LABEL, *others], dtype=np.int64)

    def node_config(self, ledger_path: Path, data_path: Path) -> dict[str, Any]:
        return {
            "ledger-path": str(ledger_path),
            "data-path": str(data_path),
            "epsilon": self.epsilon,
            "delta": self.delta,
            "filter": self.filter,
            "unit": self.unit,
            "trust": "local",
            "realisation-max-rounds": self.max_rounds,
            "policy-max-clip": self.clip,
            "policy-min-noise-std": self.sigma,
        }

    def agent_config(self, ledger_path: Path, data_path: Path) -> AgentConfig:
        if not self.refused_by_product:
            return parse_agent_config(self.node_config(ledger_path, data_path))
        # This is the configuration the product refuses (realisation filter, record units: the
        # records share the client's noise). Built the way the old code allowed, then run
        # through the real release path, to show that the audit detects its leak.
        cfg = parse_agent_config(self.node_config(ledger_path, data_path) | {"unit": "client"})
        object.__setattr__(cfg, "unit", "record")
        return cfg


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta of mu-GDP at epsilon (DRS Cor. 2.13): Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    return float(special.ndtr(-epsilon / mu + mu / 2) - math.exp(epsilon) * special.ndtr(-epsilon / mu - mu / 2))


def curve_bound(setup: Setup, epsilon: float) -> float | None:
    """The delta at another ``epsilon`` that a Gaussian filter's own accounting implies (None: realisation).

    Every Gaussian filter (gdp, zcdp, renyi, renyi_multi) keeps each unit's squared budget
    S = sum_t mu_t^2 <= T, its threshold; Gaussian releases composed fully adaptively under that
    rule are sqrt(T)-GDP (Smith & Thakurta 2022; KTH), so delta(eps) <= delta_GDP(sqrt(T), eps) at
    every eps, not only at the target. The conversion is written out here, independently of
    protocol.conversions. When the target spends all of T, its transcript's loss is exactly
    N(T/2, T) and the bound is attained: the audit is then tight, which checks the audit itself.
    """
    if setup.filter == "realisation":
        return None
    threshold = float(setup.agent_config(Path("/audit.sqlite"), Path("/audit.npz")).gaussian_filter().threshold)
    return max(0.0, gdp_delta(math.sqrt(threshold), epsilon))


class FixedNoise:
    """Stands in for ``Agent.rng(request)``: ``normal`` returns the prescribed noise vector."""

    def __init__(self, vector: NDArray[np.float64], *, sigma: float) -> None:
        self.vector = np.asarray(vector, dtype=np.float64)
        self.sigma = sigma
        self.draws = 0

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: Any = None) -> NDArray[np.float64]:
        shape = tuple(np.atleast_1d(size)) if size is not None else ()
        if loc != 0.0 or scale != self.sigma or shape != self.vector.shape:
            raise AuditError(
                f"agent drew normal({loc}, {scale}, {size}); the audit injects N(0, {self.sigma}^2) "
                f"of shape {self.vector.shape}"
            )
        self.draws += 1
        return self.vector.copy()


def inject(agent: Agent, vector: NDArray[np.float64], *, sigma: float) -> FixedNoise:
    """Make the agent's next noise draw ``vector`` (the agent draws ``self.rng(request).normal(0, sigma, d)``)."""
    noise = FixedNoise(vector, sigma=sigma)
    agent.rng = lambda request: noise  # type: ignore[method-assign,assignment,return-value]
    return noise


def adversary(setup: Setup, t: int, last: float | None) -> wire.IndicatorRequest:
    """The adaptive coordinator: the request of round t from the last noisy reply."""
    if last is None:
        value, sigma = 1, setup.sigma
    else:
        value = 1 if last > -0.5 else 2
        sigma = setup.sigma_alt if last < -2.5 else setup.sigma
    return wire.IndicatorRequest(
        request_id=f"audit-{t}",
        run_id="audit",
        round=t,
        noise_std=sigma,
        l2_clip=setup.clip,
        trust="local",
        unit=setup.unit,
        predicate="label",
        column=0,
        value=float(value),
    )


def probe_mean(agent: Agent, request: wire.IndicatorRequest) -> NDArray[np.float64]:
    """The agent's clipped contribution sum for ``request`` in its current state (commits nothing).

    The filter fixes who takes part and with what clip before any noise is drawn, so the
    release with zero noise injected is the mean of the real release.
    """
    inject(agent, np.zeros(1), sigma=request.noise_std)
    rows = agent.contributions(request)
    reply, _, _, _ = agent.release(request, rows, AgentState.from_arrays(agent.ledger.state()))
    assert isinstance(reply, wire.ContributionReply)
    return np.asarray(reply.total, dtype=np.float64)


def answer(
    agent: Agent, config: dict[str, Any], arrays: dict[str, Any], noise: NDArray[np.float64], sigma: float
) -> NDArray[np.float64]:
    """The agent's real reply (through ``Agent.handle``) with ``noise`` injected; its total, float64."""
    fixed = inject(agent, noise, sigma=sigma)
    outcome = agent.handle(wire.INDICATOR, config, arrays)
    if outcome.is_error:
        raise AuditError(f"agent refused request {config['request_id']}: {outcome.error_reason}")
    assert outcome.config is not None and outcome.arrays is not None
    reply = wire.ContributionReply.decode(outcome.config, outcome.arrays)
    if reply.status != wire.REPLY_OK or reply.noise_added != sigma or fixed.draws != 1:
        raise AuditError(f"unexpected reply {reply!r} (noise draws: {fixed.draws})")
    return np.asarray(reply.total, dtype=np.float64)


@contextmanager
def _workdir(base: str | os.PathLike[str] | None) -> Iterator[Path]:
    if base is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"  # SQLite's fsync is cheap in memory
    path = Path(tempfile.mkdtemp(prefix="fedfilter-audit-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def play(
    setup: Setup, world: str, rng: np.random.Generator, workdir: Path, data: dict[str, Path]
) -> tuple[float, bool]:
    """One trial: the privacy loss L_W of the transcript sampled in ``world`` (data: D, null: D').

    Also whether the target unit's filter (in the agent on D) had stopped by the end: the game
    is long enough to exhaust a budget.
    """
    other = "null" if world == "data" else "data"
    workdir.mkdir()
    agents = {w: Agent(setup.agent_config(workdir / f"{w}.sqlite", data[w])) for w in ("data", "null")}
    try:
        loss = 0.0
        last: float | None = None
        for t in range(1, setup.rounds + 1):
            request = adversary(setup, t, last)
            sigma = request.noise_std
            config, arrays = wire.encode_request(request)
            decoded = wire.decode_request(wire.INDICATOR, config, arrays)
            assert isinstance(decoded, wire.IndicatorRequest)
            mean_other = probe_mean(agents[other], decoded)  # fixed before any noise is drawn
            xi = rng.normal(0.0, sigma, mean_other.shape)
            y = answer(agents[world], config, arrays, xi, sigma)  # the transcript
            mean_world = y - xi
            y_other = answer(agents[other], config, arrays, y - mean_other, sigma)
            tol = 4 * FLOAT32_EPS * max(1.0, float(np.abs(y).max()))
            if not np.allclose(y_other, y, rtol=0.0, atol=tol):
                raise AuditError(f"round {t}: the {other} agent answered {y_other}, not the transcript {y}")
            loss += float(np.sum((y - mean_other) ** 2) - np.sum((y - mean_world) ** 2)) / (2 * sigma**2)
            last = float(y[0])
        state = agents["data"].ledger.state()
        stopped = bool(state["stopped"][0]) if "stopped" in state else not bool(state["accepting"][0])
        return loss, stopped
    finally:
        for agent in agents.values():
            agent.close()
        shutil.rmtree(workdir, ignore_errors=True)


def hockey_stick(losses: NDArray[np.float64], epsilon: float) -> tuple[float, float]:
    """Estimate and standard error of delta(epsilon) = E[(1 - e^{epsilon - L})_+] from sampled losses L."""
    values = np.clip(-np.expm1(epsilon - np.asarray(losses, dtype=np.float64)), 0.0, None)
    stderr = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else math.inf
    return float(values.mean()), stderr


@dataclass(frozen=True)
class AuditResult:
    setup: Setup
    world: str
    losses: NDArray[np.float64] = field(repr=False)
    target_stopped: NDArray[np.bool_] = field(repr=False)  # per trial: the target's filter stopped
    estimate: float
    stderr: float
    seconds: float

    @property
    def tail(self) -> float:
        """P(L > epsilon), for information (a sufficient condition, not the criterion)."""
        return float(np.mean(self.losses > self.setup.epsilon))

    def at(self, epsilon: float) -> tuple[float, float]:
        """The hockey-stick estimate and its standard error at another epsilon, from the same losses."""
        return hockey_stick(self.losses, epsilon)

    def passes(self, *, sigmas: float = 4.0, floor: float = 0.02) -> bool:
        """One-sided: the estimate is within ``sigmas`` standard errors (plus ``floor``) of the claimed delta."""
        return self.estimate <= self.setup.delta + sigmas * self.stderr + floor

    def line(self) -> str:
        s = self.setup
        return (
            f"filter={s.filter} unit={s.unit} others={s.others} world={self.world} trials={self.losses.size} "
            f"rounds={s.rounds}: delta({s.epsilon:g}) = {self.estimate:.4f} +- {self.stderr:.4f} "
            f"(claimed {s.delta:g}; P(L > eps) = {self.tail:.3f}; mean L = {self.losses.mean():.3f}; "
            f"target stopped in {self.target_stopped.mean():.0%}; {self.seconds:.1f} s)"
        )


def _trials(setup: Setup, world: str, seed: int, indices: list[int], root: str) -> list[tuple[float, bool]]:
    """Losses of the given trials; trial i's noise depends only on (seed, world, i), not on the batching."""
    code = 0 if world == "data" else 1
    data = {w: Path(root) / f"{w}.npz" for w in ("data", "null")}
    return [
        play(setup, world, np.random.default_rng([seed, code, i]), Path(root) / f"trial-{i}", data) for i in indices
    ]


def default_workers() -> int:
    """``FEDFILTER_AUDIT_WORKERS`` if set, else one worker per CPU core available to this process, at most 4."""
    if os.environ.get("FEDFILTER_AUDIT_WORKERS"):
        return max(1, int(os.environ["FEDFILTER_AUDIT_WORKERS"]))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def audit(
    setup: Setup,
    *,
    world: str,
    trials: int,
    seed: int,
    workers: int = 1,
    workdir: str | os.PathLike[str] | None = None,
) -> AuditResult:
    """Monte Carlo estimate of the hockey-stick divergence in one direction (``data``: D vs D'; ``null``: D' vs D).

    ``workers`` > 1 splits the trials over processes started by a fork server (a clean
    process that has imported the agent but run nothing, so forking it is safe).
    """
    if world not in ("data", "null"):
        raise ValueError(f"world: expected 'data' or 'null', got {world!r}")
    start = time.perf_counter()
    with _workdir(workdir) as root:
        x = np.zeros((1 + setup.others, 1), dtype=np.float32)
        for w in ("data", "null"):
            np.savez(root / f"{w}.npz", x=x, y=setup.labels(w))
        workers = max(1, min(workers, trials))
        if workers == 1:
            losses = _trials(setup, world, seed, list(range(trials)), str(root))
        else:
            chunks = [list(range(trials))[k::workers] for k in range(workers)]
            with ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context()) as pool:
                futures = [pool.submit(_trials, setup, world, seed, chunk, str(root)) for chunk in chunks]
                losses = [(0.0, False)] * trials
                for chunk, future in zip(chunks, futures, strict=True):
                    for i, value in zip(chunk, future.result(), strict=True):
                        losses[i] = value
    arr = np.array([loss for loss, _ in losses], dtype=np.float64)
    stopped = np.array([flag for _, flag in losses], dtype=np.bool_)
    estimate, stderr = hockey_stick(arr, setup.epsilon)
    return AuditResult(setup, world, arr, stopped, estimate, stderr, time.perf_counter() - start)


def _pool_context() -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # Imported once in the fork server (torch included), then every worker forks from it.
    ctx.set_forkserver_preload(["client_agent.agent", "client_agent.workloads"])
    return ctx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--filter", default="realisation", help="gdp, zcdp, renyi, renyi_multi or realisation")
    parser.add_argument("--unit", default="record", choices=("record", "client"))
    parser.add_argument("--others", type=int, default=3, help="records the client holds besides the target")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epsilon", type=float, default=6.0)
    parser.add_argument("--delta", type=float, default=1e-3)
    parser.add_argument("--sigma", type=float, default=2.0)
    parser.add_argument("--max-rounds", type=int, default=30, help="realisation-max-rounds (N)")
    parser.add_argument("--world", default="both", choices=("data", "null", "both"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=default_workers(), help="processes (default: one per core)")
    args = parser.parse_args(argv)
    setup = Setup(
        filter=args.filter,
        unit=args.unit,
        others=args.others,
        epsilon=args.epsilon,
        delta=args.delta,
        sigma=args.sigma,
        max_rounds=args.max_rounds,
        rounds=args.rounds,
    )
    if setup.refused_by_product:
        print("note: filter=realisation with unit=record is refused by the product; built as the old code allowed")
    worlds = ("data", "null") if args.world == "both" else (args.world,)
    ok = True
    for world in worlds:
        result = audit(setup, world=world, trials=args.trials, seed=args.seed, workers=args.workers)
        ok &= result.passes()
        print(result.line() + ("" if result.passes() else "  <-- exceeds the claimed delta"))
        for eps in (0.5, 1.0, 2.0) if curve_bound(setup, 1.0) is not None else ():
            estimate, stderr = result.at(eps)
            print(f"  delta({eps:g}) = {estimate:.4f} +- {stderr:.4f} (sqrt(T)-GDP: {curve_bound(setup, eps):.4f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
