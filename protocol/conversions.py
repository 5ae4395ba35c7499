"""Conversions between privacy currencies and (epsilon, delta)-DP.

Pure functions, keyword-only privacy parameters. Each formula cites its source
(short names as in ``shared/design/privacy.md``):

- Gaussian DP (DRS Cor. 2.13): a mu-GDP mechanism is (epsilon, delta)-DP for
  delta_GDP(mu, epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2).
- zCDP to (epsilon, delta) (CKS Prop. 12 / Cor. 13): rho-zCDP is (epsilon, delta)-DP for
  delta = inf_{alpha>1} exp((alpha-1)(alpha rho - epsilon)) (1-1/alpha)^alpha / (alpha-1).
- zCDP, the simple conversion (BS Prop. 1.3): epsilon = rho + 2 sqrt(rho log(1/delta)),
  whose inverse is rho_B = (sqrt(log(1/delta) + epsilon) - sqrt(log(1/delta)))^2 (FZ Thm 4.8 B*).
- RDP to (epsilon, delta), Mironov (2017) Prop. 3: epsilon = eps_alpha + log(1/delta)/(alpha-1).
- RDP to (epsilon, delta), improved (CKS Prop. 12; Balle et al. 2020 Thm 21; the rule
  dp_accounting's RDP accountant uses):
  epsilon = eps_alpha + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1).

The zCDP conversion of CKS is the improved RDP conversion applied to the RDP curve
alpha -> alpha rho and optimised over alpha; the code below computes it that way,
so the two share one formula.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from scipy import optimize, special

from protocol.validate import PrivacyParameterError, open_unit, order_above_one, positive

RdpConversion = Literal["improved", "mironov"]
ZcdpConversion = Literal["cks", "bs"]

# Search range for Rényi orders, as log(alpha - 1): alpha in (1 + e^-12, 1 + e^14).
_LOG_ORDER_MINUS_ONE = (-12.0, 14.0)


# --- Gaussian differential privacy (DRS) -----------------------------------------


def gdp_delta(*, mu: float, epsilon: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (DRS Cor. 2.13), computed in log space."""
    mu = positive("mu", mu)
    if not math.isfinite(epsilon) or epsilon < 0:
        raise PrivacyParameterError(f"epsilon: expected a finite number >= 0, got {epsilon!r}")
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    first = float(special.ndtr(a))
    second = math.exp(epsilon + float(special.log_ndtr(b)))
    return max(0.0, first - second)


def gdp_epsilon(*, mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 with delta_GDP(mu, epsilon) <= delta (inverse of :func:`gdp_delta`)."""
    mu = positive("mu", mu)
    delta = open_unit("delta", delta)
    if gdp_delta(mu=mu, epsilon=0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu=mu, epsilon=hi) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: gdp_delta(mu=mu, epsilon=e) - delta, 0.0, hi, xtol=1e-14, rtol=1e-14))


def mu_budget(*, epsilon: float, delta: float) -> float:
    """The largest mu with delta_GDP(mu, epsilon) <= delta: the GDP filter's budget mu_B (privacy.md §3)."""
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)
    hi = 1.0
    while gdp_delta(mu=hi, epsilon=epsilon) < delta:
        hi *= 2.0
    return float(optimize.brentq(lambda m: gdp_delta(mu=m, epsilon=epsilon) - delta, 1e-12, hi, xtol=1e-15, rtol=1e-15))


# --- Rényi differential privacy ----------------------------------------------------


def rdp_epsilon(*, rdp: float, order: float, delta: float, conversion: RdpConversion = "improved") -> float:
    """(epsilon, delta)-DP implied by (order, rdp)-RDP (Mironov Prop. 3, or the improved rule)."""
    order = order_above_one("order", order)
    delta = open_unit("delta", delta)
    if not math.isfinite(rdp) or rdp < 0:
        raise PrivacyParameterError(f"rdp: expected a finite number >= 0, got {rdp!r}")
    if conversion == "mironov":
        return rdp + math.log(1.0 / delta) / (order - 1.0)
    if conversion == "improved":
        eps = rdp + math.log((order - 1.0) / order) - (math.log(delta) + math.log(order)) / (order - 1.0)
        return max(0.0, eps)
    raise PrivacyParameterError(f"conversion: expected 'improved' or 'mironov', got {conversion!r}")


def rdp_budget(*, epsilon: float, delta: float, order: float, conversion: RdpConversion = "improved") -> float:
    """The largest RDP value at ``order`` whose conversion is (epsilon, delta)-DP; may be <= 0 (order unusable)."""
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)
    order = order_above_one("order", order)
    if conversion == "mironov":
        return epsilon - math.log(1.0 / delta) / (order - 1.0)
    if conversion == "improved":
        return epsilon - math.log((order - 1.0) / order) + (math.log(delta) + math.log(order)) / (order - 1.0)
    raise PrivacyParameterError(f"conversion: expected 'improved' or 'mironov', got {conversion!r}")


