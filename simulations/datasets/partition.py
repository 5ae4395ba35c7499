"""Partitions of a dataset into clients: iid, label-skewed (Dirichlet), and MNIST into silos."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from simulations.datasets.checks import DataParameterError, finite_positive, int_at_least
from simulations.datasets.idx import default_data_dir, load_idx_dataset, normalise_images


def partition_iid(n_items: int, n_clients: int, *, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(n_items)`` into ``n_clients`` disjoint sorted int64 arrays whose sizes differ by at most 1."""
    n_items = int_at_least("n_items", n_items, 0)
    n_clients = int_at_least("n_clients", n_clients, 1)
    if n_items < n_clients:
        raise DataParameterError(f"n_items: expected at least n_clients={n_clients} items, got {n_items}")
    perm = np.random.default_rng(seed).permutation(n_items).astype(np.int64)
    return [np.sort(part) for part in np.array_split(perm, n_clients)]


_DIRICHLET_MAX_TRIES = 1000


def partition_dirichlet(
    labels: np.ndarray, n_clients: int, *, alpha: float, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among clients in Dirichlet(alpha) proportions.

    The per-class Dirichlet split of Hsu, Qi & Brown (2019, arXiv:1909.06335), as implemented in
    FedMA / NIID-Bench (Li et al. 2022): a client already holding ``n / n_clients`` items gets no
    further share, and the draw is repeated until every client has at least ``min_size`` items.
    Small ``alpha`` gives few classes per client; large ``alpha`` approaches IID. Returns disjoint
    sorted int64 index arrays covering ``range(len(labels))``; deterministic given ``seed``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataParameterError(f"labels: expected a 1-D integer array, got {labels.dtype} {labels.shape}")
    n_clients = int_at_least("n_clients", n_clients, 1)
    alpha = finite_positive("alpha", alpha)
    min_size = int_at_least("min_size", min_size, 0)
    n_items = labels.shape[0]
    if n_items < n_clients * min_size:
        raise DataParameterError(
            f"min_size: expected n_clients * min_size <= {n_items} items, got {n_clients} * {min_size}"
        )
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    cap = n_items / n_clients
    for _ in range(_DIRICHLET_MAX_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        sizes = np.zeros(n_clients, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            share = rng.dirichlet(np.full(n_clients, alpha))
            open_clients = sizes < cap
            share = np.where(open_clients, share, 0.0)
            total = share.sum()
            if not np.isfinite(total) or total <= 0.0:  # tiny alpha can underflow every open share to 0
                share, total = open_clients.astype(np.float64), float(open_clients.sum())
            cuts = (np.cumsum(share / total) * len(idx)).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
                sizes[client] += len(chunk)
        if sizes.min() >= min_size:
            return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
    raise DataParameterError(
        f"min_size: no Dirichlet(alpha={alpha}) split of {n_items} items over {n_clients} clients gave every client "
        f">= {min_size} items in {_DIRICHLET_MAX_TRIES} draws; lower min_size or n_clients, or raise alpha"
    )


def mnist_silos(
    clients: int,
    *,
    seed: int,
    data_dir: Path | None = None,
    download: bool = False,
    train_limit: int | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """MNIST split iid over ``clients`` silos: ``(parts, test_x, test_y)``, images normalised to (n, 1, 28, 28).

    ``train_limit`` keeps that many training records, drawn with ``seed`` (small test versions).
    """
    data_dir = data_dir or default_data_dir()
    train_x, train_y = load_idx_dataset("mnist", data_dir, split="train", download=download)
    test_x, test_y = load_idx_dataset("mnist", data_dir, split="test", download=download)
    if train_limit is not None:
        limit = int_at_least("train_limit", train_limit, 1)
        keep = np.sort(np.random.default_rng(seed).permutation(len(train_x))[:limit])
        train_x, train_y = train_x[keep], train_y[keep]
    train_x = normalise_images(train_x, dataset="mnist")
    parts = [(train_x[idx], train_y[idx]) for idx in partition_iid(len(train_x), clients, seed=seed)]
    return parts, normalise_images(test_x, dataset="mnist"), test_y
