"""Secure aggregation with distributed Gaussian noise: the pure cryptographic core of ``secagg`` trust.

The protocol is SecAgg (Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving
Machine Learning", CCS 2017, Fig. 4) in its active-adversary form (Sec. 6.2: signed
advertisements under a PKI, a consistency check of the survivor set), with the key agreement,
key derivation and stream cipher of SecAgg+ (Bell et al., "Secure Single-Server Aggregation
with (Poly)Logarithmic Overhead", CCS 2020): X25519, HKDF-SHA256, ChaCha20; signatures are
Ed25519. One *session* is one masked sum over the clients of a round:

1. advertise: client u draws two X25519 key pairs (c_u for encrypting shares, s_u for
   pairwise masks) and a self-mask seed b_u; it sends the public keys and SHA-256(b_u),
   signed with its long-term identity key together with the run, round, session id and the
   fingerprint of the step-3 request (:func:`advert_message`).
2. share keys: given the roster U1 (every advertised key pair, index i = position), u checks
   it (:meth:`Roster.authenticate`: trusted identities, valid signatures, 2m > n), then
   Shamir-shares b_u and the secret of s_u with threshold m among |U1| (x = index + 1) and
   sends peer v its two shares, encrypted with ChaCha20-Poly1305 under a key derived from
   X25519(c_u, c_v) and bound to the session tag and the ordered pair (u, v).
3. masked input: given U2 (those who shared) and the ciphertexts addressed to u, u sends
   y_u = x_u + PRG(b_u) + sum_{v in U2, v != u} sign(u, v) PRG(s_uv)  (mod 2^64),
   sign = +1 when u < v, -1 otherwise, s_uv = HKDF(X25519(s_u, s_v)); pairwise masks of
   two survivors cancel in the sum. Only for the request whose fingerprint it signed.
3b. consistency check: given U3 and U2 \\ U3 (disjoint, together its U2, |U3| >= m), u signs
   them (:func:`check_message`), once per session.
4. unmask: given U3, U2 \\ U3 and at least m survivors' signatures over them
   (:meth:`Roster.check_signatures`), u reveals, for each v in U2, its share of b_v if v is
   in U3 and its share of s_v's secret otherwise, never both (the caller keeps that rule
   across crashes: one unmask answer per session, for the set it signed). The server
   reconstructs, removes the self masks of U3 and the pairwise masks between U3 and U2 \\ U3,
   and learns sum_{u in U3} x_u and nothing else. Each honest client signs one set and
   2m > n, so no two survivor sets gather m signatures each: no peer's two secrets are
   ever both revealed.

Distributed noise: each client adds its share N(0, sigma^2 / m) (rounded to the fixed-point
grid) to its input, so a sum over at least m clients carries Gaussian noise of variance at
least sigma^2 (privacy.md §2, ``secagg`` trust). m is also the Shamir threshold and the
smallest number of masked inputs a session accepts: a session with fewer survivors
releases nothing.

Fixed point (the ring Z_{2^64}): a value v is encoded as rint(v 2^k) and must lie within
[-B, B] with n B < 2^63 for the n clients of the session, so the signed sum never wraps.
A value outside its range is an error (:class:`FixedPointOverflow`), never a wrap-around.
Rounding the client's sum to the grid moves it by at most 1/2 per coordinate, hence the
clipped contribution of one unit moves the encoded sum by at most
2^k ||v|| + sqrt(d) in L2 (each coordinate's two rounding errors differ by less than 1):
the agent charges ||v|| + :func:`rounding_slack` (sqrt(d) / 2^k) instead of ||v||. The
noise is the Gaussian rounded to the grid, with grid std s >= :data:`MIN_GRID_NOISE_STD`.
This is an approximation, stated here: P(k) = integral of the N(0, s^2) density over
[k - 1/2, k + 1/2] = phi(k) (1 + (k^2/s^2 - 1) / (24 s^2) + ...), so its probabilities differ
from the discrete Gaussian N_Z(0, s^2)'s (for which the Gaussian mechanism's zCDP holds with
the continuous formula, Canonne, Kamath & Steinke 2020, Thm 4 and 14; sums of such shares are
close to N_Z of the summed variance, Kairouz, Liu & Steinke 2021) by a relative
(k^2/s^2 - 1) / (24 s^2): under 1e-4 within 10 standard deviations at s >= 256, the same order
as the floating-point idealisation of every other release in this project.

Flower's ``flwr.common.secure_aggregation`` is reused where it fits: its share plaintext
layout (``share_keys_plaintext_concat``/``_separate``). Not reused, and why: its
``pseudo_rand_gen`` folds the seed to 32 bits and draws from Mersenne Twister (a mask could
be found by trying 2^32 seeds); its ``quantize`` clips silently (here an out-of-range value
is an error); its Shamir works over GF(2^128) through PyCryptodome with padding, where this
module shares one element of the prime field GF(2^521 - 1) per secret.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

# cryptography and Flower are imported by the functions that use them, so that importing this module
# (and protocol.messages, which reads its constants and checks) loads neither.
from numpy.typing import NDArray

from protocol.errors import FixedPointOverflow as FixedPointOverflow
from protocol.errors import SecaggError as SecaggError
from protocol.validate import integer

PROTOCOL_VERSION = b"fedfilter-secagg-v2"
KEY_BYTES = 32  # X25519 keys, seeds, session tags
FIELD_PRIME = (1 << 521) - 1  # Mersenne prime M521: every 32-byte secret is one field element
SHARE_BYTES = 66  # a field element, little endian
NONCE_BYTES = 12
TAG_BYTES = 16
SIGNATURE_BYTES = 64  # Ed25519
FINGERPRINT_CHARS = 64  # a request fingerprint: SHA-256, hex
PLAINTEXT_BYTES = 8 + 8 + 4 + 2 * SHARE_BYTES  # share_keys_plaintext_concat layout
CIPHERTEXT_BYTES = NONCE_BYTES + PLAINTEXT_BYTES + TAG_BYTES
RING_BITS = 64
SUM_LIMIT = (1 << (RING_BITS - 1)) - 1  # |sum| <= 2^63 - 1: the signed sum of the session never wraps
MAX_SCALE_BITS = 52
MIN_CLIENTS = 2
MAX_CLIENTS = 1 << 16
NOISE_TAIL_STDS = 40.0  # P(|N(0, 1)| > 40) < 1e-340: the noise's own range, independent of any data
MIN_GRID_NOISE_STD = 256.0  # noise std in grid units: the rounded Gaussian is then the discrete one to O(1e-5)


def found_array(value: object) -> str:
    """How an error names what it found where an array was expected: ``dtype(shape)``, or the type's name."""
    return f"{value.dtype}{value.shape}" if isinstance(value, np.ndarray) else type(value).__name__


