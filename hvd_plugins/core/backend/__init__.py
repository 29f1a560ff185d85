"""Horovod itself: the import, start-up, capability checks, waits, the runner and every private attribute used."""
