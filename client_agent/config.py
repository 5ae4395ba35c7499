"""The client agent's configuration: what its owner fixes once, before any request.

Read from Flower's node config: either flat keys (``ledger-path``, ``data-path``,
``epsilon``, ...) or ``agent-config`` naming a TOML file with the same keys. The
target (epsilon, delta), filter, unit, trust mode and monitor reservation are written
into the ledger when it is created and must match it ever after (privacy.md §9).
The policy is what the client keeps whatever the coordinator asks.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client_agent.high_water import default_path as high_water_default
from protocol.errors import FedfilterError
from protocol.filters import FILTER_KINDS, GaussianFilter
from protocol.messages import MESSAGE_TYPES, TRUST_MODES, UNITS
from protocol.realisation import RealisationFilter
from protocol.releases import tree_levels
from protocol.validate import PrivacyParameterError, as_float, integer, open_unit, positive, positive_int
from workloads.registry import BUILTIN_REF

AGENT_FILTERS: tuple[str, ...] = (*FILTER_KINDS, "realisation")
DEFAULT_MIN_NOISE_STD = 1e-6
DEFAULT_MAX_REQUEST_SHARE = 0.25
DEFAULT_FEDERATION = "default"
_FEDERATION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


class PolicyError(FedfilterError, ValueError):
    """A request the client's policy does not allow (nothing is spent)."""


# A deployed agent's reply leaves no sooner than this much over the slowest like reply before it.
DEFAULT_PACING_MARGIN = 0.25


class AgentConfigError(FedfilterError, ValueError):
    """The agent's configuration is missing a key or has a bad value."""


# SQLite's default SQLITE_MAX_LENGTH: the largest value (a stored reply) one row may hold, in bytes.
STORED_VALUE_BYTES = 1_000_000_000
REPLY_HEADROOM_BYTES = 1 << 20  # the reply archive's headers and small arrays


