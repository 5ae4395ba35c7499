"""What Flower's Ray backend sends with every message does not grow with the federation.

Flower's ``RayBackend`` pickles the ClientApp (``BasicActorPool.submit(..., (app_fn, message, ...))``) for every
message it hands an actor. :func:`simulations.engine.run_flower` therefore puts every node's agent config in
Ray's object store once and gives the ClientApp a reference: pickled with a mapping of every config instead,
the app was 147 KB at 1,000 clients (1.5 MB at 10,000), copied and unpickled per message. Checked here on
the ClientApp ``run_flower`` really builds, with Ray's start and store stood in for (no Ray started).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from ray import cloudpickle

from client_agent import direct
from coordinator.config import CoordinatorConfig
from simulations import engine


class _Ref:
    """Stands in for a Ray ObjectRef: small, and resolved by the fake store below."""

    store: ClassVar[dict[int, Any]] = {}

    def __init__(self, key: int) -> None:
        self.key = key


def _sent_app(monkeypatch: pytest.MonkeyPatch, clients: int) -> bytes:
    import ray

    sent: dict[str, Any] = {}

    def fake_put(value: Any) -> _Ref:
        ref = _Ref(len(_Ref.store))
        _Ref.store[ref.key] = value
        return ref

    def fake_run_simulation(**kwargs: Any) -> None:
        sent.update(kwargs)

    monkeypatch.setattr(engine, "start_ray", lambda config: None)
    monkeypatch.setattr(ray, "put", fake_put)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr("flwr.simulation.run_simulation", fake_run_simulation)
    per = {
        i: {"ledger-path": f"/srv/ledgers/client{i}.sqlite", "data-path": f"/srv/data/data{i}.npz"}
        for i in range(clients)
    }
    cfg = CoordinatorConfig(num_nodes=clients, n_public=clients, rounds=1, noise_std=1.0, l2_clip=1.0, progress=False)
    with pytest.raises(RuntimeError, match="without a summary"):  # the stand-in ran no ServerApp
        engine.run_flower(cfg, per)
    assert sent["num_supernodes"] == clients
    return bytes(cloudpickle.dumps(sent["client_app"]))


def test_the_client_app_pickles_to_the_same_size_whatever_the_federation(monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = _sent_app(monkeypatch, 10), _sent_app(monkeypatch, 2000)
    assert abs(len(large) - len(small)) < 64, (len(small), len(large))
    # ... and the configs it stands for are every node's, as given (the actor's side, resolved from the store)
    per = _Ref.store[max(_Ref.store)]
    assert len(per) == 2000 and per[1999]["data-path"] == "/srv/data/data1999.npz"


def test_a_mapping_still_pickles_with_the_app() -> None:
    """The cost the reference removes: the same mod built on the mapping grows with the clients."""
    per = {i: {"ledger-path": f"/srv/ledgers/client{i}.sqlite"} for i in range(2000)}
    with_map = cloudpickle.dumps(direct.build_client_app([direct.simulation_node_config(per)], simulation=True))
    assert len(with_map) > 2000 * 30
