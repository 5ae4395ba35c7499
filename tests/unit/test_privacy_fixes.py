"""Issue 12's findings, each with the test that would have caught it (findings 1, 2 and 4 have
their own files: tests/unit/test_agent.py, tests/property/test_agent_audit.py and
tests/unit/test_release_uniform.py)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.agent import Agent
from client_agent.config import DEFAULT_MIN_NOISE_STD, AgentConfigError, Policy, parse_agent_config
from client_agent.direct import answer_request
from client_agent.ledger import LedgerError
from coordinator.secagg import SecaggSettings, secagg_release
from protocol import messages as wire
from protocol.filters import FilterState, GaussianFilter, charge
from protocol.validate import PrivacyParameterError
from tests.factories import count_request
from tests.unit.test_agent import gradient, ledger_snapshot, make_agent
from tests.unit.test_secagg_session import SIGMA, AgentTransport, agents

HEX64 = re.compile(r"[0-9a-f]{64}")


# --- finding 3: error replies carry fixed text --------------------------------------------------


def test_a_commit_race_sends_fixed_text_not_the_state_hash(tmp_path: Path) -> None:
    """Two agents on one ledger: the loser's LedgerError names both state hashes (per-record spend).

    The hash of the state blob identifies the per-record spends, and a coordinator who knew the
    other records recovered a target's label from it; only the code's fixed text may leave.
    """
    first = make_agent(tmp_path)
    second = Agent(first.config)
    real = first.contributions

    def racing(request: Any, **kwargs: Any) -> Any:
        assert not second.handle(wire.GRADIENT, *gradient("other")).is_error  # commits in between
        return real(request, **kwargs)

    first.contributions = racing  # type: ignore[method-assign]
    outcome = first.handle(wire.GRADIENT, *gradient("r1"))
    assert outcome.error_code == wire.ERR_LEDGER
    assert "another process committed" in outcome.local_detail and HEX64.search(outcome.local_detail)
    assert outcome.error_reason == wire.ERROR_TEXT[wire.ERR_LEDGER]
    assert not HEX64.search(outcome.error_reason) and str(tmp_path) not in outcome.error_reason
    second.close()
    first.close()


def test_every_error_code_has_fixed_text_free_of_detail() -> None:
    assert set(wire.ERROR_TEXT) == set(wire.ERROR_NAMES)
    for code, text in wire.ERROR_TEXT.items():
        assert text.startswith(wire.error_name(code) + ":") and "nothing was released" in text


def test_a_bad_agent_configuration_answers_fixed_text(tmp_path: Path) -> None:
    """The ClientApp's configuration errors name the owner's files: they stay in the client's log."""
    cfg = {
        "ledger-path": str(tmp_path / "l.sqlite"),
        "data-path": str(tmp_path / "missing.npz"),
        "epsilon": 1.0,
        "delta": 1e-5,
        "policy-min-noise-std": 0.5,
        "policy-max-clip": 5.0,
    }
    outcome = answer_request(cfg, wire.GRADIENT, *gradient(), cache=None)
    assert outcome.error_code == wire.ERR_LEDGER
    assert "missing.npz" in outcome.local_detail
    assert outcome.error_reason == wire.ERROR_TEXT[wire.ERR_LEDGER]


# --- finding 5: subnormal and extreme noise ------------------------------------------------------


@pytest.mark.parametrize(
    ("noise_std", "l2_clip", "derived"),
    [
        (1e-310, 1e-310, "noise_std^2"),  # the reported case: both subnormal, 1 / sigma overflows
        (1e-160, 1.0, "noise_std^2"),  # sigma normal, its square subnormal
        (1.0, 1e-160, "l2_clip^2"),
        (1e-100, 1e100, "(l2_clip / noise_std)^2"),  # the ratio is finite, its square overflows
        (1e100, 1e-100, "(l2_clip / noise_std)^2"),  # ...or underflows to 0: every cost would be 0
    ],
)
def test_noise_and_clip_whose_squares_or_ratios_are_not_normal_are_malformed(
    tmp_path: Path, noise_std: float, l2_clip: float, derived: str
) -> None:
    config, arrays = gradient(noise_std=1.0, l2_clip=1.0)
    config |= {"noise_std": noise_std, "l2_clip": l2_clip}
    with pytest.raises(wire.ProtocolError, match=re.escape(f"give {derived} = ")):
        wire.decode_request(wire.GRADIENT, config, arrays)
    # Through the agent, with the policy's floor as low as the owner may set it: refused, nothing spent.
    agent = make_agent(tmp_path, **{"policy-min-noise-std": 5e-324, "policy-max-clip": float("inf")})
    before = ledger_snapshot(agent)
    outcome = agent.handle(wire.GRADIENT, config, arrays)
    assert outcome.error_code == wire.ERR_MALFORMED
    assert ledger_snapshot(agent) == before
    assert not agent.handle(wire.GRADIENT, *gradient("next")).is_error  # the ledger still answers


