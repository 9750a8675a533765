"""Saved-activation bytes and peak memory by training level, in both nesting modes.

For the small test models (tests/_models.py) and timm ``vit_tiny_patch16_224`` / ``resnet18``
on small images, apply a config that gives their modules levels 1-5, then for every training
level 0-5 and nesting ``all`` / ``outermost`` run one training step (forward + backward) and
measure, deterministically on CPU:

- saved: bytes autograd keeps from forward to backward, counted by an outer
  ``saved_tensors_hooks`` over distinct storages, parameters excluded (activations only);
- peak: the peak of live tensor-storage bytes during the step above what was alive before it
  (weights), from ``vision_ckpt.measure.track_peak_memory``;
- calls: how many times the core's checkpoint ran (forward calls plus nested calls made during
  recomputation), a measure of the recompute cost;
- ms: median step time over a few steps (noisy on a shared CPU; indicative only).

Run: ``python benchmarks/bench_nesting.py`` (add ``--quick`` for the test models only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import timm
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]
from _blocks import record_core_calls  # noqa: E402
from _models import LEVEL_RULES, make  # noqa: E402

import vision_ckpt  # noqa: E402
from vision_ckpt import apply, training_level  # noqa: E402
from vision_ckpt.measure import format_bytes, track_peak_memory  # noqa: E402

TIMM_VIT_RULES = [
    {"match": "patch_embed", "level": 1},
    {"match": "blocks.*.norm?", "level": 1},
    {"match": "blocks.*.attn", "level": 2},
    {"match_type": "Mlp", "level": 2},
    {"match": "blocks.*", "level": 3},
    {"match": "blocks", "level": 4},
    {"match_type": "VisionTransformer", "level": 5},
]
TIMM_RESNET_RULES = [
    {"match": "layer?.*.bn1", "level": 1},
    {"match": "layer?.*.downsample", "level": 2},
    {"match": "layer?.*", "level": 3},
    {"match": "layer?", "level": 4},
    {"match_type": "ResNet", "level": 5},
]


def _timm(name: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=10, **kwargs).train()


MODELS = {
    "tiny ViT": (lambda: make("vit"), LEVEL_RULES["vit"], (8, 3, 16, 16)),
    "tiny Swin": (lambda: make("swin"), LEVEL_RULES["swin"], (8, 3, 16, 16)),
    "tiny DenseNet": (lambda: make("densenet"), LEVEL_RULES["densenet"], (8, 3, 32, 32)),
    "vit_tiny_patch16_224 @64px": (
        lambda: _timm(
            "vit_tiny_patch16_224", img_size=64, patch_size=8, depth=4, drop_path_rate=0.1
        ),
        TIMM_VIT_RULES,
        (8, 3, 64, 64),
    ),
    "resnet18 @64px": (
        lambda: _timm("resnet18", drop_path_rate=0.1),
        TIMM_RESNET_RULES,
        (8, 3, 64, 64),
    ),
}


def _saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return total


def _measure(model: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, float]:
    saved = _saved_activation_bytes(model, x)
    with track_peak_memory(model) as mem:
        model(x).float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    with record_core_calls() as calls:  # forward and recomputation calls alike
        model(x).float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x).float().square().mean().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {
        "saved": saved,
        "peak": mem.peak_bytes - mem.start_bytes,
        "calls": len(calls),
        "ms": 1e3 * statistics.median(times),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small test models")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per cell")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    console = Console(width=160)
    console.print(f"vision_ckpt {vision_ckpt.__version__}, torch {torch.__version__}, CPU")
    names = [n for n in MODELS if not args.quick or n.startswith("tiny")]
    for name in names:
        build, rules, shape = MODELS[name]
        torch.manual_seed(0)
        x = torch.randn(shape)
        table = Table(title=f"{name}, input {tuple(shape)}", title_justify="left")
        table.add_column("level", justify="right")
        for nesting in ("all", "outermost"):
            for col in ("saved", "peak", "calls", "ms"):
                table.add_column(f"{nesting}\n{col}", justify="right", no_wrap=True)
        rows: dict[int, list[str]] = {lv: [str(lv)] for lv in range(6)}
        for nesting in ("all", "outermost"):
            model = build()
            apply(model, {"rules": rules, "nesting": nesting})
            for level in range(6):
                with training_level(level):
                    m = _measure(model, x, args.repeats)
                rows[level] += [
                    format_bytes(m["saved"]),
                    format_bytes(m["peak"]),
                    str(m["calls"]),
                    f"{m['ms']:.1f}",
                ]
        for level in range(6):
            table.add_row(*rows[level])
        console.print(table)


if __name__ == "__main__":
    main()
