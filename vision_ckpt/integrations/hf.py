"""Hugging Face transformers models: checkpoint them at a vision_ckpt level in one call.

Hugging Face models switch their own activation checkpointing on and off per layer with
``model.gradient_checkpointing_enable()`` / ``model.activation_checkpointing_enable()`` (which
``Trainer`` calls when ``TrainingArguments(gradient_checkpointing=True)``). This module gives
the same one-call shape for vision_ckpt's levels and presets (``hf_vit``, ``hf_swin``,
``hf_convnext``, ``hf_segformer``, ... in ``configs/presets``)::

    from vision_ckpt.integrations.hf import enable_checkpointing, disable_checkpointing

    plan = enable_checkpointing(model, level=3)   # or config=..., or memory_budget=...
    trainer = Trainer(model=model, args=TrainingArguments(...))   # gradient_checkpointing off
    trainer.train()
    disable_checkpointing(model)

It never imports transformers: it works on any ``nn.Module`` and recognises Hugging Face's
switch by its attributes.

NOTE [ Hugging Face's own checkpointing ]

The two must not both be on. Hugging Face's switch sets ``gradient_checkpointing = True`` on
every ``GradientCheckpointingLayer``, whose class ``forward`` then runs through
``torch.utils.checkpoint``; vision_ckpt installs an instance-level ``forward`` that runs the
class's forward through its own core. Both on, every layer would be recomputed twice over
(still exact, but the slowest way to save nothing more). So:

- :func:`enable_checkpointing` refuses a model whose Hugging Face checkpointing is on
  (``model.is_activation_checkpointing``, i.e. any module with ``gradient_checkpointing``
  true) and says how to turn it off;
- while vision_ckpt's checkpointing is enabled, the model's ``activation_checkpointing_enable``
  and ``gradient_checkpointing_enable`` raise :class:`~vision_ckpt.ConfigError` instead of
  switching Hugging Face's on. ``Trainer.train()`` calls the first when
  ``TrainingArguments(gradient_checkpointing=True)`` (or ``activation_checkpointing=True``), so
  that combination fails at the start of training with the fix in the message, before a step
  runs. :func:`disable_checkpointing` restores both methods.

Hugging Face's flags stay false under vision_ckpt: ``model.is_activation_checkpointing`` is
``False``, and ``supports_gradient_checkpointing`` does not matter (vision_ckpt also checkpoints
models without it, such as ConvNeXt). The state dict, ``save_pretrained`` files and parameter
names are those of the plain model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vision_ckpt.apply import CheckpointPlan, apply, as_config, remove, self_checkpointing
from vision_ckpt.config import CheckpointConfig
from vision_ckpt.errors import ConfigError
from vision_ckpt.levels import Level, parse_level

__all__ = ["enable_checkpointing", "disable_checkpointing", "hf_checkpointing_on"]

_HF_SWITCHES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
"""The methods of a Hugging Face model that turn its own checkpointing on."""

DEFAULT_LEVEL = Level.MEDIUM_MODULE
"""The level :func:`enable_checkpointing` uses when given neither a level, a config nor a
budget: every transformer layer / block, what Hugging Face's own switch checkpoints."""


