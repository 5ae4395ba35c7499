"""The release step: one request to every enrolled node, one noisy sum back (or the monitor's reports).

A task says what to release (:class:`Ask`); a :class:`ReleaseStep` collects it. The round loop
(coordinator/rounds.py) holds one step for the whole run, chosen at enrolment:

- :class:`PlainRelease` (local and central trust): the request goes to every node and the
  decoded contributions are summed; in central trust the coordinator adds N(0, sigma^2) once.
- :class:`coordinator.secagg.SecaggRelease` (secagg trust): every release is one
  secure-aggregation session; the coordinator learns only the sum of at least m masked inputs.

Replies that do not decode or have the wrong shape are counted by the coordinator's own name and
left out; a client's error text is never kept (coordinator/transport.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from coordinator.monitor import Reports
from protocol import messages as wire

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig
    from coordinator.transport import RoundReplies, Transport

BuildRequest = Callable[[wire.SecaggInput | None], wire.Request]


@dataclass(frozen=True)
class Ask:
    """One release a task asks for: the same request for every node but its secagg input (if any)."""

    rnd: int
    purpose: str  # 'gradient', 'indicator' or 'plateau': names the request ids and the secagg session
    kind: str  # the message type
    build: BuildRequest  # the request, given the node's SecaggInput in secagg trust (None otherwise)
    size: int  # values in each reply's row


@dataclass
class Released:
    """What a release gave: its replies, the errors counted, the noisy sum (None: nothing released)."""

    replies: RoundReplies  # the release request's replies (secagg: the masked step's; errors of every step)
    errors: Counter[str]  # the replies' errors by code name, then the coordinator's own checks
    total: np.ndarray | None
    noise_var: float  # variance of the noise in ``total``
    secagg: dict[str, Any] = field(default_factory=dict)  # secagg: clients left after each step, or why it aborted
    # Whether every enrolled node's contribution is in ``total`` (none missing, refused or dropped).
    complete: bool = False


class ReleaseStep(Protocol):
    """How the run collects a release and the monitor's reports (plain, or wrapped in secagg sessions)."""

    def release(self, ask: Ask) -> Released: ...

    def reports(self, rnd: int) -> Reports: ...


def monitor_request(
    cfg: CoordinatorConfig, rnd: int, secagg: wire.SecaggInput | None = None, noise_std: float | None = None
) -> wire.MonitorRequest:
    """Round ``rnd``'s monitor request; secagg: with the session's node noise std (the one every client reserved)."""
    return wire.MonitorRequest(f"{cfg.wire_run_id}:monitor:r{rnd}", cfg.wire_run_id, rnd, cfg.trust, secagg, noise_std)


def request_noise_std(request: wire.Request) -> float:
    """The noise std a contribution request names: what each client charges for, and the release must add.

    Every release adds noise at the std of the request it answers, never the run's default: a request
    with its own noise (the accuracy checks, coordinator/tasks.py) is charged (norm / its sigma)^2 by each
    client, so a release with less noise would cost more than the clients paid (privacy.md §2).
    """
    sigma = getattr(request, "noise_std", None)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
        raise TypeError(f"a contribution request with a noise std > 0 was expected, got {type(request).__name__}")
    return float(sigma)


class PlainRelease:
    """Local and central trust: every node answers the request; the sum of the decoded rows is released."""

    def __init__(self, transport: Transport, cfg: CoordinatorConfig, nodes: list[int], rng: np.random.Generator):
        self.transport, self.cfg, self.nodes, self.rng = transport, cfg, nodes, rng

    def _send(self, kind: str, request: wire.Request) -> RoundReplies:
        payloads = {node: wire.encode_request(request) for node in self.nodes}
        return self.transport.send(kind, payloads, timeout=self.cfg.round_timeout)

    def release(self, ask: Ask) -> Released:
        """The decoded contributions summed, plus N(0, sigma^2) once in central trust.

        The noise variance is the clients' own in local trust (the sum of the noise each added).
        """
        request = ask.build(None)
        got = self._send(ask.kind, request)
        errors: Counter[str] = Counter(got.errors)
        total = np.zeros(ask.size, dtype=np.float64)
        noise_var = 0.0
        summed = 0
        for config, arrays in got.replies.values():
            try:
                reply = wire.ContributionReply.decode(config, arrays)
            except wire.ProtocolError:
                errors["malformed-reply"] += 1
                continue
            if reply.status == wire.REPLY_EXHAUSTED:  # central trust only: contributes nothing
                summed += 1
                continue
            if reply.total.size != ask.size:
                errors["wrong-shape"] += 1
                continue
            total += reply.total
            noise_var += reply.noise_added**2
            summed += 1
        if self.cfg.trust == "central":
            # The noise the clients were charged for: the request's own (an accuracy check has its own).
            sigma = request_noise_std(request)
            total += self.rng.normal(0.0, sigma, ask.size)
            noise_var = sigma**2
        complete = summed == len(self.nodes) and not errors and got.missing == 0
        return Released(got, errors, total, noise_var, complete=complete)

    def reports(self, rnd: int) -> Reports:
        """Each node's monitor reply as it decodes; the monitor checks their shapes."""
        got = self._send(wire.MONITOR, monitor_request(self.cfg, rnd))
        out = Reports([], asked=len(self.nodes), errors=Counter(got.errors))
        for config, arrays in got.replies.values():
            try:
                reply = wire.ContributionReply.decode(config, arrays)
            except wire.ProtocolError:
                out.errors["malformed-reply"] += 1
                continue
            out.values.append((reply.total, reply.noise_added))
        return out
