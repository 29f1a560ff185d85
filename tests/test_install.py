"""What a user who installed with pip meets: the build command, and the error that names it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.build",
    "hvd_plugins.core.backend.module",
)

REFUSAL = """
import sys, types
{setup}
from hvd_plugins import HorovodStrategy
try:
    HorovodStrategy()
except ImportError as error:
    print(type(error).__name__, error)
"""


@pytest.mark.parametrize(
    ("setup", "problem"),
    [
        ("sys.modules['horovod'] = None", "Horovod cannot be imported"),
        (
            "torchless = types.ModuleType('horovod.torch'); torchless._MPI_LIB_AVAILABLE = False\n"
            "sys.modules['horovod.torch'] = torchless",
            "The installed Horovod was built without PyTorch support",
        ),
    ],
    ids=["missing", "built-without-torch"],
)
def test_a_missing_or_torchless_horovod_stops_the_strategy_naming_the_build_command(setup: str, problem: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", REFUSAL.format(setup=setup)], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.startswith("HorovodUnavailable " + problem), done.stdout + done.stderr[-2000:]
    assert "run `hvd-build-horovod`" in done.stdout


def test_the_build_command_is_installed_and_lists_its_options() -> None:
    """How the options map to the build script's knobs: tests/unit/build_horovod/test_command.py."""
    command = Path(sys.executable).with_name("hvd-build-horovod")
    assert command.exists(), "pip install -e . installs the console script beside the interpreter"
    help_text = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120).stdout
    assert all(option in help_text for option in ("--gpu", "--mpi", "--cuda-archs", "--sdist", "--cache", "--force"))
