"""The client agent's request handling, independent of Flower.

One request, in this order (privacy.md §2-4, 8, 9; architecture.md "Data through one round"):

1. decode and validate through the closed tables of :mod:`protocol.messages`;
2. replay: a request id already answered returns the stored reply byte for byte (no new
   noise, no new charge); the same id with other content is refused;
3. policy: a request outside the client's limits gets a typed error and spends nothing;
4. contributions: one row per unit (per-record gradients, indicators, or the client's one row);
5. the filter gives each unit its clip (partial clipping, FZ Alg. 3) and prices the release;
6. noise is added in local trust (N(0, sigma^2 I) on the client's sum);
7. the charge, the new state and the exact reply bytes are committed in one durable
   transaction; only then does the reply leave (charge before release). A crash before
   the commit released nothing; a crash after it is answered from the stored reply.

``FEDFILTER_FAULT`` (tests only) kills the process at a named step, to prove the order.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import signal
import zipfile
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from numpy.typing import NDArray

from client_agent import model_cache, secagg_client
from client_agent.config import AgentConfig, AgentConfigError, Federation, PolicyError, check_side_files
from client_agent.identity import load_identity, load_peers
from client_agent.ledger import (
    CommittedError,
    FederationLedger,
    Ledger,
    LedgerConfig,
    LedgerError,
    StateRead,
    qualified_id,
)
from client_agent.records import GaussianRecord, MonitorRecord, RealisationRecord
from client_agent.state import AgentState
from client_agent.streaming import Contributions, RowContributions, StreamedGradients, contributions_of
from protocol import messages as wire
from protocol import secagg as sa
from protocol.branchless import or_zero, select
from protocol.errors import FedfilterError
from protocol.filters import Charge, FilterState, GaussianFilter, charge, clip_scales, partial_clip, remaining
from protocol.realisation import RealisationFilter, RealisationState, advance, decide, realised_loss
from workloads.data_sources import materialise
from workloads.registry import (
    BUILTIN_REF,
    DataSource,
    Workload,
    WorkloadError,
    load_workload,
    model_layout,
)

FLOAT32_EPS = float(np.finfo(np.float32).eps)
LOG = logging.getLogger("fedfilter.agent")
AUDIT = logging.getLogger("fedfilter.agent.audit")


class ReplayError(FedfilterError, ValueError):
    """A request id already answered, reused with other content."""


# Each exception's wire code, most specific class first (the shape of httpx's map_exceptions): an
# exception gets the code of the first class it is an instance of, and ERR_INTERNAL if none.
EXCEPTION_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (wire.ProtocolError, wire.ERR_MALFORMED),
    # Session, roster, share and range checks on public values, keys and shares (SessionError and
    # FixedPointOverflow included).
    (sa.SecaggError, wire.ERR_MALFORMED),
    (PolicyError, wire.ERR_POLICY),
    (ReplayError, wire.ERR_REPLAY),
    (LedgerError, wire.ERR_LEDGER),
)


def error_code(exc: BaseException) -> int:
    """The wire code of ``exc`` by :data:`EXCEPTION_CODES`; ERR_INTERNAL for any other exception."""
    return next((code for cls, code in EXCEPTION_CODES if isinstance(exc, cls)), wire.ERR_INTERNAL)


@dataclass(frozen=True)
class Outcome:
    """What goes back over the wire: a reply (config, arrays) or a typed error (code, reason)."""

    config: dict[str, Any] | None = None
    arrays: dict[str, NDArray[Any]] | None = None
    error_code: int = 0
    error_reason: str = ""  # what crosses the wire: the code's fixed text (protocol.messages.ERROR_TEXT)
    local_detail: str = ""  # never sent: the exception's own message, for the client's log and tests
    # A malformed or policy refusal decided before the request was answered: from its fields, the configuration
    # and the federation's own request counts, never from a unit's spend or data (privacy.md §11), so its time
    # tells nothing of who stopped and the service sends it unpaced (held to a mark, a stream of them from one
    # federation held the one worker from the others, uncharged).
    before_answer: bool = False

    @property
    def is_error(self) -> bool:
        return self.error_code != 0


def refusal(code: int, message_type: str, config: dict[str, Any], exc: BaseException) -> Outcome:
    """A typed error reply with the code's fixed text; the details go to the client's own log only.

    Privacy note: an error reply goes back uncharged, so its text must not depend on the client's
    data. An exception's message can (a ledger error once carried the sha256 of the state blob,
    which holds per-record spend; a configuration mismatch carried the data's fingerprint; paths
    name the owner's files), so no exception text ever crosses the wire (privacy.md §8).
    """
    request_id = config.get("request_id") if isinstance(config, dict) else None
    level = logging.ERROR if code in (wire.ERR_LEDGER, wire.ERR_INTERNAL) else logging.WARNING
    LOG.log(
        level,
        "refused %.80s request %.80r (%s): %s: %.500s",  # bounded: a refused request's fields are the bundle's
        message_type,
        request_id,
        wire.error_name(code),
        type(exc).__name__,
        exc,
        exc_info=code == wire.ERR_INTERNAL,
    )
    return Outcome(error_code=code, error_reason=wire.ERROR_TEXT[code], local_detail=f"{type(exc).__name__}: {exc}")


def fault_point(step: str) -> None:
    """Kill this process with SIGKILL if FEDFILTER_FAULT names ``step`` (crash-safety tests only)."""
    if os.environ.get("FEDFILTER_FAULT") == step:
        os.kill(os.getpid(), signal.SIGKILL)


def pack_reply(config: dict[str, Any], arrays: dict[str, NDArray[Any]]) -> bytes:
    """The exact bytes of a reply, as stored in the ledger and replayed."""
    buf = io.BytesIO()
    header = np.frombuffer(json.dumps(config, sort_keys=True).encode(), dtype=np.uint8)
    members: dict[str, Any] = {"__config__": header, **arrays}
    np.savez(buf, **members)
    return buf.getvalue()


def unpack_reply(blob: bytes) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
    """A stored reply; a damaged one is a LedgerError (the ledger is corrupt, never answered afresh)."""
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as data:
            config = json.loads(bytes(data["__config__"]).decode())
            arrays = {k: data[k] for k in data.files if k != "__config__"}
    except (zipfile.BadZipFile, KeyError, EOFError, OSError, ValueError) as exc:
        raise LedgerError(f"ledger: a stored reply does not decode ({exc!r}); the ledger is corrupt") from exc
    return config, arrays


def open_client_data(config: AgentConfig) -> tuple[Workload, DataSource]:
    """The owner's workload (from the agent's ``workload`` key) and its source over ``data-path``."""
    workload = load_workload(config.workload)
    return workload, workload.open_data(config.data_path)


def load_client_data(
    path: os.PathLike[str] | str, *, workload: Workload | None = None
) -> tuple[NDArray[Any], NDArray[Any], str]:
    """The client's records ``x`` and ``y`` as arrays, and the data's SHA-256 (the built-in source: an .npz).

    Arrays of a memory-mapped source stay memory-mapped; other sources are read batch by batch.
    """
    source = (workload or load_workload(BUILTIN_REF)).open_data(os.fspath(path))
    x, y = materialise(source)
    return x, y, source.fingerprint()


# The release kernel (Agent.release over client_agent.streaming's Contributions) does the same work
# on every unit, whoever is stopped, exhausted, refused or null: every unit is scaled (by 0 for a
# unit that contributes nothing), measured, weighted and summed. A branch, a fancy index or an
# extra copy for some units would make the reply's timing tell the coordinator how many units
# stopped, the very thing the monitor exists to hide (privacy.md §7, §8);
# tests/unit/test_release_uniform.py traces it.


def _with_slack(clipped_norms: NDArray[np.float64], slack: float) -> NDArray[np.float64]:
    """secagg: a unit that sends anything is charged its fixed-point rounding slack on top (0 in other trusts)."""
    return or_zero(clipped_norms > 0, clipped_norms + slack) if slack else clipped_norms


def _digest64(text: str) -> int:
    """The first 8 bytes of SHA-256(text), as an unsigned little-endian integer."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _run_tag(run_id: str) -> int:
    """A non-zero 63-bit tag of a run id (SHA-256), to remember which run owns the SVT reservation."""
    return (_digest64(run_id) & ((1 << 63) - 1)) or 1


