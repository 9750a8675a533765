"""Levels derived by measurement, for a model nobody wrote a preset for (issue 26).

:func:`derive_preset` traces one forward to find the model's candidate regions
(``vision_ckpt.tune._spans``), prices every way of running each of them at the target batch with
the per-block planner's measurements (``vision_ckpt.tune._menus``), and solves the planner's
program at five memory goals between no checkpointing and the least memory the menus reach.
Each level keeps what the level below checkpoints (the plan only grows with the level), so the
five answers are one preset: rules in the bundled presets' vocabulary, readable, editable and
applied like any other. Every level is measured, and the model's physical floor
(``vision_ckpt.measure.peak``) says how far each is from the best any region plan could do.

This module is the derivation's entry (``derive_preset``, ``resolve_derived``); its steps live in
``_candidates`` (the regions a trace offers: NOTE [ Regions from a trace ]), ``_level_search``
(the levels chosen on the menus: NOTE [ Five levels from one menu ]), ``_level_measure`` (the
levels measured, and what the program cannot price tried on top), ``_derived_rules`` (the
levels written as rules) and ``_derived`` (the answer); docs/derive.md has the measurements.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ..config.presets import preset_for_model
from ..config.schema import CheckpointConfig
from ..errors import ConfigError
from ..measure._extrapolate import predict_from_timelines, small_batches
from ..measure._measure import LossFn, Workload, default_loss, model_restored
from ..measure.peak import physical_floor
from ._candidates import CandidateRegions, regions_of
from ._derived import DerivedLevel, DerivedPreset
from ._level_measure import measured_levels, measured_peak, plain_steps
from ._level_search import DERIVE_MENU, inner_apart, small_stages_whole
from ._menus import measure_menus

__all__ = [
    "DerivedLevel",
    "DerivedPreset",
    "CandidateRegions",
    "derive_preset",
    "regions_of",
    "resolve_derived",
]


def _floor_at(model: nn.Module, work: Workload, target: int, loss_fn: LossFn | None) -> int:
    """The physical floor at ``target``: the largest of its operators' lines through their
    values at the small batches (the parameter gradients do not grow with the batch, the
    working sets do, and which operator sets the floor can change between the two)."""
    lines: list[tuple[int, tuple[int, ...]]] = []
    points: list[tuple[int, int]] = []
    for b in small_batches(target):
        found = physical_floor(model, work.batch(b), loss_fn)
        lines.append((b, found.operator_bytes))
        points.append((b, found.floor_bytes))
    # the step ends holding every parameter gradient, whatever the batch
    return max(predict_from_timelines(lines, points, target), found.param_grad_bytes)


def derive_preset(
    model: nn.Module,
    example_input: torch.Tensor,
    batch_size: int | None = None,
    *,
    loss_fn: LossFn | None = None,
    floor: bool = True,
    compare: bool = False,
) -> DerivedPreset:
    """Levels 1-5 for ``model`` at ``batch_size``, derived by measurement: a preset.

    Traces one forward for the candidate regions (NOTE [ Regions from a trace ] in ``_candidates``),
    prices each unit's options at two small batches as the per-block planner does, chooses five
    levels on the resulting memory/time curve that each grow the level below (NOTE [ Five levels
    from one menu ] in ``_level_search``), and measures every level's step peak. Nothing about the
    model's library or classes is used; the model's own checkpointing and any applied config are
    left as they were.

    Args:
        model: the model, on its device, in the state it trains in.
        example_input: one input batch of any size (a sample's shape is what matters).
        batch_size: the batch the levels are for (default: the example's).
        loss_fn: maps the output to a scalar loss (default: mean of squares).
        floor: also measure the physical floor (two more small steps).
        compare: when a bundled preset knows the model, measure its levels' peaks too (ten
            more small steps), for :meth:`DerivedPreset.table`.

    Returns:
        A :class:`DerivedPreset`: ``rules``, ``config(level)``, ``to_yaml()``, each level's step.

    Raises:
        ConfigError: the trace finds nothing to checkpoint.

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
    ...                     *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    ...                       for _ in range(3)])
    >>> found = derive_preset(net, torch.randn(2, 3, 16, 16), batch_size=16, floor=False)
    >>> found.levels[-1].measurement.peak < found.plain.peak
    True
    """
    started = time.perf_counter()
    work = Workload(model, example_input, loss_fn or default_loss, None)
    target = batch_size or work.batch_size
    with model_restored(model, None):
        regions = regions_of(model, work.batch(min(2, work.batch_size)))
        if not regions.units:
            raise ConfigError(
                f"derive_preset found no region to checkpoint in {type(model).__name__}: its "
                "trace has no repeated blocks, runs or submodules. Write rules for it instead."
            )
        base = CheckpointConfig(preset=None, rules=regions.base_rules())
        # modelled prices: the same derivation on every run (NOTE [ A modelled price ])
        outer = [s.name for s in regions.stages if s.kind != "stage"]  # blocks of single layers
        menus = measure_menus(work, target, base, DERIVE_MENU, None, True, outer)
        menus.spans = small_stages_whole(menus, regions)
        alone = inner_apart(menus)
        levels, rules = measured_levels(work, regions, menus, alone, target)
        plain, plain_modelled = plain_steps(work, menus, target)
        floor_bytes = _floor_at(model, work, target, loss_fn) if floor else None
        bundled = preset_for_model(model)
        compared = None
        if compare and bundled is not None:
            own = CheckpointConfig(preset=bundled)
            compared = {k: measured_peak(work, own, k, target) for k in range(1, 6)}
    return DerivedPreset(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        batch_size=target,
        input_shape=tuple(example_input.shape[1:]),
        rules=rules,
        levels=levels,
        plain=plain,
        plain_modelled=plain_modelled,
        floor=floor_bytes,
        seconds=time.perf_counter() - started,
        units=[b.name for b in menus.blocks],
        compared=compared,
        bundled=bundled,
    )


# Derived presets of this process, per model class, sample shape, batch and device.
_DERIVED: dict[tuple[str, tuple[int, ...], int, str], DerivedPreset] = {}


def resolve_derived(
    model: nn.Module,
    example_input: torch.Tensor,
    config: CheckpointConfig | dict[str, Any],
    batch_size: int | None = None,
    *,
    loss_fn: LossFn | None = None,
) -> CheckpointConfig:
    """The config to apply for ``preset: derived``: the derived preset's rules, then the
    config's own (which override them, as after any preset).

    The derivation (:func:`derive_preset`) runs once per model class, sample shape, batch and
    device in a process; later calls reuse it.

    Raises:
        ConfigError: the config's preset is not ``derived``.

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
    ...                     *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    ...                       for _ in range(3)])
    >>> cfg = resolve_derived(net, torch.randn(2, 3, 16, 16),
    ...                       {"preset": "derived", "training_checkpoint_level": 5}, 16)
    >>> cfg.preset is None and len(cfg.rules) > 0
    True
    """
    if isinstance(config, dict):
        config = CheckpointConfig.model_validate(config)
    if config.preset != "derived":
        raise ConfigError(
            f"resolve_derived needs a config with preset 'derived'; got preset "
            f"{config.preset!r}. Apply that config directly instead."
        )
    target = batch_size or int(example_input.shape[0])
    device = next((p.device.type for p in model.parameters()), "cpu")
    key = (
        f"{type(model).__module__}.{type(model).__qualname__}",
        tuple(example_input.shape[1:]),
        target,
        device,
    )
    if key not in _DERIVED:
        _DERIVED[key] = derive_preset(model, example_input, target, loss_fn=loss_fn, floor=False)
    rules = [*_DERIVED[key].rules, *config.rules]
    return config.model_copy(update={"preset": None, "rules": tuple(rules)})
