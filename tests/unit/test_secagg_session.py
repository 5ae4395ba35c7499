"""Secagg trust through the real client agents and the coordinator's session (coordinator/secagg.py).

The agents answer each step from their ledgers; a scripted transport drops chosen clients at
chosen steps. Exactness is checked with the noise share patched to zero (the decoded sum is
then the plain sum of the clients' clipped contributions); the charge, the replay rules that
keep SecAgg safe across restarts, and every refusal are checked on the ledgers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.agent import Agent
from client_agent.config import parse_agent_config
from client_agent.ledger import LedgerError
from client_agent.ledger_report import verify_ledger
from coordinator.analysts import Query
from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from coordinator.enrolment import EnrolmentError
from coordinator.rounds import run
from coordinator.secagg import SecaggSettings, default_min_clients, secagg_release
from coordinator.transport import Payload, RoundReplies
from protocol import messages as wire
from protocol import secagg as sa
from tests.factories import (
    COUNT_CLIP,
    COUNT_NOISE_STD,
    count_request,
    gradient_run,
    secagg_agents,
    secagg_node_config,
)

SIGMA, CLIP, BITS = COUNT_NOISE_STD, COUNT_CLIP, 24


def node_config(tmp_path: Path, i: int, **over: Any) -> dict[str, Any]:
    return secagg_node_config(tmp_path, i, peers=max(8, i + 1), **over)


class AgentTransport:
    """The agents answer in turn; ``drop[message_type]`` lists nodes whose request is lost (no reply)."""

    def __init__(self, agents: Mapping[int, Agent], drop: Mapping[str, set[int]] | None = None) -> None:
        self.agents = dict(agents)
        self.drop = dict(drop or {})
        self.sent: list[tuple[str, dict[int, Payload]]] = []
        self.details: list[str] = []  # the clients' own log lines for their refusals (never on the wire)

    def node_ids(self, count: int, *, timeout: float) -> list[int]:
        return sorted(self.agents)[:count]

    def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
        self.sent.append((message_type, dict(payloads)))
        out = RoundReplies()
        for node, (config, arrays) in payloads.items():
            if node in self.drop.get(message_type, set()):
                out.missing += 1
                continue
            outcome = self.agents[node].handle(message_type, dict(config), dict(arrays))
            if outcome.is_error:
                assert outcome.error_reason == wire.ERROR_TEXT[outcome.error_code]  # fixed text only
                self.details.append(outcome.local_detail)
                out.error(wire.error_name(outcome.error_code), outcome.error_reason)
            else:
                assert outcome.config is not None and outcome.arrays is not None
                out.replies[node] = (outcome.config, outcome.arrays)
        return out


def agents(tmp_path: Path, n: int, **over: Any) -> dict[int, Agent]:
    """``n`` agents that accept any m with 2m > n (tolerance f = 0): these tests drop clients down to
    thresholds below the default m >= ceil(2n/3) on purpose; the default has its own tests (test 7 of
    test_secagg_attacks.py)."""
    return secagg_agents(tmp_path, n, peers=max(8, n), **({"policy-secagg-tolerance": 0} | over))


def gradient_config(nodes: int, **over: Any) -> CoordinatorConfig:
    """A secagg gradient run on the agents' 3-feature logistic regression, 10 records per client."""
    return gradient_run(**(dict(num_nodes=nodes, n_public=10 * nodes, rounds=2, trust="secagg", unit="record") | over))


def count_config(nodes: int, **over: Any) -> CoordinatorConfig:
    """A secagg counting run (indicator task, client units) at the module's SIGMA and CLIP."""
    base: dict[str, Any] = dict(
        num_nodes=nodes,
        n_public=nodes,
        rounds=1,
        noise_std=SIGMA,
        l2_clip=CLIP,
        task="indicator",
        trust="secagg",
        unit="client",
    )
    return CoordinatorConfig(**(base | over))


def label_count(agent: Agent) -> float:
    return float(np.sum(agent.y == 1))


def session(transport: AgentTransport, m: int, *, rnd: int = 1, run_id: str = "run") -> Any:
    return secagg_release(
        transport,
        run_id=run_id,
        rnd=rnd,
        purpose="indicator",
        nodes=sorted(transport.agents),
        settings=SecaggSettings(min_clients=m, scale_bits=BITS),
        kind=wire.INDICATOR,
        build=lambda node, s: count_request(s, node=node, rnd=rnd, run_id=run_id),
        size=1,
        noise_std=SIGMA,
        timeout=1.0,
    )


