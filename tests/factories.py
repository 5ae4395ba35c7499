"""The tests' inputs, one copy each: client data, node configs, agents, requests, statuses, ledgers, federations.

Each factory's defaults are the values most tests use; a test states what it changes as keyword
arguments (node-config keys as they are written in a TOML file: ``**{"noise-seed": 3}``; request
fields by their names). The fixtures built on these live in tests/conftest.py.

The agent (and with it torch) and ``simulations`` are imported only inside the factories that
need them, so a test of a filter or a ledger alone stays light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from client_agent.ledger import Ledger, LedgerConfig
from protocol import messages as wire

if TYPE_CHECKING:
    from client_agent.agent import Agent
    from coordinator.config import CoordinatorConfig

# The agents' logistic regression over 3 features and 2 classes: 3 * 2 weights + 2 biases.
MODEL_ARGS = json.dumps({"in_features": 3, "n_classes": 2})
N_PARAMS = 3 * 2 + 2
# The units of the ledgers built by ledger_config() and fresh_ledger_state().
LEDGER_UNITS = 5
# The secagg counting tests' noise and clip (client-unit label counts).
COUNT_NOISE_STD, COUNT_CLIP = 10.0, 100.0

Data = tuple[np.ndarray, np.ndarray]


# --- data and agents ------------------------------------------------------------------------------


def client_data(n: int = 10, features: int = 3, *, seed: int = 0) -> Data:
    """``n`` Gaussian records with ``features`` float32 features; label = first feature > 0."""
    x = np.random.default_rng(seed).normal(size=(n, features)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def node_config(folder: Path, data: Data | None = None, **over: Any) -> dict[str, Any]:
    """An agent's node config over ``folder/data.npz`` (written here; default :func:`client_data`) and
    ``folder/ledger.sqlite``: (1, 1e-5) per record, local trust; ``over`` adds or replaces keys."""
    x, y = data if data is not None else client_data()
    np.savez(folder / "data.npz", x=x, y=y)
    base: dict[str, Any] = {
        "ledger-path": str(folder / "ledger.sqlite"),
        "data-path": str(folder / "data.npz"),
        "epsilon": 1.0,
        "delta": 1e-5,
        "unit": "record",
        "trust": "local",
        # The tests' requests are sized so that a few spend a small budget; the per-request cap
        # (default 1/4) has tests of its own (tests/unit/test_federations.py).
        "policy-max-request-share": 1.0,
    }
    return base | over


def build_agent(folder: Path, data: Data | None = None, **over: Any) -> Agent:
    """An agent over :func:`node_config` (simulation switch on, so ``noise-seed`` is allowed)."""
    from client_agent.agent import Agent
    from client_agent.config import parse_agent_config

    return Agent(parse_agent_config(node_config(folder, data, **over), simulation=True))


def secagg_node_config(folder: Path, i: int, *, peers: int, **over: Any) -> dict[str, Any]:
    """Client ``i`` of a secagg federation in ``folder``: 10 records with random 0/1 labels (seed ``i``),
    client units, epsilon 20, its own identity key and a peers file listing ``peers`` identities."""
    from simulations.federation import secagg_identities

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(i)
    np.savez(folder / f"data{i}.npz", x=rng.normal(size=(10, 3)).astype(np.float32), y=rng.integers(0, 2, 10))
    cfg = {
        "ledger-path": str(folder / f"ledger{i}.sqlite"),
        "data-path": str(folder / f"data{i}.npz"),
        "epsilon": 20.0,
        "delta": 1e-5,
        "unit": "client",
        "trust": "secagg",
        "noise-seed": 100 + i,
        "policy-max-request-share": 1.0,
        **secagg_identities(folder / "identities", peers)[i],
    }
    return cfg | over


def secagg_agents(folder: Path, n: int, *, peers: int | None = None, **over: Any) -> dict[int, Agent]:
    """``n`` secagg agents (:func:`secagg_node_config`) keyed by node id 1000 + i; all trust each other."""
    from client_agent.agent import Agent
    from client_agent.config import parse_agent_config

    return {
        1000 + i: Agent(parse_agent_config(secagg_node_config(folder, i, peers=peers or n, **over), simulation=True))
        for i in range(n)
    }


# --- requests and replies -------------------------------------------------------------------------


def gradient_request(request_id: str = "r1", *, features: int = 3, n_classes: int = 2, **fields: Any) -> Any:
    """A gradient request for the logistic regression (``features`` -> ``n_classes``) at zero parameters:
    round 1 of run "run", noise_std 2, clip 1, local trust, record units; ``fields`` replace any field."""
    base: dict[str, Any] = dict(
        request_id=request_id,
        run_id="run",
        round=1,
        noise_std=2.0,
        l2_clip=1.0,
        trust="local",
        unit="record",
        model="logreg",
        model_args=json.dumps({"in_features": features, "n_classes": n_classes}),
        parameters=np.zeros(features * n_classes + n_classes, np.float32),
    )
    return wire.GradientRequest(**(base | fields))


def indicator_request(request_id: str = "q1", **fields: Any) -> Any:
    """An indicator request: round 1 of run "run", noise_std 1, clip 1, local trust, record units,
    predicate "column" on column 0 at value 0; ``fields`` replace any field."""
    base: dict[str, Any] = dict(
        request_id=request_id,
        run_id="run",
        round=1,
        noise_std=1.0,
        l2_clip=1.0,
        trust="local",
        unit="record",
        predicate="column",
        column=0,
        value=0.0,
    )
    return wire.IndicatorRequest(**(base | fields))


def count_request(
    secagg: Any, *, node: int | None = None, rnd: int = 1, run_id: str = "run", value: float = 1.0
) -> Any:
    """The secagg counting question of round ``rnd``: how many of a client's records have label ``value``
    (request id ``{run_id}:indicator:r{rnd}``, with ``:n{node}`` when a node is named)."""
    request_id = f"{run_id}:indicator:r{rnd}" + ("" if node is None else f":n{node}")
    return wire.IndicatorRequest(
        request_id,
        run_id,
        rnd,
        noise_std=COUNT_NOISE_STD,
        l2_clip=COUNT_CLIP,
        trust="secagg",
        unit="client",
        predicate="label",
        column=0,
        value=value,
        secagg=secagg,
    )


def status(
    *,
    trust: str,
    unit: str = "record",
    monitor: dict[str, Any] | None = None,
    filter: str = "gdp",
    n_units: int = 5,
) -> str:
    """A client's status description (JSON) as the coordinator reads it at enrolment: (2, 1e-5)."""
    ledger = {
        "filter": filter,
        "epsilon": 2.0,
        "delta": 1e-5,
        "unit": unit,
        "trust": trust,
        "n_units": n_units,
        "params": {"monitor": monitor or {"kind": "none"}},
    }
    return json.dumps({"ledger": ledger, "policy": {}})


