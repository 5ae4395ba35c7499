"""AgentState and the typed release records: the ledger's arrays round-trip exactly, and anything else is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from client_agent.ledger import LedgerError
from client_agent.records import (
    CheckRecord,
    GaussianRecord,
    KeysRecord,
    MaskedShares,
    MonitorRecord,
    RealisationRecord,
    ReleaseRecord,
    SharesRecord,
    UnmaskRecord,
    contribution_from_arrays,
    release_from_arrays,
    round_of,
)
from client_agent.state import AgentState

N = 4


def gaussian_state() -> AgentState:
    return AgentState(halt_round=np.full(N, -1, dtype=np.int64), spent=np.zeros(N), stopped=np.zeros(N, dtype=np.bool_))


def realisation_state() -> AgentState:
    return AgentState(
        halt_round=np.full(N, -1, dtype=np.int64), loss=np.zeros(N), accepting=np.ones(N, dtype=np.bool_), answered=3
    )


def layout(arrays: dict[str, np.ndarray]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, a.dtype.str, a.shape) for name, a in arrays.items()]


def test_gaussian_state_arrays_are_the_ledger_layout() -> None:
    arrays = gaussian_state().to_arrays()
    assert layout(arrays) == [
        ("spent", "<f8", (N,)),
        ("stopped", "|b1", (N,)),
        ("halt_round", "<i8", (N,)),
        ("monitor_last", "<i8", (1,)),
        ("monitor_run", "<i8", (1,)),
    ]
    back = AgentState.from_arrays(arrays)
    assert layout(back.to_arrays()) == layout(arrays)
    assert all(np.array_equal(back.to_arrays()[k], v) for k, v in arrays.items())


def test_realisation_state_arrays_are_the_ledger_layout() -> None:
    arrays = replace(realisation_state(), monitor_last=5, monitor_run=9).to_arrays()
    assert layout(arrays) == [
        ("loss", "<f8", (N,)),
        ("accepting", "|b1", (N,)),
        ("answered", "<i8", (1,)),
        ("halt_round", "<i8", (N,)),
        ("monitor_last", "<i8", (1,)),
        ("monitor_run", "<i8", (1,)),
    ]
    back = AgentState.from_arrays(arrays)
    assert (back.answered, back.monitor_last, back.monitor_run) == (3, 5, 9)
    assert back.realisation_state().answered == 3


def test_state_with_other_names_is_refused_naming_both() -> None:
    arrays = gaussian_state().to_arrays()
    del arrays["monitor_run"]
    with pytest.raises(LedgerError, match=r"expected arrays .*'monitor_run'.* found \['halt_round'"):
        AgentState.from_arrays(arrays)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("spent", np.zeros(N, dtype=np.float32), r"array 'spent': expected shape \(n_units,\) dtype float64, found"),
        ("stopped", np.zeros(N + 1, dtype=np.bool_), r"array 'stopped': expected shape \(4,\)"),
        ("monitor_last", np.zeros(2, dtype=np.int64), r"array 'monitor_last': expected shape \(1,\) dtype int64"),
    ],
)
def test_state_with_other_shapes_or_dtypes_is_refused(name: str, value: np.ndarray, expected: str) -> None:
    arrays = gaussian_state().to_arrays() | {name: value}
    with pytest.raises(LedgerError, match=expected):
        AgentState.from_arrays(arrays)


def test_state_has_one_filter_kind() -> None:
    with pytest.raises(LedgerError, match="expected the Gaussian fields"):
        replace(gaussian_state(), loss=np.zeros(N))
    with pytest.raises(LedgerError, match="found a realisation state"):
        realisation_state().filter_state()
    with pytest.raises(LedgerError, match="found a Gaussian state"):
        gaussian_state().realisation_state()


def test_active_units() -> None:
    stopped = replace(gaussian_state(), stopped=np.array([True, False, False, True]))
    assert stopped.active.tolist() == [False, True, True, False]
    halted = replace(realisation_state(), halt_round=np.array([-1, 2, -1, -1], dtype=np.int64))
    assert halted.active.tolist() == [True, False, True, True]


def shares(round_: int = 7) -> MaskedShares:
    return MaskedShares(
        round_, np.arange(3, dtype=np.int64), np.zeros((3, 8), np.uint8), np.ones((3, 8), np.uint8), 0.5
    )


RECORDS: list[Any] = [
    GaussianRecord("gradient", 2.0, np.array([1.0, 0.0]), np.array([False, True])),
    GaussianRecord("indicator", 2.0, np.array([1.0, 0.0]), np.array([False, False]), shares()),
    RealisationRecord("indicator", 1.0, np.array([0.5]), np.array([0.1]), np.array([True]), np.array([True])),
    MonitorRecord(7),
    MonitorRecord(7, shares()),
    KeysRecord(7, "ab" * 32, b"\x01" * 32, b"\x02" * 32, b"\x03" * 32),
    SharesRecord(7, 1, 2, *(np.zeros((3, 32), np.uint8) for _ in range(5))),
    CheckRecord(7, np.array([0, 1], dtype=np.int64), np.array([2], dtype=np.int64)),
    UnmaskRecord(7, np.array([0, 1], dtype=np.int64)),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_records_round_trip_through_their_arrays(record: ReleaseRecord) -> None:
    arrays = record.to_arrays()
    assert next(iter(arrays)) == "kind"
    back = release_from_arrays(arrays)
    assert type(back) is type(record)
    again = back.to_arrays()
    assert layout(again) == layout(arrays)
    assert all(np.array_equal(again[k], v) for k, v in arrays.items())


def test_masked_records_keep_the_old_array_order() -> None:
    gaussian = GaussianRecord("gradient", 2.0, np.array([1.0]), np.array([False]), shares()).to_arrays()
    assert list(gaussian) == [
        "kind",
        "noise_std",
        "l2_norms",
        "refused",
        "round",
        "secagg_peers",
        "secagg_seed_shares",
        "secagg_key_shares",
        "secagg_noise_share_std",
    ]
    assert list(MonitorRecord(7, shares()).to_arrays())[:2] == ["kind", "round"]
    assert round_of(release_from_arrays(gaussian)) == 7
    assert round_of(GaussianRecord("gradient", 2.0, np.array([1.0]), np.array([False]))) is None


def test_gaussian_record_gives_the_filters_release() -> None:
    release = RECORDS[0].release("r1")
    assert (release.kind, release.round_id, release.noise_std) == ("gradient", "r1", 2.0)
    assert release.refused is not None and release.refused.tolist() == [False, True]


def test_unknown_kind_or_missing_array_is_a_ledger_error() -> None:
    with pytest.raises(LedgerError, match=r"expected a kind in \['gradient'.*found 'status'"):
        release_from_arrays({"kind": np.array("status")})
    assert contribution_from_arrays({"kind": np.array("status")}) is None
    arrays = RECORDS[0].to_arrays()
    del arrays["refused"]
    with pytest.raises(
        LedgerError, match=r"kind 'gradient': expected arrays \['kind', 'l2_norms', 'noise_std', 'refused'\]"
    ):
        release_from_arrays(arrays)
    arrays = RECORDS[0].to_arrays() | {"noise_std": np.array([2.0, 3.0])}
    with pytest.raises(LedgerError, match=r"array 'noise_std': expected shape \(1,\), found \(2,\)"):
        release_from_arrays(arrays)


def test_a_bad_halt_round_is_named_itself() -> None:
    arrays = gaussian_state().to_arrays() | {"halt_round": np.zeros((N, 1), dtype=np.int64)}
    with pytest.raises(LedgerError, match=r"array 'halt_round': expected shape \(n_units,\) dtype int64"):
        AgentState.from_arrays(arrays)


def test_a_contribution_kind_that_is_not_one_string_is_refused_not_skipped() -> None:
    """Review finding: contribution_from_arrays read the kind with str(), so np.array(['gradient']) was not a
    contribution kind and the release was silently left out of ledger verify's replay."""
    arrays = RECORDS[0].to_arrays() | {"kind": np.array(["gradient"])}
    with pytest.raises(LedgerError, match=r"array 'kind': expected 0 dimension\(s\)"):
        contribution_from_arrays(arrays)


def test_ledger_verify_reports_a_stored_record_that_does_not_parse(tmp_path: Any) -> None:
    """Review finding: a stored release that did not parse aborted verify with a LedgerError; it is reported
    as a problem naming the request."""
    from client_agent.ledger_report import verify_ledger
    from protocol import messages as wire
    from tests.factories import build_agent, gradient_request

    agent = build_agent(tmp_path)
    assert not agent.handle(wire.GRADIENT, *wire.encode_request(gradient_request("r1"))).is_error
    state = agent.ledger.state()
    bad = RECORDS[0].to_arrays() | {"kind": np.array(["gradient"])}
    agent.ledger.commit(
        request_id="r2",
        message_type=wire.GRADIENT,
        run_id="run",
        digest="0" * 64,
        release=bad,
        new_state=state,
        reply=b"",
    )
    agent.close()
    problems = verify_ledger(tmp_path / "ledger.sqlite")
    assert len(problems) == 1 and problems[0].startswith("request 'r2': ") and "'kind'" in problems[0]
