"""The training-run config of ``train_timm.py`` and ``train_ddp.py``: one validated YAML file.

.. code-block:: yaml

    model: vit_tiny_patch16_224
    model_kwargs: {img_size: 32, patch_size: 8, depth: 2}
    image_size: 32
    batch_size: 8
    steps: 5
    optimizer: {name: adamw, lr: 1.0e-3}
    amp: bf16                      # none | bf16 (autocast on the run's device)
    device: cpu                    # cpu | cuda | auto
    checkpoint:                    # a vision_ckpt.CheckpointConfig
      preset: auto
      training_checkpoint_level: 3

Every key is checked (unknown keys are errors) and every field has a docstring, like the
checkpoint config it embeds. Errors are :class:`vision_ckpt.ConfigError` naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vision_ckpt import CheckpointConfig, ConfigError

__all__ = [
    "OptimizerConfig",
    "TrainConfig",
    "format_validation_error",
    "load_train_config",
    "load_validated",
]


SchemaT = TypeVar("SchemaT", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class OptimizerConfig(_Strict):
    """The optimizer and its hyper-parameters."""

    name: Literal["sgd", "adamw"] = "sgd"
    """``sgd`` (with ``momentum``) or ``adamw`` (with ``weight_decay``)."""

    lr: float = Field(default=0.01, gt=0)
    """Learning rate."""

    momentum: float = Field(default=0.9, ge=0, lt=1)
    """SGD momentum (ignored by AdamW)."""

    weight_decay: float = Field(default=0.0, ge=0)
    """Weight decay (decoupled for AdamW, L2 for SGD)."""


class TrainConfig(_Strict):
    """A synthetic-data training run of one timm model with activation checkpointing."""

    model: str = "vit_tiny_patch16_224"
    """A timm model name (``timm.list_models()``); built with ``pretrained=False``: no
    download ever happens."""

    model_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for ``timm.create_model`` (``img_size``, ``depth``,
    ``drop_path_rate``...); shrink a model here to make a run fast."""

    num_classes: int = Field(default=10, ge=1)
    """Classes of the synthetic labels (and of the model's head)."""

    image_size: int = Field(default=224, ge=8)
    """Height and width of the synthetic images."""

    batch_size: int = Field(default=8, ge=1)
    """Images per step (the global batch: ``train_ddp.py`` splits it across processes)."""

    steps: int = Field(default=10, ge=1)
    """Optimizer steps to run."""

    channels_last: bool = False
    """Feed images (and keep convolution weights) in ``torch.channels_last`` memory format."""

    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer."""

    amp: Literal["none", "bf16"] = "none"
    """Mixed precision: ``none`` (float32) or ``bf16`` (``torch.autocast`` with bfloat16 on the
    run's device; checkpointed regions are recomputed under the same autocast state)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``auto`` picks ``cuda`` when it is available, else ``cpu``."""

    seed: int = 0
    """Seed of the weights, the synthetic data and dropout."""

    track_memory: bool = True
    """Report the peak memory of each step: ``torch.cuda.max_memory_allocated`` on CUDA, and
    on CPU the peak of live tensor bytes from ``vision_ckpt.measure.track_peak_memory``
    (exact, but it slows the step down)."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    """The activation-checkpointing config (see ``vision_ckpt.CheckpointConfig``): ``preset``,
    ``rules``, ``training_checkpoint_level`` and the run options. The default checkpoints
    nothing."""

    @model_validator(mode="after")
    def _level_is_concrete(self) -> TrainConfig:
        if self.checkpoint.training_checkpoint_level == "auto":
            raise ValueError(
                "checkpoint.training_checkpoint_level 'auto' is not supported by the training "
                "examples; give a level 0-5 (or null and pass --level)"
            )
        return self


def format_validation_error(
    exc: ValidationError, source: str, what: str = "training config"
) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{loc}: {msg}".replace("\n", " "))
    return ConfigError(f"invalid {what} ({source}):\n  " + "\n  ".join(lines))


def load_validated(
    schema: type[SchemaT], source: str | Path | dict[str, Any], what: str = "training config"
) -> SchemaT:
    """Validate ``source`` (a YAML file path or a dict) against the pydantic ``schema``.

    Raises:
        ConfigError: the file is missing or does not parse, or a key is unknown or invalid;
            the message names the key.
    """
    if isinstance(source, dict):
        data: Any = source
        where = "dict"
    else:
        path = Path(source)
        where = str(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"{what} {where!r} cannot be read: {exc}") from None
        if data is None:
            data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{what} {where!r} holds a {type(data).__name__}, expected a mapping of "
            f"keys ({', '.join(schema.model_fields)})"
        )
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(exc, where, what) from None


def load_train_config(source: str | Path | dict[str, Any]) -> TrainConfig:
    """Validate a training config given as a YAML file path or as a dict.

    Raises:
        ConfigError: the file is missing or does not parse, or a key is unknown or invalid;
            the message names the key.
    """
    return load_validated(TrainConfig, source)
