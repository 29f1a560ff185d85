"""The documentation stays true: README.rst and docs/*.rst run, the site builds, the API page is complete.

Python snippets: every ``.. code-block:: python`` of README.rst and of each page in docs/ compiles
and imports what exists. The runnable ones run in one plain python process
(tests/workers/doc_snippets.py), page after page, in order, each from a fresh start unless its
first line is ``# continues the example above ...``, in which case it runs in the namespace of the
runnable snippet before it on the same page. A snippet whose first line is
``# needs horovodrun ...``, ``# needs a GPU ...`` or ``# needs its own script ...`` is only compiled
here: one process without a launcher or a GPU cannot show what it claims, and a script that starts
its workers by running itself again cannot be run by this runner. Every other snippet runs as one
process (a job of one worker), which is what ``python train.py`` gives a user; the
``# needs its own script`` snippet runs as ``train.py`` in tests/test_launcher.py.

The Sphinx site builds with ``sphinx-build -W --keep-going -b html docs <tmp>`` (a warning fails),
and its API page describes every argument of both ``HorovodStrategy`` classes (the Trainer's and
Fabric's). CI runs the test command README gives.
"""

from __future__ import annotations

import ast
import html
import inspect
import json
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hvd_launch import run_single

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.rst", *sorted(DOCS.glob("*.rst"))]
MARKERS_NOT_RUN = r"# needs (horovodrun|a GPU|its own script)"


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of ``.. code-block:: <language>`` directives (also nested ones, with options), dedented."""
    pattern = re.compile(
        rf"^(?P<indent>[ ]*)\.\. code-block:: {language}\n"
        r"(?:(?P=indent)[ ]{3}:[^\n]*\n)*\n"
        r"(?P<body>(?:(?P=indent)[ ]{3}.*\n|[ ]*\n)+)",
        re.MULTILINE,
    )
    return [textwrap.dedent(match.group("body")).strip() + "\n" for match in pattern.finditer(text)]


@dataclass(frozen=True)
class Snippet:
    page: str  # relative to the repository root
    number: int  # among the page's python snippets, from 0
    source: str

    @property
    def name(self) -> str:
        return f"{self.page}#{self.number}"

    @property
    def first_line(self) -> str:
        return self.source.splitlines()[0]

    @property
    def continues(self) -> bool:
        return self.first_line.startswith("# continues the example above")

    @property
    def runs(self) -> bool:
        return re.match(MARKERS_NOT_RUN, self.first_line) is None

    @property
    def fits(self) -> bool:
        return ".fit(" in self.source


def _page_snippets(page: Path) -> list[Snippet]:
    blocks = code_blocks(page.read_text(encoding="utf-8"), "python")
    return [Snippet(str(page.relative_to(REPO)), number, block) for number, block in enumerate(blocks)]


SNIPPETS = [snippet for page in PAGES for snippet in _page_snippets(page)]
RUNNABLE = [snippet for snippet in SNIPPETS if snippet.runs]


def snippet_marked(marker: str) -> Snippet:
    """The one snippet, on any page, whose first line starts with ``marker``."""
    (found,) = [snippet for snippet in SNIPPETS if snippet.first_line.startswith(marker)]
    return found


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


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every runnable snippet once, in one process, in a temporary folder."""
    work = tmp_path_factory.mktemp("doc_snippets")
    listing = work / "snippets.json"
    chosen = [{"name": s.name, "source": s.source, "continues": s.continues} for s in RUNNABLE]
    listing.write_text(json.dumps(chosen))
    job = run_single("doc_snippets.py", str(listing), out_dir=work / "run", timeout=600)
    assert 0 in job.results, job.output[-6000:]
    return {"report": job.results[0], "output": job.output}


@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda snippet: snippet.name)
def test_python_snippet_runs(executed: dict[str, Any], snippet: Snippet) -> None:
    assert snippet.name in executed["report"], f"{snippet.name} never ran:\n{executed['output'][-6000:]}"
    result = executed["report"][snippet.name]
    assert result["ok"], f"python snippet {snippet.name}:\n{snippet.source}\n{result['trace']}"
    if snippet.fits:  # it trained: every fit it called took optimizer steps
        assert result["fit_steps"] and all(steps > 0 for steps in result["fit_steps"])


def test_ci_runs_the_test_command_the_readme_gives() -> None:
    readme = (REPO / "README.rst").read_text(encoding="utf-8")
    commands = [line.split("#")[0].strip() for block in code_blocks(readme, "bash") for line in block.splitlines()]
    assert "bash ci/test.sh" in commands
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "bash ci/test.sh" in ci_lines


# ---------------------------------------------------------------------------------------------- the site


def _strategies() -> list[tuple[str, type]]:
    from hvd_plugins.fabric import HorovodStrategy as FabricStrategy
    from hvd_plugins.pytorch import HorovodStrategy as TrainerStrategy

    return [("hvd_plugins.HorovodStrategy", TrainerStrategy), ("hvd_plugins.fabric.HorovodStrategy", FabricStrategy)]


def _arguments(strategy: type) -> list[str]:
    return [name for name in inspect.signature(strategy.__init__).parameters if name != "self"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HTML site, built as CI builds it: every warning is an error."""
    out = tmp_path_factory.mktemp("docs_html")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", str(DOCS), str(out)]
    build = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert build.returncode == 0, f"sphinx-build failed:\n{build.stdout[-3000:]}\n{build.stderr[-6000:]}"
    return out


def test_the_site_builds_without_warnings(site: Path) -> None:
    for page in DOCS.glob("*.rst"):
        assert (site / page.with_suffix(".html").name).is_file(), page.name


def _object_description(page_html: str, anchor: str) -> str:
    """What the API page says about ``anchor`` (its docstring), without the signature line."""
    start = page_html.index(f'id="{anchor}"')
    others = (
        match.start()
        for match in re.finditer(r'id="(hvd_plugins\.[^"]+)"', page_html[start:])
        if match.group(1) != anchor and not match.group(1).startswith(anchor + ".")
    )
    end = start + next(others, len(page_html) - start)
    return page_html[page_html.index("</dt>", start) : end]


@pytest.mark.parametrize("anchor", ["hvd_plugins.HorovodStrategy", "hvd_plugins.fabric.HorovodStrategy"])
def test_the_api_page_describes_every_strategy_argument(site: Path, anchor: str) -> None:
    strategy = dict(_strategies())[anchor]
    description = _object_description((site / "api.html").read_text(encoding="utf-8"), anchor)
    described = set(re.findall(r"<strong>(\w+)</strong>", html.unescape(description)))
    arguments = _arguments(strategy)
    assert len(arguments) >= 14
    missing = [name for name in arguments if name not in described]
    assert not missing, f"{anchor}: arguments without a description on the API page: {missing}"


def test_attribute_docstrings_read_as_sentences(site: Path) -> None:
    """napoleon takes ``words: text`` on the first line of an attribute's docstring for its type."""
    api = (site / "api.html").read_text(encoding="utf-8")
    found = api.find('>Type<span class="colon">')
    before = re.sub(r"<[^>]+>", " ", api[max(0, found - 1500) : found])
    assert found < 0, f"a docstring's first line was read as a type; use no colon there: ...{before[-300:]}"


def test_the_strategy_page_covers_every_trainer_argument() -> None:
    page = (DOCS / "strategy.rst").read_text(encoding="utf-8")
    (_, trainer_strategy), _ = _strategies()
    missing = [name for name in _arguments(trainer_strategy) if f"``{name}``" not in page]
    assert not missing, f"docs/strategy.rst never names {missing}"
