"""Lightning's private names behind one module: each one still where Lightning keeps it, and no other module
touching one.

A Lightning release that renames or moves a private name the package relies on fails
``test_each_private_name_is_still_there`` with that name, for ``lightning`` or for the standalone
``pytorch_lightning``/``lightning_fabric`` (whose internals module the mirror generates).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hvd_plugins.fabric import lightning_internals
from hvd_plugins.lightning_fabric import lightning_internals as standalone_internals
from hvd_plugins.mirror import MIRRORS

PACKAGE = Path(__file__).resolve().parents[3] / "hvd_plugins"
LIGHTNING_ROOTS = ("lightning", "pytorch_lightning", "lightning_fabric")
INTERNALS = (lightning_internals, standalone_internals)
"""The module for ``lightning`` and its twin for the standalone packages."""
DOORS = {Path(module.__file__).resolve() for module in INTERNALS if module.__file__}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _lightning_root(module: str) -> bool:
    return module.split(".")[0] in LIGHTNING_ROOTS


def _resolve(module: str, dotted: str) -> tuple[Any, str]:
    """The object owning the last part of ``dotted`` in ``module``, and that part's name."""
    owner: Any = importlib.import_module(module)
    *path, name = dotted.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _lightning_classes(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if _lightning_root(base.__module__)]


def _uses_on_self(cls: type) -> set[str]:
    """Private names a class's own source reads or writes on ``self``."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return set()
    return {name for name in re.findall(r"\bself\.(_\w+)", source) if _private(name)}


# ---------------------------------------------------------------------------- the names are still there
ENTRIES = [(internals, entry) for internals in INTERNALS for entry in internals.TOUCHED]


@pytest.mark.parametrize(("internals", "entry"), ENTRIES, ids=[f"{e.module}:{e.name}" for _, e in ENTRIES])
def test_each_private_name_is_still_there(internals: ModuleType, entry: Any) -> None:
    owner, name = _resolve(entry.module, entry.name)
    if entry.how == "defined":
        assert hasattr(owner, name), f"{entry.module} no longer has {entry.name} ({entry.why})"
    elif entry.how == "hook":
        assert callable(getattr(owner, name, None)), f"{entry.module} no longer has the hook {entry.name}"
    elif entry.how == "set on instances":
        assert any(name in _uses_on_self(cls) for cls in owner.__mro__), (
            f"no class of {entry.module}.{owner.__name__}'s MRO sets self.{name} any more ({entry.why})"
        )
    else:
        assert re.search(rf"\.{name}\(", inspect.getsource(owner)), f"{owner.__name__} no longer calls {name}()"


def test_the_table_names_only_private_names_of_its_own_lightning_package() -> None:
    for internals in INTERNALS:
        roots = {entry.module.split(".")[0] for entry in internals.TOUCHED}
        expected = {"lightning"} if internals is lightning_internals else {"pytorch_lightning", "lightning_fabric"}
        assert roots == expected
        assert all(any(_private(part) for part in entry.name.split(".")) for entry in internals.TOUCHED)


@pytest.mark.parametrize(
    ("internals", "trainer"), [(lightning_internals, "lightning.pytorch"), (standalone_internals, "pytorch_lightning")]
)
def test_the_trainer_classes_load_when_first_asked_for(internals: ModuleType, trainer: str) -> None:
    launcher = importlib.import_module(f"{trainer}.strategies.launchers.launcher")
    connector = importlib.import_module(f"{trainer}.trainer.connectors.accelerator_connector")
    assert internals.TrainerLauncher is launcher._Launcher
    assert internals.TrainerConnector is connector._AcceleratorConnector
    with pytest.raises(AttributeError, match="Trainer"):
        internals.Trainer  # noqa: B018  (only the Trainer's private classes load this way)


@pytest.mark.parametrize(
    ("internals", "trainer"), [(INTERNALS[0], "lightning.pytorch"), (INTERNALS[1], "pytorch_lightning")]
)
def test_the_model_summary_counts_each_parameter_as_it_is_told(internals: ModuleType, trainer: str) -> None:
    """As under shard="parameters", where each parameter holds a shard and the count must be the whole's."""
    pl = importlib.import_module(trainer)
    demo = importlib.import_module(f"{trainer}.demos.boring_classes")
    module = demo.BoringModel()
    summary = pl.callbacks.ModelSummary(max_depth=2)
    fit = pl.Trainer(accelerator="cpu", devices=1, callbacks=[summary], logger=False, enable_progress_bar=False)
    plain = summary._summary(fit, module)
    internals.count_summaries_with(fit, lambda parameter: 3 * parameter.numel())
    internals.count_summaries_with(fit, lambda parameter: 3 * parameter.numel())  # once is enough
    counted = summary._summary(fit, module)
    assert counted.total_parameters == 3 * plain.total_parameters > 0
    assert counted.trainable_parameters == 3 * plain.trainable_parameters
    assert counted.param_nums == [3 * count for count in plain.param_nums]
    assert counted.model_size == pytest.approx(3 * plain.model_size)


