"""How a plain ``python train.py`` with ``devices=N`` becomes N Horovod workers."""

from hvd_plugins.pytorch.strategies.launchers.horovod import HorovodScriptLauncher

__all__ = ["HorovodScriptLauncher"]
