"""The error of a simulation, preset or reproduction that cannot run as asked (the CLI exits 2 with it)."""

from __future__ import annotations

from protocol.errors import FedfilterError


class SimulationError(FedfilterError, ValueError):
    """An option a simulation, preset or reproduction refuses, or a run that ended unlike its plan.

    The message names the option (as the command line spells it) and the value received.
    """
