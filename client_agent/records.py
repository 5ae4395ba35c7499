"""What each answered request released, as the ledger stores it: one frozen record type per kind.

After dp_accounting's ``dp_event.py``: a record says what left the machine and nothing else;
each type knows how to write itself as the ledger's named arrays (:meth:`to_arrays`) and how
to read itself back (:meth:`from_arrays`); :func:`release_from_arrays` dispatches on the
stored ``kind``. Pricing stays apart (protocol/releases.py, protocol/filters.py).

The arrays are the ledger's on-disk format (privacy.md §9): their names, dtypes and shapes, and
their order, are exactly those the agent has always written. A stored record whose arrays are
not those of its kind raises :class:`~client_agent.ledger.LedgerError` naming what was expected
and what was found.

| kind                          | record                  | arrays                                            |
|-------------------------------|-------------------------|---------------------------------------------------|
| ``gradient``, ``indicator``   | :class:`GaussianRecord` | noise_std, l2_norms, refused (+ masked shares)    |
| same, realisation filter      | :class:`RealisationRecord` | noise_std, l2_norms, losses, participating,    |
|                               |                         | accept_next (+ masked shares)                     |
| ``monitor``                   | :class:`MonitorRecord`  | round (+ masked shares)                           |
| ``secagg-keys``               | :class:`KeysRecord`     | round, fingerprint, the three session secrets     |
| ``secagg-shares``             | :class:`SharesRecord`   | round, own, min_clients and the roster            |
| ``secagg-check``              | :class:`CheckRecord`    | round, survivors, dropped                         |
| ``secagg-unmask``             | :class:`UnmaskRecord`   | round, survivors                                  |

Every record also stores its ``kind`` (a 0-d string array), first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from client_agent.ledger import LedgerError
from protocol.releases import GaussianRelease

Arrays = dict[str, NDArray[Any]]

KEYS_KIND: Final = "secagg-keys"
SHARES_KIND: Final = "secagg-shares"
CHECK_KIND: Final = "secagg-check"
UNMASK_KIND: Final = "secagg-unmask"
MONITOR_KIND: Final = "monitor"
CONTRIBUTION_KINDS: Final = ("gradient", "indicator")

_MASKED_NAMES: Final = ("round", "secagg_peers", "secagg_seed_shares", "secagg_key_shares", "secagg_noise_share_std")


def _kind(kind: str) -> NDArray[np.str_]:
    return np.array(kind)


def u8(raw: bytes) -> NDArray[np.uint8]:
    """``raw`` as a writable uint8 array (keys, signatures and shares as the ledger stores them)."""
    return np.frombuffer(raw, dtype=np.uint8).copy()


def _names(kind: str, arrays: Mapping[str, NDArray[Any]], names: tuple[str, ...]) -> None:
    """Refuse a stored record whose array names are not ``kind`` plus ``names``."""
    expected = sorted(("kind", *names))
    if sorted(arrays) != expected:
        raise LedgerError(f"release record of kind {kind!r}: expected arrays {expected}, found {sorted(arrays)}")


def _array(kind: str, arrays: Mapping[str, NDArray[Any]], name: str, dtype_kinds: str, ndim: int) -> NDArray[Any]:
    """``arrays[name]``, refused unless its dtype kind is one of ``dtype_kinds`` and it has ``ndim`` dimensions."""
    array = arrays[name]
    if array.dtype.kind not in dtype_kinds or array.ndim != ndim:
        raise LedgerError(
            f"release record of kind {kind!r}: array {name!r}: expected {ndim} dimension(s) of dtype kind "
            f"{dtype_kinds!r}, found shape {array.shape} dtype {array.dtype}"
        )
    return array


def _one(kind: str, arrays: Mapping[str, NDArray[Any]], name: str, dtype_kinds: str) -> Any:
    """The single value of a shape-(1,) array."""
    array = _array(kind, arrays, name, dtype_kinds, 1)
    if array.shape != (1,):
        raise LedgerError(f"release record of kind {kind!r}: array {name!r}: expected shape (1,), found {array.shape}")
    return array[0].item()


def _text(kind: str, arrays: Mapping[str, NDArray[Any]], name: str) -> str:
    return str(_array(kind, arrays, name, "U", 0))


def _per_unit(kind: str, arrays: Mapping[str, NDArray[Any]], names: tuple[str, ...], dtype_kinds: str) -> list[Any]:
    """Arrays of one entry per unit, all of one length."""
    found = [_array(kind, arrays, name, dtype_kinds[i], 1) for i, name in enumerate(names)]
    if len({a.shape for a in found}) != 1:
        shapes = {name: a.shape for name, a in zip(names, found, strict=True)}
        raise LedgerError(f"release record of kind {kind!r}: expected one entry per unit in each of {shapes}")
    return found


@dataclass(frozen=True, eq=False)
class MaskedShares:
    """A masked input's session secrets for step 4: the peers' shares, stored with the charge of step 3 (secagg)."""

    round: int
    peers: NDArray[np.int64] = field(repr=False)
    seed_shares: NDArray[np.uint8] = field(repr=False)
    key_shares: NDArray[np.uint8] = field(repr=False)
    noise_share_std: float

    def to_arrays(self) -> Arrays:
        return {
            "round": np.array([self.round]),
            "secagg_peers": self.peers,
            "secagg_seed_shares": self.seed_shares,
            "secagg_key_shares": self.key_shares,
            "secagg_noise_share_std": np.array([self.noise_share_std]),
        }

    @classmethod
    def from_arrays(cls, kind: str, arrays: Mapping[str, NDArray[Any]]) -> MaskedShares | None:
        """The shares stored in a record of ``kind``, or None if it holds none (names are checked by the caller)."""
        if "secagg_peers" not in arrays:
            return None
        return cls(
            _one(kind, arrays, "round", "i"),
            _array(kind, arrays, "secagg_peers", "i", 1),
            _array(kind, arrays, "secagg_seed_shares", "u", 2),
            _array(kind, arrays, "secagg_key_shares", "u", 2),
            _one(kind, arrays, "secagg_noise_share_std", "f"),
        )


def _masked_names(arrays: Mapping[str, NDArray[Any]]) -> tuple[str, ...]:
    return _MASKED_NAMES if "secagg_peers" in arrays else ()


def _with_masked(arrays: Arrays, masked: MaskedShares | None) -> Arrays:
    return arrays if masked is None else arrays | masked.to_arrays()


@dataclass(frozen=True, eq=False)
class GaussianRecord:
    """A Gaussian filter's release: noise std, each unit's charged clipped norm, and the units it refused.

    Privacy note: the charge (privacy.md §2); replaying these records through the filter rebuilds
    the stored spend (:meth:`release` gives the filter's own record).
    """

    kind: str
    noise_std: float
    l2_norms: NDArray[np.float64] = field(repr=False)
    refused: NDArray[np.bool_] = field(repr=False)
    masked: MaskedShares | None = None

    _NAMES = ("noise_std", "l2_norms", "refused")

    def to_arrays(self) -> Arrays:
        arrays: Arrays = {
            "kind": _kind(self.kind),
            "noise_std": np.array([self.noise_std]),
            "l2_norms": self.l2_norms,
            "refused": self.refused,
        }
        return _with_masked(arrays, self.masked)

    @classmethod
    def from_arrays(cls, kind: str, arrays: Mapping[str, NDArray[Any]]) -> GaussianRecord:
        _names(kind, arrays, cls._NAMES + _masked_names(arrays))
        l2_norms, refused = _per_unit(kind, arrays, ("l2_norms", "refused"), "fb")
        return cls(
            kind, _one(kind, arrays, "noise_std", "f"), l2_norms, refused, MaskedShares.from_arrays(kind, arrays)
        )

    def release(self, round_id: str) -> GaussianRelease:
        """The filter's record of this release (protocol.releases), for replay."""
        return GaussianRelease(self.kind, round_id, self.noise_std, self.l2_norms, refused=self.refused)


@dataclass(frozen=True, eq=False)
class RealisationRecord:
    """A realisation filter's release (TVC, privacy.md §6): who took part, their realised losses, who accepts next."""

    kind: str
    noise_std: float
    l2_norms: NDArray[np.float64] = field(repr=False)
    losses: NDArray[np.float64] = field(repr=False)
    participating: NDArray[np.bool_] = field(repr=False)
    accept_next: NDArray[np.bool_] = field(repr=False)
    masked: MaskedShares | None = None

    _NAMES = ("noise_std", "l2_norms", "losses", "participating", "accept_next")

    def to_arrays(self) -> Arrays:
        arrays: Arrays = {
            "kind": _kind(self.kind),
            "noise_std": np.array([self.noise_std]),
            "l2_norms": self.l2_norms,
            "losses": self.losses,
            "participating": self.participating,
            "accept_next": self.accept_next,
        }
        return _with_masked(arrays, self.masked)

    @classmethod
    def from_arrays(cls, kind: str, arrays: Mapping[str, NDArray[Any]]) -> RealisationRecord:
        _names(kind, arrays, cls._NAMES + _masked_names(arrays))
        names = ("l2_norms", "losses", "participating", "accept_next")
        l2_norms, losses, participating, accept_next = _per_unit(kind, arrays, names, "ffbb")
        noise_std = _one(kind, arrays, "noise_std", "f")
        masked = MaskedShares.from_arrays(kind, arrays)
        return cls(kind, noise_std, l2_norms, losses, participating, accept_next, masked)


@dataclass(frozen=True, eq=False)
class MonitorRecord:
    """A monitor report for ``round`` (privacy.md §7): its cost was reserved at enrolment, so it charges nothing."""

    round: int
    masked: MaskedShares | None = None

    def __post_init__(self) -> None:
        if self.masked is not None and self.masked.round != self.round:
            raise LedgerError(f"monitor record: expected its shares' round {self.round}, found {self.masked.round}")

    def to_arrays(self) -> Arrays:
        if self.masked is not None:
            return {"kind": _kind(MONITOR_KIND), **self.masked.to_arrays()}
        return {"kind": _kind(MONITOR_KIND), "round": np.array([self.round])}

    @classmethod
    def from_arrays(cls, kind: str, arrays: Mapping[str, NDArray[Any]]) -> MonitorRecord:
        _names(kind, arrays, _masked_names(arrays) or ("round",))
        return cls(_one(kind, arrays, "round", "i"), MaskedShares.from_arrays(kind, arrays))


@dataclass(frozen=True, eq=False)
class KeysRecord:
    """Step 1 of a secagg session: the secrets behind the advertised keys and the fingerprint this client signed."""

    round: int
    fingerprint: str
    encryption_secret: bytes = field(repr=False)
    masking_secret: bytes = field(repr=False)
    self_seed: bytes = field(repr=False)

    def to_arrays(self) -> Arrays:
        return {
            "kind": _kind(KEYS_KIND),
            "round": np.array([self.round]),
            "fingerprint": np.array(self.fingerprint),
            "encryption_secret": u8(self.encryption_secret),
            "masking_secret": u8(self.masking_secret),
            "self_seed": u8(self.self_seed),
        }

    @classmethod
    def from_arrays(cls, kind: str, arrays: Mapping[str, NDArray[Any]]) -> KeysRecord:
        secrets = ("encryption_secret", "masking_secret", "self_seed")
        _names(kind, arrays, ("round", "fingerprint", *secrets))
        raw = [_array(kind, arrays, name, "u", 1).tobytes() for name in secrets]
        return cls(_one(kind, arrays, "round", "i"), _text(kind, arrays, "fingerprint"), *raw)


@dataclass(frozen=True, eq=False)
class SharesRecord:
    """Step 2 of a secagg session: the authenticated roster, this client's index in it, and m."""

    round: int
    own: int
    min_clients: int
    encryption_keys: NDArray[Any] = field(repr=False)
    masking_keys: NDArray[Any] = field(repr=False)
    identities: NDArray[Any] = field(repr=False)
    commitments: NDArray[Any] = field(repr=False)
    signatures: NDArray[Any] = field(repr=False)

    _ROSTER = ("encryption_keys", "masking_keys", "identities", "commitments", "signatures")

    def to_arrays(self) -> Arrays:
        return {
            "kind": _kind(SHARES_KIND),
            "round": np.array([self.round]),
            "own": np.array([self.own]),
            "min_clients": np.array([self.min_clients]),
            "encryption_keys": self.encryption_keys,
            "masking_keys": self.masking_keys,
            "identities": self.identities,
            "commitments": self.commitments,
            "signatures": self.signatures,
        }

    @classmethod
    def from_arrays(cls, kind: str, arrays: Mapping[str, NDArray[Any]]) -> SharesRecord:
        _names(kind, arrays, ("round", "own", "min_clients", *cls._ROSTER))
        counters = [_one(kind, arrays, name, "i") for name in ("round", "own", "min_clients")]
        return cls(*counters, *(arrays[name] for name in cls._ROSTER))


@dataclass(frozen=True, eq=False)
class CheckRecord:
    """The consistency check of a secagg session: the survivor set U3 and the dropped set this client signed."""

    round: int
    survivors: NDArray[np.int64] = field(repr=False)
    dropped: NDArray[np.int64] = field(repr=False)

    def to_arrays(self) -> Arrays:
        return {
            "kind": _kind(CHECK_KIND),
            "round": np.array([self.round]),
            "survivors": self.survivors,
            "dropped": self.dropped,
        }

    @classmethod
    def from_arrays(cls, kind: str, arrays: Mapping[str, NDArray[Any]]) -> CheckRecord:
        _names(kind, arrays, ("round", "survivors", "dropped"))
        return cls(
            _one(kind, arrays, "round", "i"),
            _array(kind, arrays, "survivors", "i", 1),
            _array(kind, arrays, "dropped", "i", 1),
        )


@dataclass(frozen=True, eq=False)
class UnmaskRecord:
    """Step 4 of a secagg session: the survivors U3 this client revealed shares for."""

    round: int
    survivors: NDArray[np.int64] = field(repr=False)

    def to_arrays(self) -> Arrays:
        return {"kind": _kind(UNMASK_KIND), "round": np.array([self.round]), "survivors": self.survivors}

    @classmethod
    def from_arrays(cls, kind: str, arrays: Mapping[str, NDArray[Any]]) -> UnmaskRecord:
        _names(kind, arrays, ("round", "survivors"))
        return cls(_one(kind, arrays, "round", "i"), _array(kind, arrays, "survivors", "i", 1))


ReleaseRecord = (
    GaussianRecord | RealisationRecord | MonitorRecord | KeysRecord | SharesRecord | CheckRecord | UnmaskRecord
)


def release_from_arrays(arrays: Mapping[str, NDArray[Any]]) -> ReleaseRecord:
    """The record a ledger stored, by its ``kind``; an unknown kind or a wrong array is a :class:`LedgerError`."""
    if "kind" not in arrays:
        raise LedgerError(f"release record: expected an array 'kind', found arrays {sorted(arrays)}")
    kind = _text("?", arrays, "kind")
    match kind:
        case "gradient" | "indicator" if "losses" in arrays:
            return RealisationRecord.from_arrays(kind, arrays)
        case "gradient" | "indicator":
            return GaussianRecord.from_arrays(kind, arrays)
        case "monitor":
            return MonitorRecord.from_arrays(kind, arrays)
        case "secagg-keys":
            return KeysRecord.from_arrays(kind, arrays)
        case "secagg-shares":
            return SharesRecord.from_arrays(kind, arrays)
        case "secagg-check":
            return CheckRecord.from_arrays(kind, arrays)
        case "secagg-unmask":
            return UnmaskRecord.from_arrays(kind, arrays)
        case _:
            known = [*CONTRIBUTION_KINDS, MONITOR_KIND, KEYS_KIND, SHARES_KIND, CHECK_KIND, UNMASK_KIND]
            raise LedgerError(f"release record: expected a kind in {known}, found {kind!r}")


def contribution_from_arrays(arrays: Mapping[str, NDArray[Any]]) -> GaussianRecord | RealisationRecord | None:
    """A stored gradient or indicator release (the only kinds that charge a filter), else None."""
    if "kind" not in arrays or _text("?", arrays, "kind") not in CONTRIBUTION_KINDS:
        return None  # a kind that is not one string is refused by _text (LedgerError), never skipped
    record = release_from_arrays(arrays)
    assert isinstance(record, GaussianRecord | RealisationRecord)  # dispatched on a contribution kind
    return record


def round_of(record: ReleaseRecord) -> int | None:
    """The session round a record stored (secagg steps, masked inputs and monitor reports), else None."""
    match record:
        case GaussianRecord() | RealisationRecord():
            return None if record.masked is None else record.masked.round
        case _:
            return record.round