def gradient_run(**over: Any) -> CoordinatorConfig:
    """A coordinator's gradient run on :data:`MODEL_ARGS`: one round, noise_std 2, clip 1, central trust, no
    progress bar; ``over`` gives the rest (``num_nodes`` and ``n_public`` at least) and replaces any field."""
    from coordinator.config import CoordinatorConfig

    base: dict[str, Any] = dict(
        rounds=1,
        noise_std=2.0,
        l2_clip=1.0,
        trust="central",
        model="logreg",
        model_args=MODEL_ARGS,
        progress=False,
    )
    return CoordinatorConfig(**(base | over))


# --- ledgers ----------------------------------------------------------------------------------------


def ledger_config(**over: Any) -> LedgerConfig:
    """A ledger's fixed configuration: GDP at (3, 1e-5), 5 record units, local trust."""
    fields: dict[str, Any] = {
        "filter": "gdp",
        "epsilon": 3.0,
        "delta": 1e-5,
        "unit": "record",
        "trust": "local",
        "n_units": LEDGER_UNITS,
        "params": {"threshold": 1.25, "monitor_reserve": 0.05, "data_fingerprint": "abc123"},
    }
    return LedgerConfig(**(fields | over))


def fresh_ledger_state(n_units: int = LEDGER_UNITS) -> dict[str, np.ndarray]:
    """A minimal generic ledger state (a Gaussian filter's spent and stopped arrays: nothing spent, nobody
    stopped) for the ledger's own tests; the agent stores more (client_agent.state.AgentState)."""
    return {"spent": np.zeros(n_units), "stopped": np.zeros(n_units, dtype=np.bool_)}


def ledger_state(path: Path | str) -> dict[str, np.ndarray]:
    """The state stored in an existing ledger, read through the ledger's own checks."""
    with Ledger.open_existing(Path(path)) as ledger:
        return ledger.state()


def spent(path: Path | str) -> np.ndarray:
    """Each unit's spent squared budget S in an existing ledger."""
    return ledger_state(path)["spent"]


# --- federations ------------------------------------------------------------------------------------


def central_clients(root: Path, clients: int, records: int) -> dict[int, dict[str, Any]]:
    """``clients`` agents of :func:`client_data` (3 features, seeds 0, 1, ...) in central trust, record units,
    (4, 1e-5) each, no per-request cap: node configs under ``root`` for :func:`gradient_run`'s model."""
    from simulations.federation import write_clients

    parts = [client_data(records, 3, seed=i) for i in range(clients)]
    return write_clients(
        root, parts, epsilon=4.0, delta=1e-5, unit="record", trust="central", policy_max_request_share=1.0
    )


def split(x: np.ndarray, y: np.ndarray, clients: int, records: int) -> list[Data]:
    """The first ``clients * records`` rows, ``records`` consecutive rows per client."""
    return [(x[i * records : (i + 1) * records], y[i * records : (i + 1) * records]) for i in range(clients)]


def federation(
    root: Path,
    *,
    clients: int,
    records: int,
    features: int,
    seed: int,
    separation: float,
    held_out: int = 0,
    **agent: Any,
) -> tuple[dict[int, dict[str, Any]], np.ndarray, np.ndarray]:
    """Separable two-class blobs split over ``clients`` clients of ``records`` records each (``held_out``
    more rows at the end, for evaluation), written under ``root`` as agents' node configs
    (:func:`simulations.federation.write_clients`, ``agent`` holding their keys). Returns the configs
    and all rows."""
    from simulations.datasets.synthetic import synthetic_classification
    from simulations.federation import write_clients

    x, y = synthetic_classification(clients * records + held_out, features, 2, seed=seed, separation=separation)
    return write_clients(root, split(x, y, clients, records), **agent, policy_max_request_share=1.0), x, y
