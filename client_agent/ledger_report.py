"""What a ledger says, for its owner: ``fedfilter ledger show``, ``verify``, ``requests`` and ``report``.

``verify`` replays every stored release through the filter the ledger was created with
and checks that the result equals the stored state (House style: replaying the ledger
through the filter rebuilds the state). ``requests`` and ``report`` replay the same way,
request by request (:func:`replay`), to say what each request cost and how every unit's
spend grew; the epsilon they give is the odometer's (:mod:`client_agent.odometer`), a bound
valid at any stopping time. Everything here reads the ledger only; nothing is sent anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from client_agent.high_water import HighWater, HighWaterError
from client_agent.high_water import default_path as default_high_water
from client_agent.ledger import DEFAULT_FEDERATION, Ledger, LedgerError
from client_agent.odometer import Odometer
from client_agent.records import (
    GaussianRecord,
    MonitorRecord,
    RealisationRecord,
    ReleaseRecord,
    contribution_from_arrays,
    release_from_arrays,
    round_of,
)
from client_agent.state import AgentState
from protocol.filters import FilterState, GaussianFilter, charge, rebuild
from protocol.validate import PrivacyParameterError


def _filter_of(ledger: Ledger) -> GaussianFilter | None:
    described = dict(ledger.config.params.get("filter", {}))  # type: ignore[call-overload]
    if ledger.config.filter == "realisation":
        return None
    return GaussianFilter(
        kind=str(described["filter"]),
        epsilon=float(described["epsilon"]),
        delta=float(described["delta"]),
        threshold=float(described["threshold"]),
        reserved=float(described["reserved"]),
        orders=tuple(described.get("orders", ())),
        conversion=str(described.get("conversion", "")),
    )


def odometer_of(ledger: Ledger) -> Odometer | None:
    """The odometer of a Gaussian-filter ledger (None for the realisation filter), its monitor's cost included."""
    filt = _filter_of(ledger)
    if filt is None:
        return None
    monitor = ledger.config.params.get("monitor")
    svt = 0.0
    if isinstance(monitor, dict) and monitor.get("kind") == "svt":
        svt = float(monitor.get("epsilon_svt", 0.0))
    return Odometer.for_filter(filt, extra_epsilon=svt)


def ledger_summary(path: Path, *, units: bool = False) -> dict[str, Any]:
    """The ledger's configuration and spend, as ``fedfilter ledger show --json`` prints it.

    Always: each federation's spend against its quota (:func:`federation_summaries`) and, for a Gaussian
    filter, the odometer's rule and its reading at the full budget. With ``units``: each unit's spend S,
    its share of the threshold T, whether it is stopped, and the odometer's epsilon so far at the ledger's
    delta (:mod:`client_agent.odometer`; for the realisation filter: the realised loss and its share of epsilon).
    """
    with Ledger.open_existing(path) as ledger:
        cfg = ledger.config
        state = AgentState.from_arrays(ledger.state())
        filt = _filter_of(ledger)
        if filt is not None:
            fstate = state.filter_state()
            spent, stopped, threshold = fstate.spent, fstate.stopped, filt.threshold
        else:
            rstate = state.realisation_state()
            described = dict(cfg.params["filter"])  # type: ignore[call-overload]
            spent, stopped = np.abs(rstate.loss), ~rstate.accepting
            threshold = float(described["epsilon"])
        odometer = odometer_of(ledger)
        summary: dict[str, Any] = {
            "path": str(path),
            "filter": cfg.filter,
            "unit": cfg.unit,
            "trust": cfg.trust,
            "epsilon": cfg.epsilon,
            "delta": cfg.delta,
            "units_total": int(cfg.n_units),
            "units_active": int((~stopped).sum()),
            "units_exhausted": int(stopped.sum()),
            "spent_max": float(spent.max()),
            "spent_mean": float(spent.mean()),
            "threshold": threshold,
            "monitor": cfg.params.get("monitor"),
            "requests_answered": ledger.requests_answered(),
            "odometer": None if odometer is None else odometer.describe(),
            "federations": federation_summaries(ledger, stopped=stopped, threshold=threshold),
        }
        if units:
            epsilon = None if odometer is None else odometer.epsilon(spent)
            summary["units"] = [
                {
                    "unit": i,
                    "spent": float(spent[i]),
                    "share": float(spent[i] / threshold),
                    "stopped": bool(stopped[i]),
                    "epsilon_so_far": None if epsilon is None else float(epsilon[i]),
                }
                for i in range(spent.size)
            ]
        return summary


