"""The package's layering, read from its source with ``ast`` (nothing is imported):

1. a module uses only the public names of another ``vision_ckpt`` module: no
   ``from .x import _y`` and no ``x._y`` on a module ``x`` of the package (private *modules*,
   such as ``runtime._core``, are fine: their public names are their interface);
2. imports point down: subpackages in the order of :data:`SUBPACKAGES` (a module may import
   only from its own subpackage or one below it), and inside a subpackage down the layers of
   :data:`LAYERS`. A module missing from them fails, so a new module gets a place.

Each subpackage's ``__init__`` says what it owns and what it may import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vision_ckpt"

# Lower first. The base modules have no subpackage; the package's own __init__ is its face and
# may import anything (it is not checked).
SUBPACKAGES: list[str] = [
    "",  # errors, _version, _torch_floor, _compat: torch and the standard library only
    "config",  # levels, matching, the schema, presets, the fallback
    "runtime",  # the checkpoint core, keep policies, lean MLPs, the wrapper
    "regions",  # plan / apply / remove and the forwards they install
    "measure",  # bytes, steps, extrapolation, prices, where a step peaks, model specs
    "tune",  # profile, suggest, the budget planner, fit, derive
    "integrations",  # trainers and model libraries
    "cli",  # the only code that prints or exits
]

# Inside each subpackage, lower first (a subpackage's __init__ sits above its modules).
LAYERS: list[set[str]] = [
    {"errors", "_version", "_torch_floor", "_compat"},
    {"config.levels", "config.matching", "config._messages"},
    {"config.schema"},
    {"config._fallback", "config._features"},
    {"config.presets"},
    {"config"},
    {"runtime._call_state", "runtime._saved_inputs", "runtime._lean"},
    {"runtime._frame"},
    {"runtime._core", "runtime._chain"},
    {"runtime._traced"},
    {"runtime._selective"},
    {"runtime.wrapper"},
    {"runtime"},
    {"regions._install", "regions._plan_record"},
    {"regions._planning"},
    {"regions.apply"},
    {"regions"},
    {"measure._memory", "measure.models", "measure._fake"},
    {"measure._record"},
    {"measure._measure"},
    {"measure._extrapolate", "measure._price", "measure.peak"},
    {"measure"},
    {"tune._optimise", "tune._spans"},
    {"tune._search"},
    {"tune._blocks", "tune._budget_plan"},
    {"tune._menus"},
    {"tune._planner"},
    {"tune.profiling", "tune.fit"},
    {"tune._candidates", "tune._derived"},
    {"tune._derived_rules", "tune._level_search"},
    {"tune._level_measure"},
    {"tune.derive"},
    {"tune"},
    {"integrations.lightning", "integrations.hf"},
    {"integrations"},
    {"cli._inputs"},
    {"cli._measuring", "cli._budget"},
    {"cli.main"},
    {"cli"},
    {"__main__"},
]
RANK = {module: rank for rank, layer in enumerate(LAYERS) for module in layer}


def _module_name(path: Path) -> str:
    """``runtime._core`` for vision_ckpt/runtime/_core.py, ``runtime`` for its ``__init__``,
    ``errors`` for vision_ckpt/errors.py, ``__init__`` for the package's own."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _subpackage(module: str) -> str:
    if module == "__main__":  # ``python -m vision_ckpt`` runs the command line
        return "cli"
    return module.split(".")[0] if "." in module or module in SUBPACKAGES else ""


def _package_of(module: str, path: Path) -> list[str]:
    """The package a module's relative imports start from."""
    parts = module.split(".") if module != "__init__" else []
    return parts if path.name == "__init__.py" else parts[:-1]


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {
        _module_name(path): (path, ast.parse(path.read_text(), filename=str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _resolve(
    node: ast.ImportFrom, alias: ast.alias, package: list[str], known: set[str]
) -> str | None:
    """The package module an import reads from (``x`` of ``from .x import y``; ``x`` itself for
    ``from . import x`` when ``x`` is a module), or ``None`` outside the package."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        if parts[0] != "vision_ckpt":
            return None
        base = parts[1:]
    else:
        base = package[: len(package) - (node.level - 1)] if node.level > 1 else list(package)
        base = base + (node.module.split(".") if node.module else [])
    submodule = ".".join([*base, alias.name])
    if submodule in known:
        return submodule
    return ".".join(base) if base else "__init__"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_imports(
    module: str, path: Path, tree: ast.Module, known: set[str]
) -> Iterator[tuple[str, int]]:
    """(package module, line) for every import of a package module, at any depth."""
    package = _package_of(module, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                target = _resolve(node, alias, package, known)
                if target is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "vision_ckpt" and len(parts) > 1:
                    yield ".".join(parts[1:]), node.lineno


def _private_uses(
    module: str, path: Path, tree: ast.Module, known: set[str]
) -> Iterator[tuple[str, int]]:
    """("module.name", line) for every private name of another package module used here."""
    package = _package_of(module, path)
    bound: dict[str, str] = {}  # local name -> package module it refers to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                source = _resolve(node, alias, package, known)
                if source is None:
                    continue
                if source.split(".")[-1] == alias.name and source in known:
                    bound[alias.asname or alias.name] = source  # from . import x: a module
                    continue
                if source != module and _is_private(alias.name):
                    yield f"{source}.{alias.name}", node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "vision_ckpt" and len(parts) > 1 and alias.asname:
                    bound[alias.asname] = ".".join(parts[1:])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            value = node.value
            if isinstance(value, ast.Name) and value.id in bound:
                source = bound[value.id]
                if source != module:
                    yield f"{source}.{node.attr}", node.lineno


def test_scanner_resolves_relative_imports_and_sees_private_uses() -> None:
    source = """
from ._core import _region_label, checkpoint
from . import wrapper as w
from ..config import presets as p
from ..regions.apply import _installed
import vision_ckpt.runtime._core as core
p._registered
w.training_level
core._state
"""
    known = {"runtime._core", "runtime.wrapper", "config.presets", "regions.apply"}
    path = PACKAGE / "runtime" / "here.py"
    tree = ast.parse(source)
    uses = {used for used, _ in _private_uses("runtime.here", path, tree, known)}
    assert uses == {
        "runtime._core._region_label",
        "regions.apply._installed",
        "config.presets._registered",
        "runtime._core._state",
    }
    imports = {target for target, _ in _package_imports("runtime.here", path, tree, known)}
    assert imports == known


def test_modules_use_only_public_names_of_each_other() -> None:
    trees = _modules()
    found = {
        f"{m}:{line} uses {used}"
        for m, (path, tree) in trees.items()
        for used, line in _private_uses(m, path, tree, set(trees))
    }
    assert not found, (
        "a module imports another module's private name; make the name public (drop the "
        "underscore, add it to __all__) or move the code:\n" + "\n".join(sorted(found))
    )


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_point_down_the_layers(module: str) -> None:
    if module == "__init__":
        return
    trees = _modules()
    assert module in RANK, f"vision_ckpt module {module} has no layer: add it to LAYERS"
    path, tree = trees[module]
    imports = [(t, line) for t, line in _package_imports(module, path, tree, set(trees))]
    unknown = [t for t, _ in imports if t not in RANK and t != "__init__"]
    assert not unknown, f"{module} imports modules that have no layer: {unknown}"
    mine = SUBPACKAGES.index(_subpackage(module))
    wrong = [
        f"line {line}: {module} imports {t}"
        for t, line in imports
        if t != module
        and (t == "__init__" or SUBPACKAGES.index(_subpackage(t)) > mine or RANK[t] >= RANK[module])
    ]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)
