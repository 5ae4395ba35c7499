"""The contract every unit filter keeps (privacy.md §3, §4, §6), run once per filter kind.

The shape of dp_accounting's ``privacy_accountant_test.py``: :class:`UnitFilterContract` holds the
tests and is not collected itself (its name does not start with ``Test``); each ``Test*`` subclass
builds its filter, drives one release through it, serialises its state as the agent's ledger does,
and says what the math gives for its budget. The properties:

- the budget is the one the math gives, on its feasible side (privacy.md §3, §6);
- a release beyond the budget is never admitted (the check comes before the release, §3);
- a stopped unit stays stopped, and what a unit has been charged never goes down (§3);
- every unit takes part for as many rounds as the worst-case analysis promises (§4);
- partial clipping spends the exact remainder, where the filter has one (FZ Alg. 3, §4);
- the state round-trips through its stored arrays; replaying the releases rebuilds it; the filter
  rebuilds from its description (style.md: replaying the ledger through the filter rebuilds the state);
- a NaN, infinite, negative, zero or boolean parameter raises ``PrivacyParameterError`` naming it (§3).

Every number a test asserts comes from privacy.md (the §3 reference table) or from an independent
computation in this file (scipy's normal distribution, root finding and minimisation over the
formulas privacy.md states), never from ``protocol.conversions`` or the filter under test.
"""

from __future__ import annotations

import abc
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
from numpy.typing import NDArray
from scipy import optimize, special, stats

from protocol.errors import PrivacyParameterError
from protocol.filters import FilterState, GaussianFilter, charge, clip_scales, partial_clip, rebuild
from protocol.realisation import RealisationFilter, RealisationState, advance, decide, realised_loss

EPSILON, DELTA = 3.0, 1e-5  # privacy.md §3, the reference row
NOISE_STD, L2_CLIP = 10.0, 1.0  # the reference row's sigma at unit sensitivity: a full round costs mu^2 = 0.01
N_UNITS, ROUNDS, SEEDS = 6, 80, (0, 1, 2)
BAD = (math.nan, math.inf, -1.0, 0.0, True)  # privacy.md §3: not finite, or <= 0, is an error; a bool is no number
BAD_ENTRY = (math.nan, math.inf, -1.0)  # in a per-unit array, where 0 is a unit that asks nothing
RTOL = 1e-9  # the independent root finding is good to a few ulps; this leaves room for both sides' rounding