def best_rdp_order(*, epsilon: float, delta: float, conversion: RdpConversion = "improved") -> float:
    """The Rényi order that admits the most Gaussian rounds, fixed in advance of any release.

    A Gaussian round of sensitivity mu costs alpha mu^2 / 2 at order alpha (FZ Ex. 2.6), so the
    number of rounds at order alpha is floor(T_alpha / mu^2) with T_alpha = 2 B_alpha / alpha,
    B_alpha = :func:`rdp_budget`. The best order maximises T_alpha, whatever mu is.
    """
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)

    def neg_threshold(log_am1: float) -> float:
        order = 1.0 + math.exp(log_am1)
        return -2.0 * rdp_budget(epsilon=epsilon, delta=delta, order=order, conversion=conversion) / order

    grid = np.linspace(*_LOG_ORDER_MINUS_ONE, 521)
    values = np.array([neg_threshold(x) for x in grid])
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = optimize.minimize_scalar(neg_threshold, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    best = float(res.x) if res.fun <= values[i] else float(grid[i])
    if neg_threshold(best) >= 0:
        raise PrivacyParameterError(
            f"(epsilon, delta)=({epsilon!r}, {delta!r}): no Rényi order gives a positive budget"
        )
    return 1.0 + math.exp(best)


def rdp_threshold(*, epsilon: float, delta: float, order: float, conversion: RdpConversion = "improved") -> float:
    """The Rényi filter at one order as a threshold on S = sum mu_t^2: alpha S / 2 <= B_alpha."""
    budget = rdp_budget(epsilon=epsilon, delta=delta, order=order, conversion=conversion)
    if budget <= 0:
        raise PrivacyParameterError(
            f"order: {order!r} leaves no budget at (epsilon, delta)=({epsilon!r}, {delta!r}) "
            f"(B_alpha = {budget:.6g}); choose a larger order"
        )
    return 2.0 * budget / order


# --- zero-concentrated differential privacy ----------------------------------------


def _zcdp_log_delta_at(rho: float, epsilon: float, log_am1: float) -> float:
    order = 1.0 + math.exp(log_am1)
    # CKS Cor. 13: log of exp((a-1)(a rho - eps)) (1-1/a)^a / (a-1).
    return (order - 1.0) * (order * rho - epsilon) + order * math.log1p(-1.0 / order) - math.log(order - 1.0)


def zcdp_delta(*, rho: float, epsilon: float) -> float:
    """delta(epsilon) of a rho-zCDP mechanism by CKS Cor. 13 (infimum over orders), at most 1."""
    rho = positive("rho", rho)
    if not math.isfinite(epsilon) or epsilon < 0:
        raise PrivacyParameterError(f"epsilon: expected a finite number >= 0, got {epsilon!r}")
    grid = np.linspace(*_LOG_ORDER_MINUS_ONE, 521)
    values = np.array([_zcdp_log_delta_at(rho, epsilon, x) for x in grid])
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = optimize.minimize_scalar(
        lambda x: _zcdp_log_delta_at(rho, epsilon, x), bounds=(lo, hi), method="bounded", options={"xatol": 1e-12}
    )
    log_delta = min(float(res.fun), float(values[i]))
    return min(1.0, math.exp(log_delta))


def zcdp_epsilon(*, rho: float, delta: float, conversion: ZcdpConversion = "cks") -> float:
    """epsilon of a rho-zCDP mechanism at delta (CKS Cor. 13, or BS Prop. 1.3)."""
    rho = positive("rho", rho)
    delta = open_unit("delta", delta)
    if conversion == "bs":
        return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))
    if conversion != "cks":
        raise PrivacyParameterError(f"conversion: expected 'cks' or 'bs', got {conversion!r}")

    def eps_at(log_am1: float) -> float:
        order = 1.0 + math.exp(log_am1)
        return rdp_epsilon(rdp=order * rho, order=order, delta=delta, conversion="improved")

    grid = np.linspace(*_LOG_ORDER_MINUS_ONE, 521)
    values = np.array([eps_at(x) for x in grid])
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = optimize.minimize_scalar(eps_at, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    return min(float(res.fun), float(values[i]))


def rho_budget(*, epsilon: float, delta: float, conversion: ZcdpConversion = "cks") -> float:
    """The largest rho whose conversion is (epsilon, delta)-DP: the zCDP filter's budget rho_B (privacy.md §3)."""
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)
    if conversion == "bs":
        log_inv = math.log(1.0 / delta)
        return (math.sqrt(log_inv + epsilon) - math.sqrt(log_inv)) ** 2
    if conversion != "cks":
        raise PrivacyParameterError(f"conversion: expected 'cks' or 'bs', got {conversion!r}")
    # delta_CKS grows with rho; the BS budget is feasible (BS is looser), epsilon is not.
    lo = rho_budget(epsilon=epsilon, delta=delta, conversion="bs")
    hi = epsilon
    while zcdp_delta(rho=hi, epsilon=epsilon) <= delta:
        hi *= 2.0
    return float(optimize.brentq(lambda r: zcdp_delta(rho=r, epsilon=epsilon) - delta, lo, hi, xtol=1e-15, rtol=1e-14))
