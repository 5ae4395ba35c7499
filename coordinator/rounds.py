"""The coordinator's run: enrolment, rounds, the active-set monitor, stopping, reporting.

Gradient task: federated GD with filtering (FZ Alg. 3 over units). Each round broadcasts the
model, collects each client's sum of its units' clipped gradients, adds N(0, sigma^2 I) once
in central trust (in local trust every client did), divides by the public number of enrolled
units n (never by a count of who is active, privacy.md §4) and takes a step. With local steps
(client units, DP-FedAvg, McMahan et al. 2018) each client's row is its model update after local
SGD instead of its gradient, clipped and charged the same way; the model moves by
server_lr * (sum + noise) / n.

Indicator task: adaptive sparse counting queries (FZ Thm 1.2; the Gaussian filter of FZ
Cor. 4.7). An analyst maps past answers to the next predicate; each round releases the noisy
count. Each answer carries the error bound for the units still active: the released value
minus the sum of the active units' (clipped) indicators is the sum of the Gaussian noise, of
std sigma_rel (sigma in central trust, sigma sqrt(#clients that added noise) in local), so
with the union bound over the run's at most ``rounds`` queries every answer is within
sigma_rel z(beta / (2 rounds)) of that sum, all together with probability >= 1 - beta.
(Derived from the Gaussian tail and a union bound; a unit that has stopped contributes 0,
and a unit in its last, partially clipped round contributes its clipped value.)

Robust rounds: missing replies and error replies (counted by the code's name) do not stop a
round; n is public, so the privacy statement does not change. A client's error text is never
kept or logged: it may carry data-dependent detail (coordinator/transport.py).

Secagg trust: every release (the round's, the plateau count's, the tree monitor's) is one
secure-aggregation session (coordinator/secagg.py); the coordinator learns only the sum of
at least m clients' masked inputs, each holding its noise share N(0, sigma^2 / m). A session
with fewer than m survivors releases nothing: the round takes no step and answers nothing.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import numpy as np

from coordinator.analysts import Analyst, Answer, Query, build_analyst
from coordinator.config import MONITORS, CoordinatorConfig
from coordinator.monitor import SvtMonitor, TreeMonitor, Verdict, gaussian_bound
from coordinator.report import Progress, RunWriter
from coordinator.secagg import SecaggRound, SecaggSettings, default_min_clients, secagg_release
from coordinator.transport import RoundReplies, Transport
from protocol import messages as wire
from protocol.filters import GaussianFilter, rounds_within
from protocol.models import flatten_parameters
from protocol.releases import tree_levels
from protocol.validate import PrivacyParameterError
from protocol.workload import layout_fingerprint

Evaluate = Callable[[np.ndarray], dict[str, float]]


class EnrolmentError(RuntimeError):
    """The clients' accepted configuration does not cover what the run would do."""


def noise_rng(cfg: CoordinatorConfig) -> np.random.Generator:
    """Central-trust and SVT noise: OS entropy unless a simulation fixed ``noise_seed``."""
    return np.random.default_rng() if cfg.noise_seed is None else np.random.default_rng(cfg.noise_seed)


# --- enrolment ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Enrolment:
    """Who takes part and what every one of them accepted (public configuration from their status replies)."""

    nodes: list[int]
    units_enrolled: int
    privacy: dict[str, Any]
    worst_case_threshold: float  # the GDP threshold at the weakest client's (epsilon, delta), monitor reserved
    excluded: dict[str, int] = field(default_factory=dict)
    secagg: SecaggSettings | None = None  # secagg trust only


def _monitor_matches(cfg: CoordinatorConfig, reserved: dict[str, Any]) -> str | None:
    """Why a client's reservation does not cover the run's monitor, or None when it does."""
    kind = reserved.get("kind")
    if kind != cfg.monitor:
        return f"monitor {cfg.monitor!r} asked; the client reserved {kind!r}"
    if cfg.monitor == "svt" and not float(reserved.get("epsilon_svt", 0.0)) >= cfg.monitor_epsilon:
        return f"svt epsilon {cfg.monitor_epsilon} asked; the client reserved {reserved.get('epsilon_svt')}"
    if cfg.monitor == "tree" and int(reserved.get("max_rounds", 0)) < cfg.rounds:
        return f"{cfg.rounds} monitor rounds asked; the client's tree covers {reserved.get('max_rounds')}"
    return None