# --- the math, computed here (privacy.md §3, §6) ---------------------------------------------------


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta_GDP(mu, eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (DRS Cor. 2.13; privacy.md §3)."""
    return float(stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2))


def root(f: Callable[[float], float], lo: float, hi: float) -> float:
    return float(optimize.brentq(f, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps))


def mu_budget(epsilon: float, delta: float) -> float:
    """mu_B: the largest mu with delta_GDP(mu, eps) <= delta (privacy.md §3)."""
    return root(lambda mu: gdp_delta(mu, epsilon) - delta, 1e-6, 100.0)


def cks_log_delta(rho: float, epsilon: float) -> float:
    """log delta_CKS(rho, eps) = log inf_{a>1} exp((a-1)(a rho - eps)) (1-1/a)^a / (a-1) (CKS Cor. 13; privacy.md §3),
    minimised over log(a - 1) on a grid, then refined."""

    def log_term(log_am1: float) -> float:
        a = 1.0 + math.exp(log_am1)
        return (a - 1.0) * (a * rho - epsilon) + a * math.log1p(-1.0 / a) - log_am1

    grid = np.linspace(-12.0, 12.0, 2401)
    values = np.array([log_term(x) for x in grid])
    i = int(np.argmin(values))
    bounds = (grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)])
    best = optimize.minimize_scalar(log_term, bounds=bounds, method="bounded", options={"xatol": 1e-12})
    return min(float(best.fun), float(values[i]))


def rho_budget_cks(epsilon: float, delta: float) -> float:
    """rho_B: the largest rho with delta_CKS(rho, eps) <= delta (privacy.md §3)."""
    return root(lambda rho: cks_log_delta(rho, epsilon) - math.log(delta), 1e-6, epsilon)


def rho_budget_bs(epsilon: float, delta: float) -> float:
    """rho_B = (sqrt(log(1/delta) + eps) - sqrt(log(1/delta)))^2 (BS Prop. 1.3; FZ Thm 4.8 B*; privacy.md §3)."""
    log_inv = math.log(1.0 / delta)
    return (math.sqrt(log_inv + epsilon) - math.sqrt(log_inv)) ** 2


def bs_epsilon(rho: float, delta: float) -> float:
    """eps = rho + 2 sqrt(rho log(1/delta)) (BS Prop. 1.3)."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def rdp_budget(epsilon: float, delta: float, order: float) -> float:
    """B_a at order a: (a, B_a)-RDP is (eps, delta)-DP for eps = B_a + log((a-1)/a) - (log delta + log a)/(a-1)
    (CKS Prop. 12; Balle et al. 2020 Thm 21: the conversion dp_accounting's RDP accountant uses), solved for B_a."""
    return epsilon - math.log((order - 1.0) / order) + (math.log(delta) + math.log(order)) / (order - 1.0)


def z(p: float) -> float:
    """z(p) = Phi^{-1}(1 - p) (privacy.md §6)."""
    return float(stats.norm.isf(p))


# --- the contract --------------------------------------------------------------------------------------


class UnitFilterContract(abc.ABC):
    """What every unit filter must satisfy. Not collected itself; each ``Test*`` subclass runs it once.

    A subclass gives its filter's privacy parameters (``PARAMETERS``: name -> valid value) and its
    per-release parameters (``RELEASE_PARAMETERS``: name -> bad values to try), and implements the
    hooks below. ``KNOWN_BUGS`` maps a parameter name to the reason its check fails today; that
    one test is marked xfail(strict=True), so it fails the suite once the bug is fixed.
    """

    PARAMETERS: ClassVar[dict[str, object]]
    RELEASE_PARAMETERS: ClassVar[dict[str, tuple[object, ...]]]
    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset()
    KNOWN_BUGS: ClassVar[dict[str, str]] = {}
    supports_partial_clip: ClassVar[bool] = False
    mu_full: ClassVar[float]  # the sensitivity of a full-norm request
    mu_most: ClassVar[float]  # the largest sensitivity a random run asks for

    # -- hooks ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def build(self, **params: Any) -> Any:
        """The filter at ``PARAMETERS``, with ``params`` replacing some of them."""

    @abc.abstractmethod
    def fresh(self, filt: Any, n_units: int) -> Any:
        """The state of ``n_units`` units before any release."""

    @abc.abstractmethod
    def release(self, filt: Any, state: Any, mu: NDArray[np.float64], rng: np.random.Generator) -> tuple[Any, Any, Any]:
        """One release at per-unit sensitivity ``mu``: (new state, who took part, the record the ledger keeps)."""

    @abc.abstractmethod
    def stopped(self, state: Any) -> NDArray[np.bool_]:
        """Units that will never take part again."""

    @abc.abstractmethod
    def charged(self, state: Any) -> NDArray[np.float64]:
        """Per unit, what the filter has charged so far (the quantity that must never go down)."""

    @abc.abstractmethod
    def to_arrays(self, state: Any) -> dict[str, np.ndarray]:
        """The state as the agent stores it in its ledger (client_agent/agent.py)."""

    @abc.abstractmethod
    def from_arrays(self, arrays: dict[str, np.ndarray]) -> Any:
        """The state back from the stored arrays."""

    @abc.abstractmethod
    def replay(self, filt: Any, n_units: int, records: Sequence[Any]) -> Any:
        """The state rebuilt from the stored records alone."""

    @abc.abstractmethod
    def from_description(self, described: dict[str, Any]) -> Any:
        """The filter rebuilt from its JSON description (what the ledger's configuration holds)."""

    @abc.abstractmethod
    def budget(self, filt: Any) -> list[tuple[str, float, float]]:
        """(what, the filter's value, the value the math gives), for every number that fixes the budget."""

    @abc.abstractmethod
    def feasible(self, filt: Any) -> list[tuple[str, float, float]]:
        """(what, the guarantee's value at the filter's budget by the math, its target): value <= target."""

    @abc.abstractmethod
    def oracle(self, filt: Any, n_units: int) -> Oracle:
        """An independent implementation of the filter's rule, from privacy.md."""

    @abc.abstractmethod
    def worst_case_rounds(self, filt: Any) -> int:
        """Rounds at full norm every unit takes part in, whatever the data (privacy.md §4, TVC Prop. 1)."""

    @abc.abstractmethod
    def release_with(self, filt: Any, state: Any, name: str, value: object) -> None:
        """One release (or the clip before it) with release parameter ``name`` set to ``value``."""

    def bad_variant(self, name: str, bad: object) -> object:
        """The value to build with when parameter ``name`` is ``bad`` (a sequence parameter wraps it)."""
        return bad

    # -- helpers -------------------------------------------------------------------------------

    def run(self, seed: int) -> list[tuple[Any, NDArray[np.float64], Any, Any, Any]]:
        """ROUNDS releases at random sensitivities up to ``mu_most``.

        Returns (state before, mu, took part, state after, record) per release."""
        rng = np.random.default_rng(seed)
        filt = self.build()
        state = self.fresh(filt, N_UNITS)
        steps = []
        for _ in range(ROUNDS):
            mu = rng.uniform(0.0, self.mu_most, N_UNITS)
            mu[rng.random(N_UNITS) < 0.1] = 0.0  # some units ask nothing this round
            after, took_part, record = self.release(filt, state, mu, rng)
            steps.append((state, mu, np.asarray(took_part), after, record))
            state = after
        return steps

    # -- the tests -----------------------------------------------------------------------------

    def test_the_budget_is_the_one_the_math_gives(self) -> None:
        for what, found, expected in self.budget(self.build()):
            assert found == pytest.approx(expected, rel=RTOL, abs=1e-15), what

    def test_the_budget_is_on_its_feasible_side(self) -> None:
        for what, value, target in self.feasible(self.build()):
            assert value <= target * (1 + RTOL), what

    @pytest.mark.parametrize("seed", SEEDS)
    def test_a_release_beyond_the_budget_is_never_admitted(self, seed: int) -> None:
        filt = self.build()
        oracle = self.oracle(filt, N_UNITS)
        for t, (_, mu, took_part, _, record) in enumerate(self.run(seed)):
            allowed = oracle.allowed(mu)
            assert not np.any(took_part & ~allowed), f"round {t}: units {np.flatnonzero(took_part & ~allowed)}"
            oracle.observe(mu, took_part, record)

    @pytest.mark.parametrize("seed", SEEDS)
    def test_a_stopped_unit_stays_stopped(self, seed: int) -> None:
        steps = self.run(seed)
        for before, _, took_part, after, _ in steps:
            was = self.stopped(before)
            assert not np.any(took_part[was])
            assert np.all(self.stopped(after)[was])
        assert np.any(self.stopped(steps[-1][3])), "no unit stopped: the run has no power"

    @pytest.mark.parametrize("seed", SEEDS)
    def test_charges_never_go_down(self, seed: int) -> None:
        for before, _, _, after, _ in self.run(seed):
            assert np.all(self.charged(after) >= self.charged(before))

    def test_every_unit_takes_part_for_the_worst_case_rounds(self) -> None:
        filt = self.build()
        state = self.fresh(filt, N_UNITS)
        rng = np.random.default_rng(0)
        full = np.full(N_UNITS, self.mu_full)
        rounds = self.worst_case_rounds(filt)
        for t in range(rounds):
            state, took_part, _ = self.release(filt, state, full, rng)
            assert np.all(took_part), f"round {t + 1} of {rounds}"

    def test_partial_clipping_spends_the_exact_remainder(self) -> None:
        if not self.supports_partial_clip:
            pytest.skip("this filter has no remainder to clip to: it decides on the realised loss (privacy.md §6)")
        self.check_partial_clip(self.build())

    def check_partial_clip(self, filt: Any) -> None:
        raise NotImplementedError

    @pytest.mark.parametrize("seed", SEEDS)
    def test_the_state_round_trips_through_its_stored_arrays(self, seed: int) -> None:
        filt = self.build()
        state = self.run(seed)[10][3]  # some units part-spent, some stopped
        buffer = io.BytesIO()
        np.savez(buffer, allow_pickle=False, **self.to_arrays(state))
        with np.load(io.BytesIO(buffer.getvalue()), allow_pickle=False) as stored:
            back = self.from_arrays({name: stored[name] for name in stored.files})
        assert_same_arrays(self.to_arrays(back), self.to_arrays(state))
        mu = np.full(N_UNITS, self.mu_full)
        one = self.release(filt, state, mu, np.random.default_rng(1))
        other = self.release(filt, back, mu, np.random.default_rng(1))
        np.testing.assert_array_equal(one[1], other[1])
        assert_same_arrays(self.to_arrays(one[0]), self.to_arrays(other[0]))

    @pytest.mark.parametrize("seed", SEEDS)
    def test_replaying_the_records_rebuilds_the_state(self, seed: int) -> None:
        steps = self.run(seed)
        rebuilt = self.replay(self.build(), N_UNITS, [record for *_, record in steps])
        assert_same_arrays(self.to_arrays(rebuilt), self.to_arrays(steps[-1][3]))

    def test_the_filter_rebuilds_from_its_description(self) -> None:
        filt = self.build()
        assert self.from_description(json.loads(json.dumps(filt.describe()))) == filt

    def test_a_bad_parameter_is_refused_by_name(self, parameter: str) -> None:
        for bad in BAD:
            if bad == 0.0 and parameter in self.ZERO_ALLOWED:
                continue
            with pytest.raises(PrivacyParameterError, match=rf"^{re.escape(parameter)}\b"):
                self.build(**{parameter: self.bad_variant(parameter, bad)})

    def test_a_bad_release_parameter_is_refused_by_name(self, release_parameter: str) -> None:
        filt = self.build()
        state = self.fresh(filt, N_UNITS)
        for bad in self.RELEASE_PARAMETERS[release_parameter]:
            with pytest.raises(PrivacyParameterError, match=rf"^{re.escape(release_parameter)}\b"):
                self.release_with(filt, state, release_parameter, bad)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each subclass's own parameters, one test each; a known bug marks its one test xfail(strict=True)."""
    cls = metafunc.cls
    if cls is None:
        return
    for fixture, names in (("parameter", "PARAMETERS"), ("release_parameter", "RELEASE_PARAMETERS")):
        if fixture in metafunc.fixturenames:
            bugs = cls.KNOWN_BUGS if fixture == "parameter" else {}
            values = [
                pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=bugs[name])) if name in bugs else name
                for name in getattr(cls, names)
            ]
            metafunc.parametrize(fixture, values)


