"""The public surface: every exported name exists and is documented, the modules carry >>>
examples (pytest runs them), the package imports torch only when needed, and the torch floor."""

from __future__ import annotations

import ast
import doctest
import importlib
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import vision_ckpt
import vision_ckpt.config.presets
import vision_ckpt.errors
import vision_ckpt.measure
import vision_ckpt.regions
import vision_ckpt.runtime
import vision_ckpt.tune
from vision_ckpt import _torch_floor

# The public namespaces below the top level: each lists in ``__all__`` what lives in it
# (``regions.apply`` is a module: the package ``regions`` cannot export a function ``apply``).
_SUBPACKAGES = [
    "vision_ckpt.config",
    "vision_ckpt.config.presets",
    "vision_ckpt.runtime",
    "vision_ckpt.regions",
    "vision_ckpt.regions.apply",
    "vision_ckpt.errors",
    "vision_ckpt.measure",
    "vision_ckpt.tune",
]
_PUBLIC = [
    *(("vision_ckpt", n) for n in vision_ckpt.__all__),
    *((p, n) for p in _SUBPACKAGES for n in importlib.import_module(p).__all__),
]


@pytest.mark.parametrize(("package", "name"), _PUBLIC, ids=[f"{p}.{n}" for p, n in _PUBLIC])
def test_every_exported_name_exists_and_is_documented(package: str, name: str) -> None:
    obj = getattr(importlib.import_module(package), name)
    if name != "__version__":
        assert (obj.__doc__ or "").strip(), f"{package}.{name} has no docstring"


def test_the_top_level_is_the_missions_api() -> None:
    """The wrapper, the training level, configs and rules, plan/apply/remove, presets, the
    checkpoint function and errors; the tuning tools live in ``vision_ckpt.tune``."""
    assert len(vision_ckpt.__all__) <= 20
    assert not set(vision_ckpt.tune.__all__) & set(vision_ckpt.__all__)
    assert not set(vision_ckpt.measure.__all__) & set(vision_ckpt.__all__)


def test_every_top_level_name_lives_in_a_public_subpackage() -> None:
    """The top level re-exports; each name is public, as the same object, where it lives."""
    homes = {
        name: package
        for package in _SUBPACKAGES
        for name in importlib.import_module(package).__all__
    }
    for name in set(vision_ckpt.__all__) - {"__version__"}:
        assert name in homes, f"vision_ckpt.{name} is public in no subpackage"
        assert getattr(vision_ckpt, name) is getattr(importlib.import_module(homes[name]), name)


@pytest.mark.parametrize("name", sorted(vision_ckpt._MOVED))
def test_a_name_that_left_the_top_level_is_public_where_it_went(name: str) -> None:
    home = vision_ckpt._MOVED[name]
    assert name in importlib.import_module(home).__all__
    assert name not in vision_ckpt.__all__
    with pytest.raises(AttributeError, match=f"moved to {home}"):
        getattr(vision_ckpt, name)


def test_presets_are_listed_from_the_package() -> None:
    names = vision_ckpt.list_presets()
    assert {"vit", "swin", "convnext", "resnet", "densenet", "efficientnet"} <= set(names)
    assert vision_ckpt.list_presets("tv_*") == ["tv_densenet", "tv_resnet", "tv_swin", "tv_vit"]


# --- docstring examples: pytest runs them (--doctest-modules); this checks they are there ----


@pytest.mark.parametrize(
    "module",
    [
        "vision_ckpt.runtime._core",
        "vision_ckpt.measure._memory",
        "vision_ckpt.measure._record",
        "vision_ckpt.regions.apply",
        "vision_ckpt.config.schema",
        "vision_ckpt.tune.fit",
        "vision_ckpt.config.levels",
        "vision_ckpt.config.matching",
        "vision_ckpt.measure.models",
        "vision_ckpt.config.presets",
        "vision_ckpt.tune.profiling",
        "vision_ckpt.runtime.wrapper",
    ],
)
def test_public_modules_have_docstring_examples(module: str) -> None:
    """Every public module documents itself with >>> examples (the façade ``profile`` through
    the functions it re-exports)."""
    mod = importlib.import_module(module)
    named = [(module, mod)] + [(name, getattr(mod, name)) for name in getattr(mod, "__all__", ())]
    finder = doctest.DocTestFinder(recurse=False)
    examples = sum(
        len(test.examples)
        for name, obj in named
        if isinstance(obj, (types.ModuleType, type, types.FunctionType))
        for test in finder.find(obj, name, module=False)
    )
    assert examples > 0, f"{module} has no >>> example in its docstrings"