# --- fixed point ----------------------------------------------------------------------------


def _scale_bits(scale_bits: int) -> int:
    return integer("scale_bits", scale_bits, at_least=0, at_most=MAX_SCALE_BITS, error=SecaggError)


def value_bound_for(n_clients: int) -> int:
    """The largest per-client bound B with n B <= 2^63 - 1: a sum of n values in [-B, B] never wraps."""
    return SUM_LIMIT // integer("n_clients", n_clients, at_least=1, at_most=MAX_CLIENTS, error=SecaggError)


def check_value_bound(value_bound: int, n_clients: int) -> int:
    """``value_bound`` if n values within it sum without wrapping; a SecaggError naming both otherwise."""
    integer("value_bound", value_bound, at_least=1, error=SecaggError)
    if value_bound > value_bound_for(n_clients):
        raise SecaggError(
            f"value_bound: {n_clients} clients with values up to {value_bound} could wrap the 64-bit sum; "
            f"expected at most {value_bound_for(n_clients)}"
        )
    return value_bound


def encode_fixed_point(values: NDArray[np.floating], *, scale_bits: int, bound: int) -> NDArray[np.int64]:
    """rint(values * 2^scale_bits) as int64, each within [-bound, bound]; FixedPointOverflow otherwise.

    A non-finite value is out of every range. The check is exact (integer comparison after an
    exact float-to-int conversion), so a value that passes can never wrap.
    """
    bits = _scale_bits(scale_bits)
    integer("bound", bound, at_least=0, at_most=SUM_LIMIT, error=SecaggError)
    scaled = np.rint(np.ldexp(np.asarray(values, dtype=np.float64), bits))
    bad = ~(np.abs(scaled) < 2.0**63)  # also catches NaN
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FixedPointOverflow(
            f"fixed point: coordinate {i} is {float(np.asarray(values, dtype=np.float64).reshape(-1)[i])!r}, "
            f"which does not encode within [-{bound}, {bound}] at scale 2^{bits}"
        )
    out = scaled.astype(np.int64)
    over = np.abs(out) > bound
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise FixedPointOverflow(
            f"fixed point: coordinate {i} encodes to {int(out.reshape(-1)[i])}, outside [-{bound}, {bound}] "
            f"at scale 2^{bits}"
        )
    return out


def to_ring(encoded: NDArray[np.int64]) -> NDArray[np.uint64]:
    """Two's complement: the int64 values as elements of Z_{2^64}."""
    return np.ascontiguousarray(encoded, dtype=np.int64).view(np.uint64)


def decode_fixed_point(total: NDArray[np.uint64], *, scale_bits: int) -> NDArray[np.float64]:
    """The signed sum a ring element stands for, divided by 2^scale_bits."""
    bits = _scale_bits(scale_bits)
    return np.ldexp(np.ascontiguousarray(total, dtype=np.uint64).view(np.int64).astype(np.float64), -bits)


def data_bound(*, n_units: int, l2_clip: float, scale_bits: int) -> int:
    """Encoded bound on each coordinate of a client's clipped sum of ``n_units`` contributions of norm <= C.

    |sum_u v(u)_j| <= sum_u ||v(u)|| <= n_units C. The float64 sum of n terms errs by at most
    n eps sum |x| (eps = 2^-53), under 1e-6 of n C for n < 10^9; rounding to the grid adds 1/2.
    Hence ceil(n C 2^k (1 + 1e-6)) + 2.
    """
    integer("n_units", n_units, at_least=1, at_most=10**9 - 1, error=SecaggError)
    if not math.isfinite(l2_clip) or l2_clip <= 0:
        raise SecaggError(f"l2_clip: expected a finite number > 0, got {l2_clip!r}")
    return math.ceil(n_units * l2_clip * 2.0 ** _scale_bits(scale_bits) * (1 + 1e-6)) + 2


def noise_bound(*, noise_std: float, scale_bits: int) -> int:
    """Encoded bound on each coordinate of a noise share of std ``noise_std`` (40 standard deviations, +1)."""
    return math.ceil(NOISE_TAIL_STDS * noise_std * 2.0 ** _scale_bits(scale_bits)) + 1


def noise_share_std(noise_std: float, min_clients: int) -> float:
    """sigma / sqrt(m): any m shares sum to Gaussian noise of variance sigma^2 (privacy.md §2, secagg)."""
    if not math.isfinite(noise_std) or noise_std <= 0:
        raise SecaggError(f"noise_std: expected a finite number > 0, got {noise_std!r}")
    integer("min_clients", min_clients, at_least=MIN_CLIENTS, error=SecaggError)
    return noise_std / math.sqrt(min_clients)


