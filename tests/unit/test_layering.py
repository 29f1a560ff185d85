"""The package's layers, enforced: core < faces < monitoring callbacks, and one source for both Lightning packages.

- ``hvd_plugins.core`` imports no Lightning and no face; inside it ``backend`` (the only code that knows
  Horovod) imports nothing else of the core, ``comm`` (mechanism) only the backend, ``sync`` (the modes,
  policy) only those two, the config and the fault guards, and of the backend not Horovod's module: its bytes
  move through ``comm``.
- ``hvd_plugins.fabric`` (Fabric-level plugins) imports no Trainer code; ``hvd_plugins.pytorch`` may
  import it, and of its callbacks only the progress bar it installs by default.
- Faces name Lightning only as ``lightning.pytorch...``/``lightning.fabric...``, which the mirror rewrites.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from hvd_plugins.mirror import MIRRORS

PACKAGE = Path(__file__).resolve().parents[2] / "hvd_plugins"
LIGHTNING_ROOTS = {"lightning", "pytorch_lightning", "lightning_fabric"}
FACES = ("hvd_plugins.pytorch", "hvd_plugins.fabric", "hvd_plugins.pytorch_lightning", "hvd_plugins.lightning_fabric")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, type_checking: bool = False) -> set[str]:
    """Modules imported when ``path`` runs (imports under ``if TYPE_CHECKING:`` do not run, unless
    ``type_checking``: a type checker follows them too, and a circle through them is a circle all the same)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
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


GENERATED = tuple(PACKAGE / mirror for mirror in MIRRORS)
"""The faces generated from the others (hvd_plugins.mirror): their rules are their sources'."""
MODULES = {
    _module_name(path): path for path in PACKAGE.rglob("*.py") if not any(path.is_relative_to(g) for g in GENERATED)
}
IMPORTS = {name: _runtime_imports(path) for name, path in MODULES.items()}
ALL_IMPORTS = {name: _runtime_imports(path, type_checking=True) for name, path in MODULES.items()}