def verify_ledger(path: Path, high_water: Path | None = None) -> list[str]:
    """Problems found (empty when the ledger is consistent). Opening already checks integrity and checksums.

    Also reported: objects in the schema that fedfilter did not create (a trigger can undo every
    commit), and a ledger behind its high-water mark (``high_water``, by default
    ``<ledger>.high-water`` when that file exists): restored or rolled back, its budget spent twice.
    """
    with Ledger.open_existing(path, allow_foreign=True) as ledger:
        findings = [f"schema: {name} was not created by fedfilter" for name in ledger.foreign_objects]
        mark_path = high_water if high_water is not None else default_high_water(path)
        if high_water is not None or mark_path.exists() or ledger.marked:
            try:
                rollback = HighWater(mark_path, path).check(
                    ledger.mark(), marked=ledger.marked, request_at=ledger.request_fingerprint
                )
            except HighWaterError as exc:
                rollback = str(exc)
            if rollback is not None:
                where = "" if high_water is not None or mark_path.exists() else " (kept elsewhere? pass --high-water)"
                findings.append(f"high-water mark {mark_path}: {rollback}{where}")
        return findings + _replay_problems(ledger)


def _replay_problems(ledger: Ledger) -> list[str]:
    """Where replaying the stored releases through the ledger's filter does not give the stored state."""
    problems: list[str] = []
    state = AgentState.from_arrays(ledger.state())
    releases: list[tuple[str, GaussianRecord | RealisationRecord | None]] = []
    for request_id, _, arrays in ledger.releases():
        try:
            releases.append((request_id, contribution_from_arrays(arrays)))
        except LedgerError as exc:  # a stored record that does not parse is a finding, not an abort
            problems.append(f"request {request_id!r}: {exc}")
    if problems:
        return problems
    filt = _filter_of(ledger)
    if filt is None:
        losses = np.zeros(ledger.config.n_units)
        for _, release in releases:
            if isinstance(release, RealisationRecord):
                losses = losses + release.losses
        if not np.allclose(losses, state.realisation_state().loss, rtol=0, atol=1e-12):
            problems.append("stored realised losses differ from the sum of the stored releases")
        return problems
    records = [rel.release(request_id) for request_id, rel in releases if isinstance(rel, GaussianRecord)]
    try:
        rebuilt = rebuild(filt, ledger.config.n_units, records)
    except ValueError as exc:
        return [f"replay failed: {exc}"]
    stored = state.filter_state()
    if not np.array_equal(rebuilt.spent, stored.spent):
        worst = int(np.argmax(np.abs(rebuilt.spent - stored.spent)))
        problems.append(
            f"unit {worst}: stored spend {stored.spent[worst]!r} but the releases add up to {rebuilt.spent[worst]!r}"
        )
    if not np.array_equal(rebuilt.stopped, stored.stopped):
        problems.append(f"{int((rebuilt.stopped != stored.stopped).sum())} units' stopped flags differ from replay")
    if np.any(stored.spent > filt.threshold):
        problems.append("a unit's stored spend exceeds the filter's threshold")
    return problems + _quota_problems(ledger)


