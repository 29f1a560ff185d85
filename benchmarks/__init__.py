"""Benchmark scripts: each answers one question about the strategy with a table (see README.rst here).

Run one from the repository root as ``python benchmarks/<name>.py`` or ``python -m benchmarks.<name>``.
The scripts import only ``hvd_plugins`` (their shared helpers are ``hvd_plugins.testing.benchmarking``,
``hvd_plugins.testing.reports`` and ``hvd_plugins.testing.netns_cluster``), never each other, so both
forms work and a worker can be started by the script's path.
"""
