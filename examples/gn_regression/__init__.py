"""A workload no built-in covers: a GroupNorm CNN regressing two targets (MSE) from 8x8 grids."""
