"""The secure-aggregation core (protocol/secagg.py): fixed point, keys, masks, Shamir, a whole session.

Exactness: the unmasked sum equals the plain sum of the encoded inputs bit for bit, with and
without dropouts below the threshold; above it the session is refused. Privacy: what the
coordinator receives from one client is independent of that client's input (a two-sample
chi-square test, with a control without masks that the same test rejects). Refusals: every
malformed, inconsistent, replayed or wrongly keyed piece is an error naming what was wrong.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from protocol import secagg as sa

# --- a session between in-memory clients -------------------------------------------------------


@dataclass
class Session:
    clients: list[sa.ClientSecrets]
    roster: sa.Roster
    sealed: dict[int, np.ndarray]  # step 2: sender -> uint8[n, CT]

    def delivered(self, u: int, peers: np.ndarray) -> np.ndarray:
        """What the coordinator forwards to u at step 3: row u of each peer's ciphertexts."""
        return np.stack([self.sealed[v][u] for v in peers.tolist()])


def session(n: int, m: int, *, run_id: str = "run", rnd: int = 1) -> Session:
    clients = [sa.ClientSecrets.fresh() for _ in range(n)]
    roster = sa.Roster(
        run_id,
        rnd,
        m,
        np.stack([np.frombuffer(c.encryption_key, np.uint8) for c in clients]),
        np.stack([np.frombuffer(c.masking_key, np.uint8) for c in clients]),
    )
    sealed = {u: sa.share_ciphertexts(clients[u], roster, u) for u in range(n)}
    return Session(clients, roster, sealed)


def run_session(
    s: Session, inputs: dict[int, np.ndarray], *, shared: list[int], masked_from: list[int], unmask_from: list[int]
) -> np.ndarray:
    """Steps 3 and 4 with the given survivors; returns the unmasked ring sum."""
    u2 = np.array(shared, dtype=np.int64)
    opened = {u: sa.open_ciphertexts(s.clients[u], s.roster, u, u2, s.delivered(u, u2)) for u in shared}
    masked = {u: sa.masked_input(inputs[u], s.clients[u], s.roster, u, u2) for u in masked_from}
    u3 = np.array(sorted(masked), dtype=np.int64)
    revealed = {u: sa.reveal(opened[u], u3) for u in unmask_from}
    commitments = {u: c.commitment for u, c in enumerate(s.clients)}
    dim = next(iter(inputs.values())).size
    return sa.unmask_sum(s.roster, shared=u2, masked=masked, revealed=revealed, commitments=commitments, dim=dim)


def encoded_inputs(n: int, dim: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    bound = sa.value_bound_for(n)
    values = rng.normal(0.0, 3.0, (n, dim))
    values[0, 0] = (bound - 1024) / 2.0**20  # near the range's end (float spacing there is 256): the sum stays exact
    return {u: sa.encode_fixed_point(values[u], scale_bits=20, bound=bound) for u in range(n)}


# --- fixed point ----------------------------------------------------------------------------


def test_fixed_point_round_trip_and_exact_signed_sum() -> None:
    values = np.array([0.0, 1.5, -2.25, 1e-7, -3.0e6])
    enc = sa.encode_fixed_point(values, scale_bits=24, bound=sa.value_bound_for(3))
    np.testing.assert_array_equal(enc, np.rint(values * 2**24).astype(np.int64))
    # Three clients at the extremes of [-B, B]: the ring sum decodes to the exact signed sum.
    b = sa.value_bound_for(3)
    ring = sa.to_ring(np.array([b, -b, b], np.int64)) + sa.to_ring(np.array([b, -b, -b], np.int64))
    ring += sa.to_ring(np.array([b, -b, b], np.int64))
    assert ring.view(np.int64).tolist() == [3 * b, -3 * b, b]
    assert sa.decode_fixed_point(sa.to_ring(np.array([3 << 24], np.int64)), scale_bits=24).tolist() == [3.0]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (np.array([0.0, 2.0]), r"coordinate 1 encodes to 2048, outside \[-1000, 1000\] at scale 2\^10"),
        (np.array([-1.0, np.nan]), r"coordinate 1 is nan, which does not encode within \[-1000, 1000\]"),
        (np.array([np.inf]), r"coordinate 0 is inf"),
        (np.array([1e300]), r"coordinate 0 is 1e\+300"),
    ],
)
def test_fixed_point_overflow_is_an_error_not_a_wrap(values: np.ndarray, message: str) -> None:
    with pytest.raises(sa.FixedPointOverflow, match=message):
        sa.encode_fixed_point(values, scale_bits=10, bound=1000)


