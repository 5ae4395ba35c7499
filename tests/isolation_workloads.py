"""Owner workloads for the isolation audit (tests/unit/test_isolation_audit.py): three that mix records when
run on a batch, and non-mixing controls on every layer path of the per-record engine.

Each is an ordinary workload (workloads.registry.Workload) that an agent TOML could name, e.g.
``workload = "tests.isolation_workloads:CENTRED"``. The mixing ones are the issue-22 findings:

- ``CENTRED``: squared error against batch-centred targets (the loss subtracts the batch's mean target);
- ``RESCALE``: features divided by the batch's largest magnitude when it exceeds a threshold that the
  request's ``model_args`` choose (a coordinator can keep a synthetic batch below it and real data above);
- ``EMB_CENTRED``: token embeddings centred over the batch before pooling.

Run on a batch, each lets one record's data move another record's contribution; run on each record
alone (client_agent.isolation), the mean of a batch of one is that record.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from workloads.registry import DataSource, Query, Workload

FEATURES = 6
CLASSES = 3
TOKENS, VOCAB = 8, 20


def _data(path: Path) -> DataSource:
    from workloads.data_sources import open_source

    return open_source(path)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, 2))


def centred_mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Squared error against targets centred over the batch: mixes records."""
    t = targets.to(outputs.dtype).reshape(outputs.shape)
    return ((outputs - (t - t.mean(dim=0, keepdim=True))) ** 2).sum(dim=1)


def plain_mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets.to(outputs.dtype).reshape(outputs.shape)) ** 2).sum(dim=1)


class BatchRescale(nn.Module):
    """Divides the features by the batch's largest magnitude when it exceeds ``threshold`` (a model argument)."""

    def __init__(self, threshold: float = 3.0) -> None:
        super().__init__()
        self.threshold = threshold
        self.body = nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peak = x.abs().amax()
        scale = torch.where(peak > self.threshold, peak, torch.ones_like(peak))
        return self.body(x / scale)


class EmbeddingCentred(nn.Module):
    """Token embeddings centred over the batch, then mean-pooled: mixes records."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        return self.head((e - e.mean(dim=0, keepdim=True)).mean(dim=1))


# -- non-mixing controls, one per layer path ---------------------------------------------------------


class SeqLinear(nn.Module):
    """Linear on sequences (b, T, in): the per-record bmm rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x.reshape(x.shape[0], 3, 2))).mean(dim=1))


class Convs(nn.Module):
    """Conv2d then Conv1d on (b, 6) features seen as (b, 1, 2, 3) and (b, 2, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.c2 = nn.Conv2d(1, 4, (2, 2), padding=1)
        self.c1 = nn.Conv1d(4, 2, 2, stride=2)
        self.head = nn.Linear(2 * 6, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c2(x.reshape(x.shape[0], 1, 2, 3)))  # (b, 4, 3, 4)
        h = torch.relu(self.c1(h.reshape(h.shape[0], 4, 12)))  # (b, 2, 6)
        return self.head(h.flatten(1))


class Norms(nn.Module):
    """LayerNorm and GroupNorm: parameters whose per-record gradients are taken directly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 8)
        self.ln = nn.LayerNorm(8)
        self.gn = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.gn(self.ln(self.a(x)))))


class Tokens(nn.Module):
    """Embedding (repeated tokens) then a Linear on the mean."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).mean(dim=1))


class Recurrent(nn.Module):
    """An embedding into an LSTM or a GRU, the last state into a Linear."""

    def __init__(self, cell: str = "lstm") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(4, 5, batch_first=True)
        self.head = nn.Linear(5, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.head(h[:, -1])


class Attention(nn.Module):
    """Token and positional embeddings, one multi-head self-attention, mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.pos = nn.Embedding(TOKENS, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        out, _ = self.att(h, h, h, need_weights=False)
        return self.head(out.mean(dim=1))


class Borrowed(nn.Module):
    """A parameter used outside its module's forward: every gradient taken directly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x))) + torch.sin(x @ self.a.weight.t())[:, :CLASSES]


class Branchy(nn.Module):
    """Python control flow on a value: vmap cannot run it, so the agent refuses it (whatever the data)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if float(h.abs().max()) > 0.5:  # a batch would branch on its largest record
            h = h * 2.0
        return self.head(h)


class RunningMax(nn.Module):
    """Scales features by the largest magnitude seen so far, kept as a Python float on the module (review F1):
    run record by record, one record's data would reach the next. vmap cannot run it: refused."""

    def __init__(self, floor: float = 1.0) -> None:
        super().__init__()
        self.peak = floor
        self.body = nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.peak = max(self.peak, float(x.abs().max()))
        return self.body(x / self.peak)


class TwoTables(nn.Module):
    """A token table over the record and a 'category' table over its first id, of a size the coordinator
    chooses (review F3): an id beyond it must make its record null, not an error."""

    def __init__(self, categories: int = VOCAB) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 4)
        self.cat = nn.Embedding(categories, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(x).mean(dim=1) + self.cat(x[:, 0]))


