"""What the release adds for a unit is within what the unit is charged, to the last rounding (privacy.md §2).

Two gaps found by a hostile review (2026-11-27), each with the test that would have caught it:

- central trust rounded each client's exact float64 sum to float32 *before* the coordinator's noise, so the
  released sum moved by up to an ulp of the whole sum in every coordinate when one record came or went:
  a record charged 5.6e-5 moved it by 2.0e-4 (the float32 spacing near 140 is 1.5e-5), 3.6x its charge;
- materialised rows (client units, indicators) were charged their float64 norm with no margin for that
  norm's own rounding (below 4e-16 relative, but below the exact norm for about half the rows);
- a second review: a float64 owner model's Linear layer was charged ||a|| ||g|| from float64 factors whose
  squares can be subnormal (a few bits), 2.7 % below the outer product the sum added.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client_agent.agent import FLOAT32_EPS, Agent
from client_agent.state import AgentState
from client_agent.streaming import NORM_REL_ERROR, ArraySource, RowContributions, fused_clipped_sum
from protocol import messages as wire
from protocol.filters import FilterState, GaussianFilter, charge, clip_scales, partial_clip
from tests.factories import build_agent, gradient_request, node_config

FEATURES = 40
D = 2 * FEATURES + 2  # logreg weights (2, FEATURES) then biases (2,)
BACKGROUND = 5000
U = 2.0**-53


def _agent(folder: Path, x: np.ndarray, y: np.ndarray) -> Agent:
    folder.mkdir()
    return build_agent(folder, (x, y), trust="central", **{"policy-max-model-params": 100})


def _released(agent: Agent, parameters: np.ndarray) -> np.ndarray:
    request = gradient_request(
        "r1",
        features=FEATURES,
        trust="central",
        noise_std=10.0,  # a bound of about 2.7 (the whole budget at sigma 10): every record is clipped to 1
        l2_clip=1.0,
        parameters=parameters,
    )
    outcome = agent.handle(wire.GRADIENT, *wire.encode_request(request))
    assert not outcome.is_error and outcome.arrays is not None
    total = outcome.arrays["total"]
    assert total.dtype == np.float64  # central trust: the exact float64 sum, rounded after the noise only
    return np.asarray(total, dtype=np.float64)


def test_a_central_reply_moves_by_at_most_the_charge_of_the_record_that_differs(tmp_path: Path) -> None:
    """Neighbouring data sets through the agent's real release path: a background of 5,000 records whose
    clipped gradients sum to about 140 a coordinate, with and without one record of tiny gradient (its
    logits favour its label by 12, so its gradient is 6e-6 a coordinate, 0.4 of the float32 spacing
    of the sum). The two central-trust replies may differ by the record's charged norm plus the float64
    accumulation bound gamma_n x (the charged norms summed), both sums' (privacy.md §2), never more.
    Before the fix the replies were float32 and moved 2.0e-4 for a charge of 5.6e-5."""
    rng = np.random.default_rng(0)
    background = rng.uniform(0.5, 1.5, size=(BACKGROUND, FEATURES)).astype(np.float32)
    target = np.ones((1, FEATURES), dtype=np.float32)
    parameters = np.zeros(D, np.float32)
    parameters[2 * FEATURES] = 12.0  # bias of class 0: every record is predicted 0 with p = 1 - 6e-6
    x_with = np.concatenate([background, target])
    y_with = np.concatenate([np.ones(BACKGROUND, np.int64), np.zeros(1, np.int64)])
    with_target = _agent(tmp_path / "with", x_with, y_with)
    without = _agent(tmp_path / "without", background, np.ones(BACKGROUND, np.int64))
    r_with, r_without = _released(with_target, parameters), _released(without, parameters)
    charged_with = [rel["l2_norms"] for _, _, rel in with_target.ledger.releases()][-1]
    charged_without = [rel["l2_norms"] for _, _, rel in without.ledger.releases()][-1]
    with_target.close()
    without.close()
    charge = float(charged_with[-1])
    assert 1e-5 < charge < 1e-4  # the record that differs pays little; the others about 1 each
    assert np.all(charged_with[:-1] > 0.99)
    slack = (BACKGROUND + 1) * U / (1 - (BACKGROUND + 1) * U) * (charged_with.sum() + charged_without.sum())
    moved = float(np.linalg.norm(r_with - r_without))
    assert moved <= charge + slack, f"the reply moved {moved:.3e} for a record charged {charge:.3e}"


def test_a_reply_keeps_its_dtype_by_trust_whatever_stopped(tmp_path: Path) -> None:
    """The dtype is fixed by the trust (public), never by the data: float64 in central trust, float32 in local
    trust, where the client's own noise is added in float64 first (rounding after it is post-processing)."""
    x = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    for trust, dtype in (("central", np.float64), ("local", np.float32)):
        agent = build_agent(_fresh(tmp_path / trust), (x, y), trust=trust, **{"noise-seed": 1})
        outcome = agent.handle(wire.GRADIENT, *wire.encode_request(gradient_request("r1", trust=trust)))
        agent.close()
        assert not outcome.is_error and outcome.arrays is not None
        assert outcome.arrays["total"].dtype == dtype
        decoded = wire.ContributionReply.decode(outcome.config, outcome.arrays)
        assert decoded.total.dtype == dtype


