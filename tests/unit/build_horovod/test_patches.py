"""The patch files of ``hvd-build-horovod``: numbered, each with a header that says what, why and its effect, and
the only way the build script changes Horovod's source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from horovod_patches import FIELDS, PATCH_DIR, PATCHES, fields, header

from hvd_plugins.build import SCRIPT
from hvd_plugins.core.backend.waits import SLEEPING_WAIT_PATCH


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