class _RefuseHFCheckpointing:
    """Stands in for a model's ``gradient_checkpointing_enable`` (and the ``activation_``
    spelling) while vision_ckpt checkpoints the model; see NOTE [ Hugging Face's own
    checkpointing ]. Picklable and holding no reference to the model, so ``copy.deepcopy``,
    ``pickle`` and ``torch.save(model)`` work as before."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            f"{self.name}() was called on a model that vision_ckpt already checkpoints "
            "(vision_ckpt.integrations.hf.enable_checkpointing); Hugging Face's checkpointing on "
            "top would recompute every layer twice. With Trainer, leave "
            "TrainingArguments(gradient_checkpointing=False, activation_checkpointing=False) (the "
            "default) and choose the memory/speed trade-off with the vision_ckpt level instead; "
            "or call vision_ckpt.integrations.hf.disable_checkpointing(model) first to use "
            "Hugging Face's."
        )

    def __repr__(self) -> str:
        return f"<{self.name} refused: vision_ckpt checkpoints this model>"


def hf_checkpointing_on(model: nn.Module) -> bool:
    """Whether Hugging Face's own activation checkpointing is on anywhere in ``model``
    (``model.is_activation_checkpointing`` for a ``PreTrainedModel``; any module with a true
    ``gradient_checkpointing`` attribute for any model).

    >>> import torch
    >>> hf_checkpointing_on(torch.nn.Linear(2, 2))
    False
    """
    return bool(self_checkpointing(model))


def enable_checkpointing(
    model: nn.Module,
    level: int | str | Level | None = None,
    *,
    config: CheckpointConfig | Mapping[str, Any] | str | Path | None = None,
    memory_budget: int | str | None = None,
    example_input: torch.Tensor | None = None,
    batch_size: int | None = None,
    preset: str = "auto",
    **options: Any,
) -> CheckpointPlan:
    """Checkpoint a Hugging Face (or any) model with vision_ckpt, in place; returns the plan.

    Give at most one of ``level`` and ``config``; with neither, ``memory_budget`` chooses the
    level, and with no budget either the level is 3 (every transformer layer or block, as
    Hugging Face's ``gradient_checkpointing_enable()``). Calling it again replaces what the
    previous call applied.

    Args:
        model: the model, e.g. ``ViTForImageClassification``; its preset (``hf_vit``) is found
            from its class, or the structural fallback derives levels for a model without one.
        level: the training level 0-5 (see ``docs/hf.md`` for what each level checkpoints).
        config: a :class:`~vision_ckpt.CheckpointConfig`, a dict of its keys or a YAML/JSON
            path, applied as :func:`vision_ckpt.apply` does (its ``preset`` and ``rules``).
        memory_budget: a size such as ``"6GiB"``: the lowest level whose predicted peak fits is
            chosen by :func:`vision_ckpt.suggest_level`, measured on ``example_input``. Also
            used when ``config`` has ``training_checkpoint_level: auto``.
        example_input: a batch of ``pixel_values`` for ``memory_budget`` (a few rows are
            enough; larger batches are extrapolated).
        batch_size: the batch size the budget is for (default: ``example_input``'s).
        preset: with ``level`` or a budget: the preset to use, ``"auto"`` to pick it from the
            model's class.
        **options: other :class:`~vision_ckpt.CheckpointConfig` keys with ``level`` or a budget
            (``nesting``, ``rules``, ``selective``...).

    Returns:
        The installed :class:`~vision_ckpt.CheckpointPlan`; ``print(plan)`` shows every
        checkpointed module and the preset rule that chose it.

    Raises:
        ConfigError: Hugging Face's own checkpointing is on; both ``level`` and ``config``
            given; ``memory_budget`` without ``example_input``, or with ``level`` or a config
            that sets a level; ``options`` with ``config``; no level fits the budget; or the
            config does not fit the model.
        LevelError: ``level`` is not 0-5.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    >>> cfg = {"training_checkpoint_level": 2, "rules": [{"match": "*", "level": 2}]}
    >>> plan = enable_checkpointing(net, config=cfg)
    >>> plan.checkpointed
    ('0', '1', '2')
    >>> disable_checkpointing(net)
    3
    """
    if hf_checkpointing_on(model):
        raise ConfigError(
            f"{type(model).__name__} has Hugging Face's own activation checkpointing on "
            "(model.is_activation_checkpointing is True); vision_ckpt on top would recompute "
            "every layer twice. Turn it off first with model.gradient_checkpointing_disable() "
            "and do not pass gradient_checkpointing=True to TrainingArguments; the vision_ckpt "
            "level then decides what is checkpointed."
        )
    if level is not None and config is not None:
        raise ConfigError(
            f"enable_checkpointing got level={level!r} and a config; give one: the level "
            "(with the model's preset), or a config carrying training_checkpoint_level."
        )
    if config is not None and options:
        raise ConfigError(
            f"enable_checkpointing got a config and the options {sorted(options)}; put those "
            "keys in the config instead."
        )
    if memory_budget is not None and level is not None:
        raise ConfigError(
            f"enable_checkpointing got level={level!r} and memory_budget={memory_budget!r}; "
            "give one: the budget chooses the level."
        )

    if config is not None:
        cfg = as_config(config)
        if cfg.training_checkpoint_level == "auto":
            if memory_budget is None:
                memory_budget = cfg.memory_budget
            cfg = cfg.model_copy(update={"training_checkpoint_level": None, "memory_budget": None})
        elif memory_budget is not None and cfg.training_checkpoint_level is not None:
            raise ConfigError(
                f"enable_checkpointing got memory_budget={memory_budget!r} and a config with "
                f"training_checkpoint_level {int(cfg.training_checkpoint_level)}; give one: the "
                "budget chooses the level (leave the config's level out, or set it to auto)."
            )
    else:
        lv = None if level is None else parse_level(level, what="training level")
        cfg = CheckpointConfig(training_checkpoint_level=lv, preset=preset, **options)

    if memory_budget is not None:
        chosen = _level_for_budget(model, cfg, memory_budget, example_input, batch_size)
        cfg = cfg.model_copy(update={"training_checkpoint_level": chosen})
    elif config is None and level is None:
        cfg = cfg.model_copy(update={"training_checkpoint_level": DEFAULT_LEVEL})

    the_plan = apply(model, cfg)
    for name in _HF_SWITCHES:
        if hasattr(model, name):
            model.__dict__[name] = _RefuseHFCheckpointing(name)
    return the_plan


def disable_checkpointing(model: nn.Module) -> int:
    """Undo :func:`enable_checkpointing`: every module gets its own forward back and Hugging
    Face's ``gradient_checkpointing_enable`` works again. Returns how many modules were
    restored (0 when nothing was applied).

    >>> import torch
    >>> disable_checkpointing(torch.nn.Linear(2, 2))
    0
    """
    for name in _HF_SWITCHES:
        if isinstance(model.__dict__.get(name), _RefuseHFCheckpointing):
            del model.__dict__[name]
    return remove(model)


def _level_for_budget(
    model: nn.Module,
    cfg: CheckpointConfig,
    budget: int | str,
    example_input: torch.Tensor | None,
    batch_size: int | None,
) -> Level:
    if example_input is None:
        raise ConfigError(
            f"memory_budget={budget!r} needs example_input=<a batch of pixel_values> to measure "
            "the model's steps on (a few rows are enough: larger batches are extrapolated, "
            "batch_size=... says which); or give level=0..5 instead of a budget."
        )
    from vision_ckpt.profile import suggest_level  # the profiler is loaded only for budgets

    suggestion = suggest_level(model, example_input, budget, batch_size, config=cfg)
    if suggestion.level is None:
        raise ConfigError(f"memory_budget {budget!r}: {suggestion.explain()}")
    return Level(suggestion.level)
