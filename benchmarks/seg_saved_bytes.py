"""Bytes each training level keeps for backward in smp segmentation models (the table of
docs/segmentation.md): 128 px, batch 2, 21 classes, smp's default decoder widths, random weights.

Deterministic (counted with ``count_saved_bytes``, not timed), seconds on a CPU::

    python benchmarks/seg_saved_bytes.py
"""

from __future__ import annotations

import copy
import warnings

import torch

from vision_ckpt import CheckpointConfig, apply
from vision_ckpt.measure._memory import count_saved_bytes

MODELS = [
    ("Unet", "resnet34"),
    ("Unet", "tu-resnet34"),
    ("Unet", "tu-convnext_tiny"),
    ("UnetPlusPlus", "resnet34"),
    ("FPN", "resnet34"),
    ("DeepLabV3Plus", "resnet34"),
    ("Segformer", "resnet34"),
    ("Segformer", "mit_b0"),
]


def main() -> None:
    import segmentation_models_pytorch as smp

    warnings.filterwarnings("ignore", module="segmentation_models_pytorch")
    x = torch.randn(2, 3, 128, 128)
    print("| model, encoder | 0 | 1 | 2 | 3 | 4 | 5 |")
    print("|---|---|---|---|---|---|---|")
    for arch, encoder in MODELS:
        torch.manual_seed(0)
        base = getattr(smp, arch)(encoder, encoder_weights=None, classes=21).train()
        cells = []
        for level in range(6):
            model = copy.deepcopy(base)
            apply(model, CheckpointConfig(training_checkpoint_level=level, preset="auto"))
            with count_saved_bytes() as saved:
                model(x)
            cells.append(f"{saved.nbytes / 2**20:.1f}")
        print(f"| {arch}, `{encoder}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
