"""The wire contract between coordinator and client agents: kinds, keys, requests, replies.

Both sides import these constants and codecs; nothing else names a wire key. Decoding
goes through closed tables: a message type, a key, a trust mode or a predicate that
is not in its table is an error naming what was expected and what was found. A key
that is not part of a request kind is refused, so a request cannot smuggle in a new
budget (budgets live in the client's ledger and are never changed by a request,
privacy.md §9).

Content layout of a Flower message (both directions):
  RecordDict{ CONFIG: ConfigRecord(scalar fields), ARRAYS: ArrayRecord(named numpy arrays) }
This module works on the plain ``dict`` form of those two records; the Flower
conversion lives in :mod:`protocol.records`.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from protocol import secagg as sa
from protocol.errors import ProtocolError as ProtocolError
from protocol.validate import as_float, integer

CONFIG = "config"
ARRAYS = "arrays"

GRADIENT = "train.gradient"
INDICATOR = "query.indicator"
MONITOR = "query.monitor"
STATUS = "query.status"
# Secure aggregation (``secagg`` trust, protocol/secagg.py): the session's steps 1, 2, the consistency
# check and 4; step 3, the masked input, is a GRADIENT, INDICATOR or MONITOR request with trust
# 'secagg' and a SecaggInput.
SECAGG_KEYS = "query.secagg_keys"
SECAGG_SHARES = "query.secagg_shares"
SECAGG_CHECK = "query.secagg_check"
SECAGG_UNMASK = "query.secagg_unmask"
SECAGG_STEPS: tuple[str, ...] = (SECAGG_KEYS, SECAGG_SHARES, SECAGG_CHECK, SECAGG_UNMASK)
MESSAGE_TYPES: tuple[str, ...] = (GRADIENT, INDICATOR, MONITOR, STATUS, *SECAGG_STEPS)

# local: each client adds N(0, sigma^2); central: the trusted coordinator adds it once; secagg: each
# client adds N(0, sigma^2 / m) and masks its input, the coordinator learns only the sum of >= m inputs.
TRUST_MODES: tuple[str, ...] = ("local", "central", "secagg")
UNITS: tuple[str, ...] = ("client", "record")
# How an indicator request's client unit folds its records' rows (IndicatorRequest.reduce).
REDUCTIONS: tuple[str, ...] = ("sum", "mean")

# An indicator query names a query of the client's workload (workloads/registry.py): any name of
# letters, digits, '_', '.', '-' decodes; a name the client's workload does not register is refused
# by the agent (malformed). The built-in workload's queries (workloads/builtin.py):
#   column     indicator = X[:, column] != 0            (sparse counting queries, FZ Thm 1.2)
#   label      indicator = y == value
#   threshold  indicator = X[:, column] > value
#   correct    indicator = the request's model classifies the record correctly (training accuracy,
#              for a private plateau test; the request then carries model, model_args, parameters)
PREDICATES: tuple[str, ...] = ("column", "label", "threshold", "correct")
# A model's parameter layout (workloads.registry.layout_fingerprint): SHA-256 hex of its (name, shape, dtype) list.
LAYOUT_HEX = 64

# Error codes of typed Error replies (Flower ``Error(code, reason)``).
ERR_MALFORMED = 4001  # the request does not decode
ERR_POLICY = 4003  # the request breaks the client's policy
ERR_REPLAY = 4009  # a request id reused with other content
ERR_LEDGER = 4010  # the ledger is corrupt, missing or mismatched: the client refuses to answer
ERR_INTERNAL = 4050  # anything else; nothing was charged or sent
ERR_UNAVAILABLE = 4503  # the deployed proxy could not reach the agent service; nothing reached it
ERROR_NAMES: dict[int, str] = {
    ERR_MALFORMED: "malformed",
    ERR_POLICY: "policy",
    ERR_REPLAY: "replay",
    ERR_LEDGER: "ledger",
    ERR_INTERNAL: "internal",
    ERR_UNAVAILABLE: "unavailable",
}
# The only text an error reply carries: fixed per code, never an exception's message, which may
# depend on the client's data, files or ledger (privacy.md §8). Details stay in the client's log.
ERROR_TEXT: dict[int, str] = {
    ERR_MALFORMED: "malformed: the request does not decode or does not fit this client "
    "(details in the client's log); nothing was released",
    ERR_POLICY: "policy: the request is outside this client's policy (its status reply states the policy; "
    "details in the client's log); nothing was released",
    ERR_REPLAY: "replay: this request id was already answered with other content; nothing was released",
    ERR_LEDGER: "ledger: the client's ledger or configuration cannot answer (details in the client's log); "
    "nothing was released",
    ERR_INTERNAL: "internal: the client could not answer (details in the client's log); nothing was released",
    ERR_UNAVAILABLE: "unavailable: agent unavailable (the node's proxy could not reach its agent service); "
    "nothing was released",
}


def error_name(code: int) -> str:
    """A readable name for an Error reply's code (Flower's own codes keep their number)."""
    return ERROR_NAMES.get(code, f"flower-{code}")


# --- field validation ---------------------------------------------------------------


# The largest integer field a request may carry: rounds, columns and bounds are stored as int64 in
# the ledger, so a larger one would fail after the work was done (an uncharged internal error).
MAX_WIRE_INT = 2**53


def _require(config: Mapping[str, Any], key: str, kind: str) -> Any:
    if key not in config:
        raise ProtocolError(f"{kind}: missing key {key!r}")
    return config[key]


def _str(config: Mapping[str, Any], key: str, kind: str, *, choices: tuple[str, ...] | None = None) -> str:
    value = _require(config, key, kind)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{kind}: {key!r} must be a non-empty string, got {value!r}")
    if len(value) > 256:
        raise ProtocolError(f"{kind}: {key!r} must be at most 256 characters, got {len(value)}")
    if choices is not None and value not in choices:
        raise ProtocolError(f"{kind}: {key!r} must be one of {choices}, got {value!r}")
    return value


def _int(config: Mapping[str, Any], key: str, kind: str, *, minimum: int = 0, maximum: int = MAX_WIRE_INT) -> int:
    value = _require(config, key, kind)
    return integer(f"{kind}: {key!r}", value, at_least=minimum, at_most=maximum, error=ProtocolError)


def _positive(config: Mapping[str, Any], key: str, kind: str) -> float:
    value = _require(config, key, kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{kind}: {key!r} must be a number, got {value!r} ({type(value).__name__})")
    out = as_float(f"{kind}: {key!r}", value, error=ProtocolError)
    if not math.isfinite(out) or out <= 0:
        raise ProtocolError(f"{kind}: {key!r} must be a finite number > 0, got {value!r}")
    return out


_TINY = sys.float_info.min  # the smallest normal float64


def _normal(x: float) -> bool:
    """True for a finite, normal float64 (not zero, not subnormal, not infinite or NaN)."""
    return math.isfinite(x) and abs(x) >= _TINY


def _noise_and_clip(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """``noise_std`` and ``l2_clip``, refused unless their squares and ratios are finite normal numbers.

    Privacy note: the charge is (norm / noise_std)^2 per unit. A subnormal noise_std (1e-310)
    passes a "finite and > 0" check, yet 1 / noise_std overflows and NaN would be committed as
    every unit's spend, bricking the ledger; an extreme ratio overflows the same way. Refusing such
    pairs at the wire keeps every cost a finite float (privacy.md §3: a non-finite parameter is an error).
    """
    sigma = _positive(config, "noise_std", kind)
    clip = _positive(config, "l2_clip", kind)
    derived = {
        "noise_std^2": sigma * sigma,
        "l2_clip^2": clip * clip,
        "l2_clip / noise_std": clip / sigma,
        "noise_std / l2_clip": sigma / clip,
    }
    ratio = clip / sigma
    derived["(l2_clip / noise_std)^2"] = ratio * ratio
    for name, value in derived.items():
        if not _normal(value):
            raise ProtocolError(
                f"{kind}: noise_std {sigma!r} and l2_clip {clip!r} give {name} = {value!r}; expected every "
                "square and ratio of the two to be a finite normal number"
            )
    return {"noise_std": sigma, "l2_clip": clip}


def _real(config: Mapping[str, Any], key: str, kind: str) -> float:
    value = _require(config, key, kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{kind}: {key!r} must be a finite number, got {value!r}")
    out = as_float(f"{kind}: {key!r}", value, error=ProtocolError)
    if not math.isfinite(out):
        raise ProtocolError(f"{kind}: {key!r} must be a finite number, got {value!r}")
    return out


def _no_extra(
    config: Mapping[str, Any], arrays: Mapping[str, Any], kind: str, keys: set[str], array_keys: set[str]
) -> None:
    for key in config:
        if key not in keys:
            hint = ""
            if key in {"epsilon", "delta", "budget", "mu_budget", "rho_budget", "threshold", "spent", "reset"}:
                hint = ": budgets are fixed in the client's ledger and are never changed by a request"
            raise ProtocolError(f"{kind}: unexpected key {key!r}; expected only {sorted(keys)}{hint}")
    for key in arrays:
        if key not in array_keys:
            raise ProtocolError(f"{kind}: unexpected array {key!r}; expected only {sorted(array_keys)}")


def _flat_finite(arrays: Mapping[str, Any], key: str, kind: str, *, max_size: int) -> NDArray[np.float32]:
    if key not in arrays:
        raise ProtocolError(f"{kind}: missing array {key!r}")
    arr = arrays[key]
    if not isinstance(arr, np.ndarray):
        raise ProtocolError(f"{kind}: array {key!r} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.float32:
        raise ProtocolError(f"{kind}: array {key!r} must have dtype float32, got {arr.dtype}")
    if arr.ndim != 1:
        raise ProtocolError(f"{kind}: array {key!r} must be 1-dimensional, got shape {arr.shape}")
    if arr.size > max_size:
        raise ProtocolError(f"{kind}: array {key!r} has {arr.size} values, more than the wire limit {max_size}")
    if not np.all(np.isfinite(arr)):
        raise ProtocolError(f"{kind}: array {key!r} contains NaN or infinite values")
    return arr


# Hard wire limit, before any client policy: 2^28 values (1 GiB of float32 parameters). An agent's own
# policy-max-model-params is lower where its replies must fit its ledger (client_agent/config.py).
WIRE_MAX_VALUES = 1 << 28


# --- requests -------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SecaggInput:
    """What a masked-input request (secure aggregation step 3) adds: the session, fixed point and U2.

    ``peers`` lists the roster indices of U2 (the clients whose shares were delivered), and
    ``ciphertexts`` row i the shares peer ``peers[i]`` sealed for this client. Each client's
    encoded value must lie within [-value_bound, value_bound] at scale 2^scale_bits.
    """

    session: str
    scale_bits: int
    value_bound: int
    peers: NDArray[np.int64] = field(repr=False)
    ciphertexts: NDArray[np.uint8] = field(repr=False)


@dataclass(frozen=True, eq=False)
class RequestBase:
    """Fields every request carries: its id (idempotency key), the run id and the round."""

    request_id: str
    run_id: str
    round: int


@dataclass(frozen=True, eq=False)
class GradientRequest(RequestBase):
    """One round of federated GD: each unit's clipped loss gradient at ``parameters`` (FZ Alg. 3).

    Privacy: the reply is the sum of the units' clipped gradients (plus N(0, noise_std^2 I)
    in local trust); each unit is charged ||clipped gradient||^2 / noise_std^2.
    """

    noise_std: float
    l2_clip: float
    trust: str
    unit: str
    model: str
    model_args: str  # canonical JSON of the model's constructor arguments
    parameters: NDArray[np.float32] = field(repr=False)
    secagg: SecaggInput | None = field(default=None, repr=False)  # trust 'secagg' only
    # Local training (``client`` units only; DP-FedAvg, McMahan et al. 2018): with local_steps > 0
    # the client's one row is its update theta_local - parameters after local_steps steps of
    # minibatch SGD (learning rate local_lr, batches of local_batch_size records), released and
    # charged exactly like a client-unit gradient row. 0 (the default) is a gradient request;
    # the three keys are on the wire only when local_steps > 0, so older messages decode unchanged.
    local_steps: int = 0
    local_lr: float | None = None
    local_batch_size: int | None = None
    # The coordinator's parameter layout of ``model`` (workloads.registry.layout_fingerprint); the
    # client refuses the request when its own build of the named model has another. Optional on the wire.
    layout: str | None = None


@dataclass(frozen=True, eq=False)
class IndicatorRequest(RequestBase):
    """An adaptive counting query: each unit's indicator of a predicate on its data (FZ Thm 1.2).

    Privacy: in ``record`` units each record contributes its 0/1 indicator, clipped by
    partial clipping; in ``client`` units the client's count (``reduce`` 'sum') or the mean of its
    records' rows (``reduce`` 'mean': a fraction in [0, 1] for a 0/1 query, e.g. the client's
    training accuracy for private model selection), clipped to ``l2_clip``. Either is a function of
    the unit's own data, so the charge is the same argument (privacy.md §2); in ``record`` units
    each unit holds one record and the two are the same.
    """

    noise_std: float
    l2_clip: float
    trust: str
    unit: str
    predicate: str
    column: int
    value: float
    model: str | None = None  # queries that need a model only (e.g. 'correct')
    model_args: str | None = None
    parameters: NDArray[np.float32] | None = field(default=None, repr=False)
    secagg: SecaggInput | None = field(default=None, repr=False)  # trust 'secagg' only
    layout: str | None = None  # with a model: its parameter layout, as in GradientRequest
    # How a client unit folds its records' rows: 'sum' (the default, left off the wire so a request has
    # one encoding) or 'mean'.
    reduce: str = "sum"


@dataclass(frozen=True, eq=False)
class MonitorRequest(RequestBase):
    """The active-set monitor's per-round report (privacy.md §7); its cost is reserved at enrolment.

    ``noise_std`` (secagg trust only, and required there): the node noise std sigma_m of the
    session. Each client adds N(0, noise_std^2 / m) and refuses a value below the one it reserved;
    the fingerprint makes it one value for the whole session, so a sum of m reports carries at
    least every member's reserved node noise.
    """

    trust: str
    secagg: SecaggInput | None = field(default=None, repr=False)  # trust 'secagg' only
    noise_std: float | None = None  # trust 'secagg' only


@dataclass(frozen=True, eq=False)
class SecaggKeysRequest(RequestBase):
    """Secure aggregation step 1: open a session with fresh keys; this request's id names the session.

    ``fingerprint`` is the :func:`session_fingerprint` of the step-3 request the session will sum:
    each client signs it with its advertisement and answers step 3 only for a request with that
    fingerprint, so a coordinator cannot send one client another model within a session.

    Privacy: the reply holds two public keys, a commitment to the self-mask seed and a signature,
    drawn before and independently of any data.
    """

    trust: str
    fingerprint: str


@dataclass(frozen=True, eq=False)
class SecaggSharesRequest(RequestBase):
    """Secure aggregation step 2: the roster U1 (public keys by index) and the threshold m; reply: sealed shares."""

    trust: str
    session: str
    min_clients: int
    encryption_keys: NDArray[np.uint8] = field(repr=False)
    masking_keys: NDArray[np.uint8] = field(repr=False)
    fingerprint: str = ""
    identities: NDArray[np.uint8] = field(default_factory=lambda: np.zeros((0, sa.KEY_BYTES), np.uint8), repr=False)
    commitments: NDArray[np.uint8] = field(default_factory=lambda: np.zeros((0, sa.KEY_BYTES), np.uint8), repr=False)
    signatures: NDArray[np.uint8] = field(
        default_factory=lambda: np.zeros((0, sa.SIGNATURE_BYTES), np.uint8), repr=False
    )


@dataclass(frozen=True, eq=False)
class SecaggCheckRequest(RequestBase):
    """Secure aggregation consistency check: U3 and U2 \\ U3; reply: this client's signature over them.

    Each client signs one survivor set per session, ever (Bonawitz et al. 2017, Fig. 4, round 3
    of the malicious variant).
    """

    trust: str
    session: str
    survivors: NDArray[np.int64] = field(repr=False)
    dropped: NDArray[np.int64] = field(repr=False)


@dataclass(frozen=True, eq=False)
class SecaggUnmaskRequest(RequestBase):
    """Secure aggregation step 4: U3, U2 \\ U3 and at least m survivors' signatures over them.

    Reply: one share per peer of U2 (the self-mask seed's for U3, the masking key's for the dropped).
    """

    trust: str
    session: str
    survivors: NDArray[np.int64] = field(repr=False)
    dropped: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    signers: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    signatures: NDArray[np.uint8] = field(
        default_factory=lambda: np.zeros((0, sa.SIGNATURE_BYTES), np.uint8), repr=False
    )


@dataclass(frozen=True, eq=False)
class StatusRequest(RequestBase):
    """What the client accepts: its filter, target, unit, trust and policy (public configuration, no spend).

    With ``model`` and ``model_args`` (both or neither), the reply also gives the parameter layout
    fingerprint of that model as the client's workload builds it (names, shapes, dtypes: no data),
    so that enrolment can check every client reads the run's flat parameter vector the same way.
    """

    model: str | None = None
    model_args: str | None = None


Request = (
    GradientRequest
    | IndicatorRequest
    | MonitorRequest
    | StatusRequest
    | SecaggKeysRequest
    | SecaggSharesRequest
    | SecaggCheckRequest
    | SecaggUnmaskRequest
)
SecaggStepRequest = SecaggKeysRequest | SecaggSharesRequest | SecaggCheckRequest | SecaggUnmaskRequest

_BASE_KEYS = {"request_id", "run_id", "round"}
_GRADIENT_KEYS = _BASE_KEYS | {"noise_std", "l2_clip", "trust", "unit", "model", "model_args"}
_LOCAL_TRAINING_KEYS = {"local_steps", "local_lr", "local_batch_size"}
_INDICATOR_KEYS = _BASE_KEYS | {"noise_std", "l2_clip", "trust", "unit", "predicate", "column", "value", "reduce"}
_MODEL_KEYS = {"model", "model_args", "layout"}
_MONITOR_KEYS = _BASE_KEYS | {"trust"}
_SECAGG_INPUT_KEYS = {"secagg_session", "secagg_scale_bits", "secagg_value_bound"}
_SECAGG_INPUT_ARRAYS = {"secagg_peers", "secagg_ciphertexts"}
_SECAGG_TRUST = ("secagg",)


def _id(config: Mapping[str, Any], key: str, kind: str) -> str:
    """A request or session id: '|' is reserved (the client stores secagg steps as '<session>|<step>')."""
    value = _str(config, key, kind)
    if "|" in value:
        raise ProtocolError(f"{kind}: {key!r} must not contain '|' (reserved), got {value!r}")
    return value


def _base(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    return {
        "request_id": _id(config, "request_id", kind),
        "run_id": _str(config, "run_id", kind),
        "round": _int(config, "round", kind, minimum=0),
    }


def decode_request(message_type: str, config: Mapping[str, Any], arrays: Mapping[str, Any]) -> Request:
    """Decode and validate a request through the closed table of message types."""
    if message_type not in MESSAGE_TYPES:
        raise ProtocolError(f"message type: expected one of {MESSAGE_TYPES}, got {message_type!r}")
    kind = message_type
    if message_type in SECAGG_STEPS:
        return _decode_secagg_step(message_type, config, arrays)
    secagg = config.get("trust") == "secagg" and message_type in (GRADIENT, INDICATOR, MONITOR)
    extra_keys, extra_arrays = (_SECAGG_INPUT_KEYS, _SECAGG_INPUT_ARRAYS) if secagg else (set(), set())
    masked: dict[str, Any] = {"secagg": _secagg_input(config, arrays, kind)} if secagg else {}
    if message_type == GRADIENT:
        keys = _GRADIENT_KEYS | _LOCAL_TRAINING_KEYS | {"layout"} | extra_keys
        _no_extra(config, arrays, kind, keys, {"parameters"} | extra_arrays)
        unit = _str(config, "unit", kind, choices=UNITS)
        return GradientRequest(
            **_base(config, kind),
            **_noise_and_clip(config, kind),
            trust=_str(config, "trust", kind, choices=TRUST_MODES),
            unit=unit,
            model=_str(config, "model", kind),
            model_args=_model_args(config, kind),
            parameters=_flat_finite(arrays, "parameters", kind, max_size=WIRE_MAX_VALUES),
            **masked,
            **_local_training(config, kind, unit),
            **_layout(config, kind),
        )
    if message_type == INDICATOR:
        if "model" in config or "parameters" in arrays:  # a query that needs a model carries all of it
            _no_extra(config, arrays, kind, _INDICATOR_KEYS | _MODEL_KEYS | extra_keys, {"parameters"} | extra_arrays)
            model: dict[str, Any] = {
                "model": _str(config, "model", kind),
                "model_args": _model_args(config, kind),
                "parameters": _flat_finite(arrays, "parameters", kind, max_size=WIRE_MAX_VALUES),
                **_layout(config, kind),
            }
        else:
            _no_extra(config, arrays, kind, _INDICATOR_KEYS | extra_keys, extra_arrays)
            model = {}
        unit = _str(config, "unit", kind, choices=UNITS)
        return IndicatorRequest(
            **_base(config, kind),
            **_noise_and_clip(config, kind),
            trust=_str(config, "trust", kind, choices=TRUST_MODES),
            unit=unit,
            predicate=_name(config, "predicate", kind),
            column=_int(config, "column", kind, minimum=0),
            value=_real(config, "value", kind),
            **model,
            **masked,
            **_reduce(config, kind, unit),
        )
    if message_type == MONITOR:
        noise: dict[str, Any] = {"noise_std": _positive(config, "noise_std", kind)} if secagg else {}
        _no_extra(config, arrays, kind, _MONITOR_KEYS | extra_keys | set(noise), extra_arrays)
        return MonitorRequest(
            **_base(config, kind), trust=_str(config, "trust", kind, choices=TRUST_MODES), **masked, **noise
        )
    _no_extra(config, arrays, kind, _BASE_KEYS | {"model", "model_args"}, set())
    if ("model" in config) != ("model_args" in config):
        raise ProtocolError(f"{kind}: expected 'model' and 'model_args' together or neither, got one")
    named: dict[str, Any] = (
        {"model": _str(config, "model", kind), "model_args": _model_args(config, kind)} if "model" in config else {}
    )
    return StatusRequest(**_base(config, kind), **named)


def _uint8_table(arrays: Mapping[str, Any], key: str, kind: str, *, rows: int | None, width: int) -> NDArray[np.uint8]:
    """A uint8[rows, width] array (any number of rows when ``rows`` is None, up to the session limit)."""
    if key not in arrays:
        raise ProtocolError(f"{kind}: missing array {key!r}")
    arr = arrays[key]
    ok = isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and arr.ndim == 2 and arr.shape[1] == width
    if not ok or (rows is not None and arr.shape[0] != rows) or arr.shape[0] > sa.MAX_CLIENTS:
        found = sa.found_array(arr)
        want = f"uint8[{rows if rows is not None else 'n'}, {width}]"
        raise ProtocolError(f"{kind}: array {key!r} must be {want}, got {found}")
    out: NDArray[np.uint8] = arr
    return out


def _index_list(arrays: Mapping[str, Any], key: str, kind: str) -> NDArray[np.int64]:
    """A 1-d int64 array of roster indices, at most the session limit long."""
    if key not in arrays:
        raise ProtocolError(f"{kind}: missing array {key!r}")
    arr = arrays[key]
    if not isinstance(arr, np.ndarray) or arr.dtype != np.int64 or arr.ndim != 1 or arr.size > sa.MAX_CLIENTS:
        found = sa.found_array(arr)
        raise ProtocolError(f"{kind}: array {key!r} must be a 1-d int64 list of roster indices, got {found}")
    return arr


def _secagg_input(config: Mapping[str, Any], arrays: Mapping[str, Any], kind: str) -> SecaggInput:
    scale_bits = _int(config, "secagg_scale_bits", kind, minimum=0)
    if scale_bits > sa.MAX_SCALE_BITS:
        raise ProtocolError(f"{kind}: 'secagg_scale_bits' must be <= {sa.MAX_SCALE_BITS}, got {scale_bits}")
    bound = _int(config, "secagg_value_bound", kind, minimum=1, maximum=sys.maxsize * 4)  # checked just below
    if bound > sa.SUM_LIMIT:
        raise ProtocolError(f"{kind}: 'secagg_value_bound' must be <= 2^63 - 1, got {bound}")
    peers = _index_list(arrays, "secagg_peers", kind)
    return SecaggInput(
        session=_id(config, "secagg_session", kind),
        scale_bits=scale_bits,
        value_bound=bound,
        peers=peers,
        ciphertexts=_uint8_table(arrays, "secagg_ciphertexts", kind, rows=peers.size, width=sa.CIPHERTEXT_BYTES),
    )


def _decode_secagg_step(message_type: str, config: Mapping[str, Any], arrays: Mapping[str, Any]) -> Request:
    kind = message_type
    if message_type == SECAGG_KEYS:
        _no_extra(config, arrays, kind, _BASE_KEYS | {"trust", "fingerprint"}, set())
        return SecaggKeysRequest(
            **_base(config, kind),
            trust=_str(config, "trust", kind, choices=_SECAGG_TRUST),
            fingerprint=_fingerprint(config, kind),
        )
    common: dict[str, Any] = {
        "trust": _str(config, "trust", kind, choices=_SECAGG_TRUST),
        "session": _id(config, "session", kind),
    }
    if message_type == SECAGG_SHARES:
        _no_extra(
            config,
            arrays,
            kind,
            _BASE_KEYS | {"trust", "session", "min_clients", "fingerprint"},
            {"encryption_keys", "masking_keys", "identities", "commitments", "signatures"},
        )
        enc = _uint8_table(arrays, "encryption_keys", kind, rows=None, width=sa.KEY_BYTES)
        n = enc.shape[0]
        return SecaggSharesRequest(
            **_base(config, kind),
            **common,
            min_clients=_int(config, "min_clients", kind, minimum=sa.MIN_CLIENTS),
            encryption_keys=enc,
            masking_keys=_uint8_table(arrays, "masking_keys", kind, rows=n, width=sa.KEY_BYTES),
            fingerprint=_fingerprint(config, kind),
            identities=_uint8_table(arrays, "identities", kind, rows=n, width=sa.KEY_BYTES),
            commitments=_uint8_table(arrays, "commitments", kind, rows=n, width=sa.KEY_BYTES),
            signatures=_uint8_table(arrays, "signatures", kind, rows=n, width=sa.SIGNATURE_BYTES),
        )
    if message_type == SECAGG_CHECK:
        _no_extra(config, arrays, kind, _BASE_KEYS | {"trust", "session"}, {"survivors", "dropped"})
        return SecaggCheckRequest(
            **_base(config, kind),
            **common,
            survivors=_index_list(arrays, "survivors", kind),
            dropped=_index_list(arrays, "dropped", kind),
        )
    _no_extra(
        config, arrays, kind, _BASE_KEYS | {"trust", "session"}, {"survivors", "dropped", "signers", "signatures"}
    )
    signers = _index_list(arrays, "signers", kind)
    return SecaggUnmaskRequest(
        **_base(config, kind),
        **common,
        survivors=_index_list(arrays, "survivors", kind),
        dropped=_index_list(arrays, "dropped", kind),
        signers=signers,
        signatures=_uint8_table(arrays, "signatures", kind, rows=signers.size, width=sa.SIGNATURE_BYTES),
    )


def _fingerprint(config: Mapping[str, Any], kind: str) -> str:
    """A request fingerprint: 64 lowercase hex characters (SHA-256)."""
    value = _str(config, "fingerprint", kind)
    if len(value) != sa.FINGERPRINT_CHARS or any(c not in "0123456789abcdef" for c in value):
        raise ProtocolError(f"{kind}: 'fingerprint' must be 64 lowercase hex characters (SHA-256), got {value!r:.80}")
    return value


def _reduce(config: Mapping[str, Any], kind: str, unit: str) -> dict[str, Any]:
    """An indicator request's optional ``reduce``: 'mean' with client units, or left out for 'sum' (one
    encoding per request; a record unit holds one record, so 'mean' would only be a second name for it)."""
    if "reduce" not in config:
        return {}
    value = _str(config, "reduce", kind)
    if value != "mean":
        raise ProtocolError(f"{kind}: 'reduce' must be 'mean' when given (leave it out for 'sum'), got {value!r:.80}")
    if unit != "client":
        raise ProtocolError(f"{kind}: 'reduce' 'mean' folds a client unit's records; got it with unit {unit!r}")
    return {"reduce": value}


def _local_training(config: Mapping[str, Any], kind: str, unit: str) -> dict[str, Any]:
    """A gradient request's local-training fields: none of them, or all three with local_steps >= 1.

    The wire form is canonical: local_steps = 0 is written by leaving the three keys out, so a
    request has one encoding (its digest is the replay key, privacy.md §9).
    """
    present = sorted(_LOCAL_TRAINING_KEYS & set(config))
    if not present:
        return {}
    if "local_steps" not in config:
        raise ProtocolError(f"{kind}: {present} given without 'local_steps'; expected all three keys or none")
    steps = _int(config, "local_steps", kind, minimum=1)
    if unit != "client":
        raise ProtocolError(
            f"{kind}: 'local_steps' {steps} asked with unit {unit!r}; per-record units cannot train locally "
            "(a local update mixes every record of the client: use unit 'client')"
        )
    return {
        "local_steps": steps,
        "local_lr": _positive(config, "local_lr", kind),
        "local_batch_size": _int(config, "local_batch_size", kind, minimum=1),
    }


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _name(config: Mapping[str, Any], key: str, kind: str) -> str:
    """A registry name (a model or query of the client's workload): looked up by the client, never imported."""
    value = _str(config, key, kind)
    if len(value) > 64 or not set(value) <= _NAME_CHARS:
        raise ProtocolError(
            f"{kind}: {key!r} must be a name of at most 64 letters, digits, '_', '.', '-', got {value[:80]!r}"
        )
    return value


def _layout(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The optional ``layout`` key: 64 lowercase hex digits (a SHA-256), or nothing."""
    if "layout" not in config:
        return {}
    value = _str(config, "layout", kind)
    if len(value) != LAYOUT_HEX or not set(value) <= set("0123456789abcdef"):
        raise ProtocolError(f"{kind}: 'layout' must be {LAYOUT_HEX} lowercase hex digits (SHA-256), got {value[:80]!r}")
    return {"layout": value}


def _model_args(config: Mapping[str, Any], kind: str) -> str:
    """The canonical JSON of a request's model constructor arguments."""
    model_args = _str(config, "model_args", kind) if config.get("model_args") != "" else ""
    try:
        parsed = json.loads(model_args or "{}")
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"{kind}: 'model_args' must be JSON, got {model_args!r}") from exc
    if not isinstance(parsed, dict):
        raise ProtocolError(f"{kind}: 'model_args' must be a JSON object, got {model_args!r}")
    return json.dumps(parsed, sort_keys=True)


def message_type_of(request: Request) -> str:
    """The wire message type of a request object."""
    table: dict[type, str] = {
        GradientRequest: GRADIENT,
        IndicatorRequest: INDICATOR,
        MonitorRequest: MONITOR,
        StatusRequest: STATUS,
        SecaggKeysRequest: SECAGG_KEYS,
        SecaggSharesRequest: SECAGG_SHARES,
        SecaggCheckRequest: SECAGG_CHECK,
        SecaggUnmaskRequest: SECAGG_UNMASK,
    }
    return table[type(request)]


def encode_request(request: Request) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
    """The (config, arrays) form of a request, the inverse of :func:`decode_request` (None fields are left out)."""
    config: dict[str, Any] = {}
    arrays: dict[str, NDArray[Any]] = {}
    for f in fields(request):
        value = getattr(request, f.name)
        # Defaults left off the wire (one encoding per request): 0 local steps, the 'sum' reduction.
        if value is None or (f.name == "local_steps" and value == 0) or (f.name == "reduce" and value == "sum"):
            continue
        if isinstance(value, SecaggInput):
            config.update(
                secagg_session=value.session, secagg_scale_bits=value.scale_bits, secagg_value_bound=value.value_bound
            )
            arrays.update(secagg_peers=value.peers, secagg_ciphertexts=value.ciphertexts)
        elif isinstance(value, np.ndarray):
            arrays[f.name] = value
        else:
            config[f.name] = value
    return config, arrays


def session_fingerprint(request: GradientRequest | IndicatorRequest | MonitorRequest, scale_bits: int) -> str:
    """SHA-256 of a step-3 request's content apart from its id and its per-client U2 and shares.

    Every client of a secagg session must be asked the same question (the same model and
    parameters, noise, clip, predicate) at the same fixed-point scale: the keys request carries
    this fingerprint, each client signs it, and each answers step 3 only for a request that has
    it. Another model for one client is the model-inconsistency attack (Pasquini et al., CCS
    2022); another scale for one client would shrink every other input in the decoded sum by
    2^(k - k') and leave that client's input with only its own noise share.
    """
    config, arrays = encode_request(replace(request, request_id="-", secagg=None))
    config["secagg_scale_bits"] = scale_bits
    return request_digest(message_type_of(request), config, arrays)


def request_digest(message_type: str, config: Mapping[str, Any], arrays: Mapping[str, NDArray[Any]]) -> str:
    """SHA-256 of a request's canonical form: reusing an id with other content changes it."""
    h = hashlib.sha256()
    h.update(message_type.encode())
    h.update(json.dumps({k: config[k] for k in sorted(config)}, sort_keys=True, default=repr).encode())
    for key in sorted(arrays):
        arr = np.ascontiguousarray(arrays[key])
        h.update(f"|{key}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


# --- replies ----------------------------------------------------------------------------

REPLY_OK = "ok"
REPLY_EXHAUSTED = "exhausted"


def reply_dtype(trust: str) -> type[np.floating[Any]]:
    """The dtype of a reply's ``total`` in ``trust`` (public, never the data's): float64 in central trust,
    float32 otherwise.

    Privacy note: a central-trust reply is the client's exact float64 sum, with no noise yet. Rounding it
    to float32 before the coordinator's noise moved the released sum by up to an ulp of the sum in every
    coordinate when one record came or went: a record charged 5.6e-5 moved it by 2.0e-4
    (tests/unit/test_reply_precision.py). In local trust the client's noise is added in float64 first, so
    rounding the noisy sum is post-processing.
    """
    return np.float64 if trust == "central" else np.float32


@dataclass(frozen=True, eq=False)
class ContributionReply:
    """A client's answer to a gradient or indicator request.

    ``total`` is the sum of its units' clipped contributions; in local trust the client
    has added N(0, noise_std^2 I) and the reply has the same keys, shapes and dtypes
    whether or not any unit is still active (privacy.md §8). In central trust an
    exhausted client may answer ``status="exhausted"`` with an empty total. The agent sends
    :func:`reply_dtype` of its trust: float64 (the exact sum) in central trust, float32 otherwise.
    """

    request_id: str
    status: str
    trust: str
    noise_added: float  # std of the noise the client added (0 in central trust)
    total: NDArray[np.floating[Any]] = field(repr=False)

    def encode(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        return (
            {
                "request_id": self.request_id,
                "status": self.status,
                "trust": self.trust,
                "noise_added": self.noise_added,
            },
            {"total": self.total},
        )

    @classmethod
    def decode(cls, config: Mapping[str, Any], arrays: Mapping[str, Any]) -> ContributionReply:
        kind = "reply"
        _no_extra(config, arrays, kind, {"request_id", "status", "trust", "noise_added"}, {"total"})
        total = arrays.get("total")
        if not isinstance(total, np.ndarray) or total.dtype not in (np.float32, np.float64) or total.ndim != 1:
            raise ProtocolError(f"reply: 'total' must be a 1-d float32 or float64 array, got {total!r:.80}")
        # Either dtype in any trust: the agent is what keeps a central reply exact (reply_dtype), and a reply
        # an earlier version stored in float32 is replayed as stored, byte for byte (a resumed run, a retry).
        trust = _str(config, "trust", kind, choices=TRUST_MODES)
        if not np.all(np.isfinite(total)):
            raise ProtocolError("reply: 'total' contains NaN or infinite values")
        raw = config.get("noise_added")
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ProtocolError(f"reply: 'noise_added' must be a finite number >= 0, got {raw!r}")
        noise_added = as_float("reply: 'noise_added'", raw, error=ProtocolError)
        if not math.isfinite(noise_added) or noise_added < 0:
            raise ProtocolError(f"reply: 'noise_added' must be a finite number >= 0, got {raw!r}")
        return cls(
            request_id=_str(config, "request_id", kind),
            status=_str(config, "status", kind, choices=(REPLY_OK, REPLY_EXHAUSTED)),
            trust=trust,
            noise_added=noise_added,
            total=total,
        )


@dataclass(frozen=True)
class StatusReply:
    """The client's public configuration: what it accepts. Holds no spend (that is private)."""

    request_id: str
    description: str  # canonical JSON

    def encode(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        return {"request_id": self.request_id, "description": self.description}, {}

    @classmethod
    def decode(cls, config: Mapping[str, Any], arrays: Mapping[str, Any]) -> StatusReply:
        kind = "status reply"
        _no_extra(config, arrays, kind, {"request_id", "description"}, set())
        description = _require(config, "description", kind)
        if not isinstance(description, str):
            raise ProtocolError(f"{kind}: 'description' must be a JSON string, got {type(description).__name__}")
        try:
            parsed = json.loads(description)
        except (ValueError, RecursionError) as exc:  # not JSON; an integer over 4,300 digits; nesting too deep
            raise ProtocolError(f"{kind}: 'description' must be JSON, got {description[:80]!r}") from exc
        if not isinstance(parsed, dict) or "ledger" not in parsed or "policy" not in parsed:
            raise ProtocolError(
                f"{kind}: 'description' must be an object with 'ledger' and 'policy', got {parsed!r:.80}"
            )
        return cls(request_id=_str(config, "request_id", kind), description=description)

    def parsed(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.description)
        return out


# --- secure aggregation replies -----------------------------------------------------------------


def _key_bytes(arrays: Mapping[str, Any], key: str, kind: str) -> NDArray[np.uint8]:
    arr = arrays.get(key)
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.shape != (sa.KEY_BYTES,):
        found = sa.found_array(arr)
        raise ProtocolError(f"{kind}: array {key!r} must be uint8[{sa.KEY_BYTES}], got {found}")
    return arr


@dataclass(frozen=True, eq=False)
class SecaggKeysReply:
    """Step 1's answer: the session's two public keys and the commitment SHA-256(b_u) to the self-mask seed."""

    request_id: str
    session: str
    encryption_key: NDArray[np.uint8] = field(repr=False)
    masking_key: NDArray[np.uint8] = field(repr=False)
    seed_commitment: NDArray[np.uint8] = field(repr=False)
    identity: NDArray[np.uint8] = field(repr=False)  # the client's long-term Ed25519 key
    signature: NDArray[np.uint8] = field(repr=False)  # over protocol.secagg.advert_message

    def encode(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        return (
            {"request_id": self.request_id, "session": self.session},
            {
                "encryption_key": self.encryption_key,
                "masking_key": self.masking_key,
                "seed_commitment": self.seed_commitment,
                "identity": self.identity,
                "signature": self.signature,
            },
        )

    @classmethod
    def decode(cls, config: Mapping[str, Any], arrays: Mapping[str, Any]) -> SecaggKeysReply:
        kind = "secagg keys reply"
        names = {"encryption_key", "masking_key", "seed_commitment", "identity"}
        _no_extra(config, arrays, kind, {"request_id", "session"}, names | {"signature"})
        return cls(
            request_id=_str(config, "request_id", kind),
            session=_str(config, "session", kind),
            **{name: _key_bytes(arrays, name, kind) for name in sorted(names)},
            signature=_signature(arrays, "signature", kind),
        )


def _signature(arrays: Mapping[str, Any], key: str, kind: str) -> NDArray[np.uint8]:
    arr = arrays.get(key)
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.shape != (sa.SIGNATURE_BYTES,):
        raise ProtocolError(f"{kind}: array {key!r} must be uint8[{sa.SIGNATURE_BYTES}], got {sa.found_array(arr)}")
    return arr


@dataclass(frozen=True, eq=False)
class SecaggCheckReply:
    """The consistency check's answer: this client's signature over (session tag, U3, U2 \\ U3)."""

    request_id: str
    session: str
    signature: NDArray[np.uint8] = field(repr=False)

    def encode(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        return {"request_id": self.request_id, "session": self.session}, {"signature": self.signature}

    @classmethod
    def decode(cls, config: Mapping[str, Any], arrays: Mapping[str, Any]) -> SecaggCheckReply:
        kind = "secagg check reply"
        _no_extra(config, arrays, kind, {"request_id", "session"}, {"signature"})
        return cls(
            request_id=_str(config, "request_id", kind),
            session=_str(config, "session", kind),
            signature=_signature(arrays, "signature", kind),
        )


@dataclass(frozen=True, eq=False)
class SecaggSharesReply:
    """Step 2's answer: row v holds this client's shares for roster index v, sealed for v."""

    request_id: str
    session: str
    ciphertexts: NDArray[np.uint8] = field(repr=False)

    def encode(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        return {"request_id": self.request_id, "session": self.session}, {"ciphertexts": self.ciphertexts}

    @classmethod
    def decode(cls, config: Mapping[str, Any], arrays: Mapping[str, Any], *, roster_size: int) -> SecaggSharesReply:
        kind = "secagg shares reply"
        _no_extra(config, arrays, kind, {"request_id", "session"}, {"ciphertexts"})
        return cls(
            request_id=_str(config, "request_id", kind),
            session=_str(config, "session", kind),
            ciphertexts=_uint8_table(arrays, "ciphertexts", kind, rows=roster_size, width=sa.CIPHERTEXT_BYTES),
        )


@dataclass(frozen=True, eq=False)
class MaskedInputReply:
    """Step 3's answer: the client's encoded contribution plus its noise share, masked (uint64, mod 2^64).

    Privacy: uniformly distributed whatever the client's data, as long as the self mask is
    unknown; the client charged its units before it left (privacy.md §9).
    """

    request_id: str
    session: str
    masked: NDArray[np.uint64] = field(repr=False)

    def encode(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        return {"request_id": self.request_id, "session": self.session}, {"masked": self.masked}

    @classmethod
    def decode(cls, config: Mapping[str, Any], arrays: Mapping[str, Any], *, size: int) -> MaskedInputReply:
        kind = "masked input reply"
        _no_extra(config, arrays, kind, {"request_id", "session"}, {"masked"})
        masked = arrays.get("masked")
        if not isinstance(masked, np.ndarray) or masked.dtype != np.uint64 or masked.shape != (size,):
            found = sa.found_array(masked)
            raise ProtocolError(f"{kind}: array 'masked' must be uint64[{size}], got {found}")
        return cls(request_id=_str(config, "request_id", kind), session=_str(config, "session", kind), masked=masked)


@dataclass(frozen=True, eq=False)
class SecaggUnmaskReply:
    """Step 4's answer: shares of the survivors' self-mask seeds and of the dropped clients' masking keys."""

    request_id: str
    session: str
    revealed: sa.Revealed = field(repr=False)

    def encode(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        r = self.revealed
        return (
            {"request_id": self.request_id, "session": self.session},
            {
                "seed_peers": r.seed_peers,
                "seed_shares": r.seed_shares,
                "key_peers": r.key_peers,
                "key_shares": r.key_shares,
            },
        )

    @classmethod
    def decode(cls, config: Mapping[str, Any], arrays: Mapping[str, Any]) -> SecaggUnmaskReply:
        kind = "secagg unmask reply"
        _no_extra(
            config, arrays, kind, {"request_id", "session"}, {"seed_peers", "seed_shares", "key_peers", "key_shares"}
        )
        seed_peers = _index_list(arrays, "seed_peers", kind)
        key_peers = _index_list(arrays, "key_peers", kind)
        return cls(
            request_id=_str(config, "request_id", kind),
            session=_str(config, "session", kind),
            revealed=sa.Revealed(
                seed_peers,
                _uint8_table(arrays, "seed_shares", kind, rows=seed_peers.size, width=sa.SHARE_BYTES),
                key_peers,
                _uint8_table(arrays, "key_shares", kind, rows=key_peers.size, width=sa.SHARE_BYTES),
            ),
        )
