"""Horovod's source changes: the patch files of ``hvd-build-horovod`` and the build marker that lists them.

Fast, no build. The patches are applied to the pristine Horovod sdist when one is at hand: ``HVD_SDIST``,
or the copy the build script keeps in its wheel cache folder after downloading it.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from hvd_plugins.build import SCRIPT
from hvd_plugins.core.backend.build_marker import applied_patches
from hvd_plugins.core.backend.waits import SLEEPING_WAIT_PATCH, synchronize_sleeps

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


def test_the_patches_are_numbered_one_to_n_with_lowercase_names() -> None:
    assert PATCHES, f"no patches in {PATCH_DIR}"
    for number, patch in enumerate(PATCHES, start=1):
        assert re.fullmatch(r"\d{4}-[a-z0-9]+(-[a-z0-9]+)*\.patch", patch.name), patch.name
        assert int(patch.name[:4]) == number, f"{patch.name}: expected number {number:04d} (no gaps)"


@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_every_patch_says_what_why_its_effect_and_whether_it_changes_behaviour(patch: Path) -> None:
    found = fields(patch)
    missing = [name for name in FIELDS if not found.get(name)]
    assert not missing, f"{patch.name}: header lacks {missing}"
    assert re.match(r"(yes|no)\b", found["Upstreamable"], re.I), found["Upstreamable"]
    assert re.match(r"(yes|no)\b", found["Changes runtime behaviour"]), found["Changes runtime behaviour"]
    assert found.get("Applies-when", "gpu=none") in ("gpu=none", "gpu=nccl")  # what the script understands
    # nothing in the header that patch would take for the start of a diff
    starts = [line for line in header(patch).splitlines() if re.match(r"\s*(---|\+\+\+|\*\*\*|@@|diff |Index:)", line)]
    assert not starts, starts
    body = patch.read_text()[len(header(patch)) :]
    assert re.search(r"^--- a/\S+\n\+\+\+ b/\S+\n@@ ", body, re.M), f"{patch.name}: not a -p1 unified diff"


def test_the_script_changes_horovods_source_only_through_the_patches() -> None:
    script = SCRIPT.read_text()
    assert "sed -i" not in script
    heredocs = [line for line in script.splitlines() if "<<'PY'" in line]
    assert heredocs and not [line for line in heredocs if "SRC" in line or "GLOO_CC" in line], heredocs
    assert '"$SRC/' not in script, "a file inside Horovod's source is named: edit it with a patch"
    assert 'patch -d "$1" -p1 --forward' in script
    assert "PATCH_LEVEL" not in script


def test_the_sleeping_wait_is_one_of_the_patches() -> None:
    assert (PATCH_DIR / f"{SLEEPING_WAIT_PATCH}.patch").exists()


def pristine_sdist() -> Path | None:
    """Horovod's sdist where the build script finds it: ``HVD_SDIST``, else its wheel cache folder."""
    if os.environ.get("HVD_SDIST"):
        return Path(os.environ["HVD_SDIST"])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hvd_plugins" / "wheels"
    cached = Path(os.environ.get("HVD_WHEEL_CACHE", cache)) / f"horovod-{HOROVOD_VERSION}.tar.gz"
    return cached if cached.exists() else None


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
        f'{function.group(0)}apply_patches "$1"\n'
    )
    done = subprocess.run(["bash", "-c", program, "apply", str(source)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == patches_for(gpu)
    assert not list(source.rglob("*.rej")) and not list(source.rglob("*.orig"))
    # applying them again fails loudly, naming the first patch
    again = subprocess.run(["bash", "-c", program, "apply", str(source)], capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and f"patch {PATCHES[0].name} does not apply" in again.stderr


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
