"""The privacy calculator: each filter's budget and the full-norm rounds it allows.

Pure: ``budget_report`` returns the JSON-ready dictionary that ``fedfilter budget
--json`` prints. Rounds are counted for releases of sensitivity mu = C / sigma (a
unit at full norm every round), exactly as the filter's check counts them.
"""

from __future__ import annotations

from protocol.conversions import best_rdp_order, mu_budget, rdp_threshold, rho_budget
from protocol.filters import rounds_within
from protocol.realisation import RealisationFilter
from protocol.validate import open_unit, positive, positive_int


def budget_report(
    *, epsilon: float, delta: float, noise_std: float, l2_clip: float, max_rounds: int | None = None
) -> dict[str, object]:
    """Budgets and full-norm rounds for the GDP, zCDP (CKS, BS), Rényi and realisation-level filters."""
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)
    noise_std = positive("noise_std", noise_std)
    l2_clip = positive("clip", l2_clip)
    step = (l2_clip / noise_std) ** 2  # S per full-norm round

    mu_b = mu_budget(epsilon=epsilon, delta=delta)
    rho_cks = rho_budget(epsilon=epsilon, delta=delta, conversion="cks")
    rho_bs = rho_budget(epsilon=epsilon, delta=delta, conversion="bs")
    order = best_rdp_order(epsilon=epsilon, delta=delta, conversion="improved")
    filters: dict[str, dict[str, object]] = {
        "gdp": {"mu_budget": mu_b, "rounds": rounds_within(mu_b * mu_b, step)},
        "zcdp_cks": {"rho_budget": rho_cks, "rounds": rounds_within(2.0 * rho_cks, step)},
        "zcdp_bs": {"rho_budget": rho_bs, "rounds": rounds_within(2.0 * rho_bs, step)},
        "rdp": {
            "order": order,
            "rounds": rounds_within(rdp_threshold(epsilon=epsilon, delta=delta, order=order), step),
        },
    }
    if max_rounds is not None:
        n = positive_int("max_rounds", max_rounds)
        real = RealisationFilter.create(epsilon=epsilon, delta=delta, max_rounds=n, mu_max=l2_clip / noise_std)
        filters["realisation"] = {
            "kappa": real.kappa(mu=real.mu_max),
            "delta_tilde": real.delta_tilde,
            "theta": real.theta,
            "max_rounds": n,
        }
    return {"epsilon": epsilon, "delta": delta, "noise_std": noise_std, "clip": l2_clip, "filters": filters}