def _accepted(status: dict[str, Any]) -> dict[str, Any]:
    """A status description with the ledger fields enrolment reads, checked; a ProtocolError otherwise."""
    ledger = status.get("ledger")
    if not isinstance(ledger, dict):
        raise wire.ProtocolError(f"status reply: expected a 'ledger' object, got {ledger!r:.80}")
    for key, kind in (
        ("epsilon", float),
        ("delta", float),
        ("n_units", int),
        ("filter", str),
        ("trust", str),
        ("unit", str),
    ):
        value = ledger.get(key)
        numeric = kind is float and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
        if isinstance(value, bool) or not (numeric or (kind is not float and isinstance(value, kind))):
            raise wire.ProtocolError(f"status reply: ledger {key!r} must be {kind.__name__}, got {value!r:.80}")
    # Closed tables: a refusal quotes these values, and must never quote a client's free text.
    for key, choices in (("trust", wire.TRUST_MODES), ("unit", wire.UNITS)):
        if ledger[key] not in choices:
            raise wire.ProtocolError(f"status reply: ledger {key!r} must be one of {choices}, got {ledger[key]!r:.80}")
    monitor = ledger.get("params", {}).get("monitor") if isinstance(ledger.get("params"), dict) else None
    if not isinstance(monitor, dict):
        raise wire.ProtocolError(f"status reply: expected a monitor reservation object, got {monitor!r:.80}")
    reserved = monitor.get("kind")
    if reserved not in MONITORS:
        raise wire.ProtocolError(f"status reply: monitor 'kind' must be one of {MONITORS}, got {reserved!r:.80}")
    needed = {"svt": ("epsilon_svt",), "tree": ("noise_std", "max_rounds", "squared_cost")}.get(str(reserved), ())
    for key in needed:
        value = monitor.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise wire.ProtocolError(f"status reply: monitor {key!r} must be a finite number > 0, got {value!r:.80}")
    if monitor.get("kind") == "tree":
        for key in ("max_rounds", "levels"):
            value = monitor.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise wire.ProtocolError(f"status reply: monitor {key!r} must be an integer >= 1, got {value!r:.80}")
    if not float(ledger["delta"]) < 1:
        raise wire.ProtocolError(f"status reply: ledger 'delta' must be in (0, 1), got {ledger['delta']!r:.80}")
    if "workload" in status:
        _described_workload(status["workload"])
    layout = status.get("layout", {})
    if not isinstance(layout, dict) or not isinstance(layout.get("fingerprint", ""), str | None):
        raise wire.ProtocolError(f"status reply: 'layout' must be an object with a fingerprint, got {layout!r:.80}")
    policy = status.get("policy", {})
    if not isinstance(policy, dict):
        raise wire.ProtocolError(f"status reply: expected a 'policy' object, got {policy!r:.80}")
    floor = policy.get("min_secagg_clients", 2)
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 2:
        raise wire.ProtocolError(
            f"status reply: policy 'min_secagg_clients' must be an integer >= 2, got {floor!r:.80}"
        )
    return status


def _described_workload(workload: Any) -> None:
    """A status reply's workload description (name, model names, queries with dim and bound), checked."""
    if not isinstance(workload, dict) or not isinstance(workload.get("name"), str):
        raise wire.ProtocolError(f"status reply: expected a workload object with a 'name', got {workload!r:.80}")
    models, queries = workload.get("models"), workload.get("queries")
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise wire.ProtocolError(f"status reply: workload 'models' must be a list of names, got {models!r:.80}")
    if not isinstance(queries, dict):
        raise wire.ProtocolError(f"status reply: workload 'queries' must be an object, got {queries!r:.80}")
    for query in queries.values():
        dim = query.get("dim") if isinstance(query, dict) else None
        bound = query.get("l2_bound") if isinstance(query, dict) else None
        ok_dim = isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1
        ok_bound = (
            isinstance(bound, (int, float)) and not isinstance(bound, bool) and math.isfinite(bound) and bound > 0
        )
        if not (ok_dim and ok_bound):
            raise wire.ProtocolError(
                f"status reply: a workload query must have an integer 'dim' >= 1 and a finite 'l2_bound' > 0, "
                f"got {query!r:.80}"
            )


def _workload_matches(cfg: CoordinatorConfig, described: dict[str, Any]) -> list[str]:
    """Why a client's workload cannot answer this run (its model, queries and their dims), or nothing.

    The reasons quote only the coordinator's own names, never the client's text. A status without a
    workload (an agent from before workloads) is not checked here; its per-request checks still refuse.
    """
    ours = cfg.load_workload()
    why: list[str] = []
    if cfg.task == "gradient" and cfg.model not in described["models"]:
        why.append(f"model {cfg.model!r} asked; a client's workload does not register it")
    needed = set()
    if cfg.task == "indicator":
        needed.add("column")  # the analysts' counting queries (coordinator.analysts)
    if cfg.plateau_every:
        needed.add("correct")
    for name in sorted(needed):
        theirs = described["queries"].get(name)
        if theirs is None:
            why.append(f"query {name!r} asked; a client's workload does not register it")
        elif name in ours.queries and theirs["dim"] != ours.queries[name].dim:
            dim = ours.queries[name].dim
            why.append(f"query {name!r} of dim {dim} asked; a client's workload declares another dim")
    return why


