"""The coordinator's side of a secure-aggregation session (``secagg`` trust): four exchanges, one sum.

One release in secagg trust is one session of protocol/secagg.py over the ordinary
:class:`coordinator.transport.Transport` (one request per node per exchange, replies by
node), so the in-process transport and Flower's grid both carry it. :class:`SecaggRelease`
wraps every release of a run (the round's, the plateau count's, the tree monitor's) this way;
the round loop holds it as its release step (coordinator/release.py) and never asks the trust:

1. ``query.secagg_keys`` to every node, with the fingerprint of the step-3 request: public keys,
   seed commitments, identities and signed advertisements; U1 (roster order: node id).
2. ``query.secagg_shares`` to U1 with the signed roster and m: each authenticates it and answers
   sealed shares, one per roster index; U2.
3. the round's request (gradient, indicator or monitor) with trust 'secagg' to U2, each carrying
   the shares addressed to it: each answers its masked input; U3.
4a. ``query.secagg_check`` to U3 with U3 and U2 \\ U3: each signs them (the consistency check); U4.
4b. ``query.secagg_unmask`` to U4 with U3, U2 \\ U3 and the signatures of U4: each answers one
   share per peer of U2; U5.

The coordinator reconstructs the self-mask seeds of U3 and the masking keys of U2 \\ U3 and
learns sum_{U3} (x_u + noise share) and nothing else. Any step with fewer than m clients,
or shares that do not reconstruct to the committed seeds and advertised keys, ends the
session with nothing released (:attr:`SecaggRound.total` is None). The clients have then
charged their filters already if they sent masked inputs: an over-count, never an under-count.

Privacy: the sum carries noise of variance |U3| sigma^2 / m >= sigma^2, the noise every
client's charge assumed, provided that at least m of the summed clients are honest (their
noise shares are unknown to the coordinator). The clients' checks (client_agent/secagg_client.py)
hold this against a coordinator that deviates, too (Bonawitz et al. 2017, Sec. 6.2): this
module is the honest coordinator's side, and tests/adversarial_secagg.py the deviating one's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.monitor import Reports
from coordinator.release import Ask, Released, monitor_request, request_noise_std
from coordinator.transport import RoundReplies, Transport
from protocol import messages as wire
from protocol import secagg as sa
from protocol.records import Payload

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig

BuildRequest = Callable[[int, wire.SecaggInput | None], wire.Request]


@dataclass(frozen=True)
class SecaggSettings:
    """A run's secure-aggregation parameters, fixed at enrolment (public)."""

    min_clients: int  # m: the Shamir threshold, the noise divisor, the fewest inputs a sum may hold
    scale_bits: int  # fixed point: values are encoded as rint(v 2^scale_bits)
    monitor_noise_std: float = 0.0  # tree monitor: the smallest node noise std the clients reserved
    monitor_levels: int = 0  # tree monitor: the levels every client reports (the same for all)


def default_min_clients(clients: int) -> int:
    """m = max(2, ceil(2 n / 3)): a third of the clients may drop out of a session (SecAgg+'s usual choice)."""
    return max(sa.MIN_CLIENTS, math.ceil(2 * clients / 3))


@dataclass
class SecaggRound:
    """What one session gave: the masked step's replies, every step's errors, the sum or None."""

    replies: RoundReplies
    total: np.ndarray | None = None  # the decoded sum of U3's inputs; None: nothing was released
    noise_var: float = 0.0  # |U3| sigma^2 / m
    counts: dict[str, Any] = field(default_factory=dict)  # clients left after each step, and why it aborted


def _merge(into: RoundReplies, got: RoundReplies, prefix: str) -> None:
    for name, count in got.errors.items():
        into.errors[prefix + name] += count


