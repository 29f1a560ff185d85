"""Horovod's source changes: the build script applies its patch files to the pristine Horovod sdist.

Fast, no build; the sdist is used when one is at hand: ``HVD_SDIST``, or the copy the build script keeps in
its wheel cache folder after downloading it. The patch files and the build marker without a process of their
own: tests/unit/build_horovod/test_patches.py and tests/unit/core/backend/test_build_marker.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from horovod_patches import HOROVOD_VERSION, PATCH_DIR, PATCHES, patches_for, pristine_sdist

from hvd_plugins.build import SCRIPT


@pytest.mark.parametrize("gpu", ["none", "nccl"])
def test_the_script_applies_the_patches_in_order_to_the_pristine_source(gpu: str, tmp_path: Path) -> None:
    sdist = pristine_sdist()
    if sdist is None:
        reason = f"no horovod-{HOROVOD_VERSION}.tar.gz: set HVD_SDIST, or run hvd-build-horovod once (it keeps one)"
        print(reason)
        pytest.skip(reason)
    subprocess.run(["tar", "-xzf", str(sdist), "-C", str(tmp_path)], check=True)
    source = tmp_path / f"horovod-{HOROVOD_VERSION}"
    # the script's own apply_patches, run alone
    function = re.search(r"^apply_patches\(\) \{\n.*?^\}\n", SCRIPT.read_text(), re.M | re.S)
    assert function is not None
    program = (
        'log() { :; }; die() { echo "$*" >&2; exit 1; }\n'
        f"HOROVOD_VERSION={HOROVOD_VERSION}; PATCH_DIR='{PATCH_DIR}'; GPU_MODE={gpu}\n"
        f"PATCHES=({' '.join(patch.name for patch in PATCHES)})\n"  # the build's selection: all of them
        f'{function.group(0)}apply_patches "$1"\n'
    )
    done = subprocess.run(["bash", "-c", program, "apply", str(source)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == patches_for(gpu)
    assert not list(source.rglob("*.rej")) and not list(source.rglob("*.orig"))
    # applying them again fails loudly, naming the first patch
    again = subprocess.run(["bash", "-c", program, "apply", str(source)], capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and f"patch {PATCHES[0].name} does not apply" in again.stderr
