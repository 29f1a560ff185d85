"""The documentation's pages as text: snippets compile and import what exists, every argument is named."""

from __future__ import annotations

import ast

import pytest
from doc_pages import DOCS, REPO, RUNNABLE, SNIPPETS, Snippet, argument_names, code_blocks, strategy_classes


def test_the_pages_have_python_snippets() -> None:
    pages = {snippet.page for snippet in SNIPPETS}
    assert {"README.rst", "docs/strategy.rst", "docs/hierarchical.rst", "docs/daso.rst"} <= pages, pages
    assert len(SNIPPETS) >= 10
    assert any("stall_timeout_seconds=300" in snippet.source for snippet in SNIPPETS)  # a nested block is found


def test_a_continuing_snippet_follows_a_runnable_one_on_its_page() -> None:
    for snippet in RUNNABLE:
        if snippet.continues:
            earlier = [other for other in RUNNABLE if other.page == snippet.page and other.number < snippet.number]
            assert earlier, f"{snippet.name} continues, but no runnable snippet comes before it on its page"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda snippet: snippet.name)
def test_python_snippet_compiles_and_its_imports_resolve(snippet: Snippet) -> None:
    tree = ast.parse(snippet.source)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    namespace: dict[str, object] = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), f"<{snippet.name}>", "exec"), namespace)


def test_ci_runs_the_test_command_the_readme_gives() -> None:
    readme = (REPO / "README.rst").read_text(encoding="utf-8")
    commands = [line.split("#")[0].strip() for block in code_blocks(readme, "bash") for line in block.splitlines()]
    assert "bash ci/test.sh" in commands
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "bash ci/test.sh" in ci_lines


def test_the_strategy_page_covers_every_trainer_argument() -> None:
    page = (DOCS / "strategy.rst").read_text(encoding="utf-8")
    (_, trainer_strategy), _ = strategy_classes()
    missing = [name for name in argument_names(trainer_strategy) if f"``{name}``" not in page]
    assert not missing, f"docs/strategy.rst never names {missing}"