# --- the sum --------------------------------------------------------------------------------


def test_sum_is_the_plain_sum_of_the_clients_counts(tmp_path: Path, no_noise: None) -> None:
    group = agents(tmp_path, 5)
    result = session(AgentTransport(group), 3)
    assert result.total is not None and result.counts == {
        "advertised": 5,
        "shared": 5,
        "masked": 5,
        "checked": 5,
        "unmasked": 5,
    }
    assert result.total[0] == sum(label_count(a) for a in group.values())  # exact: integers on a 2^24 grid
    # 5 independent shares of N(0, sigma^2 / m), m = 3 (protocol/secagg.py, distributed noise): variances add.
    assert result.noise_var == pytest.approx(5 * SIGMA**2 / 3)


@pytest.mark.parametrize(
    ("drop", "survivors"),
    [
        ({wire.INDICATOR: {1001, 1004}}, [1000, 1002, 1003]),  # masked inputs lost: their masks are removed
        ({wire.SECAGG_SHARES: {1002}, wire.SECAGG_UNMASK: {1000}}, [1000, 1001, 1003, 1004]),
        ({wire.SECAGG_KEYS: {1003}, wire.INDICATOR: {1001}}, [1000, 1002, 1004]),
    ],
)
def test_dropouts_below_the_threshold_are_recovered(
    tmp_path: Path, no_noise: None, drop: dict[str, set[int]], survivors: list[int]
) -> None:
    group = agents(tmp_path, 5)
    result = session(AgentTransport(group, drop), 3)
    assert result.total is not None, result.counts
    assert result.total[0] == sum(label_count(group[n]) for n in survivors)
    assert result.counts["masked"] == len(survivors)
    assert result.noise_var == pytest.approx(len(survivors) * SIGMA**2 / 3)  # one N(0, sigma^2 / 3) share per survivor


def test_dropouts_above_the_threshold_release_nothing(tmp_path: Path) -> None:
    group = agents(tmp_path, 5)
    result = session(AgentTransport(group, {wire.INDICATOR: {1000, 1001, 1002}}), 3)
    assert result.total is None
    assert result.counts["aborted"] == "2 masked inputs arrived, fewer than m = 3"
    assert result.replies.errors["secagg-aborted"] == 1
    (tmp_path / "b").mkdir()
    transport = AgentTransport(agents(tmp_path / "b", 5), {wire.SECAGG_UNMASK: {1000, 1001, 1002}})
    again = session(transport, 3)
    assert again.total is None and again.counts["aborted"].startswith("2 clients answered the unmask step")
    assert [kind for kind, _ in transport.sent][-1] == wire.SECAGG_UNMASK


# --- what each client charged, and when ----------------------------------------------------------


def test_charge_is_committed_with_the_masked_input_and_replays(tmp_path: Path) -> None:
    group = agents(tmp_path, 3)
    result = session(AgentTransport(group), 2)
    assert result.total is not None
    slack = sa.rounding_slack(1, BITS)
    for agent in group.values():
        spent = agent.ledger.state()["spent"]
        # mu^2 = (||v|| + sqrt(d) / 2^k)^2 / sigma^2: privacy.md §2's cost with the grid-rounding slack of
        # protocol/secagg.py (d = 1, k = BITS); ||v|| is the client's label count (client unit, C = 100 > 10).
        assert spent[0] == pytest.approx(((label_count(agent) + slack) / SIGMA) ** 2, rel=1e-12)
        assert verify_ledger(agent.config.ledger_path) == []  # replaying the stored releases rebuilds the spend
        kinds = [str(rel["kind"]) for _, _, rel in agent.ledger.releases()]
        assert kinds == ["secagg-keys", "secagg-shares", "indicator", "secagg-check", "secagg-unmask"]


def _masked_step(transport: AgentTransport) -> tuple[int, dict[str, Any], dict[str, np.ndarray]]:
    payloads = next(p for k, p in transport.sent if k == wire.INDICATOR)
    node = sorted(payloads)[0]
    return node, *payloads[node]


