"""Enrolment: who takes part, what every client accepted, and whether that covers the run.

Every node is asked for its status (coordinator/status.py). A client whose ledger is fixed to
another trust mode, unit or monitor would refuse every request; a monitor the clients did not
reserve would be an unaccounted release (privacy.md §7); so the run does not start. The privacy
statement (coordinator/statement.py), the worst-case threshold and, in secagg trust, the session
settings (coordinator/secagg.py) follow from what the enrolled clients accepted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.secagg import SecaggSettings, default_min_clients
from coordinator.statement import statement
from coordinator.status import ClientStatus, LedgerTerms, MonitorTerms, WorkloadTerms
from coordinator.tasks import TASKS, Needs, model_layout
from coordinator.transport import Transport
from protocol import messages as wire
from protocol.errors import FedfilterError
from protocol.filters import GaussianFilter, rounds_within
from protocol.releases import tree_levels
from protocol.validate import PrivacyParameterError


class EnrolmentError(FedfilterError, RuntimeError):
    """The clients' accepted configuration does not cover what the run would do."""


@dataclass(frozen=True)
class Enrolment:
    """Who takes part and what every one of them accepted (public configuration from their status replies)."""

    nodes: list[int]
    units_enrolled: int
    privacy: dict[str, Any]
    worst_case_threshold: float  # the GDP threshold at the weakest client's (epsilon, delta), monitor reserved
    excluded: dict[str, int] = field(default_factory=dict)
    secagg: SecaggSettings | None = None  # secagg trust only

    def worst_case_rounds(self, squared_cost: float) -> int:
        """How many releases of this squared cost worst-case accounting would allow the weakest client."""
        return rounds_within(self.worst_case_threshold, squared_cost)


def _monitor_matches(cfg: CoordinatorConfig, reserved: MonitorTerms) -> str | None:
    """Why a client's reservation does not cover the run's monitor, or None when it does."""
    if reserved.kind != cfg.monitor:
        return f"monitor {cfg.monitor!r} asked; the client reserved {reserved.kind!r}"
    if cfg.monitor == "svt" and not float(reserved.epsilon_svt) >= cfg.monitor_epsilon:
        return f"svt epsilon {cfg.monitor_epsilon} asked; the client reserved {reserved.epsilon_svt}"
    if cfg.monitor == "tree" and int(reserved.max_rounds) < cfg.rounds:
        return f"{cfg.rounds} monitor rounds asked; the client's tree covers {reserved.max_rounds}"
    return None


def _workload_matches(cfg: CoordinatorConfig, needs: Needs, described: WorkloadTerms) -> list[str]:
    """Why a client's workload cannot answer this run (its model, queries and their dims), or nothing.

    The reasons quote only the coordinator's own names, never the client's text. A status without a
    workload (an agent from before workloads) is not checked here; its per-request checks still refuse.
    """
    ours = cfg.load_workload()
    why: list[str] = []
    if needs.model and cfg.model not in described.models:
        why.append(f"model {cfg.model!r} asked; a client's workload does not register it")
    for name in sorted(needs.queries):
        theirs = described.query_dims.get(name)
        if theirs is None:
            why.append(f"query {name!r} asked; a client's workload does not register it")
        elif name in ours.queries and theirs != ours.queries[name].dim:
            dim = ours.queries[name].dim
            why.append(f"query {name!r} of dim {dim} asked; a client's workload declares another dim")
    return why


