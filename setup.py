"""Build hook: write the ``pytorch_lightning`` faces before setuptools collects the packages.

The metadata lives in pyproject.toml. ``hvd_plugins/pytorch_lightning`` and
``hvd_plugins/lightning_fabric`` are generated from ``hvd_plugins/pytorch`` and ``hvd_plugins/fabric``
(``hvd_plugins/mirror.py``), as Lightning generates ``pytorch_lightning``: every wheel, sdist and
``pip install -e .`` gets them as real files.
"""

import importlib.util
from pathlib import Path

from setuptools import setup


def generate_faces() -> None:
    """Run ``hvd_plugins/mirror.py`` by its path: importing the package would need torch and Lightning."""
    spec = importlib.util.spec_from_file_location(
        "hvd_plugins_mirror", Path(__file__).parent / "hvd_plugins" / "mirror.py"
    )
    assert spec is not None and spec.loader is not None
    mirror = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mirror)
    mirror.generate()


generate_faces()
setup()
