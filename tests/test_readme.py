"""README.rst stays true: its Python snippets compile and import what exists, and CI runs its test command."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.rst").read_text(encoding="utf-8")


def _code_blocks(language: str) -> list[str]:
    """The bodies of ``.. code-block:: <language>`` directives, dedented."""
    blocks = []
    pattern = re.compile(rf"^\.\. code-block:: {language}\n\n((?:[ ]{{3}}.*\n|\n)+)", re.MULTILINE)
    for match in pattern.finditer(README):
        lines = [line[3:] for line in match.group(1).splitlines()]
        blocks.append("\n".join(lines).strip() + "\n")
    return blocks


PYTHON_BLOCKS = _code_blocks("python")


def test_readme_has_python_snippets() -> None:
    assert len(PYTHON_BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_snippet_compiles_and_its_imports_resolve(index: int) -> None:
    source = PYTHON_BLOCKS[index]
    tree = ast.parse(source)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    namespace: dict[str, object] = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<README>", "exec"), namespace)


def test_ci_runs_the_test_command_the_readme_gives() -> None:
    commands = [line.split("#")[0].strip() for block in _code_blocks("bash") for line in block.splitlines()]
    assert "bash ci/test.sh" in commands
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "bash ci/test.sh" in ci_lines
