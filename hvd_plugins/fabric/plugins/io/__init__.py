"""Checkpoint writes that never leave a truncated file."""

from hvd_plugins.fabric.plugins.io.atomic import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO"]
