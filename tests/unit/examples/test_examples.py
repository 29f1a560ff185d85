"""The examples read as text: each shows its Trainer (or Fabric) and HorovodStrategy and states its own flags."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SCRIPTS = sorted(path for path in EXAMPLES.glob("*.py") if path.name != "cli.py")
"""The examples that build their Trainer or Fabric themselves; cli.py leaves it to LightningCLI and config.yaml."""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_each_example_builds_its_trainer_and_strategy_in_view(script: Path) -> None:
    source = script.read_text()
    assert "Trainer(" in source or "Fabric(" in source, script.name
    assert "HorovodStrategy(" in source or re.search(r"""strategy=["']horovod\w*["']""", source), script.name


def test_the_cli_example_takes_the_strategy_from_its_config() -> None:
    assert "LightningCLI" in (EXAMPLES / "cli.py").read_text()
    assert "class_path: hvd_plugins.pytorch.HorovodStrategy" in (EXAMPLES / "config.yaml").read_text()


def test_no_example_shares_flags_or_training_code() -> None:
    """Flags are declared where they are used: at a script's top level (or its ``__main__`` block), never in a
    function another file could call; one example may import only another's LightningModule/DataModule classes."""
    trees = {path.stem: ast.parse(path.read_text()) for path in EXAMPLES.glob("*.py")}
    assert "common" not in trees
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {alias.name for alias in node.names} & set(trees), f"{name}.py imports an example"
            if isinstance(node, ast.ImportFrom) and node.module in trees:
                classes = {item.name for item in trees[node.module].body if isinstance(item, ast.ClassDef)}
                imported = {alias.name for alias in node.names}
                assert imported <= classes, f"{name}.py imports {imported - classes} from {node.module}.py"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                flag_calls = [
                    call.func.attr
                    for call in ast.walk(node)
                    if isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("add_argument", "add_argument_group", "add_mutually_exclusive_group")
                ]
                assert not flag_calls, f"{name}.py declares flags inside a function (line {node.lineno})"