def rounding_slack(dim: int, scale_bits: int) -> float:
    """sqrt(d) / 2^k: how far rounding a client's sum to the grid can move one unit's L2 sensitivity.

    Derivation: for neighbours differing in unit u, the unrounded client sums differ by v(u);
    each coordinate's rounding error lies in [-1/2, 1/2], so the two rounding errors differ by
    less than 1 per coordinate and the encoded sums differ by at most 2^k ||v(u)|| + sqrt(d)
    (grid units), i.e. ||v(u)|| + sqrt(d) / 2^k in the original units.
    """
    return math.sqrt(dim) / 2.0 ** _scale_bits(scale_bits)


def rounded_gaussian(rng: np.random.Generator, *, noise_std: float, scale_bits: int, size: int) -> NDArray[np.int64]:
    """A noise share on the grid: rint(N(0, noise_std^2) 2^k), range-checked against :func:`noise_bound`.

    The check can fail only on the noise itself (probability < 1e-340 per coordinate), never on
    data, so its error says nothing about anyone's data.
    """
    grid_std = noise_std * 2.0 ** _scale_bits(scale_bits)
    if grid_std < MIN_GRID_NOISE_STD:
        raise SecaggError(
            f"noise share: std {grid_std!r} grid steps at scale 2^{scale_bits}; expected >= {MIN_GRID_NOISE_STD} "
            "(raise secagg scale bits)"
        )
    draw = rng.normal(0.0, noise_std, size)
    return encode_fixed_point(
        draw, scale_bits=scale_bits, bound=noise_bound(noise_std=noise_std, scale_bits=scale_bits)
    )


# --- keys, derivation, masks ----------------------------------------------------------------


def _bytes32(name: str, raw: object) -> bytes:
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8 or raw.shape != (KEY_BYTES,):
            raise SecaggError(f"{name}: expected {KEY_BYTES} bytes (uint8[{KEY_BYTES}]), got {raw.dtype}{raw.shape}")
        return raw.tobytes()
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != KEY_BYTES:
        found = f"{len(raw)} bytes" if isinstance(raw, (bytes, bytearray)) else type(raw).__name__
        raise SecaggError(f"{name}: expected {KEY_BYTES} bytes, got {found}")
    return bytes(raw)


def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair (secret, public), raw 32 bytes each, from the OS CSPRNG."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    secret = X25519PrivateKey.generate()
    return (
        secret.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()),
        secret.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw),
    )


def public_key_of(secret: bytes) -> bytes:
    """The X25519 public key of a raw secret key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    key = X25519PrivateKey.from_private_bytes(_bytes32("secret key", secret))
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def agree(secret: bytes, peer_public: bytes, *, what: str) -> bytes:
    """X25519(secret, peer_public); a low-order or malformed peer key is a SecaggError naming ``what``."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    key = X25519PrivateKey.from_private_bytes(_bytes32("secret key", secret))
    try:
        return key.exchange(X25519PublicKey.from_public_bytes(_bytes32(what, peer_public)))
    except ValueError as exc:
        raise SecaggError(f"{what}: not a usable X25519 public key ({exc})") from exc


def _hkdf(secret: bytes, *, salt: bytes, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=PROTOCOL_VERSION + b"|" + info).derive(
        secret
    )


def _pair(a: int, b: int) -> bytes:
    return struct.pack("<II", a, b)


def pairwise_seed(secret: bytes, peer_public: bytes, *, tag: bytes, u: int, v: int) -> bytes:
    """s_uv = HKDF(X25519(s_u, s_v)) bound to the session and the unordered pair: the same seed on both sides."""
    shared = agree(secret, peer_public, what=f"masking key of peer {v}")
    return _hkdf(shared, salt=tag, info=b"pairwise-mask" + _pair(min(u, v), max(u, v)))


def self_mask_seed(seed: bytes, *, tag: bytes) -> bytes:
    """The PRG seed of the self mask, from b_u and the session tag."""
    return _hkdf(_bytes32("self-mask seed", seed), salt=tag, info=b"self-mask")


def seed_commitment(seed: bytes) -> bytes:
    """SHA-256 of b_u, sent at advertise time: a reconstructed b_u must match it."""
    return hashlib.sha256(PROTOCOL_VERSION + b"|seed|" + _bytes32("self-mask seed", seed)).digest()


def expand_mask(seed: bytes, dim: int) -> NDArray[np.uint64]:
    """PRG(seed): ``dim`` uniform elements of Z_{2^64} from the ChaCha20 keystream under key ``seed``.

    Each seed is derived for one session and one use, so the all-zero nonce is never reused
    with a key.
    """
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    integer("dim", dim, at_least=0, error=SecaggError)
    encryptor = Cipher(algorithms.ChaCha20(_bytes32("mask seed", seed), b"\x00" * 16), mode=None).encryptor()
    stream = encryptor.update(bytes(8 * dim))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64, copy=False)


