"""``hvd-build-horovod`` without a build: its options reach the build script's knobs, bad choices stop it first."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from hvd_plugins.build import SCRIPT, build_environment, main


def test_the_build_command_refuses_a_bad_choice_before_building() -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--gpu", "cuda"])
    assert stop.value.code == 2


def test_the_options_map_to_the_build_scripts_knobs(tmp_path: Path) -> None:
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
