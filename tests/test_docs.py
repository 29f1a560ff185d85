"""The documentation stays true: README.rst and docs/*.rst run, the site builds, the API page is complete.

The runnable Python snippets (tests/doc_pages.py; tests/unit/docs compiles every one) run in one
plain python process (tests/workers/doc_snippets.py), page after page, in order, each from a fresh
start unless its first line is ``# continues the example above ...``, in which case it runs in the
namespace of the runnable snippet before it on the same page. A snippet whose first line is
``# needs horovodrun ...``, ``# needs torchrun ...``, ``# needs a GPU ...``, ``# needs a Ray cluster ...`` or
``# needs its own script ...`` is not run here:
one process without a launcher or a GPU cannot show what it claims, and a script that starts its
workers by running itself again cannot be run by this runner. Every other snippet runs as one
process (a job of one worker), which is what ``python train.py`` gives a user; the
``# needs its own script`` snippet runs as ``train.py`` in tests/test_launcher.py.

The Sphinx site builds with ``sphinx-build -W --keep-going -b html docs <tmp>`` (a warning fails),
and its API page describes every argument of both ``HorovodStrategy`` classes (the Trainer's and
Fabric's).
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from doc_pages import DOCS, REPO, RUNNABLE, Snippet, argument_names, strategy_classes
from hvd_launch import run_single


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


# ---------------------------------------------------------------------------------------------- the site


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
    strategy = dict(strategy_classes())[anchor]
    description = _object_description((site / "api.html").read_text(encoding="utf-8"), anchor)
    described = set(re.findall(r"<strong>(\w+)</strong>", html.unescape(description)))
    arguments = argument_names(strategy)
    assert len(arguments) >= 14
    missing = [name for name in arguments if name not in described]
    assert not missing, f"{anchor}: arguments without a description on the API page: {missing}"


def test_attribute_docstrings_read_as_sentences(site: Path) -> None:
    """napoleon takes ``words: text`` on the first line of an attribute's docstring for its type."""
    api = (site / "api.html").read_text(encoding="utf-8")
    found = api.find('>Type<span class="colon">')
    before = re.sub(r"<[^>]+>", " ", api[max(0, found - 1500) : found])
    assert found < 0, f"a docstring's first line was read as a type; use no colon there: ...{before[-300:]}"
