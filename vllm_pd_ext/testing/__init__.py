"""Helpers for tests, the demo and benchmarks: local engines and a tiny model."""