def test_value_bound_keeps_the_sum_of_all_clients_in_range() -> None:
    for n in (1, 2, 3, 10, 100, 1000):
        assert n * sa.value_bound_for(n) <= 2**63 - 1 < n * (sa.value_bound_for(n) + 1)
    with pytest.raises(sa.SecaggError, match=r"10 clients with values up to .* could wrap the 64-bit sum"):
        sa.check_value_bound(sa.value_bound_for(10) + 1, 10)


def test_data_and_noise_bounds() -> None:
    # 100 units at clip 1, scale 2^20: |sum_u v(u)_j| <= n C, so at most 100 * 2^20 per coordinate, plus a relative
    # 1e-6 (float64 summation error, n 2^-53 < 1e-6 for n < 10^9) and 2 grid steps (rounding to the grid: 1/2).
    assert sa.data_bound(n_units=100, l2_clip=1.0, scale_bits=20) == int(np.ceil(100 * 2**20 * (1 + 1e-6))) + 2
    # A 40-sigma tail (P(|N(0, 1)| > 40) < 1e-340): 40 * 0.5 * 2^4 steps, + 1.
    assert sa.noise_bound(noise_std=0.5, scale_bits=4) == 40 * 8 + 1
    assert sa.rounding_slack(10_000, 10) == pytest.approx(100 / 1024)  # sqrt(d) / 2^k
    assert sa.noise_share_std(6.0, 4) == pytest.approx(3.0)  # sigma / sqrt(m)
    with pytest.raises(sa.SecaggError, match="min_clients: expected an integer >= 2, got 1"):
        sa.noise_share_std(1.0, 1)
    with pytest.raises(sa.SecaggError, match=r"expected >= 256.0 \(raise secagg scale bits\)"):
        sa.rounded_gaussian(np.random.default_rng(0), noise_std=1.0, scale_bits=4, size=3)


def test_rounded_gaussian_share_has_the_right_variance() -> None:
    # 200,000 draws at std 0.5 on a 2^20 grid: the sample variance is within 2% of 0.25 (its relative sd is
    # sqrt(2 / (n - 1)) = 0.3% for a normal sample, so 2% is over 6 sd; seeded, hence reproducible).
    draws = sa.rounded_gaussian(np.random.default_rng(1), noise_std=0.5, scale_bits=20, size=200_000)
    assert np.var(draws / 2**20) == pytest.approx(0.25, rel=0.02)


# --- keys and masks -------------------------------------------------------------------------


def test_key_agreement_is_symmetric_and_refuses_bad_keys() -> None:
    a_sk, a_pk = sa.generate_keypair()
    b_sk, b_pk = sa.generate_keypair()
    assert sa.agree(a_sk, b_pk, what="b") == sa.agree(b_sk, a_pk, what="a")
    tag = bytes(32)
    assert sa.pairwise_seed(a_sk, b_pk, tag=tag, u=0, v=1) == sa.pairwise_seed(b_sk, a_pk, tag=tag, u=1, v=0)
    assert sa.pairwise_seed(a_sk, b_pk, tag=tag, u=0, v=1) != sa.pairwise_seed(a_sk, b_pk, tag=b"\1" * 32, u=0, v=1)
    with pytest.raises(sa.SecaggError, match="masking key of peer 3: not a usable X25519 public key"):
        sa.pairwise_seed(a_sk, bytes(32), tag=tag, u=0, v=3)  # the all-zero point: low order
    with pytest.raises(sa.SecaggError, match="encryption key of peer 2: expected 32 bytes, got 31 bytes"):
        sa.agree(a_sk, b_pk[:31], what="encryption key of peer 2")


def test_mask_expansion_is_deterministic_uniform_and_seed_specific() -> None:
    seed = bytes(range(32))
    mask = sa.expand_mask(seed, 100_000)
    assert mask.dtype == np.uint64 and mask.shape == (100_000,)
    np.testing.assert_array_equal(mask, sa.expand_mask(seed, 100_000))
    np.testing.assert_array_equal(mask[:10], sa.expand_mask(seed, 10))  # a prefix of the same stream
    assert not np.array_equal(mask[:1000], sa.expand_mask(bytes(31) + b"\1", 1000))
    # Top byte uniform over 256 bins: chi-square goodness of fit, p > 1e-4 (fails 1 time in 10,000 if uniform).
    counts = np.bincount((mask >> np.uint64(56)).astype(np.int64), minlength=256)
    assert chisquare(counts).pvalue > 1e-4


# --- Shamir ---------------------------------------------------------------------------------