def _worst_case_threshold(cfg: CoordinatorConfig, ledgers: list[dict[str, Any]]) -> float:
    """The smallest GDP threshold among the clients, each at its own (epsilon, delta) less its own monitor share.

    What worst-case accounting would allow the weakest client (``worst_case_queries``); the
    reservation rule is the clients' own (privacy.md §7): (epsilon - epsilon_svt, delta) for the
    SVT, T - L / sigma_m^2 for the tree.
    """
    thresholds = []
    for lg in ledgers:
        monitor = lg["params"]["monitor"]
        eps = float(lg["epsilon"]) - (float(monitor["epsilon_svt"]) if cfg.monitor == "svt" else 0.0)
        try:
            filt = GaussianFilter.gdp(epsilon=eps, delta=float(lg["delta"]))
            if cfg.monitor == "tree":
                filt = filt.reserve(squared_budget=float(monitor["squared_cost"]))
        except PrivacyParameterError as exc:
            raise EnrolmentError(
                f"the clients did not accept this run: a client's budget ({lg['epsilon']}, {lg['delta']}) "
                f"leaves nothing after its monitor reservation: {exc}"
            ) from exc
        thresholds.append(filt.threshold)
    return min(thresholds)


def enrol(transport: Transport, cfg: CoordinatorConfig) -> Enrolment:
    """Ask every node what it accepted; refuse to run when a client's ledger does not cover the run.

    A client whose ledger is fixed to another trust mode, unit or monitor would refuse every
    request; a monitor the clients did not reserve would be an unaccounted release
    (privacy.md §7), so the run does not start. A client whose status does not decode, or whose
    ledger runs the realisation filter over records (privacy.md §6), is left out and counted by
    cause in ``excluded``; error replies are counted by code name, never by the client's text.
    """
    nodes = transport.node_ids(cfg.num_nodes, timeout=cfg.enrol_timeout)
    # A run that sends a model asks each client for that model's parameter layout as its workload builds it.
    uses_model = cfg.task == "gradient" or bool(cfg.plateau_every)
    named = (cfg.model, cfg.canonical_model_args) if uses_model else (None, None)
    status_request = wire.StatusRequest(f"{cfg.run_id}:status", cfg.run_id, 0, *named)
    payloads = {node: wire.encode_request(status_request) for node in nodes}
    got = transport.send(wire.STATUS, payloads, timeout=cfg.round_timeout)
    excluded: Counter[str] = Counter(got.errors)
    if got.missing:
        excluded["missing"] += got.missing
    statuses: dict[int, dict[str, Any]] = {}
    for node, (config, arrays) in got.replies.items():
        try:
            status = _accepted(wire.StatusReply.decode(config, arrays).parsed())
        except wire.ProtocolError:
            excluded["malformed-status"] += 1
            continue
        if status["ledger"]["filter"] == "realisation" and status["ledger"]["unit"] == "record":
            # privacy.md §6: a client's records share one noise draw, so the realised loss one record's
            # filter reads depends on the other records' data; their stopping times leak it. Not private.
            excluded["realisation-record"] += 1
            continue
        statuses[node] = status
    if not statuses:
        raise EnrolmentError(f"no client enrolled: {dict(excluded)}")
    mismatches: list[str] = []
    want_layout = model_layout(cfg) if uses_model else None
    for status in statuses.values():
        ledger = status["ledger"]
        for key, want in (("trust", cfg.trust), ("unit", cfg.unit)):
            if ledger.get(key) != want:
                mismatches.append(f"{key} {want!r} asked; a client's ledger is fixed to {ledger.get(key)!r}")
        why = _monitor_matches(cfg, ledger["params"]["monitor"])
        if why:
            mismatches.append(why)
        if "workload" in status:
            mismatches.extend(_workload_matches(cfg, status["workload"]))
        if uses_model and "workload" in status and status.get("layout", {}).get("fingerprint") != want_layout:
            mismatches.append(
                f"model {cfg.model!r} with {cfg.model_args} asked; a client's workload builds it with another "
                "parameter layout (names, shapes, dtypes)"
            )
    if mismatches:
        raise EnrolmentError("the clients did not accept this run: " + "; ".join(sorted(set(mismatches))))
    ledgers = [s["ledger"] for s in statuses.values()]
    epsilon = max(float(lg["epsilon"]) for lg in ledgers)
    delta = max(float(lg["delta"]) for lg in ledgers)
    filters = sorted({str(lg["filter"]) for lg in ledgers})
    monitors = [lg["params"]["monitor"] for lg in ledgers]
    monitor_reserved: dict[str, Any] = {"kind": cfg.monitor}
    units = sum(int(lg["n_units"]) for lg in ledgers)
    if units != cfg.n_public:
        raise EnrolmentError(
            f"n_public: the run divides by {cfg.n_public} enrolled units; the {len(statuses)} enrolled clients "
            f"hold {units} (set n_public to the number of enrolled units)"
        )
    if cfg.monitor == "svt":
        monitor_reserved.update(
            epsilon_svt=cfg.monitor_epsilon,
            epsilon_threshold=cfg.monitor_epsilon / 2,
            epsilon_query=cfg.monitor_epsilon / 2,
            threshold=cfg.monitor_threshold,
            rule="split (epsilon - epsilon_svt, delta) for the filter and (epsilon_svt, 0) for the SVT",
        )
    elif cfg.monitor == "tree":
        monitor_reserved.update(
            noise_std=min(float(m["noise_std"]) for m in monitors),
            levels=tree_levels(cfg.rounds),  # the nodes a run of this length reads; clients may report more
            squared_cost=max(float(m["squared_cost"]) for m in monitors),
            max_rounds=min(int(m["max_rounds"]) for m in monitors),
            threshold=cfg.monitor_threshold,
            rule="T <- T - L / sigma_m^2 in every unit's filter",
        )
    worst_threshold = _worst_case_threshold(cfg, ledgers)
    secagg = _secagg_settings(cfg, statuses, monitor_reserved) if cfg.trust == "secagg" else None
    privacy = {
        "epsilon": epsilon,
        "delta": delta,
        "filter": filters[0] if len(filters) == 1 else filters,
        "unit": cfg.unit,
        "trust": cfg.trust,
        "monitor_reserved": monitor_reserved,
        "clients_enrolled": len(statuses),
        "statement": _statement(cfg, epsilon, delta, filters, len(statuses), secagg),
    }
    if secagg is not None:
        privacy["secagg"] = {
            "min_clients": secagg.min_clients,
            "scale_bits": secagg.scale_bits,
            "noise_share": f"N(0, sigma^2 / {secagg.min_clients}) per client",
            "rule": "each client charges ||v|| + sqrt(d) / 2^scale_bits against sigma when its masked input leaves",
        }
    return Enrolment(
        nodes=sorted(statuses),
        units_enrolled=units,
        privacy=privacy,
        worst_case_threshold=worst_threshold,
        excluded=dict(excluded),
        secagg=secagg,
    )


