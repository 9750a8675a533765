"""PyTorch Lightning: checkpoint the LightningModule's network before the strategy wraps it.

::

    import lightning as L
    from vision_ckpt.integrations.lightning import CheckpointingCallback

    trainer = L.Trainer(callbacks=[CheckpointingCallback(level=3)])        # or config=...,
    trainer.fit(module)                                                    # or memory_budget=...

The callback applies a training level (with the network's preset), a
:class:`~vision_ckpt.CheckpointConfig`, or the plan that fits a memory budget to the
LightningModule, or to the submodule that holds the network (``module="net"``; found by itself
when exactly one child has a preset), logs the plan on the ``vision_ckpt.integrations.lightning``
logger, and removes it when ``fit`` ends. Importing this module imports ``lightning``
(``pip install "vision_ckpt[lightning]"``); ``import vision_ckpt`` never does.

NOTE [ When the callback applies ]

vision_ckpt's checkpointing must be on the plain modules before DDP or FSDP wraps them (NOTE
[ Order: checkpointing, then DDP or fully_shard ] in ``examples/train_ddp.py``). In Lightning
2.6 ``Trainer._run`` goes: ``strategy.connect(model)``, ``strategy.setup_environment()`` (the
process group), ``Callback.setup(stage="fit")``, ``LightningModule.setup``,
``LightningModule.configure_model``, then ``strategy.setup(trainer)``, which converts the
precision, moves the model to its device, wraps it (``DistributedDataParallel``, or FSDP's
``FullyShardedDataParallel``) and builds the optimizers; ``on_fit_start`` comes after that. So:

- the callback applies in ``setup`` (stage ``fit`` only: validation, test and predict run
  without grad, where nothing is checkpointed anyway);
- a LightningModule that builds its layers in ``configure_model`` has none of them at
  ``setup``: there the callback wraps that module's ``configure_model`` (an instance
  attribute, removed again when it has run once) so that it applies right after it, still
  before ``strategy.setup``;
- a module already sharded with FSDP2's ``fully_shard`` (``ModelParallelStrategy``, in the
  user's ``configure_model``) has renamed classes (``FSDPBlock``) that presets do not know: the
  callback refuses it. Apply vision_ckpt there yourself, before ``fully_shard``.

With a memory budget the plan is measured on rank 0 (the network moved to the strategy's root
device, float32, the optimizer state not counted: optimizers do not exist yet) and broadcast,
so every process checkpoints the same modules. Measuring on the root device before the
strategy moves the model means FSDP's sharding cannot help that measurement: budgets are for
models that fit one device.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"vision_ckpt.integrations.lightning needs PyTorch Lightning ({exc}); install it with "
        'pip install "vision_ckpt[lightning]" (the lightning package, 2.5 or newer).'
    ) from None

from vision_ckpt.config import CheckpointConfig
from vision_ckpt.config.levels import Level, parse_level
from vision_ckpt.config.presets import preset_for_model
from vision_ckpt.errors import ConfigError
from vision_ckpt.regions.apply import CheckpointPlan, apply, as_config, remove

__all__ = ["CheckpointingCallback"]

log = logging.getLogger(__name__)

DEFAULT_LEVEL = Level.MEDIUM_MODULE
"""The level used when the callback is given neither a level, a config nor a budget: every
block / transformer layer, what the libraries' own switches checkpoint."""

BudgetPlan = Literal["level", "blocks"]


