"""README.rst stays true: its Python snippets compile, import what exists and run; CI runs its test command.

The snippets run in one plain python process (tests/workers/readme_snippets.py), in order, each
from a fresh start unless its first line is ``# continues the example above ...``, in which case
it runs in the namespace of the snippet before it. A snippet whose first line is
``# needs horovodrun ...``, ``# needs a GPU ...`` or ``# needs its own script ...`` is only
compiled here: one process without a launcher or a GPU cannot show what it claims, and a script
that starts its workers by running itself again cannot be run by this runner. Every other snippet
runs as one process (a job of one worker), which is what ``python train.py`` gives a user; the
``# needs its own script`` snippet runs as ``train.py`` in tests/test_launcher.py.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from hvd_launch import run_single

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.rst").read_text(encoding="utf-8")


def _code_blocks(language: str) -> list[str]:
    """The bodies of ``.. code-block:: <language>`` directives (also nested ones), dedented."""
    blocks = []
    pattern = re.compile(
        rf"^(?P<indent>[ ]*)\.\. code-block:: {language}\n\n(?P<body>(?:(?P=indent)[ ]{{3}}.*\n|[ ]*\n)+)",
        re.MULTILINE,
    )
    for match in pattern.finditer(README):
        blocks.append(textwrap.dedent(match.group("body")).strip() + "\n")
    return blocks


@dataclass(frozen=True)
class Snippet:
    source: str

    @property
    def first_line(self) -> str:
        return self.source.splitlines()[0]

    @property
    def continues(self) -> bool:
        return self.first_line.startswith("# continues the example above")

    @property
    def runs(self) -> bool:
        return re.match(r"# needs (horovodrun|a GPU|its own script)", self.first_line) is None

    @property
    def fits(self) -> bool:
        return ".fit(" in self.source


PYTHON_BLOCKS = _code_blocks("python")
SNIPPETS = [Snippet(block) for block in PYTHON_BLOCKS]
RUNNABLE = [index for index, snippet in enumerate(SNIPPETS) if snippet.runs]


def test_readme_has_python_snippets() -> None:
    assert len(PYTHON_BLOCKS) >= 7
    assert any("stall_timeout_seconds" in block for block in PYTHON_BLOCKS)  # a nested code-block is found


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_snippet_compiles_and_its_imports_resolve(index: int) -> None:
    source = PYTHON_BLOCKS[index]
    tree = ast.parse(source)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    namespace: dict[str, object] = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<README>", "exec"), namespace)


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every runnable snippet once, in one process, in a temporary folder."""
    work = tmp_path_factory.mktemp("readme_snippets")
    listing = work / "snippets.json"
    chosen = [asdict(snippet) | {"continues": snippet.continues} for snippet in SNIPPETS if snippet.runs]
    listing.write_text(json.dumps(chosen))
    job = run_single("readme_snippets.py", str(listing), out_dir=work / "run", timeout=600)
    assert 0 in job.results, job.output[-6000:]
    return {"report": job.results[0], "output": job.output}


@pytest.mark.parametrize("index", RUNNABLE)
def test_python_snippet_runs(executed: dict[str, Any], index: int) -> None:
    position = str(RUNNABLE.index(index))
    assert position in executed["report"], f"snippet {index} never ran:\n{executed['output'][-6000:]}"
    result = executed["report"][position]
    assert result["ok"], f"README python snippet {index}:\n{SNIPPETS[index].source}\n{result['trace']}"
    if SNIPPETS[index].fits:  # it trained: every fit it called took optimizer steps
        assert result["fit_steps"] and all(steps > 0 for steps in result["fit_steps"])


def test_ci_runs_the_test_command_the_readme_gives() -> None:
    commands = [line.split("#")[0].strip() for block in _code_blocks("bash") for line in block.splitlines()]
    assert "bash ci/test.sh" in commands
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "bash ci/test.sh" in ci_lines
