"""What users bring next (issue 22): recurrent, attention and tied models work; frozen parameters are neither
released nor charged; what the engine cannot run is refused by ``fedfilter agent check`` before serving, named.

Per-record gradients of each zoo model are checked against a per-record loop of plain autograd (one
record at a time, an independent computation); the frozen model's charge against the trainable-only
norm of that loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client_agent.streaming import ArraySource, StreamedGradients
from client_agent.workload_check import dry_run, model_problems
from examples.model_zoo.workload import WORKLOAD, DictItems, dict_data, make_records
from protocol import messages as wire
from simulations.cli import main as cli_main
from simulations.deploy.agent_files import write_agent_toml
from tests.factories import build_agent
from workloads.models import flatten_parameters, trainable_mask
from workloads.registry import Workload


def loop_gradients(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each record's gradient of every trainable parameter by plain autograd on a batch of one (float64 rows)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(x)):
        loss = WORKLOAD.loss(model(torch.from_numpy(x[i : i + 1])), torch.from_numpy(y[i : i + 1])).sum()
        grads = torch.autograd.grad(loss, params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]).double().numpy())
    return np.stack(rows)


@pytest.mark.parametrize("name", ["gru", "lstm", "transformer", "tied", "bag", "frozen_bag"])
def test_zoo_models_give_each_records_own_gradient(name: str) -> None:
    x, y = make_records(9, seed=1)
    model = WORKLOAD.build_model(name, seed=0)
    units = StreamedGradients(model, WORKLOAD.loss, ArraySource(x, y), chunk_size=4)
    weights = np.linspace(0.2, 1.0, 9)
    total = units.clipped_sum(lambda start, norms: weights[start : start + norms.size])
    want = loop_gradients(model, x, y)
    np.testing.assert_allclose(units.norms(), np.linalg.norm(want, axis=1), rtol=2e-5)
    mask = trainable_mask(model)
    np.testing.assert_allclose(total[mask], weights @ want, rtol=2e-5, atol=1e-7)
    assert not np.any(total[~mask])  # frozen entries: exact zeros


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize(
    "options",
    [{"batch_first": True}, {"num_layers": 2, "bidirectional": True}, {"batch_first": True, "bias": False}],
)
def test_the_unrolled_recurrent_forward_is_pytorchs(cell: type, options: dict[str, object]) -> None:
    from client_agent.layers.recurrent import unrolled_forward

    torch.manual_seed(0)
    m = cell(3, 5, **options)
    for x in (torch.randn(4, 6, 3), torch.randn(6, 3)):  # batched and unbatched
        want, got = m(x), unrolled_forward(m, x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_frozen_parameters_are_neither_released_nor_charged(tmp_path: Path) -> None:
    """Issue 22: a frozen embedding was released and charged as trainable (the charge matched the all-parameters
    oracle, off by 8e-2 from the trainable one). Through Agent.handle: its entries are exactly 0 (noise
    included) and each record is charged its trainable-only norm."""
    x, y = make_records(8, seed=2)
    np.savez(tmp_path / "tokens.npz", x=x, y=y)
    agent = build_agent(
        tmp_path, (x, y), workload="examples.model_zoo.workload:WORKLOAD", **{"data-path": str(tmp_path / "tokens.npz")}
    )
    model = WORKLOAD.build_model("frozen_bag", seed=0)
    sigma = 100.0  # the GDP filter's bound sigma sqrt(T) stays above every record's norm: nothing clipped
    req = wire.GradientRequest(
        request_id="f1",
        run_id="run",
        round=1,
        noise_std=sigma,
        l2_clip=100.0,
        trust="local",
        unit="record",
        model="frozen_bag",
        model_args="{}",
        parameters=flatten_parameters(model),
    )
    outcome = agent.handle(wire.GRADIENT, *wire.encode_request(req))
    assert not outcome.is_error, outcome.error_reason
    reply = wire.ContributionReply.decode(outcome.config, outcome.arrays)
    mask = trainable_mask(model)
    assert (~mask).sum() == 64 * 32 and not np.any(reply.total[~mask])
    charged = sigma * np.sqrt(agent.ledger.state()["spent"])
    want = np.linalg.norm(loop_gradients(model, x, y), axis=1)  # trainable parameters only
    np.testing.assert_allclose(charged, want, rtol=1e-4)
    agent.close()


def test_coordinator_never_moves_a_frozen_parameter() -> None:
    from coordinator.tasks import GradientTask
    from tests.factories import gradient_run

    cfg = gradient_run(num_nodes=1, n_public=1)
    params = np.arange(4, dtype=np.float32)
    task = GradientTask(cfg, params, None, np.array([True, False, True, False]))
    moved = task._moved(np.full(4, 7.0))
    assert moved[1] == 1.0 and moved[3] == 3.0 and moved[0] != 0.0


def test_dict_item_datasets_and_their_errors(tmp_path: Path) -> None:
    x, y = make_records(5, seed=0)
    np.savez(tmp_path / "t.npz", x=x, y=y)
    bx, by = next(iter(dict_data(tmp_path / "t.npz").batches(5)))
    np.testing.assert_array_equal(bx, x)
    np.testing.assert_array_equal(by, y)
    from workloads.data_sources import TorchDatasetSource

    class Bad(DictItems):
        def __getitem__(self, i: int) -> dict[str, object]:
            return {"features": 1, "label": 2}

    with pytest.raises(ValueError, match=r"item 0: expected a mapping with keys 'x' and 'y', got keys \['features'"):
        next(iter(TorchDatasetSource(Bad(tmp_path / "t.npz")).batches(2)))


def test_agent_check_dry_runs_every_model_on_the_owners_records(tmp_path: Path) -> None:
    x, y = make_records(20, seed=0)
    np.savez(tmp_path / "t.npz", x=x, y=y)
    report = dry_run(WORKLOAD, dict_data(tmp_path / "t.npz"), unit="record")
    assert report["problems"] == [] and report["warnings"] == []
    assert {name: r["status"] for name, r in report["models"].items()} == dict.fromkeys(WORKLOAD.models, "ok")
    assert (
        report["models"]["gru"]["method"] == "rows"
    )  # nn.GRU unrolled step by step (client_agent/layers/recurrent.py)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * 2.0 if float(x.sum()) > 0 else self.a(x)


def _refused() -> dict[str, object]:
    return {
        "bn": lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)),
        "drop": lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1), nn.Linear(4, 2)),
        "drop0": lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.0), nn.Linear(4, 2)),
        "drop_eval": lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).eval(),
        "needs_args": lambda *, width: nn.Linear(3, width),
        "branchy": _Branchy,
        "wrong_shape": lambda: nn.Linear(5, 2),
    }


REFUSING = Workload(
    name="refusing",
    models=_refused(),  # type: ignore[arg-type]
    loss=lambda out, t: nn.functional.cross_entropy(out, t.long(), reduction="none"),
    data=lambda p: __import__("workloads.data_sources", fromlist=["open_source"]).open_source(p),
)


def test_agent_check_refuses_batch_norm_and_dropout_before_serving_naming_module_and_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert model_problems(_refused()["drop0"]()) == []  # type: ignore[operator]
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(6, 3)).astype(np.float32), y=rng.integers(0, 2, 6))
    path = write_agent_toml(
        tmp_path / "agent.toml",
        {
            "ledger-path": str(tmp_path / "l.sqlite"),
            "data-path": str(tmp_path / "d.npz"),
            "epsilon": 1.0,
            "delta": 1e-5,
            "policy-min-noise-std": 0.5,
            "policy-max-clip": 5.0,
            "workload": "tests.unit.test_model_zoo:REFUSING",
        },
    )
    assert cli_main(["agent", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    report = json.loads(out)["dry-run"]
    status = {name: r["status"] for name, r in report["models"].items()}
    assert status == {
        "bn": "refused",
        "drop": "refused",
        "drop0": "ok",
        "drop_eval": "ok",
        "needs_args": "not run",
        "branchy": "refused",
        "wrong_shape": "fails",
    }
    assert "model 'branchy': model: torch.func.vmap cannot run it one record at a time" in err
    assert "warning: model 'wrong_shape' does not run on your records" in err
    assert "module '1' (BatchNorm1d)" in err and "use GroupNorm or LayerNorm" in err
    assert "module '1' (Dropout)" in err and "p = 0 or call .eval()" in err
    assert not (tmp_path / "l.sqlite").exists()


def test_a_validity_rule_that_nulls_the_sample_is_warned_about(tmp_path: Path) -> None:
    x, y = make_records(20, seed=0)
    y[:3] = 99  # labels no model of the zoo can take
    np.savez(tmp_path / "t.npz", x=x, y=y)
    from workloads.builtin import classification_records

    zoo = Workload(
        name="zoo_labels",
        models={"bag": WORKLOAD.models["bag"]},
        loss=WORKLOAD.loss,
        data=dict_data,
        valid=classification_records,
    )
    report = dry_run(zoo, dict_data(tmp_path / "t.npz"), unit="record")
    assert report["models"]["bag"]["null_records"] == 3
    assert report["warnings"] == [
        "model 'bag': the validity rule treats 3 of 16 sampled records as the null element (they would contribute "
        "nothing and learn nothing)"
    ]


def test_token_features_stay_integer_through_the_coordinators_evaluation() -> None:
    """Issue 22: the coordinator's evaluation turned public token ids into float32 before the model, so a
    token model crashed the run after round 1 was charged."""
    from coordinator.evaluation import model_evaluator
    from tests.factories import gradient_run

    cfg = gradient_run(
        num_nodes=1, n_public=30, workload="examples.model_zoo.workload:WORKLOAD", model="bag", model_args="{}"
    )
    x, y = make_records(30, seed=3)
    evaluate = model_evaluator(cfg, x, y)
    metrics = evaluate(flatten_parameters(WORKLOAD.build_model("bag", seed=cfg.seed)))
    assert 0.0 <= metrics["accuracy"] <= 1.0 and np.isfinite(metrics["loss"])


def test_the_owners_log_says_how_many_records_were_null_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.factories import client_data, gradient_request

    x, y = client_data(10)
    x[2, 0] = np.nan
    y[5] = 7  # a label the request's 2-class model cannot take
    agent = build_agent(tmp_path, (x, y))
    with caplog.at_level("INFO", logger="fedfilter.agent"):
        outcome = agent.handle(wire.GRADIENT, *wire.encode_request(gradient_request()))
    assert not outcome.is_error
    assert (
        "request 'r1': 2 of 10 records were the null element (1 not finite, 1 rejected by the workload's validity "
        "rule); they contributed nothing and paid nothing"
    ) in caplog.text
    agent.close()
