"""The federation both short reproductions run: counting queries to clients holding one record equal to 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from coordinator.config import CoordinatorConfig
from simulations.errors import SimulationError
from simulations.federation import write_clients
from simulations.presets.base import Options


def fixed_options(opts: Options, preset: str, **fixed: object) -> None:
    """Refuse command-line choices a preset fixes (its trust mode, unit, filter and the counting queries' clip 1)."""
    for name, value in fixed.items():
        given = getattr(opts, name)
        if given is not None and given != value:
            raise SimulationError(f"--{name}: the {preset} preset runs with {name} {value!r}; got {given!r}")


def ones_parts(n_clients: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """One record per client with a single feature equal to 1: a counting query on column 0 counts it."""
    return [(np.ones((1, 1), dtype=np.float32), np.zeros(1, dtype=np.int64)) for _ in range(n_clients)]


def counting_config(
    *, clients: int, rounds: int, noise_std: float, l2_clip: float, run_id: str, out: Path, seed: int
) -> CoordinatorConfig:
    """Counting queries on column 0, every round, to client units in local trust (analyst 'cycle' over 1 column)."""
    return CoordinatorConfig(
        num_nodes=clients,
        n_public=clients,
        rounds=rounds,
        noise_std=noise_std,
        l2_clip=l2_clip,
        task="indicator",
        trust="local",
        unit="client",
        analyst="cycle",
        query_columns=1,
        seed=seed,
        run_id=run_id,
        output_dir=str(out),
        noise_seed=seed,
        round_timeout=600.0,
    )


def counting_federation(
    opts: Options, out: Path, preset: str, *, clients: int, rounds: int, noise_std: float, l2_clip: float, **agent: Any
) -> tuple[dict[int, dict[str, Any]], CoordinatorConfig]:
    """The clients (one record equal to 1 each, client units, local trust) and the counting-query run config."""
    per = write_clients(
        out / "clients",
        ones_parts(clients),
        ledger_dir=out / "ledgers",
        unit="client",
        trust="local",
        noise_seed=opts.seed,
        **agent,
        # FZ's counting queries spend a record's budget in a few large steps: stated, not the default cap.
        policy_max_request_share=1.0,
    )
    cfg = counting_config(
        clients=clients,
        rounds=rounds,
        noise_std=noise_std,
        l2_clip=l2_clip,
        run_id=f"{preset}-{opts.seed}",
        out=out,
        seed=opts.seed,
    )
    return per, cfg