def _quota_problems(ledger: Ledger) -> list[str]:
    """Where a federation's stored quota spend is not the sum, in commit order, of what its releases charged.

    The same arithmetic as the charge (cost (norm / noise_std)^2 added to the spend so far), so a ledger
    the agent wrote replays exactly; a quota state edited, or a release moved to another federation, does
    not. (The quota itself is the owner's configuration, not the ledger's: it is not checked here.)
    """
    problems = []
    for federation in ledger.federations():
        quota = ledger.quota_state(federation)
        if quota is None:
            continue
        replayed = ledger.charged_by(federation)
        if not np.array_equal(replayed, np.asarray(quota["spent"])):
            worst = int(np.argmax(np.abs(replayed - np.asarray(quota["spent"]))))
            problems.append(
                f"federation {federation!r}, unit {worst}: stored quota spend {float(quota['spent'][worst])!r} but its "
                f"releases add up to {float(replayed[worst])!r}"
            )
    return problems


# --------------------------------------------------------------------------- request by request

# How fedfilter's coordinator names its requests ("{run}:{purpose}:r{round}", with ":n{node}" or a secagg
# step around it): the round of a plain contribution, which its stored release does not hold.
_ROUND_IN_ID = re.compile(r":r(\d{1,18})(?=:|$)")


def display_id(federation: str, request_id: str) -> str:
    """A stored request id as its federation sent it: without the ``|federation|`` prefix of its namespace."""
    prefix = f"|{federation}|"
    if federation != DEFAULT_FEDERATION and request_id.startswith(prefix):
        return request_id[len(prefix) :]
    return request_id


def _round(record: ReleaseRecord, request_id: str) -> int | None:
    """The round the release stored (secagg steps, masked inputs, monitor reports), else the one the
    coordinator's request id names, else None (ids are the sender's: a round read from one is its say-so)."""
    stored = round_of(record)
    if stored is not None:
        return int(stored)
    found = _ROUND_IN_ID.search(request_id)
    return None if found is None else int(found.group(1))


@dataclass(frozen=True, eq=False)
class Step:
    """One answered request, replayed: its ledger row, its release, what it charged and the spend after it.

    ``cost``: per unit, what this request charged: (l2_norm / noise_std)^2 for a Gaussian record, the
    realised loss for a realisation record, None for a release that charges nothing (monitor reports,
    whose cost was reserved at enrolment, and secagg key steps). ``spent`` and ``stopped``: every unit's
    spend (S, or |L| for the realisation filter) and stopped flag after this request, as the filter
    replayed them (the global filter: a unit stopped for one federation's quota only is not in it).
    """

    row: dict[str, object]
    record: ReleaseRecord
    cost: NDArray[np.float64] | None = field(repr=False)
    spent: NDArray[np.float64] = field(repr=False)
    stopped: NDArray[np.bool_] = field(repr=False)
    newly_stopped: int

    @property
    def federation(self) -> str:
        return str(self.row["federation"])

    @property
    def time(self) -> datetime:
        return _parse_time(str(self.row["created_at"]))


