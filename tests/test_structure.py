"""The package's dependencies point one way: no import circles, and comm/ and daso/ stay free of Lightning."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hvd_plugins"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` runs (imports under ``if TYPE_CHECKING:`` do not run)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in ast.walk(node)
    }
    imported = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    return imported


def _graph() -> dict[str, set[str]]:
    """Module -> package modules it imports; a package exposing its own submodules is not an edge."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {
        name: {
            target
            for target in _runtime_imports(path)
            if target in modules
            and target != name
            and not target.startswith(name + ".")
            and not name.startswith(target + ".")
        }
        for name, path in modules.items()
    }


def test_the_package_has_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target] if target in path else [node, target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import circles: {cycles}"


def test_comm_and_daso_import_no_lightning() -> None:
    offenders = {
        _module_name(path): sorted(i for i in _runtime_imports(path) if i.split(".")[0] == "lightning")
        for folder in ("comm", "daso")
        for path in (PACKAGE / folder).rglob("*.py")
    }
    assert not {name: found for name, found in offenders.items() if found}


def test_one_module_touches_horovod_internals() -> None:
    users = sorted(
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if any(name in path.read_text() for name in ("_allreduce_delay", "_grad_accs", "._optimizer.zero_grad"))
    )
    assert users == ["hvd_plugins.horovod_adapter"]
