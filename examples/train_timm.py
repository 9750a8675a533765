"""Train any timm model on synthetic data with activation checkpointing from one YAML config.

The config (schema: ``examples/_train_config.py``) names the timm model and its arguments, the
batch, the number of steps, the optimizer, mixed precision, the device and the checkpoint config
(``checkpoint:``, a :class:`vision_ckpt.CheckpointConfig` with ``preset``, ``rules`` and
``training_checkpoint_level``). The model is built with ``pretrained=False`` and fed random
images, so nothing is downloaded. A progress bar shows the loss, the step time and the peak
memory of each step.

Run::

    python examples/train_timm.py --config configs/train/vit_tiny.yaml
    python examples/train_timm.py --config configs/train/resnet_tiny.yaml --level 4
    python examples/train_timm.py --config configs/train/convnext_tiny.yaml   # heavier

``--level`` overrides ``checkpoint.training_checkpoint_level``; ``--steps`` overrides ``steps``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from _train_config import TrainConfig, load_train_config
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

import vision_ckpt
from vision_ckpt.measure import format_bytes, track_peak_memory

__all__ = [
    "StepStats",
    "build_model",
    "make_optimizer",
    "synthetic_batch",
    "resolve_device",
    "train_step",
    "with_overrides",
    "main",
]


@dataclass
class StepStats:
    """What one optimizer step did."""

    step: int
    """Step number, from 0."""
    loss: float
    """Loss of the step (averaged over processes in ``train_ddp.py``)."""
    seconds: float
    """Wall time of forward, backward and optimizer step."""
    peak_bytes: int | None
    """Peak memory of the step: CUDA allocator peak, or live tensor bytes on CPU."""


def resolve_device(cfg: TrainConfig) -> torch.device:
    """The device of the run: ``auto`` is ``cuda`` when available, else ``cpu``."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise vision_ckpt.ConfigError("device: cuda was asked for, but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def with_overrides(
    cfg: TrainConfig, level: int | None = None, steps: int | None = None
) -> TrainConfig:
    """``cfg`` with ``checkpoint.training_checkpoint_level`` and ``steps`` replaced (if given)."""
    data = cfg.model_dump()
    if level is not None:
        data["checkpoint"]["training_checkpoint_level"] = level
    if steps is not None:
        data["steps"] = steps
    return load_train_config(data)


def build_model(cfg: TrainConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The timm model of ``cfg`` (random weights from ``cfg.seed``), in training mode.

    Checkpointing is not applied here: see :func:`vision_ckpt.apply`.
    """
    torch.manual_seed(cfg.seed)
    model = timm.create_model(
        cfg.model, pretrained=False, num_classes=cfg.num_classes, **cfg.model_kwargs
    )
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def make_optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` over ``params``."""
    opt = cfg.optimizer
    if opt.name == "adamw":
        return torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay)
    return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)


def synthetic_batch(
    cfg: TrainConfig, step: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: the same images and labels on every process."""
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=gen)
    y = torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=gen)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.to(device), y.to(device)


@contextlib.contextmanager
def _peak_memory(
    cfg: TrainConfig, device: torch.device, roots: Sequence[Any]
) -> Iterator[list[int | None]]:
    """Yields a one-item list that holds the step's peak bytes at exit (None when off)."""
    out: list[int | None] = [None]
    if not cfg.track_memory:
        yield out
    elif device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out[0] = torch.cuda.max_memory_allocated(device)
    else:
        with track_peak_memory(*roots, device=device) as mem:
            yield out
        out[0] = mem.peak_bytes


def train_step(
    cfg: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
) -> tuple[float, float, int | None]:
    """One forward, backward and optimizer step; returns (loss, seconds, peak bytes)."""
    start = time.perf_counter()
    with _peak_memory(cfg, device, (model, optimizer)) as peak:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return loss.item(), time.perf_counter() - start, peak[0]


def progress_bar(console: Console) -> Progress:
    """A rich progress bar with a free-text field for the step's figures."""
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
    )


def step_info(stats: StepStats) -> str:
    """``loss 2.3026 | 12.3 ms/step | peak 4.21 MiB``."""
    peak = "-" if stats.peak_bytes is None else format_bytes(stats.peak_bytes)
    return f"loss {stats.loss:.4f} | {stats.seconds * 1e3:.1f} ms/step | peak {peak}"


def train(cfg: TrainConfig, console: Console | None = None) -> list[StepStats]:
    """Build, checkpoint and train the model of ``cfg``; returns the figures of every step."""
    console = console or Console()
    device = resolve_device(cfg)
    model = build_model(cfg, device)
    the_plan = vision_ckpt.apply(model, cfg.checkpoint)
    console.print(
        f"{cfg.model} on {device}, batch {cfg.batch_size}, {cfg.image_size} px, amp {cfg.amp}: "
        f"{len(the_plan.checkpointed)} of {len(the_plan)} planned modules checkpointed at "
        f"training level {int(the_plan.training_level)}"
    )
    optimizer = make_optimizer(cfg, model.parameters())
    history: list[StepStats] = []
    with progress_bar(console) as bar:
        task = bar.add_task("train", total=cfg.steps, info="")
        for step in range(cfg.steps):
            x, y = synthetic_batch(cfg, step, device)
            loss, seconds, peak = train_step(cfg, model, optimizer, x, y, device)
            history.append(StepStats(step, loss, seconds, peak))
            bar.update(task, advance=1, info=step_info(history[-1]))
    console.print(f"last step: {step_info(history[-1])}")
    return history


def parse_args(
    argv: Sequence[str] | None, description: str, distributed: bool = False
) -> argparse.Namespace:
    """The command line shared by ``train_timm.py`` and (with ``distributed``) ``train_ddp.py``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, required=True, help="a configs/train/*.yaml file")
    parser.add_argument(
        "--level", type=int, choices=range(6), help="override checkpoint.training_checkpoint_level"
    )
    parser.add_argument("--steps", type=int, help="override steps")
    if distributed:
        parser.add_argument(
            "--fsdp", action="store_true", help="FSDP2 fully_shard on each block, not DDP"
        )
        parser.add_argument(
            "--static-graph", action="store_true", help="DistributedDataParallel(static_graph=True)"
        )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[StepStats]:
    """Run the training described by ``--config``; returns the figures of every step.

    Raises:
        SystemExit: the config is invalid (the message names the key).
    """
    args = parse_args(argv, __doc__.split("\n\n")[0])
    try:
        cfg = with_overrides(load_train_config(args.config), args.level, args.steps)
    except vision_ckpt.ConfigError as exc:
        raise SystemExit(f"train_timm: {exc}") from None
    return train(cfg)


if __name__ == "__main__":
    main()
