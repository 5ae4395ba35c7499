"""The agent's filter state: one typed value, stored in the ledger as named arrays (privacy.md §3, §6, §7, §9).

The ledger stores the state as named numpy arrays whose names, shapes and dtypes are fixed
when it is created (client_agent/ledger.py). :class:`AgentState` is that state as one frozen
value: :meth:`AgentState.to_arrays` gives exactly the arrays the ledger stores and
:meth:`AgentState.from_arrays` reads them back, refusing any other name, shape or dtype with a
:class:`~client_agent.ledger.LedgerError` that names what was expected and what was found.

Layout, one entry per unit unless marked (1,):

| array          | filter      | dtype   | meaning                                                   |
|----------------|-------------|---------|-----------------------------------------------------------|
| ``spent``      | Gaussian    | float64 | spent squared budget S = sum mu^2                         |
| ``stopped``    | Gaussian    | bool    | the filter stopped the unit (for good)                    |
| ``loss``       | realisation | float64 | realised privacy loss L                                   |
| ``accepting``  | realisation | bool    | the unit accepts the next request                         |
| ``answered``   | realisation | int64 (1,) | requests answered                                      |
| ``halt_round`` | both        | int64   | the round the unit stopped in (-1: not stopped)           |
| ``monitor_last`` | both      | int64 (1,) | the last monitor round reported (once each)            |
| ``monitor_run``  | both      | int64 (1,) | tag of the run that owns the SVT reservation (0: none) |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from client_agent.ledger import LedgerError
from protocol.filters import FilterState
from protocol.realisation import RealisationState

GAUSSIAN_FIELDS: Final = ("spent", "stopped")
REALISATION_FIELDS: Final = ("loss", "accepting", "answered")
COMMON_FIELDS: Final = ("halt_round", "monitor_last", "monitor_run")
_PER_UNIT: Final = {  # halt_round first: the others are checked against its length
    "halt_round": np.dtype(np.int64),
    "spent": np.dtype(np.float64),
    "stopped": np.dtype(np.bool_),
    "loss": np.dtype(np.float64),
    "accepting": np.dtype(np.bool_),
}
_COUNTERS: Final = ("answered", "monitor_last", "monitor_run")  # int64, shape (1,)


def _describe(array: NDArray[Any] | None) -> str:
    return "no such array" if array is None else f"shape {array.shape} dtype {array.dtype.name}"


def _names(filter_fields: tuple[str, ...]) -> list[str]:
    return sorted(filter_fields + COMMON_FIELDS)


@dataclasses.dataclass(frozen=True, eq=False)
class AgentState:
    """Every unit's filter state, its halt round, and the monitor's progress; Gaussian or realisation fields.

    Privacy note: this is what the ledger commits before a reply leaves (charge before release,
    privacy.md §9). A Gaussian filter has ``spent`` and ``stopped``; the realisation filter has
    ``loss``, ``accepting`` and ``answered``; exactly one of the two sets is present.
    """

    halt_round: NDArray[np.int64]
    monitor_last: int = 0
    monitor_run: int = 0  # the run that owns the SVT reservation (0: none yet)
    spent: NDArray[np.float64] | None = None
    stopped: NDArray[np.bool_] | None = None
    loss: NDArray[np.float64] | None = None
    accepting: NDArray[np.bool_] | None = None
    answered: int | None = None

    def __post_init__(self) -> None:
        gaussian = [getattr(self, name) is not None for name in GAUSSIAN_FIELDS]
        realisation = [getattr(self, name) is not None for name in REALISATION_FIELDS]
        if not (all(gaussian) and not any(realisation)) and not (all(realisation) and not any(gaussian)):
            present = [name for name in GAUSSIAN_FIELDS + REALISATION_FIELDS if getattr(self, name) is not None]
            raise LedgerError(
                f"agent state: expected the Gaussian fields {list(GAUSSIAN_FIELDS)} or the realisation fields "
                f"{list(REALISATION_FIELDS)}, found {present}"
            )
        halt = self.halt_round
        n_units = halt.shape[0] if isinstance(halt, np.ndarray) and halt.ndim == 1 else -1
        for name, dtype in _PER_UNIT.items():
            array = getattr(self, name)
            if array is None:
                continue
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1 or n_units < 1:
                found = _describe(array) if isinstance(array, np.ndarray) else type(array).__name__
                raise LedgerError(
                    f"agent state: array {name!r}: expected shape (n_units,) dtype {dtype.name}, found {found}"
                )
            if array.shape[0] != n_units:
                raise LedgerError(
                    f"agent state: array {name!r}: expected shape ({n_units},) like 'halt_round', found {array.shape}"
                )
        for name in _COUNTERS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | np.integer)):
                raise LedgerError(f"agent state: {name}: expected an int, found {value!r}")

    @property
    def active(self) -> NDArray[np.bool_]:
        """The units still taking part: not stopped (Gaussian), not halted (realisation)."""
        return ~self.stopped if self.stopped is not None else self.halt_round < 0

    def filter_state(self) -> FilterState:
        """The Gaussian filter's state (spent, stopped); a realisation state raises :class:`LedgerError`."""
        if self.spent is None or self.stopped is None:
            raise LedgerError("agent state: expected a Gaussian filter's spent and stopped, found a realisation state")
        return FilterState(spent=self.spent, stopped=self.stopped)

    def realisation_state(self) -> RealisationState:
        """The realisation filter's state (loss, accepting, answered); a Gaussian state raises :class:`LedgerError`."""
        if self.loss is None or self.accepting is None or self.answered is None:
            raise LedgerError(
                "agent state: expected a realisation filter's loss, accepting and answered, found a Gaussian state"
            )
        return RealisationState(loss=self.loss, accepting=self.accepting, answered=self.answered)

    def to_arrays(self) -> dict[str, NDArray[Any]]:
        """The named arrays the ledger stores (the same names, shapes and dtypes as ever)."""
        if self.spent is not None and self.stopped is not None:
            arrays: dict[str, NDArray[Any]] = {"spent": self.spent, "stopped": self.stopped}
        else:
            assert self.loss is not None and self.accepting is not None and self.answered is not None
            arrays = {
                "loss": self.loss,
                "accepting": self.accepting,
                "answered": np.array([self.answered], dtype=np.int64),
            }
        arrays["halt_round"] = self.halt_round
        arrays["monitor_last"] = np.array([self.monitor_last], dtype=np.int64)
        arrays["monitor_run"] = np.array([self.monitor_run], dtype=np.int64)
        return arrays

    def quota_arrays(self) -> dict[str, NDArray[Any]]:
        """A federation's own state as the ledger's ``quotas`` table stores it (client_agent.ledger.QUOTA_LAYOUT)."""
        if self.spent is None or self.stopped is None:
            raise LedgerError("agent state: a federation's quota state needs a Gaussian filter's spent and stopped")
        return {"spent": self.spent, "stopped": self.stopped, "halt_round": self.halt_round}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, NDArray[Any]]) -> AgentState:
        """The state the ledger stored; other names, shapes or dtypes raise :class:`LedgerError`."""
        names = sorted(arrays)
        if names not in (_names(GAUSSIAN_FIELDS), _names(REALISATION_FIELDS)):
            raise LedgerError(
                f"agent state: expected arrays {_names(GAUSSIAN_FIELDS)} (Gaussian filter) or "
                f"{_names(REALISATION_FIELDS)} (realisation filter), found {names}"
            )
        counters: dict[str, int] = {}
        for name in _COUNTERS:
            if name not in arrays:
                continue
            array = np.asarray(arrays[name])
            if array.dtype != np.int64 or array.shape != (1,):
                raise LedgerError(
                    f"agent state: array {name!r}: expected shape (1,) dtype int64, found {_describe(array)}"
                )
            counters[name] = int(array[0])
        return cls(
            halt_round=arrays["halt_round"],
            monitor_last=counters["monitor_last"],
            monitor_run=counters["monitor_run"],
            spent=arrays.get("spent"),
            stopped=arrays.get("stopped"),
            loss=arrays.get("loss"),
            accepting=arrays.get("accepting"),
            answered=counters.get("answered"),
        )
