"""Train a segmentation_models_pytorch model (a U-Net with a timm encoder by default) on synthetic
data with activation checkpointing, from one YAML config.

The config is ``train_timm.py``'s (``examples/_train_config.py``) with ``model`` naming an smp
architecture (``Unet``, ``UnetPlusPlus``, ``FPN``, ``DeepLabV3Plus``, ``Segformer``) and one
more key, ``encoder``: an smp encoder name, ``tu-<timm model>`` for a timm encoder.
``model_kwargs`` go to the smp class (``decoder_channels``, ``encoder_depth``...; with a ``tu-``
encoder, keys smp does not take itself, such as ``drop_path_rate``, reach ``timm.create_model``).
The model is built with ``encoder_weights=None`` and fed random images with random per-pixel
labels, so nothing is downloaded. ``checkpoint.preset: auto`` resolves to the smp presets
(``docs/segmentation.md``).

Run::

    python examples/train_segmentation.py                       # 64 px, batch 2: seconds on a CPU
    python examples/train_segmentation.py --image-size 512 --batch-size 4 --level 4
    python examples/train_segmentation.py --config configs/train/segmentation/unet_timm_512.yaml

``--level``, ``--steps``, ``--image-size`` and ``--batch-size`` override the config.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _train_config import TrainConfig, load_validated
from pydantic import Field, model_validator
from rich.console import Console
from torch import nn
from train_timm import (
    StepStats,
    make_optimizer,
    progress_bar,
    resolve_device,
    step_info,
    train_step,
)

import vision_ckpt

__all__ = [
    "DEFAULT_CONFIG",
    "SegmentationConfig",
    "load_segmentation_config",
    "build_model",
    "synthetic_batch",
    "parse_args",
    "config_from_args",
    "train",
    "main",
]

DEFAULT_CONFIG = (
    Path(__file__).resolve().parents[1]
    / "configs"
    / "train"
    / "segmentation"
    / "unet_timm_tiny.yaml"
)
"""The config used without ``--config``: a tu-resnet18 U-Net at 64 px."""


class SegmentationConfig(TrainConfig):
    """A synthetic-data training run of one smp segmentation model with activation
    checkpointing. The other keys are those of ``TrainConfig`` (``examples/_train_config.py``)."""

    model: str = "Unet"
    """An smp architecture: a class of ``segmentation_models_pytorch`` such as ``Unet``,
    ``UnetPlusPlus``, ``FPN``, ``DeepLabV3Plus`` or ``Segformer``."""

    encoder: str = "tu-resnet18"
    """The smp encoder: ``tu-<timm model name>`` for a timm encoder, or an smp one
    (``resnet34``, ``mit_b0``); built with random weights."""

    num_classes: int = Field(default=3, ge=1)
    """Classes of the synthetic per-pixel labels (and of the model's output channels)."""

    image_size: int = Field(default=64, ge=8)
    """Height and width of the synthetic images; a multiple of ``2 ** encoder_depth``."""

    batch_size: int = Field(default=2, ge=1)
    """Images per step."""

    @model_validator(mode="after")
    def _image_fits_the_encoder(self) -> SegmentationConfig:
        depth = int(self.model_kwargs.get("encoder_depth", 5))
        stride = 2**depth
        if self.image_size % stride:
            fit = max(stride, self.image_size // stride * stride)
            raise ValueError(
                f"image_size {self.image_size} is not divisible by {stride} (2 ** encoder_depth "
                f"{depth}): the decoder upsamples to the encoder's sizes; use e.g. {fit}"
            )
        return self


def load_segmentation_config(source: str | Path | dict[str, Any]) -> SegmentationConfig:
    """Validate a segmentation training config given as a YAML file path or as a dict.

    Raises:
        ConfigError: the file is missing or does not parse, or a key is unknown or invalid;
            the message names the key.
    """
    return load_validated(SegmentationConfig, source, "segmentation training config")


def build_model(cfg: SegmentationConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The smp model of ``cfg`` (random weights from ``cfg.seed``), in training mode.

    Checkpointing is not applied here: see :func:`vision_ckpt.apply`.
    """
    import segmentation_models_pytorch as smp

    arch = getattr(smp, cfg.model, None)
    if not (isinstance(arch, type) and issubclass(arch, nn.Module)):
        raise vision_ckpt.ConfigError(
            f"model {cfg.model!r} is not a segmentation_models_pytorch architecture; use one of "
            "Unet, UnetPlusPlus, FPN, DeepLabV3Plus, Segformer, ..."
        )
    torch.manual_seed(cfg.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = arch(
            encoder_name=cfg.encoder,
            encoder_weights=None,
            classes=cfg.num_classes,
            **cfg.model_kwargs,
        )
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def synthetic_batch(
    cfg: SegmentationConfig, step: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step ``step``: random images and random per-pixel class labels."""
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    size = (cfg.image_size, cfg.image_size)
    x = torch.randn(cfg.batch_size, 3, *size, generator=gen)
    y = torch.randint(0, cfg.num_classes, (cfg.batch_size, *size), generator=gen)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.to(device), y.to(device)


def train(cfg: SegmentationConfig, console: Console | None = None) -> list[StepStats]:
    """Build, checkpoint and train the model of ``cfg``; returns the figures of every step."""
    console = console or Console()
    device = resolve_device(cfg)
    model = build_model(cfg, device)
    the_plan = vision_ckpt.apply(model, cfg.checkpoint)
    console.print(
        f"{cfg.model}({cfg.encoder}) on {device}, batch {cfg.batch_size}, {cfg.image_size} px, "
        f"amp {cfg.amp}: {len(the_plan.checkpointed)} of {len(the_plan)} planned modules "
        f"checkpointed at training level {int(the_plan.training_level)}"
    )
    optimizer = make_optimizer(cfg, model.parameters())
    history: list[StepStats] = []
    with progress_bar(console) as bar:
        task = bar.add_task("train", total=cfg.steps, info="")
        for step in range(cfg.steps):
            x, y = synthetic_batch(cfg, step, device)
            # per-pixel cross-entropy: (B, C, H, W) logits against (B, H, W) labels
            loss, seconds, peak = train_step(cfg, model, optimizer, x, y, device)
            history.append(StepStats(step, loss, seconds, peak))
            bar.update(task, advance=1, info=step_info(history[-1]))
    console.print(f"last step: {step_info(history[-1])}")
    return history


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line: a config and the overrides for a run at another size or level."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="a configs/train/segmentation/*.yaml"
    )
    parser.add_argument(
        "--level", type=int, choices=range(6), help="override checkpoint.training_checkpoint_level"
    )
    parser.add_argument("--steps", type=int, help="override steps")
    parser.add_argument("--image-size", type=int, help="override image_size (e.g. 512)")
    parser.add_argument("--batch-size", type=int, help="override batch_size (e.g. 4)")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SegmentationConfig:
    """The config of ``args.config`` with the command line's overrides applied.

    Raises:
        ConfigError: the config, or the config with the overrides, is invalid.
    """
    data = load_segmentation_config(args.config).model_dump()
    if args.level is not None:
        data["checkpoint"]["training_checkpoint_level"] = args.level
    for key in ("steps", "image_size", "batch_size"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    return load_segmentation_config(data)


def main(argv: Sequence[str] | None = None) -> list[StepStats]:
    """Run the training described by the command line; returns the figures of every step.

    Raises:
        SystemExit: the config is invalid (the message names the key).
    """
    try:
        cfg = config_from_args(parse_args(argv))
    except vision_ckpt.ConfigError as exc:
        raise SystemExit(f"train_segmentation: {exc}") from None
    return train(cfg)


if __name__ == "__main__":
    main()
