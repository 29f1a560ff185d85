"""The documentation's pages and their Python snippets, shared by the tests that read and run them.

Python snippets: every ``.. code-block:: python`` of README.rst and of each page in docs/. A snippet
whose first line is ``# continues the example above ...`` runs in the namespace of the runnable
snippet before it on the same page; one whose first line is ``# needs horovodrun ...``,
``# needs torchrun ...``, ``# needs a GPU ...``, ``# needs a Ray cluster ...`` or ``# needs its own script ...``
is only compiled
(tests/unit/docs), not run (tests/test_docs.py).
"""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.rst", *sorted(DOCS.glob("*.rst"))]
MARKERS_NOT_RUN = r"# needs (horovodrun|torchrun|a GPU|a Ray cluster|its own script)"


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


def strategy_classes() -> list[tuple[str, type]]:
    """Both ``HorovodStrategy`` classes (the Trainer's and Fabric's), by the name the API page gives them."""
    from hvd_plugins.fabric import HorovodStrategy as FabricStrategy
    from hvd_plugins.pytorch import HorovodStrategy as TrainerStrategy

    return [("hvd_plugins.HorovodStrategy", TrainerStrategy), ("hvd_plugins.fabric.HorovodStrategy", FabricStrategy)]


def argument_names(strategy: type) -> list[str]:
    """The arguments of ``strategy``'s constructor, in order."""
    return [name for name in inspect.signature(strategy.__init__).parameters if name != "self"]
