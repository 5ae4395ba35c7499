"""The privacy statement a run publishes in its summary: who is protected, how, and at what (epsilon, delta).

Its text follows the run's public configuration and what the enrolled clients accepted; every
clause points to a section of docs/design/privacy.md (§1 units, §7 the monitor, the secagg trust
model in coordinator/secagg.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig
    from coordinator.secagg import SecaggSettings


def statement(
    cfg: CoordinatorConfig,
    *,
    epsilon: float,
    delta: float,
    filters: list[str],
    clients: int,
    secagg: SecaggSettings | None = None,
) -> str:
    """One sentence: every unit of the enrolled clients has (epsilon, delta)-DP for all the run released."""
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
