"""What every preset shares: the options the command line may change, the plan a preset returns,
and the simulation's ground truth read back from the clients' ledgers.

The plots' "active units" curve is read from the simulated clients' ledgers after the run:
ground truth that only a simulation has. It is never released to the coordinator, which
sees only the monitor's private verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from client_agent.ledger import Ledger
from coordinator.config import CoordinatorConfig
from protocol.filters import GaussianFilter
from simulations.federation import write_clients

if TYPE_CHECKING:
    from coordinator.tasks import Evaluate


@dataclass(frozen=True)
class Options:
    """What the command line may change; None keeps the preset's value."""

    clients: int | None = None
    rounds: int | None = None
    epsilon: float | None = None
    delta: float | None = None
    noise_std: float | None = None
    clip: float | None = None
    trust: str | None = None
    unit: str | None = None
    filter: str | None = None
    seed: int = 0
    data_dir: str | None = None
    download: bool = False  # fetch missing dataset files from the canonical mirrors
    out: str | None = None  # default: fedfilter-out/<preset>-<UTC time>, a new folder per run
    engine: str = "flower"
    # An existing Ray cluster for the flower engine (host:port or auto; default RAY_ADDRESS, else a local Ray).
    ray_address: str | None = None
    # The ``workload`` preset: "package.module:object" (workloads/registry.py); both sides load it.
    workload: str | None = None
    # Local training (quickstart with unit 'client'; DP-FedAvg): CoordinatorConfig's local_* and server_lr.
    local_steps: int | None = None
    local_lr: float | None = None
    local_batch_size: int | None = None
    server_lr: float | None = None


@dataclass(frozen=True)
class Plan:
    """A ready run: the coordinator's config, each client's agent config, and the server-side evaluation."""

    cfg: CoordinatorConfig
    clients: dict[int, dict[str, Any]]
    evaluate: Evaluate | None
    worst_case_rounds: int
    notes: dict[str, Any]
    # Paper reproductions: after the run, (summary, out) -> entries added to summary.json under
    # "reproduction" (their "plots" join the run's plots, their "headline" lines the headline).
    post: Callable[[dict[str, Any], Path], dict[str, Any]] | None = None


Preset = Callable[[Options, Path], Plan]


def pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def timeouts(clients: int) -> dict[str, Any]:
    """Enrolment and round timeouts for a simulation of ``clients`` virtual clients: the default 120 s, or
    0.2 s a client where more (every client answers each query in turn on the simulation's few actors: about
    40-60 ms a client on 2 cores; at 10,000 clients 120 s enrolled 1,898 and the run refused its n_public)."""
    limit = max(120.0, 0.2 * clients)
    return {"enrol_timeout": limit, "round_timeout": limit}


def local_training(opts: Options) -> dict[str, Any]:
    """The CoordinatorConfig keys of local training that the command line set (validated there)."""
    keys = ("local_steps", "local_lr", "local_batch_size", "server_lr")
    return {k: getattr(opts, k) for k in keys if getattr(opts, k) is not None}


def worst_case_rounds(
    epsilon: float,
    delta: float,
    noise_std: float,
    clip: float,
    monitor_epsilon: float = 0.0,
    filter_kind: str = "gdp",
) -> int:
    """Rounds worst-case accounting with the run's filter allows at full sensitivity, the monitor's share set aside."""
    return GaussianFilter.create(filter_kind, epsilon=epsilon - monitor_epsilon, delta=delta).full_norm_rounds(
        noise_std=noise_std, l2_clip=clip
    )


def client_files(out: Path, parts: list[tuple[np.ndarray, np.ndarray]], **agent: Any) -> dict[int, dict[str, Any]]:
    """Data under ``out/clients``, ledgers under ``out/ledgers`` (which ``simulate`` checked empty)."""
    return write_clients(out / "clients", parts, ledger_dir=out / "ledgers", **agent)


def halt_rounds(clients: Mapping[int, Mapping[str, Any]]) -> np.ndarray:
    """Every unit's halt round (its last round with data; -1: still active), from the simulated clients' ledgers."""
    halts = []
    for node in clients.values():
        with Ledger.open_existing(Path(node["ledger-path"])) as ledger:
            halts.append(ledger.state()["halt_round"])
    return np.concatenate(halts)


def active_per_round(clients: dict[int, dict[str, Any]], rounds: int) -> np.ndarray:
    """Active units after each round 0..rounds, from the simulated clients' ledgers (ground truth)."""
    h = halt_rounds(clients)
    return np.array([np.count_nonzero((h < 0) | (h > t)) for t in range(rounds + 1)])
