"""Client datasets with known answers, for tests, demonstrations and reproductions."""

from __future__ import annotations

import numpy as np

from simulations.datasets.synthetic import sparse_indicator_data

# Staircase groups: record r is positive on these columns of the 4 that a cycling analyst asks.
STAIRCASE_COLUMNS: tuple[tuple[int, ...], ...] = ((0, 1, 2, 3), (0, 1), (0,), ())


def staircase(n_clients: int, records: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Records in four equal groups, positive on 4, 2, 1 and 0 of every 4 cycled column queries.

    Under counting queries that cycle through columns 0..3, group g's records spend their
    budget at 1, 1/2, 1/4 and 0 times the full rate, so the active count falls in steps at
    known rounds: the ground truth for the active-set monitor's stopping round.
    """
    group = np.arange(records) % len(STAIRCASE_COLUMNS)
    x = np.zeros((records, 4), dtype=np.float32)
    for g, cols in enumerate(STAIRCASE_COLUMNS):
        for c in cols:
            x[group == g, c] = 1.0
    return [(x.copy(), np.zeros(records, dtype=np.int64)) for _ in range(n_clients)]


def sparse_counting(
    n_clients: int, records: int, *, k_queries: int, s_max: int, seed: int, profile: str = "heavy_tailed"
) -> list[tuple[np.ndarray, np.ndarray]]:
    """FZ Thm 1.2's setting split over clients: each record positive on at most ``s_max`` of ``k_queries`` columns."""
    data = sparse_indicator_data(n_clients * records, k_queries, s_max, seed=seed, density_profile=profile)
    x = data.astype(np.float32)
    return [(x[i * records : (i + 1) * records], np.zeros(records, dtype=np.int64)) for i in range(n_clients)]
