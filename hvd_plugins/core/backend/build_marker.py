"""What ``hvd-build-horovod`` recorded about the Horovod it installed: the source patches applied.

Beside the installed ``horovod/__init__.py`` the build writes ``.hvd_plugins_patches``, the file
names of the patches of ``hvd_plugins/build/patches/`` it applied, one per line in the order
applied (and ``.hvd_plugins_build_key``, its cache key). A Horovod built another way has no such
file, and none of the patches.
"""

from __future__ import annotations

import functools
from pathlib import Path

PATCHES_MARKER = ".hvd_plugins_patches"
"""The marker's file name, beside ``horovod/__init__.py``."""


def installed_marker() -> Path:
    """Where the installed Horovod's marker is (whether or not it exists)."""
    import horovod

    return Path(horovod.__file__).with_name(PATCHES_MARKER)


@functools.cache
def applied_patches(marker: Path | None = None) -> frozenset[str]:
    """The patches the build applied, by file name stem (``"0008-sleeping-synchronize-wait"``);
    empty for another build (no marker). ``marker``: the file to read (default: the installed Horovod's).
    """
    try:
        text = (marker or installed_marker()).read_text()
    except OSError:
        return frozenset()  # another build
    return frozenset(Path(line.strip()).stem for line in text.splitlines() if line.strip())
