"""Helpers for the test suite and the benchmarks: launching real Horovod jobs and reading what they wrote."""