def _fresh(folder: Path) -> Path:
    folder.mkdir()
    return folder


@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.complex64])
def test_a_reply_of_another_dtype_is_malformed(dtype: type) -> None:
    config = {"request_id": "r1", "status": wire.REPLY_OK, "trust": "central", "noise_added": 0.0}
    with pytest.raises(wire.ProtocolError, match=r"'total' must be a 1-d float32 or float64 array"):
        wire.ContributionReply.decode(config, {"total": np.zeros(3, dtype=dtype)})


def test_a_float32_reply_an_earlier_version_stored_still_decodes_in_central_trust() -> None:
    """A resumed run or a retry replays the stored reply byte for byte, whatever version stored it."""
    config = {"request_id": "r1", "status": wire.REPLY_OK, "trust": "central", "noise_added": 0.0}
    stored = np.linspace(-1.0, 1.0, 5, dtype=np.float32)
    decoded = wire.ContributionReply.decode(config, {"total": stored})
    assert decoded.total.dtype == np.float32 and np.array_equal(decoded.total, stored)


def _exact_norm_below(charged: float, row: np.ndarray) -> bool:
    """Whether the exact L2 norm of ``row`` (float32 values) is at most ``charged``, in integers: each float32
    value times 2^149 is an integer, so the squared norm times 2^298 is an exact integer sum."""
    scaled = np.ldexp(row.astype(np.float64), 149)  # exact: float32's smallest step is 2^-149
    total = sum(int(v) ** 2 for v in scaled.tolist())
    p, q = float(charged).as_integer_ratio()  # q a power of two
    return p * p * (1 << 298) >= total * q * q


def test_materialised_rows_are_charged_at_least_their_exact_norm() -> None:
    """RowContributions.scale returns the norms charged; each is at least the exact norm of the scaled row the
    sum adds (exactly, in integers), for rows of 4,096 float32 values, scaled or not; a row of one value is exact and
    pays no margin (counts: a correctly classified record pays exactly (1/sigma)^2)."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(200, 4096)).astype(np.float32)
    units = RowContributions(rows.copy())
    assert units.norm_rel_error == NORM_REL_ERROR
    scales = np.where(np.arange(200) % 2 == 0, 1.0, 0.37)
    charged = units.scale(scales)
    assert all(_exact_norm_below(float(c), units.rows[i]) for i, c in enumerate(charged))
    # float64's own norm falls below the exact one on some rows: the margin is what covers them
    measured = np.linalg.norm(units.rows.astype(np.float64), axis=1)
    assert not all(_exact_norm_below(float(m), units.rows[i]) for i, m in enumerate(measured))
    ones = RowContributions(rng.normal(size=(50, 1)).astype(np.float32))
    assert ones.norm_rel_error == 0.0
    charged_ones = ones.scale(np.ones(50))
    assert np.array_equal(charged_ones, np.abs(ones.rows[:, 0]).astype(np.float64))


class _Deep64(nn.Module):
    """An owner's float64 model: a saturated sigmoid (an input of about 1e-162 for ``l2``), then bias-free
    layers of weight 3e38 (a backprop of about 1e154 for ``l2``). Every parameter is a float32 value."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(1, 1, dtype=torch.float64)
        self.l2 = nn.Linear(1, 1, bias=False, dtype=torch.float64)
        self.tail = nn.Sequential(*[nn.Linear(1, 1, bias=False, dtype=torch.float64) for _ in range(4)])
        with torch.no_grad():
            self.l1.weight.fill_(1.0)
            self.l1.bias.fill_(-372.0)
            self.l2.weight.fill_(1.0)
            for layer in self.tail:
                layer.weight.fill_(float(np.float32(3.0e38)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.l2(torch.sigmoid(self.l1(x.double()))))


def _squared_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.squeeze(-1) - y.double()) ** 2


