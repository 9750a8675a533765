"""The per-block planner's candidates, and the configs that run a strategy per block.

Owns what the planner reads off a plan before it measures anything: the candidate blocks (the
plan's finest repeated blocks and the modules outside them, ``candidate_blocks``), the blocks of
a selective stage taken one by one (``with_stage_blocks``), the stages that hold a run of them
(``stage_groups``), and the other way round, the config whose rules run one strategy per block
(``strategy_config``), in the levels of ``STRATEGY_LEVEL``. Pure: no forward runs here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..config.levels import Level
from ..config.matching import exact_name_pattern
from ..config.schema import CheckpointConfig, LevelRule
from ..regions.apply import plan as _plan

__all__ = [
    "STRATEGY_LEVEL",
    "candidate_blocks",
    "with_stage_blocks",
    "block_run",
    "stage_groups",
    "strategy_config",
    "run_ends",
    "inner_rules",
    "only_rules",
]

# The levels the planner's config gives each strategy: a selective block is a rung of its own
# (level 1), full blocks are medium modules (3), the inner regions of nested blocks small ones
# (2); a training level of 3 then runs exactly the chosen strategies.
STRATEGY_LEVEL = {
    "selective": Level(1),
    "selective_below": Level(1),
    "full": Level(3),
    "nested": Level(3),
}
_INNER_LEVEL = Level(2)
_TRAINING_LEVEL = Level(3)


def candidate_blocks(plan: Any) -> list[Any]:
    """Non-overlapping blocks to choose from: the plan's entries at the finest level that covers
    repeated blocks (level 3 with the whole blocks of level 2 if present, but not a stack of
    them, else 2, else 4), and the outermost entries outside them, in forward order."""
    by_level: dict[int, list[Any]] = {}
    for entry in plan.entries:
        for rung in entry.rungs or ():
            by_level.setdefault(int(rung.level), []).append(entry)
            if int(rung.level) == 2 and not rung.selective and not rung.group:
                # whole from level 2 on: a block of a preset that recomputes its memory-dense
                # blocks first (ResNet's layer1-2), one of level 3's blocks
                by_level.setdefault(3, []).append(entry)
        if not entry.rungs and entry.lean is None:  # a lean MLP alone is not a block
            by_level.setdefault(int(entry.level), []).append(entry)
    for level in (3, 2, 4, 1, 5):
        entries = by_level.get(level, [])
        entries = list({e.name: e for e in entries}.values())  # once each
        if level in (2, 3):
            # a stage a preset recomputes from level 3 (ResNet's layer1) is not a block: it
            # holds several of them
            entries = [e for e in entries if not _holds_repeats(e, entries)]
        names = [e.name for e in entries]
        independent = [
            e for e in entries if not any(o != e.name and e.name.startswith(o + ".") for o in names)
        ]
        if independent:
            # ... plus the plan's modules outside all of them (a stem's max pool, whose indices
            # are kept for backward), in the plan's (forward) order
            chosen = {e.name for e in independent}
            outside = [
                e.name
                for e in plan.entries
                if e.name and not any(_related(e.name, c) for c in chosen)
            ]
            keep = chosen | {
                n for n in outside if not any(o != n and n.startswith(o + ".") for o in outside)
            }
            return [e for e in plan.entries if e.name in keep]
    return []


def with_stage_blocks(model: torch.nn.Module, base: CheckpointConfig, plan: Any) -> Any:
    """``plan`` again with the numbered blocks of each selective stage that holds no planned
    module (EfficientNet's later stages, selective at every level of its preset) whole at level
    3, so that the planner chooses per block there too, not per stage."""
    planned = [e.name for e in plan.entries]
    blocks = []
    for entry in plan.entries:
        rungs = entry.rungs or ()
        if not entry.name or not rungs or any(not r.selective for r in rungs):
            continue
        if any(n.startswith(entry.name + ".") for n in planned):
            continue
        children = list(model.get_submodule(entry.name).named_children())
        if children and all(n.isdigit() for n, _ in children):
            if len({type(m) for _, m in children}) == 1:
                blocks += [f"{entry.name}.{n}" for n, _ in children]
    if not blocks:
        return plan
    rules = [*base.rules, *(LevelRule(match=exact_name_pattern(n), level=3) for n in blocks)]
    return _plan(model, base.model_copy(update={"rules": rules}))


def block_run(entry: Any) -> str | None:
    """The last sibling of the run that ``entry``'s block is (a stem's ``through``), or
    ``None``; a group of a ModuleList's layers is a run too, but its block is the first layer
    alone (NOTE [ Groups of a ModuleList ] in ``_planning``)."""
    return next(
        (r.through for r in entry.rungs or () if r.through and not r.layer_group_run),
        None,
    )


def _holds_repeats(entry: Any, entries: list[Any]) -> bool:
    """Whether two or more of ``entries`` inside ``entry`` are consecutive numbered blocks of
    one class under one parent (``layer1.0``, ``layer1.1``: a stack), not a block's named parts
    (``attn_block``, ``attn_grid`` of a MaxViT block) nor the layers of a container that holds
    a block's weights (``block.0``, ``block.3``, ``block.5`` of torchvision's ConvNeXt block:
    a convolution and two linear layers, with a norm and activations between them)."""
    numbered: dict[tuple[str, int], str] = {}
    for e in entries:
        parent, _, index = e.name.rpartition(".")
        if e.name.startswith(entry.name + ".") and index.isdigit():
            numbered[(parent, int(index))] = e.class_name
    return any(
        numbered.get((parent, index + 1)) == kind for (parent, index), kind in numbered.items()
    )


def _held_blocks(names: Sequence[str], module: str) -> tuple[int, int] | None:
    """``(first, last)`` of the candidate blocks inside ``module`` when there are two or more
    and they are consecutive, else ``None``."""
    inside = [i for i, n in enumerate(names) if n.startswith(module + ".")]
    if len(inside) < 2 or inside != list(range(inside[0], inside[-1] + 1)):
        return None
    return inside[0], inside[-1]


def stage_groups(
    plan: Any, names: Sequence[str], outer: Sequence[str] = ()
) -> list[tuple[str, int, int]]:
    """``(module, first, last)`` for the innermost plan entries (not the model itself) that hold
    two or more consecutive candidate blocks and no other candidate: the stages; a module of
    ``outer`` that holds such blocks is a stage in place of those inside it."""
    out = []
    for entry in plan.entries:
        held = _held_blocks(names, entry.name) if entry.name else None
        if held is None:
            continue
        if any(n != entry.name and n.startswith(entry.name + ".") for n, _, _ in out):
            continue
        out = [g for g in out if not entry.name.startswith(g[0] + ".")]  # keep the innermost
        out.append((entry.name, *held))
    for name in outer:
        held = _held_blocks(names, name)
        if held is None or any(name.startswith(g + ".") for g, _, _ in out):
            continue
        out = [g for g in out if g[0] != name and not g[0].startswith(name + ".")]
        out = sorted([*out, (name, *held)], key=lambda g: g[1])
    return out


def _related(a: str, b: str) -> bool:
    """Whether one of the two qualified names is the other or inside it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def strategy_config(
    base: CheckpointConfig,
    entries: Sequence[Any],
    strategies: dict[str, str],
    inner_of: dict[str, list[str]],
    stage_of: dict[str, str] | None = None,
    below: int | None = None,
) -> CheckpointConfig:
    """A config that runs ``strategies`` (block -> strategy) and nothing else; a block whose
    strategy is ``stage`` makes its stage (``stage_of``) one selective region; one whose
    strategy is ``selective_below`` or ``stage_below`` redoes the products under ``below`` FLOPs
    per output.

    Its rules replace the base config's and its preset (a module keeps a rung per strategy, so
    a rule could not switch off the preset's other rung); the base's run options stay."""
    stages = {
        (stage_of or {})[b]: _keep_of(s, below)
        for b, s in strategies.items()
        if s in ("stage", "stage_below")
    }
    ends = run_ends(entries)
    rules = []
    for entry in entries:
        if entry.name in stages:
            rules.append(
                LevelRule(
                    match=exact_name_pattern(entry.name),
                    level=STRATEGY_LEVEL["selective"],
                    keep=stages[entry.name],
                )
            )
            continue
        strategy = strategies.get(entry.name, "keep")
        if strategy in ("keep", "stage", "stage_below"):
            continue
        if strategy == "inner":  # NOTE [ Inner regions alone ] in _level_search
            rules += inner_rules(ends, inner_of[entry.name])
            continue
        rules.append(
            LevelRule(
                match=exact_name_pattern(entry.name),
                level=STRATEGY_LEVEL[strategy],
                keep=_keep_of(strategy, below),
                through=None if strategy.startswith("selective") else block_run(entry),
            )
        )
        if strategy == "nested":
            rules += inner_rules(ends, inner_of[entry.name])
    return only_rules(base, rules)