def _parse_time(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def parse_since(text: str) -> datetime:
    """``--since``: an ISO date or date and time (``2026-05-01``, ``2026-05-01T12:00``, ``...Z``), UTC if no zone."""
    try:
        return _parse_time(text)
    except ValueError as exc:
        raise LedgerError(
            f"--since: expected an ISO date or date and time such as 2026-05-01 or 2026-05-01T12:00Z, got {text!r}"
        ) from exc


def threshold_of(ledger: Ledger) -> float:
    """What a spend is a share of: the Gaussian filter's threshold T on S, or the realisation filter's epsilon."""
    filt = _filter_of(ledger)
    if filt is not None:
        return filt.threshold
    described = dict(ledger.config.params["filter"])  # type: ignore[call-overload]
    return float(described["epsilon"])


def replay(ledger: Ledger) -> Iterator[Step]:
    """Every answered request in commit order, replayed through the ledger's filter (as ``verify`` does).

    A Gaussian record is charged with :func:`protocol.filters.charge`, its refused units stopped, exactly
    as :func:`protocol.filters.rebuild` does; a release that charges more than the filter admits is a
    :class:`LedgerError` (``fedfilter ledger verify`` says more).
    """
    filt = _filter_of(ledger)
    n = ledger.config.n_units
    state = FilterState.fresh(n)
    loss = np.zeros(n)
    accepting = np.ones(n, dtype=np.bool_)
    for row, arrays in ledger.log():
        request_id = str(row["request_id"])
        record = release_from_arrays(arrays)
        before = state.stopped if filt is not None else ~accepting
        cost: NDArray[np.float64] | None = None
        if isinstance(record, GaussianRecord) and filt is not None:
            if record.l2_norms.size != n:
                raise LedgerError(f"replay: request {request_id!r} has {record.l2_norms.size} norms, expected {n}")
            try:
                result = charge(filt, state, noise_std=record.noise_std, l2_norms=record.l2_norms)
            except PrivacyParameterError as exc:
                raise LedgerError(f"replay: request {request_id!r}: {exc}") from exc
            if np.any((record.l2_norms > 0) & ~result.admitted):
                raise LedgerError(
                    f"replay: request {request_id!r} charged a unit beyond what the filter admits; "
                    "run `fedfilter ledger verify`"
                )
            state = FilterState(spent=result.state.spent, stopped=result.state.stopped | record.refused)
            cost = np.square(np.asarray(record.l2_norms, dtype=np.float64) / record.noise_std)
        elif isinstance(record, RealisationRecord):
            loss = loss + record.losses
            accepting = np.asarray(record.accept_next, dtype=np.bool_)
            cost = np.asarray(record.losses, dtype=np.float64)
        if filt is not None:
            spent, stopped = state.spent, state.stopped
        else:
            spent, stopped = np.abs(loss), ~accepting
        newly = int(np.count_nonzero(stopped & ~before))
        yield Step(row, record, cost, spent, stopped, newly)


def request_entry(step: Step, threshold: float) -> dict[str, Any]:
    """One line of ``fedfilter ledger requests``: what one answered request asked, cost and returned."""
    row, record, cost = step.row, step.record, step.cost
    federation = step.federation
    noise = getattr(record, "noise_std", None)
    norms = getattr(record, "l2_norms", None)
    charged = int(np.count_nonzero(norms)) if norms is not None else 0
    cost_max = float(cost.max()) if cost is not None and cost.size else 0.0
    cost_mean = float(cost.mean()) if cost is not None and cost.size else 0.0
    request_id = display_id(federation, str(row["request_id"]))
    return {
        "seq": int(str(row["seq"])),
        "time": str(row["created_at"]),
        "federation": federation,
        "run_id": str(row["run_id"]),
        "request_id": request_id,
        "round": _round(record, request_id),
        "kind": str(row["message_type"]),
        "release": record.kind if isinstance(record, GaussianRecord | RealisationRecord) else _kind_name(record),
        "noise_std": None if noise is None else float(noise),
        "units_charged": charged,
        "cost_max": cost_max,
        "cost_mean": cost_mean,
        "cost_max_share": cost_max / threshold,
        "cost_mean_share": cost_mean / threshold,
        "units_newly_stopped": step.newly_stopped,
        "reply_bytes": int(str(row["reply_bytes"])),
    }


def _kind_name(record: ReleaseRecord) -> str:
    return "monitor" if isinstance(record, MonitorRecord) else str(record.to_arrays()["kind"])


def ledger_requests(
    path: Path, *, since: datetime | None = None, federation: str | None = None
) -> list[dict[str, Any]]:
    """``fedfilter ledger requests``: one entry per answered request (:func:`request_entry`), in commit order.

    ``since`` keeps the requests committed at or after it; ``federation`` those of one federation. The
    replay runs over every request either way (a request's newly stopped units depend on all before it).
    """
    with Ledger.open_existing(path) as ledger:
        threshold = threshold_of(ledger)
        out = []
        for step in replay(ledger):
            if federation is not None and step.federation != federation:
                continue
            if since is not None and step.time < since:
                continue
            out.append(request_entry(step, threshold))
        return out


def federation_summaries(ledger: Ledger, *, stopped: NDArray[np.bool_], threshold: float) -> list[dict[str, Any]]:
    """Each federation's spend: max and mean share of T over units, units stopped for it, requests answered.

    The spend is the federation's quota state (what its releases took of every unit's budget, in S); a
    ledger without one for a federation (written before quotas, or a realisation filter) adds up that
    federation's releases instead (``source``). A unit stopped globally is stopped for every federation,
    so ``units_stopped`` counts the quota's stops and the global ones (``stopped``).
    """
    names = ledger.federations()
    quotas = {name: ledger.quota_state(name) for name in names}
    n = ledger.config.n_units
    requests = dict.fromkeys(names, 0)
    added = {name: np.zeros(n) for name in names if quotas[name] is None}
    for row, arrays in ledger.log():
        name = str(row["federation"])
        requests[name] = requests.get(name, 0) + 1
        if name in added:
            record = contribution_from_arrays(arrays)
            if isinstance(record, GaussianRecord):
                added[name] += np.square(np.asarray(record.l2_norms, dtype=np.float64) / record.noise_std)
            elif isinstance(record, RealisationRecord):
                added[name] += record.losses
    out = []
    for name in names:
        quota = quotas[name]
        if quota is not None:
            spent, own_stops, source = np.asarray(quota["spent"]), np.asarray(quota["stopped"]) | stopped, "quota_state"
        else:
            spent, own_stops, source = np.abs(added[name]), stopped, "replay"
        out.append(
            {
                "federation": name,
                "requests": requests.get(name, 0),
                "spent_max": float(spent.max()),
                "spent_mean": float(spent.mean()),
                "share_max": float(spent.max() / threshold),
                "share_mean": float(spent.mean() / threshold),
                "units_stopped": int(np.count_nonzero(own_stops)),
                "source": source,
            }
        )
    return out


QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


@dataclass
class Timeline:
    """What ``fedfilter ledger report`` plots: per request, the quantiles of every unit's spend share and of the
    odometer's epsilon after it, and the units stopped; per federation and per run, what their releases took."""

    seq: list[int] = field(default_factory=list)
    time: list[datetime] = field(default_factory=list)
    federation: list[str] = field(default_factory=list)
    share_quantiles: list[list[float]] = field(default_factory=list)  # QUANTILES of S / T
    epsilon_quantiles: list[list[float]] = field(default_factory=list)  # QUANTILES of the odometer's epsilon
    stopped: list[int] = field(default_factory=list)
    by_federation: dict[str, NDArray[np.float64]] = field(default_factory=dict)  # per-unit S (sum of its costs)
    by_run: dict[tuple[str, str], NDArray[np.float64]] = field(default_factory=dict)  # (federation, run id)
    requests_by_run: dict[tuple[str, str], int] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)  # request_entry of each, in commit order


def ledger_timeline(path: Path) -> Timeline:
    """Replay the whole ledger once (:func:`replay`) and keep what the report's figures need."""
    out = Timeline()
    with Ledger.open_existing(path) as ledger:
        threshold = threshold_of(ledger)
        odometer = odometer_of(ledger)
        n = ledger.config.n_units
        for step in replay(ledger):
            out.seq.append(int(str(step.row["seq"])))
            out.time.append(step.time)
            out.federation.append(step.federation)
            out.share_quantiles.append([float(q) for q in np.quantile(step.spent / threshold, QUANTILES)])
            if odometer is not None:
                eps = odometer.epsilon(step.spent)
                out.epsilon_quantiles.append([float(q) for q in np.quantile(eps, QUANTILES)])
            out.stopped.append(int(np.count_nonzero(step.stopped)))
            out.requests.append(request_entry(step, threshold))
            run = (step.federation, str(step.row["run_id"]))
            out.requests_by_run[run] = out.requests_by_run.get(run, 0) + 1
            if step.cost is not None:
                out.by_federation[step.federation] = out.by_federation.get(step.federation, np.zeros(n)) + step.cost
                out.by_run[run] = out.by_run.get(run, np.zeros(n)) + step.cost
    return out