@pytest.mark.parametrize("hooks", [True, False])
def test_a_float64_linear_layer_is_charged_at_least_what_it_adds(hooks: bool) -> None:
    """Through the fused pass Agent.release runs (one record, weight 1): the sum adds the record's gradient,
    and its charge norm * (1 + E) must be at least that sum's norm. With factored rows the norm came from
    ||a||^2 ||g||^2 with a subnormal ||a||^2: 1.0070 x the charge (rows), where the direct path held."""
    x, y = np.ones((1, 1), np.float32), np.full(1, -0.5, np.float32)
    norms, total, method = fused_clipped_sum(
        _Deep64(), _squared_error, ArraySource(x, y), lambda start, n: np.ones(n.size), hooks=hooks
    )
    assert method == ("rows" if hooks else "direct")
    added = float(np.linalg.norm(total))
    assert 1e-9 < added < 1e-6  # an ordinary contribution, from a tiny factor times a huge one
    assert added <= float(norms[0]) * (1 + NORM_REL_ERROR)


def test_a_one_hot_histogram_row_at_the_clip_is_counted_whole_and_charged_exactly(tmp_path: Path) -> None:
    """Exact rows pay no margin: one-hot rows of 5 cells (norm 1) at clip 1 through Agent.release are summed
    unscaled (whole counts) and charged exactly 1; a row of 3 and 4 (norm 5, exact) over the clip is scaled
    with the margin and charged at most the clip; a row of 0.5 and 0.25 (not integers) within the clip pays
    the margin on its measured norm.
    With the margin on every row (a review) each one-hot record counted 0.99999."""
    n = 40
    x = np.random.default_rng(2).normal(size=(n, 3)).astype(np.float32)
    agent = build_agent(tmp_path, (x, (x[:, 0] > 0).astype(np.int64)), trust="central", unit="record")
    rows = np.zeros((n, 5), dtype=np.float32)
    rows[np.arange(n - 2), np.arange(n - 2) % 5] = 1.0
    rows[n - 2, :2] = (3.0, 4.0)
    rows[n - 1, :2] = (0.5, 0.25)
    request = wire.IndicatorRequest(
        request_id="h1", run_id="run", round=1, noise_std=10.0, l2_clip=1.0, trust="central", unit="record",
        predicate="column", column=0, value=0.0,
    )  # fmt: skip
    state = AgentState.from_arrays(agent.ledger.state())
    reply, _, release, _ = agent.release(request, rows, state)
    agent.close()
    assert isinstance(reply, wire.ContributionReply) and reply.total.dtype == np.float64
    counts = np.bincount(np.arange(n - 2) % 5, minlength=5).astype(np.float64)
    np.testing.assert_array_equal(reply.total[2:], counts[2:])  # whole counts where only one-hot rows fall
    norms = np.asarray(release.l2_norms)
    assert np.all(norms[: n - 2] == 1.0)  # charged exactly their exact norm
    assert norms[n - 2] <= 1.0 and norms[n - 2] > 0.9999  # scaled under the clip, margin included
    assert norms[n - 1] == np.sqrt(0.3125) * (1 + NORM_REL_ERROR)  # unscaled, measured norm times (1 + E)
    assert np.all(np.abs(reply.total[:2] - counts[:2] - np.array([0.6, 0.8]) - [0.5, 0.25]) < 1e-4)


def test_a_policy_whose_largest_reply_the_ledger_cannot_store_is_refused_at_start(tmp_path: Path) -> None:
    """A reply is stored whole in the ledger (SQLite: at most 1e9 bytes a value) before it is sent: float64 in
    central trust since the fix, so 2e8 parameters fit local trust's float32 replies but not central's."""
    from client_agent.config import AgentConfigError, parse_agent_config

    big = {"policy-max-model-params": 200_000_000}
    assert parse_agent_config(node_config(_fresh(tmp_path / "local"), trust="local", **big), simulation=True)
    central = node_config(_fresh(tmp_path / "central"), trust="central", **big)
    with pytest.raises(AgentConfigError, match=r"policy-max-model-params: expected at most 124868928 in central"):
        parse_agent_config(central, simulation=True)