def _advert_signed(reply: wire.SecaggKeysReply, run_id: str, rnd: int, session: str, fingerprint: str) -> bool:
    """Whether a keys reply's advertisement is signed by the identity it names, for this session."""
    message = sa.advert_message(
        run_id=run_id,
        round=rnd,
        session=session,
        fingerprint=fingerprint,
        encryption_key=reply.encryption_key.tobytes(),
        masking_key=reply.masking_key.tobytes(),
        commitment=reply.seed_commitment.tobytes(),
    )
    return sa.signature_valid(reply.identity.tobytes(), message, reply.signature.tobytes())


def secagg_release(
    transport: Transport,
    *,
    run_id: str,
    rnd: int,
    purpose: str,
    nodes: Sequence[int],
    settings: SecaggSettings,
    kind: str,
    build: BuildRequest,
    size: int,
    noise_std: float,
    timeout: float,
) -> SecaggRound:
    """One session: ``build(node, secagg_input)`` makes each node's step-3 request; ``size`` values per input."""
    m = settings.min_clients
    out = SecaggRound(RoundReplies())
    errors: Counter[str] = out.replies.errors

    def abort(reason: str) -> SecaggRound:
        """End the session; ``reason`` is the coordinator's own text (counts and m only, never a client's text)."""
        out.counts["aborted"] = reason
        errors["secagg-aborted"] += 1
        return out

    def rid(step: str) -> str:
        return f"{run_id}:{purpose}:{step}:r{rnd}"

    session = rid("keys")  # the keys request's id names the session, on every client alike

    def decoded(got: RoundReplies, asked: Sequence[int], name: str, decode: Callable[..., Any]) -> dict[int, Any]:
        """The replies of ``asked`` that decode and belong to this session; the others counted under ``name``."""
        ok: dict[int, Any] = {}
        for node in asked:
            if node not in got.replies:
                continue
            try:
                reply = decode(*got.replies[node])
            except wire.ProtocolError:
                out.replies.error(name)
                continue
            if reply.session != session:  # a reply for another session
                out.replies.error(name)
                continue
            ok[node] = reply
        return ok

    # 1. keys, bound to the one step-3 request every client of the session will be asked
    template = build(nodes[0], None)
    assert isinstance(template, (wire.GradientRequest, wire.IndicatorRequest, wire.MonitorRequest))
    fingerprint = wire.session_fingerprint(template, settings.scale_bits)
    keys_request = wire.SecaggKeysRequest(session, run_id, rnd, "secagg", fingerprint)
    got = transport.send(wire.SECAGG_KEYS, {n: wire.encode_request(keys_request) for n in nodes}, timeout=timeout)
    _merge(out.replies, got, "secagg-keys-")
    keys: dict[int, wire.SecaggKeysReply] = decoded(
        got, nodes, "secagg-keys-malformed-reply", wire.SecaggKeysReply.decode
    )
    seen = Counter(bytes(r.encryption_key) for r in keys.values()) + Counter(
        bytes(r.masking_key) for r in keys.values()
    )
    seen += Counter(bytes(r.identity) for r in keys.values())
    for node in [
        n
        for n, r in keys.items()
        if seen[bytes(r.encryption_key)] > 1 or seen[bytes(r.masking_key)] > 1 or seen[bytes(r.identity)] > 1
    ]:
        out.replies.error("secagg-keys-duplicate")  # a key or identity advertised by more than one client
        del keys[node]
    for node in [n for n, r in keys.items() if not _advert_signed(r, run_id, rnd, session, fingerprint)]:
        out.replies.error("secagg-keys-bad-signature")  # the clients would refuse a roster holding it
        del keys[node]
    u1 = sorted(keys)
    out.counts["advertised"] = len(u1)
    if len(u1) < m:
        return abort(f"{len(u1)} clients advertised keys, fewer than m = {m}")
    enc = np.stack([keys[n].encryption_key for n in u1])
    mask = np.stack([keys[n].masking_key for n in u1])
    signed: dict[str, Any] = {
        "fingerprint": fingerprint,
        "identities": np.stack([keys[n].identity for n in u1]),
        "commitments": np.stack([keys[n].seed_commitment for n in u1]),
        "signatures": np.stack([keys[n].signature for n in u1]),
    }
    roster = sa.Roster(run_id, rnd, m, enc, mask, session=session, **signed)

    # 2. shares
    shares_request = wire.SecaggSharesRequest(rid("shares"), run_id, rnd, "secagg", session, m, enc, mask, **signed)
    got = transport.send(wire.SECAGG_SHARES, {n: wire.encode_request(shares_request) for n in u1}, timeout=timeout)
    _merge(out.replies, got, "secagg-shares-")
    shares = decoded(
        got, u1, "secagg-shares-malformed-reply", partial(wire.SecaggSharesReply.decode, roster_size=roster.size)
    )
    sealed: dict[int, np.ndarray] = {i: shares[node].ciphertexts for i, node in enumerate(u1) if node in shares}
    u2 = np.array(sorted(sealed), dtype=np.int64)
    out.counts["shared"] = int(u2.size)
    if u2.size < m:
        return abort(f"{u2.size} clients shared keys, fewer than m = {m}")

    # 3. masked inputs
    bound = sa.value_bound_for(roster.size)
    payloads: dict[int, Payload] = {}
    for i in u2.tolist():
        node = u1[i]
        secagg = wire.SecaggInput(
            session=session,
            scale_bits=settings.scale_bits,
            value_bound=bound,
            peers=u2,
            ciphertexts=np.stack([sealed[v][i] for v in u2.tolist()]),
        )
        payloads[node] = wire.encode_request(build(node, secagg))
    got = transport.send(kind, payloads, timeout=timeout)
    _merge(out.replies, got, "")
    out.replies.missing = got.missing
    inputs = decoded(
        got, [u1[i] for i in u2.tolist()], "malformed-reply", partial(wire.MaskedInputReply.decode, size=size)
    )
    masked: dict[int, np.ndarray] = {i: inputs[u1[i]].masked for i in u2.tolist() if u1[i] in inputs}
    out.replies.replies.update({node: got.replies[node] for node in inputs})
    u3 = np.array(sorted(masked), dtype=np.int64)
    out.counts["masked"] = int(u3.size)
    if u3.size < m:
        return abort(f"{u3.size} masked inputs arrived, fewer than m = {m}")

    # 4a. consistency check: every survivor signs (U3, U2 \\ U3) as it was told them
    dropped_arr = np.array(sorted(set(u2.tolist()) - set(u3.tolist())), dtype=np.int64)
    check_request = wire.SecaggCheckRequest(rid("check"), run_id, rnd, "secagg", session, u3, dropped_arr)
    got = transport.send(
        wire.SECAGG_CHECK, {u1[i]: wire.encode_request(check_request) for i in u3.tolist()}, timeout=timeout
    )
    _merge(out.replies, got, "secagg-check-")
    checks = decoded(got, [u1[i] for i in u3.tolist()], "secagg-check-malformed-reply", wire.SecaggCheckReply.decode)
    message = sa.check_message(roster.tag, u3, dropped_arr)
    assert roster.identities is not None
    signatures: dict[int, np.ndarray] = {}
    for i in u3.tolist():
        if u1[i] not in checks:
            continue
        if not sa.signature_valid(roster.identities[i].tobytes(), message, checks[u1[i]].signature.tobytes()):
            out.replies.error("secagg-check-bad-signature")
            continue
        signatures[i] = checks[u1[i]].signature
    u4 = np.array(sorted(signatures), dtype=np.int64)
    out.counts["checked"] = int(u4.size)
    if u4.size < m:
        return abort(f"{u4.size} clients signed the survivor set, fewer than m = {m}")

    # 4b. unmask
    unmask_request = wire.SecaggUnmaskRequest(
        rid("unmask"),
        run_id,
        rnd,
        "secagg",
        session,
        u3,
        dropped_arr,
        u4,
        np.stack([signatures[i] for i in u4.tolist()]),
    )
    got = transport.send(
        wire.SECAGG_UNMASK, {u1[i]: wire.encode_request(unmask_request) for i in u4.tolist()}, timeout=timeout
    )
    _merge(out.replies, got, "secagg-unmask-")
    answers = decoded(got, [u1[i] for i in u4.tolist()], "secagg-unmask-malformed-reply", wire.SecaggUnmaskReply.decode)
    dropped = dropped_arr.tolist()
    revealed: dict[int, sa.Revealed] = {}
    for i in u4.tolist():
        if u1[i] not in answers:
            continue
        r = answers[u1[i]].revealed
        if r.seed_peers.tolist() != u3.tolist() or r.key_peers.tolist() != dropped:
            out.replies.error("secagg-unmask-malformed-reply")  # shares for other peers than U3 and U2 \ U3
            continue
        revealed[i] = r
    out.counts["unmasked"] = len(revealed)
    if len(revealed) < m:
        return abort(f"{len(revealed)} clients answered the unmask step, fewer than m = {m}")
    try:
        ring = sa.unmask_sum(
            roster,
            shared=u2,
            masked=masked,
            revealed=revealed,
            commitments={i: keys[u1[i]].seed_commitment.tobytes() for i in u3.tolist()},
            dim=size,
        )
    except sa.SecaggError:
        # Its text names a client's roster index and what its reply held: per-client detail, never logged.
        return abort("the unmask step failed a consistency check (shares, commitments or masked inputs)")
    out.total = sa.decode_fixed_point(ring, scale_bits=settings.scale_bits)
    out.noise_var = float(u3.size) * noise_std**2 / m
    return out


