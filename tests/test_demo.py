"""The README's demo (examples/demo_timm.py) runs end to end on tiny timm models."""

from __future__ import annotations

import importlib.util
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from rich.console import Console

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo_timm.py"


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo_timm", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP threads that
    # wait for each other make these tests 20x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("model", ["vit_tiny_patch16_224", "resnet18"])
def test_main_prints_every_setting(demo: ModuleType, model: str) -> None:
    out = io.StringIO()
    argv = ["--model", model, "--img-size", "32", "--batch-size", "2", "--steps", "2"]
    code = demo.main([*argv, "--levels", "0,3"], console=Console(file=out, width=200))
    text = out.getvalue()
    assert code == 0
    for expected in ("reproduce: python examples/demo_timm.py", "none", "blocks", "level 3"):
        assert expected in text
    assert "first-step loss identical" in text


def test_checkpointing_saves_memory_and_keeps_the_loss(demo: ModuleType) -> None:
    results = demo.run("vit_tiny_patch16_224", batch_size=2, img_size=32, steps=2, levels=[0])
    plain, blocks = results
    assert (plain.setting, blocks.setting) == ("none", "blocks")
    assert blocks.regions == 12
    assert blocks.losses == plain.losses  # exact, and on every step
    assert blocks.saved_bytes * 3 < plain.saved_bytes
    assert blocks.kept_bytes * 3 < plain.kept_bytes
    # deterministic accounting: the same figures on a second run
    again = demo.run("vit_tiny_patch16_224", batch_size=2, img_size=32, steps=1, levels=[0])
    assert [(r.saved_bytes, r.kept_bytes, r.peak_bytes) for r in again] == [
        (r.saved_bytes, r.kept_bytes, r.peak_bytes) for r in results
    ]


def test_bad_level_is_a_usage_error(demo: ModuleType) -> None:
    with pytest.raises(SystemExit) as info:
        demo.main(["--levels", "7"], console=Console(file=io.StringIO()))
    assert info.value.code == 2
