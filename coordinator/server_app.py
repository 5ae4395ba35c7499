"""The Flower ServerApp: rounds of federated GD with individual filtering (FZ Alg. 3 over units).

Each round: broadcast the model in a ``train.gradient`` request, collect each client's
sum of clipped per-unit gradients, add N(0, sigma^2 I) once in central trust (in local
trust the clients did), divide by the public number of enrolled units n (never by a
count of who is still active, privacy.md §4), take a gradient step.

Replies are mapped to requests by ``reply_to_message_id``; missing replies and error
replies are counted (by code) and the round goes on with what came: n is public, so
the privacy statement does not change.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from protocol import messages as wire
from protocol.models import build_model, flatten_parameters


class CoordinatorConfigError(ValueError):
    """The run configuration is missing a key or has a bad value."""


@dataclass(frozen=True)
class CoordinatorConfig:
    """What one run does; read from Flower's run config (keys with dashes)."""

    num_nodes: int
    n_public: int  # enrolled units: the public divisor
    rounds: int
    noise_std: float
    l2_clip: float
    learning_rate: float
    trust: str = "local"
    unit: str = "record"
    model: str = "logreg"
    model_args: str = "{}"
    seed: int = 0  # model initialisation only
    run_id: str = "run"
    # Central-trust noise comes from OS entropy. A fixed seed makes the noise reproducible by
    # anyone who knows it, which undoes the privacy: set it only for simulations and tests.
    noise_seed: int | None = None
    round_timeout: float = 120.0

    def __post_init__(self) -> None:
        for name in ("num_nodes", "n_public", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CoordinatorConfigError(f"{name}: expected an integer >= 1, got {value!r}")
        for name in ("noise_std", "l2_clip", "learning_rate", "round_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise CoordinatorConfigError(f"{name}: expected a finite number > 0, got {value!r}")
        if self.trust not in wire.TRUST_MODES:
            raise CoordinatorConfigError(f"trust: expected one of {wire.TRUST_MODES}, got {self.trust!r}")
        if self.unit not in wire.UNITS:
            raise CoordinatorConfigError(f"unit: expected one of {wire.UNITS}, got {self.unit!r}")
        try:
            parsed = json.loads(self.model_args)
        except (TypeError, json.JSONDecodeError) as exc:
            raise CoordinatorConfigError(f"model_args: expected a JSON object, got {self.model_args!r}") from exc
        if not isinstance(parsed, dict):
            raise CoordinatorConfigError(f"model_args: expected a JSON object, got {self.model_args!r}")

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> CoordinatorConfig:
        known = {f.replace("_", "-"): f for f in cls.__dataclass_fields__}
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            raise CoordinatorConfigError(f"run config: unknown keys {unknown}; expected keys among {sorted(known)}")
        kwargs = {known[k]: v for k, v in run_config.items()}
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise CoordinatorConfigError(f"run config: {exc}") from exc


@dataclass
class RoundLog:
    round: int
    replies: int
    errors: dict[str, int]
    missing: int
    noise_std: float
    duration_s: float
    metrics: dict[str, float] = field(default_factory=dict)


def noise_rng(cfg: CoordinatorConfig) -> np.random.Generator:
    """The central-trust noise source: OS entropy unless a simulation fixed ``noise_seed``."""
    return np.random.default_rng() if cfg.noise_seed is None else np.random.default_rng(cfg.noise_seed)


def wait_for_nodes(grid: Grid, count: int, timeout: float = 120.0) -> list[int]:
    """Node ids once ``count`` nodes are connected (in simulation the grid starts empty)."""
    start = time.monotonic()
    while True:
        ids = sorted(grid.get_node_ids())
        if len(ids) >= count:
            return ids
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"expected {count} connected nodes within {timeout} s, found {len(ids)}")
        time.sleep(0.1)


def send_round(
    grid: Grid, node_ids: list[int], message_type: str, content: Callable[[int], RecordDict], timeout: float
) -> tuple[dict[int, Message], Counter[str], int]:
    """Send one message per node; replies keyed by node (through reply_to_message_id), errors by code, missing."""
    messages = {node: Message(content(node), node, message_type) for node in node_ids}
    replies = grid.send_and_receive(list(messages.values()), timeout=timeout)
    by_id = {msg.metadata.message_id: node for node, msg in messages.items()}
    out: dict[int, Message] = {}
    errors: Counter[str] = Counter()
    for reply in replies:
        node = by_id.get(reply.metadata.reply_to_message_id)
        if node is None:
            errors["unmatched"] += 1
            continue
        if reply.has_error():
            errors[str(reply.error.code)] += 1
            continue
        out[node] = reply
    return out, errors, len(node_ids) - len(out) - sum(errors.values())


def reply_totals(reply: Message) -> wire.ContributionReply:
    """Decode a contribution reply through the shared schema."""
    content = reply.content
    config = dict(content[wire.CONFIG]) if wire.CONFIG in content.config_records else {}
    arrays = (
        {k: v.numpy() for k, v in content.array_records[wire.ARRAYS].items()}
        if wire.ARRAYS in content.array_records
        else {}
    )
    return wire.ContributionReply.decode(config, arrays)


def run_gradient(
    grid: Grid,
    cfg: CoordinatorConfig,
    *,
    evaluate: Callable[[np.ndarray], dict[str, float]] | None = None,
    on_round: Callable[[RoundLog], None] | None = None,
) -> dict[str, Any]:
    """Federated GD with filtering; returns the run's summary."""
    rng = noise_rng(cfg)
    model = build_model(cfg.model, seed=cfg.seed, **json.loads(cfg.model_args))
    params = flatten_parameters(model).astype(np.float32)
    node_ids = wait_for_nodes(grid, cfg.num_nodes)
    logs: list[RoundLog] = []
    for rnd in range(1, cfg.rounds + 1):
        start = time.monotonic()

        def content(node: int, rnd: int = rnd, params: np.ndarray = params) -> RecordDict:
            request = wire.GradientRequest(
                request_id=f"{cfg.run_id}:r{rnd}:n{node}",
                run_id=cfg.run_id,
                round=rnd,
                noise_std=cfg.noise_std,
                l2_clip=cfg.l2_clip,
                trust=cfg.trust,
                unit=cfg.unit,
                model=cfg.model,
                model_args=json.dumps(json.loads(cfg.model_args), sort_keys=True),
                parameters=params,
            )
            config, arrays = wire.encode_request(request)
            return RecordDict(
                {wire.CONFIG: ConfigRecord(config), wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()})}
            )

        replies, errors, missing = send_round(grid, node_ids, wire.GRADIENT, content, cfg.round_timeout)
        total = np.zeros(params.size, dtype=np.float64)
        for reply in replies.values():
            try:
                decoded = reply_totals(reply)
            except wire.ProtocolError:
                errors["malformed-reply"] += 1
                continue
            if decoded.status == wire.REPLY_OK:
                if decoded.total.size != params.size:
                    errors["wrong-shape"] += 1
                    continue
                total += decoded.total
        if cfg.trust == "central":
            total += rng.normal(0.0, cfg.noise_std, params.size)
        params = (params - cfg.learning_rate * total / cfg.n_public).astype(np.float32)
        log = RoundLog(rnd, len(replies), dict(errors), missing, cfg.noise_std, time.monotonic() - start)
        if evaluate is not None:
            log.metrics = evaluate(params)
        logs.append(log)
        if on_round is not None:
            on_round(log)
    return {
        "rounds_completed": len(logs),
        "final_metrics": logs[-1].metrics if logs else {},
        "rounds": [asdict(log) for log in logs],
        "parameters": params,
    }


def build_server_app(
    cfg: CoordinatorConfig,
    results: dict[str, Any],
    *,
    evaluate: Callable[[np.ndarray], dict[str, float]] | None = None,
) -> ServerApp:
    """A ServerApp for a run whose configuration is given directly (simulations pass it this way)."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        results.update(run_gradient(grid, cfg, evaluate=evaluate))

    return server


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Deployment entry: the run config comes from ``pyproject.toml`` and ``flwr run -c``."""
    cfg = CoordinatorConfig.from_run_config(dict(context.run_config))
    summary = run_gradient(grid, cfg)
    summary.pop("parameters")
    print(json.dumps(summary))