class CheckpointingCallback(Callback):
    """Apply vision_ckpt's checkpointing to a LightningModule when ``fit`` sets up.

    Give at most one of ``level``, ``config`` and ``memory_budget`` (none: level 3). See NOTE
    [ When the callback applies ] for the hook it uses and why.

    Args:
        level: the training level 0-5, with the network's preset (``preset``).
        config: a :class:`~vision_ckpt.CheckpointConfig`, a dict of its keys or a YAML/JSON
            path; with ``training_checkpoint_level: auto`` its ``memory_budget`` is planned for
            as below.
        memory_budget: the peak a training step may reach (``"10GiB"`` or bytes: weights,
            gradients and activations; the optimizer state is not measured). ``budget_plan``
            says how it is met; measured on ``example_input``.
        module: qualified name of the submodule to checkpoint (``"net"``, ``"model.backbone"``);
            rules and plans are relative to it. Default: the one child of the LightningModule
            whose class has a preset, when there is exactly one and the config leaves the
            preset to ``auto`` without rules of its own; else the LightningModule itself.
        example_input: an input batch of the network for ``memory_budget`` (a few rows are
            enough; larger batches are extrapolated). Default: the LightningModule's
            ``example_input_array``.
        batch_size: the per-process batch size the budget is for (default: the example's).
        budget_plan: ``"level"``: the lowest uniform level that fits
            (:func:`vision_ckpt.tune.suggest_level`); ``"blocks"``: the fastest per-block mix of
            strategies that fits (:func:`vision_ckpt.tune.plan_for_budget`).
        preset: with ``level`` or a budget: the preset, ``"auto"`` to pick it from the class.
        remove_at_teardown: give the network its own forwards back when ``fit`` ends.
        log_plan: log the plan's table (INFO, rank 0) besides the one-line summary.
        **options: other :class:`~vision_ckpt.CheckpointConfig` keys with ``level`` or a budget
            (``nesting``, ``rules``, ``selective``...).

    Attributes:
        plan: the installed :class:`~vision_ckpt.CheckpointPlan` (``None`` before ``fit``).
        module_name: the checkpointed module's name in the LightningModule (``""``: itself).

    Raises:
        ConfigError: at construction, for arguments that do not go together; at ``fit``, when
            the submodule is missing, no ``example_input`` is there for a budget, nothing fits
            the budget, or the network is already sharded by FSDP2.

    >>> cb = CheckpointingCallback(level=2, nesting="all")
    >>> cb.config.training_checkpoint_level, cb.config.nesting
    (<Level.SMALL_BLOCK: 2>, 'all')
    >>> CheckpointingCallback(level=2, memory_budget="1GiB")
    Traceback (most recent call last):
    ...
    vision_ckpt.errors.ConfigError: CheckpointingCallback got level=2 and memory_budget='1GiB'; ...
    """

    def __init__(
        self,
        level: int | str | Level | None = None,
        *,
        config: CheckpointConfig | Mapping[str, Any] | str | Path | None = None,
        memory_budget: int | str | None = None,
        module: str | None = None,
        example_input: torch.Tensor | None = None,
        batch_size: int | None = None,
        budget_plan: BudgetPlan = "level",
        preset: str = "auto",
        remove_at_teardown: bool = True,
        log_plan: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        given = [
            f"{name}={value!r}"
            for name, value in (("level", level), ("memory_budget", memory_budget))
            if value is not None
        ]
        if config is not None:
            given.append("a config")
        if len(given) > 1:
            raise ConfigError(
                f"CheckpointingCallback got {' and '.join(given)}; give one: a level (with the "
                "network's preset), a config, or a memory budget that chooses the plan (a "
                "config with training_checkpoint_level: auto carries its own budget)."
            )
        if config is not None and options:
            raise ConfigError(
                f"CheckpointingCallback got a config and the options {sorted(options)}; put "
                "those keys in the config instead."
            )
        if budget_plan not in ("level", "blocks"):
            raise ConfigError(
                f"budget_plan={budget_plan!r}; allowed: 'level' (the lowest uniform level that "
                "fits) or 'blocks' (a plan per block)."
            )
        if config is not None:
            cfg = as_config(config)
            if cfg.training_checkpoint_level == "auto":
                memory_budget = cfg.memory_budget
                cfg = cfg.model_copy(
                    update={"training_checkpoint_level": None, "memory_budget": None}
                )
        else:
            lv = (
                None
                if memory_budget is not None
                else parse_level(DEFAULT_LEVEL if level is None else level, what="training level")
            )
            cfg = CheckpointConfig(training_checkpoint_level=lv, preset=preset, **options)
        self.config: CheckpointConfig = cfg
        """The config to apply (for a budget: the rules, the level still to choose)."""
        self.memory_budget = memory_budget
        self.module = module
        self.example_input = example_input
        self.batch_size = batch_size
        self.budget_plan: BudgetPlan = budget_plan
        self.remove_at_teardown = remove_at_teardown
        self.log_plan = log_plan
        self._auto_target = config is None or (cfg.preset == "auto" and not cfg.rules)
        self.plan: CheckpointPlan | None = None
        self.module_name: str | None = None
        self._target: nn.Module | None = None
        self._deferred: LightningModule | None = None

    # ---------------------------------------------------------------------------------------
    # Lightning hooks
    # ---------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if is_overridden("configure_model", pl_module):
            self._defer(trainer, pl_module)
        else:
            self._apply(trainer, pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._undefer()
        if self.remove_at_teardown and self._target is not None:
            remove(self._target)
            self._target = None

    # ---------------------------------------------------------------------------------------

    def _defer(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Apply right after the module's own ``configure_model`` (NOTE [ When the callback
        applies ]): an instance attribute that runs it, then removes itself and applies."""
        self._undefer()  # left over from a fit that failed before configure_model ran
        original = pl_module.configure_model

        @functools.wraps(original)
        def configure_model_then_checkpoint() -> None:
            original()
            self._undefer()
            self._apply(trainer, pl_module)

        pl_module.__dict__["configure_model"] = configure_model_then_checkpoint
        self._deferred = pl_module

    def _undefer(self) -> None:
        if self._deferred is not None:
            self._deferred.__dict__.pop("configure_model", None)
            self._deferred = None

    def _apply(self, trainer: Trainer, pl_module: LightningModule) -> None:
        name, target = self._resolve_target(pl_module)
        _refuse_sharded(target, name)
        cfg = self.config
        detail = ""
        if self.memory_budget is not None:
            cfg, detail = self._plan_budget(trainer, pl_module, target, self.memory_budget)
        elif cfg.preset == "derived":
            cfg, detail = self._derive(trainer, pl_module, target)
        the_plan = apply(target, cfg)
        self.plan, self.module_name, self._target = the_plan, name, target
        if trainer.is_global_zero:
            where = f"{type(pl_module).__name__}.{name}" if name else type(pl_module).__name__
            log.info(
                "vision_ckpt: %s: %d of %d planned modules checkpointed at training level %s%s",
                where,
                len(the_plan.checkpointed),
                len(the_plan),
                _level_text(the_plan),
                f" ({detail})" if detail else "",
            )
            if self.log_plan:
                log.info("%s", the_plan)

    def _resolve_target(self, pl_module: LightningModule) -> tuple[str, nn.Module]:
        if self.module is not None:
            try:
                return self.module, pl_module.get_submodule(self.module)
            except AttributeError:
                children = ", ".join(n for n, _ in pl_module.named_children()) or "(none)"
                raise ConfigError(
                    f"CheckpointingCallback(module={self.module!r}): "
                    f"{type(pl_module).__name__} has no such submodule (its children: "
                    f"{children}); give the attribute that holds the network, or module=None "
                    "for the LightningModule itself."
                ) from None
        if self._auto_target and preset_for_model(pl_module) is None:
            with_preset = [
                (n, m) for n, m in pl_module.named_children() if preset_for_model(m) is not None
            ]
            if len(with_preset) == 1:
                return with_preset[0]
        return "", pl_module

    def _plan_budget(
        self, trainer: Trainer, pl_module: LightningModule, target: nn.Module, budget: int | str
    ) -> tuple[CheckpointConfig, str]:
        example = self.example_input
        if example is None:
            example = getattr(pl_module, "example_input_array", None)
        if not isinstance(example, torch.Tensor):
            raise ConfigError(
                f"CheckpointingCallback(memory_budget={budget!r}) needs an input "
                "batch of the network to measure on: pass example_input=<tensor> (a few rows "
                "are enough; batch_size=... says which batch the budget is for) or set the "
                "LightningModule's example_input_array; or give level=0..5 instead."
            )
        answer: tuple[CheckpointConfig | None, str] = (None, "")
        if trainer.is_global_zero:
            answer = self._measure(trainer, target, example, budget)
        cfg, detail = trainer.strategy.broadcast(answer, src=0)
        if cfg is None:
            raise ConfigError(f"CheckpointingCallback memory_budget: {detail}")
        return cfg, detail

    def _derive(
        self, trainer: Trainer, pl_module: LightningModule, target: nn.Module
    ) -> tuple[CheckpointConfig, str]:
        """``preset: derived``: levels derived on the example input by the global-zero process
        (``vision_ckpt.tune.derive.resolve_derived``), broadcast to the others."""
        from vision_ckpt.tune.derive import resolve_derived  # measured only here

        example = self.example_input
        if example is None:
            example = getattr(pl_module, "example_input_array", None)
        if not isinstance(example, torch.Tensor):
            raise ConfigError(
                "CheckpointingCallback with preset 'derived' needs an input batch of the "
                "network to measure on: pass example_input=<tensor> (batch_size=... says which "
                "batch the levels are for) or set the LightningModule's example_input_array."
            )
        cfg: CheckpointConfig | None = None
        if trainer.is_global_zero:
            device = trainer.strategy.root_device
            target.to(device)
            cfg = resolve_derived(target, example.to(device), self.config, self.batch_size)
        cfg = trainer.strategy.broadcast(cfg, src=0)
        assert cfg is not None
        return cfg, "levels derived by measurement"

    def _measure(
        self, trainer: Trainer, target: nn.Module, example: torch.Tensor, budget: int | str
    ) -> tuple[CheckpointConfig | None, str]:
        from vision_ckpt.tune.profiling import plan_for_budget, suggest_level  # measured only here

        device = trainer.strategy.root_device
        target.to(device)  # the strategy moves the whole module there next anyway
        example = example.to(device)
        if self.budget_plan == "blocks":
            result = plan_for_budget(target, example, budget, self.batch_size, config=self.config)
            return result.config, result.explain()
        suggestion = suggest_level(target, example, budget, self.batch_size, config=self.config)
        if suggestion.level is None:
            return None, suggestion.explain()
        level = Level(suggestion.level)
        return self.config.model_copy(update={"training_checkpoint_level": level}), (
            suggestion.explain()
        )


def _level_text(the_plan: CheckpointPlan) -> str:
    if the_plan.pinned_training_level is None:
        return f"{int(the_plan.training_level)} (the global level, which can change)"
    return str(int(the_plan.training_level))


def _refuse_sharded(target: nn.Module, name: str) -> None:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for sub_name, sub in target.named_modules():
        if isinstance(sub, (FSDPModule, FullyShardedDataParallel)):
            where = ".".join(p for p in (name, sub_name) if p) or "the LightningModule"
            raise ConfigError(
                f"CheckpointingCallback: {where} ({type(sub).__name__}) is already sharded "
                "by FSDP; presets and plans name the unsharded classes. Apply vision_ckpt in "
                "configure_model before fully_shard (vision_ckpt.apply(self.net, config)) "
                "and leave this callback out."
            )