def test_charge_prices_by_division_and_refuses_a_non_finite_cost() -> None:
    filt = GaussianFilter.gdp(epsilon=1.0, delta=1e-5)
    state = FilterState.fresh(2)
    # (norm / sigma)^2 with sigma subnormal: 1e-10 / 1e-310 = 1e300, squared: inf.
    with pytest.raises(PrivacyParameterError, match="non-finite cost"):
        charge(filt, state, noise_std=1e-310, l2_norms=np.array([1e-10, 0.0]))
    # Division first: norm 1e-308 at sigma 1e-308 costs exactly 1, where 1 / sigma would not be exact.
    result = charge(filt, FilterState.fresh(1), noise_std=1e-308, l2_norms=np.array([1e-308 * 0.1]))
    assert result.state.spent[0] == pytest.approx(0.01, rel=1e-12)


def test_the_ledger_refuses_a_non_finite_state(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    before = ledger_snapshot(agent)
    state = agent.ledger.state()
    bad = dict(state) | {"spent": np.full_like(state["spent"], np.nan)}
    with pytest.raises(LedgerError, match=r"expected finite values in new_state\['spent'\]"):
        agent.ledger.commit(
            request_id="x",
            message_type=wire.GRADIENT,
            run_id="run",
            digest="0" * 64,
            release={"k": np.zeros(1)},
            new_state=bad,
            reply=b"",
        )
    assert ledger_snapshot(agent) == before


def test_policy_min_noise_std_has_a_safe_non_zero_default(tmp_path: Path) -> None:
    assert Policy().min_noise_std == DEFAULT_MIN_NOISE_STD > 0
    base = {"ledger-path": str(tmp_path / "l"), "data-path": str(tmp_path / "d"), "epsilon": 1.0, "delta": 1e-5}
    assert parse_agent_config(base, simulation=True).policy.min_noise_std == DEFAULT_MIN_NOISE_STD
    with pytest.raises(AgentConfigError, match="policy-min-noise-std: expected a number > 0"):
        parse_agent_config(base | {"policy-min-noise-std": 0.0, "policy-max-clip": 1.0})
    # A deployed agent has no default: its owner states the floor and the clip limit (issue 23).
    with pytest.raises(AgentConfigError, match="policy-min-noise-std and policy-max-clip: expected explicit values"):
        parse_agent_config(base)
    with pytest.raises(AgentConfigError, match=r"^policy-max-clip: expected explicit values"):
        parse_agent_config(base | {"policy-min-noise-std": 0.5})


# --- finding 6: seeded noise is for simulations only ---------------------------------------------


def test_noise_seed_is_refused_outside_simulations(tmp_path: Path) -> None:
    np.savez(tmp_path / "data.npz", x=np.zeros((3, 3), np.float32), y=np.zeros(3, np.int64))
    cfg = {
        "ledger-path": str(tmp_path / "ledger.sqlite"),
        "data-path": str(tmp_path / "data.npz"),
        "epsilon": 1.0,
        "delta": 1e-5,
        "noise-seed": 7,
    }
    with pytest.raises(AgentConfigError, match="noise-seed: seeded noise is for simulations and tests only"):
        parse_agent_config(cfg)
    # The deployed ClientApp's path (no simulation switch): refused, nothing created or spent.
    outcome = answer_request(cfg, wire.GRADIENT, *gradient(), cache=None)
    assert outcome.error_code == wire.ERR_LEDGER and "noise-seed" in outcome.local_detail
    assert not (tmp_path / "ledger.sqlite").exists()
    # A TOML file cannot set the switch either: it is a keyword in code, not a configuration key.
    toml = tmp_path / "agent.toml"
    toml.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in cfg.items()) + "\nsimulation = true\n")
    with pytest.raises(AgentConfigError, match="unknown keys \\['simulation'\\]"):
        parse_agent_config({"agent-config": str(toml)})


