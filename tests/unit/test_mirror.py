"""The generated ``pytorch_lightning`` faces: up to date, written only when they change, ordinary modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hvd_plugins import mirror

FACE_SOURCE = '''"""A face module."""

import lightning.pytorch as pl
from lightning.fabric.utilities import rank_zero_only
from hvd_plugins.pytorch.callbacks import LineProgressBar
from hvd_plugins.core.config import HorovodConfig  # the core is shared, never renamed

NOT_A_MODULE = "mylightning.pytorch_stuff"
'''


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "hvd_plugins"
    (package / "pytorch" / "callbacks").mkdir(parents=True)
    (package / "fabric").mkdir()
    (package / "pytorch" / "__init__.py").write_text(FACE_SOURCE)
    (package / "pytorch" / "callbacks" / "__init__.py").write_text("from hvd_plugins.fabric import x\n")
    (package / "fabric" / "__init__.py").write_text("x = 1\n")
    return package


def test_the_generated_faces_in_this_tree_are_up_to_date() -> None:
    stale = mirror.stale_files()
    assert not stale, f"generated faces are stale, run `python hvd_plugins/mirror.py`: {stale}"


def test_rewrite_renames_lightning_and_face_imports_line_for_line() -> None:
    rewritten = mirror.rewrite(FACE_SOURCE)
    assert rewritten.count("\n") == FACE_SOURCE.count("\n")
    assert "import pytorch_lightning as pl" in rewritten
    assert "from lightning_fabric.utilities import rank_zero_only" in rewritten
    assert "from hvd_plugins.pytorch_lightning.callbacks import LineProgressBar" in rewritten
    assert "from hvd_plugins.core.config import HorovodConfig" in rewritten
    assert '"mylightning.pytorch_stuff"' in rewritten


def test_generate_writes_each_face_file_with_a_header_naming_its_source(tmp_path: Path) -> None:
    package = _package(tmp_path)
    assert len(mirror.stale_files(package)) == 3
    written = mirror.generate(package)
    assert sorted(path.relative_to(package).as_posix() for path in written) == [
        "lightning_fabric/__init__.py",
        "pytorch_lightning/__init__.py",
        "pytorch_lightning/callbacks/__init__.py",
    ]
    text = (package / "pytorch_lightning" / "__init__.py").read_text()
    assert text.startswith("# Generated from hvd_plugins/pytorch/__init__.py")
    assert text.split("\n", 1)[1] == mirror.rewrite(FACE_SOURCE)
    assert mirror.stale_files(package) == []


def test_generate_leaves_unchanged_files_alone_and_follows_edits_and_removals(tmp_path: Path) -> None:
    package = _package(tmp_path)
    mirror.generate(package)
    kept = package / "lightning_fabric" / "__init__.py"
    os.utime(kept, (1_000_000, 1_000_000))  # bytecode caches key on the mtime: it must not move
    (package / "pytorch" / "__init__.py").write_text(FACE_SOURCE + "EDITED = True\n")
    (package / "pytorch" / "callbacks" / "__init__.py").unlink()
    (package / "pytorch" / "callbacks").rmdir()
    assert sorted(mirror.stale_files(package)) == [
        "pytorch_lightning/__init__.py (differs)",
        "pytorch_lightning/callbacks/__init__.py (no source)",
    ]
    changed = mirror.generate(package)
    assert len(changed) == 2 and kept.stat().st_mtime == 1_000_000
    assert not (package / "pytorch_lightning" / "callbacks").exists()
    assert "EDITED = True" in (package / "pytorch_lightning" / "__init__.py").read_text()
    assert mirror.stale_files(package) == []


IMPORT_FACE = """
import importlib.machinery, sys
import hvd_plugins.pytorch_lightning as face
from hvd_plugins.pytorch_lightning.strategies import horovod
finders = [type(f).__module__ + "." + type(f).__qualname__ for f in sys.meta_path]
assert not [f for f in finders if "hvd_plugins" in f or "mirror" in f], finders
assert type(face.__spec__.loader) is importlib.machinery.SourceFileLoader, face.__spec__.loader
print(horovod.__file__)
print(horovod.__cached__)
"""


def test_the_face_imports_as_ordinary_files_cached_as_bytecode_with_no_import_hook() -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}

    def import_face() -> tuple[Path, Path]:
        done = subprocess.run(
            [sys.executable, "-c", IMPORT_FACE], capture_output=True, text=True, timeout=120, env=env, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        source, cached = done.stdout.split()
        return Path(source), Path(cached)

    source, cached = import_face()
    assert source == mirror.PACKAGE_DIR / "pytorch_lightning" / "strategies" / "horovod.py"
    assert cached.is_file()
    compiled_at = cached.stat().st_mtime_ns
    assert import_face() == (source, cached)
    assert cached.stat().st_mtime_ns == compiled_at, "the second run loaded the bytecode instead of compiling again"
