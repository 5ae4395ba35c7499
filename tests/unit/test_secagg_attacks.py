"""secagg against a coordinator that deviates: each attack against real agents, refused by every honest client.

The harness (tests/adversarial_secagg.py) scripts a coordinator that deviates step by step
against real client agents. Each attack's goal is the one that matters for privacy: one
client's input unmasked alone (its value with only its own noise share sigma^2 / m, far less
than the sigma^2 its charge assumed), or a sum isolated to one client. The control
(``previous_protocol``) turns off exactly the client checks this protocol adds (roster
authentication with 2m > n, the consistency signatures, the request fingerprint): with them off
the same scripts recover the target's exact input, so it is those checks that stop each attack.
Noise shares are patched to zero, so a recovered input is the target's exact label count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from client_agent import secagg_client
from client_agent.ledger_report import verify_ledger
from protocol import messages as wire
from protocol import secagg as sa
from tests.adversarial_secagg import (
    BITS,
    Coordinator,
    Refused,
    count_request,
    label_count,
    make_clients,
    recover_input,
    revealed_shares,
    sybil_advert,
    sybil_seed_shares,
)


@pytest.fixture
def previous_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the clients' acceptance rules before the active-adversary checks (those three off)."""
    monkeypatch.setattr(sa.Roster, "authenticate", lambda self, trusted: None)
    monkeypatch.setattr(sa.Roster, "check_signatures", lambda self, survivors, dropped, signers, signatures: None)
    monkeypatch.setattr(secagg_client, "check_fingerprint", lambda request, roster: None)