def _secagg_settings(
    cfg: CoordinatorConfig, statuses: dict[int, dict[str, Any]], monitor_reserved: dict[str, Any]
) -> SecaggSettings:
    """m and the fixed point of a secagg run; refused when the enrolled clients cannot form a sum of m."""
    m = cfg.secagg_min_clients or default_min_clients(len(statuses))
    if m > len(statuses):
        raise EnrolmentError(f"secagg: m = {m} clients per sum asked; only {len(statuses)} clients enrolled")
    if 2 * m <= len(statuses):
        # The clients refuse such a roster: with 2m <= n two disjoint survivor sets could each gather
        # m consistency signatures (protocol.secagg.Roster.authenticate).
        raise EnrolmentError(
            f"secagg: m = {m} clients per sum asked of {len(statuses)} enrolled; expected 2m > n (m >= "
            f"{len(statuses) // 2 + 1})"
        )
    floor = max(int(s.get("policy", {}).get("min_secagg_clients", 2)) for s in statuses.values())  # checked: _accepted
    if m < floor:
        raise EnrolmentError(f"the clients did not accept this run: secagg m = {m} asked; a client requires >= {floor}")
    levels = 0
    if cfg.monitor == "tree":
        # The masked reports are summed coordinate by coordinate: every client must report the same tree.
        found = {s["ledger"]["params"]["monitor"].get("levels") for s in statuses.values()}
        if len(found) != 1 or not isinstance(next(iter(found)), int) or next(iter(found)) < tree_levels(cfg.rounds):
            raise EnrolmentError(
                f"the clients did not accept this run: secagg sums the tree monitor's reports, so every client must "
                f"reserve the same tree of >= {tree_levels(cfg.rounds)} levels; found levels {sorted(map(str, found))}"
            )
        levels = int(next(iter(found)))
        # Each client adds N(0, sigma_m^2 / m) to the masked tree; a node of the sum carries the
        # average of the clients' sigma_m^2. A client that reserved L / sigma_m^2 for a larger
        # sigma_m than the others' would pay more than it reserved: all must reserve the same.
        sigmas = {s["ledger"]["params"]["monitor"].get("noise_std") for s in statuses.values()}
        if len(sigmas) != 1:
            raise EnrolmentError(
                "the clients did not accept this run: secagg sums the tree monitor's node noise, so every client "
                f"must reserve the same node noise std sigma_m; found {sorted(map(str, sigmas))}"
            )
    return SecaggSettings(
        min_clients=m,
        scale_bits=cfg.secagg_scale_bits,
        monitor_noise_std=float(monitor_reserved.get("noise_std", 0.0)),
        monitor_levels=levels,
    )


