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

Budgets are returned on the feasible side. :func:`mu_budget` and :func:`rho_budget` find a root
numerically (or, for BS, evaluate a closed form), then step the result down by ulps only where
needed, so that the delta (or, for BS, the epsilon) the code itself computes at the returned
budget is <= the target; the step is at most one ulp more than needed (:func:`_feasible_below`).
:func:`gdp_epsilon` steps up the same way (its delta at the returned epsilon is <= the target).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import numpy as np
from scipy import integrate, optimize, special

from protocol.validate import PrivacyParameterError, open_unit, order_above_one, positive

RdpConversion = Literal["improved", "mironov"]
ZcdpConversion = Literal["cks", "bs"]

# Search range for Rényi orders, as log(alpha - 1): alpha in (1 + e^-12, 1 + e^14).
_LOG_ORDER_MINUS_ONE = (-12.0, 14.0)
# zcdp_delta widens that range (the CKS Cor. 13 objective is convex in alpha) up to these limits;
# e^700 is still a finite float.
_LOG_ORDER_MINUS_ONE_LIMITS = (-745.0, 700.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_EPS = float(np.finfo(float).eps)
# gdp_delta uses the direct DRS Cor. 2.13 formula when its rounding error, estimated as
# _DIRECT_ULPS ulps of each term, is at most _DIRECT_RTOL of the result.
_DIRECT_ULPS = 4.0
_DIRECT_RTOL = 1e-12


def _gauss_legendre_panels(edges: tuple[float, ...], nodes: int) -> tuple[np.ndarray, np.ndarray]:
    x, w = np.polynomial.legendre.leggauss(nodes)
    lo, hi = np.array(edges[:-1])[:, None], np.array(edges[1:])[:, None]
    return ((hi - lo) / 2 * x + (hi + lo) / 2).ravel(), ((hi - lo) / 2 * w).ravel()


# Nodes and weights for int_0^127.5 f(s) ds (_gdp_delta_integral): panels of doubling width.
_GL_S, _GL_W = _gauss_legendre_panels((0.0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5, 63.5, 127.5), 20)
# brentq's tightest relative tolerance (scipy requires rtol >= 4 * machine epsilon); xtol is
# set far below any budget so that the relative tolerance governs even for tiny budgets.
_RTOL = 4.0 * _EPS
_XTOL = 1e-300
# Bounds on the bracketing loops (doubling / halving): beyond them the float range is exhausted.
_MAX_BRACKET_STEPS = 2200


def _root(f: Callable[[float], float], lo: float, hi: float, what: str) -> float:
    """brentq on [lo, hi] (f changes sign there) to brentq's tightest relative tolerance."""
    if f(lo) == 0:
        return lo
    try:
        return float(optimize.brentq(f, lo, hi, xtol=_XTOL, rtol=_RTOL, maxiter=500))
    except (RuntimeError, ValueError) as err:
        raise PrivacyParameterError(f"{what}: root finding failed on [{lo!r}, {hi!r}] ({err})") from err


def _feasible_below(value: float, excess: Callable[[float], float], what: str, *, upward: bool = False) -> float:
    """The largest float <= ``value`` (up to one ulp) with ``excess(x) <= 0``; ``excess`` increases in x.

    Root finders stop within a tolerance on either side of the root, so their result can be
    infeasible (its delta above the target). Steps of k ulps, k = 1, 2, 4, ..., find a feasible
    point; a bisection over k then brings the step to within one ulp of the smallest feasible step.
    With ``upward=True`` the mirror image: the smallest float >= ``value`` with ``excess(x) <= 0``,
    ``excess`` decreasing in x (used for an epsilon, where larger is feasible).
    Raises :class:`PrivacyParameterError` if no positive finite feasible value is found.
    """
    if excess(value) <= 0:
        return value
    step = math.ulp(value) if upward else -math.ulp(value)
    bad, k = 0, 1
    while True:
        x = value + k * step
        if x <= 0 or not math.isfinite(x):
            raise PrivacyParameterError(f"{what}: no positive finite value meets the target (started from {value!r})")
        if excess(x) <= 0:
            break
        bad, k = k, 2 * k
    while k - bad > 1:  # excess(value + bad step) > 0 >= excess(value + k step)
        mid = (bad + k) // 2
        if excess(value + mid * step) <= 0:
            k = mid
        else:
            bad = mid
    return value + k * step


# --- Gaussian differential privacy (DRS) -----------------------------------------


def gdp_delta(*, mu: float, epsilon: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (DRS Cor. 2.13).

    Direct formula Phi(a) - e^epsilon Phi(b), a = -epsilon/mu + mu/2, b = a - mu, with log_ndtr for
    the second term, when the terms differ by a factor 2 or its estimated rounding error is at most
    1e-12 relative. Otherwise the difference cancels (for small mu relative to epsilon, or tiny
    delta: at epsilon = 1e-6, delta = 1e-100 the terms agree to 9 digits and the direct formula was
    off by 7e-6 relative), and delta is computed as the integral of DRS's privacy-loss form, with
    no subtraction (:func:`_gdp_delta_integral`).
    """
    mu = positive("mu", mu)
    if not math.isfinite(epsilon) or epsilon < 0:
        raise PrivacyParameterError(f"epsilon: expected a finite number >= 0, got {epsilon!r}")
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    first = float(special.ndtr(a))
    log_second = epsilon + float(special.log_ndtr(b))
    second = math.exp(log_second)
    # Rounding error of the direct formula: a few ulps of each term, the second term's scaled by
    # its log (an absolute error in log_ndtr is a relative one in exp).
    rounding = _DIRECT_ULPS * _EPS * (first + second * (1.0 + abs(log_second)))
    if second <= 0.5 * first or (first > second and rounding <= _DIRECT_RTOL * (first - second)):
        return max(0.0, first - second)
    return _gdp_delta_integral(mu, epsilon)


def _gdp_delta_integral(mu: float, epsilon: float) -> float:
    """delta_GDP(mu, epsilon) without cancellation (DRS Cor. 2.13 in its privacy-loss form).

    With the privacy loss L = mu^2/2 + mu Z, Z ~ N(0, 1), delta = E[(1 - e^(epsilon - L))_+]
    (DRS Cor. 2.13 is this expectation evaluated in closed form). Writing Z = z0 + t with
    z0 = epsilon/mu - mu/2 and phi(z0 + t) = phi(z0) exp(-z0 t - t^2/2):
        delta = phi(z0) int_0^inf (1 - e^(-mu t)) exp(-z0 t - t^2/2) dt,
    an integral of a positive function; phi(z0) is applied in log space. With t = h s,
    h = 1 / (1 + max(z0, 0)), the weight decays like e^-s (z0 >= 1) or e^(-s^2/8) (z0 < 1), and
    :func:`gdp_delta` calls this only where the two DRS terms are within a factor 2, which keeps
    mu h below about 1; the s-integral over [0, 127.5] is a composite 20-point Gauss-Legendre rule
    on panels of doubling width (_GL_S, _GL_W). For z0 < -1 (not reached from gdp_delta) an
    adaptive quadrature is used instead.
    """
    z0 = epsilon / mu - mu / 2.0
    log_scale = -0.5 * z0 * z0 - _LOG_SQRT_2PI
    if z0 >= -1.0:
        h = 1.0 / (1.0 + max(z0, 0.0))
        t = h * _GL_S
        value = h * float(np.dot(_GL_W, -np.expm1(-mu * t) * np.exp(-t * (z0 + 0.5 * t))))
    else:

        def integrand(u: float) -> float:
            return -math.expm1(-mu * u) * math.exp(-u * (z0 + 0.5 * u))

        value, _ = integrate.quad(integrand, 0.0, -z0 + 40.0, epsabs=0.0, epsrel=1e-13, limit=200, points=[-z0])
    if value <= 0.0:
        return 0.0
    return min(1.0, math.exp(log_scale + math.log(value)))


def gdp_epsilon(*, mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 with delta_GDP(mu, epsilon) <= delta (inverse of :func:`gdp_delta`).

    DRS Cor. 2.13 inverted in epsilon by brentq, then stepped up by ulps where needed
    (:func:`_feasible_below` with ``upward=True``) so that ``gdp_delta(mu=mu, epsilon=result) <= delta``
    as computed here.
    """
    mu = positive("mu", mu)
    delta = open_unit("delta", delta)

    def excess(e: float) -> float:
        return gdp_delta(mu=mu, epsilon=e) - delta

    if excess(0.0) <= 0:
        return 0.0
    what = f"gdp_epsilon at (mu, delta)=({mu!r}, {delta!r})"
    hi = 1.0
    for _ in range(_MAX_BRACKET_STEPS):
        if excess(hi) <= 0:
            break
        hi *= 2.0
    else:
        raise PrivacyParameterError(f"{what}: no finite epsilon meets delta")
    return _feasible_below(_root(excess, 0.0, hi, what), excess, what, upward=True)


def mu_budget(*, epsilon: float, delta: float) -> float:
    """The largest mu with delta_GDP(mu, epsilon) <= delta: the GDP filter's budget mu_B (privacy.md §3).

    DRS Cor. 2.13, inverted in mu by brentq, then stepped down by ulps where needed
    (:func:`_feasible_below`): the result satisfies ``gdp_delta(mu=mu_B, epsilon=epsilon) <= delta``
    as computed here. brentq stops within 4 ulps (relative) of the root and the step is at most one
    ulp more than needed, so mu_B stays tight: mu_B (1 + 1e-12) is infeasible at the (epsilon, delta)
    of tests/unit/test_conversions_feasible.py.
    """
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)

    def excess(m: float) -> float:
        return gdp_delta(mu=m, epsilon=epsilon) - delta

    what = f"mu_budget at (epsilon, delta)=({epsilon!r}, {delta!r})"
    # Bracket [lo, hi] = [m, 2m] with lo feasible and hi not (delta_GDP increases in mu).
    hi = 1.0
    for _ in range(_MAX_BRACKET_STEPS):
        if excess(hi) > 0:
            break
        hi *= 2.0
    else:
        raise PrivacyParameterError(f"{what}: no finite mu reaches delta")
    lo = hi / 2.0
    for _ in range(_MAX_BRACKET_STEPS):
        if excess(lo) <= 0:
            break
        lo, hi = lo / 2.0, lo
    else:
        raise PrivacyParameterError(f"{what}: no positive mu meets delta")
    return _feasible_below(_root(excess, lo, hi, what), excess, what)


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


def _log_one_minus_inverse_order(log_am1: float) -> float:
    # log(1 - 1/a) = log((a-1)/a) = x - log1p(e^x) for x = log(a - 1); for x > 0 that difference
    # cancels, and -log1p(e^-x) is used instead.
    if log_am1 > 0.0:
        return -math.log1p(math.exp(-log_am1))
    return log_am1 - math.log1p(math.exp(log_am1))


def _zcdp_log_delta_at(rho: float, epsilon: float, log_am1: float) -> float:
    # CKS Cor. 13: log of exp((a-1)(a rho - eps)) (1-1/a)^a / (a-1), with x = log(a - 1),
    # l = log(1 - 1/a) and log(a) = x - l: (a-1)(a rho - eps) + a l - x = e^x (a rho - eps + l) + l - x.
    # Written in x so that orders close to 1 (x << 0, where 1 + e^x rounds to 1) stay exact.
    e = math.exp(log_am1)
    log_ratio = _log_one_minus_inverse_order(log_am1)
    return e * ((1.0 + e) * rho - epsilon + log_ratio) + log_ratio - log_am1


def _zcdp_slope_at(rho: float, epsilon: float, log_am1: float) -> float:
    # d/da of the CKS Cor. 13 log-delta: (2a - 1) rho - eps + log(1 - 1/a); increasing in a
    # (second derivative 2 rho + 1/(a(a-1)) > 0), so the objective is convex in a.
    return (1.0 + 2.0 * math.exp(log_am1)) * rho - epsilon + _log_one_minus_inverse_order(log_am1)


def zcdp_delta(*, rho: float, epsilon: float) -> float:
    """delta(epsilon) of a rho-zCDP mechanism by CKS Cor. 13 (infimum over orders), at most 1.

    The objective log delta(a) is convex in the order a (its a-derivative (2a - 1) rho - epsilon +
    log(1 - 1/a) increases), so the infimum is at the root of that derivative, found by brentq over
    x = log(a - 1) with a bracket widened from (-12, 14) as needed (up to (-745, 700); at a limit
    the bound at the limit is used, which is still a valid, if loose, delta).
    """
    rho = positive("rho", rho)
    if not math.isfinite(epsilon) or epsilon < 0:
        raise PrivacyParameterError(f"epsilon: expected a finite number >= 0, got {epsilon!r}")
    lo, hi = _LOG_ORDER_MINUS_ONE
    lo_limit, hi_limit = _LOG_ORDER_MINUS_ONE_LIMITS
    while lo > lo_limit and _zcdp_slope_at(rho, epsilon, lo) > 0:
        lo = max(2.0 * lo, lo_limit)
    while hi < hi_limit and _zcdp_slope_at(rho, epsilon, hi) < 0:
        hi = min(2.0 * hi, hi_limit)
    if _zcdp_slope_at(rho, epsilon, lo) >= 0:
        x = lo
    elif _zcdp_slope_at(rho, epsilon, hi) <= 0:
        x = hi
    else:
        x = float(optimize.brentq(lambda t: _zcdp_slope_at(rho, epsilon, t), lo, hi, xtol=1e-13, rtol=_RTOL))
    return min(1.0, math.exp(_zcdp_log_delta_at(rho, epsilon, x)))


def zcdp_epsilon(*, rho: float, delta: float, conversion: ZcdpConversion = "cks") -> float:
    """epsilon of a rho-zCDP mechanism at delta (CKS Cor. 13, or BS Prop. 1.3)."""
    rho = positive("rho", rho)
    delta = open_unit("delta", delta)
    if conversion == "bs":
        return rho + 2.0 * math.sqrt(rho * -math.log(delta))
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
    """The largest rho whose conversion is (epsilon, delta)-DP: the zCDP filter's budget rho_B (privacy.md §3).

    "bs": FZ Thm 4.8's B* = (sqrt(log(1/delta) + epsilon) - sqrt(log(1/delta)))^2, evaluated as
    (epsilon / (sqrt(log(1/delta) + epsilon) + sqrt(log(1/delta))))^2 (no cancellation for small
    epsilon), then stepped down by ulps where needed so that ``zcdp_epsilon(rho=rho_B, delta=delta,
    conversion="bs") <= epsilon`` as computed here.
    "cks": CKS Cor. 13 inverted in rho by brentq, then stepped down by ulps where needed
    (:func:`_feasible_below`) so that ``zcdp_delta(rho=rho_B, epsilon=epsilon) <= delta`` as computed
    here; as for :func:`mu_budget`, rho_B (1 + 1e-12) is infeasible at the tested (epsilon, delta).
    """
    epsilon = positive("epsilon", epsilon)
    delta = open_unit("delta", delta)
    what = f"rho_budget ({conversion}) at (epsilon, delta)=({epsilon!r}, {delta!r})"
    if conversion == "bs":
        log_inv = -math.log(delta)  # not log(1/delta): 1/delta overflows for subnormal delta
        closed = (epsilon / (math.sqrt(log_inv + epsilon) + math.sqrt(log_inv))) ** 2
        return _feasible_below(closed, lambda r: zcdp_epsilon(rho=r, delta=delta, conversion="bs") - epsilon, what)
    if conversion != "cks":
        raise PrivacyParameterError(f"conversion: expected 'cks' or 'bs', got {conversion!r}")

    def excess(r: float) -> float:
        return zcdp_delta(rho=r, epsilon=epsilon) - delta

    # delta_CKS grows with rho; the BS budget is feasible (BS is looser). Bracket [lo, hi] with lo
    # feasible and hi not, hi found by doubling from lo.
    lo = rho_budget(epsilon=epsilon, delta=delta, conversion="bs")
    for _ in range(_MAX_BRACKET_STEPS):
        if excess(lo) <= 0:
            break
        lo /= 2.0
    else:
        raise PrivacyParameterError(f"{what}: no positive rho meets delta")
    hi = 2.0 * lo
    for _ in range(_MAX_BRACKET_STEPS):
        if excess(hi) > 0:
            break
        lo, hi = hi, 2.0 * hi
    else:
        raise PrivacyParameterError(f"{what}: no finite rho reaches delta")
    return _feasible_below(_root(excess, lo, hi, what), excess, what)
