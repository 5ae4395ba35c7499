"""Server-side evaluation of the model on public test data (no client data, so no privacy cost)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from workloads.models import load_flat_parameters


def model_evaluator(cfg: CoordinatorConfig, x: np.ndarray, y: np.ndarray):  # type: ignore[no-untyped-def]
    """A callable from flat parameters to metrics on (x, y): the workload's ``evaluate(model, x, y)``, or
    ``{"accuracy", "loss"}`` of a classifier (cross-entropy) when the workload has none."""
    workload = cfg.load_workload()
    model = workload.build_model(cfg.model, seed=cfg.seed, **json.loads(cfg.model_args))
    # Features keep their kind as the agents' engine sees them (client_agent.streaming): floats as float32,
    # integers (token ids) as int64, never converted to float.
    xa = np.ascontiguousarray(x)
    xt = torch.from_numpy(xa.astype(np.float32 if np.issubdtype(xa.dtype, np.floating) else np.int64))
    if workload.evaluate is not None:
        user_evaluate = workload.evaluate
        yu = torch.from_numpy(np.ascontiguousarray(y))

        def evaluate_with_workload(parameters: np.ndarray) -> dict[str, float]:
            load_flat_parameters(model, parameters)
            with torch.no_grad():
                return {k: float(v) for k, v in user_evaluate(model, xt, yu).items()}

        return evaluate_with_workload
    yt = torch.from_numpy(np.ascontiguousarray(y).astype(np.int64))

    def evaluate(parameters: np.ndarray) -> dict[str, float]:
        load_flat_parameters(model, parameters)
        with torch.no_grad():
            logits = model(xt)
            loss = torch.nn.functional.cross_entropy(logits, yt).item()
            accuracy = (logits.argmax(dim=1) == yt).double().mean().item()
        return {"accuracy": accuracy, "loss": loss}

    return evaluate


def load_test_data(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` from an .npz file named by the run config's ``test-data``."""
    try:
        with np.load(Path(path), allow_pickle=False) as data:
            if "x" not in data.files or "y" not in data.files:
                raise CoordinatorConfigError(f"test_data: expected arrays 'x' and 'y' in {path}, found {data.files}")
            return data["x"], data["y"]
    except FileNotFoundError as exc:
        raise CoordinatorConfigError(f"test_data: no file at {path}") from exc
