"""Dense prediction and Hugging Face models: our levels against each library's own switch.

Models (``pretrained``/``encoder_weights`` off, synthetic data, the device given):

- ``unet``: segmentation_models_pytorch ``Unet("resnet34")``, 19 classes, ``--unet-size`` px
  (512), batch ``--unet-batch`` (4); smp has no checkpointing of its own;
- ``swinunetr``: MONAI ``SwinUNETR(feature_size=48)``, 1 channel in, 14 out, a
  ``--swin-size``^3 volume (96), batch 1; its own switch is ``use_checkpoint=True`` (the Swin
  blocks only);
- ``hf_vit``: transformers ``ViTForImageClassification`` (ViT-B/16), 224 px, batch
  ``--vit-batch`` (32); its own switch is ``gradient_checkpointing_enable()`` (every layer).

Per variant (no checkpointing, the library's switch, vision_ckpt levels 1-5 of the model's
preset): the step's peak of live tensor bytes (forward + backward, parameters and gradients
included; deterministic on CPU) and the median step time over ``--reps`` interleaved rounds
(one step of every variant per round; ratios to no checkpointing per round, then the median).

Usage::

    python benchmarks/bench_dense.py --threads 2 --reps 2
    python benchmarks/bench_dense.py --models unet --unet-size 256 --reps 1
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

import vision_ckpt
from vision_ckpt.measure import track_peak_memory

MB = 2**20


@dataclass
class Row:
    model: str
    variant: str
    peak_mb: float
    above_mb: float
    """The peak above what was alive before the step (parameters, buffers, the input)."""
    time_s: float = 0.0
    ratio: float = 0.0
    times: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)


def _loss(out: object) -> torch.Tensor:
    if isinstance(out, dict):  # a Hugging Face ModelOutput
        out = out["logits"]
    assert isinstance(out, torch.Tensor)
    return out.float().square().mean()


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    _loss(model(x)).backward()


def _peak(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    model.zero_grad(set_to_none=True)
    with track_peak_memory(model, x) as mem:
        _loss(model(x)).backward()
    model.zero_grad(set_to_none=True)
    return mem.peak_bytes, mem.peak_bytes - mem.start_bytes


def _unet(args: argparse.Namespace) -> tuple[dict[str, nn.Module], torch.Tensor]:
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    base = smp.Unet("resnet34", encoder_weights=None, classes=19)
    x = torch.randn(args.unet_batch, 3, args.unet_size, args.unet_size)
    return {"none": base}, x


def _swinunetr(args: argparse.Namespace) -> tuple[dict[str, nn.Module], torch.Tensor]:
    from monai.networks.nets import SwinUNETR

    torch.manual_seed(0)
    kwargs = {"in_channels": 1, "out_channels": 14, "feature_size": 48, "spatial_dims": 3}
    base = SwinUNETR(**kwargs)
    own = SwinUNETR(use_checkpoint=True, **kwargs)
    own.load_state_dict(base.state_dict())
    x = torch.randn(1, 1, args.swin_size, args.swin_size, args.swin_size)
    return {"none": base, "own switch": own}, x


def _hf_vit(args: argparse.Namespace) -> tuple[dict[str, nn.Module], torch.Tensor]:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    base = ViTForImageClassification(ViTConfig(num_labels=1000))
    own = copy.deepcopy(base)
    own.gradient_checkpointing_enable()
    x = torch.randn(args.vit_batch, 3, 224, 224)
    return {"none": base, "own switch": own}, x


MODELS: dict[str, Callable[[argparse.Namespace], tuple[dict[str, nn.Module], torch.Tensor]]] = {
    "unet": _unet,
    "swinunetr": _swinunetr,
    "hf_vit": _hf_vit,
}


def bench(name: str, args: argparse.Namespace, console: Console) -> list[Row]:
    variants, x = MODELS[name](args)
    for level in range(1, 6):
        m = copy.deepcopy(variants["none"])
        vision_ckpt.apply_preset(m, level)
        variants[f"L{level}"] = m
    rows = {}
    for v, m in variants.items():
        m.train()
        peak, above = _peak(m, x)  # also the timing's warm-up step
        rows[v] = Row(name, v, peak / MB, above / MB)
        console.print(f"  {name} {v}: peak {peak / MB:9.1f} MB, above the start {above / MB:9.1f}")
    for round_ in range(args.reps):
        times = {}
        for v, m in variants.items():
            start = time.perf_counter()
            _step(m, x)
            times[v] = time.perf_counter() - start
            rows[v].times.append(times[v])
        for v in variants:
            rows[v].ratios.append(times[v] / times["none"])
        console.print(
            f"  round {round_ + 1}/{args.reps}: "
            + ", ".join(f"{k} {t:.1f}s" for k, t in times.items())
        )
    for row in rows.values():
        row.time_s = statistics.median(row.times)
        row.ratio = statistics.median(row.ratios)
    return list(rows.values())


def table(rows: list[Row], shapes: dict[str, str]) -> list[str]:
    lines = [
        "| model | variant | peak MB | above start MB | above / none | above / own switch "
        "| time / none |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r.model for r in rows):
        mine = {r.variant: r for r in rows if r.model == name}
        none, own = mine["none"], mine.get("own switch")
        for r in mine.values():
            vs_own = f"{r.above_mb / own.above_mb:.2f}" if own else "-"
            lines.append(
                f"| {name} ({shapes[name]}) | {r.variant} | {r.peak_mb:.0f} | {r.above_mb:.0f} | "
                f"{r.above_mb / none.above_mb:.2f} | {vs_own} | {r.ratio:.2f}x |"
            )
    return lines


def targets(rows: list[Row]) -> list[str]:
    out = []
    for name in dict.fromkeys(r.model for r in rows):
        mine = {r.variant: r for r in rows if r.model == name}
        own = mine.get("own switch")
        if own is None:
            continue
        top = mine["L5"]
        out.append(
            f"{name}: top level peak {top.peak_mb / own.peak_mb:.2f}x the own switch's, above "
            f"the start {top.above_mb / own.above_mb:.2f}x (target <= 0.5): "
            f"{'met' if top.above_mb <= 0.5 * own.above_mb else 'missed'}"
        )
        close = [
            v
            for v, r in mine.items()
            if v.startswith("L") and r.ratio <= own.ratio * 1.05 and r.above_mb < own.above_mb
        ]
        out.append(
            f"{name}: levels within 5% of the own switch's time with a lower peak: "
            f"{', '.join(close) or 'none'} ({'met' if close else 'missed'})"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="unet,swinunetr,hf_vit")
    parser.add_argument("--unet-size", type=int, default=512)
    parser.add_argument("--unet-batch", type=int, default=4)
    parser.add_argument("--swin-size", type=int, default=96)
    parser.add_argument("--vit-batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/dense")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    shapes = {
        "unet": f"resnet34, {args.unet_size} px, batch {args.unet_batch}",
        "swinunetr": f"{args.swin_size}^3, batch 1",
        "hf_vit": f"ViT-B/16, 224 px, batch {args.vit_batch}",
    }
    rows: list[Row] = []
    for name in args.models.split(","):
        rows += bench(name, args, console)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}, indent=2)
    )
    lines = table(rows, shapes) + [""] + targets(rows)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    console.print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
