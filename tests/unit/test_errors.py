"""One error tree, and the one table that turns the client's exceptions into wire codes (privacy.md §8)."""

from __future__ import annotations

import logging
import types
from typing import Any, cast

import pytest

import client_agent.agent as agent_module
from client_agent.agent import EXCEPTION_CODES, Agent, ReplayError, error_code
from client_agent.config import AgentConfigError, PolicyError
from client_agent.ledger import LedgerError
from client_agent.local_wire import FrameError
from client_agent.secagg_client import DataRangeInvariantError, SessionError
from client_agent.service import ServiceError
from client_agent.streaming import NonFiniteSumError
from protocol import messages as wire
from protocol import secagg as sa
from protocol.errors import FedfilterError
from protocol.validate import PrivacyParameterError, integer
from workloads.registry import WorkloadError

# Text that must never reach the wire: an owner's path and a data fingerprint.
SECRET = "/home/owner/records.npz sha256=9f86d081884c7d659a2feaa0c55ad015"

TREE: list[tuple[type[Exception], type[Exception]]] = [
    (PrivacyParameterError, ValueError),
    (wire.ProtocolError, ValueError),
    (sa.SecaggError, ValueError),
    (sa.FixedPointOverflow, sa.SecaggError),
    (WorkloadError, ValueError),
    (AgentConfigError, ValueError),
    (PolicyError, ValueError),
    (ReplayError, ValueError),
    (FrameError, ValueError),
    (SessionError, sa.SecaggError),
    (LedgerError, RuntimeError),
    (DataRangeInvariantError, RuntimeError),
    (NonFiniteSumError, ArithmeticError),
    (ServiceError, OSError),
]


@pytest.mark.parametrize(("cls", "category"), TREE)
def test_every_error_is_a_fedfilter_error_and_keeps_its_category(
    cls: type[Exception], category: type[Exception]
) -> None:
    assert issubclass(cls, FedfilterError) and issubclass(cls, category)


def test_no_entry_of_the_table_is_shadowed_by_an_earlier_one() -> None:
    for i, (cls, _) in enumerate(EXCEPTION_CODES):
        assert not any(issubclass(cls, earlier) for earlier, _ in EXCEPTION_CODES[:i]), cls


def raising(exc: BaseException) -> Any:
    def decode(*args: object, **kwargs: object) -> None:
        raise exc

    return decode


def refused(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> agent_module.Outcome:
    """What Agent.handle answers when the request's decoding raises ``exc`` (nothing else is reached)."""
    monkeypatch.setattr(wire, "decode_request", raising(exc))
    # An agent with nothing but its audit hook (every request, refused or not, leaves an audit line).
    stub = types.SimpleNamespace(audit=lambda *args: None, _federation="default")
    return Agent.handle(cast(Agent, stub), wire.GRADIENT, {"request_id": "r1"}, {})


# Written out, not read from EXCEPTION_CODES: the codes the agent's handler gave before the table
# replaced its except clauses (b0e8609: client_agent/agent.py, Agent.handle), which must not move.
TABLE = [
    (wire.ProtocolError, 4001),
    (sa.SecaggError, 4001),
    (PolicyError, 4003),
    (ReplayError, 4009),
    (LedgerError, 4010),
    # Subclasses of listed classes take their parent's code.
    (SessionError, 4001),
    (sa.FixedPointOverflow, 4001),
]


def test_the_table_lists_exactly_the_mapped_classes() -> None:
    assert [cls for cls, _ in EXCEPTION_CODES] == [cls for cls, _ in TABLE[:5]]
    assert (wire.ERR_MALFORMED, wire.ERR_POLICY, wire.ERR_REPLAY, wire.ERR_LEDGER) == (4001, 4003, 4009, 4010)


@pytest.mark.parametrize(("cls", "code"), TABLE)
def test_each_listed_exception_gets_its_code_and_the_fixed_text(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cls: type[Exception], code: int
) -> None:
    exc = cls(SECRET)
    assert error_code(exc) == code
    with caplog.at_level(logging.WARNING, logger="fedfilter.agent"):
        outcome = refused(monkeypatch, exc)
    assert outcome.error_code == code
    assert outcome.error_reason == wire.ERROR_TEXT[code] and SECRET not in outcome.error_reason
    assert outcome.config is None and outcome.arrays is None
    assert SECRET in outcome.local_detail and SECRET in caplog.text  # the detail stays in the client's log
    [record] = caplog.records
    assert record.levelno == (logging.ERROR if code == wire.ERR_LEDGER else logging.WARNING)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError(SECRET),
        RuntimeError(SECRET),
        KeyError(SECRET),
        PrivacyParameterError(SECRET),
        WorkloadError(SECRET),
        AgentConfigError(SECRET),
        NonFiniteSumError(SECRET),
        DataRangeInvariantError(SECRET),
        FedfilterError(SECRET),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_an_unlisted_exception_is_internal_with_the_fixed_text(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, exc: Exception
) -> None:
    assert error_code(exc) == wire.ERR_INTERNAL
    with caplog.at_level(logging.WARNING, logger="fedfilter.agent"):
        outcome = refused(monkeypatch, exc)
    assert outcome.error_code == wire.ERR_INTERNAL
    assert outcome.error_reason == wire.ERROR_TEXT[wire.ERR_INTERNAL] and SECRET not in outcome.error_reason
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None  # with its traceback


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({}, True, r"^n: expected an integer, got True \(bool\)$"),
        ({}, 1.0, r"^n: expected an integer, got 1.0 \(float\)$"),
        ({"at_least": 1}, 0, r"^n: expected an integer >= 1, got 0$"),
        ({"at_most": 3}, 4, r"^n: expected an integer <= 3, got 4$"),
        ({"at_least": 0, "at_most": 3}, -1, r"^n: expected an integer in \[0, 3\], got -1$"),
        ({"at_least": 0, "at_most": 3}, "2", r"^n: expected an integer in \[0, 3\], got '2' \(str\)$"),
    ],
)
def test_integer_names_the_parameter_the_range_and_the_value(kwargs: Any, value: object, message: str) -> None:
    with pytest.raises(PrivacyParameterError, match=message):
        integer("n", value, **kwargs)


def test_integer_raises_the_callers_error_and_returns_the_value() -> None:
    assert integer("n", 0, at_least=0, at_most=0) == 0
    assert integer("n", -(2**70)) == -(2**70)
    with pytest.raises(wire.ProtocolError):
        integer("n", False, error=wire.ProtocolError)