def _mismatches(cfg: CoordinatorConfig, needs: Needs, statuses: dict[int, ClientStatus]) -> list[str]:
    """Why the enrolled clients do not accept this run (their ledgers, monitors and workloads), or nothing."""
    mismatches: list[str] = []
    want_layout = model_layout(cfg) if needs.model else None
    for status in statuses.values():
        ledger = status.ledger
        for key, want, have in (("trust", cfg.trust, ledger.trust), ("unit", cfg.unit, ledger.unit)):
            if have != want:
                mismatches.append(f"{key} {want!r} asked; a client's ledger is fixed to {have!r}")
        why = _monitor_matches(cfg, ledger.monitor)
        if why:
            mismatches.append(why)
        if status.workload is not None:
            mismatches.extend(_workload_matches(cfg, needs, status.workload))
        if needs.model and status.workload is not None and status.layout_fingerprint != want_layout:
            mismatches.append(
                f"model {cfg.model!r} with {cfg.model_args} asked; a client's workload builds it with another "
                "parameter layout (names, shapes, dtypes)"
            )
    return mismatches


def _worst_case_threshold(cfg: CoordinatorConfig, ledgers: list[LedgerTerms]) -> float:
    """The smallest GDP threshold among the clients, each at its own (epsilon, delta) less its own monitor share.

    What worst-case accounting would allow the weakest client (``worst_case_queries``); the
    reservation rule is the clients' own (privacy.md §7): (epsilon - epsilon_svt, delta) for the
    SVT, T - L / sigma_m^2 for the tree.
    """
    thresholds = []
    for lg in ledgers:
        eps = float(lg.epsilon) - (float(lg.monitor.epsilon_svt) if cfg.monitor == "svt" else 0.0)
        try:
            filt = GaussianFilter.gdp(epsilon=eps, delta=float(lg.delta))
            if cfg.monitor == "tree":
                filt = filt.reserve(squared_budget=float(lg.monitor.squared_cost))
        except PrivacyParameterError as exc:
            raise EnrolmentError(
                f"the clients did not accept this run: a client's budget ({lg.epsilon}, {lg.delta}) "
                f"leaves nothing after its monitor reservation: {exc}"
            ) from exc
        thresholds.append(filt.threshold)
    return min(thresholds)


def _statuses(
    transport: Transport, cfg: CoordinatorConfig, needs: Needs
) -> tuple[dict[int, ClientStatus], Counter[str]]:
    """Every node's status that decodes, by node; the others counted by cause (error replies by code name)."""
    nodes = transport.node_ids(cfg.num_nodes, timeout=cfg.enrol_timeout)
    # A run that sends a model asks each client for that model's parameter layout as its workload builds it.
    named = (cfg.model, cfg.canonical_model_args) if needs.model else (None, None)
    status_request = wire.StatusRequest(f"{cfg.wire_run_id}:status", cfg.wire_run_id, 0, *named)
    payloads = {node: wire.encode_request(status_request) for node in nodes}
    got = transport.send(wire.STATUS, payloads, timeout=cfg.round_timeout)
    excluded: Counter[str] = Counter(got.errors)
    if got.missing:
        excluded["missing"] += got.missing
    statuses: dict[int, ClientStatus] = {}
    tags: set[str] = set()
    for node, (config, arrays) in got.replies.items():
        try:
            status = ClientStatus.from_json(wire.StatusReply.decode(config, arrays).description)
        except wire.ProtocolError:
            excluded["malformed-status"] += 1
            continue
        if status.ledger_tag is not None:
            # privacy.md §8: a second node answered from a ledger already enrolled would replay its stored
            # reply, uncharged, into the same sum: in central trust one exact sum counted twice under one noise.
            if status.ledger_tag in tags:
                excluded["duplicate-ledger"] += 1
                continue
            tags.add(status.ledger_tag)
        if status.ledger.filter == "realisation" and status.ledger.unit == "record":
            # privacy.md §6: a client's records share one noise draw, so the realised loss one record's
            # filter reads depends on the other records' data; their stopping times leak it. Not private.
            excluded["realisation-record"] += 1
            continue
        statuses[node] = status
    return statuses, excluded


