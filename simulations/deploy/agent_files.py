"""Client agents' files for a deployment: agent TOMLs, demo data, and the check an agent's owner runs first."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from simulations.deploy.files import DeployFileError
from simulations.federation import write_clients


def toml_value(value: object) -> str:
    """One value in TOML syntax: string, boolean, integer, float or a list of strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "inf" if value == math.inf else repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    raise DeployFileError(f"agent config value: expected a string, boolean, number or list of strings, got {value!r}")


def write_agent_toml(path: Path, values: Mapping[str, object]) -> Path:
    """Write an agent configuration file (flat ``key = value`` lines) and check that it parses back."""
    from client_agent.config import parse_agent_config

    text = "".join(f"{key} = {toml_value(value)}\n" for key, value in values.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    parse_agent_config({"agent-config": str(path)})
    return path


def write_agent_files(root: Path, parts: Sequence[tuple[np.ndarray, np.ndarray]], **agent: object) -> list[Path]:
    """Data files, ledgers folder and ``agent{i}.toml`` (absolute paths) for each part, under ``root``.

    Each TOML names its service's socket, ``agent{i}.sock`` beside it (``fedfilter agent serve``), and
    states the policy a deployed agent must state: a noise floor and a clip limit (default 1.0 each: the
    demo runs ask noise 3 and clip 1) and the per-request cap those allow (at least the default quarter;
    more when one request within them costs more, as the demos' few-round runs do at epsilon 2).
    """
    from simulations.federation import request_share

    root = root.resolve()
    values: dict[str, Any] = {k.replace("_", "-"): v for k, v in agent.items()}
    agent = values
    agent.setdefault("policy-min-noise-std", 1.0)
    agent.setdefault("policy-max-clip", 1.0)
    if "policy-max-request-share" not in agent:
        agent["policy-max-request-share"] = request_share(
            str(agent.get("filter", "gdp")),
            epsilon=float(agent["epsilon"]),  # type: ignore[arg-type]
            delta=float(agent["delta"]),  # type: ignore[arg-type]
            noise_std=float(agent["policy-min-noise-std"]),  # type: ignore[arg-type]
            clip=float(agent["policy-max-clip"]),  # type: ignore[arg-type]
        )
    per = write_clients(root, parts, ledger_dir=root / "ledgers", **values)
    return [
        write_agent_toml(root / f"agent{pid}.toml", per[pid] | {"agent-socket": str(root / f"agent{pid}.sock")})
        for pid in sorted(per)
    ]


def demo_parts(agents: int, *, records: int = 40, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Synthetic demo data per agent: 4 features, 2 classes; half the records have small gradients."""
    if agents < 1 or records < 2:
        raise DeployFileError(f"demo: expected agents >= 1 and records >= 2, got {agents} and {records}")
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(agents):
        x = rng.normal(size=(records, 4)).astype(np.float32)
        x[records // 2 :] *= 0.05  # these records' units outlive the others
        parts.append((x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)))
    return parts


def effective_policy(cfg: Any) -> dict[str, object]:
    """The policy the agent keeps, with what one request can cost a unit at most (issue 23).

    The cost of one request is (C / sigma)^2 in the filter's currency S = sum mu^2, at most
    (policy-max-clip / policy-min-noise-std)^2 and at most policy-max-request-share of the threshold T.
    """
    from client_agent.config import AgentConfig

    assert isinstance(cfg, AgentConfig)
    policy = cfg.policy.describe()
    if cfg.filter == "realisation":
        policy["one_request_costs_at_most"] = "the realisation filter's cap mu_max = max_clip / min_noise_std"
        return policy
    threshold = cfg.gaussian_filter().threshold
    limits = {"policy-max-request-share": cfg.policy.max_request_share * threshold}
    if cfg.policy.max_request_share >= 1.0:
        limits["policy-max-request-share"] = threshold  # the budget itself (partial clipping)
    if math.isfinite(cfg.policy.max_clip):
        limits["policy-max-clip / policy-min-noise-std"] = (cfg.policy.max_clip / cfg.policy.min_noise_std) ** 2
    binding = min(limits, key=lambda k: limits[k])
    policy["threshold_T"] = threshold
    policy["one_request_costs_at_most"] = {
        "S": limits[binding],
        "share_of_budget": limits[binding] / threshold,
        "set_by": binding,
        "requests_to_spend_a_budget_at_least": math.ceil(threshold / limits[binding] - 1e-12),
    }
    return policy


def check_agent_file(path: Path) -> dict[str, object]:
    """Validate an agent TOML as the ClientApp will: configuration, data file, and an existing ledger.

    Returns a short description; raises ``AgentConfigError``, ``LedgerError`` or :class:`DeployFileError`
    naming what was expected and what was found. Nothing is created or spent.
    """
    from client_agent.agent import open_client_data
    from client_agent.config import parse_agent_config
    from client_agent.ledger_report import ledger_summary

    cfg = parse_agent_config({"agent-config": str(path)})  # relative paths resolve against the file's folder
    if not cfg.data_path.exists():
        raise DeployFileError(
            f"data-path: expected the workload's data (an .npz file by default), found nothing at {cfg.data_path}"
        )
    try:
        workload, source = open_client_data(cfg)  # the workload named in the file, and its data source
    except ValueError as exc:  # a data file the workload cannot read: this check exists to say so, exit code 2
        raise DeployFileError(str(exc)) from exc
    out: dict[str, object] = {
        "agent-config": str(path),
        "workload": workload.name,
        "records": len(source),
        "units": len(source) if cfg.unit == "record" else 1,
        "target": f"({cfg.epsilon:g}, {cfg.delta:g})",
        "filter": cfg.filter,
        "unit": cfg.unit,
        "trust": cfg.trust,
        "policy": cfg.policy.describe(),
    }
    from client_agent.workload_check import dry_run

    out["effective_policy"] = effective_policy(cfg)
    # Every registered model, loss, validity rule and query on a few of the owner's own records (locally).
    out["dry-run"] = dry_run(workload, source, unit=cfg.unit)
    if len(cfg.workload_refs) > 1:
        from client_agent.agent import _name_index
        from workloads.registry import load_workload

        extra = tuple(load_workload(ref) for ref in cfg.extra_workloads)
        _name_index((workload, *extra))  # a name in two workloads stops the check, as it stops the agent
        out["workloads"] = [workload.name, *(w.name for w in extra)]
        for other in extra:
            out[f"dry-run {other.name}"] = dry_run(other, source, unit=cfg.unit)
    out["federations"] = [
        {**fed.describe(), "socket": None if fed.socket_path is None else str(fed.socket_path)} for fed in cfg.served
    ]
    if cfg.socket_path is not None:
        out["agent-socket"] = str(cfg.socket_path)
    if cfg.secagg_identity_key is not None and cfg.secagg_peers is not None:
        from client_agent.identity import load_identity, load_peers
        from protocol.secagg import identity_public_key

        out["secagg-identity"] = identity_public_key(load_identity(cfg.secagg_identity_key)).hex()
        out["secagg-peers"] = len(load_peers(cfg.secagg_peers))
    if cfg.ledger_path.exists():
        from client_agent.agent import Agent

        Agent(cfg).close()  # the ClientApp's own check: the ledger was created with this configuration and data
        summary = ledger_summary(cfg.ledger_path)
        out["ledger"] = {k: summary[k] for k in ("units_total", "units_active", "units_exhausted", "spent_max")}
    elif not cfg.ledger_path.parent.is_dir():
        raise DeployFileError(f"ledger-path: expected an existing folder, found none at {cfg.ledger_path.parent}")
    else:
        out["ledger"] = "created at the first request"
    return out