def _within(name: str, *prefixes: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _package_imports(name: str) -> set[str]:
    return {target for target in IMPORTS[name] if target.startswith("hvd_plugins")}


def _offenders(modules: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Modules under ``modules`` importing something under ``forbidden`` (unless it is under ``allowed``)."""
    found = {
        name: sorted(t for t in IMPORTS[name] if _within(t, *forbidden) and not _within(t, *allowed))
        for name in MODULES
        if _within(name, modules)
    }
    return {name: targets for name, targets in found.items() if targets}


def _graph() -> dict[str, set[str]]:
    """Module -> package modules it imports (under ``TYPE_CHECKING`` too); a package exposing its own submodules
    is not an edge."""
    return {
        name: {
            target
            for target in ALL_IMPORTS[name]
            if target in MODULES
            and target != name
            and not target.startswith(name + ".")
            and not name.startswith(target + ".")
        }
        for name in MODULES
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


def test_the_core_imports_no_lightning_and_no_face() -> None:
    assert not _offenders("hvd_plugins.core", (*LIGHTNING_ROOTS, *FACES, "hvd_plugins.callbacks", "hvd_plugins.mirror"))


def test_the_core_is_layered_backend_then_comm_then_sync() -> None:
    core = "hvd_plugins.core"
    assert not _offenders(f"{core}.backend", (core,), allowed=(f"{core}.backend",))
    assert not _offenders(f"{core}.comm", (core,), allowed=(f"{core}.backend", f"{core}.comm"))
    checkpoint = (f"{core}.backend", f"{core}.comm", f"{core}.checkpoint")  # DCP's layout: below every mode
    assert not _offenders(f"{core}.checkpoint", (core,), allowed=checkpoint)
    below_sync = (*checkpoint, f"{core}.sync", f"{core}.config", f"{core}.faults")
    assert not _offenders(f"{core}.sync", (core,), allowed=below_sync)


def test_sync_modes_move_bytes_through_comm() -> None:
    """A mode is policy: it reaches Horovod only through ``comm`` (its sums, ``comm.world``) and the backend's
    optimizer functions, never through Horovod's module itself."""
    assert not _offenders("hvd_plugins.core.sync", ("hvd_plugins.core.backend.module",))


def test_the_faces_know_no_sync_mode() -> None:
    """A strategy, its elastic fit and its checkpoints reach a mode only through ``GradientSync``'s hooks, the table
    that builds it, the guards around it, the parts format any mode may save, and the modes' settings; a callback
    made for one mode (``DasoScheduleCallback``) may read its records."""
    sync = "hvd_plugins.core.sync"
    shared = tuple(f"{sync}.{name}" for name in ("base", "guards", "table", "parts"))
    settings = tuple(name for name in MODULES if _within(name, sync) and name.endswith(".config"))
    for face in ("hvd_plugins.pytorch", "hvd_plugins.fabric"):
        offenders = {
            name: targets
            for name, targets in _offenders(face, (sync,), allowed=(*shared, *settings)).items()
            if not _within(name, f"{face}.callbacks")
        }
        assert not offenders, offenders


def test_a_sync_mode_knows_no_other_mode() -> None:
    """Only the table (config -> mode) names every mode; a mode may build on ``flat`` (Horovod's own route)."""
    modes = ("hvd_plugins.core.sync.flat", "hvd_plugins.core.sync.hierarchical", "hvd_plugins.core.sync.daso")
    for mode in modes:
        others = tuple(other for other in modes if other != mode and other != modes[0])
        assert not _offenders(mode, others), mode


def test_the_fabric_face_knows_no_trainer() -> None:
    assert not _offenders("hvd_plugins.fabric", ("lightning.pytorch", "hvd_plugins.pytorch"))


def test_the_trainer_face_installs_only_the_progress_bar_of_its_callbacks() -> None:
    callbacks = "hvd_plugins.pytorch.callbacks"
    bar = f"{callbacks}.progress"
    outside = {
        name: sorted(t for t in _package_imports(name) if _within(t, callbacks) and not _within(t, bar))
        for name in MODULES
        if _within(name, "hvd_plugins.pytorch") and not _within(name, callbacks) and name != "hvd_plugins.pytorch"
    }
    assert not {name: found for name, found in outside.items() if found}


def test_faces_name_lightning_only_in_forms_the_mirror_rewrites() -> None:
    """``import lightning`` or ``from lightning import pytorch`` would bind the mirror's twin to the wrong package."""
    for name in MODULES:
        if not _within(name, "hvd_plugins.pytorch", "hvd_plugins.fabric"):
            continue
        roots = {target for target in IMPORTS[name] if target.split(".")[0] in LIGHTNING_ROOTS}
        bad = {
            t
            for t in roots
            if t.split(".")[0] != "lightning" or not _within(t, "lightning.pytorch", "lightning.fabric")
        }
        assert not bad, f"{name} imports {sorted(bad)}"


def test_only_the_backend_imports_horovod() -> None:
    users = _offenders("hvd_plugins", ("horovod",))
    assert users and all(_within(name, "hvd_plugins.core.backend", "hvd_plugins.testing") for name in users), users


def test_one_module_touches_horovod_internals() -> None:
    users = sorted(
        name
        for name, path in MODULES.items()
        if any(marker in path.read_text() for marker in ("_allreduce_delay", "_grad_accs", "._optimizer.zero_grad"))
    )
    assert users == ["hvd_plugins.core.backend.optimizer"]


@pytest.mark.parametrize(("face", "twin", "lightning"), [("pytorch", "pytorch_lightning", "pytorch_lightning")])
def test_every_module_of_a_face_has_a_twin_bound_to_the_other_package(face: str, twin: str, lightning: str) -> None:
    """Each module of ``hvd_plugins.<face>`` has a generated file in ``hvd_plugins.<twin>``, on the other classes."""

    pl = importlib.import_module(lightning)
    source = importlib.import_module(f"hvd_plugins.{face}")
    names = [info.name for info in pkgutil.walk_packages(source.__path__, prefix=f"hvd_plugins.{face}.")]
    assert names
    for name in names:
        mirrored = importlib.import_module(name.replace(f"hvd_plugins.{face}", f"hvd_plugins.{twin}", 1))
        source_file = Path(inspect.getfile(importlib.import_module(name))).relative_to(PACKAGE / face)
        assert Path(inspect.getfile(mirrored)) == PACKAGE / twin / source_file
    strategy = importlib.import_module(f"hvd_plugins.{twin}").HorovodStrategy
    assert issubclass(strategy, pl.strategies.ParallelStrategy)
    assert strategy is not source.HorovodStrategy


def test_the_strategy_wires_sync_modes_without_branching_on_them() -> None:
    """Every sync mode offers the same hooks; HorovodStrategy never asks which one runs."""
    path = MODULES["hvd_plugins.pytorch.strategies.horovod"]
    (strategy,) = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]
    assert strategy.end_lineno - strategy.lineno + 1 < 300
    mode_words = ("sync ==", "daso", "hierarchical", "route", "Daso", "Hierarchical", "node_aware")
    branches = [ast.unparse(n.test) for n in ast.walk(strategy) if isinstance(n, (ast.If, ast.IfExp))]
    assert not [test for test in branches if any(word in test for word in mode_words)], branches
