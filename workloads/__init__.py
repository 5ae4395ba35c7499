"""Workloads: what an agent may compute, by name, and the models both sides build.

- :mod:`workloads.registry`: the ``Workload`` an owner registers (models, loss, data, validity rule,
  queries), how a reference loads one, the default validity rule and the parameter layout fingerprint;
- :mod:`workloads.models`: the built-in architectures and the flat parameter layout (torch);
- :mod:`workloads.builtin`: the built-in workload ``builtin``;
- :mod:`workloads.data_sources`: how a workload's records are read (arrays, IDX files, torch Datasets).

Its own package (issue 22): ``protocol`` is the wire contract both sides import without torch; the
client agent and the coordinator each build models from here, and nothing here imports either of them.
"""
