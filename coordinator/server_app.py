"""The Flower ServerApp: wiring from a Flower ``Grid`` to :func:`coordinator.rounds.run`.

Deployment (``flwr run``): the configuration comes from the run config
(``[tool.flwr.app.config]`` and ``flwr run -c``). Simulations build the app with
:func:`build_server_app`, since ``run_simulation`` passes an empty run config.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from coordinator.analysts import Analyst
from coordinator.config import CoordinatorConfig
from coordinator.evaluation import load_test_data, model_evaluator
from coordinator.rounds import run
from coordinator.tasks import Evaluate
from coordinator.transport import FlowerTransport

logger = logging.getLogger(__name__)


class _StdoutHandler(logging.Handler):
    """Each message as one line on the current ``sys.stdout`` (what ``flwr run --stream`` shows)."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stdout.write(self.format(record) + "\n")
        sys.stdout.flush()


def _show_on_stdout() -> None:
    """The deployed run's summary line goes to stdout as plain text, once, whatever the root logger holds."""
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        logger.addHandler(_StdoutHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def build_server_app(
    cfg: CoordinatorConfig,
    results: dict[str, Any],
    *,
    evaluate: Evaluate | None = None,
    analyst: Analyst | None = None,
) -> ServerApp:
    """A ServerApp for a run whose configuration is given directly; the summary lands in ``results``."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        results.update(run(FlowerTransport(grid), cfg, evaluate=evaluate, analyst=analyst))

    return server


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Deployment entry: the run config comes from ``pyproject.toml`` and ``flwr run -c``."""
    cfg = CoordinatorConfig.from_run_config(dict(context.run_config))
    evaluate = model_evaluator(cfg, *load_test_data(cfg.test_data)) if cfg.test_data else None
    summary = run(FlowerTransport(grid), cfg, evaluate=evaluate)
    summary.pop("parameters", None)
    summary.pop("rounds", None)
    _show_on_stdout()
    logger.info(json.dumps(summary, default=str))
