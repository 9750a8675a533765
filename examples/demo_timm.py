"""Train a real timm model for a few steps with and without activation checkpointing.

Everything is synthetic and local: the model is built with ``pretrained=False`` and fed random
images, so nothing is downloaded. For each checkpointing setting the demo runs the same steps
from the same weights and prints what checkpointing changed:

* saved for bwd: bytes autograd keeps for backward during the forward (``count_saved_bytes``);
* kept fwd->bwd: bytes of tensors created by the forward and still alive when backward starts;
* step peak / activations: peak of live tensor bytes during the step, and that peak minus
  what was alive before it (weights, gradients, optimizer state) (``track_peak_memory``);
* step time (median of the untracked steps) and its ratio to no checkpointing;
* the loss of the first and the last step. Checkpointing is exact: the first-step loss of every
  setting must equal the un-checkpointed one bit for bit, and the demo checks it.

Settings: ``none``; ``blocks``, where every transformer block (ViT ``model.blocks``) or residual
block (ResNet ``layer1..4``, ConvNeXt/Swin ``stages[i].blocks``) is run through
``vision_ckpt.checkpoint`` by the small helper :func:`checkpoint_blocks` below; and one row per
training level given with ``--levels`` (1-5), applied with ``vision_ckpt.apply_preset``.

Run::

    python examples/demo_timm.py                      # vit_small_patch16_224, batch 4, 224 px
    python examples/demo_timm.py --model resnet50 --levels 0,2,4
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import timm
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import vision_ckpt
from vision_ckpt.measure import count_saved_bytes, format_bytes, track_peak_memory

NUM_CLASSES = 10


# --------------------------------------------------------------------------------------------
# Checkpointing every block by hand (the level/apply layer does this from a config)
# --------------------------------------------------------------------------------------------


class CheckpointedBlock(nn.Module):
    """Runs ``block`` through :func:`vision_ckpt.checkpoint`: its activations are recomputed."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return vision_ckpt.checkpoint(self.block, *args, **kwargs)


def block_lists(model: nn.Module) -> list[nn.Sequential | nn.ModuleList]:
    """The containers that hold the model's transformer or residual blocks, in order."""
    if isinstance(getattr(model, "blocks", None), (nn.Sequential, nn.ModuleList)):
        return [model.blocks]  # ViT, DeiT, EVA, ...
    if hasattr(model, "layer1"):
        return [getattr(model, f"layer{i}") for i in range(1, 5) if hasattr(model, f"layer{i}")]
    for attr in ("stages", "layers"):  # ConvNeXt, Swin, ...
        stages = getattr(model, attr, None)
        if stages is not None and all(hasattr(s, "blocks") for s in stages):
            return [s.blocks for s in stages]
    raise SystemExit(
        f"demo_timm: cannot find the blocks of {type(model).__name__} (looked for .blocks, "
        ".layer1-4, .stages[i].blocks, .layers[i].blocks); pass --levels to use the presets"
    )


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap every block of ``model`` in :class:`CheckpointedBlock`, in place; return the count."""
    count = 0
    for container in block_lists(model):
        for i, block in enumerate(container):
            container[i] = CheckpointedBlock(block)
            count += 1
    return count


# --------------------------------------------------------------------------------------------
# Training steps
# --------------------------------------------------------------------------------------------


@dataclass
class SettingResult:
    """What one checkpointing setting did over the demo's steps."""

    setting: str
    regions: int
    saved_bytes: int
    kept_bytes: int
    peak_bytes: int
    activation_bytes: int
    step_s: float
    losses: list[float]


def make_model(name: str, img_size: int) -> nn.Module:
    """Build ``name`` from timm without weights, for ``img_size`` inputs where that matters."""
    try:
        return timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, img_size=img_size)
    except TypeError:  # CNNs take any input size and have no img_size argument
        return timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES)