def _statement(
    cfg: CoordinatorConfig,
    epsilon: float,
    delta: float,
    filters: list[str],
    clients: int,
    secagg: SecaggSettings | None = None,
) -> str:
    who = "Every record held by" if cfg.unit == "record" else "Every one of"
    where = (
        "each client added its own Gaussian noise before anything left it (local trust)"
        if cfg.trust == "local"
        else "the coordinator added the Gaussian noise once to the sum (central trust)"
    )
    if secagg is not None:
        m = secagg.min_clients
        where = (
            f"each client added N(0, sigma^2/{m}) to its input and masked it, charging its filter at the total "
            f"noise sigma when the masked input left; the coordinator learned only sums of at least m = {m} "
            "clients' inputs (secure aggregation), so the guarantee holds whenever at least m honest clients "
            "took part in each sum, even against a coordinator that deviates: the clients accept only rosters "
            "signed by their trusted peers, answer only the request every member signed, and unmask only a "
            "survivor set that m of them signed, with 2m > n (secagg trust, active-adversary SecAgg)"
        )
    monitor = {
        "none": "no active-set monitor ran",
        "svt": f"the sparse-vector monitor (epsilon_svt = {cfg.monitor_epsilon:g}) is included",
        "tree": "the binary-tree monitor's cost was reserved in every filter and is included",
    }[cfg.monitor]
    local = ""
    if cfg.task == "gradient" and cfg.local_steps:
        local = (
            f"; each round every client sent its model update after {cfg.local_steps} local SGD steps "
            "(DP-FedAvg), clipped to its remaining budget and charged as one Gaussian release, as a gradient would be"
        )
    return (
        f"{who} the {clients} enrolled clients has ({epsilon:g}, {delta:g})-differential privacy for everything "
        f"this run released, enforced by its own {'/'.join(filters)} filter on its realised spend; {where}; "
        f"{monitor}{local}."
    )


# --- rounds --------------------------------------------------------------------------------


@dataclass
class RoundLog:
    """One line of ``rounds.jsonl``: aggregates only, never a node id, a per-client value or a client's text."""

    round: int
    task: str
    replies: int
    errors: dict[str, int]  # errors_by_code, plus the coordinator's checks and the plateau and monitor requests
    errors_by_code: dict[str, int]  # the release request's failed replies by code name (secagg: every step's)
    missing: int
    noise_std: float  # sigma of each release (per client in local trust)
    release_noise_std: float  # std of the noise in the released sum
    duration_s: float
    monitor: dict[str, Any] = field(default_factory=dict)
    secagg: dict[str, Any] = field(default_factory=dict)  # clients left after each step, or why it aborted
    metrics: dict[str, float | None] = field(default_factory=dict)
    query: dict[str, Any] | None = None
    answer: float | None = None
    bound: float | None = None


def _released_sum(
    cfg: CoordinatorConfig, got: RoundReplies, size: int, rng: np.random.Generator, errors: Counter[str]
) -> tuple[np.ndarray, float]:
    """The round's release: the decoded contributions summed, plus N(0, sigma^2) once in central trust.

    Returns the sum and the variance of the noise in it (the clients' noise in local trust).
    """
    total = np.zeros(size, dtype=np.float64)
    noise_var = 0.0
    for config, arrays in got.replies.values():
        try:
            reply = wire.ContributionReply.decode(config, arrays)
        except wire.ProtocolError:
            errors["malformed-reply"] += 1
            continue
        if reply.status == wire.REPLY_EXHAUSTED:  # central trust only: contributes nothing
            continue
        if reply.total.size != size:
            errors["wrong-shape"] += 1
            continue
        total += reply.total
        noise_var += reply.noise_added**2
    if cfg.trust == "central":
        total += rng.normal(0.0, cfg.noise_std, size)
        noise_var = cfg.noise_std**2
    return total, noise_var


def _private_accuracy(
    transport: Transport,
    cfg: CoordinatorConfig,
    nodes: list[int],
    rnd: int,
    params: np.ndarray,
    rng: np.random.Generator,
    errors: Counter[str],
    secagg: SecaggSettings | None = None,
) -> float:
    """Noisy count of correctly classified training records / n (a counting release every filter charges)."""
    query = Query("correct")
    if secagg is not None:
        masked = _secagg(
            transport,
            cfg,
            secagg,
            nodes,
            rnd,
            "plateau",
            wire.INDICATOR,
            lambda node, s: _indicator_request(cfg, "plateau", rnd, query, params, secagg=s),
            1,
            cfg.noise_std,
        )
        for name, count in masked.replies.errors.items():
            errors[f"plateau-{name}"] += count
        return math.nan if masked.total is None else float(masked.total[0]) / cfg.n_public
    payloads = {node: wire.encode_request(_indicator_request(cfg, "plateau", rnd, query, params)) for node in nodes}
    got = transport.send(wire.INDICATOR, payloads, timeout=cfg.round_timeout)
    plateau_errors: Counter[str] = Counter(got.errors)
    total, _ = _released_sum(cfg, got, 1, rng, plateau_errors)
    for name, count in plateau_errors.items():
        errors[f"plateau-{name}"] += count
    return float(total[0]) / cfg.n_public


