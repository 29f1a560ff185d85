"""One source, two Lightning packages: the ``pytorch_lightning`` faces are generated files.

``lightning.pytorch`` and ``pytorch_lightning`` are the same code published twice, with classes of
their own: a ``pytorch_lightning.Trainer`` takes only strategies and callbacks that subclass
``pytorch_lightning`` classes. Lightning builds ``pytorch_lightning`` by rewriting the imports of
``lightning.pytorch`` when it packages it; this module does the same for this package's faces:

- ``hvd_plugins/pytorch_lightning/`` is generated from ``hvd_plugins/pytorch/``, and
- ``hvd_plugins/lightning_fabric/`` from ``hvd_plugins/fabric/``,

with ``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric`` and
the face names rewritten, line for line. ``setup.py`` generates them on every build and install
(wheel, sdist, ``pip install -e .``); after editing a face in a development install, run
``python hvd_plugins/mirror.py`` (the test suite fails while they are stale). They are ordinary
files: IDEs and type checkers resolve them, Python caches their bytecode, tracebacks show their
own text. The core (``hvd_plugins.core``) imports no Lightning and is shared as it is.

Only the standard library is used here, so ``setup.py`` can load this file before anything is
installed. Run it by its path, not with ``-m``: importing ``hvd_plugins`` would first import the
generated faces, stale ones included.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent

RENAMES = {
    "lightning.pytorch": "pytorch_lightning",
    "lightning.fabric": "lightning_fabric",
    "hvd_plugins.pytorch": "hvd_plugins.pytorch_lightning",
    "hvd_plugins.fabric": "hvd_plugins.lightning_fabric",
}
"""Module prefixes of the ``lightning`` faces and what they become in the standalone packages' faces."""

MIRRORS = {"pytorch_lightning": "pytorch", "lightning_fabric": "fabric"}
"""Generated face folder (under ``hvd_plugins/``) -> the face folder it is generated from."""

HEADER = "# Generated from hvd_plugins/{source} by `python hvd_plugins/mirror.py`: edit that file, not this one.\n"
"""First line of every generated file; ``generated_files`` also recognises a file by it."""

_PATTERN = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in RENAMES) + r")(?!\w)")


def rewrite(source: str) -> str:
    """``source`` of a ``lightning`` face, as the face of the standalone packages (same lines)."""
    return _PATTERN.sub(lambda match: RENAMES[match.group(1)], source)


def expected_files(package_dir: Path = PACKAGE_DIR) -> dict[Path, str]:
    """Every generated file's path and the text it should hold, from the faces' current source."""
    expected: dict[Path, str] = {}
    for mirror, folder in MIRRORS.items():
        for source in sorted((package_dir / folder).rglob("*.py")):
            relative = source.relative_to(package_dir / folder)
            header = HEADER.format(source=f"{folder}/{relative.as_posix()}")
            expected[package_dir / mirror / relative] = header + rewrite(source.read_text(encoding="utf-8"))
    return expected


def generated_files(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The ``.py`` files now in the generated folders."""
    return sorted(path for mirror in MIRRORS for path in (package_dir / mirror).rglob("*.py"))


def stale_files(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """What ``generate`` would change: files missing, different or left over (empty when up to date)."""
    expected = expected_files(package_dir)
    stale = [
        f"{path.relative_to(package_dir)} ({'missing' if not path.is_file() else 'differs'})"
        for path, text in expected.items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]
    stale += [
        f"{path.relative_to(package_dir)} (no source)" for path in generated_files(package_dir) if path not in expected
    ]
    return stale


def generate(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Write the generated faces; returns the files written or removed (unchanged files keep their bytecode)."""
    expected = expected_files(package_dir)
    changed = []
    for path in generated_files(package_dir):
        if path not in expected:
            path.unlink()
            changed.append(path)
    for path, text in expected.items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    for mirror in MIRRORS:  # folders whose source folder is gone
        for folder in sorted((package_dir / mirror).rglob("*"), reverse=True):
            if folder.is_dir() and folder.name != "__pycache__" and not any(folder.rglob("*.py")):
                shutil.rmtree(folder)
    return changed


def main(argv: list[str] | None = None) -> int:
    """``python hvd_plugins/mirror.py``: write the generated faces; ``--check``: only say whether they are stale."""
    arguments = sys.argv[1:] if argv is None else argv
    if arguments == ["--check"]:
        stale = stale_files()
        for entry in stale:
            print(f"hvd_plugins.mirror: stale: {entry}", file=sys.stderr)
        if stale:
            print("hvd_plugins.mirror: run `python hvd_plugins/mirror.py` to write them", file=sys.stderr)
        return 1 if stale else 0
    if arguments:
        print(f"usage: python hvd_plugins/mirror.py [--check] (got {' '.join(arguments)})", file=sys.stderr)
        return 2
    changed = generate()
    print(f"hvd_plugins.mirror: {len(changed)} generated file(s) written or removed under {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