def assert_same_arrays(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(found) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(np.asarray(found[name]), np.asarray(array), err_msg=name)


class Oracle(abc.ABC):
    """An independent implementation of a filter's rule, stepped along with the filter under test."""

    @abc.abstractmethod
    def allowed(self, mu: NDArray[np.float64]) -> NDArray[np.bool_]:
        """Units the rule lets take part in a release at sensitivity ``mu``."""

    @abc.abstractmethod
    def observe(self, mu: NDArray[np.float64], took_part: NDArray[np.bool_], record: Any) -> None:
        """Fold in the release the filter made."""


# --- Gaussian filters: a threshold T on S = sum mu_t^2 (privacy.md §3) ----------------------------------


class GaussianOracle(Oracle):
    """A unit may take part while it is not stopped and S + mu^2 <= T; a refused unit is stopped for good."""

    def __init__(self, threshold: float, n_units: int) -> None:
        self.threshold = threshold
        self.spent = np.zeros(n_units)
        self.stopped = np.zeros(n_units, dtype=np.bool_)

    def allowed(self, mu: NDArray[np.float64]) -> NDArray[np.bool_]:
        return ~self.stopped & (self.spent + mu**2 <= self.threshold * (1 + RTOL))

    def observe(self, mu: NDArray[np.float64], took_part: NDArray[np.bool_], record: Any) -> None:
        cost = (record.l2_norms / record.noise_std) ** 2  # privacy.md §2: ||v||^2 / sigma^2
        np.testing.assert_array_equal(record.l2_norms[~took_part], 0.0)  # who did not take part released 0
        self.spent = self.spent + np.where(took_part, cost, 0.0)
        self.stopped |= (mu > 0) & ~took_part


class GaussianContract(UnitFilterContract):
    """The Gaussian filters' hooks; a subclass gives the constructor and the threshold the math gives."""

    RELEASE_PARAMETERS: ClassVar[dict[str, tuple[object, ...]]] = {
        "noise_std": BAD,
        "l2_clip": BAD,
        "l2_norms": BAD_ENTRY,
    }
    supports_partial_clip = True
    mu_full = L2_CLIP / NOISE_STD
    mu_most = 3 * mu_full  # requests with other clips: units run out within the run, many of them refused
    # privacy.md §3 reference table at (3, 1e-5): (the budget's name, its value, a function of T giving it),
    # and the rounds at sigma = 10; None where the table has no row for this filter.
    TABLE: ClassVar[tuple[str, float, Callable[[float], float]] | None] = None
    TABLE_ROUNDS: ClassVar[int | None] = None

    @abc.abstractmethod
    def threshold(self) -> float:
        """T, computed here from privacy.md's formulas."""

    def fresh(self, filt: GaussianFilter, n_units: int) -> FilterState:
        return FilterState.fresh(n_units)

    def release(
        self, filt: GaussianFilter, state: FilterState, mu: NDArray[np.float64], rng: np.random.Generator
    ) -> tuple[FilterState, NDArray[np.bool_], Any]:
        norms = mu * NOISE_STD
        result = charge(filt, state, noise_std=NOISE_STD, l2_norms=norms)
        record = result.release(kind="gradient", round_id="r", noise_std=NOISE_STD, l2_norms=norms)
        return result.state, result.admitted, record

    def stopped(self, state: FilterState) -> NDArray[np.bool_]:
        return state.stopped

    def charged(self, state: FilterState) -> NDArray[np.float64]:
        return state.spent

    def to_arrays(self, state: FilterState) -> dict[str, np.ndarray]:
        return {"spent": state.spent, "stopped": state.stopped}

    def from_arrays(self, arrays: dict[str, np.ndarray]) -> FilterState:
        return FilterState(spent=arrays["spent"], stopped=arrays["stopped"])

    def replay(self, filt: GaussianFilter, n_units: int, records: Sequence[Any]) -> FilterState:
        return rebuild(filt, n_units, records)

    def from_description(self, described: dict[str, Any]) -> GaussianFilter:
        return GaussianFilter(
            kind=described["filter"],
            epsilon=described["epsilon"],
            delta=described["delta"],
            threshold=described["threshold"],
            reserved=described["reserved"],
            orders=tuple(described["orders"]),
            conversion=described["conversion"],
        )

    def budget(self, filt: GaussianFilter) -> list[tuple[str, float, float]]:
        return [("threshold T on S", filt.threshold, self.threshold())]

    def oracle(self, filt: GaussianFilter, n_units: int) -> Oracle:
        return GaussianOracle(self.threshold(), n_units)

    def worst_case_rounds(self, filt: GaussianFilter) -> int:
        # privacy.md §4: every unit is active for at least floor(T sigma^2 / C^2) rounds.
        rounds = math.floor(self.threshold() / self.mu_full**2)
        if self.TABLE_ROUNDS is not None:
            assert rounds == self.TABLE_ROUNDS  # privacy.md §3 table, rounds at sigma = 10
        return rounds

    def test_the_budget_is_the_one_in_the_reference_table(self) -> None:
        if self.TABLE is None:
            pytest.skip("privacy.md §3's table has no row for this filter")
        name, value, of_threshold = self.TABLE
        assert of_threshold(self.build().threshold) == pytest.approx(value, abs=5e-7), name  # 6 digits in the table

    def test_the_round_after_the_worst_case_ones_is_refused_at_full_norm(self) -> None:
        filt = self.build()
        state = self.fresh(filt, N_UNITS)
        full = np.full(N_UNITS, self.mu_full)
        rng = np.random.default_rng(0)
        for _ in range(self.worst_case_rounds(filt)):
            state, _, _ = self.release(filt, state, full, rng)
        state, took_part, _ = self.release(filt, state, full, rng)
        assert not np.any(took_part) and np.all(state.stopped)

    def check_partial_clip(self, filt: GaussianFilter) -> None:
        # FZ Alg. 3 (privacy.md §4): c = min(C, sigma sqrt(T - S)). The vector is scaled to c in its storage
        # dtype with the filter's rounding margin (protocol.filters.clip_scales) and charged at its measured norm.
        threshold = self.threshold()
        rng = np.random.default_rng(5)
        spent = filt.threshold * np.concatenate([rng.uniform(0.0, 0.6, 10), rng.uniform(0.8, 0.999, 10)])
        state = FilterState(spent=spent, stopped=np.zeros(spent.size, dtype=np.bool_))
        clip = NOISE_STD * math.sqrt(0.3 * threshold)  # full norm below 0.7 T spent, partial above
        bound = partial_clip(filt, state, noise_std=NOISE_STD, l2_clip=clip)
        expected = np.minimum(clip, NOISE_STD * np.sqrt(threshold - spent))
        np.testing.assert_allclose(bound, expected, rtol=1e-6)
        rows = np.full((spent.size, 64), 1e3)
        scale = clip_scales(np.linalg.norm(rows, axis=1), bound, dtype_eps=float(np.finfo(np.float64).eps))
        norms = np.linalg.norm(rows * scale[:, None], axis=1)
        result = charge(filt, state, noise_std=NOISE_STD, l2_norms=norms)
        assert np.all(result.admitted)
        paid = result.state.spent - spent
        partial = expected < clip
        assert partial.sum() == 10
        np.testing.assert_allclose(paid[partial], threshold - spent[partial], rtol=1e-6)  # the exact remainder
        assert np.all(result.state.spent <= threshold * (1 + RTOL))
        assert np.all(result.state.stopped[partial]) and not np.any(result.state.stopped[~partial])
        np.testing.assert_allclose(paid[~partial], (clip / NOISE_STD) ** 2, rtol=1e-12)  # a full round

    def release_with(self, filt: GaussianFilter, state: FilterState, name: str, value: object) -> None:
        if name == "noise_std":
            with pytest.raises(PrivacyParameterError, match=r"^noise_std\b"):
                partial_clip(filt, state, noise_std=value, l2_clip=L2_CLIP)  # type: ignore[arg-type]
            charge(filt, state, noise_std=value, l2_norms=np.ones(state.n_units))  # type: ignore[arg-type]
        elif name == "l2_clip":
            partial_clip(filt, state, noise_std=NOISE_STD, l2_clip=value)  # type: ignore[arg-type]
        else:
            norms = np.ones(state.n_units)
            norms[0] = value  # type: ignore[call-overload]
            charge(filt, state, noise_std=NOISE_STD, l2_norms=norms)


class TestGdpFilter(GaussianContract):
    """GDP: continue while S <= mu_B^2 (ST; KTH; privacy.md §3). The default filter."""

    PARAMETERS: ClassVar[dict[str, object]] = {"epsilon": EPSILON, "delta": DELTA}
    TABLE = ("mu_B", 0.719117, math.sqrt)
    TABLE_ROUNDS = 51

    def build(self, **params: Any) -> GaussianFilter:
        return GaussianFilter.gdp(**(self.PARAMETERS | params))  # type: ignore[arg-type]

    def threshold(self) -> float:
        return mu_budget(EPSILON, DELTA) ** 2

    def feasible(self, filt: GaussianFilter) -> list[tuple[str, float, float]]:
        return [("delta_GDP(sqrt(T), eps)", gdp_delta(math.sqrt(filt.threshold), EPSILON), DELTA)]


class TestZcdpFilter(GaussianContract):
    """zCDP, rho_B by CKS Cor. 13: continue while S / 2 <= rho_B (FZ Thm 4.3, Remark 4.4; privacy.md §3)."""

    PARAMETERS: ClassVar[dict[str, object]] = {"epsilon": EPSILON, "delta": DELTA}
    TABLE = ("rho_B (CKS)", 0.224249, lambda t: t / 2)
    TABLE_ROUNDS = 44

    def build(self, **params: Any) -> GaussianFilter:
        return GaussianFilter.zcdp(**(self.PARAMETERS | params), conversion="cks")  # type: ignore[arg-type]

    def threshold(self) -> float:
        return 2.0 * rho_budget_cks(EPSILON, DELTA)

    def feasible(self, filt: GaussianFilter) -> list[tuple[str, float, float]]:
        return [("delta_CKS(T / 2, eps)", math.exp(cks_log_delta(filt.threshold / 2, EPSILON)), DELTA)]


class TestZcdpBsFilter(GaussianContract):
    """zCDP, rho_B by the simple conversion (BS Prop. 1.3; FZ Thm 4.8 B*; privacy.md §3)."""

    PARAMETERS: ClassVar[dict[str, object]] = {"epsilon": EPSILON, "delta": DELTA}
    TABLE = ("rho_B (BS)", 0.173483, lambda t: t / 2)
    TABLE_ROUNDS = 34

    def build(self, **params: Any) -> GaussianFilter:
        return GaussianFilter.zcdp(**(self.PARAMETERS | params), conversion="bs")  # type: ignore[arg-type]

    def threshold(self) -> float:
        return 2.0 * rho_budget_bs(EPSILON, DELTA)

    def feasible(self, filt: GaussianFilter) -> list[tuple[str, float, float]]:
        return [("eps_BS(T / 2)", bs_epsilon(filt.threshold / 2, DELTA), EPSILON)]


class TestRenyiFilter(GaussianContract):
    """Rényi at one order fixed in advance: continue while a S / 2 <= B_a (FZ Thm 4.3; privacy.md §3)."""

    PARAMETERS: ClassVar[dict[str, object]] = {"epsilon": EPSILON, "delta": DELTA, "order": 8.0}

    def build(self, **params: Any) -> GaussianFilter:
        return GaussianFilter.renyi(**(self.PARAMETERS | params))  # type: ignore[arg-type]

    def threshold(self) -> float:
        order = float(self.PARAMETERS["order"])  # type: ignore[arg-type]
        return 2.0 * rdp_budget(EPSILON, DELTA, order) / order

    def feasible(self, filt: GaussianFilter) -> list[tuple[str, float, float]]:
        # eps of (a, a T / 2)-RDP by the same conversion, read forwards.
        order = filt.orders[0]
        eps = (
            order * filt.threshold / 2
            + math.log((order - 1) / order)
            - (math.log(DELTA) + math.log(order)) / (order - 1)
        )
        return [("eps(a, a T / 2)", eps, EPSILON)]


class TestRenyiMultiFilter(GaussianContract):
    """Rényi over several orders, each at delta / k, continue while any fits (union bound; privacy.md §3)."""

    ORDERS = (4.0, 8.0, 16.0, 32.0)
    PARAMETERS: ClassVar[dict[str, object]] = {"epsilon": EPSILON, "delta": DELTA, "orders": ORDERS}

    def build(self, **params: Any) -> GaussianFilter:
        return GaussianFilter.renyi_multi(**(self.PARAMETERS | params))  # type: ignore[arg-type]

    def bad_variant(self, name: str, bad: object) -> object:
        return (bad, *self.ORDERS[1:]) if name == "orders" else bad

    def threshold(self) -> float:
        share = DELTA / len(self.ORDERS)
        return max(2.0 * rdp_budget(EPSILON, share, a) / a for a in self.ORDERS if rdp_budget(EPSILON, share, a) > 0)

    def feasible(self, filt: GaussianFilter) -> list[tuple[str, float, float]]:
        share = DELTA / len(self.ORDERS)
        usable = [a for a in self.ORDERS if rdp_budget(EPSILON, share, a) > 0]
        fits = min(a * filt.threshold / 2 / rdp_budget(EPSILON, share, a) for a in usable)
        return [("min over orders of (a T / 2) / B_a(delta / k): some order fits", fits, 1.0)]


class TestGdpReservedFilter(GaussianContract):
    """GDP with the local-trust monitor's cost reserved: T <- mu_B^2 - S_m (privacy.md §7)."""

    # The tree monitor over N = 64 rounds at sigma_m = 8: L = ceil(log2 N) + 1 = 7 nodes, S_m = L / sigma_m^2.
    RESERVED = (math.ceil(math.log2(64)) + 1) / 8.0**2
    PARAMETERS: ClassVar[dict[str, object]] = {"epsilon": EPSILON, "delta": DELTA, "squared_budget": RESERVED}
    ZERO_ALLOWED = frozenset({"squared_budget"})  # nothing reserved: no monitor

    def build(self, **params: Any) -> GaussianFilter:
        p = self.PARAMETERS | params
        filt = GaussianFilter.gdp(epsilon=p["epsilon"], delta=p["delta"])  # type: ignore[arg-type]
        return filt.reserve(squared_budget=p["squared_budget"])  # type: ignore[arg-type]

    def threshold(self) -> float:
        return mu_budget(EPSILON, DELTA) ** 2 - self.RESERVED

    def budget(self, filt: GaussianFilter) -> list[tuple[str, float, float]]:
        return [*super().budget(filt), ("reserved S_m", filt.reserved, self.RESERVED)]

    def feasible(self, filt: GaussianFilter) -> list[tuple[str, float, float]]:
        whole = math.sqrt(filt.threshold + filt.reserved)  # releases and monitor together (GDP composition)
        return [("delta_GDP(sqrt(T + S_m), eps)", gdp_delta(whole, EPSILON), DELTA)]


# --- the realisation filter (TVC; privacy.md §6) ----------------------------------------------------------


class RealisationOracle(Oracle):
    """TVC Alg. 1 as privacy.md §6 states it: holding request i, a unit accepts i+1 iff
    |L_{i-1}| <= eps - mu_max^2/2 - mu_max z(dt) - mu_i^2/2 - mu_i z(theta); at most N requests."""

    def __init__(self, filt: RealisationFilter, n_units: int) -> None:
        self.epsilon, self.max_rounds, self.mu_max = filt.epsilon, filt.max_rounds, filt.mu_max
        self.z_dt, self.z_theta = z(filt.delta_tilde), z(filt.theta)
        self.loss = np.zeros(n_units)
        self.accepting = np.full(n_units, self.margin(np.zeros(1))[0] >= 0)  # L_0 = 0, no current request
        self.answered = 0

    def margin(self, mu: NDArray[np.float64]) -> NDArray[np.float64]:
        head = self.epsilon - self.mu_max**2 / 2 - self.mu_max * self.z_dt
        return np.asarray(head - mu**2 / 2 - mu * self.z_theta)

    def allowed(self, mu: NDArray[np.float64]) -> NDArray[np.bool_]:
        return self.accepting & (self.answered < self.max_rounds)

    def observe(self, mu: NDArray[np.float64], took_part: NDArray[np.bool_], record: Any) -> None:
        _, losses = record
        np.testing.assert_array_equal(losses[~took_part], 0.0)
        room = np.abs(self.loss) <= self.margin(mu) + RTOL * self.epsilon
        self.accepting = took_part & room & (self.answered + 1 < self.max_rounds)
        self.loss = self.loss + losses
        self.answered += 1


class TestRealisationFilter(UnitFilterContract):
    """TVC's realisation-level filter, client units in local trust (privacy.md §6)."""

    PARAMETERS: ClassVar[dict[str, object]] = {"epsilon": EPSILON, "delta": DELTA, "max_rounds": 40, "mu_max": 0.3}
    RELEASE_PARAMETERS: ClassVar[dict[str, tuple[object, ...]]] = {"mu": BAD_ENTRY, "noise_std": BAD}
    mu_full = mu_most = 0.3

    def build(self, **params: Any) -> RealisationFilter:
        return RealisationFilter.create(**(self.PARAMETERS | params))  # type: ignore[arg-type]

    def fresh(self, filt: RealisationFilter, n_units: int) -> RealisationState:
        return RealisationState.fresh(filt, n_units)

    def release(
        self, filt: RealisationFilter, state: RealisationState, mu: NDArray[np.float64], rng: np.random.Generator
    ) -> tuple[RealisationState, NDArray[np.bool_], Any]:
        # Each unit's clipped contribution has norm mu sigma; its own noise is N(0, sigma^2 I) (client units).
        step = decide(filt, state, mu=mu)
        contribution = np.zeros((mu.size, 3))
        contribution[:, 0] = mu * NOISE_STD
        noise = rng.normal(0.0, NOISE_STD, (mu.size, 3))
        loss = realised_loss(contribution=contribution, noise=noise, noise_std=NOISE_STD)
        losses = np.where(step.participating, loss, 0.0)
        return advance(state, step, losses=losses), step.participating, (mu, losses)

    def stopped(self, state: RealisationState) -> NDArray[np.bool_]:
        return state.stopped

    def charged(self, state: RealisationState) -> NDArray[np.float64]:
        # The realised loss L is a random walk and may go down; what only grows is the count of requests.
        return np.full(state.loss.size, float(state.answered))

    def to_arrays(self, state: RealisationState) -> dict[str, np.ndarray]:
        return {"loss": state.loss, "accepting": state.accepting, "answered": np.array([state.answered], np.int64)}

    def from_arrays(self, arrays: dict[str, np.ndarray]) -> RealisationState:
        return RealisationState(loss=arrays["loss"], accepting=arrays["accepting"], answered=int(arrays["answered"][0]))

    def replay(self, filt: RealisationFilter, n_units: int, records: Sequence[Any]) -> RealisationState:
        state = RealisationState.fresh(filt, n_units)
        for mu, losses in records:
            state = advance(state, decide(filt, state, mu=mu), losses=losses)
        return state

    def from_description(self, described: dict[str, Any]) -> RealisationFilter:
        assert described.pop("filter") == "realisation"
        return RealisationFilter(**described)

    def budget(self, filt: RealisationFilter) -> list[tuple[str, float, float]]:
        n, mu_max = filt.max_rounds, filt.mu_max
        z_dt, z_theta = z(filt.delta_tilde), z(filt.theta)

        # privacy.md §6: for N rounds choose dt minimising z(dt) + z(theta(dt)),
        # theta(dt) = (delta - dt) / (N (1 - dt)).
        def objective(log_odds: float) -> float:
            dt = DELTA * float(special.expit(log_odds))
            return z(dt) + z((DELTA - dt) / (n * (1 - dt)))

        grid = np.linspace(-25.0, 25.0, 501)
        i = int(np.argmin([objective(x) for x in grid]))
        bounds = (grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)])
        best = optimize.minimize_scalar(objective, bounds=bounds, method="bounded", options={"xatol": 1e-10})
        out = [
            (
                "theta = theta(dt), the largest the budget allows",
                filt.theta,
                (DELTA - filt.delta_tilde) / (n * (1 - filt.delta_tilde)),
            ),
            ("z(dt) + z(theta) at the chosen split: the minimum", z_dt + z_theta, float(best.fun)),
            # TVC Prop. 1: kappa = eps - mu^2 - mu (z(dt) + z(theta)) for i.i.d. requests at mu = mu_max.
            ("kappa (TVC Prop. 1)", filt.kappa(mu=mu_max), EPSILON - mu_max**2 - mu_max * (z_dt + z_theta)),
        ]
        for mu in (0.0, mu_max / 2, mu_max):
            rule = EPSILON - mu_max**2 / 2 - mu_max * z_dt - mu**2 / 2 - mu * z_theta
            out.append((f"the continue rule's margin at mu = {mu}", float(filt.margin(mu)), rule))
        return out

    def feasible(self, filt: RealisationFilter) -> list[tuple[str, float, float]]:
        spent = filt.delta_tilde + filt.theta * (1 - filt.delta_tilde) * filt.max_rounds
        return [("dt + theta (1 - dt) N", spent, DELTA)]  # privacy.md §6, TVC Thm 1

    def oracle(self, filt: RealisationFilter, n_units: int) -> Oracle:
        return RealisationOracle(filt, n_units)

    def worst_case_rounds(self, filt: RealisationFilter) -> int:
        # Request 1 is accepted with L_0 = 0 iff eps - mu_max^2/2 - mu_max z(dt) >= 0; request 2 is decided
        # on L_0 = 0 too, so it is accepted iff kappa >= 0 (TVC Prop. 1). Later ones depend on the noise.
        kappa = EPSILON - filt.mu_max**2 - filt.mu_max * (z(filt.delta_tilde) + z(filt.theta))
        assert kappa >= 0
        return 2

    def release_with(self, filt: RealisationFilter, state: RealisationState, name: str, value: object) -> None:
        if name == "mu":
            mu = np.full(state.loss.size, 0.1)
            mu[0] = value
            decide(filt, state, mu=mu)
        else:
            realised_loss(contribution=np.ones((state.loss.size, 3)), noise=np.zeros(3), noise_std=value)  # type: ignore[arg-type]
