"""Isolation audit through the agent's release path (issue 22): a record's influence on the reply never exceeds
its charge, and a stopped record's influence is exactly zero, whatever the owner's model and loss do.

Neighbours (privacy.md §1): D, and D' with record 0 replaced by the null element (NaN features, or a
negative token id). Two agents on fresh ledgers, record units, local trust, the same noise seed and
request, each answering through ``Agent.handle`` (decode, policy, contributions, clip, filter, noise,
ledger commit, reply): the replies differ by exactly what record 0 added, so

    ||reply(D) - reply(D')|| <= record 0's charged norm (sigma sqrt(spent_0)) + float32 rounding of the replies.

A stopped record: with record 1 stopped (its filter state, as the ledger would hold it), two agents whose
record 1 differs (x50, or other tokens) must give bit-identical replies through ``Agent.contributions`` and
``Agent.release`` (what ``handle`` runs between the policy and the commit).

Owner workloads (tests/isolation_workloads.py) that mix records when run on a batch: batch-centred targets,
a batch-max rescale above a threshold the request's model arguments set, batch-centred token embeddings;
and controls on every layer path: Linear, sequence Linear, convolutions, Embedding, LayerNorm/GroupNorm,
LSTM, GRU, attention with positional embeddings, a model whose parameter is used outside its module
(every gradient taken directly), two embedding tables. Then the hostile review's findings: models vmap
cannot run (a Python branch on a value, Python state across records) and an in-place max_norm table are
refused alike for every data set; an id outside a table the coordinator sized makes its record null,
never an error, even when a stopped record holds it. On the batched engine
before issue 22 the three mixing workloads fail both checks.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.state import AgentState
from protocol import messages as wire
from tests import isolation_workloads as iw
from tests.factories import build_agent
from workloads.models import flatten_parameters

N = 12
SIGMA, CLIP = 0.5, 2.0
# Each reply is a float32 rounding of a float64 sum: ||error|| <= 2^-24 ||reply||; two replies, a margin of 2.
F32_SLACK = 2.0**-23

CASES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    # name: (workload, model, model_args, data kind)
    "mixing:centred-targets": ("CENTRED", "mlp", {}, "regression"),
    "mixing:batch-max-rescale": ("RESCALE", "rescale", {"threshold": 3.0}, "peaked"),
    "mixing:centred-embeddings": ("EMB_CENTRED", "emb", {}, "tokens"),
    "control:mse": ("REGRESSION", "mlp", {}, "regression"),
    "control:linear": ("CONTROLS", "linear", {}, "features"),
    "control:seq-linear": ("CONTROLS", "seq_linear", {}, "features"),
    "control:conv": ("CONTROLS", "conv", {}, "features"),
    "control:norms": ("CONTROLS", "norms", {}, "features"),
    "control:embedding": ("CONTROLS", "tokens", {}, "tokens"),
    "control:lstm": ("CONTROLS", "lstm", {}, "tokens"),
    "control:gru": ("CONTROLS", "gru", {}, "tokens"),
    "control:attention": ("CONTROLS", "attention", {}, "tokens"),
    "control:direct": ("CONTROLS", "borrowed", {}, "features"),
    "control:two-tables": ("CONTROLS", "two_tables", {"categories": iw.VOCAB}, "tokens"),
}


def records(kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "tokens":
        x = rng.integers(0, iw.VOCAB, size=(N, iw.TOKENS))
        x[0] = iw.VOCAB - 1  # record 0: a token no other record leans on so heavily
        return x, rng.integers(0, iw.CLASSES, N)
    x = rng.normal(size=(N, iw.FEATURES)).astype(np.float32)
    if kind == "regression":
        y = rng.normal(size=(N, 2)).astype(np.float32)
        y[0] = 25.0  # record 0's target moves a batch mean by about 2
        return x, y
    if kind == "peaked":
        x = np.clip(x, -2.5, 2.5)
        x[0] *= 4.0  # record 0 alone exceeds the threshold 3: a batch rescale moves every record
    return x, rng.integers(0, iw.CLASSES, N)


def null_record(x: np.ndarray, i: int) -> np.ndarray:
    out = x.copy()
    if np.issubdtype(out.dtype, np.floating):
        out[i] = np.nan
    else:
        out[i] = -1  # an id no model can take: the null element under the default rule
    return out


def changed_record(x: np.ndarray, i: int) -> np.ndarray:
    out = x.copy()
    if np.issubdtype(out.dtype, np.floating):
        out[i] *= 50.0
    else:
        out[i] = (out[i] + 7) % iw.VOCAB
    return out


def request(case: str, request_id: str = "audit-1") -> wire.GradientRequest:
    workload, model, args, _ = CASES[case]
    return gradient_request_for(getattr(iw, workload), model, args, request_id)


def gradient_request_for(workload: Any, model: str, args: dict[str, Any], request_id: str) -> wire.GradientRequest:
    """A record-unit gradient request, local trust, for ``model`` of ``workload`` at its seed-3 parameters."""
    built = workload.build_model(model, seed=3, **args)
    return wire.GradientRequest(
        request_id=request_id,
        run_id="audit",
        round=1,
        noise_std=SIGMA,
        l2_clip=CLIP,
        trust="local",
        unit="record",
        model=model,
        model_args=json.dumps(args),
        parameters=flatten_parameters(built),
    )


def agent(folder: Path, case: str, x: np.ndarray, y: np.ndarray) -> Any:
    folder.mkdir(parents=True, exist_ok=True)
    workload = CASES[case][0]
    return build_agent(folder, (x, y), workload=f"tests.isolation_workloads:{workload}", **{"noise-seed": 11})


def handled(a: Any, req: wire.GradientRequest) -> np.ndarray:
    outcome = a.handle(wire.GRADIENT, *wire.encode_request(req))
    assert not outcome.is_error, outcome.error_reason
    reply = wire.ContributionReply.decode(outcome.config, outcome.arrays)
    assert reply.status == wire.REPLY_OK
    return np.asarray(reply.total, dtype=np.float64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_records_influence_on_the_reply_never_exceeds_its_charge(tmp_path: Path, case: str) -> None:
    x, y = records(CASES[case][3])
    with_0 = agent(tmp_path / "d", case, x, y)
    without_0 = agent(tmp_path / "d-prime", case, null_record(x, 0), y)
    req = request(case)
    r1, r0 = handled(with_0, req), handled(without_0, req)
    spent = with_0.ledger.state()["spent"]
    charged = SIGMA * float(np.sqrt(spent[0]))
    assert charged > 0.0  # record 0 took part
    assert without_0.ledger.state()["spent"][0] == 0.0  # the null element pays nothing
    influence = float(np.linalg.norm(r1 - r0))
    slack = F32_SLACK * (float(np.linalg.norm(r1)) + float(np.linalg.norm(r0)))
    moved = f"{case}: record 0 moved the reply by {influence}, charged {charged}"
    assert influence <= charged * (1 + 1e-9) + slack, moved
    # Every other record paid the same in both worlds: record 0's data reached no one else's norm.
    np.testing.assert_array_equal(spent[1:], without_0.ledger.state()["spent"][1:])
    with_0.close()
    without_0.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stopped_records_data_has_no_influence_at_all(tmp_path: Path, case: str) -> None:
    x, y = records(CASES[case][3])
    replies = []
    for name, data in (("d", x), ("d-changed", changed_record(x, 1))):
        a = agent(tmp_path / name, case, data, y)
        state = AgentState.from_arrays(a.ledger.state())
        assert a.gaussian is not None
        stopped = np.zeros(N, dtype=np.bool_)
        stopped[1] = True
        spent = np.where(stopped, a.gaussian.threshold, 0.0)
        state = replace(state, spent=spent, stopped=stopped)
        req = request(case, "audit-stopped")
        reply, new_state, _, _ = a.release(req, a.contributions(req), state)
        assert isinstance(reply, wire.ContributionReply)
        assert new_state.spent[1] == a.gaussian.threshold  # the stopped record paid nothing more
        replies.append(np.asarray(reply.total))
        a.close()
    np.testing.assert_array_equal(replies[0], replies[1])


def test_the_method_each_model_gets() -> None:
    from client_agent.streaming import ArraySource, record_norms

    methods = {}
    for name, kind in (("gru", "tokens"), ("attention", "tokens"), ("borrowed", "features"), ("linear", "features")):
        x, y = records(kind)
        methods[name] = record_norms(iw.CONTROLS.build_model(name, seed=0), iw._ce, ArraySource(x, y))[1]
    assert methods == {"gru": "rows", "attention": "rows", "borrowed": "direct", "linear": "rows"}


@pytest.mark.parametrize("model", ["branchy", "running_max", "tied_max_norm"])
def test_what_cannot_run_one_record_at_a_time_is_refused_alike_for_every_data_set(tmp_path: Path, model: str) -> None:
    """Review F1, F2: a model vmap cannot run (it used to run record by record, where a Python float on the
    module carried record 0's peak into every later record: influence 2.03x its charge) and an in-place
    max_norm table (records renormalised each other's rows: 1.29x) are refused before any record is read,
    with the same error for a data set and its neighbour, and nothing spent."""
    kind = "tokens" if model == "tied_max_norm" else "features"
    x, y = records(kind)
    if kind == "features":
        x = x * 3.0  # values above the running-max floor and the branch threshold
    codes = []
    for name, data in (("d", x), ("d-prime", null_record(x, 0))):
        (tmp_path / name).mkdir()
        a = build_agent(tmp_path / name, (data, y), workload="tests.isolation_workloads:CONTROLS")
        outcome = a.handle(wire.GRADIENT, *wire.encode_request(_controls_request(model, {})))
        assert outcome.is_error
        codes.append((outcome.error_code, outcome.error_reason))
        assert not np.any(a.ledger.state()["spent"])
        a.close()
    assert codes[0] == codes[1]


def _controls_request(model: str, args: dict[str, Any], request_id: str = "r1") -> wire.GradientRequest:
    return gradient_request_for(iw.CONTROLS, model, args, request_id)


@pytest.mark.parametrize("model", ["two_tables", "keyword_tables"])
def test_an_id_outside_a_table_makes_its_record_null_never_an_error(tmp_path: Path, model: str) -> None:
    """Review F3: with a category table of 5 (the coordinator's model_args) and a record whose first id is 7,
    the forward raised and the request was refused, uncharged: one free bit ("some category >= k?"), also
    when the record was stopped. The record is now the null element and the request is answered."""
    x, y = records("tokens")
    x[:, 0] = np.arange(N) % 5
    x[3, 0] = 7
    a = build_agent(tmp_path, (x, y), workload="tests.isolation_workloads:CONTROLS")
    outcome = a.handle(wire.GRADIENT, *wire.encode_request(_controls_request(model, {"categories": 5})))
    assert not outcome.is_error, outcome.error_reason
    spent = a.ledger.state()["spent"]
    assert spent[3] == 0.0 and np.all(np.delete(spent, 3) > 0.0)
    # A stopped record holding the bad id: answered too, and its data reaches nothing.
    state = AgentState.from_arrays(a.ledger.state())
    assert a.gaussian is not None
    stopped = np.zeros(N, dtype=np.bool_)
    stopped[3] = True
    state = replace(state, stopped=stopped, spent=np.where(stopped, a.gaussian.threshold, state.spent))
    req = _controls_request(model, {"categories": 5}, "r2")
    reply, _, _, _ = a.release(req, a.contributions(req), state)
    assert isinstance(reply, wire.ContributionReply) and reply.status == wire.REPLY_OK
    a.close()
