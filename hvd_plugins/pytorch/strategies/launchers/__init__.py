"""How a plain ``python train.py`` with ``devices=N`` becomes N Horovod workers, and how an elastic job's fit
goes on after workers die or join."""

from hvd_plugins.pytorch.strategies.launchers.elastic import HorovodElasticLauncher
from hvd_plugins.pytorch.strategies.launchers.horovod import HorovodScriptLauncher

__all__ = ["HorovodElasticLauncher", "HorovodScriptLauncher"]
