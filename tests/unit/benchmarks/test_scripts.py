"""Every benchmark script stands alone: no sibling imports, runnable as a file or a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = sorted(path for path in (REPO / "benchmarks").glob("*.py") if path.name != "__init__.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_a_script_imports_no_sibling_and_runs_as_file_or_module(script: Path) -> None:
    """No ``sys.path`` edits and no imports of another script: ``python benchmarks/<name>.py`` needs none."""
    nodes = list(ast.walk(ast.parse(script.read_text())))
    siblings = {path.stem for path in SCRIPTS} | {"benchmarks", "common"}
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom)}
    assert not imported & siblings, sorted(imported & siblings)
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in nodes), "relative import"
    assert "sys.path" not in script.read_text()
    assert script.read_text().rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())')