def test_one_masked_input_and_one_unmask_answer_per_session_even_after_a_restart(tmp_path: Path) -> None:
    group = agents(tmp_path, 3)
    transport = AgentTransport(group)
    assert session(transport, 2).total is not None
    node, config, arrays = _masked_step(transport)
    before = group[node].ledger.state()["spent"].copy()
    # The agent restarts (a crash after its answers were committed): the session's state is in the ledger.
    group[node].close()
    agent = Agent(group[node].config)
    same = agent.handle(wire.INDICATOR, dict(config), dict(arrays))
    assert not same.is_error and same.arrays is not None
    other = agent.handle(wire.INDICATOR, {**config, "request_id": "another-id", "value": 0.0}, dict(arrays))
    assert other.error_code == wire.ERR_REPLAY
    assert "already sent its masked input for another request" in other.local_detail
    np.testing.assert_array_equal(agent.ledger.state()["spent"], before)  # no second charge
    unmask = next(p for k, p in transport.sent if k == wire.SECAGG_UNMASK)[node]
    fewer = dict(unmask[1], survivors=np.array([0, 1], np.int64))
    refused = agent.handle(wire.SECAGG_UNMASK, {**unmask[0], "request_id": "u2"}, fewer)
    assert refused.error_code == wire.ERR_REPLAY and "could give both shares of one peer" in refused.local_detail
    repeat = agent.handle(wire.SECAGG_UNMASK, dict(unmask[0]), dict(unmask[1]))
    assert not repeat.is_error  # the same request gets the stored answer
    agent.close()


def test_steps_out_of_order_or_from_another_run_are_refused(tmp_path: Path) -> None:
    group = agents(tmp_path, 3)
    agent = group[1000]
    fp = wire.session_fingerprint(count_request(None, node=1000), BITS)
    keys = agent.handle(wire.SECAGG_KEYS, *wire.encode_request(wire.SecaggKeysRequest("s1", "run", 1, "secagg", fp)))
    assert not keys.is_error and keys.config is not None
    zeros = np.zeros((3, sa.CIPHERTEXT_BYTES), np.uint8)
    ghost = wire.SecaggInput("s1", BITS, sa.value_bound_for(3), np.arange(3, dtype=np.int64), zeros)
    early = agent.handle(wire.INDICATOR, *wire.encode_request(count_request(ghost, node=1000)))
    assert early.error_code == wire.ERR_MALFORMED and "step 2 (shares) was not answered" in early.local_detail
    unknown = wire.SecaggUnmaskRequest("u", "run", 1, "secagg", "nope", np.arange(3, dtype=np.int64))
    refused = agent.handle(wire.SECAGG_UNMASK, *wire.encode_request(unknown))
    assert refused.error_code == wire.ERR_MALFORMED and "'nope': step 1 (keys) was not answered" in refused.local_detail
    zeros32 = np.zeros((2, 32), np.uint8)
    roster_other_run = wire.SecaggSharesRequest(
        "sh", "other-run", 1, "secagg", "s1", 2, zeros32, zeros32, fp, zeros32, zeros32, np.zeros((2, 64), np.uint8)
    )
    wrong_run = agent.handle(wire.SECAGG_SHARES, *wire.encode_request(roster_other_run))
    assert wrong_run.error_code == wire.ERR_MALFORMED
    assert "expected run 'run' round 1, got run 'other-run' round 1" in wrong_run.local_detail
    # A roster of two trusted peers' signed keys for this session that leaves this client out.
    adverts = []
    for node in (1001, 1002):
        got = group[node].handle(
            wire.SECAGG_KEYS, *wire.encode_request(wire.SecaggKeysRequest("s1", "run", 1, "secagg", fp))
        )
        assert got.config is not None and got.arrays is not None
        adverts.append(wire.SecaggKeysReply.decode(got.config, got.arrays))

    def table(name: str) -> np.ndarray:
        return np.stack([getattr(a, name) for a in adverts])

    not_listed = wire.SecaggSharesRequest(
        "sh", "run", 1, "secagg", "s1", 2, table("encryption_key"), table("masking_key"), fp,
        table("identity"), table("seed_commitment"), table("signature"),
    )  # fmt: skip
    missing = agent.handle(wire.SECAGG_SHARES, *wire.encode_request(not_listed))
    assert missing.error_code == wire.ERR_MALFORMED
    assert "expected this client's advertised keys exactly once" in missing.local_detail
    assert agent.ledger.state()["spent"][0] == 0.0