def test_shamir_reconstructs_from_any_threshold_subset() -> None:
    rng = np.random.default_rng(3)
    secret = int.from_bytes(bytes(rng.integers(0, 256, 32, dtype=np.uint8)), "little")
    shares = sa.shamir_split(secret, threshold=4, n=7)
    for _ in range(10):
        xs = sorted(rng.choice(np.arange(1, 8), size=int(rng.integers(4, 8)), replace=False).tolist())
        assert sa.shamir_reconstruct({x: shares[x - 1] for x in xs}, threshold=4) == secret
    with pytest.raises(sa.SecaggError, match="shamir: expected at least 4 shares, got 3"):
        sa.shamir_reconstruct({1: shares[0], 2: shares[1], 3: shares[2]}, threshold=4)
    # A wrong share gives another secret (caught upstream by the commitment and key checks).
    bad = {x: shares[x - 1] for x in (1, 2, 3, 4)} | {2: (shares[1] + 1) % sa.FIELD_PRIME}
    assert sa.shamir_reconstruct(bad, threshold=4) != secret
    assert sa.share_from_bytes(sa.share_to_bytes(shares[0]), what="s") == shares[0]
    with pytest.raises(sa.SecaggError, match="not an element of GF"):
        sa.share_from_bytes(b"\xff" * sa.SHARE_BYTES, what="s")
    with pytest.raises(sa.SecaggError, match="expected a 66-byte share, got 65 bytes"):
        sa.share_from_bytes(b"\0" * 65, what="s")


def test_fewer_than_threshold_shares_are_independent_of_the_secret() -> None:
    """With threshold 2, one share f(1) = secret + a (a uniform in the field) is uniform whatever the secret.

    2,000 splits each of secret 0 and secret 2^256 - 1; the low byte of share 1 in 256 bins;
    chi-square test of homogeneity, H0 kept at p > 1e-4. The coefficients come from a seeded
    uniform source (``random.Random.randrange``, in place of the default ``secrets.randbelow``),
    so the test is reproducible instead of failing 1 time in 10,000.
    """
    draw = random.Random(5).randrange
    low = {
        secret: [sa.shamir_split(secret, threshold=2, n=3, randbelow=draw)[0] & 0xFF for _ in range(2000)]
        for secret in (0, 2**256 - 1)
    }
    table = np.stack([np.bincount(v, minlength=256) for v in low.values()])
    assert chi2_contingency(table).pvalue > 1e-4


# --- a whole session ------------------------------------------------------------------------


def test_unmasked_sum_equals_the_plain_sum_exactly() -> None:
    s = session(5, 3)
    inputs = encoded_inputs(5, 257)
    everyone = list(range(5))
    total = run_session(s, inputs, shared=everyone, masked_from=everyone, unmask_from=everyone)
    np.testing.assert_array_equal(total.view(np.int64), sum(inputs.values()))


@pytest.mark.parametrize(
    ("shared", "masked_from", "unmask_from"),
    [
        ([0, 1, 2, 3, 4, 5], [0, 2, 3, 5], [0, 2, 3, 5]),  # two drop after sharing (their masks are removed)
        ([0, 1, 3, 4, 5], [0, 1, 3, 4, 5], [0, 3, 5]),  # one never shares; two survivors do not help unmask
        ([1, 2, 3, 4, 5], [1, 2, 4, 5], [1, 4, 5]),  # dropouts at every step, at the threshold
    ],
)
def test_dropouts_below_the_threshold_are_recovered(
    shared: list[int], masked_from: list[int], unmask_from: list[int]
) -> None:
    s = session(6, 3)
    inputs = encoded_inputs(6, 64, seed=1)
    total = run_session(s, inputs, shared=shared, masked_from=masked_from, unmask_from=unmask_from)
    np.testing.assert_array_equal(total.view(np.int64), sum(inputs[u] for u in masked_from))


def test_dropouts_above_the_threshold_release_nothing() -> None:
    s = session(6, 4)
    inputs = encoded_inputs(6, 16)
    with pytest.raises(sa.SecaggError, match=r"U3 \(masked inputs received\): 3 clients, fewer than .* m = 4"):
        run_session(s, inputs, shared=list(range(6)), masked_from=[0, 1, 2], unmask_from=[0, 1, 2])
    with pytest.raises(sa.SecaggError, match="U4: 3 clients answered the unmask step, fewer than the threshold m = 4"):
        run_session(s, inputs, shared=list(range(6)), masked_from=[0, 1, 2, 3], unmask_from=[0, 1, 2])
    u2 = np.array([0, 1, 2], np.int64)
    with pytest.raises(sa.SecaggError, match=r"U2: 3 clients, fewer than the session's minimum m = 4"):
        s.roster.check_peers(u2, name="U2")