def session_tag(
    *,
    run_id: str,
    round: int,
    threshold: int,
    encryption_keys: NDArray[np.uint8],
    masking_keys: NDArray[np.uint8],
    session: str = "",
    fingerprint: str = "",
    identities: NDArray[np.uint8] | None = None,
    commitments: NDArray[np.uint8] | None = None,
) -> bytes:
    """SHA-256 of everything that defines a session: run, round, session id, the step-3 request's
    fingerprint, threshold, and the roster's public keys, identities and seed commitments."""
    h = hashlib.sha256(PROTOCOL_VERSION + b"|session|")
    h.update(_framed(run_id.encode(), struct.pack("<qI", round, threshold), session.encode(), fingerprint.encode()))
    h.update(struct.pack("<I", len(encryption_keys)))
    h.update(np.ascontiguousarray(encryption_keys, dtype=np.uint8).tobytes())
    h.update(np.ascontiguousarray(masking_keys, dtype=np.uint8).tobytes())
    for table in (identities, commitments):
        h.update(b"|" if table is None else b"+" + np.ascontiguousarray(table, dtype=np.uint8).tobytes())
    return h.digest()


# --- identities and signatures (the active-adversary variant) --------------------------------
#
# Bonawitz et al. 2017, Sec. 6.2 and Fig. 4 ("malicious" rounds): every client holds a long-term
# signing key whose public half its peers know from outside the coordinator (here: the data
# owner's `secagg-peers` file). It signs its key advertisement, bound to the session and to the
# fingerprint of the request whose inputs the session sums, and, before the unmask step, the
# survivor set it was told (the consistency check). A coordinator can then neither invent nor
# substitute roster members, nor show two clients two survivor sets that both gather m
# signatures (each honest client signs one set per session, and 2m > n).