class SecaggRelease:
    """The release step of a secagg run: each release is one session; a session that aborts releases nothing.

    An aborted session leaves the release's total at None: the round takes no step and answers
    nothing, the plateau count reads as NaN, and the tree monitor's nodes of that round stay at 0.
    """

    def __init__(self, transport: Transport, cfg: CoordinatorConfig, nodes: list[int], settings: SecaggSettings):
        self.transport, self.cfg, self.nodes, self.settings = transport, cfg, nodes, settings

    def _session(self, ask: Ask, noise_std: float) -> SecaggRound:
        return secagg_release(
            self.transport,
            run_id=self.cfg.wire_run_id,
            rnd=ask.rnd,
            purpose=ask.purpose,
            nodes=self.nodes,
            settings=self.settings,
            kind=ask.kind,
            build=lambda node, secagg: ask.build(secagg),
            size=ask.size,
            noise_std=noise_std,
            timeout=self.cfg.round_timeout,
        )

    def release(self, ask: Ask) -> Released:
        # Each client adds its share of the request's own noise (an accuracy check has its own).
        masked = self._session(ask, request_noise_std(ask.build(None)))
        # Complete: the sum holds every enrolled node's masked input (a node lost at any step is not in it).
        complete = masked.total is not None and masked.counts.get("masked") == len(self.nodes)
        return Released(
            masked.replies, Counter(masked.replies.errors), masked.total, masked.noise_var, masked.counts, complete
        )

    def reports(self, rnd: int) -> Reports:
        """The tree monitor's reports summed in one session, at the node noise std every client reserved."""
        noise_std = self.settings.monitor_noise_std
        ask = Ask(
            rnd,
            "monitor",
            wire.MONITOR,
            partial(monitor_request, self.cfg, rnd, noise_std=noise_std),
            self.settings.monitor_levels,
        )
        masked = self._session(ask, noise_std)
        summed = [] if masked.total is None else [(masked.total, math.sqrt(masked.noise_var))]
        return Reports(summed, asked=len(self.nodes), errors=Counter(masked.replies.errors))