def test_masked_input_is_independent_of_the_input() -> None:
    """Two-sample chi-square test of homogeneity on the top byte of what the coordinator receives.

    Client 0 of a 3-client session holds input A (all zeros) or input B (all 2^62 - 1, the far
    end of the ring) in 400 fresh sessions each; each session's masked input has 64 coordinates,
    so each sample has 25,600 values in 256 bins. H0 (same distribution) is kept at p > 1e-4
    (a false alarm 1 time in 10,000). The control applies the same test to the unmasked encodings:
    it must reject at p < 1e-12.
    """
    dim, draws = 64, 400
    inputs = {"A": np.zeros(dim, np.int64), "B": np.full(dim, 2**62 - 1, np.int64)}
    received: dict[str, list[np.ndarray]] = {"A": [], "B": []}
    for label, x in inputs.items():
        for _ in range(draws):
            s = session(3, 2)
            received[label].append(sa.masked_input(x, s.clients[0], s.roster, 0, np.arange(3, dtype=np.int64)))

    def top_byte_histogram(values: np.ndarray) -> np.ndarray:
        return np.bincount((values >> np.uint64(56)).astype(np.int64), minlength=256)

    table = np.stack([top_byte_histogram(np.concatenate(received[k])) for k in ("A", "B")])
    assert chi2_contingency(table).pvalue > 1e-4
    control = np.stack([top_byte_histogram(np.tile(sa.to_ring(inputs[k]), draws)) for k in ("A", "B")])
    control = control[:, control.sum(axis=0) > 0]
    assert chi2_contingency(control).pvalue < 1e-12


# --- refusals -------------------------------------------------------------------------------


def test_tampered_replayed_and_misrouted_ciphertexts_are_refused() -> None:
    s = session(4, 3)
    u2 = np.arange(4, dtype=np.int64)
    rows = s.delivered(1, u2)
    tampered = rows.copy()
    tampered[2, 40] ^= 1
    with pytest.raises(sa.SecaggError, match="share from peer 2 to 1: does not authenticate for this session"):
        sa.open_ciphertexts(s.clients[1], s.roster, 1, u2, tampered)
    swapped = rows.copy()
    swapped[[0, 3]] = swapped[[3, 0]]  # peer 3's ciphertext presented as peer 0's
    with pytest.raises(sa.SecaggError, match="share from peer 0 to 1: does not authenticate"):
        sa.open_ciphertexts(s.clients[1], s.roster, 1, u2, swapped)
    other_pair = s.delivered(2, u2)  # meant for client 2
    with pytest.raises(sa.SecaggError, match="share from peer 0 to 1: does not authenticate"):
        sa.open_ciphertexts(s.clients[1], s.roster, 1, u2, other_pair)
    # Replay from another session with the same clients and keys: the session tag differs (round 2).
    later = replace(s.roster, round=2)
    with pytest.raises(sa.SecaggError, match="does not authenticate for this session"):
        sa.open_ciphertexts(s.clients[1], later, 1, u2, rows)
    # Wrong key material: another client's secrets cannot open client 1's shares.
    with pytest.raises(sa.SecaggError, match="does not authenticate"):
        sa.open_ciphertexts(s.clients[2], s.roster, 1, u2, rows)
    width = sa.CIPHERTEXT_BYTES
    with pytest.raises(sa.SecaggError, match=rf"expected uint8\[4, {width}\] \(one per peer\), got \(3, {width}\)"):
        sa.open_ciphertexts(s.clients[1], s.roster, 1, u2, rows[:3])
    assert len(sa.open_ciphertexts(s.clients[1], s.roster, 1, u2, rows)) == 4


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda enc, mask: (enc[:, :31], mask), r"encryption_keys: expected uint8\[n, 32\], got uint8\(4, 31\)"),
        (lambda enc, mask: (enc, mask[:3]), "expected as many masking keys as encryption keys"),
        (lambda enc, mask: (np.concatenate([enc[:3], enc[:1]]), mask), "expected every public key to be distinct"),
        (lambda enc, mask: (enc[:1], mask[:1]), "roster: expected between 2 and 65536 clients, got 1"),
    ],
)
def test_bad_rosters_are_refused(mutate: object, message: str) -> None:
    s = session(4, 3)
    enc, mask = mutate(s.roster.encryption_keys, s.roster.masking_keys)  # type: ignore[operator]
    with pytest.raises(sa.SecaggError, match=message):
        sa.Roster("run", 1, 2, enc, mask)