def _framed(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: no two different part lists frame to the same bytes."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def new_identity() -> bytes:
    """A fresh Ed25519 signing key (raw 32-byte secret) from the OS CSPRNG."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def identity_public_key(secret: bytes) -> bytes:
    """The Ed25519 public key (32 bytes) of a raw identity secret."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.from_private_bytes(_bytes32("identity key", secret))
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def sign(secret: bytes, message: bytes) -> bytes:
    """Ed25519 signature (64 bytes) of ``message`` under the identity secret."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(_bytes32("identity key", secret)).sign(message)


def signature_valid(public: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the Ed25519 signature of ``message`` under ``public`` (malformed: False)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if len(public) != KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def advert_message(
    *,
    run_id: str,
    round: int,
    session: str,
    fingerprint: str,
    encryption_key: bytes,
    masking_key: bytes,
    commitment: bytes,
) -> bytes:
    """What a client signs at step 1: its session keys and commitment, bound to run, round, session and request."""
    return (
        PROTOCOL_VERSION
        + b"|advert|"
        + _framed(
            run_id.encode(),
            struct.pack("<q", round),
            session.encode(),
            fingerprint.encode(),
            encryption_key,
            masking_key,
            commitment,
        )
    )


def signed_advert(
    identity: bytes, secrets_: ClientSecrets, *, run_id: str, round: int, session: str, fingerprint: str
) -> bytes:
    """The signature of a client's advertisement of ``secrets_``'s public keys (:func:`advert_message`)."""
    message = advert_message(
        run_id=run_id,
        round=round,
        session=session,
        fingerprint=fingerprint,
        encryption_key=secrets_.encryption_key,
        masking_key=secrets_.masking_key,
        commitment=secrets_.commitment,
    )
    return sign(identity, message)


def check_message(tag: bytes, survivors: NDArray[np.int64], dropped: NDArray[np.int64]) -> bytes:
    """What a survivor signs in the consistency check: the session tag, U3 and U2 \\ U3 as it was told them."""
    return (
        PROTOCOL_VERSION
        + b"|check|"
        + _framed(tag, np.asarray(survivors, dtype="<i8").tobytes(), np.asarray(dropped, dtype="<i8").tobytes())
    )


def _signature_table(name: str, table: object, rows: int) -> NDArray[np.uint8]:
    if not isinstance(table, np.ndarray) or table.dtype != np.uint8 or table.shape != (rows, SIGNATURE_BYTES):
        raise SecaggError(f"{name}: expected uint8[{rows}, {SIGNATURE_BYTES}], got {found_array(table)}")
    return table


# --- Shamir secret sharing over GF(2^521 - 1) --------------------------------------------------


def shamir_split(
    secret: int, *, threshold: int, n: int, randbelow: Callable[[int], int] = secrets.randbelow
) -> list[int]:
    """Shares f(1), ..., f(n) of a random polynomial f of degree threshold - 1 with f(0) = secret."""
    if not 0 <= secret < FIELD_PRIME:
        raise SecaggError("shamir: the secret must be an element of the field")
    if not 1 <= threshold <= n:
        raise SecaggError(f"shamir: expected 1 <= threshold <= n, got threshold {threshold} and n {n}")
    coefficients = [secret] + [randbelow(FIELD_PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in range(1, n + 1):
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % FIELD_PRIME
        shares.append(y)
    return shares


def lagrange_at_zero(xs: Sequence[int]) -> list[int]:
    """Coefficients l_i with f(0) = sum_i l_i f(x_i) for every polynomial of degree < len(xs)."""
    out = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % FIELD_PRIME
                den = den * (xj - xi) % FIELD_PRIME
        out.append(num * pow(den, -1, FIELD_PRIME) % FIELD_PRIME)
    return out


def shamir_reconstruct(shares: Mapping[int, int], *, threshold: int, coefficients: Sequence[int] | None = None) -> int:
    """f(0) from the ``threshold`` shares with the smallest x (the polynomial's degree is threshold - 1).

    ``coefficients`` (from :func:`lagrange_at_zero` of those x) may be passed when many secrets
    share the same x. Too few shares, or an x or y outside the field, is a SecaggError.
    """
    if len(shares) < threshold:
        raise SecaggError(f"shamir: expected at least {threshold} shares, got {len(shares)}")
    for x, y in shares.items():
        if not 1 <= x < FIELD_PRIME or not 0 <= y < FIELD_PRIME:
            raise SecaggError(f"shamir: share at x = {x} is not a point of the field")
    xs = sorted(shares)[:threshold]
    lam = lagrange_at_zero(xs) if coefficients is None else coefficients
    if len(lam) != threshold:
        raise SecaggError(f"shamir: expected {threshold} Lagrange coefficients, got {len(lam)}")
    return sum(lam_i * shares[x] for lam_i, x in zip(lam, xs, strict=True)) % FIELD_PRIME


def share_to_bytes(share: int) -> bytes:
    return share.to_bytes(SHARE_BYTES, "little")


def share_table(shares: Sequence[int]) -> NDArray[np.uint8]:
    """uint8[len(shares), SHARE_BYTES]: one share per row, as :func:`share_to_bytes` writes it."""
    raw = b"".join(share_to_bytes(s) for s in shares)
    return np.frombuffer(raw, dtype=np.uint8).reshape(len(shares), SHARE_BYTES).copy()


def share_from_bytes(raw: bytes, *, what: str) -> int:
    if len(raw) != SHARE_BYTES:
        raise SecaggError(f"{what}: expected a {SHARE_BYTES}-byte share, got {len(raw)} bytes")
    value = int.from_bytes(raw, "little")
    if value >= FIELD_PRIME:
        raise SecaggError(f"{what}: the share is not an element of GF(2^521 - 1)")
    return value


# --- the roster and the client's steps --------------------------------------------------------


@dataclass(frozen=True)
class ClientSecrets:
    """A client's secrets for one session: never reused by another session (reuse would unmask inputs)."""

    encryption_secret: bytes = field(repr=False)
    masking_secret: bytes = field(repr=False)
    self_seed: bytes = field(repr=False)

    @classmethod
    def fresh(cls) -> ClientSecrets:
        return cls(generate_keypair()[0], generate_keypair()[0], secrets.token_bytes(KEY_BYTES))

    @property
    def encryption_key(self) -> bytes:
        return public_key_of(self.encryption_secret)

    @property
    def masking_key(self) -> bytes:
        return public_key_of(self.masking_secret)

    @property
    def commitment(self) -> bytes:
        return seed_commitment(self.self_seed)


def _key_table(name: str, keys: object) -> NDArray[np.uint8]:
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != KEY_BYTES:
        found = found_array(keys)
        raise SecaggError(f"{name}: expected uint8[n, {KEY_BYTES}], got {found}")
    return keys


@dataclass(frozen=True, eq=False)
class Roster:
    """U1: every client that advertised keys, in index order; the session's threshold m and its tag."""

    run_id: str
    round: int
    threshold: int
    encryption_keys: NDArray[np.uint8] = field(repr=False)
    masking_keys: NDArray[np.uint8] = field(repr=False)
    # The authenticated roster (:meth:`authenticate`): the session id, the fingerprint of the step-3
    # request, and per member its identity key, seed commitment and signed advertisement.
    session: str = ""
    fingerprint: str = ""
    identities: NDArray[np.uint8] | None = field(default=None, repr=False)
    commitments: NDArray[np.uint8] | None = field(default=None, repr=False)
    signatures: NDArray[np.uint8] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        enc = _key_table("encryption_keys", self.encryption_keys)
        mask = _key_table("masking_keys", self.masking_keys)
        n = enc.shape[0]
        if mask.shape[0] != n:
            raise SecaggError(f"roster: expected as many masking keys as encryption keys ({n}), got {mask.shape[0]}")
        if not MIN_CLIENTS <= n <= MAX_CLIENTS:
            raise SecaggError(f"roster: expected between {MIN_CLIENTS} and {MAX_CLIENTS} clients, got {n}")
        integer("threshold", self.threshold, error=SecaggError)
        if not MIN_CLIENTS <= self.threshold <= n:
            raise SecaggError(
                f"threshold: expected {MIN_CLIENTS} <= m <= {n} (the roster's size), got {self.threshold}"
            )
        every = [bytes(k) for k in np.concatenate([enc, mask])]
        if len(set(every)) != len(every):
            raise SecaggError("roster: expected every public key to be distinct, found a key listed twice")

    @property
    def size(self) -> int:
        return int(self.encryption_keys.shape[0])

    @property
    def tag(self) -> bytes:
        return session_tag(
            run_id=self.run_id,
            round=self.round,
            threshold=self.threshold,
            encryption_keys=self.encryption_keys,
            masking_keys=self.masking_keys,
            session=self.session,
            fingerprint=self.fingerprint,
            identities=self.identities,
            commitments=self.commitments,
        )

    def advert(self, i: int) -> bytes:
        """The advertisement member ``i`` signed (its keys and commitment, this run, round, session, request)."""
        assert self.commitments is not None
        return advert_message(
            run_id=self.run_id,
            round=self.round,
            session=self.session,
            fingerprint=self.fingerprint,
            encryption_key=self.encryption_keys[i].tobytes(),
            masking_key=self.masking_keys[i].tobytes(),
            commitment=self.commitments[i].tobytes(),
        )

    def authenticate(self, trusted: Collection[bytes]) -> None:
        """Refuse a roster that a deviating coordinator could have forged or bent (Bonawitz et al. 2017, Sec. 6.2).

        Every member must be listed with an identity from ``trusted`` (the data owner's peer list,
        never the coordinator's word), each identity once, each advertisement signed by its identity
        for this run, round, session and request fingerprint; and 2m > n, so that no two survivor
        sets can each gather m consistency signatures from clients who sign one set per session.
        """
        n = self.size
        if not self.session or len(self.fingerprint) != FINGERPRINT_CHARS:
            raise SecaggError("roster: expected a session id and a 64-character request fingerprint, found none")
        identities = _key_table("identities", self.identities)
        commitments = _key_table("commitments", self.commitments)
        if identities.shape[0] != n or commitments.shape[0] != n:
            raise SecaggError(
                f"roster: expected {n} identities and {n} commitments (one per member), "
                f"got {identities.shape[0]} and {commitments.shape[0]}"
            )
        signatures = _signature_table("signatures", self.signatures, n)
        ids = [row.tobytes() for row in identities]
        if len(set(ids)) != n:
            raise SecaggError("roster: expected every member's identity once, found an identity listed twice")
        trusted_set = set(trusted)
        unknown = [i for i, key in enumerate(ids) if key not in trusted_set]
        if unknown:
            raise SecaggError(f"roster: members {unknown} have identities that are not this client's trusted peers")
        forged = [i for i in range(n) if not signature_valid(ids[i], self.advert(i), signatures[i].tobytes())]
        if forged:
            raise SecaggError(
                f"roster: the advertisements of members {forged} are not signed by their identities for this "
                "run, round, session and request"
            )
        if 2 * self.threshold <= n:
            raise SecaggError(
                f"threshold: m = {self.threshold} of {n} clients; expected 2m > n, so that no two survivor sets "
                "can each gather m consistency signatures"
            )

    def index_of(self, encryption_key: bytes, masking_key: bytes) -> int:
        """The index of the client holding these public keys; a SecaggError when it is not listed."""
        hits = [
            i
            for i in range(self.size)
            if self.encryption_keys[i].tobytes() == encryption_key and self.masking_keys[i].tobytes() == masking_key
        ]
        if len(hits) != 1:
            raise SecaggError("roster: expected this client's advertised keys exactly once, found them missing")
        return hits[0]

    def check_peers(self, peers: object, *, name: str, own: int | None = None) -> NDArray[np.int64]:
        """A strictly increasing int64 list of at least m roster indices (containing ``own`` when given)."""
        if not isinstance(peers, np.ndarray) or peers.dtype != np.int64 or peers.ndim != 1:
            found = found_array(peers)
            raise SecaggError(f"{name}: expected an int64 list of roster indices, got {found}")
        if peers.size and (peers[0] < 0 or peers[-1] >= self.size or np.any(np.diff(peers) <= 0)):
            raise SecaggError(f"{name}: expected strictly increasing indices in [0, {self.size}), got {peers.tolist()}")
        if peers.size < self.threshold:
            raise SecaggError(
                f"{name}: {peers.size} clients, fewer than the session's minimum m = {self.threshold}; "
                "the session releases nothing"
            )
        if own is not None and own not in set(peers.tolist()):
            raise SecaggError(f"{name}: expected this client's index {own} among them, found it missing")
        return peers

    def check_split(
        self, survivors: object, dropped: object, *, shared: NDArray[np.int64], own: int
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """U3 and U2 \\ U3 as a client checks them: disjoint, together exactly its own U2, U3 >= m holding itself.

        A coordinator that lists one client as both survivor and dropped, or whose lists do not
        partition the U2 this client masked against, is refused here, before any share is revealed.
        """
        u3 = self.check_peers(survivors, name="survivors (U3)", own=own)
        if not isinstance(dropped, np.ndarray) or dropped.dtype != np.int64 or dropped.ndim != 1:
            raise SecaggError(
                f"dropped (U2 \\ U3): expected an int64 list of roster indices, got {found_array(dropped)}"
            )
        if dropped.size and (np.any(np.diff(dropped) <= 0) or dropped[0] < 0 or dropped[-1] >= self.size):
            raise SecaggError(
                f"dropped (U2 \\ U3): expected strictly increasing indices in [0, {self.size}), got {dropped.tolist()}"
            )
        both = sorted(set(u3.tolist()) & set(dropped.tolist()))
        if both:
            raise SecaggError(f"survivors and dropped: expected disjoint lists, found {both} in both")
        if sorted(u3.tolist() + dropped.tolist()) != shared.tolist():
            raise SecaggError(
                f"survivors and dropped: expected together exactly the U2 this client masked against "
                f"{shared.tolist()}, got {sorted(u3.tolist() + dropped.tolist())}"
            )
        return u3, dropped

    def check_signatures(
        self,
        survivors: NDArray[np.int64],
        dropped: NDArray[np.int64],
        signers: object,
        signatures: object,
    ) -> None:
        """At least m distinct survivors signed this exact (U3, U2 \\ U3) for this session; every listed one valid."""
        if self.identities is None:
            raise SecaggError("consistency check: the roster holds no identities to check signatures against")
        if not isinstance(signers, np.ndarray) or signers.dtype != np.int64 or signers.ndim != 1:
            raise SecaggError(f"signers: expected an int64 list of roster indices, got {found_array(signers)}")
        table = _signature_table("check signatures", signatures, signers.size)
        if np.any(np.diff(signers) <= 0) or not set(signers.tolist()) <= set(survivors.tolist()):
            raise SecaggError(
                f"signers: expected strictly increasing survivors from {survivors.tolist()}, got {signers.tolist()}"
            )
        if signers.size < self.threshold:
            raise SecaggError(
                f"consistency check: {signers.size} survivors signed the survivor set, fewer than m = "
                f"{self.threshold}; revealing nothing"
            )
        message = check_message(self.tag, survivors, dropped)
        bad = [
            int(i)
            for i, sig in zip(signers.tolist(), table, strict=True)
            if not signature_valid(self.identities[i].tobytes(), message, sig.tobytes())
        ]
        if bad:
            raise SecaggError(
                f"consistency check: the signatures of {bad} are not over this session's survivor set; "
                "clients were told different sets"
            )


def share_ciphertexts(secrets_: ClientSecrets, roster: Roster, own: int) -> NDArray[np.uint8]:
    """Step 2: row v holds (shares of b_u and of s_u's secret for x = v + 1), encrypted for client v."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

    tag = roster.tag
    n = roster.size
    b_shares = shamir_split(int.from_bytes(secrets_.self_seed, "little"), threshold=roster.threshold, n=n)
    sk_shares = shamir_split(int.from_bytes(secrets_.masking_secret, "little"), threshold=roster.threshold, n=n)
    out = np.zeros((n, CIPHERTEXT_BYTES), dtype=np.uint8)
    for v in range(n):
        plaintext = share_keys_plaintext_concat(own, v, share_to_bytes(b_shares[v]), share_to_bytes(sk_shares[v]))
        key = _share_key(
            secrets_.encryption_secret, roster.encryption_keys[v].tobytes(), tag=tag, src=own, dst=v, peer=v
        )
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, tag + _pair(own, v))
        out[v] = np.frombuffer(sealed, dtype=np.uint8)
    return out


def _share_key(secret: bytes, peer_public: bytes, *, tag: bytes, src: int, dst: int, peer: int) -> bytes:
    """The AEAD key for shares sent from ``src`` to ``dst`` in this session (directional: one key per message)."""
    shared = agree(secret, peer_public, what=f"encryption key of peer {peer}")
    return _hkdf(shared, salt=tag, info=b"share-encryption" + _pair(src, dst))


@dataclass(frozen=True)
class OpenedShare:
    """What peer ``src`` gave this client: its shares of b_src and of s_src's secret."""

    src: int
    seed_share: int = field(repr=False)
    key_share: int = field(repr=False)


def open_ciphertexts(
    secrets_: ClientSecrets, roster: Roster, own: int, peers: NDArray[np.int64], ciphertexts: object
) -> list[OpenedShare]:
    """Step 3, first half: decrypt and check the shares each peer of U2 sent to this client.

    A ciphertext that does not authenticate (another session's, another pair's, tampered,
    or sealed under other keys) or whose plaintext names another pair is a SecaggError.
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

    if not isinstance(ciphertexts, np.ndarray) or ciphertexts.dtype != np.uint8:
        raise SecaggError(f"ciphertexts: expected uint8[{peers.size}, {CIPHERTEXT_BYTES}], got {ciphertexts!r:.60}")
    if ciphertexts.shape != (peers.size, CIPHERTEXT_BYTES):
        raise SecaggError(
            f"ciphertexts: expected uint8[{peers.size}, {CIPHERTEXT_BYTES}] (one per peer), got {ciphertexts.shape}"
        )
    tag = roster.tag
    out = []
    for row, src in zip(ciphertexts, peers.tolist(), strict=True):
        sealed = row.tobytes()
        key = _share_key(
            secrets_.encryption_secret, roster.encryption_keys[src].tobytes(), tag=tag, src=src, dst=own, peer=src
        )
        try:
            plaintext = ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], tag + _pair(src, own))
        except InvalidTag as exc:
            raise SecaggError(
                f"share from peer {src} to {own}: does not authenticate for this session (replayed from another "
                "session or pair, tampered, or sealed under other keys)"
            ) from exc
        if len(plaintext) != PLAINTEXT_BYTES:
            raise SecaggError(
                f"share from peer {src}: expected {PLAINTEXT_BYTES} plaintext bytes, got {len(plaintext)}"
            )
        got_src, got_dst, b_raw, sk_raw = share_keys_plaintext_separate(plaintext)
        if (got_src, got_dst) != (src, own) or len(b_raw) != SHARE_BYTES:
            raise SecaggError(f"share from peer {src} to {own}: the plaintext names peers {got_src} -> {got_dst}")
        out.append(
            OpenedShare(
                src,
                share_from_bytes(b_raw, what=f"seed share from peer {src}"),
                share_from_bytes(sk_raw, what=f"key share from peer {src}"),
            )
        )
    return out


def masked_input(
    encoded: NDArray[np.int64], secrets_: ClientSecrets, roster: Roster, own: int, peers: NDArray[np.int64]
) -> NDArray[np.uint64]:
    """Step 3: y_u = x_u + PRG(b_u) + sum_{v in U2, v != u} sign(u, v) PRG(s_uv)  (mod 2^64)."""
    tag = roster.tag
    dim = int(encoded.size)
    y = to_ring(encoded).copy()
    y += expand_mask(self_mask_seed(secrets_.self_seed, tag=tag), dim)
    for v in peers.tolist():
        if v == own:
            continue
        mask = expand_mask(
            pairwise_seed(secrets_.masking_secret, roster.masking_keys[v].tobytes(), tag=tag, u=own, v=v), dim
        )
        if own < v:
            y += mask
        else:
            y -= mask
    return y


@dataclass(frozen=True, eq=False)
class Revealed:
    """Step 4's answer: shares of b_v for survivors, shares of s_v's secret for the dropped, never both."""

    seed_peers: NDArray[np.int64]
    seed_shares: NDArray[np.uint8] = field(repr=False)
    key_peers: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    key_shares: NDArray[np.uint8] = field(default_factory=lambda: np.zeros((0, SHARE_BYTES), np.uint8), repr=False)


def reveal(opened: Iterable[OpenedShare], survivors: NDArray[np.int64]) -> Revealed:
    """For each peer of U2: its seed share if it survived, else its key share (SecAgg's one-or-the-other rule)."""
    alive = set(survivors.tolist())
    seeds = [(o.src, o.seed_share) for o in opened if o.src in alive]
    keys = [(o.src, o.key_share) for o in opened if o.src not in alive]

    def table(items: list[tuple[int, int]]) -> tuple[NDArray[np.int64], NDArray[np.uint8]]:
        return np.array([p for p, _ in items], dtype=np.int64), share_table([s for _, s in items])

    return Revealed(*table(seeds), *table(keys))


# --- the server's step 4 ----------------------------------------------------------------------


def _share_rows(name: str, peers: object, shares: object) -> dict[int, int]:
    if not isinstance(peers, np.ndarray) or peers.dtype != np.int64 or peers.ndim != 1:
        raise SecaggError(f"{name}: expected an int64 list of peers, got {peers!r:.60}")
    if not isinstance(shares, np.ndarray) or shares.dtype != np.uint8 or shares.shape != (peers.size, SHARE_BYTES):
        found = found_array(shares)
        raise SecaggError(f"{name}: expected uint8[{peers.size}, {SHARE_BYTES}], got {found}")
    out = {}
    for p, row in zip(peers.tolist(), shares, strict=True):
        if p in out:
            raise SecaggError(f"{name}: peer {p} listed twice")
        out[p] = share_from_bytes(row.tobytes(), what=f"{name} of peer {p}")
    return out


def unmask_sum(
    roster: Roster,
    *,
    shared: NDArray[np.int64],
    masked: Mapping[int, NDArray[np.uint64]],
    revealed: Mapping[int, Revealed],
    commitments: Mapping[int, bytes],
    dim: int,
) -> NDArray[np.uint64]:
    """Step 4, server side: the sum of the survivors' encoded inputs (mod 2^64), or a SecaggError.

    ``shared`` is U2; ``masked`` holds the masked inputs of U3; ``revealed`` the answers of
    U4 (by responder index). Refused: fewer than m survivors or responders, a responder that
    reveals both shares of one peer or shares of peers outside U2, a survivor's seed that does
    not match its commitment, a dropped client's key that does not match its advertised key.
    """
    masked = {int(k): v for k, v in masked.items()}
    revealed = {int(k): v for k, v in revealed.items()}
    peers = roster.check_peers(shared, name="U2 (clients that shared keys)")
    u2 = set(peers.tolist())
    survivors = np.array(sorted(masked), dtype=np.int64)
    roster.check_peers(survivors, name="U3 (masked inputs received)")
    u3 = set(survivors.tolist())
    if not u3 <= u2:
        raise SecaggError(f"U3: expected survivors among U2, found {sorted(u3 - u2)}")
    if not set(revealed) <= u3:
        raise SecaggError(f"U4: expected responders among the survivors U3, found {sorted(set(revealed) - u3)}")
    if len(revealed) < roster.threshold:
        raise SecaggError(
            f"U4: {len(revealed)} clients answered the unmask step, fewer than the threshold m = {roster.threshold}; "
            "the session releases nothing"
        )
    dropped = u2 - u3
    seed_points: dict[int, dict[int, int]] = {v: {} for v in u3}
    key_points: dict[int, dict[int, int]] = {w: {} for w in dropped}
    for responder, answer in revealed.items():
        seeds = _share_rows(f"seed shares from client {responder}", answer.seed_peers, answer.seed_shares)
        keys = _share_rows(f"key shares from client {responder}", answer.key_peers, answer.key_shares)
        if set(seeds) != u3 or set(keys) != dropped:
            raise SecaggError(
                f"unmask answer of client {responder}: expected seed shares for U3 {sorted(u3)} and key shares for "
                f"the dropped {sorted(dropped)}, found {sorted(seeds)} and {sorted(keys)}"
            )
        for v, s in seeds.items():
            seed_points[v][responder + 1] = s
        for w, s in keys.items():
            key_points[w][responder + 1] = s
    xs = sorted(r + 1 for r in revealed)[: roster.threshold]
    lam = lagrange_at_zero(xs)
    total = np.zeros(dim, dtype=np.uint64)
    tag = roster.tag
    for v in sorted(u3):
        y = masked[v]
        if not isinstance(y, np.ndarray) or y.dtype != np.uint64 or y.shape != (dim,):
            found = found_array(y)
            raise SecaggError(f"masked input of client {v}: expected uint64[{dim}], got {found}")
        total += y
        seed = _secret_bytes(shamir_reconstruct(seed_points[v], threshold=roster.threshold, coefficients=lam))
        if seed is None or seed_commitment(seed) != commitments.get(v):
            raise SecaggError(
                f"client {v}: the reconstructed self-mask seed does not match its commitment (inconsistent shares)"
            )
        total -= expand_mask(self_mask_seed(seed, tag=tag), dim)
    for w in sorted(dropped):
        secret = _secret_bytes(shamir_reconstruct(key_points[w], threshold=roster.threshold, coefficients=lam))
        if secret is None or public_key_of(secret) != roster.masking_keys[w].tobytes():
            raise SecaggError(
                f"dropped client {w}: the reconstructed masking key does not match its advertised key "
                "(inconsistent shares)"
            )
        for v in sorted(u3):
            mask = expand_mask(pairwise_seed(secret, roster.masking_keys[v].tobytes(), tag=tag, u=w, v=v), dim)
            if v < w:
                total -= mask
            else:
                total += mask
    return total


def _secret_bytes(value: int) -> bytes | None:
    return value.to_bytes(KEY_BYTES, "little") if value < 1 << (8 * KEY_BYTES) else None
