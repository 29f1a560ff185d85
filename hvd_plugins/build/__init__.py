"""``hvd-build-horovod``: build Horovod 0.28.1 for the torch of this environment, cache the wheel, install it.

pip cannot do this: Horovod's sdist builds in an isolated environment without torch (so without
PyTorch support), and its last release does not compile against current torch unpatched. This runs
``install_horovod.sh`` beside this file with this interpreter; every option maps to one of the
script's environment knobs, which its header documents.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("install_horovod.sh")
COMMAND = "hvd-build-horovod"
"""What error messages tell users to run (``python -m hvd_plugins.build`` is the same)."""


def build_environment(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    """The script's environment: this interpreter, plus the knobs the options set."""
    # this interpreter's scripts (pip, horovodrun) first, also when its environment is not activated
    path = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    env = {**environ, "PYTHON": sys.executable, "PATH": path}
    knobs = {"HVD_GPU": args.gpu, "HVD_MPI": args.mpi, "HVD_CUDA_ARCHS": args.cuda_archs, "HVD_SDIST": args.sdist}
    knobs["HVD_WHEEL_CACHE"] = args.cache
    knobs["HVD_PATCHES"] = args.patches
    knobs["HVD_INSTALL_TARGET"] = args.target
    env.update({name: str(value) for name, value in knobs.items() if value is not None})
    if args.force:
        env["HVD_FORCE_BUILD"] = "1"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=["auto", "nccl", "none"], help="NCCL GPU ops (default auto)")
    parser.add_argument("--mpi", choices=["auto", "yes", "no"], help="the MPI controller (default: when mpicc exists)")
    parser.add_argument("--cuda-archs", help='GPU architectures, e.g. "80;90" (the default)')
    parser.add_argument("--sdist", type=Path, help="build from this horovod-0.28.1.tar.gz (no package index)")
    parser.add_argument("--cache", type=Path, help="wheel cache folder (default ~/.cache/hvd_plugins/wheels)")
    parser.add_argument("--force", action="store_true", help="build even when a cached wheel matches")
    parser.add_argument("--patches", help='only these patches of hvd_plugins/build/patches, by number, e.g. "0001"')
    parser.add_argument("--target", type=Path, help="install into this folder instead of the environment")
    args = parser.parse_args(argv)
    env = build_environment(args, dict(os.environ))
    return subprocess.run(["bash", str(SCRIPT)], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
