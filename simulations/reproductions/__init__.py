"""Paper reproductions run as federations (never shipped to the nodes).

- :mod:`~simulations.reproductions.tvc_fig2`: TVC Fig. 2, the ``realisation-survival`` preset
- :mod:`~simulations.reproductions.fz_sec43`: FZ Sec. 4.3, the ``filters-compare`` preset
- :mod:`~simulations.reproductions.fz_sec51`: FZ Sec. 5.1 and Fig. 1 on MNIST (``fedfilter reproduce``)
- :mod:`~simulations.reproductions.counting`: the counting-query federation of the two presets
- :mod:`~simulations.reproductions.plots`: their PNG figures
"""
