"""Every module of the package has a test that can be found from the module's name.

The rule, for every ``hvd_plugins/**/*.py`` but the generated faces (``hvd_plugins.mirror.MIRRORS``):

- A unit file at the module's mirror path: ``hvd_plugins/a/b/c.py`` -> ``tests/unit/a/b/test_c.py``. Leading
  and trailing underscores leave the name (``_gather.py`` -> ``test_gather.py``, a package's ``__init__.py``
  -> ``test_init.py`` in the package's folder, ``__main__.py`` -> ``test_main.py``).
- Or a multi-process file that names it: a ``tests/test_*.py`` whose module-level ``COVERS`` tuple lists the
  dotted names of the modules its jobs exercise (a package's ``__init__.py`` by the package's name). It is
  read as text, never imported: those files need horovodrun and their workers.
- Exempt: a module that holds no code of its own, whose top level is only a docstring, imports and an
  ``__all__`` (a package's docstring, or the names it re-exports); and a ``__main__.py`` that only calls
  what it imports (``sys.exit(main())``): the called code's tests cover it.

A ``COVERS`` entry that names no module of the package fails too, so a moved or removed module cannot
leave a declaration that covers nothing. The module list is read from the tree, never written down here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

from hvd_plugins.mirror import MIRRORS

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hvd_plugins"
UNIT = REPO / "tests" / "unit"
COVERS = "COVERS"
"""The name of the declaration in a multi-process test file."""


def multiprocess_files(tests: Path = REPO / "tests") -> list[Path]:
    return sorted(tests.glob("test_*.py"))


def source_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package's source by dotted name (a package by its own name), the generated faces left out."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.parts[0] in MIRRORS or "__pycache__" in relative.parts:
            continue
        parts = (package.name, *relative.with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def holds_no_code(path: Path) -> bool:
    """Whether the module is only a docstring, imports and ``__all__`` (a ``__main__.py`` may also call what it
    imports): nothing of its own to test."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for statement in body:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            continue
        if isinstance(statement, ast.Assign) and [ast.unparse(target) for target in statement.targets] == ["__all__"]:
            continue
        if path.name == "__main__.py" and isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            continue
        return False
    return True


def mirror_path(path: Path, package: Path = PACKAGE, unit: Path = UNIT) -> Path:
    """Where a module's unit file is: the same folders under ``tests/unit``, ``test_`` + its name unadorned."""
    relative = path.relative_to(package)
    return unit / relative.parent / f"test_{relative.stem.strip('_')}.py"


def declared_covers(files: Iterable[Path]) -> dict[Path, tuple[str, ...]]:
    """The ``COVERS`` tuple of each file that has one, read from its source; a malformed one raises ValueError."""
    declared = {}
    for path in files:
        for statement in ast.parse(path.read_text(encoding="utf-8")).body:
            target = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
            if not any(isinstance(name, ast.Name) and name.id == COVERS for name in target):
                continue
            value = getattr(statement, "value", None)
            try:
                names = ast.literal_eval(value) if value is not None else None
            except ValueError:
                names = None
            if not isinstance(names, tuple) or not all(isinstance(name, str) for name in names):
                raise ValueError(f"{path.name}: {COVERS} must be a tuple of dotted module names, written out")
            declared[path] = names
    return declared


def uncovered(package: Path, unit: Path, files: Iterable[Path]) -> list[str]:
    """The modules that hold code and have neither a unit file at their mirror path nor a declaring file."""
    named = {name for names in declared_covers(files).values() for name in names}
    return [
        f"{path.relative_to(package.parent)} (no {mirror_path(path, package, unit).relative_to(unit.parent.parent)}, "
        f"and no tests/test_*.py names {module} in its {COVERS})"
        for module, path in source_modules(package).items()
        if not holds_no_code(path) and not mirror_path(path, package, unit).is_file() and module not in named
    ]


def stale_declarations(package: Path, files: Iterable[Path]) -> list[str]:
    """``COVERS`` entries that name no module of the package, or name one twice in a file."""
    modules = source_modules(package)
    stale = []
    for path, names in declared_covers(files).items():
        stale += [f"{path.name}: {name} is no module of the package" for name in names if name not in modules]
        stale += [f"{path.name}: {name} is named twice" for name in sorted(set(names)) if names.count(name) > 1]
    return stale


# ---------------------------------------------------------------------------- the rule, on the package
def test_every_module_has_a_unit_file_at_its_mirror_path_or_a_multiprocess_file_that_declares_it() -> None:
    missing = uncovered(PACKAGE, UNIT, multiprocess_files())
    assert not missing, "modules without a findable test:\n" + "\n".join(missing)


