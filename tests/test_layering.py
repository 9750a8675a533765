"""The package's layering, read from its source with ``ast`` (nothing is imported):

1. a module uses only the public names of another ``vision_ckpt`` module: no
   ``from .x import _y`` and no ``x._y`` on a module ``x`` of the package (private *modules*,
   such as ``_core``, are fine: their public names are their interface);
2. imports point down the layers in :data:`LAYERS`, the real dependency graph (README,
   "Development"); a module missing from it fails, so a new module gets a place.

There are no exceptions: the install layer and the public ``_core.region_label`` /
``region_depth`` and ``errors.internal_assert`` removed the last ones.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vision_ckpt"

# Lower layers first; a module may import only modules of lower layers. (__init__ is the
# package's face and may import anything; it is not in the table.)
LAYERS: list[set[str]] = [
    {"errors", "_version", "_torch_floor", "_compat"},  # _compat: torch only
    {"levels", "matching", "_memory", "_optimise", "models"},  # levels, matching, models ->
    # errors; _optimise: none
    {"_core", "_lean", "config"},  # _core -> errors; _lean: torch only; config -> errors, levels,
    # matching (no torch)
    {"_selective", "_fallback", "_features"},  # the selective operator policy -> _core; the
    # structural fallback and timm feature wrappers -> config, matching, levels
    {"wrapper", "presets"},  # wrapper -> _core, levels; presets -> config, matching
    {"_install"},  # the install layer of issue 9: what apply puts on a model and takes off
    {"apply"},  # -> wrapper, presets, config, matching
    {"_measure"},  # one training step -> apply, _memory
    {"_extrapolate", "_spans", "_price"},  # a larger batch's peak; a model's candidate spans;
    # the modelled price of operators -> _measure, _selective
    {"_search"},  # uniform levels -> _extrapolate, _measure, wrapper
    {"_planner"},  # per-block plans -> _search, _extrapolate, _measure, apply, _memory
    {"profile", "fit", "peak"},  # the public faces of the four above; fit -> models, _planner;
    # peak -> apply, _measure
    {"derive"},  # levels derived by measurement (issue 26) -> _planner, _spans, peak
    {"integrations", "integrations.lightning", "integrations.hf"},  # trainers, model libraries
    {"cli"},  # the only code that prints or exits
    {"__main__"},
]
RANK = {module: rank for rank, layer in enumerate(LAYERS) for module in layer}


def _module_name(path: Path) -> str:
    """``apply`` for vision_ckpt/apply.py, ``integrations.hf`` for a module of a subpackage,
    ``integrations`` for the subpackage's ``__init__``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {
        _module_name(path): ast.parse(path.read_text(), filename=str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _imported_module(node: ast.ImportFrom, alias: ast.alias | None = None) -> str | None:
    """The package module an import names (``from .x import y`` -> ``x``; ``from . import x``
    -> ``x``), or ``None`` for an import from outside the package."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        if parts[0] != "vision_ckpt":
            return None
        parts = parts[1:]
    elif node.level in (1, 2):  # level 2 only occurs in a subpackage: from ..apply import x
        parts = node.module.split(".") if node.module else []
    else:
        return None
    if parts:
        return parts[0]
    return alias.name if alias is not None else None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_imports(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(package module, line) for every import of a package module, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                module = _imported_module(node, alias)
                if module is not None:
                    yield module, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "vision_ckpt" and len(parts) > 1:
                    yield parts[1], node.lineno


def _private_uses(name: str, tree: ast.Module, modules: set[str]) -> Iterator[tuple[str, int]]:
    """("module.name", line) for every private name of another package module used here."""
    bound: dict[str, str] = {}  # local name -> package module it refers to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                source = _imported_module(node, alias)
                if source is None:
                    continue
                if node.module is None or (node.level == 0 and node.module == "vision_ckpt"):
                    if alias.name in modules:  # from . import x: x is a module
                        bound[alias.asname or alias.name] = alias.name
                        continue
                if source != name and _is_private(alias.name):
                    yield f"{source}.{alias.name}", node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "vision_ckpt" and len(parts) == 2 and alias.asname:
                    bound[alias.asname] = parts[1]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in bound:
            source = bound[value.id]
        elif (
            isinstance(value, ast.Attribute)
            and isinstance(value.value, ast.Name)
            and value.value.id == "vision_ckpt"
            and value.attr in modules
        ):
            source = value.attr
        else:
            continue
        if source != name:
            yield f"{source}.{node.attr}", node.lineno


def _violations() -> dict[tuple[str, str], int]:
    trees = _modules()
    found: dict[tuple[str, str], int] = {}
    for name, tree in trees.items():
        for used, line in _private_uses(name, tree, set(trees)):
            found.setdefault((name, used), line)
    return found


def test_scanner_sees_each_kind_of_private_use() -> None:
    source = """
from ._core import _region_label, checkpoint
from . import presets as p, wrapper
from vision_ckpt.apply import _installed
import vision_ckpt._core as core
import vision_ckpt
p._registered
wrapper.training_level
core._state
vision_ckpt.levels._table
own._private
"""
    modules = {"_core", "presets", "wrapper", "apply", "levels", "here"}
    uses = {used for used, _ in _private_uses("here", ast.parse(source), modules)}
    assert uses == {
        "_core._region_label",
        "apply._installed",
        "presets._registered",
        "_core._state",
        "levels._table",
    }


def test_modules_use_only_public_names_of_each_other() -> None:
    found = _violations()
    new = {f"vision_ckpt/{m}.py:{line} uses {used}" for (m, used), line in found.items()}
    assert not new, (
        "a module imports another module's private name; make the name public (drop the "
        "underscore, add it to __all__) or move the code:\n" + "\n".join(sorted(new))
    )


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_point_down_the_layers(module: str) -> None:
    if module == "__init__":
        return
    assert module in RANK, f"vision_ckpt/{module}.py has no layer: add it to LAYERS"
    tree = _modules()[module]
    upward = [
        f"line {line}: {module} (layer {RANK[module]}) imports {target} (layer {RANK[target]})"
        for target, line in _package_imports(tree)
        if target != module and target in RANK and RANK[target] >= RANK[module]
    ]
    unknown = [target for target, _ in _package_imports(tree) if target not in RANK]
    assert not unknown, f"{module} imports modules that have no layer: {unknown}"
    assert not upward, "imports against the layering:\n" + "\n".join(upward)
