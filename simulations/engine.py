"""Run a federation on Flower's simulation engine (Ray): the real ServerApp and ClientApp, one machine."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from client_agent.direct import build_client_app, simulation_node_config
from coordinator.analysts import Analyst
from coordinator.config import CoordinatorConfig
from coordinator.server_app import build_server_app
from coordinator.tasks import Evaluate
from simulations.errors import SimulationError
from simulations.linkstate import indexed_link_state

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# Ray's future default (it prints a FutureWarning at every start otherwise): a worker that asks for
# no GPU keeps the accelerator variables it inherited. The simulation's workers ask for none.
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


class _NoRunSimulationDeprecation(logging.Filter):
    """Drops Flower's banner that `run_simulation` is deprecated in favour of `flwr run`.

    A user of `fedfilter simulate` did not call it: the engine does, and `flwr run` is the deployed
    path (docs/deploy.md). Every other Flower log line passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "DEPRECATED FEATURE: The `run_simulation` function" not in record.getMessage()


def ray_address(address: str | None = None) -> str | None:
    """The Ray cluster to join: ``address`` (``--ray-address``), else ``RAY_ADDRESS``, else None (start one here)."""
    found = address if address is not None else os.environ.get("RAY_ADDRESS")
    return found or None


def backend_config(num_cpus: int | None = None, address: str | None = None) -> dict[str, Any]:
    """One CPU per virtual client, quiet logs; Ray started on this machine's cores, or an existing cluster joined.

    With ``address`` (``host:port`` of a running Ray head, or ``auto``; :func:`ray_address`) Flower's
    backend joins that cluster and places one ClientApp actor per free CPU of every node in it;
    Ray refuses ``num_cpus`` when it joins a cluster, so none is passed then.
    """
    found = ray_address(address)
    if found is not None:
        init: dict[str, Any] = {"address": found, "logging_level": "ERROR", "log_to_driver": False}
    else:
        # "local": a new Ray on this machine, never a cluster Ray finds by itself (a running `ray start`, or
        # the address file a stopped one left in /tmp/ray, would be joined and then refuse num_cpus).
        cpus = num_cpus or os.cpu_count() or 1
        init = {"address": "local", "num_cpus": cpus, "logging_level": "ERROR", "log_to_driver": False}
    return {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": init}


def start_ray(config: Mapping[str, Any]) -> None:
    """Ray started, or the cluster joined, with the arguments Flower's ``RayBackend.init_ray`` would use.

    Started before ``run_simulation`` so that objects can be put in Ray's store first; Flower's backend finds
    Ray initialised, uses it, and shuts it down at the end of the run.
    """
    import ray

    if ray.is_initialized():
        return
    init = dict(config["init_args"])
    init.setdefault("include_dashboard", False)
    # as Flower's backend does: Ray's workers inherit the environment, not this process's sys.path
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init)


def run_flower(
    cfg: CoordinatorConfig,
    node_configs: Mapping[int, Mapping[str, Any]],
    *,
    evaluate: Evaluate | None = None,
    analyst: Analyst | None = None,
    num_cpus: int | None = None,
    address: str | None = None,
    indexed_state: bool = True,
    mods: Sequence[Callable[..., Any]] = (),
) -> dict[str, Any]:
    """One run of ``cfg`` with one virtual SuperNode per entry of ``node_configs``; returns the summary.

    ``address``: an existing Ray cluster to run the virtual clients on (:func:`backend_config`); each
    client's agent opens its ledger where its ClientApp actor runs, at the node config's ``ledger-path``.
    ``indexed_state``: Flower's in-memory LinkState with a per-node index of undelivered messages
    (:mod:`simulations.linkstate`; the stock one's delivery loop is quadratic in the number of nodes).
    ``mods``: ClientApp mods run before the one that adds each node's agent config (tests observe with them).
    """
    import ray
    from flwr.simulation import run_simulation

    results: dict[str, Any] = {}
    flwr_log = logging.getLogger("flwr")
    quiet = _NoRunSimulationDeprecation()
    flwr_log.addFilter(quiet)
    config = backend_config(num_cpus, address)
    try:
        start_ray(config)
        # Every node's agent config, once in Ray's object store: the ClientApp carries a reference, not the
        # mapping, each time Flower's backend pickles it for a message (client_agent/direct.py).
        shared = ray.put({int(pid): dict(values) for pid, values in node_configs.items()})
        with indexed_link_state() if indexed_state else contextlib.nullcontext():
            run_simulation(
                server_app=build_server_app(cfg, results, evaluate=evaluate, analyst=analyst),
                client_app=build_client_app([*mods, simulation_node_config(shared)], simulation=True),
                num_supernodes=len(node_configs),
                backend_config=config,
            )
    finally:
        flwr_log.removeFilter(quiet)
        if ray.is_initialized():  # Flower's backend shuts Ray down at its end; not if it failed to start
            ray.shutdown()
    if not results:
        raise RuntimeError("the Flower simulation ended without a summary; see the log above for the ServerApp error")
    return results


ENGINES = ("flower", "inprocess")


def run_engine(
    engine: str,
    cfg: CoordinatorConfig,
    node_configs: Mapping[int, Mapping[str, Any]],
    *,
    evaluate: Evaluate | None = None,
    address: str | None = None,
) -> dict[str, Any]:
    """``cfg`` on Flower's simulation engine (``flower``, on the Ray cluster at ``address`` when given) or by
    direct calls to the same agents (``inprocess``)."""
    if engine == "flower":
        return run_flower(cfg, node_configs, evaluate=evaluate, address=address)
    if engine == "inprocess":
        from coordinator.rounds import run
        from simulations.inprocess import InProcessTransport

        return run(InProcessTransport(node_configs), cfg, evaluate=evaluate)
    raise SimulationError(f"--engine: expected one of {ENGINES}, got {engine!r}")
