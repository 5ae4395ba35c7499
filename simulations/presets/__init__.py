"""Named federations for ``fedfilter simulate --preset NAME``: what each builds, found by name.

:data:`PRESETS` maps a name to ``"module:function"``; the module is imported only when the preset
runs (as entry points are), so listing the names costs nothing. A preset is a function
``(Options, out) -> Plan`` (:mod:`simulations.presets.base`): it writes the clients' data and agent
configurations under ``out`` and returns the coordinator's configuration.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simulations.presets.base import Preset

PRESETS: dict[str, str] = {
    "quickstart": "simulations.presets.quickstart:quickstart",
    "sparse-queries": "simulations.presets.sparse_queries:sparse_queries",
    "mnist-gd": "simulations.presets.mnist_gd:mnist_gd",
    "realisation-survival": "simulations.reproductions.tvc_fig2:realisation_survival",
    "filters-compare": "simulations.reproductions.fz_sec43:filters_compare",
    "workload": "simulations.presets.workload:workload_demo",
}


def load_preset(name: str) -> Preset:
    """The preset function registered under ``name``; :class:`SimulationError` naming the known ones."""
    from simulations.errors import SimulationError

    if name not in PRESETS:
        raise SimulationError(f"--preset: expected one of {sorted(PRESETS)}, got {name!r}")
    module, _, attr = PRESETS[name].partition(":")
    preset: Preset = getattr(importlib.import_module(module), attr)
    return preset
