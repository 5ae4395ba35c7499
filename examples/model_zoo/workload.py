"""Example workload: the sequence models users bring next, over token records served by a dict-item Dataset.

Models (each takes (b, T) token ids and gives ``CLASSES`` logits):

- ``gru`` / ``lstm``: an embedding into a recurrent layer, the last state into a Linear;
- ``transformer``: token and positional embeddings, ``layers`` x ``nn.TransformerEncoderLayer``
  (dropout 0, batch_first), mean-pooled;
- ``tied``: a tiny language-model head whose output Linear shares the embedding's weight;
- ``bag``: bag of tokens (Embedding, LayerNorm, Linear);
- ``frozen_bag``: ``bag`` with its embedding frozen (``requires_grad = False``): only the rest is
  released and charged.

The data: a torch ``Dataset`` whose items are dicts ``{"x": ids, "y": label, "id": k}`` (the
agent takes the keys ``x`` and ``y``; docs/workloads.md). Use it from an agent TOML
(``workload = "examples.model_zoo.workload:WORKLOAD"``, ``data-path`` an ``.npz`` of ``x``, ``y``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from workloads.registry import Workload

VOCAB, TOKENS, CLASSES = 64, 16, 4


class Recurrent(nn.Module):
    def __init__(self, *, cell: str = "lstm", dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.head(h[:, -1])


class Transformer(nn.Module):
    def __init__(self, *, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(TOKENS, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(self.enc(h).mean(dim=1))


class Tied(nn.Module):
    """Mean-pooled embeddings scored against the same embedding matrix (weight tying), then a Linear."""

    def __init__(self, *, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.out = nn.Linear(dim, VOCAB, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.head = nn.Linear(VOCAB, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.out(self.emb(x).mean(dim=1))))


def bag(*, dim: int = 32, frozen: bool = False) -> nn.Module:
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, dim)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.emb(x).mean(dim=1)))

    model = Bag()
    if frozen:
        model.emb.weight.requires_grad_(False)
    return model


class DictItems(Dataset[dict[str, Any]]):
    """Token records from an ``.npz`` (``x`` ids (n, T), ``y`` labels), each item a dict."""

    def __init__(self, path: Path | str) -> None:
        with np.load(path) as data:
            self.x, self.y = data["x"].astype(np.int64), data["y"].astype(np.int64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.from_numpy(self.x[i]), "y": int(self.y[i]), "id": i}


def dict_data(path: Path) -> Any:
    from workloads.data_sources import TorchDatasetSource

    return TorchDatasetSource(DictItems(path))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets.long(), reduction="none")


def make_records(n: int, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences whose label is the most frequent token's id modulo CLASSES."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, TOKENS))
    y = np.array([np.bincount(r, minlength=VOCAB).argmax() % CLASSES for r in x])
    return x, y


WORKLOAD = Workload(
    name="model_zoo",
    models={
        "gru": lambda dim=32, hidden=64: Recurrent(cell="gru", dim=dim, hidden=hidden),
        "lstm": lambda dim=32, hidden=64: Recurrent(cell="lstm", dim=dim, hidden=hidden),
        "transformer": Transformer,
        "tied": Tied,
        "bag": bag,
        "frozen_bag": lambda dim=32: bag(dim=dim, frozen=True),
    },
    loss=cross_entropy,
    data=dict_data,
)