def _monitor_round(
    transport: Transport,
    cfg: CoordinatorConfig,
    nodes: list[int],
    rnd: int,
    monitor: SvtMonitor | TreeMonitor,
    errors: Counter[str],
    secagg: SecaggSettings | None = None,
) -> Verdict:
    def request(secagg_input: wire.SecaggInput | None = None) -> wire.MonitorRequest:
        # secagg: the session's node noise std, the one every client reserved (checked at enrolment)
        noise = secagg.monitor_noise_std if secagg is not None else None
        return wire.MonitorRequest(f"{cfg.run_id}:monitor:r{rnd}", cfg.run_id, rnd, cfg.trust, secagg_input, noise)

    if secagg is not None:
        assert isinstance(monitor, TreeMonitor)
        masked = _secagg(
            transport,
            cfg,
            secagg,
            nodes,
            rnd,
            "monitor",
            wire.MONITOR,
            lambda node, s: request(s),
            secagg.monitor_levels,
            secagg.monitor_noise_std,
        )
        for name, count in masked.replies.errors.items():
            errors[f"monitor-{name}"] += count
        # An aborted session leaves round t's nodes at 0 (their halts are lost: the estimate errs towards
        # "more active", as with a client that misses a round in local trust).
        summed = [] if masked.total is None else [(masked.total[: monitor.levels], math.sqrt(masked.noise_var))]
        return monitor.add_round(rnd, summed)
    payloads = {node: wire.encode_request(request()) for node in nodes}
    got = transport.send(wire.MONITOR, payloads, timeout=cfg.round_timeout)
    for name, count in got.errors.items():
        errors[f"monitor-{name}"] += count
    reports: list[tuple[np.ndarray, float]] = []
    for config, arrays in got.replies.values():
        try:
            reply = wire.ContributionReply.decode(config, arrays)
        except wire.ProtocolError:
            errors["monitor-malformed-reply"] += 1
            continue
        reports.append((reply.total, reply.noise_added))
    if isinstance(monitor, SvtMonitor):
        if len(reports) < len(nodes) or any(r[0].size != 1 for r in reports):
            # A partial count would read as units leaving. Skipping the check depends on replies
            # only (not on the count), so it costs nothing; the SVT answers at a later round.
            errors["monitor-skipped-partial"] += 1
            return Verdict(below=False)
        return monitor.check(float(sum(float(r[0][0]) for r in reports)))
    good = [(r[0][: monitor.levels], r[1]) for r in reports if r[0].size >= monitor.levels]
    if len(good) < len(reports):
        errors["monitor-wrong-shape"] += len(reports) - len(good)
    return monitor.add_round(rnd, good)