def check_monotone(old: AgentState, new: AgentState) -> None:
    """Refuse to commit a state in which a spend went down or a stopped unit restarted (privacy.md §3, §9)."""
    if old.spent is not None and (new.spent is None or np.any(new.spent < old.spent)):
        raise LedgerError("new state: expected every unit's spend to stay or grow, found one that went down")
    if old.stopped is not None and (new.stopped is None or np.any(old.stopped & ~new.stopped)):
        raise LedgerError("new state: expected stopped units to stay stopped, found one restarted")
    if old.accepting is not None and (new.accepting is None or np.any(new.accepting & ~old.accepting)):
        raise LedgerError("new state: expected stopped units to stay stopped, found one accepting again")
    if old.monitor_run != 0 and new.monitor_run != old.monitor_run:
        raise LedgerError("new state: expected the SVT reservation to stay with its run, found it moved")
    if np.any((old.halt_round >= 0) & (new.halt_round != old.halt_round)):
        raise LedgerError("new state: expected recorded halt rounds to stay as they were, found one changed")


def _name_index(workloads: tuple[Workload, ...]) -> tuple[dict[str, Workload], dict[str, Workload]]:
    """Each model and query name's one workload; a name two workloads register is refused at start."""
    models: dict[str, Workload] = {}
    queries: dict[str, Workload] = {}
    for workload in workloads:
        for table, names in ((models, workload.models), (queries, workload.queries)):
            for name in names:
                if name in table:
                    what = "model" if table is models else "query"
                    raise AgentConfigError(
                        f"workloads: expected each {what} name in one workload, found {name!r} in both "
                        f"{table[name].name!r} and {workload.name!r} (a request must resolve to exactly one)"
                    )
                table[name] = workload
    return models, queries


def quota_filter(filt: GaussianFilter, federation: Federation) -> GaussianFilter:
    """The filter a federation's own spend runs against: the unit's threshold times its quota."""
    return replace(filt, threshold=filt.threshold * federation.quota)


def charge_with_quota(
    filt: GaussianFilter,
    state: FilterState,
    quota: GaussianFilter,
    quota_state: FilterState,
    *,
    noise_std: float,
    l2_norms: NDArray[np.float64],
) -> tuple[Charge, FilterState]:
    """Price a release against the unit's global filter and its federation's quota: (global charge, quota state).

    A unit is admitted when both admit it (it pays the same cost to both). One its quota refuses offers
    the global filter nothing (it is stopped for this federation only, and pays nothing anywhere); one the
    global filter refuses is stopped everywhere and its quota is not charged. The same operations run for
    every unit, whoever is refused (privacy.md §8).
    """
    by_quota = charge(quota, quota_state, noise_std=noise_std, l2_norms=l2_norms)
    offered = or_zero(by_quota.admitted, l2_norms)
    result = charge(filt, state, noise_std=noise_std, l2_norms=offered)
    spent = select(result.admitted, by_quota.state.spent, quota_state.spent)
    stopped = by_quota.state.stopped | result.state.stopped
    return result, FilterState(spent=spent, stopped=stopped)


