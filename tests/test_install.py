"""What a user who installed with pip meets: the build command, and the error that names it."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_plugins.build import SCRIPT, build_environment, main

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


def test_the_build_command_is_installed_and_maps_its_options_to_the_scripts_knobs(tmp_path: Path) -> None:
    command = Path(sys.executable).with_name("hvd-build-horovod")
    assert command.exists(), "pip install -e . installs the console script beside the interpreter"
    help_text = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120).stdout
    assert all(option in help_text for option in ("--gpu", "--mpi", "--cuda-archs", "--sdist", "--cache", "--force"))
    assert SCRIPT.exists() and SCRIPT.read_text().startswith("#!/usr/bin/env bash")
    namespace = argparse.Namespace(
        gpu="none", mpi="no", cuda_archs=None, sdist=None, cache=tmp_path, force=True, patches="0001", target=None
    )
    env = build_environment(namespace, {"PATH": "/usr/bin"})
    assert env["HVD_GPU"] == "none" and env["HVD_MPI"] == "no" and env["HVD_WHEEL_CACHE"] == str(tmp_path)
    assert env["HVD_FORCE_BUILD"] == "1" and env["PYTHON"] == sys.executable
    assert env["PATH"].startswith(str(Path(sys.executable).parent))
    assert env["HVD_PATCHES"] == "0001"
    assert "HVD_SDIST" not in env and "HVD_INSTALL_TARGET" not in env  # options not given leave the defaults


def test_the_build_command_refuses_a_bad_choice_before_building() -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--gpu", "cuda"])
    assert stop.value.code == 2


def test_the_installed_build_records_the_patches_it_applied() -> None:
    """The markers the build writes beside horovod/__init__.py: its cache key names the patch set, and
    .hvd_plugins_patches lists the patches of that set applied to a build of its GPU mode."""
    from test_horovod_patches import patch_set_hash, patches_for

    from hvd_plugins.core.backend.build_marker import applied_patches, installed_marker
    from hvd_plugins.core.backend.waits import synchronize_sleeps

    key_file = installed_marker().with_name(".hvd_plugins_build_key")
    if not key_file.exists():
        pytest.skip("the installed Horovod was not built by hvd-build-horovod")
    key = key_file.read_text().strip()
    if f"-{patch_set_hash()}-" not in key:
        pytest.skip(f"the installed Horovod ({key}) was built from another patch set: run hvd-build-horovod")
    gpu = re.search(r"-gpu_(none|nccl)-", key)
    assert gpu is not None, key
    assert installed_marker().read_text().split() == patches_for(gpu.group(1))
    assert applied_patches() == {Path(name).stem for name in patches_for(gpu.group(1))}
    assert synchronize_sleeps()
