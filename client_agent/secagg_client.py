"""The client's side of a secure-aggregation session (``secagg`` trust), over the ledger it already has.

Each step of a session (protocol/secagg.py) is one request, answered like any other: its
answer is committed to the ledger before it leaves, and a repeat gets the stored answer.
The per-session secret state lives in those ledger records (the ledger is the client's own
file, already holding everything the client has released):

| step                  | ledger id            | release record holds                                  |
|-----------------------|----------------------|-------------------------------------------------------|
| 1 ``secagg_keys``     | the session id       | the two X25519 secrets, the self-mask seed b_u and    |
|                       |                      | the step-3 request fingerprint it signed              |
| 2 ``secagg_shares``   | ``<session>|shares`` | the authenticated roster, this client's index, m      |
| 3 masked input        | ``<session>|masked`` | the charge (as any release) and the peers' shares     |
| check ``secagg_check``| ``<session>|check``  | the survivor set U3 and dropped set it signed         |
| 4 ``secagg_unmask``   | ``<session>|unmask`` | the survivors U3 it answered for                      |

Steps 2-4 are keyed by the session, not by the coordinator's request id, so each happens
at most once per session, whatever the ids and across crashes and restarts (the ledger's
primary key enforces it; a second request for a step with other content is a replay error):

- one masked input per session: two masked inputs under the same masks would reveal the
  difference of the two inputs;
- one signed survivor set per session, and one unmask answer, for that set only: for each
  peer the client reveals the share of its self-mask seed (peer survived) or of its masking
  key (peer dropped), never both; and since each honest client signs one set and an unmask
  needs m signatures over the same set with 2m > n, no two clients can be told different sets;
- step 4 needs the check, the check needs step 3: only a client that sent its masked input
  signs and helps unmask.

Against a coordinator that deviates (Bonawitz et al. 2017, Sec. 6.2; the model-inconsistency
attack of Pasquini et al., CCS 2022): the roster is accepted only when every member is an
identity from the owner's ``secagg-peers`` file that signed its advertisement for this run,
round, session and step-3 request fingerprint (no invented or substituted member, no replay
from another session); step 3 is answered only for a request with that fingerprint (no other
model for one client); the unmask step only for the survivor set this client signed, with m
valid signatures over it.

Charge before release (privacy.md §9): the masked input's charge is in the same commit as
the stored reply, as for every release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from client_agent.ledger import FederationLedger, StoredRequest
from client_agent.records import (
    CheckRecord,
    GaussianRecord,
    KeysRecord,
    MaskedShares,
    MonitorRecord,
    RealisationRecord,
    ReleaseRecord,
    SharesRecord,
    UnmaskRecord,
    release_from_arrays,
    round_of,
    u8,
)
from protocol import messages as wire
from protocol import secagg as sa
from protocol.errors import FedfilterError


class SessionError(sa.SecaggError):
    """A step that does not follow the session's earlier steps (unknown session, wrong order, other run)."""


def ledger_id(request: wire.Request) -> str:
    """Where the answer to ``request`` is stored: the session's step for secure aggregation, else its id."""
    if isinstance(request, wire.SecaggSharesRequest):
        return f"{request.session}|shares"
    if isinstance(request, wire.SecaggCheckRequest):
        return f"{request.session}|check"
    if isinstance(request, wire.SecaggUnmaskRequest):
        return f"{request.session}|unmask"
    secagg = getattr(request, "secagg", None)
    if isinstance(secagg, wire.SecaggInput):
        return f"{secagg.session}|masked"
    return request.request_id


def replay_reason(request: wire.Request) -> str:
    """Why a request whose step this session already answered with other content is refused."""
    if isinstance(request, wire.SecaggSharesRequest):
        return f"secagg session {request.session!r} already shared its keys for another roster; one roster per session"
    if isinstance(request, wire.SecaggCheckRequest):
        return (
            f"secagg session {request.session!r} already signed another survivor set; one set per session, "
            "or two clients could be told two sets"
        )
    if isinstance(request, wire.SecaggUnmaskRequest):
        return (
            f"secagg session {request.session!r} already answered the unmask step for another survivor set; "
            "revealing again could give both shares of one peer"
        )
    secagg = getattr(request, "secagg", None)
    if isinstance(secagg, wire.SecaggInput):
        return (
            f"secagg session {secagg.session!r} already sent its masked input for another request; "
            "two masked inputs under the same masks reveal their difference"
        )
    return f"request id {request.request_id!r} was answered before with other content; a new request needs a new id"


R = TypeVar("R", KeysRecord, SharesRecord, CheckRecord)