def _keep_of(strategy: str, below: int | None) -> Any:
    """What a region of ``strategy`` keeps, as a rule's ``keep``."""
    if strategy.endswith("_below"):  # NOTE [ Products cheap to redo ] in _price
        return {"ops": "heavy", "below": below}
    return "heavy" if strategy in ("selective", "stage") else None


def run_ends(entries: Sequence[Any]) -> dict[str, str]:
    """Entry name -> the last sibling of the run it starts (``block_run``), for the runs."""
    return {e.name: end for e in entries if (end := block_run(e)) is not None}


def inner_rules(ends: dict[str, str], names: Sequence[str]) -> list[LevelRule]:
    """Rules that make the inner regions ``names`` of blocks regions on their own, each with
    its span (``ends``: ``run_ends``): a run of siblings stays a run (``conv_pw`` through
    ``bn1``), else the module."""
    return [
        LevelRule(match=exact_name_pattern(n), level=_INNER_LEVEL, through=ends.get(n))
        for n in names
    ]


def only_rules(base: CheckpointConfig, rules: Sequence[LevelRule]) -> CheckpointConfig:
    return base.model_copy(
        update={
            "preset": None,
            "rules": tuple(rules),
            "training_checkpoint_level": _TRAINING_LEVEL,
            "nesting": "all",
        }
    )