def test_a_range_too_small_for_the_worst_case_is_refused_before_any_charge(tmp_path: Path) -> None:
    group = agents(tmp_path, 3)

    class Narrow(AgentTransport):
        def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
            if message_type == wire.INDICATOR:
                payloads = {n: ({**c, "secagg_value_bound": 10**6}, a) for n, (c, a) in payloads.items()}
            return super().send(message_type, payloads, timeout=timeout)

    transport = Narrow(group)
    result = session(transport, 2)
    assert result.total is None
    reason = transport.details[0]
    assert "this client's worst case needs values up to" in reason and "the session allows 1000000" in reason
    assert all(a.ledger.state()["spent"][0] == 0.0 for a in group.values())


def test_tampered_shares_are_refused_before_any_charge(tmp_path: Path) -> None:
    group = agents(tmp_path, 3)

    class Tamper(AgentTransport):
        def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
            if message_type == wire.INDICATOR:
                changed = {}
                for n, (c, a) in payloads.items():
                    cts = a["secagg_ciphertexts"].copy()
                    cts[0, 50] ^= 0xFF
                    changed[n] = (c, {**a, "secagg_ciphertexts": cts})
                payloads = changed
            return super().send(message_type, payloads, timeout=timeout)

    transport = Tamper(group)
    result = session(transport, 2)
    assert result.total is None
    assert any("share from peer 0 to" in r and "does not authenticate" in r for r in transport.details)
    assert all(a.ledger.state()["spent"][0] == 0.0 for a in group.values())


def test_local_trust_clients_and_low_thresholds_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    local = Agent(parse_agent_config(node_config(tmp_path / "a", 0, trust="local"), simulation=True))
    keys = local.handle(
        wire.SECAGG_KEYS,
        *wire.encode_request(
            wire.SecaggKeysRequest(
                "s", "run", 1, "secagg", wire.session_fingerprint(count_request(None, node=1000), BITS)
            )
        ),
    )
    assert keys.error_code == wire.ERR_POLICY
    assert "trust 'secagg' asked; this client's ledger is fixed to trust 'local'" in keys.local_detail
    strict = agents(tmp_path, 3, **{"policy-secagg-min-clients": 3})
    transport = AgentTransport(strict)
    result = session(transport, 2)
    assert result.total is None
    assert any("secagg min_clients 2 asked; the policy requires at least 3" in r for r in transport.details)


def test_secagg_ledger_is_fixed_to_secagg(tmp_path: Path) -> None:
    agent = agents(tmp_path, 1)[1000]
    status = agent.handle(wire.STATUS, {"request_id": "s", "run_id": "run", "round": 0}, {})
    assert status.config is not None and json.loads(status.config["description"])["ledger"]["trust"] == "secagg"
    config = agent.config
    agent.close()
    for other in ("central", "local"):
        with pytest.raises(LedgerError, match="trust"):
            Agent(parse_agent_config(node_config(tmp_path, 0, trust=other), simulation=True))
    Agent(config).close()


# --- the coordinator's run --------------------------------------------------------------------


def test_run_in_secagg_trust_with_an_aborted_round(tmp_path: Path, no_noise: None) -> None:
    # Round 2's masked inputs are lost for 3 of 5 clients: that round releases nothing and takes no
    # step; rounds 1 and 3 answer the exact count (noise patched to zero).
    group = agents(tmp_path, 5)

    class LoseRound2(AgentTransport):
        def send(self, message_type: str, payloads: Mapping[int, Payload], *, timeout: float) -> RoundReplies:
            rnd = next(iter(payloads.values()))[0]["round"]
            self.drop = {wire.INDICATOR: {1000, 1001, 1002}} if rnd == 2 else {}
            return super().send(message_type, payloads, timeout=timeout)

    cfg = count_config(5, rounds=3, run_id="run", progress=False, secagg_min_clients=3)
    summary = run(LoseRound2(group), cfg, analyst=lambda answers: Query("label", 0, 1.0))
    assert [a["round"] for a in summary["answers"]] == [1, 3]
    expected = sum(label_count(a) for a in group.values())
    assert all(a["value"] == expected for a in summary["answers"])
    assert summary["rounds"][1]["secagg"]["aborted"] == "2 masked inputs arrived, fewer than m = 3"
    assert summary["rounds"][1]["answer"] is None and summary["rounds"][1]["errors"]["secagg-aborted"] == 1
    # Round 1: 5 masked inputs, each with an N(0, sigma^2 / 3) share: std sigma sqrt(5 / 3).
    assert summary["rounds"][0]["release_noise_std"] == pytest.approx(SIGMA * np.sqrt(5 / 3))
    privacy = summary["privacy"]
    assert privacy["trust"] == "secagg" and privacy["secagg"]["min_clients"] == 3
    assert "at least m = 3" in privacy["statement"] and "honest" in privacy["statement"]


