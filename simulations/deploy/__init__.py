"""Deployment on real machines, and on one host for tests and benchmarks (never shipped to the nodes).

- :mod:`~simulations.deploy.certs`: the SuperLink's CA and TLS certificate; Flower's connection config
- :mod:`~simulations.deploy.keys`: a SuperNode's authentication key pair
- :mod:`~simulations.deploy.agent_files`: agent TOMLs, demo agents, ``check_agent_file``
- :mod:`~simulations.deploy.run`: ``fedfilter run``, ``flwr run`` with a checked config and an honest exit code
- :mod:`~simulations.deploy.local`: a SuperLink and SuperNodes with client agents on one host
- :mod:`~simulations.deploy.files`: private files (mode 0600), never overwritten unless asked
"""
