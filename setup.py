"""hvd_plugins: Horovod as a first-class way to train with Lightning 2.x."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="hvd_plugins",
    version="0.1.0",
    description="HorovodStrategy for Lightning 2.x: fp16 compression, two-level allreduce, DASO",
    long_description=Path(__file__).with_name("README.rst").read_text(encoding="utf-8"),
    long_description_content_type="text/x-rst",
    packages=find_packages(include=["hvd_plugins", "hvd_plugins.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Horovod is built from source for the installed torch by ci/install_horovod.sh;
        # PyPI has no wheel, and its sdist does not compile against torch >= 2.1 unpatched.
        "horovod==0.28.1",
        "torch>=2.1",
        "lightning>=2.1,<3",
        "numpy",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout", "ruff", "scikit-learn", "torchmetrics>=1.0", "matplotlib"],
        "examples": ["scikit-learn", "torchmetrics>=1.0", "matplotlib", "jsonargparse[signatures]>=4.27"],
    },
)
