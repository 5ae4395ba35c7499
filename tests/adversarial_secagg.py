"""A coordinator that deviates from secagg, scripted step by step against real client agents.

Each client is a real :class:`client_agent.agent.Agent` over its own ledger, identity key and
trusted-peers file, answering through ``Agent.handle`` (decode, policy, session checks, ledger
commit): the product's own release path. The coordinator here is not
coordinator/secagg.py: it builds every request itself, so it can send different clients
different survivor sets, forge roster members, send one client another question, or replay
steps across sessions, and then tries to unmask one client's input alone
(:func:`recover_input`). Used by tests/unit/test_secagg_attacks.py.

The data are client-unit label counts, so a recovered input is an exact integer to compare
with the target's true count when the noise share is patched to zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from client_agent import secagg_client
from client_agent.agent import Agent, Outcome
from protocol import messages as wire
from protocol import secagg as sa
from tests.factories import count_request, secagg_agents

BITS = 24
RUN = "run"


def make_clients(root: Path, n: int, **over: Any) -> list[Agent]:
    """``n`` secagg agents, client units, 10 records each with known labels; all trust each other.

    ``policy-secagg-tolerance`` is 0 unless given: these scripts probe the protocol's own checks with
    the thresholds the attacks need (m = 3 of 5 or 7); the tolerance f, which refuses such rosters
    before any of them, has its own tests (test_secagg_attacks.py, "restored or cloned peers").
    """
    return list(secagg_agents(root, n, **({"epsilon": 50.0, "policy-secagg-tolerance": 0} | over)).values())


def label_count(agent: Agent) -> int:
    return int(np.sum(agent.y == 1))


def ask(agent: Agent, request: wire.Request) -> Outcome:
    return agent.handle(wire.message_type_of(request), *wire.encode_request(request))


class Refused(Exception):
    """A client refused a step: its wire code (the text on the wire is fixed) and its local detail."""

    def __init__(self, client: int, outcome: Outcome) -> None:
        super().__init__(f"client {client}: code {outcome.error_code}: {outcome.local_detail}")
        self.client, self.code, self.detail = client, outcome.error_code, outcome.local_detail


@dataclass
class Session:
    """What the deviating coordinator holds of one session."""

    name: str
    rnd: int
    fingerprint: str
    members: list[int]  # roster index -> client index (Sybils: -1)
    m: int
    adverts: dict[int, wire.SecaggKeysReply] = field(default_factory=dict)  # by roster index
    sybils: dict[int, tuple[sa.ClientSecrets, bytes]] = field(default_factory=dict)  # roster index -> secrets, id
    ciphertexts: dict[int, np.ndarray] = field(default_factory=dict)  # by roster index: row v sealed for v
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    signatures: dict[int, np.ndarray] = field(default_factory=dict)
    roster: sa.Roster | None = None


class Coordinator:
    """Scripted steps; each returns the replies and raises :class:`Refused` when a client refuses."""

    def __init__(self, clients: Sequence[Agent]) -> None:
        self.clients = list(clients)

    def _ok(self, client: int, outcome: Outcome) -> Outcome:
        if outcome.is_error:
            assert outcome.error_reason == wire.ERROR_TEXT[outcome.error_code]  # fixed text on the wire
            raise Refused(client, outcome)
        return outcome

    # -- step 1 ------------------------------------------------------------------------------

    def open(self, name: str, members: Sequence[int], *, m: int, rnd: int = 1, sybils: int = 0) -> Session:
        """Keys from ``members`` (client indices) and, appended, ``sybils`` members the coordinator controls."""
        fingerprint = wire.session_fingerprint(count_request(None, rnd=rnd), BITS)
        s = Session(name, rnd, fingerprint, list(members) + [-1] * sybils, m)
        for idx, client in enumerate(members):
            s.adverts[idx] = self.keys_reply(client, name, fingerprint, rnd=rnd)
        for k in range(sybils):
            idx = len(members) + k
            secrets, identity = sa.ClientSecrets.fresh(), sa.new_identity()
            s.sybils[idx] = (secrets, identity)
            s.adverts[idx] = sybil_advert(secrets, identity, name, fingerprint, rnd=rnd)
        return s

    def keys_reply(self, client: int, name: str, fingerprint: str, *, rnd: int = 1) -> wire.SecaggKeysReply:
        request = wire.SecaggKeysRequest(name, RUN, rnd, "secagg", fingerprint)
        out = self._ok(client, ask(self.clients[client], request))
        return wire.SecaggKeysReply.decode(out.config, out.arrays)

    # -- step 2 ------------------------------------------------------------------------------

    def roster_request(
        self, s: Session, adverts: Mapping[int, wire.SecaggKeysReply] | None = None
    ) -> wire.SecaggSharesRequest:
        adverts = dict(s.adverts if adverts is None else adverts)
        order = sorted(adverts)

        def table(name: str) -> np.ndarray:
            return np.stack([getattr(adverts[i], name) for i in order])

        return wire.SecaggSharesRequest(
            f"{s.name}:shares",
            RUN,
            s.rnd,
            "secagg",
            s.name,
            s.m,
            table("encryption_key"),
            table("masking_key"),
            s.fingerprint,
            table("identity"),
            table("seed_commitment"),
            table("signature"),
        )

    def share(
        self, s: Session, request: wire.SecaggSharesRequest | None = None, *, who: Iterable[int] | None = None
    ) -> None:
        """Step 2 to the real members (roster indices ``who``, default all); Sybils seal their shares too."""
        request = self.roster_request(s) if request is None else request
        try:  # the coordinator's own bookkeeping; a roster it forged may not even be well formed
            s.roster = self.bookkeeping(s, request)
        except sa.SecaggError:
            s.roster = None
        for idx in who if who is not None else [i for i, c in enumerate(s.members) if c >= 0]:
            out = self._ok(s.members[idx], ask(self.clients[s.members[idx]], request))
            size = request.encryption_keys.shape[0]
            s.ciphertexts[idx] = wire.SecaggSharesReply.decode(out.config, out.arrays, roster_size=size).ciphertexts
        for idx, (secrets, _) in s.sybils.items():
            assert s.roster is not None
            s.ciphertexts[idx] = sa.share_ciphertexts(secrets, s.roster, idx)

    @staticmethod
    def bookkeeping(s: Session, request: wire.SecaggSharesRequest) -> sa.Roster:
        return secagg_client.roster_of(request)

    # -- step 3 ------------------------------------------------------------------------------

    def mask(
        self,
        s: Session,
        *,
        who: Iterable[int] | None = None,
        value_for: Mapping[int, float] | None = None,
        scale_for: Mapping[int, int] | None = None,
    ) -> None:
        """Step 3 to the real members ``who`` (default all); ``value_for`` asks some of them another
        question, ``scale_for`` gives some of them another fixed-point scale."""
        assert s.roster is not None
        peers = np.array(sorted(s.ciphertexts), dtype=np.int64)
        bound = sa.value_bound_for(s.roster.size)
        for idx in who if who is not None else [i for i, c in enumerate(s.members) if c >= 0]:
            bits = (scale_for or {}).get(idx, BITS)
            secagg = wire.SecaggInput(
                s.name, bits, bound, peers, np.stack([s.ciphertexts[v][idx] for v in peers.tolist()])
            )
            value = (value_for or {}).get(idx, 1.0)
            out = self._ok(
                s.members[idx], ask(self.clients[s.members[idx]], count_request(secagg, rnd=s.rnd, value=value))
            )
            s.masked[idx] = wire.MaskedInputReply.decode(out.config, out.arrays, size=1).masked

    # -- consistency check and unmask ---------------------------------------------------------

    def check(self, s: Session, idx: int, survivors: Sequence[int], dropped: Sequence[int]) -> np.ndarray:
        request = wire.SecaggCheckRequest(
            f"{s.name}:check", RUN, s.rnd, "secagg", s.name, _ids(survivors), _ids(dropped)
        )
        out = self._ok(s.members[idx], ask(self.clients[s.members[idx]], request))
        signature = wire.SecaggCheckReply.decode(out.config, out.arrays).signature
        s.signatures[idx] = signature
        return signature

    def unmask(
        self,
        s: Session,
        idx: int,
        survivors: Sequence[int],
        dropped: Sequence[int],
        signatures: Mapping[int, np.ndarray],
    ) -> sa.Revealed:
        signers = sorted(signatures)
        request = wire.SecaggUnmaskRequest(
            f"{s.name}:unmask",
            RUN,
            s.rnd,
            "secagg",
            s.name,
            _ids(survivors),
            _ids(dropped),
            _ids(signers),
            np.stack([signatures[i] for i in signers]) if signers else np.zeros((0, sa.SIGNATURE_BYTES), np.uint8),
        )
        out = self._ok(s.members[idx], ask(self.clients[s.members[idx]], request))
        return wire.SecaggUnmaskReply.decode(out.config, out.arrays).revealed

    def honest_finish(self, s: Session, *, scale_bits: int = BITS) -> float:
        """Steps 3b and 4 as an honest coordinator would run them for every member, then the decoded sum."""
        assert s.roster is not None
        everyone = [i for i, c in enumerate(s.members) if c >= 0]
        sigs = {i: self.check(s, i, everyone, []) for i in everyone}
        answers = {i: self.unmask(s, i, everyone, [], sigs) for i in everyone}
        total = sa.unmask_sum(
            s.roster,
            shared=_ids(everyone),
            masked=s.masked,
            revealed=answers,
            commitments={i: s.adverts[i].seed_commitment.tobytes() for i in everyone},
            dim=1,
        )
        return float(sa.decode_fixed_point(total, scale_bits=scale_bits)[0])


def _ids(values: Iterable[int]) -> np.ndarray:
    return np.array(sorted(values), dtype=np.int64)


def sybil_advert(
    secrets: sa.ClientSecrets, identity: bytes, session: str, fingerprint: str, *, rnd: int = 1
) -> wire.SecaggKeysReply:
    """A roster member the coordinator invented: its own keys, signed by an identity it made up."""
    signature = sa.signed_advert(identity, secrets, run_id=RUN, round=rnd, session=session, fingerprint=fingerprint)

    def u8(raw: bytes) -> np.ndarray:
        return np.frombuffer(raw, dtype=np.uint8).copy()

    return wire.SecaggKeysReply(
        session,
        session,
        u8(secrets.encryption_key),
        u8(secrets.masking_key),
        u8(secrets.commitment),
        u8(sa.identity_public_key(identity)),
        u8(signature),
    )


def sybil_seed_shares(s: Session, target: int) -> dict[int, int]:
    """The shares of ``target``'s self-mask seed that its ciphertexts sealed for the Sybils (x = index + 1)."""
    assert s.roster is not None
    out = {}
    for idx, (secrets, _) in s.sybils.items():
        opened = sa.open_ciphertexts(secrets, s.roster, idx, _ids([target]), s.ciphertexts[target][idx : idx + 1])
        out[idx + 1] = opened[0].seed_share
    return out