def split_views(
    coord: Coordinator, n: int, m: int, target: int, *, pad: bool = False
) -> tuple[float | None, dict[int, Refused]]:
    """Attacks (1) and (2): the target is a survivor for one group and dropped for the other.

    Group A is told U3 = everyone (it reveals the target's self-mask seed shares); group B is
    told U3 = everyone but the target (it reveals the target's masking-key shares). Each group
    signs its own set; ``pad`` tops group B's signatures up with group A's (over the other set).
    Returns the target's input if the shares recover it, and each refusal of the unmask step.
    """
    s = coord.open("S", range(n), m=m)
    coord.share(s)
    coord.mask(s)
    everyone = list(range(n))
    others = [i for i in everyone if i != target]
    group_a, group_b = others[: (n - 1) // 2], others[(n - 1) // 2 :]
    sigs_a = {i: coord.check(s, i, everyone, []) for i in [*group_a, target]}
    sigs_b = {i: coord.check(s, i, others, [target]) for i in group_b}
    if pad:
        sigs_b = {**sigs_a, **sigs_b}
        sigs_b.pop(target)
    answers, refusals = {}, {}
    for group, survivors, dropped, sigs in ((group_a, everyone, [], sigs_a), (group_b, others, [target], sigs_b)):
        for i in group:
            try:
                answers[i] = coord.unmask(s, i, survivors, dropped, sigs)
            except Refused as refused:
                refusals[i] = refused
    seeds, keys = revealed_shares(answers, target)
    return recover_input(s, target, seed_shares=seeds, key_shares=keys, peers=everyone), refusals


# --- (1) a target listed as both survivor and dropped ------------------------------------------------


def test_1_survivor_and_dropped_at_once_is_refused_by_every_client(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 5)
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    coord.share(s)
    coord.mask(s)
    for i in range(5):
        with pytest.raises(Refused, match="expected disjoint lists, found \\[4\\] in both") as refused:
            coord.check(s, i, range(5), [4])
        assert refused.value.code == wire.ERR_MALFORMED
    # The lists must also partition the U2 the client masked against: dropping a client silently is refused.
    with pytest.raises(Refused, match="expected together exactly the U2"):
        coord.check(s, 0, [0, 1, 2, 3], [])


def test_1_control_the_previous_protocol_unmasks_the_target_alone(
    tmp_path: Path, no_noise: None, previous_protocol: None
) -> None:
    clients = make_clients(tmp_path, 7)
    recovered, refusals = split_views(Coordinator(clients), 7, 3, target=6)
    assert refusals == {} and recovered == label_count(
        clients[6]
    )  # the target's exact input, with none of the others' noise


# --- (2) different survivor sets to different clients --------------------------------------------------


@pytest.mark.parametrize("pad", [False, True], ids=["own-signatures", "padded-with-the-other-sets"])
def test_2_different_survivor_sets_cannot_both_gather_m_signatures(tmp_path: Path, no_noise: None, pad: bool) -> None:
    clients = make_clients(tmp_path, 7)
    recovered, refusals = split_views(Coordinator(clients), 7, 4, target=6, pad=pad)
    # Every client of group B (told the target dropped) refuses: 3 < m = 4 signatures over its set,
    # or signatures over another set. Group A gave the target's seed shares, never its key shares.
    assert recovered is None and sorted(refusals) == [3, 4, 5]
    reason = "not over this session's survivor set" if pad else "3 survivors signed the survivor set, fewer than m = 4"
    assert all(r.code == wire.ERR_MALFORMED and reason in r.detail for r in refusals.values())


def test_2_control_the_previous_protocol_accepts_two_survivor_sets(
    tmp_path: Path, no_noise: None, previous_protocol: None
) -> None:
    clients = make_clients(tmp_path, 7)
    recovered, refusals = split_views(Coordinator(clients), 7, 3, target=2)
    assert refusals == {} and recovered == label_count(clients[2])


def test_2_a_client_signs_one_survivor_set_per_session_even_after_a_restart(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 5)
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    coord.share(s)
    coord.mask(s)
    coord.check(s, 0, range(5), [])
    clients[0].close()
    from client_agent.agent import Agent

    clients[0] = Agent(clients[0].config)  # a crash and restart: the signed set is in the ledger
    coord.clients = clients
    with pytest.raises(Refused, match="already signed another survivor set") as refused:
        coord.check(s, 0, [0, 1, 2, 3], [4])
    assert refused.value.code == wire.ERR_REPLAY
    assert np.array_equal(coord.check(s, 0, range(5), []), s.signatures[0])  # the same request: the stored answer


# --- (3) a forged roster member, a substituted key -------------------------------------------------------


def test_3_invented_members_are_refused(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 3)
    coord = Coordinator(clients)
    s = coord.open("S", [0], m=2, sybils=2)  # the target and two members the coordinator controls
    with pytest.raises(Refused, match="members \\[1, 2\\] have identities that are not this client's trusted peers"):
        coord.share(s)
    assert clients[0].ledger.state()["spent"][0] == 0.0


def test_3_control_the_previous_protocol_unmasks_the_target_among_invented_members(
    tmp_path: Path, no_noise: None, previous_protocol: None
) -> None:
    clients = make_clients(tmp_path, 1)
    coord = Coordinator(clients)
    s = coord.open("S", [0], m=2, sybils=2)
    coord.share(s)
    coord.mask(s)
    # The Sybils hold m = 2 shares of each of the target's secrets: no honest client needs to answer.
    assert s.roster is not None
    keys = {}
    for idx, (secrets, _) in s.sybils.items():
        opened = sa.open_ciphertexts(secrets, s.roster, idx, np.array([0], np.int64), s.ciphertexts[0][idx : idx + 1])
        keys[idx + 1] = opened[0].key_share
    recovered = recover_input(s, 0, seed_shares=sybil_seed_shares(s, 0), key_shares=keys, peers=[0, 1, 2])
    assert recovered == label_count(clients[0])


@pytest.mark.parametrize("forgery", ["substituted-masking-key", "substituted-identity", "member-twice"])
def test_3_substituted_or_duplicated_members_are_refused_by_every_client(
    tmp_path: Path, no_noise: None, forgery: str
) -> None:
    clients = make_clients(tmp_path, 4)
    coord = Coordinator(clients)
    s = coord.open("S", range(4), m=3)
    adverts = dict(s.adverts)
    mine = sa.ClientSecrets.fresh()
    if forgery == "substituted-masking-key":  # the coordinator's key in place of client 3's, its signature kept
        a = adverts[3]
        adverts[3] = wire.SecaggKeysReply(
            a.request_id, a.session, a.encryption_key, np.frombuffer(mine.masking_key, np.uint8).copy(),
            a.seed_commitment, a.identity, a.signature,
        )  # fmt: skip
        reason = "advertisements of members \\[3\\] are not signed"
    elif forgery == "substituted-identity":  # client 3 replaced by a member the coordinator signed itself
        adverts[3] = sybil_advert(mine, sa.new_identity(), "S", s.fingerprint)
        reason = "members \\[3\\] have identities that are not this client's trusted peers"
    else:  # client 0's advertisement listed twice (under fresh session keys it cannot sign for)
        adverts[3] = adverts[0]
        reason = "every public key to be distinct|identity listed twice"
    request = coord.roster_request(s, adverts)
    for i in range(3):
        with pytest.raises(Refused, match=reason):
            coord.share(s, request, who=[i])


# --- (4) a survivor set smaller than m, a threshold 2m <= n ------------------------------------------------


def test_4_a_survivor_set_under_m_is_refused(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 5)
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    coord.share(s)
    coord.mask(s)
    for i in (0, 1):
        with pytest.raises(Refused, match="2 clients, fewer than the session's minimum m = 3"):
            coord.check(s, i, [0, 1], [2, 3, 4])
    sigs = {i: coord.check(s, i, range(5), []) for i in (0, 1)}
    with pytest.raises(Refused, match="2 survivors signed the survivor set, fewer than m = 3"):
        coord.unmask(s, 0, range(5), [], sigs)


def test_4_a_threshold_with_2m_not_above_n_is_refused(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 7)
    coord = Coordinator(clients)
    s = coord.open("S", range(7), m=3)
    for i in range(7):
        with pytest.raises(Refused, match="m = 3 of 7 clients; expected 2m > n"):
            coord.share(s, who=[i])


def test_4_control_the_previous_protocol_accepted_2m_not_above_n(
    tmp_path: Path, no_noise: None, previous_protocol: None
) -> None:
    clients = make_clients(tmp_path, 5)
    recovered, refusals = split_views(Coordinator(clients), 5, 2, target=0)
    assert refusals == {} and recovered == label_count(clients[0])


# --- (5) another model or question for one client ---------------------------------------------------------


def test_5_another_question_for_some_clients_is_refused_at_step_3(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 5)
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    coord.share(s)
    for i in range(4):  # everyone but the target 4 is asked a question with no match: the sum would isolate 4
        with pytest.raises(Refused, match="this request differs from the one the session's clients signed"):
            coord.mask(s, who=[i], value_for={i: 99.0})
        assert clients[i].ledger.state()["spent"][0] == 0.0  # refused before anything was computed or charged


def test_5_signing_another_fingerprint_breaks_the_roster_for_everyone(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 4)
    coord = Coordinator(clients)
    s = coord.open("S", range(3), m=3)
    crafted = wire.session_fingerprint(count_request(None, value=99.0), BITS)
    s.adverts[3] = coord.keys_reply(3, "S", crafted)  # the target alone is told another request at step 1
    s.members.append(3)
    request = coord.roster_request(s)
    for i in range(4):
        with pytest.raises(Refused, match=r"not signed by their identities|this client signed"):
            coord.share(s, request, who=[i])


def test_5_control_the_previous_protocol_isolates_one_client_in_the_sum(
    tmp_path: Path, no_noise: None, previous_protocol: None
) -> None:
    clients = make_clients(tmp_path, 5)
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    coord.share(s)
    coord.mask(s, value_for={i: 99.0 for i in range(4)})
    assert coord.honest_finish(s) == label_count(clients[4])


def test_5_the_fingerprint_covers_the_question_and_the_scale_not_the_per_client_parts() -> None:
    def fp(request: wire.Request, bits: int = BITS) -> str:
        return wire.session_fingerprint(request, bits)

    base = count_request(None)
    assert fp(base) == fp(count_request(None))
    assert fp(base) != fp(count_request(None, value=0.0))
    assert fp(base) != fp(base, BITS + 20)  # another fixed-point scale for one client: refused too
    peers = np.arange(3, dtype=np.int64)
    own = wire.SecaggInput("S", BITS, 10**12, peers, np.zeros((3, sa.CIPHERTEXT_BYTES), np.uint8))
    assert fp(count_request(own)) == fp(base)  # U2 and the shares addressed to a client are its own
    params = np.zeros(8, np.float32)
    grad = wire.GradientRequest("g", "run", 1, 1.0, 1.0, "secagg", "client", "logreg", "{}", params)
    other = wire.GradientRequest("g", "run", 1, 1.0, 1.0, "secagg", "client", "logreg", "{}", params + 1)
    assert fp(grad) != fp(other)  # other parameters, another model
    monitor = wire.MonitorRequest("m", "run", 1, "secagg", None, 8.0)
    assert fp(monitor) != fp(wire.MonitorRequest("m", "run", 1, "secagg", None, 0.5))  # the node noise too


def test_5_another_scale_for_one_client_is_refused_at_step_3(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 5)
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    coord.share(s)
    with pytest.raises(Refused, match="fixed-point scale"):
        coord.mask(s, who=[4], scale_for={4: BITS + 20})
    assert clients[4].ledger.state()["spent"][0] == 0.0


def test_5_control_the_previous_protocol_isolates_one_client_by_its_scale(
    tmp_path: Path, no_noise: None, previous_protocol: None
) -> None:
    # Found in review: the target at scale 2^44, the others at 2^24; decoded at 2^44 the others'
    # inputs shrink by 2^-20 and the sum is the target's input with only its own noise share.
    clients = make_clients(tmp_path, 5)
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    coord.share(s)
    coord.mask(s, scale_for={4: BITS + 20})
    decoded = coord.honest_finish(s, scale_bits=BITS + 20)
    assert sum(label_count(c) for c in clients[:4]) > 0 and abs(decoded - label_count(clients[4])) < 1e-3


def test_5_a_monitor_session_below_a_clients_reserved_node_noise_is_refused(tmp_path: Path) -> None:
    # Found in review: each client used its own reserved sigma_m, so a coordinator could mix a client
    # that reserved 8 with clients that reserved 0.5. The request now names the session's sigma_m.
    clients = make_clients(tmp_path, 3, **{"monitor": "tree", "monitor-noise-std": 8.0, "monitor-max-rounds": 4})
    peers = np.arange(3, dtype=np.int64)
    ghost = wire.SecaggInput("S", BITS, 10**12, peers, np.zeros((3, sa.CIPHERTEXT_BYTES), np.uint8))
    for agent in clients:
        out = agent.handle(wire.MONITOR, *wire.encode_request(wire.MonitorRequest("m", "run", 1, "secagg", ghost, 0.5)))
        assert out.error_code == wire.ERR_POLICY
        assert "monitor noise_std 0.5 asked; this client reserved its tree at noise std >= 8.0" in out.local_detail
    config, arrays = wire.encode_request(wire.MonitorRequest("m", "run", 1, "secagg", ghost, 8.0))
    del config["noise_std"]
    with pytest.raises(wire.ProtocolError, match="missing key 'noise_std'"):
        wire.decode_request(wire.MONITOR, config, arrays)


# --- (6) steps replayed or reordered across sessions -------------------------------------------------------


def test_6_an_advertisement_replayed_from_another_session_is_refused(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 4)
    coord = Coordinator(clients)
    old = coord.open("S1", range(4), m=3)
    s = coord.open("S2", range(3), m=3)
    s.adverts[3], s.members = old.adverts[3], [0, 1, 2, 3]  # client 3's signed keys of session S1
    request = coord.roster_request(s)
    for i in range(3):
        with pytest.raises(Refused, match="advertisements of members \\[3\\] are not signed"):
            coord.share(s, request, who=[i])


def test_6_control_the_previous_protocol_accepted_a_replayed_advertisement(
    tmp_path: Path, no_noise: None, previous_protocol: None
) -> None:
    clients = make_clients(tmp_path, 4)
    coord = Coordinator(clients)
    old = coord.open("S1", range(4), m=3)
    s = coord.open("S2", range(3), m=3)
    s.adverts[3], s.members = old.adverts[3], [0, 1, 2, 3]
    coord.share(s, who=[0, 1, 2])  # sealed shares for keys of another session: accepted
    assert sorted(s.ciphertexts) == [0, 1, 2]


def test_6_steps_out_of_order_or_from_another_session_are_refused(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 3)
    coord = Coordinator(clients)
    s1 = coord.open("S1", range(3), m=2)
    coord.share(s1)
    with pytest.raises(Refused, match="step 3 \\(masked input\\) was not answered"):  # check before step 3
        coord.check(s1, 0, range(3), [])
    coord.mask(s1)
    with pytest.raises(Refused, match="the consistency check was not answered"):  # unmask before the check
        coord.unmask(s1, 0, range(3), [], {})
    sigs1 = {i: coord.check(s1, i, range(3), []) for i in range(3)}
    s2 = coord.open("S2", range(3), m=2, rnd=2)
    coord.share(s2)
    coord.mask(s2)
    coord.check(s2, 0, range(3), [])
    with pytest.raises(Refused, match="not over this session's survivor set"):  # S1's signatures in S2
        coord.unmask(s2, 0, range(3), [], sigs1)
    # A roster whose fingerprint is not the one the client signed at step 1 (another session's request).
    s3 = coord.open("S3", range(3), m=2, rnd=3)
    s3.fingerprint = s1.fingerprint
    with pytest.raises(Refused, match="this client signed"):
        coord.share(s3, who=[0])


def test_an_aborted_attack_keeps_the_charges_of_the_inputs_that_left(tmp_path: Path, no_noise: None) -> None:
    clients = make_clients(tmp_path, 7)
    recovered, refusals = split_views(Coordinator(clients), 7, 4, target=6)
    assert recovered is None and refusals
    for agent in clients:  # every masked input left, so every client paid for it, once; the ledgers replay
        assert agent.ledger.state()["spent"][0] > 0.0
        assert verify_ledger(agent.config.ledger_path) == []


# --- (7) restored or cloned peers: one client signs two survivor sets ----------------------------------


def restore(clients: list, idx: int, saved: bytes) -> None:
    """Client ``idx``'s ledger put back to ``saved`` (a backup taken earlier), and the agent started again."""
    from client_agent.agent import Agent

    config = clients[idx].config
    clients[idx].close()
    path = config.ledger_path
    for leftover in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        leftover.unlink(missing_ok=True)
    path.write_bytes(saved)
    clients[idx] = Agent(config)


def restored_peer_attack(clients: list, *, target: int = 4) -> float | None:
    """n = 5, m = 3: client 0's ledger is restored between its two consistency checks.

    S1 (the target survived) is signed and unmasked by {0, 1, target}: the target's seed shares at
    x = 1, 2, 5. Client 0's ledger goes back to before its check, so it signs S2 (the target dropped)
    as well, with 2 and 3: the target's masking-key shares at x = 1, 3, 4. Both secrets reconstruct.
    """
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    coord.share(s)
    coord.mask(s)
    clients[0].close()  # a backup of client 0's ledger, taken after its masked input left
    saved = clients[0].config.ledger_path.read_bytes()
    from client_agent.agent import Agent

    clients[0] = Agent(clients[0].config)
    coord.clients = clients
    everyone, others = list(range(5)), [i for i in range(5) if i != target]
    sigs_1 = {i: coord.check(s, i, everyone, []) for i in (0, 1, target)}
    answers = {i: coord.unmask(s, i, everyone, [], sigs_1) for i in (0, 1, target)}
    seeds, _ = revealed_shares(answers, target)
    restore(clients, 0, saved)
    coord.clients = clients
    sigs_2 = {i: coord.check(s, i, others, [target]) for i in (0, 2, 3)}
    answers_2 = {i: coord.unmask(s, i, others, [target], sigs_2) for i in (0, 2, 3)}
    _, keys = revealed_shares(answers_2, target)
    return recover_input(s, target, seed_shares=seeds, key_shares=keys, peers=everyone)


def test_7_control_a_restored_peer_lets_the_coordinator_unmask_a_client_alone(tmp_path: Path, no_noise: None) -> None:
    """Without the high-water mark and with f = 0 (2m > n only), one restored peer is enough."""
    clients = make_clients(tmp_path, 5)
    assert restored_peer_attack(clients) == label_count(clients[4])  # the target's exact input


def test_7_a_restored_ledger_is_refused_by_its_high_water_mark(tmp_path: Path, no_noise: None) -> None:
    """The same attack against a client 0 that keeps its mark (a deployed agent's default): refused."""
    import dataclasses

    from client_agent.agent import Agent
    from client_agent.high_water import default_path
    from client_agent.ledger import LedgerError

    clients = make_clients(tmp_path, 5)
    config = clients[0].config
    clients[0].close()
    clients[0] = Agent(dataclasses.replace(config, high_water_path=default_path(config.ledger_path)))
    with pytest.raises(LedgerError, match="found one rolled back to"):
        restored_peer_attack(clients)


def test_7_the_default_tolerance_refuses_the_roster_the_attack_needs(tmp_path: Path, no_noise: None) -> None:
    """f = 2 * ceil(2n / 3) - n - 1 = 2 for n = 5: m = 3 fails 2m > n + f; every client refuses step 2."""
    from client_agent.config import Policy

    assert [Policy().secagg_faults(n) for n in (2, 3, 4, 5, 6, 7, 9, 10)] == [1, 0, 1, 2, 1, 2, 2, 3]
    clients = make_clients(tmp_path, 5, **{"policy-secagg-tolerance": None})
    coord = Coordinator(clients)
    s = coord.open("S", range(5), m=3)
    for i in range(5):
        with pytest.raises(Refused, match="policy") as refused:
            coord.share(s, who=[i])
        assert refused.value.code == wire.ERR_POLICY
    s = coord.open("T", range(5), m=4)  # m = ceil(2n / 3): accepted
    coord.share(s)
    coord.mask(s)
    assert coord.honest_finish(s) == sum(label_count(c) for c in clients)