def test_seeded_noise_is_recorded_in_the_ledger_and_stated_in_the_status(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)  # noise-seed 3, simulation switch on
    assert agent.ledger.config.params["noise_seed"] == 3
    status = json.loads(agent.status_json())
    assert status["ledger"]["params"]["noise"] == "seeded (simulation)"
    assert "noise_seed" not in status["ledger"]["params"]


def test_seeded_stream_is_keyed_by_the_whole_digest(tmp_path: Path) -> None:
    """The documented derivation (agent.Agent.rng): SHA-256 of "seed|ledger id", all 256 bits."""
    agent = make_agent(tmp_path)
    request = wire.decode_request(wire.GRADIENT, *gradient("r9"))
    digest = hashlib.sha256(b"3|r9").digest()
    expected = np.random.default_rng(int.from_bytes(digest, "little")).normal(size=8)
    np.testing.assert_array_equal(agent.rng(request).normal(size=8), expected)
    other = wire.decode_request(wire.GRADIENT, *gradient("r10"))
    assert not np.array_equal(agent.rng(other).normal(size=8), expected)


# --- finding 7: secagg slack and scale bits ------------------------------------------------------


def run_count_session(group: dict[int, Agent], scale_bits: int) -> Any:
    return secagg_release(
        AgentTransport(group),
        run_id="run",
        rnd=1,
        purpose="indicator",
        nodes=sorted(group),
        settings=SecaggSettings(min_clients=2, scale_bits=scale_bits),
        kind=wire.INDICATOR,
        build=lambda node, s: count_request(s, node=node),
        size=1,
        noise_std=SIGMA,
        timeout=1.0,
    )


def test_a_secagg_unit_whose_room_is_below_the_slack_stops(tmp_path: Path) -> None:
    # epsilon 0.002: mu_B ~ 0.00103, so sigma sqrt(T) ~ 0.0103 is below the slack 1 / 2^6 = 0.0156
    # (6 bits: the fewest that keep the noise share over 256 grid steps at sigma 10, m = 2).
    group = agents(tmp_path, 3, epsilon=0.002, **{"policy-secagg-min-scale-bits": 6})
    assert all(SIGMA * np.sqrt(a.gaussian.threshold) < 2.0**-6 for a in group.values() if a.gaussian)
    result = run_count_session(group, scale_bits=6)
    assert result.total is not None
    for agent in group.values():
        state = agent.ledger.state()
        assert state["spent"][0] == 0.0  # it could not pay for any masked input...
        assert state["stopped"][0] and state["halt_round"][0] == 1  # ...so it stopped, and the monitor sees it
        releases = [rel for _, kind, rel in agent.ledger.releases() if kind == wire.INDICATOR]
        assert releases[-1]["refused"][0]  # replaying the ledger stops it at the same round


def test_secagg_scale_bits_below_the_policy_floor_are_refused(tmp_path: Path) -> None:
    group = agents(tmp_path, 3)  # default floor: 16 bits
    result = run_count_session(group, scale_bits=8)
    assert result.total is None
    assert all(a.ledger.state()["spent"][0] == 0.0 for a in group.values())
    assert result.replies.errors.total() >= 3


def test_requests_per_day_are_limited_per_ledger_whatever_the_run_id(tmp_path: Path) -> None:
    """policy-max-rounds-per-run counts per run id, so fresh run ids bypass it; this limit does not."""
    agent = make_agent(tmp_path, **{"policy-max-requests-per-day": 3})
    for i in range(3):
        assert not agent.handle(wire.GRADIENT, *gradient(f"r{i}", run_id=f"fresh-run-{i}")).is_error
    before = ledger_snapshot(agent)
    refused = agent.handle(wire.GRADIENT, *gradient("r3", run_id="fresh-run-3"))
    assert refused.error_code == wire.ERR_POLICY
    assert "request 4 in the last 24 hours asked; the policy allows at most 3 per day" in refused.local_detail
    assert ledger_snapshot(agent) == before
    (tmp_path / "x").mkdir()
    with pytest.raises(AgentConfigError, match="policy-max-requests-per-day: expected an integer >= 1"):
        make_agent(tmp_path / "x", **{"policy-max-requests-per-day": 0})


def test_status_is_answered_only_when_the_policy_allows_it(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, **{"policy-allowed-kinds": [wire.GRADIENT]})
    outcome = agent.handle(wire.STATUS, {"request_id": "s", "run_id": "run", "round": 0}, {})
    assert outcome.error_code == wire.ERR_POLICY and "'query.status' is not allowed" in outcome.local_detail