def _monitor_reserved(cfg: CoordinatorConfig, monitors: list[MonitorTerms]) -> dict[str, Any]:
    """The monitor the run runs and what it costs every unit (the summary's ``monitor_reserved``)."""
    reserved: dict[str, Any] = {"kind": cfg.monitor}
    if cfg.monitor == "svt":
        reserved.update(
            epsilon_svt=cfg.monitor_epsilon,
            epsilon_threshold=cfg.monitor_epsilon / 2,
            epsilon_query=cfg.monitor_epsilon / 2,
            threshold=cfg.monitor_threshold,
            rule="split (epsilon - epsilon_svt, delta) for the filter and (epsilon_svt, 0) for the SVT",
        )
    elif cfg.monitor == "tree":
        reserved.update(
            noise_std=min(float(m.noise_std) for m in monitors),
            levels=tree_levels(cfg.rounds),  # the nodes a run of this length reads; clients may report more
            squared_cost=max(float(m.squared_cost) for m in monitors),
            max_rounds=min(int(m.max_rounds) for m in monitors),
            threshold=cfg.monitor_threshold,
            rule="T <- T - L / sigma_m^2 in every unit's filter",
        )
    return reserved


def enrol(transport: Transport, cfg: CoordinatorConfig) -> Enrolment:
    """Ask every node what it accepted; refuse to run when a client's ledger does not cover the run.

    A client whose ledger is fixed to another trust mode, unit or monitor would refuse every
    request; a monitor the clients did not reserve would be an unaccounted release
    (privacy.md §7), so the run does not start. A client whose status does not decode, or whose
    ledger runs the realisation filter over records (privacy.md §6), is left out and counted by
    cause in ``excluded``; error replies are counted by code name, never by the client's text.
    """
    needs = TASKS[cfg.task].needs(cfg)
    statuses, excluded = _statuses(transport, cfg, needs)
    if not statuses:
        raise EnrolmentError(f"no client enrolled: {dict(excluded)}")
    mismatches = _mismatches(cfg, needs, statuses)
    if mismatches:
        raise EnrolmentError("the clients did not accept this run: " + "; ".join(sorted(set(mismatches))))
    ledgers = [s.ledger for s in statuses.values()]
    epsilon = max(float(lg.epsilon) for lg in ledgers)
    delta = max(float(lg.delta) for lg in ledgers)
    filters = sorted({str(lg.filter) for lg in ledgers})
    units = sum(int(lg.n_units) for lg in ledgers)
    if units != cfg.n_public:
        raise EnrolmentError(
            f"n_public: the run divides by {cfg.n_public} enrolled units; the {len(statuses)} enrolled clients "
            f"hold {units} (set n_public to the number of enrolled units)"
        )
    monitor_reserved = _monitor_reserved(cfg, [lg.monitor for lg in ledgers])
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
        "statement": statement(
            cfg, epsilon=epsilon, delta=delta, filters=filters, clients=len(statuses), secagg=secagg
        ),
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
    cfg: CoordinatorConfig, statuses: dict[int, ClientStatus], monitor_reserved: dict[str, Any]
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
    floor = max(s.min_secagg_clients for s in statuses.values())
    if m < floor:
        raise EnrolmentError(f"the clients did not accept this run: secagg m = {m} asked; a client requires >= {floor}")
    levels = 0
    if cfg.monitor == "tree":
        # The masked reports are summed coordinate by coordinate: every client must report the same tree.
        found = {s.ledger.monitor.levels for s in statuses.values()}
        if len(found) != 1 or next(iter(found)) < tree_levels(cfg.rounds):
            raise EnrolmentError(
                f"the clients did not accept this run: secagg sums the tree monitor's reports, so every client must "
                f"reserve the same tree of >= {tree_levels(cfg.rounds)} levels; found levels {sorted(map(str, found))}"
            )
        levels = int(next(iter(found)))
        # Each client adds N(0, sigma_m^2 / m) to the masked tree; a node of the sum carries the
        # average of the clients' sigma_m^2. A client that reserved L / sigma_m^2 for a larger
        # sigma_m than the others' would pay more than it reserved: all must reserve the same.
        sigmas = {s.ledger.monitor.noise_std for s in statuses.values()}
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