def test_roster_checks_threshold_membership_and_peer_lists() -> None:
    s = session(4, 3)
    with pytest.raises(sa.SecaggError, match=r"threshold: expected 2 <= m <= 4 \(the roster's size\), got 5"):
        replace(s.roster, threshold=5)
    stranger = sa.ClientSecrets.fresh()
    with pytest.raises(sa.SecaggError, match="expected this client's advertised keys exactly once"):
        s.roster.index_of(stranger.encryption_key, stranger.masking_key)
    with pytest.raises(sa.SecaggError, match=r"expected strictly increasing indices in \[0, 4\), got \[0, 2, 2\]"):
        s.roster.check_peers(np.array([0, 2, 2], np.int64), name="U2")
    with pytest.raises(sa.SecaggError, match="expected this client's index 1 among them"):
        s.roster.check_peers(np.array([0, 2, 3], np.int64), name="U2", own=1)
    with pytest.raises(sa.SecaggError, match="expected an int64 list of roster indices, got float64"):
        s.roster.check_peers(np.array([0.0, 1.0, 2.0]), name="U2")


def test_inconsistent_shares_and_double_reveals_are_refused() -> None:
    s = session(5, 3)
    inputs = encoded_inputs(5, 8)
    u2 = np.arange(5, dtype=np.int64)
    opened = {u: sa.open_ciphertexts(s.clients[u], s.roster, u, u2, s.delivered(u, u2)) for u in range(5)}
    masked = {u: sa.masked_input(inputs[u], s.clients[u], s.roster, u, u2) for u in (0, 1, 2, 3)}
    u3 = np.array([0, 1, 2, 3], np.int64)
    commitments = {u: c.commitment for u, c in enumerate(s.clients)}

    def unmask(revealed: dict[int, sa.Revealed]) -> np.ndarray:
        return sa.unmask_sum(s.roster, shared=u2, masked=masked, revealed=revealed, commitments=commitments, dim=8)

    good = {u: sa.reveal(opened[u], u3) for u in (0, 1, 2)}
    np.testing.assert_array_equal(unmask(good).view(np.int64), sum(inputs[u] for u in range(4)))

    seed_tampered = dict(good)
    shares = good[0].seed_shares.copy()
    shares[1, 0] ^= 1  # client 0's share of client 1's seed
    seed_tampered[0] = replace(good[0], seed_shares=shares)
    with pytest.raises(
        sa.SecaggError, match="client 1: the reconstructed self-mask seed does not match its commitment"
    ):
        unmask(seed_tampered)

    key_tampered = dict(good)
    keys = good[2].key_shares.copy()
    keys[0, 5] ^= 1  # client 2's share of the dropped client 4's masking key
    key_tampered[2] = replace(good[2], key_shares=keys)
    with pytest.raises(sa.SecaggError, match="dropped client 4: the reconstructed masking key does not match"):
        unmask(key_tampered)

    # A responder that reveals the seed share of the dropped client 4 as well (both shares of one peer).
    both = dict(good)
    everyone = sa.reveal(opened[1], u2)
    both[1] = replace(good[1], seed_peers=everyone.seed_peers, seed_shares=everyone.seed_shares)
    with pytest.raises(sa.SecaggError, match=r"unmask answer of client 1: expected seed shares for U3 \[0, 1, 2, 3\]"):
        unmask(both)

    with pytest.raises(sa.SecaggError, match=r"U4: expected responders among the survivors U3, found \[4\]"):
        unmask(good | {4: sa.reveal(opened[4], u3)})
    with pytest.raises(sa.SecaggError, match=r"masked input of client 0: expected uint64\[8\], got uint64\(7,\)"):
        sa.unmask_sum(
            s.roster,
            shared=u2,
            masked=masked | {0: masked[0][:7]},
            revealed=good,
            commitments=commitments,
            dim=8,
        )


def test_reveal_gives_one_share_per_peer() -> None:
    s = session(4, 2)
    u2 = np.arange(4, dtype=np.int64)
    opened = sa.open_ciphertexts(s.clients[0], s.roster, 0, u2, s.delivered(0, u2))
    r = sa.reveal(opened, np.array([0, 2], np.int64))
    assert r.seed_peers.tolist() == [0, 2] and r.key_peers.tolist() == [1, 3]
    assert r.seed_shares.shape == (2, sa.SHARE_BYTES) and r.key_shares.shape == (2, sa.SHARE_BYTES)
