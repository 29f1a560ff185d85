"""What a wheel built from a clean tree holds: the generated faces, the build script, type information."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import hvd_plugins
from hvd_plugins import mirror

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL_OUTPUTS = {".git", ".venv", "build", "dist", "runs", "lightning_logs"}
LEFT_BEHIND_ANYWHERE = shutil.ignore_patterns("*.egg-info", "__pycache__", "_build", *mirror.MIRRORS)


def left_behind(folder: str, names: list[str]) -> set[str]:
    """Not copied: what a clean clone lacks, the generated faces included (the build must write them)."""
    top_level = TOP_LEVEL_OUTPUTS if Path(folder) == ROOT else set()
    return set(LEFT_BEHIND_ANYWHERE(folder, names)) | (top_level & set(names))


def test_the_wheel_ships_both_faces_as_files_and_leaves_the_test_tooling_out(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=left_behind)
    assert not (source / "hvd_plugins" / "pytorch_lightning").exists()
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    done = subprocess.run([*command, "-w", str(tmp_path)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = tmp_path.glob("hvd_plugins-*.whl")
    assert wheel.name.startswith(f"hvd_plugins-{hvd_plugins.__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    generated = {path.relative_to(ROOT).as_posix() for path in mirror.expected_files()}
    assert generated and generated <= names, sorted(generated - names)
    assert {"hvd_plugins/py.typed", "hvd_plugins/build/install_horovod.sh", "hvd_plugins/mirror.py"} <= names
    patches = {path.relative_to(ROOT).as_posix() for path in (ROOT / "hvd_plugins/build/patches").glob("*.patch")}
    assert patches <= names, sorted(patches - names)
    assert not [name for name in names if name.startswith("hvd_plugins/testing/")]
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "hvd-build-horovod = hvd_plugins.build:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
