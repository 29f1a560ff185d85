"""The marker a build of ``hvd-build-horovod`` writes beside horovod/__init__.py: the patches it applied, and the
wait that follows them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from horovod_patches import patch_set_hash, patches_for

from hvd_plugins.core.backend.build_marker import applied_patches, installed_marker
from hvd_plugins.core.backend.waits import synchronize_sleeps


def test_the_marker_lists_the_patches_and_the_wait_follows_it(tmp_path: Path) -> None:
    marker = tmp_path / ".hvd_plugins_patches"
    marker.write_text("".join(f"{name}\n" for name in patches_for("none")))
    assert applied_patches(marker) == {Path(name).stem for name in patches_for("none")}
    assert synchronize_sleeps(marker)

    without_the_wait = tmp_path / "older" / ".hvd_plugins_patches"
    without_the_wait.parent.mkdir()
    without_the_wait.write_text("0001-cxx-standard-from-build.patch\n\n")
    assert applied_patches(without_the_wait) == {"0001-cxx-standard-from-build"}
    assert not synchronize_sleeps(without_the_wait)

    another_build = tmp_path / "elsewhere" / ".hvd_plugins_patches"  # no marker: not built by hvd-build-horovod
    assert applied_patches(another_build) == frozenset() and not synchronize_sleeps(another_build)


def test_the_installed_build_records_the_patches_it_applied() -> None:
    """The markers the build writes beside horovod/__init__.py: its cache key names the patch set, and
    .hvd_plugins_patches lists the patches of that set applied to a build of its GPU mode."""
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
