"""Data for simulated federations (never shipped to the nodes: each data owner brings their own).

- :mod:`~simulations.datasets.idx`: MNIST / Fashion-MNIST IDX files, verified against published checksums
- :mod:`~simulations.datasets.partition`: iid and Dirichlet splits over clients; MNIST silos
- :mod:`~simulations.datasets.synthetic`: Gaussian blobs, sparse indicator rows
- :mod:`~simulations.datasets.scenarios`: client datasets with known answers (staircase, sparse counting)
"""