def _stored(
    ledger: FederationLedger, key: str, message_types: tuple[str, ...], request: wire.RequestBase, what: str
) -> ReleaseRecord:
    """The record this client stored for step ``key`` of a session, checked to be of this run and round."""
    stored: StoredRequest | None = ledger.lookup(key)
    if stored is None or stored.message_type not in message_types:
        raise SessionError(f"secagg session {key.split('|')[0]!r}: {what} was not answered by this client")
    release = release_from_arrays(stored.release)
    stored_round = round_of(release)
    if stored.run_id != request.run_id or stored_round != request.round:
        raise SessionError(
            f"secagg session {key.split('|')[0]!r}: expected run {stored.run_id!r} round "
            f"{stored_round}, got run {request.run_id!r} round {request.round}"
        )
    return release


def _step(
    ledger: FederationLedger, key: str, message_type: str, request: wire.RequestBase, what: str, record: type[R]
) -> R:
    """The ``record`` this client stored for step ``key`` of a session (:func:`_stored`)."""
    release = _stored(ledger, key, (message_type,), request, what)
    if not isinstance(release, record):
        raise SessionError(
            f"secagg session {key.split('|')[0]!r}: {what}: expected a stored {record.__name__}, "
            f"found {type(release).__name__}"
        )
    return release


def _masked_step(ledger: FederationLedger, request: wire.RequestBase, session: str) -> MaskedShares:
    """The peers' shares this client stored with its masked input (step 3) of ``session``."""
    what = "step 3 (masked input)"
    release = _stored(ledger, f"{session}|masked", wire.MESSAGE_TYPES, request, what)
    if not isinstance(release, GaussianRecord | RealisationRecord | MonitorRecord) or release.masked is None:
        raise SessionError(f"secagg session {session!r}: {what}: expected stored shares, found none")
    return release.masked


def _secrets(keys: KeysRecord) -> sa.ClientSecrets:
    return sa.ClientSecrets(keys.encryption_secret, keys.masking_secret, keys.self_seed)


@dataclass(frozen=True)
class Session:
    """A session after step 2: this client's secrets, the roster and its own index in it."""

    secrets: sa.ClientSecrets
    roster: sa.Roster
    own: int


def load_session(ledger: FederationLedger, request: wire.RequestBase, session: str) -> Session:
    """Steps 1 and 2 of ``session`` as this client answered them (a SessionError when either is missing)."""
    keys = _step(ledger, session, wire.SECAGG_KEYS, request, "step 1 (keys)", KeysRecord)
    shares = _step(ledger, f"{session}|shares", wire.SECAGG_SHARES, request, "step 2 (shares)", SharesRecord)
    roster = sa.Roster(
        request.run_id,
        request.round,
        shares.min_clients,
        shares.encryption_keys,
        shares.masking_keys,
        session=session,
        fingerprint=keys.fingerprint,
        identities=shares.identities,
        commitments=shares.commitments,
        signatures=shares.signatures,
    )
    return Session(_secrets(keys), roster, shares.own)


# --- steps 1, 2 and 4 -----------------------------------------------------------------------------


Answer = tuple[dict[str, Any], dict[str, NDArray[Any]], ReleaseRecord]  # reply config, arrays, release


def advertise(request: wire.SecaggKeysRequest, identity: bytes) -> Answer:
    """Step 1: fresh secrets for this session; the reply is public keys, the seed commitment and a signature.

    The signature binds the keys to this run, round, session and step-3 request fingerprint, under
    the owner's long-term identity key: no coordinator can forge it, nor reuse it in another session.
    """
    secrets = sa.ClientSecrets.fresh()
    signature = sa.signed_advert(
        identity,
        secrets,
        run_id=request.run_id,
        round=request.round,
        session=request.request_id,
        fingerprint=request.fingerprint,
    )
    reply = wire.SecaggKeysReply(
        request.request_id,
        request.request_id,
        u8(secrets.encryption_key),
        u8(secrets.masking_key),
        u8(secrets.commitment),
        u8(sa.identity_public_key(identity)),
        u8(signature),
    )
    release = KeysRecord(
        request.round, request.fingerprint, secrets.encryption_secret, secrets.masking_secret, secrets.self_seed
    )
    return (*reply.encode(), release)


def roster_of(request: wire.SecaggSharesRequest) -> sa.Roster:
    """The roster a step-2 request names (checked for shape here; :meth:`sa.Roster.authenticate` checks the rest)."""
    return sa.Roster(
        request.run_id,
        request.round,
        request.min_clients,
        request.encryption_keys,
        request.masking_keys,
        session=request.session,
        fingerprint=request.fingerprint,
        identities=request.identities,
        commitments=request.commitments,
        signatures=request.signatures,
    )


