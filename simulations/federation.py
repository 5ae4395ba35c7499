"""Build a one-machine federation: each client's data file and agent configuration under one folder."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def write_clients(
    root: Path,
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    ledger_dir: Path | None = None,
    plan: tuple[float, float] | None = None,
    **agent: Any,
) -> dict[int, dict[str, Any]]:
    """Write ``data{i}.npz`` per client and return the per-partition agent configs (node-config keys).

    ``agent`` holds node-config keys with underscores or dashes (``epsilon=3``, ``monitor_noise_std=4``);
    a key whose value is None is left out. ``plan``: the run's (noise_std, l2_clip), from which the agents'
    ``policy-max-request-share`` is set when one round costs more than the default allows. Ledgers go to
    ``ledger_dir/client{i}.sqlite`` (default ``root/ledgers``); ledgers already there are kept, with every
    spend they hold.
    """
    root = root.resolve()  # agents need absolute paths: a ClientApp may run in another folder
    root.mkdir(parents=True, exist_ok=True)
    ledgers = (ledger_dir if ledger_dir is not None else root / "ledgers").resolve()
    ledgers.mkdir(parents=True, exist_ok=True)
    common = {k.replace("_", "-"): v for k, v in agent.items() if v is not None}
    if plan is not None and "policy-max-request-share" not in common:
        # The run's (noise_std, clip): the agents' per-request cap is stated as what one of its rounds costs
        # when that is more than the default quarter (a few large rounds), else left at the default.
        common["policy-max-request-share"] = request_share(
            str(common.get("filter", "gdp")),
            epsilon=float(common["epsilon"]) - float(common.get("monitor-epsilon", 0.0)),
            delta=float(common["delta"]),
            noise_std=plan[0],
            clip=plan[1],
        )
    seed = common.pop("noise-seed", None)
    per: dict[int, dict[str, Any]] = {}
    for pid, (x, y) in enumerate(parts):
        data = root / f"data{pid}.npz"
        np.savez(data, x=x, y=y)
        per[pid] = {
            "ledger-path": str(ledgers / f"client{pid}.sqlite"),
            "data-path": str(data),
            **common,
        }
        if seed is not None:
            per[pid]["noise-seed"] = int(seed) * 1000 + pid
    if common.get("trust") == "secagg" and "secagg-peers" not in common:
        for pid, keys in enumerate(secagg_identities(root / "identities", len(parts))):
            per[pid].update(keys)
    return per


def request_share(filter_kind: str, *, epsilon: float, delta: float, noise_std: float, clip: float) -> float:
    """The ``policy-max-request-share`` a plan of rounds at (``noise_std``, ``clip``) needs: its per-round cost
    (clip / noise_std)^2 as a share of the filter's threshold, and never less than the agents' default
    (client_agent.config.DEFAULT_MAX_REQUEST_SHARE) nor more than 1. A simulation states it explicitly
    when its rounds cost more than the default allows (a few large rounds). The realisation filter has no
    share cap (its request is capped by mu_max, privacy.md §11): 1."""
    from client_agent.config import DEFAULT_MAX_REQUEST_SHARE
    from protocol.filters import GaussianFilter

    if filter_kind == "realisation":
        return 1.0
    threshold = GaussianFilter.create(filter_kind, epsilon=epsilon, delta=delta).threshold
    cost = (clip / noise_std) ** 2
    share = cost / threshold
    # The agent checks cost <= share * threshold: round the share up until that holds in floating point
    # (cost / T * T can fall an ulp below cost, which refused every round of 5% of such plans).
    while share * threshold < cost and share < 1.0:
        share = math.nextafter(share, math.inf)
    return min(1.0, max(DEFAULT_MAX_REQUEST_SHARE, share))


def secagg_identities(folder: Path, count: int) -> list[dict[str, str]]:
    """Per client, the agent keys of secagg trust: its own identity key file (kept when already there,
    as its ledger is) and one peers file listing every client's identity (client_agent/identity.py)."""
    from client_agent.identity import ensure_identity, write_peers

    folder.mkdir(parents=True, exist_ok=True)
    keys = [folder / f"client{pid}.key" for pid in range(count)]
    peers = write_peers(folder / "peers.txt", [ensure_identity(k) for k in keys])
    return [{"secagg-identity-key": str(k), "secagg-peers": str(peers)} for k in keys]