def test_tree_monitor_under_secagg_counts_exactly_without_noise(tmp_path: Path, no_noise: None) -> None:
    # Record units at full norm C = 1 and sigma = 2 spend 0.25 a round; the (2, 1e-5) GDP threshold
    # minus the tree's reservation L / sigma_m^2 leaves room for about two rounds. With the noise
    # patched to zero the masked tree counts are exact: the monitor's estimate equals the true
    # number of active units every round, read back from the ledgers' halt rounds.
    over = {
        "unit": "record",
        "epsilon": 2.0,
        "monitor": "tree",
        "monitor-noise-std": 10.0,
        "monitor-max-rounds": 8,
    }
    group = agents(tmp_path, 4, **over)
    cfg = gradient_config(
        4, rounds=8, learning_rate=0.5, run_id="tree", monitor="tree", monitor_threshold=1, secagg_min_clients=3
    )
    summary = run(AgentTransport(group), cfg)
    halts = np.concatenate([a.ledger.state()["halt_round"] for a in group.values()])
    assert summary["stopped_because"] == "monitor" and summary["rounds"]
    for log in summary["rounds"]:
        t = log["round"]
        exact = int(np.sum((halts < 0) | (halts > t)))
        assert log["monitor"]["active_estimate"] == exact
        # Each of the 4 clients adds N(0, sigma_m^2 / m) to a tree node (sigma_m = 10, m = 3), and the prefix
        # count at t sums the dyadic nodes covering [1, t] (privacy.md §7, DNPR): 10 sqrt(4/3) sqrt(#nodes).
        assert log["monitor"]["estimate_std"] == pytest.approx(10.0 * np.sqrt(4 / 3) * np.sqrt(len(_nodes(t))))