def test_pytest_runs_the_package_doctests(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.getoption("doctestmodules"), "run with --doctest-modules (pyproject.toml)"
    assert "vision_ckpt" in pytestconfig.getini("testpaths")


# --- the lazy package: importing it does not import torch --------------------------------------


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_config_is_usable_without_importing_torch() -> None:
    out = _run(
        """
        import sys
        import vision_ckpt.config as config
        cfg = config.CheckpointConfig.model_validate({"rules": [{"match": "blocks.*", "level": 3}]})
        print(cfg.rules[0].level, "torch" in sys.modules)
        """
    )
    assert out.split() == ["3", "False"]


def test_every_exported_name_imports_in_a_fresh_interpreter() -> None:
    """``from vision_ckpt import X`` and ``dir()`` for every name, and the functions ``apply``
    and ``tune.profile`` stay functions when their modules are imported first."""
    out = _run(
        """
        import importlib, types
        import vision_ckpt.regions.apply, vision_ckpt.tune.profiling
        import vision_ckpt
        assert callable(vision_ckpt.apply) and not isinstance(vision_ckpt.apply, types.ModuleType)
        assert callable(vision_ckpt.tune.profile)
        assert not isinstance(vision_ckpt.tune.profile, types.ModuleType)
        profiling = importlib.import_module("vision_ckpt.tune.profiling")
        assert profiling.profile is vision_ckpt.tune.profile
        for name in vision_ckpt.__all__:
            exec(f"from vision_ckpt import {name}")
        assert set(vision_ckpt.__all__) <= set(dir(vision_ckpt))
        assert isinstance(vision_ckpt.runtime._core, types.ModuleType)
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_lazy_names_match_the_type_checking_imports_and_all() -> None:
    """The ``TYPE_CHECKING`` block (what type checkers see), ``_LAZY`` (what runs) and
    ``__all__`` list the same torch-dependent names, from the same modules."""
    tree = ast.parse(Path(vision_ckpt.__file__).read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    typed = {
        alias.asname or alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == vision_ckpt._LAZY
    eager = {n for n in vision_ckpt.__all__ if n not in typed}
    assert all(n in vars(vision_ckpt) for n in eager), eager - set(vars(vision_ckpt))
    assert set(typed) <= set(vision_ckpt.__all__)


def test_the_preset_registry_is_public_in_config_presets() -> None:
    assert "register_preset" in vision_ckpt.config.presets.__all__
    assert "preset_for_model" in vision_ckpt.config.presets.__all__
    assert vision_ckpt.list_presets is vision_ckpt.config.presets.list_presets


# --- the torch floor -------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["2.14.1", "2.14.1+cu128", "3.0.0", "dev", None])
def test_torch_at_or_above_the_floor_is_accepted(version: str | None) -> None:
    _torch_floor.check_torch_version(version)


def test_torch_below_the_floor_fails_at_import_and_says_how_to_fix(monkeypatch) -> None:
    major, minor = _torch_floor.MIN_TORCH
    floor = f"{major}.{minor}"
    old = f"{major}.{minor - 1}.1+cpu"
    monkeypatch.setattr(_torch_floor, "installed_torch_version", lambda: old)
    try:
        with pytest.raises(ImportError) as error:
            importlib.reload(vision_ckpt)
    finally:
        monkeypatch.undo()
        importlib.reload(vision_ckpt)
    message = str(error.value)
    assert f"needs torch>={floor}, found torch {old}" in message
    assert f'pip install "torch>={floor}"' in message