def recover_input(
    s: Session, target: int, *, seed_shares: Mapping[int, int], key_shares: Mapping[int, int], peers: Sequence[int]
) -> float | None:
    """The target's own input, unmasked alone, from m shares of its seed and m of its masking key.

    ``seed_shares``/``key_shares`` map x = responder index + 1 to that responder's share of the
    target's b and s secret. Returns the decoded input (its clipped value plus its own noise
    share), or None when either secret does not reconstruct to what the target committed to.
    """
    assert s.roster is not None
    m = s.roster.threshold
    if len(seed_shares) < m or len(key_shares) < m:
        return None
    seed = sa.shamir_reconstruct(dict(seed_shares), threshold=m).to_bytes(66, "little")[: sa.KEY_BYTES]
    secret = sa.shamir_reconstruct(dict(key_shares), threshold=m).to_bytes(66, "little")[: sa.KEY_BYTES]
    if sa.seed_commitment(seed) != s.adverts[target].seed_commitment.tobytes():
        return None
    if sa.public_key_of(secret) != s.adverts[target].masking_key.tobytes():
        return None
    tag = s.roster.tag
    y = s.masked[target].copy()
    y -= sa.expand_mask(sa.self_mask_seed(seed, tag=tag), 1)
    for v in peers:
        if v == target:
            continue
        mask = sa.expand_mask(sa.pairwise_seed(secret, s.roster.masking_keys[v].tobytes(), tag=tag, u=target, v=v), 1)
        if target < v:
            y -= mask
        else:
            y += mask
    return float(sa.decode_fixed_point(y, scale_bits=BITS)[0])


def revealed_shares(answers: Mapping[int, sa.Revealed], target: int) -> tuple[dict[int, int], dict[int, int]]:
    """From unmask answers by responder index: the target's seed shares and key shares, keyed by x."""
    seeds, keys = {}, {}
    for responder, r in answers.items():
        for peers, table, out in ((r.seed_peers, r.seed_shares, seeds), (r.key_peers, r.key_shares, keys)):
            for p, row in zip(peers.tolist(), table, strict=True):
                if p == target:
                    out[responder + 1] = sa.share_from_bytes(row.tobytes(), what="share")
    return seeds, keys