@dataclass(frozen=True)
class Policy:
    """Limits the client keeps whatever the coordinator asks (a request outside them spends nothing)."""

    # A safe non-zero floor: with noise_std >= 1e-6 every cost (norm / noise_std)^2 of a wire-valid
    # request is a finite float (the decoder also refuses pairs whose squares or ratios are not
    # finite normal numbers). Owners should set their own, larger floor.
    min_noise_std: float = DEFAULT_MIN_NOISE_STD
    min_noise_multiplier: float = 0.0  # noise_std / l2_clip
    max_clip: float = math.inf
    allowed_kinds: tuple[str, ...] = MESSAGE_TYPES  # the parser's default too
    allowed_trust: tuple[str, ...] = TRUST_MODES
    max_model_params: int = 10_000_000
    # A rate limit per run id, not a budget: a coordinator may start new run ids. What bounds a
    # unit's total loss is its filter over the ledger, which no run id resets (privacy.md §9).
    max_rounds_per_run: int = 100_000
    # A rate limit per ledger over the last 24 hours, whatever the run id: a coordinator (or anyone
    # who reaches the SuperLink's run submission) cannot make this client answer faster than this.
    max_requests_per_day: int = 1_000_000
    # secagg trust: the fewest clients whose inputs a session may sum (m); each adds sigma^2 / m of the noise.
    min_secagg_clients: int = 2
    # secagg trust: how many roster members may sign two survivor sets in one session (a peer whose
    # ledger was restored, or a cloned agent, forgets what it signed). A roster is accepted only when
    # 2m > n + f, so two survivor sets of m signers always share an honest one. None: the default
    # f = 2 * ceil(2n / 3) - n - 1, which is exactly m >= ceil(2n / 3) (a third may drop out).
    secagg_tolerance: int | None = None
    # secagg trust: the fewest fixed-point fraction bits; each masked input pays a rounding slack
    # sqrt(d) / 2^scale_bits on its norm, so a coordinator asking for few bits would burn budget.
    min_secagg_scale_bits: int = 16
    # Local training (client units): the most local SGD steps one request may ask for (0: none). A
    # rate limit on the client's compute, not a budget: the charge per request does not grow with it.
    max_local_steps: int = 100
    # Record units: the most memory (MiB) one chunk's activations, backprops and captured copies may
    # take. The coordinator chooses the model and its arguments; the agent sizes its chunks to this
    # budget (measured on the meta device) and refuses a model whose single record exceeds it.
    max_activation_mb: int = 2048
    # The most one request may cost any unit, as a share of its budget (the filter's threshold T in its
    # additive currency S = sum mu^2): a request with (l2_clip / noise_std)^2 > share * T is refused
    # unanswered. Without it one request with noise 1e-6 and no clip limit spends every unit's whole
    # budget at once (a drain, correctly charged, but a drain). 1.0 switches the cap off.
    max_request_share: float = DEFAULT_MAX_REQUEST_SHARE

    def __post_init__(self) -> None:
        # A NaN limit would compare False with everything and silently switch the limit off.
        for name, value in (
            ("policy-min-noise-std", self.min_noise_std),
            ("policy-min-noise-multiplier", self.min_noise_multiplier),
        ):
            if not math.isfinite(value) or value < 0:
                raise AgentConfigError(f"{name}: expected a finite number >= 0, got {value!r}")
        if self.min_noise_std <= 0:
            raise AgentConfigError(
                f"policy-min-noise-std: expected a number > 0 (a floor that keeps every cost finite), "
                f"got {self.min_noise_std!r}"
            )
        if not (math.isfinite(self.max_request_share) and 0 < self.max_request_share <= 1):
            raise AgentConfigError(
                "policy-max-request-share: expected a share of the budget in (0, 1] (what one request may cost a "
                f"unit at most; 1: no cap beyond the budget itself), got {self.max_request_share!r}"
            )
        if math.isnan(self.max_clip) or self.max_clip <= 0:
            raise AgentConfigError(f"policy-max-clip: expected a number > 0 (inf for no limit), got {self.max_clip!r}")
        for name, count in (
            ("policy-max-model-params", self.max_model_params),
            ("policy-max-rounds-per-run", self.max_rounds_per_run),
            ("policy-max-requests-per-day", self.max_requests_per_day),
            ("policy-max-activation-mb", self.max_activation_mb),
        ):
            integer(name, count, at_least=1, error=AgentConfigError)
        if self.secagg_tolerance is not None:
            integer("policy-secagg-tolerance", self.secagg_tolerance, at_least=0, error=AgentConfigError)
        if self.max_local_steps < 0:
            raise AgentConfigError(
                f"policy-max-local-steps: expected an integer >= 0 (0: no local training), got {self.max_local_steps!r}"
            )

    def secagg_faults(self, n: int) -> int:
        """f for a roster of ``n``: the members that may sign twice (restored or cloned), 2m > n + f."""
        if self.secagg_tolerance is not None:
            return self.secagg_tolerance
        return max(0, 2 * math.ceil(2 * n / 3) - n - 1)

    def describe(self) -> dict[str, object]:
        return {
            "min_noise_std": self.min_noise_std,
            "min_noise_multiplier": self.min_noise_multiplier,
            "max_clip": None if math.isinf(self.max_clip) else self.max_clip,
            "allowed_kinds": list(self.allowed_kinds),
            "allowed_trust": list(self.allowed_trust),
            "max_model_params": self.max_model_params,
            "max_rounds_per_run": self.max_rounds_per_run,
            "max_requests_per_day": self.max_requests_per_day,
            "min_secagg_clients": self.min_secagg_clients,
            "secagg_tolerance": "2*ceil(2n/3)-n-1" if self.secagg_tolerance is None else self.secagg_tolerance,
            "min_secagg_scale_bits": self.min_secagg_scale_bits,
            "max_local_steps": self.max_local_steps,
            "max_activation_mb": self.max_activation_mb,
            "max_request_share": self.max_request_share,
        }


@dataclass(frozen=True)
class MonitorReservation:
    """The active-set monitor's cost, reserved in every unit's filter at enrolment (privacy.md §7).

    ``tree``: local trust, binary-tree counter over N rounds with node noise std
    ``noise_std``; each unit's halt event lands in L = ceil(log2 N) + 1 nodes, so it
    costs S_m = L / noise_std^2 of the squared budget (T <- T - S_m).
    ``svt``: central trust, sparse vector on the exact count; epsilon_svt is split off
    the target (the filter runs at (epsilon - epsilon_svt, delta), basic composition).
    ``none``: no monitor; the coordinator may not run one against this client.
    """

    kind: str = "none"
    noise_std: float = 0.0
    max_rounds: int = 0
    epsilon_svt: float = 0.0

    @property
    def levels(self) -> int:
        return tree_levels(self.max_rounds) if self.max_rounds > 0 else 0

    @property
    def squared_cost(self) -> float:
        return self.levels / self.noise_std**2 if self.kind == "tree" else 0.0

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "noise_std": self.noise_std,
            "max_rounds": self.max_rounds,
            "epsilon_svt": self.epsilon_svt,
            "levels": self.levels,
            "squared_cost": self.squared_cost,
        }


