"""What the supported torch range promises, checked on the torch this script runs on.

Three checks, each on real models and synthetic data:

* ``exact``: every level 0-5 of the six frontier presets (timm ResNet-50, ConvNeXt-T, ViT-S,
  EfficientNet-B0, Swin-T, DenseNet-121, ``pretrained=False``) at batch 2, 224 px, in train mode
  with dropout and drop-path on: output, every gradient and every buffer (BatchNorm statistics)
  equal to the same model without checkpointing, ``rtol=0, atol=0``;
* ``selective``: the bytes ``count_saved_bytes`` counts for a two-MLP model whose blocks are
  full regions and selective regions (``keep: heavy``); a selective region keeps its linear
  outputs, so it must count more;
* ``compile``: graph breaks of timm ResNet-18 (BatchNorm) and ConvNeXt-atto (LayerNorm)
  compiled with ``aot_eager`` at every level (one forward and backward, batch 2, 64 px).

Run it once per torch (a venv each) and compare the files::

    python benchmarks/torch_range.py --out benchmarks/results/torch_range
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

import vision_ckpt
from vision_ckpt import _compat
from vision_ckpt.measure import count_saved_bytes

sys.path.insert(0, str(Path(__file__).parent))
from bench_derive import MODELS as FRONTIER  # noqa: E402  (a script beside this one)


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(1234)
    out = model(x)
    out.float().square().mean().backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _differences(got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    wrong = [] if torch.equal(got["out"], ref["out"]) else ["output"]
    for kind in ("grads", "buffers"):
        if got[kind].keys() != ref[kind].keys():
            wrong.append(f"{kind}: other names")
            continue
        wrong += [f"{kind}: {n}" for n, t in ref[kind].items() if not torch.equal(got[kind][n], t)]
    return wrong


def exact(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    try:
        plain = timm.create_model(name, pretrained=False, drop_rate=0.1, drop_path_rate=0.1)
    except TypeError:  # DenseNet has no drop-path
        plain = timm.create_model(name, pretrained=False, drop_rate=0.1)
    plain.train()
    x = torch.randn(2, 3, 224, 224)
    ref = _step(copy.deepcopy(plain), x)
    levels = {}
    for level in range(6):
        model = copy.deepcopy(plain)
        vision_ckpt.apply_preset(model, level=level)
        wrong = _differences(_step(model, x), ref)
        levels[str(level)] = "exact" if not wrong else f"{len(wrong)} differ: {wrong[:3]}"
    return levels


class _Block(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def selective() -> dict[str, int]:
    saved = {}
    for way, extra in (("full", {}), ("selective", {"keep": "heavy"})):
        torch.manual_seed(0)
        model = nn.Sequential(_Block(), _Block())
        config = {
            "training_checkpoint_level": 2,
            "rules": [{"match": "*", "level": 2, **extra}],
        }
        vision_ckpt.apply(model, config)
        x = torch.randn(32, 64, requires_grad=True)
        with count_saved_bytes(model) as counted:
            out = model(x)
        out.sum().backward()
        saved[way] = counted.nbytes
    return saved


def graph_breaks(name: str) -> dict[str, int]:
    from torch._dynamo.utils import counters

    breaks = {}
    for level in range(6):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10)
        vision_ckpt.apply_preset(model, level=level)
        compiled = torch.compile(model, backend="aot_eager")
        compiled(torch.randn(2, 3, 64, 64)).sum().backward()
        breaks[str(level)] = sum(counters["graph_break"].values())
    return breaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for <torch>.json")
    parser.add_argument("--models", nargs="*", default=list(FRONTIER))
    parser.add_argument("--skip", nargs="*", default=[], choices=["exact", "selective", "compile"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "timm": timm.__version__,
        "python": platform.python_version(),
        "native": {"this torch": _compat.features()},
        "command": "python benchmarks/torch_range.py --out " + str(args.out),
    }
    if "selective" not in args.skip:
        result["selective_saved_bytes"] = {"two residual MLPs, batch 32": selective()}
        print("selective:", result["selective_saved_bytes"], flush=True)
    if "compile" not in args.skip:
        result["compile_graph_breaks"] = {
            name: graph_breaks(name) for name in ("resnet18", "convnext_atto")
        }
        print("graph breaks:", result["compile_graph_breaks"], flush=True)
    if "exact" not in args.skip:
        result["exact_b2"] = {}
        for name in args.models:
            result["exact_b2"][name] = exact(name)
            print(name, result["exact_b2"][name], flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    version = torch.__version__.split("+")[0]
    (args.out / f"torch-{version}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
