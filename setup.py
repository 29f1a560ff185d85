"""hvd_plugins: Horovod as a first-class way to train with Lightning 2.x."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "hvd_plugins" / "__init__.py").read_text(), re.M).group(1)

setup(
    name="hvd_plugins",
    version=VERSION,
    description="HorovodStrategy for Lightning 2.x: fp16 compression, two-level allreduce, DASO",
    long_description=Path(__file__).with_name("README.rst").read_text(encoding="utf-8"),
    long_description_content_type="text/x-rst",
    packages=find_packages(include=["hvd_plugins", "hvd_plugins.*"]),
    package_data={"hvd_plugins.build": ["install_horovod.sh"]},
    entry_points={"console_scripts": ["hvd-build-horovod=hvd_plugins.build:main"]},
    python_requires=">=3.10",
    install_requires=[
        # Not horovod: pip would build it from its sdist in an isolated environment without torch, which
        # gives a Horovod without PyTorch support. `hvd-build-horovod` (installed with this package) builds
        # it for the torch installed here; using the strategy without it raises an error naming that command.
        # The range the suite has passed in (docs/install.rst, "Versions verified"): torch 2.1 with Lightning
        # 2.1 at the floor, torch 2.13 with Lightning 2.6 in CI; torch 2.14 builds and trains. torch 2.1 and
        # 2.2 need numpy < 2.
        "torch>=2.1,<2.15",
        "lightning>=2.1,<2.7",
        "numpy",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout", "ruff", "scikit-learn", "torchmetrics>=1.0", "matplotlib"],
        "examples": ["scikit-learn", "torchmetrics>=1.0", "matplotlib", "jsonargparse[signatures]>=4.27"],
    },
)
