"""Helpers for the test suite and the benchmarks: launching real Horovod jobs and reading what they wrote
(``launch``), nodes emulated by network namespaces (``netns_cluster``), what the benchmark scripts share
(``benchmarking``) and their dated reports (``reports``)."""