def share_keys(
    ledger: FederationLedger, request: wire.SecaggSharesRequest, identity: bytes, trusted: frozenset[bytes]
) -> Answer:
    """Step 2: authenticate the roster and seal this client's shares for its members.

    Refused: a fingerprint other than the one this client signed at step 1; a member whose
    identity is not in the owner's peer list, listed twice, or whose advertisement is not signed
    for this session; this client missing or listed under another identity; 2m <= n.
    """
    keys = _step(ledger, request.session, wire.SECAGG_KEYS, request, "step 1 (keys)", KeysRecord)
    secrets = _secrets(keys)
    signed = keys.fingerprint
    if request.fingerprint != signed:
        raise sa.SecaggError(
            f"secagg session {request.session!r}: the roster names request fingerprint {request.fingerprint[:16]}..., "
            f"this client signed {signed[:16]}... at step 1"
        )
    roster = roster_of(request)
    own_identity = sa.identity_public_key(identity)
    roster.authenticate(trusted | {own_identity})
    own = roster.index_of(secrets.encryption_key, secrets.masking_key)
    if roster.identities is None or roster.identities[own].tobytes() != own_identity:
        raise sa.SecaggError("roster: this client's keys are listed under another identity")
    reply = wire.SecaggSharesReply(request.request_id, request.session, sa.share_ciphertexts(secrets, roster, own))
    release = SharesRecord(
        request.round,
        own,
        request.min_clients,
        np.array(request.encryption_keys),
        np.array(request.masking_keys),
        np.array(request.identities),
        np.array(request.commitments),
        np.array(request.signatures),
    )
    return (*reply.encode(), release)


def check(ledger: FederationLedger, request: wire.SecaggCheckRequest, identity: bytes) -> Answer:
    """The consistency check: sign (session tag, U3, U2 \\ U3) once, after this client's masked input.

    Refused: no masked input from this client in this session; U3 and the dropped list not
    disjoint, not together exactly the U2 this client masked against, U3 under m or without
    this client. The signed sets are stored: the unmask step answers only for them.
    """
    session = load_session(ledger, request, request.session)
    masked = _masked_step(ledger, request, request.session)
    survivors, dropped = session.roster.check_split(
        request.survivors, request.dropped, shared=masked.peers, own=session.own
    )
    signature = sa.sign(identity, sa.check_message(session.roster.tag, survivors, dropped))
    reply = wire.SecaggCheckReply(request.request_id, request.session, u8(signature))
    release = CheckRecord(request.round, survivors, dropped)
    return (*reply.encode(), release)


def unmask(ledger: FederationLedger, request: wire.SecaggUnmaskRequest) -> Answer:
    """Step 4: for each peer of U2, the seed share if it is in U3, else the key share (never both).

    Answered only for the survivor and dropped sets this client signed in the consistency check,
    and only with at least m valid signatures of survivors over exactly those sets.
    """
    session = load_session(ledger, request, request.session)
    masked = _masked_step(ledger, request, request.session)
    signed = _step(ledger, f"{request.session}|check", wire.SECAGG_CHECK, request, "the consistency check", CheckRecord)
    peers = masked.peers
    survivors, dropped = session.roster.check_split(request.survivors, request.dropped, shared=peers, own=session.own)
    if survivors.tolist() != signed.survivors.tolist() or dropped.tolist() != signed.dropped.tolist():
        raise sa.SecaggError(
            f"secagg session {request.session!r}: the unmask step names another survivor set than the one this "
            "client signed"
        )
    session.roster.check_signatures(survivors, dropped, request.signers, request.signatures)
    opened = [
        sa.OpenedShare(
            int(src),
            sa.share_from_bytes(seed.tobytes(), what="stored seed share"),
            sa.share_from_bytes(key.tobytes(), what="stored key share"),
        )
        for src, seed, key in zip(peers, masked.seed_shares, masked.key_shares, strict=True)
    ]
    reply = wire.SecaggUnmaskReply(request.request_id, request.session, sa.reveal(opened, survivors))
    release = UnmaskRecord(request.round, survivors)
    return (*reply.encode(), release)


# --- step 3 ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskedContext:
    """Everything step 3 needs before touching data: the session, U2, the opened shares and the ranges."""

    session: Session
    request_id: str
    name: str
    scale_bits: int
    value_bound: int
    peers: NDArray[np.int64]
    opened: list[sa.OpenedShare]
    noise_std: float  # this client's share: sigma / sqrt(m)
    data_bound: int

    def shares(self) -> MaskedShares:
        """The peers' shares for step 4, stored with the charge of step 3."""
        return MaskedShares(
            self.session.roster.round,
            self.peers,
            sa.share_table([o.seed_share for o in self.opened]),
            sa.share_table([o.key_share for o in self.opened]),
            self.noise_std,
        )


