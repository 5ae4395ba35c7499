"""Synthetic data with known structure: Gaussian blobs, sparse 0/1 indicator rows."""

from __future__ import annotations

import numpy as np

from simulations.datasets.checks import DataParameterError, finite_positive, int_at_least


def synthetic_classification(
    n: int, d: int, n_classes: int, *, seed: int, separation: float
) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs: balanced labels, class means at distance ``separation`` from 0, unit-variance noise.

    Returns ``X`` float32 ``(n, d)`` and ``y`` int64 ``(n,)``; a (softmax) logistic regression learns it
    well once ``separation`` is a few noise standard deviations.
    """
    n = int_at_least("n", n, 1)
    d = int_at_least("d", d, 1)
    n_classes = int_at_least("n_classes", n_classes, 2)
    separation = finite_positive("separation", separation)
    if n < n_classes:
        raise DataParameterError(f"n: expected at least n_classes={n_classes} samples, got {n}")
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((n_classes, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    means = separation * directions
    y = rng.permutation(np.arange(n) % n_classes).astype(np.int64)
    x = means[y] + rng.standard_normal((n, d))
    return x.astype(np.float32), y


# Number of positives per unit, s in 1..s_max: name -> unnormalised weight of s.
DENSITY_PROFILES = ("heavy_tailed", "uniform", "constant")


def _positives_per_unit(n_units: int, s_max: int, profile: str, rng: np.random.Generator) -> np.ndarray:
    s = np.arange(1, s_max + 1)
    if profile == "heavy_tailed":
        weights = s.astype(np.float64) ** -2.0  # P(s) ∝ s^-2 on 1..s_max: median 1, a few units reach s_max
    elif profile == "uniform":
        weights = np.ones(s_max)
    elif profile == "constant":
        return np.full(n_units, s_max, dtype=np.int64)
    else:
        raise DataParameterError(f"density_profile: expected one of {list(DENSITY_PROFILES)}, got {profile!r}")
    return rng.choice(s, size=n_units, p=weights / weights.sum())


def sparse_indicator_data(
    n_units: int, k_queries: int, s_max: int, *, seed: int, density_profile: str = "heavy_tailed"
) -> np.ndarray:
    """uint8 ``(n_units, k_queries)`` 0/1 matrix; row ``i`` is positive on ``s_i <= s_max`` random queries.

    Models the sparse adaptive counting queries of Feldman & Zrnic (2021), Thm 1.2: a unit's
    individual privacy loss grows with the number of queries it is positive on, so with a
    heavy-tailed ``s_i`` most units spend far less than the worst case ``s_max``.
    Profiles: "heavy_tailed" (P(s) ∝ s^-2 on 1..s_max), "uniform" (on 1..s_max), "constant" (all s_max).
    """
    n_units = int_at_least("n_units", n_units, 1)
    k_queries = int_at_least("k_queries", k_queries, 1)
    s_max = int_at_least("s_max", s_max, 1)
    if s_max > k_queries:
        raise DataParameterError(f"s_max: expected s_max <= k_queries={k_queries}, got {s_max}")
    rng = np.random.default_rng(seed)
    counts = _positives_per_unit(n_units, s_max, density_profile, rng)
    data = np.zeros((n_units, k_queries), dtype=np.uint8)
    for row, count in enumerate(counts):
        data[row, rng.choice(k_queries, size=int(count), replace=False)] = 1
    return data
