"""The public surface: every exported name exists and is documented, and the modules carry >>>
examples (pytest runs them)."""

from __future__ import annotations

import doctest
import importlib
import types

import pytest

import vision_ckpt


@pytest.mark.parametrize("name", vision_ckpt.__all__)
def test_every_exported_name_exists_and_is_documented(name: str) -> None:
    obj = getattr(vision_ckpt, name)
    if name != "__version__":
        assert (obj.__doc__ or "").strip(), f"vision_ckpt.{name} has no docstring"


def test_presets_are_listed_from_the_package() -> None:
    names = vision_ckpt.list_presets()
    assert {"vit", "swin", "convnext", "resnet", "densenet", "efficientnet"} <= set(names)
    assert vision_ckpt.list_presets("tv_*") == ["tv_densenet", "tv_resnet", "tv_swin", "tv_vit"]


# --- docstring examples: pytest runs them (--doctest-modules); this checks they are there ----


@pytest.mark.parametrize(
    "module",
    [
        "vision_ckpt._core",
        "vision_ckpt._memory",
        "vision_ckpt.apply",
        "vision_ckpt.config",
        "vision_ckpt.levels",
        "vision_ckpt.matching",
        "vision_ckpt.presets",
        "vision_ckpt.profile",
        "vision_ckpt.wrapper",
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