def check_fingerprint(request: wire.RequestBase, roster: sa.Roster) -> None:
    """Step 3 is answered only for the request every member of the session signed at step 1.

    A coordinator that sends one client another model, other parameters or another question
    within a session (the model-inconsistency attack, Pasquini et al., CCS 2022) is refused here.
    """
    assert isinstance(request, (wire.GradientRequest, wire.IndicatorRequest, wire.MonitorRequest))
    assert request.secagg is not None
    if wire.session_fingerprint(request, request.secagg.scale_bits) != roster.fingerprint:
        raise sa.SecaggError(
            f"secagg session {roster.session!r}: this request differs from the one the session's clients signed "
            "(another model, parameters, noise, question or fixed-point scale)"
        )


def prepare_masked(
    ledger: FederationLedger,
    request: wire.RequestBase,
    secagg: wire.SecaggInput,
    *,
    noise_std: float,
    n_units: int,
    l2_clip: float,
) -> MaskedContext:
    """Check step 3's session, U2, shares and fixed-point range before any data is read.

    Every check here depends on public values only (the client's number of units is public,
    it is in its status reply): a range too small for this client's worst case is refused
    before anything is computed, so no overflow error can ever depend on the data.
    """
    session = load_session(ledger, request, secagg.session)
    roster = session.roster
    check_fingerprint(request, roster)
    peers = roster.check_peers(secagg.peers, name="U2 (clients that shared keys)", own=session.own)
    sa.check_value_bound(secagg.value_bound, roster.size)
    opened = sa.open_ciphertexts(session.secrets, roster, session.own, peers, secagg.ciphertexts)
    share_std = sa.noise_share_std(noise_std, roster.threshold)
    bound = sa.data_bound(n_units=n_units, l2_clip=l2_clip, scale_bits=secagg.scale_bits)
    need = bound + sa.noise_bound(noise_std=share_std, scale_bits=secagg.scale_bits)
    if need > secagg.value_bound:
        raise sa.SecaggError(
            f"fixed point: this client's worst case needs values up to {need} at scale 2^{secagg.scale_bits} "
            f"({n_units} units at clip {l2_clip} plus 40 noise stds); the session allows {secagg.value_bound} "
            "(lower the scale bits or the number of clients)"
        )
    if share_std * 2.0**secagg.scale_bits < sa.MIN_GRID_NOISE_STD:
        raise sa.SecaggError(
            f"fixed point: the noise share's std {share_std!r} is under {sa.MIN_GRID_NOISE_STD} grid steps at scale "
            f"2^{secagg.scale_bits}; raise the scale bits"
        )
    return MaskedContext(
        session,
        request.request_id,
        secagg.session,
        secagg.scale_bits,
        secagg.value_bound,
        peers,
        opened,
        share_std,
        bound,
    )


class DataRangeInvariantError(FedfilterError, RuntimeError):
    """The clipped data left the range its clip guarantees: a bug; reported with fixed text, nothing released."""


def masked_reply(ctx: MaskedContext, data_sum: NDArray[np.floating], rng: np.random.Generator) -> wire.MaskedInputReply:
    """Step 3: encode the clipped sum, add the noise share N(0, sigma^2 / m) on the grid, mask it.

    Privacy of the range check (the rule of commit 877f693: an error whose occurrence depends on
    private data must not leak). The data part cannot overflow: every unit's clipped norm is at
    most C, so each coordinate of the sum is at most n_units C, and :func:`sa.data_bound` adds a
    relative 1e-6 and 2 grid steps for float summation and rounding, which
    :func:`prepare_masked` checked against the session's range from public values only. If it
    fired anyway it would be a bug: it is raised as an internal error whose text is fixed
    (no value, no coordinate), before anything is committed or sent. The noise part's check
    depends on the noise alone (probability < 1e-340), so its error says nothing about data.
    """
    try:
        data = sa.encode_fixed_point(data_sum, scale_bits=ctx.scale_bits, bound=ctx.data_bound)
    except sa.FixedPointOverflow:
        raise DataRangeInvariantError("secagg: the clipped sum left its guaranteed range") from None
    noise = sa.rounded_gaussian(rng, noise_std=ctx.noise_std, scale_bits=ctx.scale_bits, size=data.size)
    masked = sa.masked_input(data + noise, ctx.session.secrets, ctx.session.roster, ctx.session.own, ctx.peers)
    return wire.MaskedInputReply(ctx.request_id, ctx.name, masked)