def _secagg(
    transport: Transport,
    cfg: CoordinatorConfig,
    settings: SecaggSettings,
    nodes: list[int],
    rnd: int,
    purpose: str,
    kind: str,
    build: Callable[[int, wire.SecaggInput | None], wire.Request],
    size: int,
    noise_std: float,
) -> SecaggRound:
    """One secure-aggregation session of this run (coordinator/secagg.py)."""
    return secagg_release(
        transport,
        run_id=cfg.run_id,
        rnd=rnd,
        purpose=purpose,
        nodes=nodes,
        settings=settings,
        kind=kind,
        build=build,
        size=size,
        noise_std=noise_std,
        timeout=cfg.round_timeout,
    )


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
    rng = noise_rng(cfg)
    params = np.zeros(1, dtype=np.float32)
    if cfg.task == "gradient":  # first: model_args the model does not take fail before any client is asked
        model = cfg.load_workload().build_model(cfg.model, seed=cfg.seed, **json.loads(cfg.model_args))
        params = flatten_parameters(model)
        params = params.astype(np.float32)
    elif analyst is None:
        analyst = build_analyst(cfg.analyst, rounds=cfg.rounds, columns=cfg.query_columns or cfg.rounds)
    enrolment = enrol(transport, cfg)  # before any output is written: a refused run leaves no partial files
    writer = RunWriter(cfg.output_dir)
    nodes = enrolment.nodes
    monitor: SvtMonitor | TreeMonitor | None = None
    if cfg.monitor == "svt":
        monitor = SvtMonitor(threshold=cfg.monitor_threshold, epsilon=cfg.monitor_epsilon, rng=rng)
    elif cfg.monitor == "tree":
        monitor = TreeMonitor(threshold=cfg.monitor_threshold, n_units=cfg.n_public, levels=tree_levels(cfg.rounds))
    progress = Progress(cfg.rounds, stream=progress_stream, enabled=cfg.progress)
    answers: list[Answer] = []
    logs: list[RoundLog] = []
    errors_total: Counter[str] = Counter()
    metrics: dict[str, float] = {}
    checkpoint: str | None = None
    stopped_because = "max_rounds"
    plateau_best, plateau_stale = -math.inf, 0

    for rnd in range(1, cfg.rounds + 1):
        t0 = time.monotonic()
        query: Query | None = None
        if cfg.task == "indicator":
            assert analyst is not None
            query = analyst(list(answers))
            if query is None:
                stopped_because = "analyst_done"
                break
        kind = wire.GRADIENT if cfg.task == "gradient" else wire.INDICATOR
        size = params.size if cfg.task == "gradient" else 1
        masked: SecaggRound | None = None
        total: np.ndarray | None
        if enrolment.secagg is not None:
            masked = _secagg(
                transport,
                cfg,
                enrolment.secagg,
                nodes,
                rnd,
                cfg.task,
                kind,
                functools.partial(_node_request, cfg, rnd, params, query),
                size,
                cfg.noise_std,
            )
            got = masked.replies
            errors: Counter[str] = Counter(got.errors)
            total, noise_var = masked.total, masked.noise_var
        else:
            payloads = {node: wire.encode_request(_request(cfg, rnd, params, query)) for node in nodes}
            got = transport.send(kind, payloads, timeout=cfg.round_timeout)
            errors = Counter(got.errors)
            total, noise_var = _released_sum(cfg, got, size, rng, errors)
        log = RoundLog(
            round=rnd,
            task=cfg.task,
            replies=len(got.replies),
            errors={},  # filled once the round's plateau and monitor requests are in
            errors_by_code=dict(got.errors),
            missing=got.missing,
            noise_std=cfg.noise_std,
            release_noise_std=math.sqrt(noise_var),
            duration_s=0.0,
            secagg={} if masked is None else masked.counts,
        )
        if cfg.task == "gradient":
            if total is not None:  # None: the secagg session released nothing, the model stays
                if cfg.local_steps:  # DP-FedAvg: the noisy sum of clipped updates, averaged by the public n
                    step = params.astype(np.float64) + cfg.server_lr * total / cfg.n_public
                else:
                    step = params.astype(np.float64) - cfg.learning_rate * total / cfg.n_public
                if np.all(np.isfinite(step)) and np.all(np.abs(step) <= np.finfo(np.float32).max):
                    params = step.astype(np.float32)
                else:  # a reply far out of range (a faulty or hostile client); post-processing, no privacy cost
                    errors["non-finite-step"] += 1
            if cfg.plateau_every and rnd % cfg.plateau_every == 0:
                accuracy = _private_accuracy(transport, cfg, nodes, rnd, params, rng, errors, enrolment.secagg)
                # JSON has no NaN: an aborted secagg count is logged as null.
                log.metrics["train_accuracy_private"] = None if math.isnan(accuracy) else accuracy
                if math.isnan(accuracy):
                    pass  # an aborted secagg count says nothing: neither better nor stale
                elif accuracy > plateau_best + cfg.plateau_min_delta:
                    plateau_best, plateau_stale = accuracy, 0
                else:
                    plateau_stale += 1
            if evaluate is not None and cfg.eval_every and rnd % cfg.eval_every == 0:
                metrics = evaluate(params)
                log.metrics.update(metrics)
            if cfg.checkpoint_every and rnd % cfg.checkpoint_every == 0:
                checkpoint = writer.checkpoint(rnd, params)
        elif total is not None:
            assert query is not None
            bound = gaussian_bound(noise_std=log.release_noise_std, queries=cfg.rounds, beta=cfg.accuracy_beta)
            answer = Answer(rnd, query, float(total[0]), bound)
            answers.append(answer)
            log.query, log.answer, log.bound = asdict(query), answer.value, bound
        else:
            log.query = asdict(query) if query is not None else None  # asked, not answered: nothing released
        verdict = None
        if monitor is not None:
            verdict = _monitor_round(transport, cfg, nodes, rnd, monitor, errors, enrolment.secagg)
            log.monitor = {
                "kind": cfg.monitor,
                "below": verdict.below,
                "active_estimate": verdict.active_estimate,
                "estimate_std": verdict.estimate_std,
            }
        log.errors = dict(errors)
        log.duration_s = time.monotonic() - t0
        errors_total.update(errors)
        logs.append(log)
        writer.round(asdict(log))
        progress.update(
            rnd,
            {
                "active~": None if verdict is None else verdict.active_estimate,
                "below": None if verdict is None else verdict.below,
                **{k: v for k, v in log.metrics.items()},
                "errors": sum(errors.values()) or None,
            },
        )
        if verdict is not None and verdict.below:
            stopped_because = "monitor"
            break
        if cfg.plateau_every and plateau_stale >= cfg.plateau_patience:
            stopped_because = "plateau"
            break

    if cfg.task == "gradient" and logs:
        if evaluate is not None and not set(logs[-1].metrics) - {"train_accuracy_private"}:
            metrics = evaluate(params)
            logs[-1].metrics.update(metrics)
        if cfg.output_dir:
            checkpoint = writer.checkpoint(logs[-1].round, params)
    summary: dict[str, Any] = {
        "run_id": cfg.run_id,
        "task": cfg.task,
        "privacy": enrolment.privacy,
        "rounds_completed": len(logs),
        "stopped_because": stopped_because,
        "final_metrics": metrics,
        "n_public": cfg.n_public,
        "units_enrolled": enrolment.units_enrolled,
        "clients_excluded": enrolment.excluded,
        "errors_total": dict(errors_total),
        "duration_s": time.monotonic() - started,
        "config": {k: v for k, v in asdict(cfg).items() if k != "noise_seed"},
    }
    if cfg.task == "indicator":
        sensitivity = min(cfg.l2_clip, 1.0) if cfg.unit == "record" else cfg.l2_clip
        summary["queries_answered"] = len(answers)
        summary["worst_case_queries"] = rounds_within(
            enrolment.worst_case_threshold, (sensitivity / cfg.noise_std) ** 2
        )
        summary["accuracy"] = {
            "beta": cfg.accuracy_beta,
            "rule": "answer - (sum of the active units' clipped indicators) is within bound, "
            "for all answers together with probability >= 1 - beta (Gaussian tail, union bound over rounds)",
        }
        summary["answers"] = [
            {"round": a.round, **asdict(a.query), "value": a.value, "bound": a.bound} for a in answers
        ]
        summary["final_metrics"] = {"queries_answered": float(len(answers))}
    if checkpoint:
        summary["checkpoint"] = checkpoint
    writer.summary(summary)
    progress.finish(
        f"run {cfg.run_id}: {len(logs)} rounds, stopped because {stopped_because}; "
        f"({enrolment.privacy['epsilon']:g}, {enrolment.privacy['delta']:g})-DP per {cfg.unit}"
    )
    if cfg.task == "gradient":
        summary["parameters"] = params
    summary["rounds"] = [asdict(log) for log in logs]
    return summary


