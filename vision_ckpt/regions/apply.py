"""From a config to a checkpointed model: ``plan`` (pure), ``apply`` and ``remove``.

:func:`plan` resolves a :class:`~vision_ckpt.CheckpointConfig` against one model: the preset's
rules (if any) and then the config's rules are matched against ``model.named_modules()``, the last
matching rule deciding each module's level. It runs no forward and changes nothing, so a plan can
be printed, compared and tested without running the model.

:func:`apply` installs a plan in place. It does not insert wrapper modules into the tree: each
selected module gets an instance-level ``forward`` (a small picklable object) that decides at
every call whether to run the class's forward through the checkpoint core. So the state dict,
``named_modules()``, parameters and hooks of the model are exactly those of the plain model, a
state dict moves freely between the two, ``copy.deepcopy`` and ``pickle`` work, and
:func:`remove` restores the model by deleting those attributes.

This module is the subpackage's public face and owns installing and removing; the plan record
is ``_plan_record``'s, and ``plan()`` with its rule checks ``_planning``'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from ..config.levels import Level, parse_level
from ..config.schema import CheckpointConfig, KeepOps
from ..errors import ConfigError
from ..runtime._selective import SaveOps
from ..runtime.wrapper import Policy
from ._install import install, install_chain, uninstall
from ._plan_record import CheckpointPlan, PlanEntry, run_label
from ._planning import ConfigLike, as_config, plan, run_members

__all__ = [
    "PlanEntry",
    "CheckpointPlan",
    "plan",
    "apply",
    "remove",
    "apply_preset",
    "as_config",
    "self_checkpointing",
]


def apply(model: nn.Module, config: ConfigLike | CheckpointPlan) -> CheckpointPlan:
    """Install checkpointing on the modules a config (or a plan) selects, in place.

    Each selected module with a level of at least 1 gets an instance-level ``forward`` that
    checkpoints the module's own forward when its level is within the training level (the
    config's, or the global one: changing it takes effect at the next forward), the module is
    in training mode and grad is enabled. Applying again first removes what a previous
    :func:`apply` installed, so applying twice equals applying once. The state dict, parameters,
    ``named_modules()`` and numerics of the model are unchanged.

    Args:
        model: the model to modify in place.
        config: a :class:`CheckpointConfig`, a dict of its keys, a .yaml/.json path, or a
            :class:`CheckpointPlan` made by :func:`plan` for this model.

    Returns:
        The plan that was installed.

    Raises:
        ConfigError: as :func:`plan`; or the plan names a module this model does not have; or
            the model's own gradient checkpointing (Hugging Face's) is on.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    >>> p = apply(net, {"training_checkpoint_level": 2, "rules": [{"match": "*", "level": 2}]})
    >>> net(torch.randn(3, 4, requires_grad=True)).sum().backward()
    >>> remove(net)
    3
    """
    the_plan = config if isinstance(config, CheckpointPlan) else plan(model, config)
    installs = []
    for entry in the_plan.entries:
        try:
            module = model.get_submodule(entry.name)
        except AttributeError:
            module = None
        if module is None or type(module).__name__ != entry.class_name:
            found = "not found" if module is None else f"a {type(module).__name__}"
            raise ConfigError(
                f"the plan does not fit this model: it has module {entry.name!r} as a "
                f"{entry.class_name}, the model has {found}. Make the plan with "
                "vision_ckpt.plan(model, config) for this very model."
            )
        installs.append((entry, module))
    _refuse_a_second_checkpointer(model)
    remove(model)
    shared: dict[KeepOps, SaveOps] = {}  # one per keep policy: it tracks the ops met
    runs = {
        entry.name: run_members(model, entry.name, entry.through, f"the plan's {entry.name!r}")
        for entry, _ in installs
        if entry.through is not None
    }
    in_runs = {n for names in runs.values() for n in names}
    install(
        (module, entry.name, _policy(the_plan, entry, shared))
        for entry, module in installs
        # never checkpointed or lean: leave it untouched
        if (entry.rungs or entry.lean is not None) and entry.name not in in_runs
    )
    own = {  # a later member's rungs for calls outside its run (NOTE [ Runs take over ], _planning)
        e.name: _policy(the_plan, e, shared)
        for e, _ in installs
        if e.name in in_runs and e.name not in runs
    }
    for entry, _ in installs:
        if entry.name in runs:
            names = runs[entry.name]
            # a group's first layer keeps its rungs below the run inside it too (NOTE [ Groups of
            # a ModuleList ] in _planning); another run's first module's rungs never nest in it
            group = any(r.layer_group_run for r in entry.rungs)
            if group:
                alone = replace(entry, rungs=tuple(r for r in entry.rungs if r.through is None))
                own[entry.name] = _policy(the_plan, alone, shared)
            install_chain(
                [(model.get_submodule(n), n, own.get(n)) for n in names],
                _policy(the_plan, entry, shared),
                run_label(entry),
                nested=group,
            )
    return the_plan


def self_checkpointing(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that checkpoint themselves: Hugging Face's own
    switch sets ``gradient_checkpointing = True`` on each layer it checkpoints.

    >>> import torch
    >>> self_checkpointing(torch.nn.Linear(2, 2))
    []
    """
    return [
        n or "(the model)"
        for n, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
    ]