def test_every_declared_module_exists() -> None:
    stale = stale_declarations(PACKAGE, multiprocess_files())
    assert not stale, f"{COVERS} entries to correct:\n" + "\n".join(stale)


def test_the_multiprocess_files_declare_what_they_cover() -> None:
    """The declaration is found where it is written (no silently ignored spelling), and some files have one."""
    declared = declared_covers(multiprocess_files())
    assert declared, f"no tests/test_*.py declares {COVERS}"
    for path in multiprocess_files():
        written = f"{COVERS} =" in path.read_text(encoding="utf-8")
        assert path in declared or not written, f"{path.name}: {COVERS} is not at module level"


# ---------------------------------------------------------------------------- the rule itself, on a toy package
def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def toy(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A package ``toy`` beside its ``tests/unit`` mirror and a multi-process file declaring one module."""
    package, unit = tmp_path / "toy", tmp_path / "tests" / "unit"
    write(package / "__init__.py", '"""A package."""\n\nfrom toy.core.tested import thing\n\n__all__ = ["thing"]\n')
    write(package / "__main__.py", '"""python -m toy."""\nimport sys\n\nfrom toy.cli import main\n\nsys.exit(main())\n')
    write(package / "core" / "__init__.py", '"""Holds code."""\n\nREGISTRY = {}\n')
    write(package / "core" / "tested.py", "def thing() -> int:\n    return 1\n")
    write(package / "core" / "_private.py", "X = 1\n")
    write(package / "core" / "declared.py", "X = 1\n")
    write(package / "core" / "untested.py", "X = 1\n")
    write(package / "cli.py", "def main() -> int:\n    return 0\n")
    write(package / "pytorch_lightning" / "generated.py", "X = 1\n")
    write(unit / "core" / "test_tested.py", "")
    write(unit / "core" / "test_private.py", "")
    declaring = write(tmp_path / "tests" / "test_jobs.py", 'COVERS = ("toy.core.declared", "toy.cli")\n')
    return package, unit, declaring


def test_a_module_without_a_mirror_or_a_declaration_is_named(toy: tuple[Path, Path, Path]) -> None:
    package, unit, declaring = toy
    missing = uncovered(package, unit, [declaring])
    assert [entry.split(" ")[0] for entry in missing] == ["toy/core/__init__.py", "toy/core/untested.py"]
    assert "no tests/unit/core/test_init.py, and no tests/test_*.py names toy.core in its COVERS" in missing[0]
    assert "pytorch_lightning" not in " ".join(source_modules(package))  # generated faces are not the source


def test_modules_without_code_of_their_own_are_exempt(toy: tuple[Path, Path, Path]) -> None:
    package, _, _ = toy
    assert holds_no_code(package / "__init__.py") and holds_no_code(package / "__main__.py")
    assert not holds_no_code(package / "core" / "__init__.py") and not holds_no_code(package / "cli.py")
    calling_init = write(package / "other" / "__init__.py", "from toy.cli import main\n\nmain()\n")
    assert not holds_no_code(calling_init)  # only a __main__.py may call at import


def test_a_declaration_of_no_module_is_stale_and_a_malformed_one_is_refused(toy: tuple[Path, Path, Path]) -> None:
    package, _, declaring = toy
    assert stale_declarations(package, [declaring]) == []
    write(declaring, 'COVERS = ("toy.core.declared", "toy.core.moved", "toy.cli", "toy.cli")  # what it runs\n')
    assert stale_declarations(package, [declaring]) == [
        "test_jobs.py: toy.core.moved is no module of the package",
        "test_jobs.py: toy.cli is named twice",
    ]
    write(declaring, 'COVERS = ["toy.cli"]\n')
    with pytest.raises(ValueError, match="COVERS must be a tuple of dotted module names"):
        declared_covers([declaring])
    write(declaring, "COVERS = tuple(sorted(NAMES))\n")
    with pytest.raises(ValueError, match="COVERS must be a tuple"):
        declared_covers([declaring])


def test_mirror_paths_drop_the_package_folder_and_the_names_underscores(toy: tuple[Path, Path, Path]) -> None:
    package, unit, _ = toy
    assert mirror_path(package / "core" / "tested.py", package, unit) == unit / "core" / "test_tested.py"
    assert mirror_path(package / "core" / "_private.py", package, unit) == unit / "core" / "test_private.py"
    assert mirror_path(package / "__init__.py", package, unit) == unit / "test_init.py"
    assert mirror_path(package / "__main__.py", package, unit) == unit / "test_main.py"
