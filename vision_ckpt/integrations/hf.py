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

NOTE [ Hugging Face's every_n_layers and offload ]

``activation_checkpointing_enable(every_n_layers=n, offload=True)`` counts the model's
``GradientCheckpointingLayer`` modules in ``named_modules()`` order from 0 across the whole
model and checkpoints layer ``i`` when ``i % n == 0`` (layers 0, n, 2n, ...; n = 1 is every
layer); ``offload`` holds what a checkpointed layer keeps for its recomputation (its inputs)
in pinned host memory. :func:`enable_checkpointing` takes both arguments with that meaning,
at the layer level only (level 3, the default: each transformer layer one region):

- the layers are the level-3 regions of the model's preset that are items of a repeated list
  (an ``nn.ModuleList`` / ``nn.Sequential`` child named by its index, e.g. ``vit.layers.4``),
  counted as Hugging Face counts: in module order across the model, from 0. For ViT, DINOv2,
  CLIP, SigLIP and SegFormer these are exactly Hugging Face's layers; on Swin Hugging Face
  also counts its stages, so the two indexings differ there, and ConvNeXt has no switch;
- the choice is written as ordinary rules appended after the preset's, so the plan prints it:
  a layer left out gets ``match: "<list>.<i>"`` at level 0, and so does every module the
  preset selects inside it (``<list>.<i>.mlp``): the whole layer keeps its activations, as
  under Hugging Face; and with ``offload`` a kept layer gets
  ``match: "<list>.<i>"`` at level 3 with ``offload: true`` (which replaces its level-3
  region). Other level-3 regions of the preset (Swin's patch embedding, SegFormer's decode
  head) stay as the preset has them;
- at levels 1-2 (parts of layers), 4-5 (groups of layers), with a config or a memory budget
  "every n-th layer" has no single meaning, so those combinations raise
  :class:`~vision_ckpt.ConfigError`.

Strategy ``offload`` does something on CUDA only; on CPU the plan reports it as a no-op and
:func:`enable_checkpointing` warns once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vision_ckpt.config import CheckpointConfig, LevelRule
from vision_ckpt.config.levels import Level, parse_level
from vision_ckpt.errors import ConfigError
from vision_ckpt.regions.apply import (
    CheckpointPlan,
    apply,
    as_config,
    plan,
    remove,
    self_checkpointing,
)

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
    every_n_layers: int | None = None,
    offload: bool = False,
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
            chosen by :func:`vision_ckpt.tune.suggest_level`, measured on ``example_input``. Also
            used when ``config`` has ``training_checkpoint_level: auto``.
        example_input: a batch of ``pixel_values`` for ``memory_budget`` (a few rows are
            enough; larger batches are extrapolated).
        batch_size: the batch size the budget is for (default: ``example_input``'s).
        preset: with ``level`` or a budget: the preset to use, ``"auto"`` to pick it from the
            model's class.
        every_n_layers: as Hugging Face's ``activation_checkpointing_enable``: of the model's
            repeated transformer layers, counted from 0 in module order, only layers 0, n,
            2n, ... are checkpointed (1: every layer, level 3's plan). Only at level 3 (the
            default); see NOTE [ Hugging Face's every_n_layers and offload ].
        offload: as Hugging Face's ``offload=True``: the checkpointed layers keep their inputs
            in pinned host memory until backward (``offload: true``), on CUDA; on CPU a
            no-op that the plan reports (and a warning, once). Only at level 3.
        **options: other :class:`~vision_ckpt.CheckpointConfig` keys with ``level`` or a budget
            (``nesting``, ``rules``, ``selective``...).

    Returns:
        The installed :class:`~vision_ckpt.CheckpointPlan`; ``print(plan)`` shows every
        checkpointed module and the preset rule that chose it.

    Raises:
        ConfigError: Hugging Face's own checkpointing is on; both ``level`` and ``config``
            given; ``every_n_layers`` not an int >= 1 or ``offload`` not a bool; either of
            them with a level other than 3, a config or a budget, or on a model without
            repeated layers; ``memory_budget`` without ``example_input``, or with ``level``
            or a config that sets a level; ``options`` with ``config``; no level fits the
            budget; or the config does not fit the model.
        LevelError: ``level`` is not 0-5.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    >>> cfg = {"training_checkpoint_level": 2, "rules": [{"match": "*", "level": 2}]}
    >>> plan = enable_checkpointing(net, config=cfg)
    >>> plan.checkpointed
    ('0', '1', '2')
    >>> disable_checkpointing(net)
    3
    >>> layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])
    >>> every_layer = [{"match": "*", "level": 3}]  # a stand-in for an hf_* preset
    >>> enable_checkpointing(layers, every_n_layers=2, preset=None, rules=every_layer).checkpointed
    ('0', '2', '4')
    >>> disable_checkpointing(layers)
    3
    """
    layer_args = _check_layer_args(every_n_layers, offload)
    _refuse_conflicting_args(model, level, config, memory_budget, options)
    cfg, memory_budget = _requested_config(level, config, memory_budget, preset, options)
    _refuse_layer_combination(layer_args, level, config, memory_budget)
    cfg = _with_level(model, cfg, level, config, memory_budget, example_input, batch_size)
    if layer_args:
        cfg = _every_n_layers_config(model, cfg, every_n_layers or 1, offload, layer_args)
    return _apply_refusing_hf(model, cfg, offload)


def _refuse_conflicting_args(
    model: nn.Module,
    level: int | str | Level | None,
    config: object,
    memory_budget: int | str | None,
    options: Mapping[str, Any],
) -> None:
    """Hugging Face's own checkpointing on, or :func:`enable_checkpointing` arguments that
    exclude one another."""
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


def _requested_config(
    level: int | str | Level | None,
    config: CheckpointConfig | Mapping[str, Any] | str | Path | None,
    memory_budget: int | str | None,
    preset: str,
    options: Mapping[str, Any],
) -> tuple[CheckpointConfig, int | str | None]:
    """The config asked for (``config``, or ``level`` with ``preset`` and ``options``) and the
    budget in force: a config at level ``auto`` brings its own unless one was given, and its
    level and budget are cleared so the budget decides."""
    if config is None:
        lv = None if level is None else parse_level(level, what="training level")
        cfg = CheckpointConfig(training_checkpoint_level=lv, preset=preset, **options)
        return cfg, memory_budget
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
    return cfg, memory_budget


def _with_level(
    model: nn.Module,
    cfg: CheckpointConfig,
    level: int | str | Level | None,
    config: object,
    memory_budget: int | str | None,
    example_input: torch.Tensor | None,
    batch_size: int | None,
) -> CheckpointConfig:
    """``cfg`` at the level the budget chooses, or at :data:`DEFAULT_LEVEL` when neither a
    level nor a config was given."""
    if memory_budget is not None:
        chosen = _level_for_budget(model, cfg, memory_budget, example_input, batch_size)
        return cfg.model_copy(update={"training_checkpoint_level": chosen})
    if config is None and level is None:
        return cfg.model_copy(update={"training_checkpoint_level": DEFAULT_LEVEL})
    return cfg


def _apply_refusing_hf(model: nn.Module, cfg: CheckpointConfig, offload: bool) -> CheckpointPlan:
    """Apply ``cfg`` and make Hugging Face's switches refuse while it is applied (NOTE
    [ Hugging Face's own checkpointing ])."""
    the_plan = apply(model, cfg)
    if offload and the_plan.device != "cuda":
        _warn_offload_does_nothing(the_plan.device)
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
    from vision_ckpt.tune.profiling import suggest_level  # the profiler is loaded only for budgets

    suggestion = suggest_level(model, example_input, budget, batch_size, config=cfg)
    if suggestion.level is None:
        raise ConfigError(f"memory_budget {budget!r}: {suggestion.explain()}")
    return Level(suggestion.level)


def _check_layer_args(every_n_layers: object, offload: object) -> str:
    """Validate Hugging Face's two arguments; return how they were given (``""``: neither)."""
    if every_n_layers is not None and (
        isinstance(every_n_layers, bool)
        or not isinstance(every_n_layers, int)
        or every_n_layers < 1
    ):
        raise ConfigError(
            f"every_n_layers={every_n_layers!r}: expected an int >= 1 (1 checkpoints every "
            "layer; n checkpoints layers 0, n, 2n, ... as Hugging Face's "
            "activation_checkpointing_enable(every_n_layers=n)), or None to leave it out."
        )
    if not isinstance(offload, bool):
        raise ConfigError(
            f"offload={offload!r}: expected True or False (True holds the checkpointed layers' "
            "inputs in pinned host memory on CUDA, as Hugging Face's offload=True)."
        )
    given = []
    if every_n_layers is not None:
        given.append(f"every_n_layers={every_n_layers}")
    if offload:
        given.append("offload=True")
    return ", ".join(given)


def _refuse_layer_combination(
    layer_args: str,
    level: int | str | Level | None,
    config: object,
    memory_budget: int | str | None,
) -> None:
    """every_n_layers / offload mean something at the layer level only (NOTE [ Hugging Face's
    every_n_layers and offload ]); ``layer_args`` as :func:`_check_layer_args` returns it, and
    nothing to refuse when it is empty (neither was given)."""
    if not layer_args:
        return
    fix = (
        "they choose which transformer layers are regions at the layer level (3, each layer "
        "one region, the default), as Hugging Face's activation_checkpointing_enable does"
    )
    if config is not None:
        raise ConfigError(
            f"enable_checkpointing got {layer_args} and a config; {fix}. Give level=3 (or no "
            "level) without a config, or write the rules in the config yourself: "
            '{"match": "<layers>.<i>", "level": 0} (and the same for its inner regions) to '
            "leave layer i out, offload: true on a layer's rule to offload it."
        )
    if memory_budget is not None:
        raise ConfigError(
            f"enable_checkpointing got {layer_args} and memory_budget={memory_budget!r}; {fix}, "
            "while the budget chooses a level. Give one of them."
        )
    if level is not None:
        lv = parse_level(level, what="training level")
        if lv != DEFAULT_LEVEL:
            kind = (
                "nothing is checkpointed"
                if lv == Level.NONE
                else "it checkpoints parts of layers"
                if lv < DEFAULT_LEVEL
                else "it checkpoints groups of layers"
            )
            raise ConfigError(
                f"enable_checkpointing got {layer_args} with level={int(lv)}, where {kind}; "
                f"{fix}. Give level=3 (or leave level out), or drop {layer_args}."
            )


def _layer_regions(checkpoint_plan: CheckpointPlan, model: nn.Module) -> list[str]:
    """The repeated layers among the plan's checkpointed whole-layer regions, in module order:
    items of a ModuleList / Sequential (named by their index), outermost only."""
    out: list[str] = []
    for entry in checkpoint_plan.entries:
        rung = entry.rung_at(checkpoint_plan.training_level) if entry.checkpointed else None
        if rung is None or rung.selective or rung.group or rung.through is not None:
            continue
        parent, _, index = entry.name.rpartition(".")
        if not index.isdigit():
            continue
        container = model.get_submodule(parent)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        if any(entry.name.startswith(f"{kept}.") for kept in out):
            continue
        out.append(entry.name)
    return out


def _every_n_layers_config(
    model: nn.Module, cfg: CheckpointConfig, every_n: int, offload: bool, layer_args: str
) -> CheckpointConfig:
    """``cfg`` (at level 3) with rules that keep every ``every_n``-th layer region, offloaded
    when asked (NOTE [ Hugging Face's every_n_layers and offload ])."""
    base = plan(model, cfg)
    layers = _layer_regions(base, model)
    if not layers:
        raise ConfigError(
            f"enable_checkpointing({layer_args}): {type(model).__name__} has no repeated layers "
            f"that its preset ({cfg.preset!r}) checkpoints as whole regions at level 3, so there "
            "is no n-th layer to pick. Give the preset with preset='hf_vit' (see "
            "vision_ckpt.list_presets()), or use level=... without every_n_layers / offload."
        )
    rules: list[LevelRule] = []
    for i, name in enumerate(layers):
        if i % every_n:  # the layer and what the preset selects inside it: no region at all
            rules += [
                LevelRule(match=e.name, level=Level.NONE)
                for e in base.entries
                if (e.name == name or e.name.startswith(f"{name}.")) and e.level != Level.NONE
            ]
        elif offload:
            rules.append(LevelRule(match=name, level=DEFAULT_LEVEL, offload=True))
    return cfg.model_copy(update={"rules": (*cfg.rules, *rules)})


_offload_warned = False


def _warn_offload_does_nothing(device: str | None) -> None:
    global _offload_warned
    if not _offload_warned:
        _offload_warned = True
        warnings.warn(
            f"enable_checkpointing(offload=True): the model is on {device or 'no device'}, "
            "where offload does nothing: its layers are plain full regions (print(plan) says "
            "so). Offload holds their inputs in pinned host memory on CUDA only; move the model "
            "to a GPU before calling enable_checkpointing. (This warning is shown once.)",
            UserWarning,
            stacklevel=3,
        )