def _refuse_a_second_checkpointer(model: nn.Module) -> None:
    """Hugging Face models checkpoint their layers themselves when ``gradient_checkpointing`` is
    on; our regions inside and around theirs would be recomputed in one of torch's runs of a
    layer and not in the other (torch then fails at backward). One checkpointer at a time."""
    on = self_checkpointing(model)
    if on:
        raise ConfigError(
            f"{type(model).__name__} checkpoints itself: gradient_checkpointing is on in "
            f"{', '.join(on[:3])}{' ...' if len(on) > 3 else ''}. Turn it off first "
            "(model.gradient_checkpointing_disable()), or use "
            "vision_ckpt.integrations.hf.enable_checkpointing(model, level), which does."
        )


def _policy(the_plan: CheckpointPlan, entry: PlanEntry, shared: dict[KeepOps, SaveOps]) -> Policy:
    rungs = []
    for r in entry.rungs:
        context_fn = None
        if r.keep is not None:
            if r.keep not in shared:
                shared[r.keep] = SaveOps.for_keep(r.keep)
            context_fn = shared[r.keep]
        rungs.append(replace(r, context_fn=context_fn))
    return Policy(
        tuple(rungs),
        the_plan.pinned_training_level,
        the_plan.nesting,  # type: ignore[arg-type]
        the_plan.preserve_rng_state,
        entry.holds_several,
        entry.lean,
        entry.nests_full,
        own_subgraph=True,
    )


def remove(model: nn.Module) -> int:
    """Undo :func:`apply`: give every module back the forward it had. Returns how many.

    >>> import torch
    >>> remove(torch.nn.Linear(2, 2))
    0
    """
    return uninstall(model)


def apply_preset(
    model: nn.Module, level: int | str | Level, preset: str = "auto", **options: Any
) -> CheckpointPlan:
    """Apply a preset's levels at training level ``level``: ``apply_preset(model, 3)``.

    Args:
        model: the model to modify in place.
        level: the training level 0-5 for this model.
        preset: a family name (see ``vision_ckpt.list_presets()``) or ``"auto"`` to choose it
            from the model's class.
        **options: other :class:`CheckpointConfig` keys (``nesting``, ``rules``...).

    Returns:
        The installed plan.

    Raises:
        LevelError: ``level`` is not 0-5.
        ConfigError: no preset fits, or an option is invalid.
    """
    lv = parse_level(level, what="training level")
    cfg = CheckpointConfig(training_checkpoint_level=lv, preset=preset, **options)
    return apply(model, cfg)
