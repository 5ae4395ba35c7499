"""What a ledger says, for its owner: ``fedfilter ledger show`` and ``fedfilter ledger verify``.

``verify`` replays every stored release through the filter the ledger was created with
and checks that the result equals the stored state (House style: replaying the ledger
through the filter rebuilds the state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from client_agent.high_water import HighWater, HighWaterError
from client_agent.high_water import default_path as default_high_water
from client_agent.ledger import Ledger, LedgerError
from client_agent.records import GaussianRecord, RealisationRecord, contribution_from_arrays
from client_agent.state import AgentState
from protocol.filters import GaussianFilter, rebuild


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


def ledger_summary(path: Path) -> dict[str, Any]:
    """The ledger's configuration and spend, as ``fedfilter ledger show --json`` prints it."""
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
        return {
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
        }


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
    return problems
