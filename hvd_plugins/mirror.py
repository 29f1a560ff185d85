"""One source, two Lightning packages: ``hvd_plugins.pytorch_lightning`` is ``hvd_plugins.pytorch`` rewritten.

``lightning.pytorch`` and ``pytorch_lightning`` are the same code published twice, with classes of
their own: a ``pytorch_lightning.Trainer`` takes only strategies and callbacks that subclass
``pytorch_lightning`` classes. Lightning builds ``pytorch_lightning`` by rewriting the imports of
``lightning.pytorch`` when it packages it; this module does the same when a face is imported. The
faces' source exists once (``hvd_plugins/pytorch``, ``hvd_plugins/fabric``); a finder on
``sys.meta_path`` serves

- ``hvd_plugins.pytorch_lightning[.x]`` from ``hvd_plugins/pytorch[/x]``, and
- ``hvd_plugins.lightning_fabric[.x]`` from ``hvd_plugins/fabric[/x]``,

compiling each file with ``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` ->
``lightning_fabric`` and the face names rewritten. Line numbers are kept, so tracebacks point at the
real source. The core (``hvd_plugins.core``) imports no Lightning and is shared as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent

RENAMES = {
    "lightning.pytorch": "pytorch_lightning",
    "lightning.fabric": "lightning_fabric",
    "hvd_plugins.pytorch": "hvd_plugins.pytorch_lightning",
    "hvd_plugins.fabric": "hvd_plugins.lightning_fabric",
}
"""Module prefixes of the ``lightning`` faces and what they become in the standalone packages' faces."""

MIRRORS = {"hvd_plugins.pytorch_lightning": "pytorch", "hvd_plugins.lightning_fabric": "fabric"}
"""Mirrored package -> the folder (under ``hvd_plugins/``) whose source it is built from."""

TRAINER_FACES = {"lightning.pytorch": "hvd_plugins.pytorch", "pytorch_lightning": "hvd_plugins.pytorch_lightning"}
"""Lightning package of a Trainer -> the face whose classes it takes."""

_PATTERN = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in RENAMES) + r")(?!\w)")


def rewrite(source: str) -> str:
    """``source`` of a ``lightning`` face, as the face of the standalone packages (same lines)."""
    return _PATTERN.sub(lambda match: RENAMES[match.group(1)], source)


def other_trainer_face(lightning_package: str) -> tuple[str, str]:
    """For a Trainer package, the other one and the face that serves it."""
    (other,) = (package for package in TRAINER_FACES if package != lightning_package)
    return other, TRAINER_FACES[other]


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Loads a face's source file rewritten for the standalone packages (never from or into ``__pycache__``)."""

    def get_source(self, fullname: str) -> str:
        return rewrite(Path(self.path).read_text(encoding="utf-8"))

    def get_code(self, fullname: str):  # type: ignore[override]  # returns a code object
        return compile(self.get_source(fullname), self.path, "exec", dont_inherit=True)


class MirrorFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of the mirrored faces in the source folders of the ``lightning`` faces."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        for mirror, folder in MIRRORS.items():
            if fullname == mirror or fullname.startswith(mirror + "."):
                relative = fullname[len(mirror) :].lstrip(".").split(".") if fullname != mirror else []
                return _spec_for(fullname, PACKAGE_DIR.joinpath(folder, *relative))
        return None


def _spec_for(fullname: str, location: Path) -> importlib.machinery.ModuleSpec | None:
    if (location / "__init__.py").is_file():
        file, search = location / "__init__.py", [str(location)]
    elif location.with_suffix(".py").is_file():
        file, search = location.with_suffix(".py"), None
    else:
        return None
    loader = _RewritingLoader(fullname, str(file))
    return importlib.util.spec_from_file_location(fullname, file, loader=loader, submodule_search_locations=search)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MirrorFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MirrorFinder())