@dataclass(frozen=True)
class Federation:
    """One coordinator this agent serves, on its own socket, drawing on every unit's budget up to a quota.

    Every federation's releases charge the same per-unit filter (one global budget per person,
    privacy.md §11); ``quota`` is the share of each unit's budget (the filter's threshold in its additive
    currency S = sum mu^2) that this federation's releases may take in all. A unit stops for a
    federation when its quota or the global budget is spent, whichever comes first. ``monitor``: this
    federation may use the active-set monitor the agent reserved at enrolment (at most one federation
    may: the reservation covers one halt event per unit). The socket, its peers and the secagg identity
    are the federation's own.
    """

    name: str
    quota: float = 1.0
    socket_path: Path | None = None
    socket_mode: int = 0o660
    socket_peers: tuple[str, ...] = ()
    monitor: bool = False
    secagg_identity_key: Path | None = None
    secagg_peers: Path | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _FEDERATION_NAME.match(self.name):
            raise AgentConfigError(
                f"federations: expected a name of 1-64 letters, digits, '_', '.' or '-' (first a letter or digit), "
                f"got {self.name!r}"
            )
        if isinstance(self.quota, bool) or not isinstance(self.quota, (int, float)):
            raise AgentConfigError(f"federations.{self.name}.quota: expected a number in (0, 1], got {self.quota!r}")
        if not (math.isfinite(self.quota) and 0 < self.quota <= 1):
            raise AgentConfigError(
                f"federations.{self.name}.quota: expected a share of every unit's budget in (0, 1], got {self.quota!r}"
            )
        if not 0 <= self.socket_mode <= 0o777 or self.socket_mode & ~0o660:
            raise AgentConfigError(
                f"federations.{self.name}: agent-socket-mode: expected 0660 or stricter (read and write for the "
                f"owner and the group, nothing for others), got {self.socket_mode:04o}"
            )
        if self.socket_path is not None and not self.socket_path.is_absolute():
            raise AgentConfigError(
                f"federations.{self.name}.socket: expected an absolute path (or a path relative to the agent TOML "
                f"file), got {str(self.socket_path)!r}"
            )

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "quota": self.quota, "monitor": self.monitor}


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent needs before its first request."""

    ledger_path: Path
    data_path: Path
    epsilon: float
    delta: float
    filter: str = "gdp"
    unit: str = "record"
    trust: str = "local"
    rdp_order: float | None = None
    realisation_max_rounds: int = 0
    monitor: MonitorReservation = field(default_factory=MonitorReservation)
    policy: Policy = field(default_factory=Policy)
    noise_seed: int | None = None  # simulations and tests only: reproducible noise
    # `fedfilter agent serve` only: the Unix socket the ClientApp proxy connects to, and its mode.
    socket_path: Path | None = None
    socket_mode: int = 0o660
    # The owner's workload (workloads/registry.py): "package.module:object" or an entry point name of
    # group fedfilter.workloads. Requests name its models and queries; they never name code.
    workload: str = BUILTIN_REF
    # secagg trust: this agent's long-term Ed25519 signing key (a file only the owner can read), and
    # the identity keys of the peers it will aggregate with, agreed outside the coordinator
    # (protocol.secagg, "identities and signatures"). Both are required in secagg trust.
    secagg_identity_key: Path | None = None
    secagg_peers: Path | None = None
    # Where the per-record engine runs: "cpu" (default), "cuda" or "cuda:N" when torch sees that device.
    device: str = "cpu"
    # The ledger's high-water mark (client_agent.high_water): a rolled-back ledger is refused. Deployed
    # agents keep one by default (``<ledger>.high-water``, or ``ledger-high-water``); None: no mark.
    high_water_path: Path | None = None
    # `fedfilter agent serve` only: the OS users (names or uids) whose processes may connect to the
    # socket (checked with SO_PEERCRED on every connection); empty: the service's own user only.
    socket_peers: tuple[str, ...] = ()
    # Further workloads on the same records (``workloads``, after ``workload``): every model and query
    # name must resolve to exactly one of them; all of them charge the same per-unit filter.
    extra_workloads: tuple[str, ...] = ()
    # The owner's audit log: one JSON line per request answered or refused (never sent anywhere). Deployed
    # agents keep one by default (``<ledger>.audit.jsonl``); None: the log records only (simulations).
    audit_log: Path | None = None
    # The coordinators this agent serves ([federations.NAME] tables); empty: one, named "default", with
    # the top-level socket, peers and secagg identity, quota 1 and the agent's monitor.
    federations: tuple[Federation, ...] = ()
    # `fedfilter agent serve` only: a reply leaves no sooner than (1 + margin) x the slowest answer to a
    # like request before it (client_agent/service.py ReplyPacer; privacy.md §8). None: replies leave
    # when ready. ``reply-pacing-margin``: a number >= 0 or "off"; by default 0.25, "off" in central trust.
    reply_pacing_margin: float | None = None

    @property
    def served(self) -> tuple[Federation, ...]:
        """The federations this agent answers: the configured ones, or the one implicit ``default``."""
        if self.federations:
            return self.federations
        return (
            Federation(
                DEFAULT_FEDERATION,
                1.0,
                self.socket_path,
                self.socket_mode,
                self.socket_peers,
                monitor=True,
                secagg_identity_key=self.secagg_identity_key,
                secagg_peers=self.secagg_peers,
            ),
        )

    def federation(self, name: str) -> Federation:
        """The served federation called ``name`` (an unknown name is a configuration error, never a default)."""
        for fed in self.served:
            if fed.name == name:
                return fed
        raise AgentConfigError(
            f"federation: expected one of {[f.name for f in self.served]} (this agent's federations), got {name!r}"
        )

    @property
    def workload_refs(self) -> tuple[str, ...]:
        """Every workload, the one that opens the data first."""
        return (self.workload, *self.extra_workloads)

    def __post_init__(self) -> None:
        self._check_federations()
        if self.trust == "secagg":
            for fed in self.served:
                if fed.secagg_identity_key is None or fed.secagg_peers is None:
                    where = "" if fed.name == DEFAULT_FEDERATION else f"federations.{fed.name}: "
                    raise AgentConfigError(
                        f"{where}secagg-identity-key and secagg-peers: expected both in secagg trust (this agent's "
                        "signing key and its trusted peers' identity keys; `fedfilter agent keygen` writes a key), "
                        "found "
                        f"{'neither' if fed.secagg_identity_key is None and fed.secagg_peers is None else 'one'}"
                    )
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise AgentConfigError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        try:
            positive("epsilon", self.epsilon)
            open_unit("delta", self.delta)
        except PrivacyParameterError as exc:
            raise AgentConfigError(str(exc)) from exc
        if not self.ledger_path.is_absolute():
            # Relative to what? The SuperNode runs the ClientApp in a folder of its own: a relative
            # ledger path would open a fresh, empty ledger there, which reads as a budget reset.
            raise AgentConfigError(
                f"ledger-path: expected an absolute path (or a path relative to the agent TOML file), "
                f"got {str(self.ledger_path)!r}"
            )
        if not 0 <= self.socket_mode <= 0o777 or self.socket_mode & ~0o660:
            raise AgentConfigError(
                f"agent-socket-mode: expected 0660 or stricter (read and write for the owner and the group, "
                f"nothing for others), got {self.socket_mode:04o}"
            )
        if self.socket_path is not None and not self.socket_path.is_absolute():
            raise AgentConfigError(
                f"agent-socket: expected an absolute path (or a path relative to the agent TOML file), "
                f"got {str(self.socket_path)!r}"
            )
        if not isinstance(self.workload, str) or not self.workload.strip():
            raise AgentConfigError(
                f"workload: expected 'package.module:object' or an entry point name, got {self.workload!r}"
            )
        if self.noise_seed is not None and self.noise_seed < 0:
            raise AgentConfigError(f"noise-seed: expected an integer >= 0, got {self.noise_seed}")
        for name, value, choices in (
            ("filter", self.filter, AGENT_FILTERS),
            ("unit", self.unit, UNITS),
            ("trust", self.trust, TRUST_MODES),
        ):
            if value not in choices:
                raise AgentConfigError(f"{name}: expected one of {choices}, got {value!r}")
        if self.filter == "realisation":
            if self.unit != "client":
                # Several records share one noise draw; a record's realised loss uses that noise,
                # so the other records' stopping times would depend on its data (privacy.md §6).
                raise AgentConfigError(
                    f"filter: 'realisation' needs unit 'client' (one unit per noise draw), got unit {self.unit!r}; "
                    "records that share a client's noise cannot use the realisation-level filter"
                )
            if self.trust != "local":
                raise AgentConfigError("filter: 'realisation' needs trust 'local' (the unit must know its noise)")
            if self.realisation_max_rounds < 1:
                raise AgentConfigError(
                    f"realisation-max-rounds: expected an integer >= 1 with filter 'realisation', "
                    f"got {self.realisation_max_rounds}"
                )
            if math.isinf(self.policy.max_clip) or self.policy.min_noise_std <= 0:
                raise AgentConfigError(
                    "filter 'realisation' needs policy-max-clip and policy-min-noise-std (they fix the cap mu_max)"
                )
            if self.policy.max_request_share < 1:
                # Its cost is the realised loss, known only after the release; what the filter bounds before is
                # mu = l2_clip / noise_std <= mu_max, and its rule reserves mu_max for the last request (TVC Alg. 1).
                raise AgentConfigError(
                    "policy-max-request-share: the realisation filter caps a request by mu_max = policy-max-clip / "
                    "policy-min-noise-std, not by a share of the budget; leave the share out (or 1), got "
                    f"{self.policy.max_request_share!r}"
                )
            if self.monitor.kind != "none":
                raise AgentConfigError("monitor: the realisation filter does not reserve a monitor yet; use 'none'")
        if self.monitor.kind == "tree" and self.trust not in ("local", "secagg"):
            raise AgentConfigError("monitor: 'tree' is the local-trust monitor (also secagg); central trust uses 'svt'")
        if self.monitor.kind == "svt" and self.trust != "central":
            raise AgentConfigError("monitor: 'svt' is the central-trust monitor; local trust uses 'tree'")
        if self.monitor.kind == "svt" and not 0 < self.monitor.epsilon_svt < self.epsilon:
            raise AgentConfigError(
                f"monitor-epsilon: expected 0 < epsilon_svt < epsilon = {self.epsilon}, got {self.monitor.epsilon_svt}"
            )

    def _check_federations(self) -> None:
        names = [fed.name for fed in self.federations]
        if len(set(names)) != len(names):
            raise AgentConfigError(f"federations: expected distinct names, got {names}")
        if self.federations and (
            self.socket_path is not None or self.socket_peers or self.secagg_identity_key or self.secagg_peers
        ):
            # secagg: one identity per federation. A key shared by two federations would let one coordinator
            # reuse a signature made for the other's session of the same id and roster (a second survivor set).
            raise AgentConfigError(
                "agent-socket / agent-socket-peers / secagg-identity-key / secagg-peers: expected them inside each "
                "[federations.NAME] table (socket, socket-peers, secagg-identity-key, secagg-peers) when "
                "federations are configured, found them at the top level too"
            )
        sockets = [fed.socket_path for fed in self.federations if fed.socket_path is not None]
        if len(set(sockets)) != len(sockets):
            raise AgentConfigError("federations: expected one socket per federation, found a socket shared by two")
        with_monitor = [fed.name for fed in self.served if fed.monitor]
        if len(with_monitor) > 1:
            raise AgentConfigError(
                f"federations: the agent's monitor reservation covers one halt event per unit, so at most one "
                f"federation may use it; found monitor = true in {with_monitor}"
            )
        if self.filter == "realisation" and (len(self.served) > 1 or self.served[0].quota < 1):
            raise AgentConfigError(
                "federations: the realisation filter serves one federation with quota 1 (its realised losses are "
                f"not split by quota yet), got {[f.describe() for f in self.served]}"
            )

    def gaussian_filter(self) -> GaussianFilter:
        """The unit filter with the monitor's cost reserved (privacy.md §7)."""
        epsilon = self.epsilon - (self.monitor.epsilon_svt if self.monitor.kind == "svt" else 0.0)
        options: dict[str, Any] = {}
        if self.filter == "renyi" and self.rdp_order is not None:
            options["order"] = self.rdp_order
        filt = GaussianFilter.create(self.filter, epsilon=epsilon, delta=self.delta, **options)
        if self.monitor.kind == "tree":
            filt = filt.reserve(squared_budget=self.monitor.squared_cost)
        return filt

    def realisation_filter(self) -> RealisationFilter:
        """TVC's filter with the cap mu_max = max_clip / min_noise_std fixed by the policy."""
        return RealisationFilter.create(
            epsilon=self.epsilon,
            delta=self.delta,
            max_rounds=self.realisation_max_rounds,
            mu_max=self.policy.max_clip / self.policy.min_noise_std,
        )


