"""The coordinator's run configuration, validated at construction with errors that name the key.

Read from Flower's run config (``[tool.flwr.app.config]`` and ``flwr run -c 'key=value'``,
keys with dashes) or built directly by a simulation (``run_simulation`` passes an empty
run config, architecture.md).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from coordinator.analysts import ANALYSTS
from coordinator.tasks import TASKS
from protocol import messages as wire
from protocol.errors import FedfilterError
from workloads.registry import BUILTIN_REF, Workload, WorkloadError, load_workload

MONITORS: tuple[str, ...] = ("none", "svt", "tree")
# How the private accuracy checks pick the returned model (coordinator/tasks.py, GradientTask):
# 'best' the highest noisy accuracy (FZ Sec. 5.1); 'guarded' a later check replaces the best only
# when it beats it beyond both checks' noise bounds (never worse than the first check, w.p. 1 - alpha).
PLATEAU_RULES: tuple[str, ...] = ("best", "guarded")


class CoordinatorConfigError(FedfilterError, ValueError):
    """The run configuration is missing a key or has a bad value."""


@dataclass(frozen=True)
class CoordinatorConfig:
    """What one run does.

    ``rounds`` is the maximum number of rounds (queries, for the indicator task); the run
    stops earlier when the monitor reports that fewer than ``monitor_threshold`` units are
    active, or when the analyst has no further query. ``n_public`` is the number of enrolled
    units, the public divisor of every average (privacy.md §4).
    """

    num_nodes: int
    n_public: int
    rounds: int
    noise_std: float
    l2_clip: float
    task: str = "gradient"
    learning_rate: float = 0.1
    trust: str = "local"
    unit: str = "record"
    model: str = "logreg"
    model_args: str = "{}"
    seed: int = 0  # model initialisation and the analyst's choices; never the noise
    run_id: str = "run"
    # The active-set monitor (privacy.md §7): 'svt' in central trust, 'tree' in local trust.
    monitor: str = "none"
    monitor_threshold: int = 0  # stop once the monitor says fewer than this many units are active
    monitor_epsilon: float = 0.0  # svt: epsilon_svt = epsilon_1 + epsilon_2, reserved on every client
    analyst: str = "sweep"  # indicator task: 'sweep', 'refine' or 'cycle' (coordinator.analysts)
    query_columns: int = 0  # indicator task: how many columns the analyst may ask about (0: as many as rounds)
    accuracy_beta: float = 0.05  # indicator task: all stated error bounds hold together w.p. 1 - beta
    # Private plateau and model selection (gradient task): every k rounds a noisy training accuracy (record
    # units: the count of correctly classified records; client units: the sum of each client's fraction),
    # charged by every unit's filter like any release, divided by n_public; the run keeps the best round's
    # model by `plateau_rule` and stops after `patience` checks without a new best.
    plateau_every: int = 0
    # Checks at rounds start, start + every, ... (0: every, 2 every, ...); model selection from the worst-case
    # horizon, FZ Sec. 5.1.
    plateau_start: int = 0
    plateau_patience: int = 3
    plateau_min_delta: float = 0.0
    # The checks' noise std (clip 1: an accuracy never exceeds 1); 0: noise_std / l2_clip (a check costs at most
    # what a full-norm round does).
    plateau_noise_std: float = 0.0
    plateau_rule: str = "best"
    plateau_alpha: float = 0.05  # 'guarded': every check's noise within its bound, all together w.p. 1 - alpha
    eval_every: int = 0  # evaluate on server-side test data every k rounds (0: never)
    test_data: str = ""  # .npz with x, y (deployment; simulations pass an evaluate callable)
    checkpoint_every: int = 0  # save the model every k rounds and at the end (needs output_dir)
    # Start from a saved model (a checkpoint file, checkpoints/round_<k>.npz): its parameters, from round k + 1
    # (a run branched from another's prefix; the clients' ledgers must already hold that prefix's spends).
    initial_checkpoint: str = ""
    output_dir: str = ""  # rounds.jsonl, summary.json, checkpoints/ (empty: keep in memory only)
    # Stop and go on (coordinator/resume.py, seeded simulations only): every k rounds save checkpoints/snapshot.npz
    # (the model, the selection's state, the noise generator's state, the rounds so far); `resume` names one
    # to go on from, with the same clients' ledgers (their answers after the snapshot are replayed).
    snapshot_every: int = 0
    resume: str = ""
    progress: bool = True
    # Central-trust noise and the SVT's noise come from OS entropy. A fixed seed makes them
    # reproducible by anyone who knows it, which undoes the privacy: simulations and tests only.
    noise_seed: int | None = None
    # The coordinator session (privacy.md §9, "One session per run id"): 16 hex digits drawn from OS entropy
    # when a central-trust run starts (coordinator.rounds.run; a resumed run takes its snapshot's), never from
    # the run config. Every request names the run as `wire_run_id`, so no two such runs share a request id: a
    # run started again under the same run_id, seeded or not, cannot have a sum the clients stored replayed to
    # it and noised afresh (two releases charged once), nor go on with the one sparse vector the clients
    # reserved. In local and secagg trust the clients add the noise, so a replayed reply is the release
    # already made, and ids stay as configured (a seeded client mixes the id into its noise).
    session: str = ""
    # secagg trust (coordinator/secagg.py): m, the fewest clients a sum may hold (0: max(2, ceil(2n/3)) of the
    # enrolled clients), and the fixed-point scale 2^k of the encoded inputs.
    secagg_min_clients: int = 0
    secagg_scale_bits: int = 24
    round_timeout: float = 120.0
    enrol_timeout: float = 120.0
    # The run's workload (workloads/registry.py), the same object the clients name in their agent TOML:
    # the coordinator builds its model from it; requests carry only its model and query names.
    workload: str = BUILTIN_REF
    # Local training (gradient task, unit 'client'; DP-FedAvg, McMahan et al. 2018): each client runs
    # local_steps steps of minibatch SGD (local_lr, batches of local_batch_size records) from the
    # broadcast model and sends its update; the model moves by server_lr * (sum + noise) / n_public.
    # 0 local steps: federated GD on gradients with learning_rate. local_lr and local_batch_size
    # have no default (0: unset); each is needed with local steps and refused without them.
    local_steps: int = 0
    local_lr: float = 0.0
    local_batch_size: int = 0
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_nodes", "n_public", "rounds"):
            _int_at_least(name, getattr(self, name), 1)
        for name in (
            "monitor_threshold",
            "query_columns",
            "plateau_every",
            "plateau_start",
            "eval_every",
            "checkpoint_every",
            "snapshot_every",
            "seed",
        ):
            _int_at_least(name, getattr(self, name), 0)
        for name in ("noise_std", "l2_clip", "learning_rate", "round_timeout", "enrol_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise CoordinatorConfigError(f"{name}: expected a finite number > 0, got {value!r}")
        for name, value, choices in (
            ("task", self.task, tuple(TASKS)),
            ("trust", self.trust, wire.TRUST_MODES),
            ("unit", self.unit, wire.UNITS),
            ("monitor", self.monitor, MONITORS),
            ("plateau_rule", self.plateau_rule, PLATEAU_RULES),
        ):
            if value not in choices:
                raise CoordinatorConfigError(f"{name}: expected one of {choices}, got {value!r}")
        try:
            models = self.load_workload().models
        except WorkloadError as exc:
            raise CoordinatorConfigError(str(exc)) from exc
        if self.task == "gradient" and self.model not in models:
            raise CoordinatorConfigError(f"model: expected one of {sorted(models)}, got {self.model!r}")
        if self.task == "indicator" and self.analyst not in ANALYSTS:
            raise CoordinatorConfigError(f"analyst: expected one of {tuple(ANALYSTS)}, got {self.analyst!r}")
        # Request ids are '<run_id>:<purpose>[:<step>]:r<round>' (at most 256 characters, no '|', protocol/messages.py).
        # '#' starts the session (wire_run_id): a run_id holding one could name another run's session.
        run_id = self.run_id
        if not isinstance(run_id, str) or not run_id or len(run_id) > 160 or "|" in run_id or "#" in run_id:
            raise CoordinatorConfigError(
                "run_id: expected a non-empty string of at most 160 characters without '|' or '#', got "
                f"{self.run_id!r:.200}"
            )
        if not isinstance(self.session, str) or (self.session and not re.fullmatch(r"[0-9a-f]{16}", self.session)):
            raise CoordinatorConfigError(f"session: expected '' or 16 hex digits, got {self.session!r:.40}")
        if self.session and self.trust != "central":
            raise CoordinatorConfigError(
                "session: only a central-trust run has one (elsewhere the clients' stored replies hold their noise)"
            )
        if not isinstance(self.progress, bool):
            raise CoordinatorConfigError(f"progress: expected true or false, got {self.progress!r}")
        if self.noise_seed is not None and (
            isinstance(self.noise_seed, bool) or not isinstance(self.noise_seed, int) or self.noise_seed < 0
        ):
            raise CoordinatorConfigError(f"noise_seed: expected an integer >= 0 (or none), got {self.noise_seed!r}")
        if isinstance(self.accuracy_beta, bool) or not isinstance(self.accuracy_beta, (int, float)):
            raise CoordinatorConfigError(f"accuracy_beta: expected a number in (0, 1), got {self.accuracy_beta!r}")
        if not 0 < self.accuracy_beta < 1:
            raise CoordinatorConfigError(f"accuracy_beta: expected a number in (0, 1), got {self.accuracy_beta!r}")
        try:
            parsed = json.loads(self.model_args)
        except (TypeError, json.JSONDecodeError) as exc:
            raise CoordinatorConfigError(f"model_args: expected a JSON object, got {self.model_args!r}") from exc
        if not isinstance(parsed, dict):
            raise CoordinatorConfigError(f"model_args: expected a JSON object, got {self.model_args!r}")
        if self.monitor == "svt" and self.trust != "central":
            raise CoordinatorConfigError("monitor: 'svt' runs on exact counts and needs trust 'central'; use 'tree'")
        if self.monitor == "tree" and self.trust not in ("local", "secagg"):
            raise CoordinatorConfigError("monitor: 'tree' is the local-trust monitor (also secagg); central uses 'svt'")
        if self.trust == "secagg":
            m = self.secagg_min_clients
            if isinstance(m, bool) or not isinstance(m, int) or not (m == 0 or 2 <= m <= self.num_nodes):
                raise CoordinatorConfigError(
                    f"secagg_min_clients: expected 0 (default) or an integer in [2, num_nodes = {self.num_nodes}], "
                    f"got {m!r}"
                )
            bits = self.secagg_scale_bits
            if isinstance(bits, bool) or not isinstance(bits, int) or not 8 <= bits <= 52:
                raise CoordinatorConfigError(f"secagg_scale_bits: expected an integer in [8, 52], got {bits!r}")
        if self.monitor == "svt":
            eps = self.monitor_epsilon
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
                raise CoordinatorConfigError(f"monitor_epsilon: expected a finite number > 0 with svt, got {eps!r}")
        if self.monitor != "none" and self.monitor_threshold < 1:
            raise CoordinatorConfigError(
                f"monitor_threshold: expected an integer >= 1 with monitor {self.monitor!r}, "
                f"got {self.monitor_threshold}"
            )
        _int_at_least("plateau_patience", self.plateau_patience, 1)
        if not isinstance(self.plateau_min_delta, (int, float)) or not 0 <= self.plateau_min_delta < 1:
            raise CoordinatorConfigError(
                f"plateau_min_delta: expected a number in [0, 1), got {self.plateau_min_delta!r}"
            )
        sigma = self.plateau_noise_std
        bad_sigma = isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma)
        # A subnormal or tiny sigma passes "finite and > 0", yet the check's cost (1 / sigma)^2 overflows: the
        # clients would refuse every check (protocol.messages._noise_and_clip); refused here, before the run.
        if bad_sigma or sigma < 0 or (sigma and not (sigma >= 1e-150)):
            raise CoordinatorConfigError(
                f"plateau_noise_std: expected a finite number >= 0 (0: noise_std / l2_clip), got {sigma!r}"
            )
        alpha = self.plateau_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
            raise CoordinatorConfigError(f"plateau_alpha: expected a number in (0, 1), got {alpha!r}")
        if self.plateau_every and self.task != "gradient":
            raise CoordinatorConfigError(
                "plateau_every: the plateau test asks the training accuracy of the run's model; it needs the "
                "gradient task"
            )
        if self.eval_every and self.task != "gradient":
            raise CoordinatorConfigError("eval_every: evaluation applies to the gradient task only")
        if not isinstance(self.initial_checkpoint, str):
            raise CoordinatorConfigError(f"initial_checkpoint: expected a file path, got {self.initial_checkpoint!r}")
        if self.initial_checkpoint and (self.task != "gradient" or self.local_steps):
            raise CoordinatorConfigError("initial_checkpoint: a saved model starts the gradient task (no local steps)")
        if self.checkpoint_every and not self.output_dir:
            raise CoordinatorConfigError("checkpoint_every: checkpoints need output_dir")
        self._check_resume()
        self._check_local_training()

    def _check_resume(self) -> None:
        """snapshot_every and resume: a seeded gradient run (no local steps, monitor or secagg) with output_dir."""
        if not isinstance(self.resume, str):
            raise CoordinatorConfigError(f"resume: expected a snapshot's file path, got {self.resume!r}")
        for name in ("snapshot_every", "resume"):
            if not getattr(self, name):
                continue
            if self.noise_seed is None:
                raise CoordinatorConfigError(
                    f"{name}: a snapshot holds the noise generator's state, which lets its reader compute the run's "
                    "noise; only a simulation with noise_seed (whose noise the seed already fixes) may write one"
                )
            if self.task != "gradient" or self.local_steps or self.monitor != "none" or self.trust == "secagg":
                raise CoordinatorConfigError(
                    f"{name}: expected the gradient task without local steps, monitor or secure aggregation; "
                    f"got task {self.task!r}, local_steps {self.local_steps}, monitor {self.monitor!r}, "
                    f"trust {self.trust!r}"
                )
            if not self.output_dir:
                raise CoordinatorConfigError(f"{name}: snapshots need output_dir")
        if self.resume and self.initial_checkpoint:
            raise CoordinatorConfigError("resume: a resumed run starts from its snapshot, not from initial_checkpoint")

    def _check_local_training(self) -> None:
        """local_steps > 0: gradient task, client units, local_lr > 0 and local_batch_size >= 1; else none set."""
        _int_at_least("local_steps", self.local_steps, 0)
        _int_at_least("local_batch_size", self.local_batch_size, 0)
        for name in ("local_lr", "server_lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise CoordinatorConfigError(f"{name}: expected a finite number > 0, got {value!r}")
        if self.server_lr <= 0:
            raise CoordinatorConfigError(f"server_lr: expected a finite number > 0, got {self.server_lr!r}")
        if not self.local_steps:
            unused = [
                name
                for name, value, default in (
                    ("local_lr", self.local_lr, 0.0),
                    ("local_batch_size", self.local_batch_size, 0),
                    ("server_lr", self.server_lr, 1.0),
                )
                if value != default
            ]
            if unused:
                raise CoordinatorConfigError(
                    f"{', '.join(unused)}: set only with local_steps >= 1 (local training); "
                    "gradient rounds without local steps use learning_rate"
                )
            return
        if self.task != "gradient" or self.unit != "client":
            raise CoordinatorConfigError(
                f"local_steps: local training needs the gradient task and unit 'client' (a local update mixes "
                f"all of a client's records), got task {self.task!r} and unit {self.unit!r}"
            )
        if self.local_lr <= 0:
            raise CoordinatorConfigError(
                f"local_lr: expected a finite number > 0 with local_steps, got {self.local_lr!r}"
            )
        if self.local_batch_size < 1:
            raise CoordinatorConfigError(
                f"local_batch_size: expected an integer >= 1 with local_steps, got {self.local_batch_size!r}"
            )
        if max(self.local_steps, self.local_batch_size) > wire.MAX_WIRE_INT:
            raise CoordinatorConfigError(
                f"local_steps, local_batch_size: expected at most {wire.MAX_WIRE_INT}, "
                f"got {self.local_steps} and {self.local_batch_size}"
            )

    def load_workload(self) -> Workload:
        """The run's workload object (loaded once per reference)."""
        return load_workload(self.workload)

    @property
    def wire_run_id(self) -> str:
        """The run as its requests name it: ``run_id``, and ``#<session>`` in a run with one (at most 177
        characters, so every request id stays within the wire's 256)."""
        return f"{self.run_id}#{self.session}" if self.session else self.run_id

    def in_session(self) -> CoordinatorConfig:
        """This configuration with a fresh session drawn from OS entropy: a central-trust run's, once. Seeded
        runs too: a seed replays the coordinator's noise only for the same settings and the same replies."""
        if self.trust != "central" or self.session:
            return self
        return replace(self, session=secrets.token_hex(8))

    @property
    def canonical_model_args(self) -> str:
        return json.dumps(json.loads(self.model_args), sort_keys=True)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> CoordinatorConfig:
        """From Flower's run config: keys with dashes; ``noise-seed`` < 0 means none (TOML has no null)."""
        known = {f.replace("_", "-"): f for f in cls.__dataclass_fields__ if f != "session"}  # drawn, never set
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            raise CoordinatorConfigError(f"run config: unknown keys {unknown}; expected keys among {sorted(known)}")
        kwargs = {known[k]: v for k, v in run_config.items()}
        if isinstance(kwargs.get("noise_seed"), int) and kwargs["noise_seed"] < 0:
            kwargs["noise_seed"] = None
        if isinstance(kwargs.get("model_args"), Mapping):
            kwargs["model_args"] = json.dumps(dict(kwargs["model_args"]))
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise CoordinatorConfigError(f"run config: {exc}") from exc


def _int_at_least(name: str, value: object, lower: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lower:
        raise CoordinatorConfigError(f"{name}: expected an integer >= {lower}, got {value!r}")
    return value