def _nodes(t: int) -> list[tuple[int, int]]:
    from coordinator.monitor import dyadic_nodes

    return dyadic_nodes(t)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"secagg_min_clients": 1},
            r"secagg_min_clients: expected 0 \(default\) or an integer in \[2, num_nodes = 3\]",
        ),
        ({"secagg_min_clients": 4}, r"got 4"),
        ({"secagg_scale_bits": 60}, r"secagg_scale_bits: expected an integer in \[8, 52\], got 60"),
        ({"monitor": "svt", "monitor_epsilon": 1.0, "monitor_threshold": 1}, "needs trust 'central'"),
    ],
)
def test_bad_secagg_coordinator_config(over: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = dict(num_nodes=3, n_public=3, rounds=1, noise_std=1.0, l2_clip=1.0, trust="secagg")
    with pytest.raises(CoordinatorConfigError, match=message):
        CoordinatorConfig(**(base | over))


def test_enrolment_needs_m_clients(tmp_path: Path) -> None:
    group = agents(tmp_path, 2)
    cfg = count_config(2, n_public=1)
    assert default_min_clients(2) == 2 and default_min_clients(10) == 7  # max(2, ceil(2n/3)): ceil(20/3) = 7
    transport = AgentTransport(group, {wire.STATUS: {1001}})
    with pytest.raises(EnrolmentError, match="secagg: m = 2 clients per sum asked; only 1 clients enrolled"):
        run(transport, cfg)


def test_wire_refuses_malformed_secagg_fields() -> None:
    peers = np.arange(3, dtype=np.int64)
    good = wire.SecaggInput("s", BITS, sa.value_bound_for(3), peers, np.zeros((3, sa.CIPHERTEXT_BYTES), np.uint8))
    config, arrays = wire.encode_request(count_request(good, node=1))
    decoded = wire.decode_request(wire.INDICATOR, config, arrays)
    assert isinstance(decoded, wire.IndicatorRequest) and decoded.secagg is not None
    assert decoded.secagg.session == "s" and decoded.secagg.peers.tolist() == [0, 1, 2]
    cases = [
        (config, arrays | {"secagg_ciphertexts": np.zeros((2, sa.CIPHERTEXT_BYTES), np.uint8)}, "must be uint8[3, "),
        (config, arrays | {"secagg_peers": peers.astype(np.int32)}, "must be a 1-d int64 list of roster indices"),
        ({k: v for k, v in config.items() if k != "secagg_session"}, arrays, "missing key 'secagg_session'"),
        (config | {"secagg_value_bound": 2**63}, arrays, "'secagg_value_bound' must be <= 2^63 - 1"),
        (config | {"secagg_scale_bits": 53}, arrays, "'secagg_scale_bits' must be <= 52"),
        (config | {"trust": "local"}, arrays, "unexpected key 'secagg_"),
    ]
    for cfg, arrs, message in cases:
        with pytest.raises(wire.ProtocolError, match=re.escape(message)):
            wire.decode_request(wire.INDICATOR, cfg, arrs)
    keys = wire.encode_request(wire.SecaggKeysRequest("k", "run", 1, "secagg", "0" * 64))
    with pytest.raises(wire.ProtocolError, match=r"'trust' must be one of \('secagg',\), got 'local'"):
        wire.decode_request(wire.SECAGG_KEYS, keys[0] | {"trust": "local"}, {})
    reply = wire.MaskedInputReply("r", "s", np.zeros(4, np.uint64)).encode()
    with pytest.raises(wire.ProtocolError, match=r"array 'masked' must be uint64\[5\], got uint64\(4,\)"):
        wire.MaskedInputReply.decode(*reply, size=5)
    with pytest.raises(wire.ProtocolError, match=r"array 'masked' must be uint64\[4\], got int64\(4,\)"):
        wire.MaskedInputReply.decode(reply[0], {"masked": np.zeros(4, np.int64)}, size=4)


def test_private_plateau_count_runs_as_its_own_session(tmp_path: Path, no_noise: None) -> None:
    # The plateau test's count of correctly classified records is a third release per round; under
    # secagg it is a session of its own, and with the noise patched to zero it is the exact count / n.
    group = agents(tmp_path, 3, unit="record")
    cfg = gradient_config(3, run_id="plateau", plateau_every=1, plateau_patience=5, plateau_noise_std=5.0)
    transport = AgentTransport(group)
    summary = run(transport, cfg)
    # The check's noise is its own: each of the 3 survivors adds its share N(0, 5^2 / m), m = 2 (review, issue 24).
    for check in summary["selection"]["checks"]:
        assert check["release_noise_std"] == pytest.approx((3 * 25 / 2) ** 0.5)
    purposes = {
        c["request_id"].split(":")[1] for kind, p in transport.sent if kind == wire.SECAGG_KEYS for c, _ in p.values()
    }
    assert purposes == {"gradient", "plateau"}
    assert summary["rounds_completed"] == 2 and len(summary["rounds"]) == 2
    for log in summary["rounds"]:
        accuracy = log["metrics"]["train_accuracy_private"]
        # 3 clients x 10 records (node_config): an exact count over n = 30 is a multiple of 1/30.
        assert accuracy * 30 == pytest.approx(round(accuracy * 30), abs=1e-9) and 0 <= accuracy <= 1
        assert not log["errors"]


def test_the_last_partial_round_spends_the_remainder_including_the_slack(tmp_path: Path) -> None:
    # Client units, counts of about 5 at C = 100 and sigma = 10: mu^2 ~ 0.25 a round against the GDP
    # threshold T = 0.517 at (3, 1e-5). Round 3 is partial (clip sigma sqrt(T - S) - slack), after which
    # every client with a positive count is stopped, having spent T up to the exhaustion margin.
    group = agents(tmp_path, 3, epsilon=3.0)
    threshold = next(iter(group.values())).gaussian.threshold  # type: ignore[union-attr]
    for rnd in range(1, 5):
        assert session(AgentTransport(group), 2, rnd=rnd).total is not None
        for agent in group.values():
            assert agent.ledger.state()["spent"][0] <= threshold
    assert any(label_count(a) > 0 for a in group.values())  # the check below runs for some client
    for agent in group.values():
        state = agent.ledger.state()
        if label_count(agent) > 0:
            assert state["stopped"][0] and state["spent"][0] >= threshold * (1 - 1e-4)
        assert verify_ledger(agent.config.ledger_path) == []


def test_enrolment_refuses_clients_with_different_tree_noise(tmp_path: Path) -> None:
    """Node noise sigma_m^2 / m per client sums to the mean sigma_m^2: a larger reservation would be under-covered."""
    tree = {"unit": "record", "epsilon": 2.0, "monitor": "tree", "monitor-max-rounds": 8}
    group = {
        1000 + i: Agent(
            parse_agent_config(node_config(tmp_path, i, **tree, **{"monitor-noise-std": s}), simulation=True)
        )
        for i, s in enumerate((16.0, 8.0, 8.0))
    }
    cfg = gradient_config(3, rounds=8, monitor="tree", monitor_threshold=1, secagg_min_clients=3)
    try:
        with pytest.raises(EnrolmentError, match="must reserve the same node noise std sigma_m; found"):
            run(AgentTransport(group), cfg)
        assert all(a.ledger.requests_answered() == 0 for a in group.values())  # nothing but status was asked
    finally:
        for a in group.values():
            a.close()


@pytest.mark.parametrize("field", ["request_id", "session"])
def test_ids_with_the_reserved_separator_are_refused(field: str) -> None:
    """A request id 'S|masked' would collide with where the client stores session S's masked input."""
    if field == "request_id":  # the keys step's id names its session
        mtype, config = wire.SECAGG_KEYS, {"request_id": "S|masked", "run_id": "run", "round": 1, "trust": "secagg"}
    else:
        mtype = wire.SECAGG_SHARES
        config = {"request_id": "r1", "run_id": "run", "round": 1, "trust": "secagg", "session": "S|masked"}
    with pytest.raises(wire.ProtocolError, match=rf"'{field}' must not contain '\|' \(reserved\)"):
        wire.decode_request(mtype, config, {})


def test_two_sessions_never_reuse_a_noise_share_even_under_one_request_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded noise is keyed by where the release is stored, not by the coordinator's request id.

    The masked step is stored under '<session>|masked', so two sessions may carry the same request
    id; the same noise share in both would cancel in the difference of the two released sums.
    """
    draws: list[np.ndarray] = []
    real = sa.rounded_gaussian

    def recording(rng: np.random.Generator, *, noise_std: float, scale_bits: int, size: int) -> np.ndarray:
        out = real(rng, noise_std=noise_std, scale_bits=scale_bits, size=size)
        draws.append(out)
        return out

    monkeypatch.setattr(sa, "rounded_gaussian", recording)
    transport = AgentTransport(agents(tmp_path, 3))
    for purpose in ("first", "second"):  # two sessions; ``count_request`` gives both the same request ids
        result = secagg_release(
            transport,
            run_id="run",
            rnd=1,
            purpose=purpose,
            nodes=sorted(transport.agents),
            settings=SecaggSettings(min_clients=2, scale_bits=BITS),
            kind=wire.INDICATOR,
            build=lambda node, s: count_request(s, node=node),
            size=1,
            noise_std=SIGMA,
            timeout=1.0,
        )
        assert result.total is not None
    masked = [p for kind, p in transport.sent if kind == wire.INDICATOR]
    assert [c["request_id"] for c, _ in masked[0].values()] == [c["request_id"] for c, _ in masked[1].values()]
    assert len(draws) == 6 and len({d.tobytes() for d in draws}) == 6  # 3 clients x 2 sessions, all distinct


def test_a_check_missing_a_client_at_any_secagg_step_is_incomplete(tmp_path: Path) -> None:
    # A client that never answers the keys step is not in the sum, though step 3 reports nothing missing:
    # the check sums fewer units than n and must not count as a measurement (review, issue 24).
    cfg = gradient_config(4, run_id="drop", plateau_every=1, plateau_patience=5, plateau_noise_std=5.0)
    dropped = run(AgentTransport(agents(tmp_path / "drop", 4, unit="record"), {wire.SECAGG_KEYS: {1003}}), cfg)
    assert [c["complete"] for c in dropped["selection"]["checks"]] == [False, False]
    assert dropped["selection"]["round"] is None
    whole = run(AgentTransport(agents(tmp_path / "all", 4, unit="record")), cfg)
    assert [c["complete"] for c in whole["selection"]["checks"]] == [True, True]
