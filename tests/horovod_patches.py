"""Horovod's source changes as ``hvd-build-horovod`` keeps them: the patch files, their headers, the patch set's
hash and which patches a build applies (shared by tests/unit/build_horovod, tests/unit/core/backend and
tests/test_horovod_patches.py)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from hvd_plugins.build import SCRIPT

PATCH_DIR = SCRIPT.with_name("patches")
PATCHES = sorted(PATCH_DIR.glob("*.patch"))
FIELDS = ("What", "Why", "Measured effect", "Upstreamable", "Changes runtime behaviour")
HOROVOD_VERSION = "0.28.1"


def header(patch: Path) -> str:
    """The free text before the diff, which ``patch`` ignores."""
    text = patch.read_text()
    start = re.search(r"^(--- |diff )", text, re.M)
    assert start is not None, f"{patch.name} has no diff"
    return text[: start.start()]


def fields(patch: Path) -> dict[str, str]:
    """The header's ``Name: value`` fields, continuation lines (indented) joined."""
    found: dict[str, str] = {}
    name = None
    for line in header(patch).splitlines():
        field = re.match(r"([A-Z][A-Za-z -]*): (.*)", line)
        if field:
            name = field.group(1)
            assert name not in found, f"{patch.name}: {name} twice"
            found[name] = field.group(2).strip()
        elif line.startswith(" ") and name is not None:
            found[name] += " " + line.strip()
        else:
            name = None
    return found


def patch_set_hash() -> str:
    """The patch set as the script's cache key names it: sha256 of ``sha256sum *.patch`` in the folder."""
    listing = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in PATCHES)
    return "patches-" + hashlib.sha256(listing.encode()).hexdigest()[:10]


def patches_for(gpu: str) -> list[str]:
    """The patch file names a build with ``HVD_GPU`` resolved to ``gpu`` applies, in order."""
    return [p.name for p in PATCHES if fields(p).get("Applies-when", f"gpu={gpu}") == f"gpu={gpu}"]


def pristine_sdist() -> Path | None:
    """Horovod's sdist where the build script finds it: ``HVD_SDIST``, else its wheel cache folder."""
    if os.environ.get("HVD_SDIST"):
        return Path(os.environ["HVD_SDIST"])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hvd_plugins" / "wheels"
    cached = Path(os.environ.get("HVD_WHEEL_CACHE", cache)) / f"horovod-{HOROVOD_VERSION}.tar.gz"
    return cached if cached.exists() else None