@pytest.mark.parametrize("trainer", ["lightning.pytorch", "pytorch_lightning"])
def test_a_fit_resumes_from_the_commit_through_the_ckpt_path_of_fit_impl(trainer: str) -> None:
    fit = importlib.import_module(trainer).Trainer._fit_impl
    assert "ckpt_path" in inspect.signature(fit).parameters
    args, kwargs = lightning_internals.fit_arguments_resuming_commit(fit, ("trainer", "model", "data"), {})
    bound = inspect.signature(fit).bind(*args, **kwargs)
    assert lightning_internals.names_the_commit(bound.arguments["ckpt_path"])
    assert bound.arguments["train_dataloaders"] == "data"
    assert not lightning_internals.names_the_commit("epoch=3.ckpt")


def test_the_cluster_environment_choice_is_wrapped_once_and_leaves_the_rest_to_lightning() -> None:
    class Connector:
        def __init__(self, strategy: str) -> None:
            self._strategy_flag, self._cluster_environment_flag = strategy, None

        def _choose_and_init_cluster_environment(self) -> Any:
            return "lightning's choice"

    choices: list[tuple[Any, Any]] = []

    def choose(strategy: Any, environment: Any) -> Any:
        choices.append((strategy, environment))
        return "ours" if strategy == "horovod" else None

    lightning_internals.override_cluster_environment_choice(Connector, choose)
    lightning_internals.override_cluster_environment_choice(Connector, lambda *_: "a second wrapper")
    assert Connector("horovod")._choose_and_init_cluster_environment() == "ours"
    assert Connector("ddp")._choose_and_init_cluster_environment() == "lightning's choice"
    assert choices == [("horovod", None), ("ddp", None)]


# ---------------------------------------------------------------------------- no other module touches one
def _package_files() -> list[Path]:
    generated = tuple(PACKAGE / mirror for mirror in MIRRORS)
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if not any(path.is_relative_to(g) for g in generated) and path.resolve() not in DOORS
    )


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private_imports(tree: ast.AST) -> list[str]:
    """``from lightning... import _x`` and imports of a private Lightning module, type-checking ones included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and _lightning_root(node.module):
            names = [alias.name for alias in node.names]
            found += [f"{node.module}.{name}" for name in names if _private(name)]
            found += [node.module] if any(_private(part) for part in node.module.split(".")) else []
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if _lightning_root(a.name) and any(map(_private, a.name.split(".")))]
    return found


def _imports_lightning(tree: ast.AST) -> bool:
    return any(
        (isinstance(node, ast.ImportFrom) and node.module and _lightning_root(node.module))
        or (isinstance(node, ast.Import) and any(_lightning_root(alias.name) for alias in node.names))
        for node in ast.walk(tree)
    )


def _private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """``obj._x`` on anything but ``self``/``cls``, and ``getattr``-style calls with a private name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                    found.append((node.lineno, name.value))
    return found


HOOKS = ("hook", "called by name")
"""Entries a class here may define as methods (the rest it reaches through the internals module only)."""
TOUCHED_NAMES = {entry.name.split(".")[-1] for entry in lightning_internals.TOUCHED}
"""Lightning's private names the package relies on: a module that imports no Lightning may not name them either."""


def test_no_other_module_touches_a_lightning_private_name() -> None:
    """Modules that import Lightning reach no private attribute of another object at all; the others (the core)
    none that the table names. Imports of private Lightning names or modules are refused everywhere."""
    offenders = []
    for path in _package_files():
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE.parent)
        offenders += [f"{where}: imports {name}" for name in _private_imports(tree)]
        strict = _imports_lightning(tree)
        offenders += [
            f"{where}:{line}: ._{name[1:]}" for line, name in _private_reaches(tree) if strict or name in TOUCHED_NAMES
        ]
    assert not offenders, "use hvd_plugins.fabric.lightning_internals instead:\n" + "\n".join(offenders)


def _strategy_classes() -> list[type]:
    """The package's classes (outside the internals module) that subclass a Lightning class."""
    found = []
    for path in _package_files():
        name = _module_name(path)
        if not name.startswith(("hvd_plugins.pytorch", "hvd_plugins.fabric")):
            continue
        module = importlib.import_module(name)
        found += [
            value
            for value in vars(module).values()
            if inspect.isclass(value) and value.__module__ == name and _lightning_classes(value)
        ]
    return found


def test_no_class_reaches_a_private_attribute_lightning_gives_it() -> None:
    """On ``self`` too: a private slot of a Lightning base (``self._launcher``) goes through the internals module,
    and a private hook of one that a class defines (``_configure_launcher``) is listed in ``TOUCHED``."""
    classes = _strategy_classes()
    assert len(classes) > 5
    hooks = {entry.name.split(".")[-1] for entry in lightning_internals.TOUCHED if entry.how in HOOKS}
    offenders = []
    for cls in classes:
        lightning = set().union(
            *(_uses_on_self(base) | set(filter(_private, vars(base))) for base in _lightning_classes(cls))
        )
        for own in (base for base in cls.__mro__ if base.__module__.startswith("hvd_plugins.")):
            tree = ast.parse(textwrap.dedent(inspect.getsource(own)))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and node.name in lightning and node.name not in hooks:
                    offenders.append(f"{own.__qualname__}.{node.name} overrides a private hook not in TOUCHED")
                elif (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and node.attr in lightning
                    and node.attr not in hooks
                ):
                    offenders.append(f"{own.__qualname__}: self.{node.attr} is {cls.__name__}'s Lightning base's")
    assert not sorted(set(offenders)), "\n".join(sorted(set(offenders)))