class Agent:
    """One client agent: its configuration, data, filter and ledger."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        # secagg trust: the owner's signing key and trusted peers (client_agent/identity.py), read
        # before anything else so that a bad key file stops the agent before it opens its ledger.
        if config.device != "cpu":
            import torch

            index = int(config.device.split(":")[1]) if ":" in config.device else 0
            if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                raise AgentConfigError(f"device: {config.device!r} asked; torch sees no such CUDA device")
        # One identity per federation (privacy.md §11): a key shared by two would let one coordinator reuse
        # a signature made in the other's session of the same id and roster.
        self.identities: dict[str, tuple[bytes, frozenset[bytes]]] = {}
        for fed in config.served:
            if fed.secagg_identity_key is not None and fed.secagg_peers is not None:
                self.identities[fed.name] = (load_identity(fed.secagg_identity_key), load_peers(fed.secagg_peers))
        public = [sa.identity_public_key(key) for key, _ in self.identities.values()]
        if len(set(public)) != len(public):
            raise AgentConfigError(
                "secagg-identity-key: expected one key per federation, found one key in two federations (a "
                "signature made for one coordinator's session could be replayed in the other's)"
            )
        # The owner's registries (privacy.md §10): requests name their models and queries, never code. The
        # first workload opens the data; every model and query name resolves to exactly one workload.
        self.workload, self.source = open_client_data(config)
        self.workloads = (self.workload, *(load_workload(ref) for ref in config.extra_workloads))
        self._federation = config.served[0].name  # the federation of the request being answered
        self._audit_entry: dict[str, Any] = {}  # what the request being answered cost (Agent.audit)
        self._by_model, self._by_query = _name_index(self.workloads)
        fingerprint = self.source.fingerprint()
        self.n_units = len(self.source) if config.unit == "record" else 1
        self._arrays: tuple[NDArray[Any], NDArray[Any]] | None = None
        if config.filter == "realisation":
            self.realisation: RealisationFilter | None = config.realisation_filter()
            self.gaussian = None
            described = self.realisation.describe()
            initial = AgentState(
                halt_round=np.full(self.n_units, -1, dtype=np.int64),
                loss=np.zeros(self.n_units),
                accepting=RealisationState.fresh(self.realisation, self.n_units).accepting,
                answered=0,
            )
        else:
            self.realisation = None
            self.gaussian = config.gaussian_filter()
            described = self.gaussian.describe()
            initial = AgentState(
                halt_round=np.full(self.n_units, -1, dtype=np.int64),
                spent=np.zeros(self.n_units),
                stopped=np.zeros(self.n_units, dtype=np.bool_),
            )
        params: dict[str, Any] = {"filter": described, "monitor": config.monitor.describe(), "data_sha256": fingerprint}
        if config.noise_seed is not None:
            # Seeded noise (simulations only) is written into the ledger: its spends were priced
            # against noise that anyone holding the seed can recompute.
            params["noise_seed"] = config.noise_seed
        self.ledger_config = LedgerConfig(
            filter=config.filter,
            epsilon=config.epsilon,
            delta=config.delta,
            unit=config.unit,
            trust=config.trust,
            n_units=self.n_units,
            params=params,
        )
        check_side_files(config)  # again: a link made since the configuration was read
        self.ledger = Ledger.open(
            config.ledger_path,
            self.ledger_config,
            initial_state=initial.to_arrays(),
            high_water=config.high_water_path,
        )

    @property
    def x(self) -> NDArray[Any]:
        """The records' features as one array (transitional: memory-mapped where the source is, else read whole)."""
        if self._arrays is None:
            self._arrays = materialise(self.source)
        return self._arrays[0]

    @property
    def y(self) -> NDArray[Any]:
        """The records' targets as one array (see :attr:`x`)."""
        if self._arrays is None:
            self._arrays = materialise(self.source)
        return self._arrays[1]

    def close(self) -> None:
        self.ledger.close()

    # -- public entry ----------------------------------------------------------------

    def handle(
        self,
        message_type: str,
        config: dict[str, Any],
        arrays: dict[str, NDArray[Any]],
        federation: str | None = None,
    ) -> Outcome:
        """One request from ``federation`` (the socket it came over); a failure is a typed error and spends nothing.

        Every request, answered or refused, leaves one line in the owner's audit log (:meth:`audit`)."""
        answering = False
        try:
            request = wire.decode_request(message_type, config, arrays)
            if federation is None:  # an in-process agent: its one federation (with several, the caller must say)
                federation = self.config.served[0].name if len(self.config.served) == 1 else ""
            self._audit_entry = {}
            self._federation = federation
            try:
                fed = self.config.federation(federation)
            except AgentConfigError as exc:  # a socket of no configured federation: refused, fixed text
                raise PolicyError(str(exc)) from exc
            if isinstance(request, wire.StatusRequest):
                if wire.STATUS not in self.config.policy.allowed_kinds:
                    raise PolicyError(f"request kind {wire.STATUS!r} is not allowed by policy-allowed-kinds")
                outcome = Outcome(*wire.StatusReply(request.request_id, self.status_json(request, fed)).encode())
            else:
                digest = wire.request_digest(message_type, config, arrays)
                # A secure-aggregation step is stored under its session, not its request id: at most once
                # each. Each federation's ids live in their own namespace: one cannot replay another's.
                stored = FederationLedger(self.ledger, fed.name).lookup(secagg_client.ledger_id(request))
                if stored is not None:
                    if stored.digest != digest:
                        raise ReplayError(secagg_client.replay_reason(request))
                    self._audit_entry = {"outcome": "replayed", "reply_bytes": len(stored.reply)}
                    outcome = Outcome(*unpack_reply(stored.reply))
                else:
                    with model_cache.scope(fed.name):  # public derivations of the model, per federation
                        # The state is read before the policy counts this federation's requests: a request
                        # committed by another process after this read (and so after the counts) makes this
                        # one's commit refused, so concurrent processes cannot together pass a rate limit.
                        state = AgentState.from_arrays(self.ledger.state())
                        read = self.ledger.last_read
                        self.check_policy(request, fed)
                        answering = True  # from here on units' spend and data are read: refusals are paced
                        outcome = self.answer(request, digest, fed, read=(state, read))
        except Exception as exc:
            # Nothing left the client: the reply is released only after a successful commit, and
            # the commit is one transaction. A repeat with the same id is answered afresh.
            outcome = refusal(error_code(exc), message_type, config, exc)
            if not answering and outcome.error_code in (wire.ERR_MALFORMED, wire.ERR_POLICY):
                outcome = replace(outcome, before_answer=True)
        try:
            self.audit(message_type, config, federation if federation is not None else self._federation, outcome)
        except Exception as exc:  # the owner's log line is lost, never the answer (its charge is committed)
            LOG.error("audit: the line for request %.80r was not written: %r", config.get("request_id"), exc)
        return outcome

    def status_json(self, request: wire.StatusRequest | None = None, federation: Federation | None = None) -> str:
        """Public configuration only: no spend, and no fingerprint of the client's data.

        The ledger's ``data_sha256`` stays on the client: a coordinator holding candidate
        datasets could otherwise confirm exactly which data the client holds. A request naming a
        model gets that model's parameter layout fingerprint (None when the workload cannot build
        it), computed on the meta device from the names alone.
        """
        ledger = json.loads(self.ledger_config.to_json())
        ledger["params"] = {k: v for k, v in ledger["params"].items() if k not in ("data_sha256", "noise_seed")}
        if self.config.noise_seed is not None:
            ledger["params"]["noise"] = "seeded (simulation)"  # the coordinator learns that, not the seed
        description = {"ledger": ledger, "policy": self.config.policy.describe(), "workload": self.workload.describe()}
        if len(self.workloads) > 1:
            # Every name this agent answers, as one registry (what enrolment checks), and each workload.
            described = [w.describe() for w in self.workloads]
            description["workload"] = {
                "name": "+".join(w["name"] for w in described),
                "models": sorted(self._by_model),
                "queries": {k: v for w in described for k, v in w["queries"].items()},
            }
            description["workloads"] = described
        fed = federation or self.config.served[0]
        description["federation"] = fed.describe()  # the owner's public choice, nothing about the data
        if request is not None and request.model is not None and request.model_args is not None:
            owner = self._by_model.get(request.model, self.workload)
            description["layout"] = {
                "model": request.model,
                "fingerprint": model_layout(owner, request.model, request.model_args),
            }
        if request is not None:  # one ledger behind two node ids is enrolled once (privacy.md §8)
            description["ledger_tag"] = self.ledger.run_tag(fed.name, request.run_id)
        return json.dumps(description, sort_keys=True)

    # -- policy -----------------------------------------------------------------------

    def check_policy(self, request: wire.Request, federation: Federation | None = None) -> None:
        """Refuse what the client's policy or ledger does not allow, naming the limit, the value asked and allowed."""
        policy = self.config.policy
        fed = federation or self.config.served[0]
        kind = wire.message_type_of(request)
        if kind not in policy.allowed_kinds:
            raise PolicyError(f"request kind {kind!r} is not allowed; allowed kinds: {list(policy.allowed_kinds)}")
        self.check_workload(request)
        trust = getattr(request, "trust", self.config.trust)
        if trust not in policy.allowed_trust or trust != self.config.trust:
            raise PolicyError(f"trust {trust!r} asked; this client's ledger is fixed to trust {self.config.trust!r}")
        unit = getattr(request, "unit", self.config.unit)
        if unit != self.config.unit:
            raise PolicyError(f"unit {unit!r} asked; this client's ledger is fixed to unit {self.config.unit!r}")
        if isinstance(request, (wire.GradientRequest, wire.IndicatorRequest)):
            if request.noise_std < policy.min_noise_std:
                raise PolicyError(
                    f"noise_std {request.noise_std!r} asked; the policy requires noise_std >= {policy.min_noise_std!r}"
                )
            if request.noise_std / request.l2_clip < policy.min_noise_multiplier:
                raise PolicyError(
                    f"noise multiplier {request.noise_std / request.l2_clip!r} asked; the policy requires "
                    f">= {policy.min_noise_multiplier!r}"
                )
            if request.l2_clip > policy.max_clip:
                raise PolicyError(f"l2_clip {request.l2_clip!r} asked; the policy allows at most {policy.max_clip!r}")
            cap = self.request_cap()
            cost = (request.l2_clip / request.noise_std) ** 2
            if cap is not None and not cost <= cap:
                raise PolicyError(
                    f"a request costing up to (l2_clip / noise_std)^2 = {cost!r} per unit asked; the policy allows "
                    f"at most policy-max-request-share = {policy.max_request_share!r} of the budget per request "
                    f"({cap!r})"
                )
        if isinstance(request, wire.GradientRequest) and request.local_steps > policy.max_local_steps:
            raise PolicyError(
                f"local_steps {request.local_steps} asked; the policy allows at most {policy.max_local_steps}"
            )
        if isinstance(request, wire.SecaggSharesRequest) and request.min_clients < policy.min_secagg_clients:
            raise PolicyError(
                f"secagg min_clients {request.min_clients} asked; the policy requires at least "
                f"{policy.min_secagg_clients} clients in every sum"
            )
        if isinstance(request, wire.SecaggSharesRequest):
            n, m = len(request.encryption_keys), request.min_clients
            faults = policy.secagg_faults(n)
            # 2m <= n is the protocol's own refusal (sa.Roster.authenticate); the policy adds the band up to n + f.
            if n < 2 * m <= n + faults:
                raise PolicyError(
                    f"secagg min_clients {m} of {n} asked; the policy requires 2m > n + f with f = {faults} "
                    "(members that may sign two survivor sets: a restored or cloned agent)"
                )
        masked_input = getattr(request, "secagg", None)
        if masked_input is not None and masked_input.scale_bits < policy.min_secagg_scale_bits:
            raise PolicyError(
                f"secagg scale_bits {masked_input.scale_bits} asked; the policy requires at least "
                f"{policy.min_secagg_scale_bits} (each masked input pays sqrt(d) / 2^scale_bits of rounding slack)"
            )
        params = getattr(request, "parameters", None)
        if params is not None and params.size > policy.max_model_params:
            raise PolicyError(
                f"model size {params.size} parameters asked; the policy allows at most {policy.max_model_params}"
            )
        used = self.ledger.requests_in_run(request.run_id, fed.name)
        if used >= policy.max_rounds_per_run:
            raise PolicyError(
                f"round {used + 1} of run {request.run_id!r} asked; the policy allows at most "
                f"{policy.max_rounds_per_run} requests per run"
            )
        # Per federation, like the run limit: a shared count would let one coordinator block another, and
        # read the other's count off its own refusals (privacy.md §11).
        today = self.ledger.requests_since(datetime.now(UTC) - timedelta(days=1), fed.name)
        if today >= policy.max_requests_per_day:
            raise PolicyError(
                f"request {today + 1} in the last 24 hours asked; the policy allows at most "
                f"{policy.max_requests_per_day} per day, whatever the run"
            )

    def request_cap(self) -> float | None:
        """What one request may cost a unit at most (in S = sum mu^2); None for the realisation filter."""
        share = self.config.policy.max_request_share
        if self.gaussian is None or share >= 1.0:  # 1: the budget itself is the only limit (partial clipping)
            return None
        return share * self.gaussian.threshold

    def workload_of(self, request: wire.Request) -> Workload:
        """The workload that registers the request's model (or query); the data's workload for other requests."""
        if isinstance(request, wire.IndicatorRequest):
            return self._by_query.get(request.predicate, self.workload)
        model = getattr(request, "model", None)
        return self._by_model.get(model, self.workload) if model is not None else self.workload

    def check_workload(self, request: wire.Request) -> None:
        """Refuse (as malformed) a model or query name this client's workload does not register, a query
        asked without the model it needs, or a model whose parameter layout is not the coordinator's.

        Only names and public arguments are read here, never the data: a refusal says nothing about it.
        """
        kind = wire.message_type_of(request)
        workload = self.workload_of(request)
        if isinstance(request, wire.IndicatorRequest):
            try:
                query = workload.query(request.predicate)
            except WorkloadError as exc:
                raise wire.ProtocolError(f"{kind}: query {request.predicate!r}: {exc}") from exc
            if query.needs_model != (request.model is not None):
                need = (
                    "needs the request's model: missing key 'model'"
                    if query.needs_model
                    else ("takes no model: unexpected key 'model'")
                )
                raise wire.ProtocolError(f"{kind}: query {request.predicate!r} {need}")
        model = getattr(request, "model", None)
        if model is None:
            return
        try:  # names and shapes only (a meta build, once per process): model_args may name huge layers
            built = model_cache.MODELS.shape(workload, model, getattr(request, "model_args", None) or "{}")
        except WorkloadError as exc:
            raise wire.ProtocolError(f"{kind}: model {model!r}: {exc}") from exc
        layout = getattr(request, "layout", None)
        if layout is not None and layout != built.layout:
            raise wire.ProtocolError(
                f"{kind}: layout: the coordinator's model {model!r} has parameter layout {layout[:16]}..., this "
                f"client's build of it (workload {workload.name!r}) has {built.layout[:16]}...; "
                "expected the same (name, shape, dtype) of every parameter"
            )

    # -- answering ------------------------------------------------------------------------

    def answer(
        self,
        request: wire.Request,
        digest: str,
        federation: Federation | None = None,
        *,
        read: tuple[AgentState, StateRead],
    ) -> Outcome:
        """Answer ``request``: compute, charge, commit, reply. ``read``: the ledger's state and what that read saw,
        taken by the caller before its policy checks; the commit refuses unless the ledger is still as it saw."""
        fed = federation or self.config.served[0]
        scoped = FederationLedger(self.ledger, fed.name)
        state, base = read
        quota = self.quota_state(fed.name, state)
        new_state, new_quota = state, quota
        if isinstance(request, wire.SecaggKeysRequest):
            cfg, arrs, release = secagg_client.advertise(request, self._identity(fed))
        elif isinstance(request, wire.SecaggSharesRequest):
            cfg, arrs, release = secagg_client.share_keys(scoped, request, self._identity(fed), self._peers(fed))
        elif isinstance(request, wire.SecaggCheckRequest):
            cfg, arrs, release = secagg_client.check(scoped, request, self._identity(fed))
        elif isinstance(request, wire.SecaggUnmaskRequest):
            cfg, arrs, release = secagg_client.unmask(scoped, request)
        elif isinstance(request, wire.MonitorRequest):
            reply, new_state, release = self.monitor_reply(request, state, fed, quota, scoped)
            cfg, arrs = reply.encode()
        else:
            assert isinstance(request, (wire.GradientRequest, wire.IndicatorRequest))
            masked = None
            if request.secagg is not None:  # checked before any data is read
                masked = secagg_client.prepare_masked(
                    scoped,
                    request,
                    request.secagg,
                    noise_std=request.noise_std,
                    n_units=self.n_units,
                    l2_clip=request.l2_clip,
                )
            rows = self.contributions(request, stopped=self.stopped_units(state, quota))
            fault_point("after_compute")
            reply, new_state, release, new_quota = self.release(
                request, rows, state, masked=masked, quota=quota, federation=fed
            )
            if isinstance(rows, StreamedGradients):
                # The owner's own log, never sent: a validity rule that nulls the data learns nothing. Written
                # for every request, null records or not: a line written only when some record is null took
                # 15 us more, before the reply (a one-bit timing answer to "is some record null?").
                LOG.info(
                    "request %r: %d of %d records were the null element (%d not finite, %d rejected by the "
                    "workload's validity rule); they contributed nothing and paid nothing",
                    request.request_id,
                    sum(rows.nulls.values()),
                    rows.n_units,
                    rows.nulls.get("not_finite", 0),
                    rows.nulls.get("rejected", 0),
                )
            cfg, arrs = reply.encode()
        check_monotone(state, new_state)
        if quota is not None and new_quota is not None:
            check_monotone(quota, new_quota)
        blob = pack_reply(cfg, arrs)
        charged = self._charged(state, new_state, quota, new_quota, release.to_arrays(), len(blob))
        try:
            self.ledger.commit(
                federation=fed.name,
                quota_state=None if new_quota is None else new_quota.quota_arrays(),
                request_id=qualified_id(fed.name, secagg_client.ledger_id(request)),
                message_type=wire.message_type_of(request),
                run_id=request.run_id,
                digest=digest,
                release=release.to_arrays(),
                new_state=new_state.to_arrays(),
                reply=blob,
                base=base,
                monitor_owner=isinstance(request, wire.MonitorRequest),
            )
        except CommittedError:  # refused, but its charge stands: the owner's audit line shows it (Agent.audit)
            self._audit_entry = charged
            raise
        fault_point("after_commit")
        self._audit_entry = charged
        return Outcome(*unpack_reply(blob))

    def _charged(
        self,
        state: AgentState,
        new_state: AgentState,
        quota: AgentState | None,
        new_quota: AgentState | None,
        release: dict[str, NDArray[Any]],
        reply_bytes: int,
    ) -> dict[str, Any]:
        """What an answered request cost, for the owner's audit line (never sent anywhere)."""
        entry: dict[str, Any] = {"outcome": "answered", "reply_bytes": reply_bytes}
        norms, noise = release.get("l2_norms"), release.get("noise_std")
        if norms is not None and noise is not None:
            entry["units_charged"] = int(np.count_nonzero(norms))
        if self.gaussian is not None and new_state.spent is not None and state.stopped is not None:
            assert new_state.stopped is not None
            share = new_state.spent / self.gaussian.threshold
            entry["spend_share_max"], entry["spend_share_mean"] = float(share.max()), float(share.mean())
            entry["units_newly_stopped"] = int(np.count_nonzero(new_state.stopped & ~state.stopped))
            if quota is not None and new_quota is not None:
                assert quota.stopped is not None and new_quota.stopped is not None
                entry["units_newly_stopped_for_federation"] = int(np.count_nonzero(new_quota.stopped & ~quota.stopped))
        elif new_state.loss is not None:
            entry["loss_max"] = float(np.abs(new_state.loss).max())
        return entry

    def audit(self, message_type: str, config: dict[str, Any], federation: str, outcome: Outcome) -> None:
        """One JSON line for the owner: who asked what, at which noise and clip, what it cost, what left.

        Public request fields and aggregate spend only (never the data, never a unit's own value), written
        to the ``fedfilter.agent.audit`` log and, when the agent has one, appended to its ``audit-log``
        file; nothing here is sent to the coordinator. ``fedfilter ledger requests`` lists the same from
        the ledger."""
        cfg = config if isinstance(config, dict) else {}

        def bounded(value: Any) -> Any:
            # A refused request's fields are as the bundle sent them: a 3 MiB string was written whole, each
            # time, uncharged (a review: 63 MB of log from five requests); the wire's own limits bound them here.
            if isinstance(value, str) and len(value) > 256:
                return f"<{len(value)} characters>"
            if isinstance(value, int) and abs(value) > wire.MAX_WIRE_INT:
                return f"<an integer of {value.bit_length()} bits>"
            return value

        def field(key: str) -> Any:
            value = cfg.get(key)
            return bounded(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None

        line: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "federation": federation,
            "run_id": field("run_id"),
            "round": field("round"),
            "request_id": field("request_id"),
            "kind": bounded(message_type),
            "model": field("model"),
            "query": field("predicate"),
            "noise_std": field("noise_std"),
            "l2_clip": field("l2_clip"),
        }
        if field("reduce") is not None:  # an indicator's 'mean' (left off the wire for the default 'sum')
            line["reduce"] = field("reduce")
        workload = None
        if line["model"] is not None:
            workload = self._by_model.get(str(line["model"]))
        elif line["query"] is not None:
            workload = self._by_query.get(str(line["query"]))
        line["workload"] = workload.name if workload is not None else None
        if outcome.is_error:
            line["outcome"] = "refused: " + wire.error_name(outcome.error_code)
            line["detail"] = outcome.local_detail[:500]
            if self._audit_entry:  # committed before it was refused (client_agent.ledger.CommittedError)
                line.update({k: v for k, v in self._audit_entry.items() if k not in ("outcome", "reply_bytes")})
                line["charge"] = "committed: it stands, though nothing was sent"
        else:
            line.update(self._audit_entry or {"outcome": "answered"})
        text = json.dumps(line, sort_keys=True, default=str)
        AUDIT.info("%s", text)
        path = self.config.audit_log
        if path is not None:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, (text + "\n").encode())
                finally:
                    os.close(fd)
            except OSError as exc:  # the ledger holds the record; a full disk must not stop the answer
                LOG.error("audit-log %s: could not append a line: %s", path, exc)

    def _identity(self, fed: Federation) -> bytes:
        if fed.name not in self.identities:  # only in secagg trust, where the configuration requires the key
            raise PolicyError("secagg: this agent has no secagg-identity-key; it takes part in no session")
        return self.identities[fed.name][0]

    def _peers(self, fed: Federation) -> frozenset[bytes]:
        if fed.name not in self.identities:
            raise PolicyError("secagg: this agent has no secagg-peers; it takes part in no session")
        return self.identities[fed.name][1]

    @property
    def identity(self) -> bytes | None:
        """The first federation's secagg identity (the only one, for an agent of one federation)."""
        first = self.identities.get(self.config.served[0].name)
        return None if first is None else first[0]

    @property
    def trusted_peers(self) -> frozenset[bytes] | None:
        first = self.identities.get(self.config.served[0].name)
        return None if first is None else first[1]

    def quota_state(self, federation: str, state: AgentState) -> AgentState | None:
        """``federation``'s own spend, stopped flags and halt rounds (Gaussian filters; fresh before its first one).

        ``state``: the ledger's state as this request read it, the state its new state is computed from. It
        is never read again here: a second read would move the ledger handle's record of the state it last
        read (what :meth:`Ledger.commit` checks the stored state against) past a charge another process
        committed in between, and this request's new state would then be written over that charge.
        """
        if self.gaussian is None:
            return None
        stored = self.ledger.quota_state(federation)
        if stored is None:
            # Its first request, or a ledger migrated from version 1 whose past requests are all federation
            # "default": the quota starts from what the federation's stored releases charged (their sum in
            # commit order, as the charge adds them), and a unit stopped everywhere is stopped for it too.
            spent = self.ledger.charged_by(federation)
            assert state.stopped is not None
            return AgentState(
                halt_round=select(np.asarray(state.stopped), np.asarray(state.halt_round, np.int64), np.int64(-1)),
                spent=spent,
                stopped=np.array(state.stopped),
            )
        return AgentState(halt_round=stored["halt_round"], spent=stored["spent"], stopped=stored["stopped"])

    def rng(self, request: wire.Request) -> np.random.Generator:
        """Noise source: OS entropy, or (simulations and tests) a seed mixed with the request's ledger id.

        The ledger id, not the request id: a masked input is stored under its session, so two
        sessions may carry one request id, and the same seeded noise in both would cancel in the
        difference of their sums. The ledger id is answered once, so no seeded draw repeats.
        """
        if self.config.noise_seed is None:
            return np.random.default_rng()
        # The whole SHA-256 digest of (seed, ledger id) seeds the stream, not 64 bits of it. The ledger id
        # as stored, in its federation's namespace: two federations may send one request id, and the same
        # draw in both replies would cancel in a weighted difference of them (for "default": the bare id,
        # so seeded runs reproduce as before).
        text = f"{self.config.noise_seed}|{qualified_id(self._federation, secagg_client.ledger_id(request))}"
        return np.random.default_rng(int.from_bytes(hashlib.sha256(text.encode()).digest(), "little"))

    @staticmethod
    def stopped_units(state: AgentState, quota: AgentState | None) -> NDArray[np.bool_]:
        """Units that may not contribute: stopped by their filter, or by this federation's quota."""
        out = state.stopped.copy() if state.stopped is not None else ~np.asarray(state.accepting, dtype=np.bool_)
        if quota is not None and quota.stopped is not None:
            out |= quota.stopped
        return out

    def contributions(
        self, request: wire.GradientRequest | wire.IndicatorRequest, *, stopped: NDArray[np.bool_] | None = None
    ) -> Contributions:
        """Each unit's unclipped contribution: streamed per-record gradients, or materialised float32 rows.

        Record-unit gradients are :class:`client_agent.streaming.StreamedGradients` (one fused pass over
        the records in chunks, run by :meth:`release`: norms, weights, clipped sum); never an (n, d) matrix.
        ``stopped`` (one flag per unit): a stopped unit's records never reach the owner's code (a query's
        rows, the model, the loss, the validity rule): client-unit gradients and local training run on the
        null element instead, record-unit gradients get the same from :meth:`release` (privacy.md §2).
        """
        from client_agent.workloads import gradient_contributions, indicator_rows

        if isinstance(request, wire.GradientRequest) and request.local_steps > 0:
            from client_agent.local_training import local_rows

            # Minibatches from a child stream of the noise source: seeded runs would otherwise draw
            # the batches and the noise from one stream, and the contribution would not be
            # independent of its noise (the Gaussian mechanism needs it to be).
            rng = self.rng(request).spawn(1)[0]
            return contributions_of(
                local_rows(request, self.x, self.y, rng=rng, workload=self.workload_of(request), stopped=stopped)
            )
        if isinstance(request, wire.GradientRequest):
            return gradient_contributions(
                request,
                self.source,
                unit=self.config.unit,
                workload=self.workload_of(request),
                device=self.config.device,
                activation_budget=self.config.policy.max_activation_mb << 20,
                stopped=stopped,
            )
        workload = self.workload_of(request)
        return contributions_of(
            indicator_rows(request, self.source, unit=self.config.unit, workload=workload, stopped=stopped)
        )

    def release(
        self,
        request: wire.GradientRequest | wire.IndicatorRequest,
        contributions: Contributions | NDArray[np.float32],
        state: AgentState,
        *,
        masked: secagg_client.MaskedContext | None = None,
        quota: AgentState | None = None,
        federation: Federation | None = None,
    ) -> tuple[
        wire.ContributionReply | wire.MaskedInputReply,
        AgentState,
        GaussianRecord | RealisationRecord,
        AgentState | None,
    ]:
        """Clip, price, noise: the reply, the new filter state and the release record.

        ``contributions`` is this request's own (from :meth:`contributions`; a float32 (n, d) array
        is wrapped as materialised rows): norms first, then the clipped, admitted sum. Rows are
        clipped in place block by block. Streamed record gradients run their one fused pass here
        (:meth:`_fused_gaussian`): each unit's bound is fixed before the pass, the engine asks for
        the weights (clip scale x admitted) chunk by chunk, and the charge over all units is then
        checked to be exactly those weights; nothing is charged before the sum exists. Streamed
        norms carry a relative error bound E
        (``norm_rel_error``): the clip is bound / (1 + E) and the charge norm * scale * (1 + E),
        never below the clipped contribution's norm (client_agent/streaming.py).

        In secagg trust (``masked``) a unit's charge includes the fixed-point rounding slack
        sqrt(d) / 2^k (protocol.secagg.rounding_slack): it pays (||v|| + slack)^2 / sigma^2 against
        the total noise sigma, which every sum of >= m inputs carries. Its clip is
        min(C, sigma sqrt(T - S) - slack), so that the last, partial round still fits the remainder.

        ``quota`` (Gaussian filters): the federation's own spend, stopped flags and halt rounds before
        this request; a unit's bound is also within its quota's remainder and the per-request cap, it is
        admitted only when both its global filter and its quota admit it (:func:`charge_with_quota`), and
        the federation's new state is returned last (None for the realisation filter).
        """
        fed = federation or self.config.served[0]
        sigma, clip = request.noise_std, request.l2_clip
        units = contributions_of(contributions)
        if units.n_units != self.n_units:
            raise ValueError(f"contributions: expected {self.n_units} units, got {units.n_units}")
        margin = 1.0 + units.norm_rel_error
        slack = 0.0 if masked is None else sa.rounding_slack(units.dim, masked.scale_bits)
        # A unit whose contribution is not finite (an overflow at extreme parameters) contributes
        # the null element's zero and pays nothing. Refusing instead would answer, uncharged, a
        # question about the client's data: whether some record overflows (privacy.md §1, §2).
        kind = "gradient" if isinstance(request, wire.GradientRequest) else "indicator"
        noise: NDArray[np.float64] | None = None
        shares = None if masked is None else masked.shares()
        release: GaussianRecord | RealisationRecord
        if self.gaussian is not None:
            fstate = state.filter_state()
            if quota is None:
                quota = self.quota_state(fed.name, state)
                assert quota is not None
            qfilter = quota_filter(self.gaussian, fed)
            qstate = quota.filter_state()
            cap = self.request_cap()
            # Each unit's bound: within its global remainder, its quota's remainder and the per-request cap,
            # all fixed before any of this request's data is read (every operation runs for every unit).
            bounds = np.minimum(
                partial_clip(self.gaussian, fstate, noise_std=sigma, l2_clip=clip),
                partial_clip(qfilter, qstate, noise_std=sigma, l2_clip=clip),
            )
            if cap is not None:  # secagg: the rounding slack is charged on top, so it comes off the cap too
                np.minimum(bounds, max(sigma * np.sqrt(cap) - slack, 0.0), out=bounds)
            # secagg: a unit whose room sigma sqrt(T - S) is at most the rounding slack cannot pay
            # for any masked input again; it stops now (it would otherwise neither take part nor stop).
            full = sigma * np.sqrt(np.minimum(remaining(self.gaussian, fstate), remaining(qfilter, qstate)))
            room = full - slack
            gone = fstate.stopped | qstate.stopped
            # A room within rounding of zero (the subtraction's error is about an ulp of full) is none: a review
            # found units whose room was 3e-17 against a slack of 1.2e-4 refused by the filter by one ulp.
            starved = (room <= 1e-9 * full) & ~gone if slack else np.zeros(self.n_units, dtype=np.bool_)
            bounds = np.minimum(bounds, np.maximum(room, 0.0)) if slack else bounds
            if isinstance(units, StreamedGradients):
                result, new_q, clipped_norms, total = self._fused_gaussian(
                    units, fstate, qfilter, qstate, bounds / margin, sigma, slack
                )
            else:
                norms = units.norms()
                finite = np.isfinite(norms)
                norms = or_zero(finite, norms)
                headroom = room if cap is None else np.minimum(room, sigma * np.sqrt(cap) - slack)
                clip_to = bounds / units.clip_margins(norms, bounds, headroom)
                scales = clip_scales(norms, clip_to, dtype_eps=FLOAT32_EPS) * finite
                clipped_norms = _with_slack(units.scale(scales), slack)
                result, new_q = charge_with_quota(
                    self.gaussian, fstate, qfilter, qstate, noise_std=sigma, l2_norms=clipped_norms
                )
                total = units.weighted_sum(result.admitted)
            record = result.release(kind=kind, round_id=request.request_id, noise_std=sigma, l2_norms=clipped_norms)
            # A starved unit stops for this federation; globally only when its global room is what starved it.
            global_full = sigma * np.sqrt(remaining(self.gaussian, fstate))
            starved_global = starved & (global_full - slack <= 1e-9 * global_full)
            stopped = np.array(result.state.stopped | starved_global)
            newly = stopped & ~fstate.stopped
            new_state = replace(state, spent=np.array(result.state.spent), stopped=stopped)
            q_stopped = np.array(new_q.stopped | starved | stopped)
            q_halt = np.asarray(quota.halt_round)
            q_halt = select(q_stopped & ~qstate.stopped & (q_halt < 0), np.int64(request.round), q_halt)
            new_quota: AgentState | None = replace(
                quota, spent=np.array(new_q.spent), stopped=q_stopped, halt_round=q_halt
            )
            release = GaussianRecord(
                kind,
                sigma,
                record.l2_norms,
                # A starved unit is recorded as stopped by this release, as a refusal is, so that
                # replaying the ledger (protocol.filters.rebuild) stops it at the same round.
                np.asarray(record.refused) | starved_global,
                shares,
            )
            active_after = ~q_stopped
            noise = self.rng(request).normal(0.0, sigma, units.dim) if self.config.trust == "local" else None
            if noise is not None and units.trainable is not None:
                noise = or_zero(units.trainable, noise)  # frozen entries are not released: exact zeros
        else:
            assert self.realisation is not None
            if not isinstance(units, RowContributions):  # realised losses need the rows: client units only
                raise ValueError("realisation filter: expected materialised rows (client units)")
            rstate = state.realisation_state()
            norms = units.norms()
            finite = np.isfinite(norms)
            norms = or_zero(finite, norms)
            clips = np.full(norms.size, clip)
            margins = units.clip_margins(norms, clips, np.full(norms.size, np.inf))  # no filter of S <= T here
            scales = clip_scales(norms, clips / margins, dtype_eps=FLOAT32_EPS) * finite
            clipped_norms = units.scale(scales)
            step = decide(self.realisation, rstate, mu=clipped_norms / sigma)
            total = units.weighted_sum(step.participating)
            draw = np.asarray(self.rng(request).normal(0.0, sigma, units.dim), dtype=np.float64)
            if units.trainable is not None:
                draw = or_zero(units.trainable, draw)  # frozen entries are not released: exact zeros
            noise = draw
            losses = or_zero(step.participating, realised_loss(contribution=units.rows, noise=draw, noise_std=sigma))
            after = advance(rstate, step, losses=losses)
            newly = ~after.accepting & rstate.accepting
            new_state = replace(
                state, loss=np.array(after.loss), accepting=np.array(after.accepting), answered=after.answered
            )
            release = RealisationRecord(
                kind,
                sigma,
                or_zero(step.participating, clipped_norms),
                losses,
                step.participating,
                step.accept_next,
                shares,
            )
            active_after = after.accepting
            new_quota = None
        halt = np.asarray(state.halt_round)
        halt = select(newly & (halt < 0), np.int64(request.round), halt)
        new_state = replace(new_state, halt_round=halt)
        if masked is not None:
            return secagg_client.masked_reply(masked, total, self.rng(request)), new_state, release, new_quota
        if noise is not None:
            total = total + noise
        trust = self.config.trust
        # Central trust: the exact float64 sum (rounding it before the coordinator's noise would move the
        # release by more than a unit's charge); local trust: the noisy sum, rounded after the noise.
        dtype = wire.reply_dtype(trust)
        if trust == "central" and not active_after.any() and not np.any(total):
            reply = wire.ContributionReply(request.request_id, wire.REPLY_EXHAUSTED, trust, 0.0, np.zeros(0, dtype))
        else:
            reply = wire.ContributionReply(
                request.request_id,
                wire.REPLY_OK,
                trust,
                sigma if noise is not None else 0.0,
                total.astype(dtype),
            )
        return reply, new_state, release, new_quota

    def _fused_gaussian(
        self,
        units: StreamedGradients,
        fstate: FilterState,
        qfilter: GaussianFilter,
        qstate: FilterState,
        clip_to: NDArray[np.float64],
        sigma: float,
        slack: float,
    ) -> tuple[Charge, FilterState, NDArray[np.float64], NDArray[np.float64]]:
        """Streamed record gradients in one fused pass: (the charge, the quota's state, the charged norms, the sum).

        A unit's weight (clip scale x admitted) depends only on its own norm and its own state
        before this request (global and its federation's quota): its bound ``clip_to`` is fixed before
        the pass, and :func:`charge_with_quota` admits each unit from its own spends, stopped flags and
        charged norm. So the engine asks ``weights`` chunk by chunk, with that charge over the chunk's
        units, and the sum is formed in the same pass as the norms (client_agent/streaming.py). The
        charge over all units is then computed from all norms as in the two-pass path, and must have
        admitted and scaled exactly as the weights did; else nothing is released. Every unit, stopped
        or not, gets the same operations (privacy.md §8).
        """
        assert self.gaussian is not None
        gaussian = self.gaussian
        used = np.zeros(units.n_units, dtype=np.float64)

        def scales_of(norms: NDArray[np.float64], lo: int) -> NDArray[np.float64]:
            finite = np.isfinite(norms)
            bound = clip_to[lo : lo + norms.size]
            return clip_scales(or_zero(finite, norms), bound, dtype_eps=FLOAT32_EPS) * finite

        def weights(lo: int, norms: NDArray[np.float64]) -> NDArray[np.float64]:
            hi = lo + norms.size
            scales = scales_of(norms, lo)
            part = FilterState(spent=fstate.spent[lo:hi], stopped=fstate.stopped[lo:hi])
            qpart = FilterState(spent=qstate.spent[lo:hi], stopped=qstate.stopped[lo:hi])
            charged = _with_slack(units.charged_norms(norms, scales), slack)
            result, _ = charge_with_quota(gaussian, part, qfilter, qpart, noise_std=sigma, l2_norms=charged)
            used[lo:hi] = scales * result.admitted
            return used[lo:hi]

        # A stopped unit enters as the null element before the forward (privacy.md §2, §8).
        total = units.clipped_sum(weights, keep=~(fstate.stopped | qstate.stopped))
        scales = scales_of(units.norms(), 0)
        clipped_norms = _with_slack(units.scale(scales), slack)
        result, new_q = charge_with_quota(gaussian, fstate, qfilter, qstate, noise_std=sigma, l2_norms=clipped_norms)
        if not np.array_equal(used, scales * result.admitted):
            raise RuntimeError("fused release: the weights summed are not the scales and admissions charged")
        return result, new_q, clipped_norms, total

    def monitor_reply(
        self,
        request: wire.MonitorRequest,
        state: AgentState,
        federation: Federation | None = None,
        quota: AgentState | None = None,
        scoped: FederationLedger | None = None,
    ) -> tuple[wire.ContributionReply | wire.MaskedInputReply, AgentState, MonitorRecord]:
        """The monitor's report for round t (privacy.md §7); its cost was reserved at enrolment.

        ``tree`` (local): for each level i of the binary tree whose node closes at t
        (t divisible by 2^i), the number of this client's units that halted in
        (t - 2^i, t], plus N(0, noise_std^2); levels that do not close report 0 + noise
        too, so the shape never varies. ``svt`` (central): the exact number of active
        units, for the trusted coordinator's sparse vector. Each round is reported once.
        ``tree`` under secagg: the same counts with noise N(0, noise_std^2 / m) per node, masked,
        so that the sum over >= m clients carries the node noise noise_std^2 the reservation prices.
        """
        monitor = self.config.monitor
        fed = federation or self.config.served[0]
        if monitor.kind == "none" or not fed.monitor:
            raise PolicyError(
                "monitor queries are not allowed: this client reserved no monitor cost at enrolment"
                + ("" if monitor.kind == "none" else f" for federation {fed.name!r}")
            )
        # One federation's monitor, for good: the reservation covers one halt event per unit, and another
        # federation's view counts the same units' halts again (a hostile review: the monitor flag moved
        # from F to G between runs, every unit's halt entered 10 tree nodes against the 7 reserved). The
        # commit claims the reservation for this federation in its transaction (client_agent/ledger.py).
        holder = self.ledger.monitor_owner()
        if holder is not None and holder != fed.name:
            raise PolicyError(
                f"monitor queries are not allowed for federation {fed.name!r}: this client's monitor reservation "
                f"was used by federation {holder!r} (a monitor for another federation needs a new reservation)"
            )
        # The federation's own view (its quota's stops and halt rounds) when it has one; the monitor
        # counts the units that stopped *for this federation*, once each (privacy.md §7, §11).
        view = quota if quota is not None else state
        t = request.round
        last = state.monitor_last
        if t <= last:
            raise PolicyError(f"monitor round {t} asked; rounds up to {last} were already reported (once each)")
        new_state = replace(state, monitor_last=t)
        active = view.active
        if monitor.kind == "svt":
            # The reservation covers one sparse vector: the first run that asks owns it. A second
            # run would start a second SVT on the same units, an unreserved release.
            tag = _run_tag(request.run_id)
            owner = state.monitor_run
            if owner != 0 and owner != tag:
                raise PolicyError(
                    f"svt monitor asked by run {request.run_id!r}; this client's reserved sparse vector "
                    "belongs to an earlier run (re-arming needs a new reservation)"
                )
            new_state = replace(new_state, monitor_run=tag)
            total = np.array([float(active.sum())], dtype=wire.reply_dtype("central"))
            reply = wire.ContributionReply(request.request_id, wire.REPLY_OK, "central", 0.0, total)
            return reply, new_state, MonitorRecord(t)
        if t > monitor.max_rounds:
            raise PolicyError(f"monitor round {t} asked; the reserved tree covers at most {monitor.max_rounds} rounds")
        masked = None
        if request.secagg is not None:  # halt counts are at most n_units per node
            # The session's node noise, the same for every member (the fingerprint covers it); below
            # this client's reservation it would make the halt reports cost more than reserved.
            noise_std = request.noise_std if request.noise_std is not None else 0.0
            if not noise_std >= monitor.noise_std:
                raise PolicyError(
                    f"monitor noise_std {noise_std!r} asked; this client reserved its tree at noise std "
                    f">= {monitor.noise_std!r}"
                )
            masked = secagg_client.prepare_masked(
                scoped or FederationLedger(self.ledger, fed.name),
                request,
                request.secagg,
                noise_std=noise_std,
                n_units=self.n_units,
                l2_clip=1.0,
            )
        halt = view.halt_round
        counts = np.zeros(monitor.levels)
        for level in range(monitor.levels):
            width = 1 << level
            if t % width == 0:
                counts[level] = np.count_nonzero((halt > t - width) & (halt <= t))
        if masked is not None:
            release = MonitorRecord(t, masked.shares())
            return secagg_client.masked_reply(masked, counts, self.rng(request)), new_state, release
        noisy = counts + self.rng(request).normal(0.0, monitor.noise_std, monitor.levels)
        reply = wire.ContributionReply(
            request.request_id, wire.REPLY_OK, "local", monitor.noise_std, noisy.astype(np.float32)
        )
        return reply, new_state, MonitorRecord(t)
