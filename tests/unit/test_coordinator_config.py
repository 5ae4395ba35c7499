"""The coordinator's run configuration and its central-trust noise source."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.config import CoordinatorConfig, CoordinatorConfigError
from coordinator.rounds import noise_rng

BASE = dict(num_nodes=2, n_public=10, rounds=1, noise_std=1.0, l2_clip=1.0, learning_rate=0.1, progress=False)


def test_central_noise_is_unpredictable_by_default() -> None:
    # The noise must not follow from any public configuration value (such as seed).
    cfg = CoordinatorConfig(**BASE)
    assert cfg.noise_seed is None
    a, b = noise_rng(cfg).normal(size=8), noise_rng(cfg).normal(size=8)
    assert not np.array_equal(a, b)
    seeded = CoordinatorConfig(**BASE, noise_seed=5)
    np.testing.assert_array_equal(noise_rng(seeded).normal(size=8), noise_rng(seeded).normal(size=8))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"model_args": "{not json"}, "model_args: expected a JSON object"),
        ({"model_args": "[1, 2]"}, "model_args: expected a JSON object"),
        ({"noise_std": float("nan")}, "noise_std: expected a finite number > 0, got nan"),
        ({"rounds": 0}, "rounds: expected an integer >= 1, got 0"),
        ({"trust": "none"}, "trust: expected one of"),
        ({"model": "nope"}, "model: expected one of"),
        ({"task": "indicator", "analyst": "nope"}, r"analyst: expected one of \('sweep', 'refine', 'cycle'\)"),
        ({"run_id": "a|b"}, "run_id: expected a non-empty string of at most 160 characters without '|'"),
        ({"progress": "false"}, "progress: expected true or false, got 'false'"),
        ({"noise_seed": 1.5}, r"noise_seed: expected an integer >= 0 \(or none\), got 1.5"),
    ],
)
def test_bad_run_config_is_refused_at_construction(override: dict[str, object], message: str) -> None:
    with pytest.raises(CoordinatorConfigError, match=message):
        CoordinatorConfig(**(BASE | override))  # type: ignore[arg-type]


def test_unknown_run_config_key() -> None:
    with pytest.raises(CoordinatorConfigError, match=r"unknown keys \['epsilon'\]"):
        CoordinatorConfig.from_run_config({"num-nodes": 2, "epsilon": 1.0})


def test_pyproject_run_config_defaults_build_a_valid_config() -> None:
    # The deployed ServerApp reads [tool.flwr.app.config]; every field has a key there and it validates.
    import tomllib
    from dataclasses import fields
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    run_config = pyproject["tool"]["flwr"]["app"]["config"]
    cfg = CoordinatorConfig.from_run_config(run_config)
    assert cfg.noise_seed is None  # -1 in TOML: OS entropy
    # Every field but the session, which each unseeded run draws for itself (test_coordinator_session.py).
    assert {f.name.replace("_", "-") for f in fields(CoordinatorConfig)} - {"session"} == set(run_config)
