"""Bytes each training level keeps for backward in segmentation models: smp architectures with
their default decoder widths, and torchvision's DeepLabV3, FCN and LRASPP with their auxiliary
heads; 128 px, batch 2, 21 classes, random weights, every level of the preset ``auto`` picks.

Deterministic (counted with ``vision_ckpt.measure.count_saved_bytes`` around one forward, not
timed), about a minute on a CPU. Prints the table and writes ``results.json`` to ``--out``
(rendered in docs/benchmarks.md)::

    python benchmarks/seg_saved_bytes.py --out benchmarks/results/seg_saved_bytes
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch

from vision_ckpt import CheckpointConfig, apply
from vision_ckpt.measure import count_saved_bytes

SMP = [
    ("Unet", "resnet34"),
    ("Unet", "tu-resnet34"),
    ("Unet", "tu-convnext_tiny"),
    ("UnetPlusPlus", "resnet34"),
    ("FPN", "resnet34"),
    ("DeepLabV3Plus", "resnet34"),
    ("Segformer", "resnet34"),
    ("Segformer", "mit_b0"),
]
TORCHVISION = [
    "deeplabv3_resnet50",
    "fcn_resnet50",
    "deeplabv3_mobilenet_v3_large",
    "lraspp_mobilenet_v3_large",
]


def models() -> list[tuple[str, Callable[[], torch.nn.Module]]]:
    import segmentation_models_pytorch as smp
    import torchvision.models.segmentation as tvs

    def from_smp(arch: str, encoder: str) -> Callable[[], torch.nn.Module]:
        return lambda: getattr(smp, arch)(encoder, encoder_weights=None, classes=21)

    def from_torchvision(name: str) -> Callable[[], torch.nn.Module]:
        aux = {} if name.startswith("lraspp") else {"aux_loss": True}
        return lambda: getattr(tvs, name)(
            weights=None, weights_backbone=None, num_classes=21, **aux
        )

    return [(f"smp {a}, `{e}`", from_smp(a, e)) for a, e in SMP] + [
        (f"torchvision `{n}`", from_torchvision(n)) for n in TORCHVISION
    ]


def saved_mib(make: Callable[[], torch.nn.Module], x: torch.Tensor) -> list[float]:
    """MiB one forward keeps for backward at each training level 0-5."""
    torch.manual_seed(0)
    base = make().train()
    out = []
    for level in range(6):
        model = copy.deepcopy(base)
        apply(model, CheckpointConfig(training_checkpoint_level=level, preset="auto"))
        with count_saved_bytes() as saved:
            model(x)
        out.append(round(saved.nbytes / 2**20, 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for results.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", module="segmentation_models_pytorch")
    torch.set_num_threads(1)
    x = torch.randn(2, 3, 128, 128)
    print("| model | L0 | L1 | L2 | L3 | L4 | L5 |\n|---|---|---|---|---|---|---|")
    rows = []
    for name, make in models():
        levels = saved_mib(make, x)
        rows.append({"model": name, **{f"L{k}": v for k, v in enumerate(levels)}})
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in levels) + " |", flush=True)
    if args.out:
        libs = ("torch", "torchvision", "segmentation_models_pytorch", "timm")
        results = {
            "command": "python benchmarks/seg_saved_bytes.py --out <dir>",
            "input": "batch 2, 3x128x128, 21 classes, random weights, train mode",
            "meter": "count_saved_bytes: MiB one forward keeps for backward, parameters excluded",
            "versions": ", ".join(f"{lib} {version(lib)}" for lib in libs),
            "rows": rows,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
