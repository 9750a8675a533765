"""Train a MONAI 3D segmentation network on synthetic volumes at several checkpoint levels.

One YAML config (schema: :class:`Train3DConfig` below, in the pattern of
``examples/_train_config.py``) names a network of ``monai.networks.nets`` and its arguments,
the volume size, the batch, the steps, the optimizer, mixed precision, the device, the checkpoint
config and the training levels to compare. For each level the same network is built from the
same seed, checkpointed with :func:`vision_ckpt.apply` and trained ``steps`` steps on the same
volumes (random noise, with labels that are quantiles of the smoothed noise, so the Dice + cross
entropy loss can fall); the table gives, per level, the last loss, the bytes the first forward
saved for backward, the peak memory of its forward and backward (CUDA allocator peak, or live
tensor bytes on CPU: the weights and their gradients included, the optimizer's state not) and the
median time of the other steps. With ``library_switch: true`` a last row runs
MONAI's own ``use_checkpoint=True`` (SwinUNETR: the Swin blocks only) without vision_ckpt.
Nothing is downloaded.

Run::

    python examples/train_3d.py                      # SwinUNETR, 32^3, feature size 12: seconds
    python examples/train_3d.py --levels 0,2,5 --steps 3
    python examples/train_3d.py --config configs/train/3d/swinunetr_96.yaml   # 96^3, a GPU
    python examples/train_3d.py --size 64            # the tiny network on 64^3 volumes

``--levels`` overrides ``levels``, ``--steps`` ``steps`` and ``--size`` ``image_size``. On a busy
CPU pass ``--threads 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from _train_config import OptimizerConfig, load_validated
from monai.losses import DiceCELoss
from monai.networks import nets
from pydantic import BaseModel, ConfigDict, Field, field_validator
from rich.console import Console
from rich.table import Table
from torch import nn
from train_timm import make_optimizer, resolve_device

import vision_ckpt
from vision_ckpt import CheckpointConfig, ConfigError
from vision_ckpt.measure import count_saved_bytes, format_bytes, track_peak_memory

__all__ = [
    "Train3DConfig",
    "LevelRow",
    "load_config",
    "build_model",
    "synthetic_batch",
    "run_level",
    "main",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "train" / "3d" / "swinunetr_tiny.yaml"


class Train3DConfig(BaseModel):
    """A synthetic-data training run of one MONAI network, compared across checkpoint levels."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    model: str = "SwinUNETR"
    """A network class of ``monai.networks.nets`` (``SwinUNETR``, ``UNETR``, ``UNet``,
    ``BasicUNet``, ``DynUNet``, ``SegResNet``...); built from ``model_kwargs`` with random
    weights."""

    model_kwargs: dict[str, Any] = {}
    """Keyword arguments of the network (``feature_size``, ``channels``...). ``in_channels``,
    ``out_channels``, ``spatial_dims: 3`` and ``img_size`` (where the class takes them) come
    from the keys below."""

    in_channels: int = Field(default=1, ge=1)
    """Channels of the synthetic volumes (imaging modalities)."""

    out_channels: int = Field(default=2, ge=2)
    """Classes of the synthetic label maps (and of the network's output)."""

    image_size: int = Field(default=96, ge=16)
    """Side of the cubic volumes, in voxels (SwinUNETR needs a multiple of 32)."""

    batch_size: int = Field(default=1, ge=1)
    """Volumes per step."""

    steps: int = Field(default=2, ge=1)
    """Optimizer steps per level: the first is measured (saved bytes, peak), the others timed."""

    levels: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    """Training levels to run, one after the other, each on a fresh copy of the network."""

    library_switch: bool = False
    """Also run the network's own ``use_checkpoint=True`` (MONAI SwinUNETR), without
    vision_ckpt, as the last row."""

    optimizer: OptimizerConfig = OptimizerConfig(name="adamw", lr=1e-4)
    """The optimizer."""

    amp: Literal["none", "bf16"] = "none"
    """Mixed precision: ``none`` (float32) or ``bf16`` (``torch.autocast`` on the run's
    device)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``auto`` picks ``cuda`` when it is available, else ``cpu``."""

    seed: int = 0
    """Seed of the weights, the volumes and dropout (the same for every level)."""

    track_memory: bool = True
    """Measure the first step of each level: bytes saved for backward, and the peak of its
    forward and backward (CUDA allocator peak, or on CPU the live tensor bytes from
    ``vision_ckpt.measure.track_peak_memory``, exact but slow)."""

    checkpoint: CheckpointConfig = CheckpointConfig(preset="auto")
    """The checkpoint config (``preset``, ``rules``, ``nesting``...); its
    ``training_checkpoint_level`` is left unset: ``levels`` gives the levels."""

    @field_validator("model")
    @classmethod
    def _known_network(cls, value: str) -> str:
        found = getattr(nets, value, None)
        if not (isinstance(found, type) and issubclass(found, nn.Module)):
            raise ValueError(
                f"{value!r} is not a network class of monai.networks.nets; e.g. SwinUNETR, "
                "UNETR, UNet, BasicUNet, DynUNet, SegResNet"
            )
        return value

    @field_validator("levels")
    @classmethod
    def _levels_0_to_5(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        bad = [lv for lv in value if not 0 <= lv <= 5]
        if bad or not value:
            raise ValueError(f"got {list(value)}; give one or more training levels 0-5")
        return value

    @field_validator("checkpoint")
    @classmethod
    def _no_level_in_checkpoint(cls, value: CheckpointConfig) -> CheckpointConfig:
        if value.training_checkpoint_level is not None:
            raise ValueError(
                f"training_checkpoint_level is {value.training_checkpoint_level!r}; leave it "
                "unset and list the levels to run under 'levels' (or pass --levels)"
            )
        return value


def load_config(source: str | Path | dict[str, Any]) -> Train3DConfig:
    """Validate a config given as a YAML file path or as a dict.

    Raises:
        ConfigError: the file is missing or does not parse, or a key is unknown or invalid;
            the message names the key.
    """
    return load_validated(Train3DConfig, source)


def build_model(
    cfg: Train3DConfig, device: torch.device | str = "cpu", library_switch: bool = False
) -> nn.Module:
    """The network of ``cfg`` (random weights from ``cfg.seed``), in training mode.

    With ``library_switch`` the network is built with its own ``use_checkpoint=True``.
    """
    cls = getattr(nets, cfg.model)
    takes = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {"in_channels": cfg.in_channels, "out_channels": cfg.out_channels}
    if "spatial_dims" in takes:
        kwargs["spatial_dims"] = 3
    if "img_size" in takes:
        kwargs["img_size"] = cfg.image_size
    if library_switch:
        if "use_checkpoint" not in takes:
            raise ConfigError(
                f"library_switch: {cfg.model} has no use_checkpoint argument of its own; set "
                "library_switch: false"
            )
        kwargs["use_checkpoint"] = True
    kwargs.update(cfg.model_kwargs)
    torch.manual_seed(cfg.seed)
    return cls(**kwargs).to(device).train()


def synthetic_batch(
    cfg: Train3DConfig, step: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The volumes and label maps of step ``step``: the same for every level."""
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    side = cfg.image_size
    x = torch.randn(cfg.batch_size, cfg.in_channels, side, side, side, generator=gen)
    # Labels: the quantiles of the noise smoothed over 5^3 voxels, out_channels classes.
    smooth = F.avg_pool3d(x.mean(1, keepdim=True), 5, stride=1, padding=2)
    edges = torch.quantile(
        smooth.flatten()[:: max(1, smooth.numel() // 100_000)],
        torch.linspace(0, 1, cfg.out_channels + 1)[1:-1],
    )
    y = torch.bucketize(smooth, edges)
    return x.to(device), y.to(device)


@dataclass
class LevelRow:
    """What one level (or the library's own switch) did."""

    level: int | None
    """The training level; ``None`` for the library's own switch."""
    label: str
    """``level 3``, or ``use_checkpoint`` for the library's own switch."""
    losses: list[float]
    """The loss of every step."""
    saved_bytes: int | None
    """Bytes the first forward saved for backward (``None`` with ``track_memory: false``)."""
    peak_bytes: int | None
    """Peak memory of the first forward and backward (weights and gradients included): CUDA
    allocator peak, or live tensor bytes on CPU."""
    seconds: float
    """Median wall time of the steps after the first (of the first when there is one step)."""
    checkpointed: int
    """Modules checkpointed at this level."""


@contextlib.contextmanager
def _measured(
    cfg: Train3DConfig, device: torch.device, roots: Sequence[Any]
) -> Iterator[list[int | None]]:
    """Yields ``[saved, peak]``, filled in at exit (``None`` when memory is not tracked)."""
    out: list[int | None] = [None, None]
    if not cfg.track_memory:
        yield out
        return
    with count_saved_bytes() as saved:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            yield out
            torch.cuda.synchronize(device)
            out[1] = torch.cuda.max_memory_allocated(device)
        else:
            with track_peak_memory(*roots, device=device) as mem:
                yield out
            out[1] = mem.peak_bytes
    out[0] = saved.nbytes


def run_level(cfg: Train3DConfig, level: int | None, device: torch.device) -> LevelRow:
    """Train ``cfg.steps`` steps at training ``level`` (``None``: the library's own switch)."""
    model = build_model(cfg, device, library_switch=level is None)
    checkpointed = 0
    if level is not None:
        checkpoint = cfg.checkpoint.model_copy(update={"training_checkpoint_level": level})
        checkpointed = len(vision_ckpt.apply(model, checkpoint).checkpointed)
    optimizer = make_optimizer(cfg, model.parameters())
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    torch.manual_seed(cfg.seed)  # dropout draws the same masks at every level
    losses, times = [], []
    saved = peak = None
    for step in range(cfg.steps):
        x, y = synthetic_batch(cfg, step, device)
        measure = _measured(cfg, device, (model, optimizer)) if step == 0 else None
        start = time.perf_counter()
        with measure or contextlib.nullcontext([None, None]) as figures:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
                loss = loss_fn(model(x).float(), y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step == 0:
            saved, peak = figures
    label = "use_checkpoint" if level is None else f"level {level}"
    seconds = statistics.median(times[1:] or times)
    return LevelRow(level, label, losses, saved, peak, seconds, checkpointed)


def _table(cfg: Train3DConfig, rows: list[LevelRow], device: torch.device) -> Table:
    side = cfg.image_size
    title = (
        f"{cfg.model} on {device}, batch {cfg.batch_size}, {side}^3 voxels, amp {cfg.amp}, "
        f"{cfg.steps} steps per run"
    )
    table = Table(title=title, title_justify="left")
    for column in ("run", "regions", "loss", "saved", "peak", "ms/step"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=True)
    base = next((r for r in rows if r.level == 0), None)

    def size(value: int | None, ref: int | None) -> str:
        if value is None:
            return "-"
        return format_bytes(value) + (f" {value / ref:.2f}x" if ref else "")

    for r in rows:
        table.add_row(
            r.label,
            str(r.checkpointed) if r.level is not None else "own",
            f"{r.losses[-1]:.4f}",
            size(r.saved_bytes, base.saved_bytes if base else None),
            size(r.peak_bytes, base.peak_bytes if base else None),
            f"{r.seconds * 1e3:.0f}",
        )
    return table


def train(cfg: Train3DConfig, console: Console | None = None) -> list[LevelRow]:
    """Run every level of ``cfg`` (and the library's switch when asked); print the table."""
    # In a log or a pipe rich would wrap the table at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 100)
    device = resolve_device(cfg)
    rows = [run_level(cfg, level, device) for level in cfg.levels]
    if cfg.library_switch:
        rows.append(run_level(cfg, None, device))
    console.print(_table(cfg, rows, device))
    console.print(
        "regions: modules checkpointed; saved: bytes the first forward kept for backward; "
        "peak: of its forward and backward (weights and gradients included)"
    )
    return rows


def _levels(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of levels"
        ) from None


def main(argv: Sequence[str] | None = None) -> list[LevelRow]:
    """Run the comparison described by ``--config``; returns one row per level.

    Raises:
        SystemExit: the config is invalid (the message names the key).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="a configs/train/3d/*.yaml file"
    )
    parser.add_argument("--levels", type=_levels, help="override levels, e.g. 0,2,5")
    parser.add_argument("--steps", type=int, help="override steps")
    parser.add_argument("--size", type=int, help="override image_size (voxels a side)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (1 on a shared machine: spinning OpenMP threads slow small steps)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        data = load_config(args.config).model_dump(exclude_unset=True)
        overrides = {"levels": args.levels, "steps": args.steps, "image_size": args.size}
        data.update({k: v for k, v in overrides.items() if v is not None})
        cfg = load_config(data)
    except ConfigError as exc:
        raise SystemExit(f"train_3d: {exc}") from None
    return train(cfg)


if __name__ == "__main__":
    main()
