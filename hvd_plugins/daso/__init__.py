"""DASO: node-local sync every step, cross-node sync every few steps, driven by the loss."""

from hvd_plugins.daso.config import DasoConfig

__all__ = ["DasoConfig"]