def train_steps(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], setting: str, regions: int
) -> SettingResult:
    """Run one SGD step per batch; measure memory on the first step and time on the others."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses: list[float] = []
    times: list[float] = []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if step == 0:
            with track_peak_memory(model, opt) as mem:
                with count_saved_bytes() as saved:
                    loss = F.cross_entropy(model(x), y)
                kept = mem.end_bytes - mem.start_bytes
                loss.backward()
                opt.step()
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return SettingResult(
        setting=setting,
        regions=regions,
        saved_bytes=saved.nbytes,
        kept_bytes=kept,
        peak_bytes=mem.peak_bytes,
        activation_bytes=mem.activation_bytes,
        # the first step runs under the memory trackers: time the others when there are some
        step_s=statistics.median(times[1:] or times),
        losses=losses,
    )


def run(
    model_name: str = "vit_small_patch16_224",
    batch_size: int = 4,
    img_size: int = 224,
    steps: int = 3,
    levels: list[int] | None = None,
    seed: int = 0,
) -> list[SettingResult]:
    """Train ``steps`` steps per setting from identical weights and data; return the results.

    Raises:
        AssertionError: a checkpointed setting's first-step loss differs from the plain one.
    """
    levels = [0] if levels is None else levels
    torch.manual_seed(seed)
    base = make_model(model_name, img_size)
    gen = torch.Generator().manual_seed(seed)
    batches = [
        (
            torch.randn(batch_size, 3, img_size, img_size, generator=gen),
            torch.randint(0, NUM_CLASSES, (batch_size,), generator=gen),
        )
        for _ in range(steps)
    ]

    settings: list[tuple[str, nn.Module, int]] = [("none", copy.deepcopy(base), 0)]
    model = copy.deepcopy(base)
    settings.append(("blocks", model, checkpoint_blocks(model)))
    for level in levels:
        if level == 0:
            continue
        model = copy.deepcopy(base)
        plan = vision_ckpt.apply_preset(model, level)
        regions = sum(1 for e in plan.entries if e.checkpointed)
        settings.append((f"level {level}", model, regions))

    results = []
    for name, model, regions in settings:
        results.append(train_steps(model, batches, name, regions))
        del model
    plain = results[0].losses[0]
    for r in results[1:]:
        assert r.losses[0] == plain, (
            f"checkpointing changed the loss: {r.setting} gives {r.losses[0]!r} at step 1, "
            f"no checkpointing gives {plain!r}"
        )
    return results


def print_table(results: list[SettingResult], title: str, console: Console) -> None:
    """Print the results as a table, with savings and slowdown relative to the first row."""
    table = Table(title=title)
    for col in ("setting", "regions", "saved for bwd", "kept fwd->bwd", "step peak"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for col in ("activations", "vs none", "step time", "slowdown", "loss step 1 -> last"):
        table.add_column(col, justify="right")
    ref = results[0]
    for r in results:
        table.add_row(
            r.setting,
            str(r.regions),
            format_bytes(r.saved_bytes),
            format_bytes(r.kept_bytes),
            format_bytes(r.peak_bytes),
            format_bytes(r.activation_bytes),
            f"{r.activation_bytes / ref.activation_bytes:.0%}",
            f"{r.step_s:.2f} s",
            f"{r.step_s / ref.step_s:.2f}x",
            f"{r.losses[0]:.6f} -> {r.losses[-1]:.6f}",
        )
    console.print(table)


def parse_levels(text: str) -> list[int]:
    """``"0,3"`` or ``"0-5"`` -> a list of levels, each checked by :func:`parse_level`."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "-" in part and not part.startswith("-"):
            lo, hi = (int(vision_ckpt.config.parse_level(p)) for p in part.split("-", 1))
            out.extend(range(lo, hi + 1))
        else:
            out.append(int(vision_ckpt.config.parse_level(part)))
    return out


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    """Parse arguments, run the demo, print a table; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_small_patch16_224", help="any timm model name")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--levels",
        default="0,3",
        help="training levels to add as rows, applied with the model's preset "
        "(e.g. '0,2,4' or '1-5'; 0 is the 'none' row, always shown)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be at least 1")
    try:
        levels = parse_levels(args.levels)
    except vision_ckpt.LevelError as exc:
        parser.error(str(exc))
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    console = console or Console(width=None if sys.stdout.isatty() else 140)
    shown = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    console.print(f"reproduce: python examples/demo_timm.py {shown}".rstrip())
    start = time.perf_counter()
    results = run(args.model, args.batch_size, args.img_size, args.steps, levels)
    title = (
        f"{args.model}, batch {args.batch_size}, {args.img_size}x{args.img_size}, "
        f"{args.steps} SGD steps on synthetic data, CPU, torch {torch.__version__}"
    )
    print_table(results, title, console)
    console.print(
        f"first-step loss identical in every setting (exact recomputation); "
        f"total {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
