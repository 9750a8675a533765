"""The public surface: every exported name exists, is documented, and its doctests run."""

from __future__ import annotations

import doctest
import importlib

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


@pytest.mark.parametrize(
    "module", ["vision_ckpt._core", "vision_ckpt.levels", "vision_ckpt.profile"]
)
def test_docstring_examples_run(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