# --- parsing -------------------------------------------------------------------------------

_KEYS = {
    "ledger-path",
    "ledger-high-water",
    "data-path",
    "agent-socket-peers",
    "epsilon",
    "delta",
    "filter",
    "unit",
    "trust",
    "rdp-order",
    "realisation-max-rounds",
    "monitor",
    "monitor-noise-std",
    "monitor-max-rounds",
    "monitor-epsilon",
    "policy-min-noise-std",
    "policy-min-noise-multiplier",
    "policy-max-clip",
    "policy-allowed-kinds",
    "policy-allowed-trust",
    "policy-max-model-params",
    "policy-max-rounds-per-run",
    "policy-max-requests-per-day",
    "policy-secagg-min-clients",
    "policy-secagg-tolerance",
    "policy-secagg-min-scale-bits",
    "policy-max-local-steps",
    "policy-max-activation-mb",
    "policy-max-request-share",
    "workloads",
    "federations",
    "audit-log",
    "noise-seed",
    "agent-socket",
    "agent-socket-mode",
    "workload",
    "secagg-identity-key",
    "secagg-peers",
    "device",
    "reply-pacing-margin",
}
# Keys Flower itself puts into a simulated node's config.
_FLOWER_KEYS = {"partition-id", "num-partitions"}


def _get(raw: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    if key not in raw:
        if default is None:
            raise AgentConfigError(f"agent config: missing key {key!r}")
        return default
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):  # TOML reads any length of integer
        value = as_float(f"agent config: {key!r}", value, error=AgentConfigError)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise AgentConfigError(f"agent config: {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _names(raw: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    if key not in raw:
        return choices
    value = raw[key]
    if not isinstance(value, (str, list, tuple)):
        raise AgentConfigError(f"agent config: {key!r} must be a comma-separated string or a list, got {value!r}")
    items = value.split(",") if isinstance(value, str) else list(value)
    out = tuple(str(v).strip() for v in items if str(v).strip())
    for item in out:
        if item not in choices:
            raise AgentConfigError(f"agent config: {key!r} entries must be among {choices}, got {item!r}")
    return out


def parse_agent_config(node_config: Mapping[str, Any], *, simulation: bool = False) -> AgentConfig:
    """Build the agent's configuration from Flower's node config (flat keys or ``agent-config`` = TOML path).

    ``simulation`` is a switch in code, set only by the simulation engines: no configuration
    file or node-config key can set it. Only with it is ``noise-seed`` accepted (seeded noise is
    reproducible, and so guessable: a small seed was brute-forced and an exact count recovered).
    """
    raw: dict[str, Any] = dict(node_config)
    if "agent-config" in raw:
        path = Path(str(raw.pop("agent-config")))
        try:
            loaded = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise AgentConfigError(f"agent-config: no file at {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise AgentConfigError(f"agent-config: {path} is not valid TOML: {exc}") from exc
        # A relative path in the file means relative to the file: the SuperNode runs the
        # ClientApp in a folder of its own, where the owner's relative paths would mean nothing.
        for key in (
            "data-path",
            "ledger-path",
            "ledger-high-water",
            "audit-log",
            "agent-socket",
            "secagg-identity-key",
            "secagg-peers",
        ):
            if isinstance(loaded.get(key), str) and not Path(loaded[key]).is_absolute():
                loaded[key] = str(path.resolve().parent / loaded[key])
        for table in (loaded.get("federations") or {}).values():
            for key in ("socket", "secagg-identity-key", "secagg-peers"):
                if isinstance(table, dict) and isinstance(table.get(key), str) and not Path(table[key]).is_absolute():
                    table[key] = str(path.resolve().parent / table[key])
        raw = {**loaded, **raw}
    unknown = sorted(set(raw) - _KEYS - _FLOWER_KEYS)
    if unknown:
        raise AgentConfigError(f"agent config: unknown keys {unknown}; expected keys among {sorted(_KEYS)}")
    default = Policy()
    policy = Policy(
        min_noise_std=_get(raw, "policy-min-noise-std", float, default.min_noise_std),
        min_noise_multiplier=_get(raw, "policy-min-noise-multiplier", float, default.min_noise_multiplier),
        max_clip=_get(raw, "policy-max-clip", float, default.max_clip),
        allowed_kinds=_names(raw, "policy-allowed-kinds", MESSAGE_TYPES),
        allowed_trust=_names(raw, "policy-allowed-trust", TRUST_MODES),
        max_model_params=_get(raw, "policy-max-model-params", int, default.max_model_params),
        max_rounds_per_run=_get(raw, "policy-max-rounds-per-run", int, default.max_rounds_per_run),
        max_requests_per_day=_get(raw, "policy-max-requests-per-day", int, default.max_requests_per_day),
        min_secagg_clients=_get(raw, "policy-secagg-min-clients", int, default.min_secagg_clients),
        secagg_tolerance=raw.get("policy-secagg-tolerance"),
        min_secagg_scale_bits=_get(raw, "policy-secagg-min-scale-bits", int, default.min_secagg_scale_bits),
        max_local_steps=_get(raw, "policy-max-local-steps", int, default.max_local_steps),
        max_activation_mb=_get(raw, "policy-max-activation-mb", int, default.max_activation_mb),
        # The realisation filter caps a request by mu_max, not by a share of an additive budget (its default: none)
        max_request_share=_get(
            raw,
            "policy-max-request-share",
            float,
            1.0 if raw.get("filter") == "realisation" else default.max_request_share,
        ),
    )
    # Each reply is stored whole in the ledger before it is sent (a retry is answered from it), and SQLite holds
    # at most SQLITE_MAX_LENGTH (1e9) bytes in one value: 8 bytes a parameter in central trust (the exact float64
    # sum, protocol.messages.reply_dtype) and secagg (uint64 masked values), 4 in local trust.
    trust_named = raw.get("trust", "local")
    per_value = 4 if trust_named == "local" else 8
    if policy.max_model_params > (STORED_VALUE_BYTES - REPLY_HEADROOM_BYTES) // per_value:
        raise AgentConfigError(
            f"policy-max-model-params: expected at most {(STORED_VALUE_BYTES - REPLY_HEADROOM_BYTES) // per_value} "
            f"in {trust_named} trust (a reply of {per_value} bytes a parameter is stored whole in the ledger, "
            f"at most {STORED_VALUE_BYTES} bytes), got {policy.max_model_params}"
        )
    if not 1 <= policy.min_secagg_scale_bits <= 52:
        raise AgentConfigError(
            f"policy-secagg-min-scale-bits: expected an integer in [1, 52], got {policy.min_secagg_scale_bits}"
        )
    if policy.min_secagg_clients < 2:
        raise AgentConfigError(f"policy-secagg-min-clients: expected an integer >= 2, got {policy.min_secagg_clients}")
    monitor_kind = _get(raw, "monitor", str, "none")
    if monitor_kind not in ("none", "tree", "svt"):
        raise AgentConfigError(f"monitor: expected 'none', 'tree' or 'svt', got {monitor_kind!r}")
    monitor = MonitorReservation(kind=monitor_kind)
    if monitor_kind == "tree":
        monitor = MonitorReservation(
            kind="tree",
            noise_std=_positive_cfg(raw, "monitor-noise-std"),
            max_rounds=_positive_int_cfg(raw, "monitor-max-rounds"),
        )
    elif monitor_kind == "svt":
        monitor = MonitorReservation(kind="svt", epsilon_svt=_positive_cfg(raw, "monitor-epsilon"))
    seed = raw.get("noise-seed")
    if seed is not None and not simulation:
        raise AgentConfigError(
            "noise-seed: seeded noise is for simulations and tests only; a deployed agent draws its noise "
            "from the operating system (remove the key)"
        )
    if seed is not None:
        integer("noise-seed", seed, at_least=0, error=AgentConfigError)
    config = AgentConfig(
        ledger_path=Path(_get(raw, "ledger-path", str)),
        data_path=Path(_get(raw, "data-path", str)),
        epsilon=_get(raw, "epsilon", float),
        delta=_get(raw, "delta", float),
        filter=_get(raw, "filter", str, "gdp"),
        unit=_get(raw, "unit", str, "record"),
        trust=_get(raw, "trust", str, "local"),
        rdp_order=raw.get("rdp-order"),
        realisation_max_rounds=_get(raw, "realisation-max-rounds", int, 0),
        monitor=monitor,
        policy=policy,
        noise_seed=seed,
        socket_path=Path(_get(raw, "agent-socket", str)) if "agent-socket" in raw else None,
        socket_mode=_socket_mode(raw),
        workload=_get(raw, "workload", str, BUILTIN_REF),
        secagg_identity_key=Path(_get(raw, "secagg-identity-key", str)) if "secagg-identity-key" in raw else None,
        secagg_peers=Path(_get(raw, "secagg-peers", str)) if "secagg-peers" in raw else None,
        device=_get(raw, "device", str, "cpu"),
        high_water_path=_high_water(raw, simulation),
        socket_peers=_socket_peers(raw),
        extra_workloads=_extra_workloads(raw),
        federations=_federations(raw),
        audit_log=_audit_log(raw, simulation),
        reply_pacing_margin=_reply_pacing(raw),
    )
    check_side_files(config)
    if not simulation:
        # A deployed agent's owner states the two limits that bound what one request can cost (privacy.md
        # §11): the defaults (noise floor 1e-6, no clip limit) suit simulations, not somebody's data.
        missing = [key for key in ("policy-min-noise-std", "policy-max-clip") if key not in raw]
        if missing:
            raise AgentConfigError(
                f"{' and '.join(missing)}: expected explicit values in a deployed agent's configuration (the "
                "smallest noise std and the largest L2 clip this agent answers; together with "
                "policy-max-request-share they bound what one request can cost), found none"
            )
    return config


def check_side_files(config: AgentConfig) -> None:
    """Refuse an audit log, high-water mark or mark lock that is the ledger or one of SQLite's files of it.

    The agent opens, writes and closes these beside its ledger connection: on a ledger file a close would
    drop the connection's POSIX locks (client_agent/ledger.py, _HeldFiles) and a write would corrupt it.
    Compared by real path (``..`` and symbolic links resolved) and, for files that exist, by device and
    inode (hard links); checked when the configuration is read and again when the agent opens its ledger.
    """
    ledger = Path(os.path.realpath(config.ledger_path))
    sqlite_files = [ledger, *(ledger.with_name(ledger.name + x) for x in ("-wal", "-shm", "-journal"))]
    sides: list[tuple[str, Path | None]] = [("audit-log", config.audit_log)]
    if config.high_water_path is not None:
        mark = config.high_water_path
        sides += [("ledger-high-water", mark), ("ledger-high-water", mark.with_name(mark.name + ".lock"))]
    for key, side in sides:
        if side is None:
            continue
        real = Path(os.path.realpath(side))
        for f in sqlite_files:
            if real == f or (real.exists() and f.exists() and os.path.samefile(real, f)):
                raise AgentConfigError(
                    f"{key}: expected files other than the ledger and its WAL, got {str(side)!r}, which is {str(f)!r}"
                )


def _audit_log(raw: Mapping[str, Any], simulation: bool) -> Path | None:
    """``audit-log``: where the owner's audit lines go; by default beside the ledger, except in simulations."""
    if "audit-log" in raw:
        text = _get(raw, "audit-log", str)
        if not Path(text).is_absolute():
            raise AgentConfigError(f"audit-log: expected an absolute path, got {text!r}")
        return Path(text)
    if simulation:
        return None
    ledger = Path(_get(raw, "ledger-path", str))
    return ledger.with_name(ledger.name + ".audit.jsonl")


def _extra_workloads(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """``workloads``: further workload references on the same data (``workload`` opens the data)."""
    value = raw.get("workloads", [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise AgentConfigError(
            f"workloads: expected a list of 'package.module:object' or entry point names, got {value!r}"
        )
    refs = [v.strip() for v in value]
    first = _get(raw, "workload", str, BUILTIN_REF)
    if len(set(refs)) != len(refs) or first in refs:
        raise AgentConfigError(f"workloads: expected each workload once (with workload = {first!r}), got {refs}")
    return tuple(refs)


_FEDERATION_KEYS = {"socket", "socket-mode", "socket-peers", "quota", "monitor", "secagg-identity-key", "secagg-peers"}


def _federations(raw: Mapping[str, Any]) -> tuple[Federation, ...]:
    """``[federations.NAME]`` tables: socket, socket-peers, socket-mode, quota, monitor, secagg keys."""
    tables = raw.get("federations", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise AgentConfigError(
            f"federations: expected tables [federations.NAME] with socket, socket-peers and quota, got {tables!r}"
        )
    out = []
    for name, table in tables.items():
        unknown = sorted(set(table) - _FEDERATION_KEYS)
        if unknown:
            raise AgentConfigError(
                f"federations.{name}: unknown keys {unknown}; expected keys among {sorted(_FEDERATION_KEYS)}"
            )
        monitor = table.get("monitor", False)
        if not isinstance(monitor, bool):
            raise AgentConfigError(f"federations.{name}.monitor: expected true or false, got {monitor!r}")
        out.append(
            Federation(
                name=str(name),
                quota=table.get("quota", 1.0),
                socket_path=Path(_get(table, "socket", str)) if "socket" in table else None,
                socket_mode=_socket_mode({"agent-socket-mode": table.get("socket-mode", "0660")}),
                socket_peers=_socket_peers({"agent-socket-peers": table.get("socket-peers", [])}),
                monitor=monitor,
                secagg_identity_key=Path(_get(table, k, str)) if (k := "secagg-identity-key") in table else None,
                secagg_peers=Path(_get(table, "secagg-peers", str)) if "secagg-peers" in table else None,
            )
        )
    return tuple(out)


def _reply_pacing(raw: Mapping[str, Any]) -> float | None:
    """``reply-pacing-margin``: a number >= 0, or "off"; by default 0.25, "off" in central trust (trusted)."""
    if "reply-pacing-margin" not in raw:
        return None if raw.get("trust", "local") == "central" else DEFAULT_PACING_MARGIN
    value = raw["reply-pacing-margin"]
    if value == "off":
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise AgentConfigError(f'reply-pacing-margin: expected a number >= 0 or "off", got {value!r}')
    return float(value)


def _high_water(raw: Mapping[str, Any], simulation: bool) -> Path | None:
    """``ledger-high-water``: the mark's path; by default beside the ledger, except in simulations."""
    if "ledger-high-water" in raw:
        text = _get(raw, "ledger-high-water", str)
        if not Path(text).is_absolute():
            raise AgentConfigError(f"ledger-high-water: expected an absolute path, got {text!r}")
        return Path(text)
    return None if simulation else high_water_default(Path(_get(raw, "ledger-path", str)))


def _socket_peers(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """``agent-socket-peers``: a list of OS user names or uids allowed to connect to the socket."""
    value = raw.get("agent-socket-peers", [])
    if not isinstance(value, list) or not all(isinstance(v, str | int) and not isinstance(v, bool) for v in value):
        raise AgentConfigError(
            f"agent-socket-peers: expected a list of OS user names or uids (the SuperNode's user), got {value!r}"
        )
    return tuple(str(v) for v in value)


def _socket_mode(raw: Mapping[str, Any]) -> int:
    """``agent-socket-mode`` as octal permission bits, written as a string ("0660"); default 0660."""
    text = _get(raw, "agent-socket-mode", str, "0660")
    try:
        return int(text, 8)
    except ValueError as exc:
        raise AgentConfigError(
            f'agent-socket-mode: expected octal permission bits such as "0660", got {text!r}'
        ) from exc


def _positive_cfg(raw: Mapping[str, Any], key: str) -> float:
    try:
        return positive(key, _get(raw, key, float))
    except PrivacyParameterError as exc:
        raise AgentConfigError(str(exc)) from exc


def _positive_int_cfg(raw: Mapping[str, Any], key: str) -> int:
    try:
        return positive_int(key, _get(raw, key, int))
    except PrivacyParameterError as exc:
        raise AgentConfigError(str(exc)) from exc
