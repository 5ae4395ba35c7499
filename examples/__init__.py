"""Example workloads (bring your own: docs/workloads.md)."""