def _common(cfg: CoordinatorConfig, purpose: str, rnd: int) -> dict[str, Any]:
    """Fields every contribution request of this run carries.

    The id names the run, purpose and round, never Flower's node id: the simulation engine draws
    node ids at random, and a seeded client (noise-seed) mixes the id into its noise, so an id
    with the node in it would make seeded runs differ from one run to the next. Each client
    keeps its own ledger, so the id need not be unique across clients.
    """
    return {
        "request_id": f"{cfg.run_id}:{purpose}:r{rnd}",
        "run_id": cfg.run_id,
        "round": rnd,
        "noise_std": cfg.noise_std,
        "l2_clip": cfg.l2_clip,
        "trust": cfg.trust,
        "unit": cfg.unit,
    }


@functools.lru_cache(maxsize=8)
def _layout_of(workload: str, model: str, model_args: str) -> str:
    import torch

    from protocol.workload import load_workload

    with torch.device("meta"):  # shapes only
        return layout_fingerprint(load_workload(workload).build_model(model, **json.loads(model_args)))


def model_layout(cfg: CoordinatorConfig) -> str:
    """The parameter layout of the run's model (protocol.workload.layout_fingerprint), sent with every model."""
    return _layout_of(cfg.workload, cfg.model, cfg.canonical_model_args)


def _node_request(
    cfg: CoordinatorConfig, rnd: int, params: np.ndarray, query: Query | None, node: int, s: wire.SecaggInput | None
) -> wire.Request:
    """The round's request for one node of a secagg session (the same for every node but its SecaggInput)."""
    return _request(cfg, rnd, params, query, secagg=s)


def _request(
    cfg: CoordinatorConfig,
    rnd: int,
    params: np.ndarray,
    query: Query | None,
    secagg: wire.SecaggInput | None = None,
) -> wire.GradientRequest | wire.IndicatorRequest:
    """The round's request: the model for a gradient round, or the analyst's counting query."""
    if cfg.task == "gradient":
        local: dict[str, Any] = {}
        if cfg.local_steps:
            local = {
                "local_steps": cfg.local_steps,
                "local_lr": float(cfg.local_lr),
                "local_batch_size": cfg.local_batch_size,
            }
        return wire.GradientRequest(
            **_common(cfg, "gradient", rnd),
            model=cfg.model,
            model_args=cfg.canonical_model_args,
            parameters=params,
            secagg=secagg,
            layout=model_layout(cfg),
            **local,
        )
    assert query is not None
    return _indicator_request(cfg, "indicator", rnd, query, secagg=secagg)


def _indicator_request(
    cfg: CoordinatorConfig,
    purpose: str,
    rnd: int,
    query: Query,
    params: np.ndarray | None = None,
    secagg: wire.SecaggInput | None = None,
) -> wire.IndicatorRequest:
    """A counting query; the 'correct' predicate also carries the model it evaluates."""
    model: dict[str, Any] = {}
    if params is not None:
        model = {
            "model": cfg.model,
            "model_args": cfg.canonical_model_args,
            "parameters": params,
            "layout": model_layout(cfg),
        }
    return wire.IndicatorRequest(
        **_common(cfg, purpose, rnd),
        predicate=query.predicate,
        column=query.column,
        value=float(query.value),
        **model,
        secagg=secagg,
    )
