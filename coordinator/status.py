"""A client's status description as enrolment reads it: checked once, then typed.

The agent answers ``query.status`` with canonical JSON (:class:`protocol.messages.StatusReply`):
its ledger's terms, its policy, its monitor reservation and, from an agent with a workload, what
that workload registers and the model's parameter layout. Enrolment reads the fields below and
nothing else. A description that does not check is a :class:`protocol.messages.ProtocolError`,
counted as a malformed status, never quoted. Numbers are kept as the client sent them (an int stays
an int): the refusals that quote a client's budget or reservation quote it as sent. Closed tables
(trust, unit, monitor kind) are checked here, since a refusal quotes them and must never quote a
client's free text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.config import MONITORS
from protocol import messages as wire
from protocol.validate import real


@dataclass(frozen=True)
class MonitorTerms:
    """The monitor a client reserved in every unit's filter (client_agent.config.MonitorReservation)."""

    kind: str  # one of MONITORS
    epsilon_svt: float = 0.0  # svt: (epsilon_svt, 0) split off the client's budget
    noise_std: float = 0.0  # tree: the node noise std sigma_m
    max_rounds: int = 0  # tree: the rounds its tree covers
    squared_cost: float = 0.0  # tree: L / sigma_m^2, reserved in every unit's filter
    levels: int = 0  # tree: the levels it reports


@dataclass(frozen=True)
class LedgerTerms:
    """What a client's ledger is fixed to: its budget, its units and their number, its filter and trust."""

    epsilon: float
    delta: float
    n_units: int
    filter: str
    trust: str
    unit: str
    monitor: MonitorTerms


@dataclass(frozen=True)
class WorkloadTerms:
    """What a client's workload registers: model names and the dims of its queries."""

    name: str
    models: tuple[str, ...]
    query_dims: Mapping[str, int]


@dataclass(frozen=True)
class ClientStatus:
    """One client's status description, checked."""

    ledger: LedgerTerms
    workload: WorkloadTerms | None  # None: an agent from before workloads (its per-request checks still refuse)
    layout_fingerprint: str | None  # the run model's parameter layout as the client's workload builds it
    min_secagg_clients: int  # the client's policy floor on m, the fewest inputs a secagg sum may hold
    ledger_tag: str | None = None  # the ledger's tag in this run (Ledger.run_tag); None: an agent from before tags

    @classmethod
    def from_json(cls, description: str) -> ClientStatus:
        """Decode a StatusReply's description; a ProtocolError when a field enrolment reads is missing or bad."""
        status: dict[str, Any] = json.loads(description)
        ledger = _ledger(status.get("ledger"))
        workload = _workload(status["workload"]) if "workload" in status else None
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
        tag = status.get("ledger_tag")
        if tag is not None and not (isinstance(tag, str) and len(tag) == 32 and set(tag) <= set("0123456789abcdef")):
            raise wire.ProtocolError(f"status reply: 'ledger_tag' must be 32 hex digits, got {tag!r:.80}")
        return cls(ledger, workload, layout.get("fingerprint"), floor, tag)


def _positive_number(value: Any) -> bool:
    """A number (not a bool) > 0 and finite as a float: JSON reads integers of any length, and 10**400 is not."""
    try:
        return real("status reply", value, error=ValueError) > 0
    except ValueError:
        return False


def _ledger(ledger: Any) -> LedgerTerms:
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
        numeric = kind is float and _positive_number(value)
        if isinstance(value, bool) or not (numeric or (kind is not float and isinstance(value, kind))):
            raise wire.ProtocolError(f"status reply: ledger {key!r} must be {kind.__name__}, got {value!r:.80}")
    for key, choices in (("trust", wire.TRUST_MODES), ("unit", wire.UNITS)):
        if ledger[key] not in choices:
            raise wire.ProtocolError(f"status reply: ledger {key!r} must be one of {choices}, got {ledger[key]!r:.80}")
    monitor = _monitor(ledger.get("params", {}).get("monitor") if isinstance(ledger.get("params"), dict) else None)
    if not float(ledger["delta"]) < 1:
        raise wire.ProtocolError(f"status reply: ledger 'delta' must be in (0, 1), got {ledger['delta']!r:.80}")
    return LedgerTerms(
        epsilon=ledger["epsilon"],
        delta=ledger["delta"],
        n_units=ledger["n_units"],
        filter=ledger["filter"],
        trust=ledger["trust"],
        unit=ledger["unit"],
        monitor=monitor,
    )


def _monitor(monitor: Any) -> MonitorTerms:
    if not isinstance(monitor, dict):
        raise wire.ProtocolError(f"status reply: expected a monitor reservation object, got {monitor!r:.80}")
    kind = monitor.get("kind")
    if kind not in MONITORS:
        raise wire.ProtocolError(f"status reply: monitor 'kind' must be one of {MONITORS}, got {kind!r:.80}")
    needed = {"svt": ("epsilon_svt",), "tree": ("noise_std", "max_rounds", "squared_cost")}.get(str(kind), ())
    for key in needed:
        value = monitor.get(key)
        if not _positive_number(value):
            raise wire.ProtocolError(f"status reply: monitor {key!r} must be a finite number > 0, got {value!r:.80}")
    if kind == "tree":
        for key in ("max_rounds", "levels"):
            value = monitor.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise wire.ProtocolError(f"status reply: monitor {key!r} must be an integer >= 1, got {value!r:.80}")
        return MonitorTerms(kind, **{key: monitor[key] for key in (*needed, "levels")})
    return MonitorTerms(kind, **{key: monitor[key] for key in needed})


def _workload(workload: Any) -> WorkloadTerms:
    """A workload description (name, model names, queries with dim and bound), checked."""
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
        ok_bound = _positive_number(bound)
        if not (ok_dim and ok_bound):
            raise wire.ProtocolError(
                f"status reply: a workload query must have an integer 'dim' >= 1 and a finite 'l2_bound' > 0, "
                f"got {query!r:.80}"
            )
    return WorkloadTerms(workload["name"], tuple(models), {name: query["dim"] for name, query in queries.items()})
