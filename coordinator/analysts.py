"""Analysts for the indicator task: callables from past answers to the next counting query.

An analyst sees only released answers (noisy counts and their stated bounds), so any
choice it makes is post-processing and adaptivity costs nothing extra: the filters are
valid under fully adaptive choice (FZ Thm 4.3; privacy.md §3). ``None`` ends the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from protocol import messages as wire


@dataclass(frozen=True)
class Query:
    """A counting query: the predicate the clients evaluate on each record (closed table PREDICATES)."""

    predicate: str = "column"
    column: int = 0
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.predicate not in wire.PREDICATES:
            raise ValueError(f"predicate: expected one of {wire.PREDICATES}, got {self.predicate!r}")


@dataclass(frozen=True)
class Answer:
    """A released answer: the noisy count and the half-width of its stated error bound."""

    round: int
    query: Query
    value: float
    bound: float


Analyst = Callable[[Sequence[Answer]], Query | None]


class AnalystFactory(Protocol):
    """Builds a run's analyst from its length and the columns it may ask about."""

    def __call__(self, *, rounds: int, columns: int) -> Analyst: ...


# Run configs hold names, never code: the names an indicator run may ask for (coordinator.config checks them).
ANALYSTS: dict[str, AnalystFactory] = {}


def register_analyst(name: str) -> Callable[[AnalystFactory], AnalystFactory]:
    """Register ``factory(rounds=, columns=)`` under ``name`` (the run config's ``analyst``)."""

    def register(factory: AnalystFactory) -> AnalystFactory:
        ANALYSTS[name] = factory
        return factory

    return register


def sweep(columns: int) -> Analyst:
    """Ask column 0, 1, ..., columns - 1 in turn, then stop (k non-adaptive sparse counting queries)."""

    def next_query(answers: Sequence[Answer]) -> Query | None:
        t = len(answers)
        return Query("column", t) if t < columns else None

    return next_query


def refine(columns: int, *, repeats: int, top: int) -> Analyst:
    """Sweep all columns once, then re-ask the ``top`` columns with the largest answers ``repeats`` times each.

    Adaptive: which columns are re-asked depends on earlier noisy answers (averaging the
    repeats sharpens the estimates of the heavy columns).
    """

    def next_query(answers: Sequence[Answer]) -> Query | None:
        t = len(answers)
        if t < columns:
            return Query("column", t)
        first = np.array([a.value for a in answers[:columns]])
        chosen = np.argsort(-first, kind="stable")[:top]
        k = t - columns
        if k >= repeats * len(chosen):
            return None
        return Query("column", int(chosen[k % len(chosen)]))

    return next_query


def cycle(columns: int) -> Analyst:
    """Ask columns 0..columns-1 round and round, never stopping by itself (the monitor or max rounds stop it)."""

    def next_query(answers: Sequence[Answer]) -> Query | None:
        return Query("column", len(answers) % columns)

    return next_query


@register_analyst("sweep")
def _sweep_run(*, rounds: int, columns: int) -> Analyst:
    return sweep(min(columns, rounds))


@register_analyst("refine")
def _refine_run(*, rounds: int, columns: int) -> Analyst:
    top = max(1, columns // 10)
    return refine(columns, repeats=max(1, (rounds - columns) // top), top=top)


@register_analyst("cycle")
def _cycle_run(*, rounds: int, columns: int) -> Analyst:
    return cycle(columns)


def build_analyst(name: str, *, rounds: int, columns: int) -> Analyst:
    """An analyst by its registered name: 'sweep', 'refine', 'cycle' or one a deployer registered."""
    factory = ANALYSTS.get(name)
    if factory is None:
        raise ValueError(f"analyst: expected one of {tuple(ANALYSTS)}, got {name!r}")
    return factory(rounds=rounds, columns=columns)