def test_exact_rows_at_the_filters_boundary_are_admitted_never_refused() -> None:
    """Agent.release's arithmetic for materialised rows (real partial_clip, clip_margins, clip_scales, scale,
    charge): one-hot rows at clip 1 on units whose remainder T - S is (1/sigma)^2 give or take a few ulps. Each
    is admitted (scaled where it must be), never refused: charged exactly a bound sigma sqrt(T - S) that rounded
    up to 1, a review's unit was refused by the filter's S + (1/sigma)^2 > T (sigma 18.529..., below)."""
    rng = np.random.default_rng(1)
    onehot = np.eye(10, dtype=np.float32)[:1]
    cases = [(18.52922320079771, 0.00701303109238484, 0.004100399375715735)]  # the review's example
    for _ in range(4000):
        sigma = float(rng.uniform(0.3, 30.0))
        t = float(rng.uniform(0.5, 50.0)) / sigma**2
        if (1.0 / sigma) ** 2 <= t:
            s = t - (1.0 / sigma) ** 2
            for _ in range(int(rng.integers(-2, 3))):
                s = float(np.nextafter(s, np.inf))
            cases.append((sigma, t, s))
    for sigma, t, s in cases:
        filt = GaussianFilter(kind="gdp", epsilon=1.0, delta=1e-5, threshold=t)
        state = FilterState(spent=np.array([s]), stopped=np.array([False]))
        units = RowContributions(onehot.copy())
        bounds = partial_clip(filt, state, noise_std=sigma, l2_clip=1.0)
        norms = units.norms()
        headroom = sigma * np.sqrt(np.maximum(t - state.spent, 0.0))
        scales = clip_scales(norms, bounds / units.clip_margins(norms, bounds, headroom), dtype_eps=FLOAT32_EPS)
        charged = units.scale(scales)
        result = charge(filt, state, noise_std=sigma, l2_norms=charged)
        assert not result.refused[0] and charged[0] <= bounds[0], (sigma, t, s)


def test_float32_subnormals_are_flushed_before_any_multiply_and_charged_as_what_is_added() -> None:
    """A float32 multiply with a subnormal operand was 8x slower (a review): rows of subnormals would set the
    reply's time by who stopped. They are zeroed bitwise on entry, and products that fall subnormal after the
    scaling too; the norm is measured after, so the charge still covers what the sum adds."""
    tiny = np.float32(1e-40)  # subnormal in float32
    rows = np.array([[tiny, 1.0, -tiny], [np.float32(2e-38), 3.0, 4.0], [np.inf, 1.0, tiny]], dtype=np.float32)
    units = RowContributions(rows.copy())
    assert units.rows[0].tolist() == [0.0, 1.0, 0.0] and units.rows[2, 2] == 0.0 and np.isinf(units.rows[2, 0])
    norms = units.norms()
    assert not np.isfinite(norms[2])
    scales = np.array([1.0, 0.25, 0.0])
    charged = units.scale(scales)  # 2e-38 x 0.25 is subnormal: flushed, with the infinity row's entries
    assert units.rows[1, 0] == 0.0 and units.rows[1, 1:].tolist() == [0.75, 1.0] and not units.rows[2].any()
    total = units.weighted_sum(np.ones(3))
    assert total.tolist() == [0.0, 1.75, 1.0]
    assert charged[0] == 1.0 and charged[1] >= np.hypot(0.75, 1.0) and charged[2] == 0.0


def test_a_tiny_scale_factor_never_charges_a_row_above_its_bound() -> None:
    """A row of huge values at a small clip: its scale is below float32's smallest normal. Rounded to a float32
    factor it was a subnormal, up to 1.4x the float64 one, and the row was charged 1.4x its bound (a review).
    The multiply is in float64 now, and such a factor is 0: the row is the null element and pays 0."""
    for d, clip in ((1, 3e-7), (4096, 1.0)):
        rows = np.full((1, d), 3e38, dtype=np.float32)
        units = RowContributions(rows)
        norms = units.norms()
        bounds = np.array([clip])
        scales = clip_scales(norms, bounds / units.clip_margins(norms, bounds, bounds), dtype_eps=FLOAT32_EPS)
        charged = units.scale(scales)
        assert charged[0] <= clip and not units.rows.any()  # below 2^-126: the null element, charged 0
    units = RowContributions(np.array([[2.0**-100, 1.0]], dtype=np.float32))
    charged = units.scale(np.array([2.0**-30]))  # a normal factor whose products fall below 2^-126: zeroed
    assert units.rows.tolist() == [[0.0, 2.0**-30]] and charged[0] >= 2.0**-30


def test_a_float64_array_is_taken_as_its_float32_values() -> None:
    """Rows are float32; a float64 array (a test's, a caller's) is converted, not read as float32 words."""
    units = RowContributions(np.array([[1.0 + 2.0**-41, 0.5]]))
    assert units.rows.dtype == np.float32 and units.rows.tolist() == [[1.0, 0.5]]
    assert units.scale(np.array([0.5]))[0] >= np.hypot(0.5, 0.25)