class KeywordTables(nn.Module):
    """TwoTables with the category table called by keyword and the tokens pooled by an EmbeddingBag (a second
    review: the guard missed ``input=`` calls)."""

    def __init__(self, categories: int = VOCAB) -> None:
        super().__init__()
        self.tok = nn.EmbeddingBag(VOCAB, 4, mode="mean")
        self.cat = nn.Embedding(categories, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(x) + self.cat(input=x[:, 0]))


class TiedMaxNorm(nn.Module):
    """An embedding with max_norm whose table is also used whole (review F2): the in-place renormalisation
    would let records see each other's lookups. Refused by model_problems."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4, max_norm=0.5)
        self.head = nn.Linear(VOCAB, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).mean(dim=1) @ self.emb.weight.t())


CE = functools.partial(F.cross_entropy, reduction="none")


def _ce(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return CE(outputs, targets.long())


def _valid(x: torch.Tensor, y: torch.Tensor, model: Any = None) -> torch.Tensor:
    from workloads.registry import finite_features

    return finite_features(x, y, model)


CENTRED = Workload(name="centred", models={"mlp": _mlp}, loss=centred_mse, data=_data, valid=_valid)
RESCALE = Workload(name="rescale", models={"rescale": BatchRescale}, loss=_ce, data=_data, valid=_valid)
EMB_CENTRED = Workload(name="emb_centred", models={"emb": EmbeddingCentred}, loss=_ce, data=_data, valid=_valid)
REGRESSION = Workload(name="regression", models={"mlp": _mlp}, loss=plain_mse, data=_data, valid=_valid)
CONTROLS = Workload(
    name="controls",
    models={
        "linear": lambda: nn.Sequential(nn.Linear(FEATURES, 5), nn.ReLU(), nn.Linear(5, CLASSES)),
        "seq_linear": SeqLinear,
        "conv": Convs,
        "norms": Norms,
        "tokens": Tokens,
        "lstm": functools.partial(Recurrent, "lstm"),
        "gru": functools.partial(Recurrent, "gru"),
        "attention": Attention,
        "borrowed": Borrowed,
        "branchy": Branchy,
        "running_max": RunningMax,
        "two_tables": TwoTables,
        "keyword_tables": KeywordTables,
        "tied_max_norm": TiedMaxNorm,
    },
    loss=_ce,
    data=_data,
    valid=_valid,
)


def _token_correct(x: Any, y: Any, args: Any) -> Any:
    """'correct' for token records: the model's argmax against the label (the ids as int64)."""
    import numpy as np

    with torch.no_grad():
        out = args.model(torch.from_numpy(np.ascontiguousarray(x)).long())
    return (out.argmax(1).numpy() == np.asarray(y).reshape(-1)).astype("float32")


def _token_threshold(x: Any, y: Any, args: Any) -> Any:
    return (x.reshape(len(x), -1)[:, args.column] > args.value).astype("float32")


# The controls with an accuracy check that runs their token models, and a threshold query (issue 24 review).
TOKEN_QUERIES = Workload(
    name="token_queries",
    models=CONTROLS.models,
    loss=CONTROLS.loss,
    data=CONTROLS.data,
    valid=CONTROLS.valid,
    queries={"correct": Query(_token_correct, needs_model=True), "threshold": Query(_token_threshold)},
)


# --- client units (a hostile review, 2026-11-26): what the owner's code sees of a stopped client -----------

SEEN: list[float] = []  # the largest |value| each call of the probe's model or query saw (the test clears it)
DTYPES: list[torch.dtype] = []  # the dtype of the ids each call of the probe's model was given


class ProbeBag(nn.Module):
    """Mean-pooled token embeddings; the table's size ``vocab`` is a model argument (the coordinator's choice),
    ``frozen`` freezes the table. Its forward notes the largest id it is given (client_agent copies modules, so
    the notes are module-level)."""

    def __init__(self, vocab: int = 64, frozen: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.emb.weight.requires_grad_(not frozen)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(float(x.abs().max()))
        DTYPES.append(x.dtype)
        return self.head(self.emb(x.long()).mean(dim=1))


def _probe_rows(x: Any, y: Any, args: Any) -> Any:
    """'large': whether a record holds an id above 10; notes what it reads."""
    import numpy as np

    SEEN.append(float(np.abs(np.asarray(x)).max()) if len(x) else 0.0)
    return (np.asarray(x).reshape(len(x), -1).max(axis=1) > 10).astype("float32").reshape(-1, 1)


CLIENT_PROBE = Workload(
    name="client_probe",
    models={"bag": ProbeBag},
    loss=_ce,
    data=_data,
    valid=_valid,
    queries={"large": Query(_probe_rows)},
)


def _valid_by_model(x: torch.Tensor, y: torch.Tensor, model: Any = None) -> torch.Tensor:
    """A validity rule that runs the model: records whose logits are finite (a second review's case)."""
    with torch.no_grad():
        return torch.isfinite(model(x)).all(dim=1)


CLIENT_PROBE_VALID = Workload(
    name="client_probe_valid", models=CLIENT_PROBE.models, loss=_ce, data=_data, valid=_valid_by_model
)
