"""The ``fedfilter`` command line: one module per command, assembled here (as Flower's ``flwr/cli/app.py``).

Commands:
  budget    privacy calculator: each filter's budget and the full-norm rounds it allows  (budget.py)
  ledger    show or verify a client's privacy ledger                                      (ledger.py)
  simulate  a federation on one machine, on Flower's simulation engine                    (simulate.py)
  certs     CA and TLS server certificate for the coordinator's SuperLink                 (deploy.py)
  keys      a SuperNode key pair for node authentication                                  (deploy.py)
  run       flwr run with the run config checked first and an honest exit code           (deploy.py)
  agent     serve a client agent, check its configuration, write demo agents              (agent.py)
  reproduce long paper reproductions (FZ Sec. 5.1 on MNIST)                               (reproduce.py)

:func:`main` builds only the parser of the command it runs, and no parser imports torch, Flower,
cryptography or matplotlib: a command's handler imports what it runs when it runs, so
``fedfilter budget`` starts without them. An error of
fedfilter's own (:class:`protocol.errors.FedfilterError`) or of the filesystem ends the command
with its message and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from protocol.errors import FedfilterError

# Command -> the module of this package that adds its sub-parser (``deploy`` adds three), in help order.
COMMANDS: dict[str, str] = {
    "budget": "budget",
    "ledger": "ledger",
    "simulate": "simulate",
    "certs": "deploy",
    "keys": "deploy",
    "run": "deploy",
    "agent": "agent",
    "reproduce": "reproduce",
}


class _StdoutHandler(logging.Handler):
    """Progress lines to the current ``sys.stdout`` (looked up at each line, as ``print`` does)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), flush=True)


def _show_progress() -> None:
    """Progress that the ``simulations`` modules log at INFO goes to stdout as plain lines, once."""
    logger = logging.getLogger("simulations")
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        logger.addHandler(_StdoutHandler())
    logger.setLevel(logging.INFO)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``fedfilter`` parser: only ``command``'s sub-parser when it names one, else every command's.

    :func:`main` builds the one command it runs, so a command imports no other command's module.
    """
    parser = argparse.ArgumentParser(
        prog="fedfilter",
        description="Federated learning and analytics with individual privacy filters.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else dict.fromkeys(COMMANDS.values())
    for module in modules:
        importlib.import_module(f"{__name__}.{module}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (2 with the message for an error it reports)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    _show_progress()
    try:
        return int(args.handler(args))
    except (FedfilterError, OSError) as exc:
        print(f"fedfilter {args.command}: error: {exc}", file=sys.stderr)
        return 2
