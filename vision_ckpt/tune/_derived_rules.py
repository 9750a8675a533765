"""The derived levels written as rules, in the bundled presets' vocabulary.

Owns the translation of a mix per level (unit -> way) into "from level k on" rules
(``emit_rules``): per unit and stage the rung of each way from the first level that uses it,
one rung per way of a module (NOTE [ One rung per way ]), runs of units recomputed as one (NOTE
[ Runs of units ]), stacks as groups, lean MLPs outside runs and the structural fallback's
regions; and the check that every rule written decides a rung (``lost_rules``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..config.levels import Level
from ..config.matching import exact_name_pattern
from ..config.presets import fallback_rules
from ..config.schema import CheckpointConfig, LevelRule
from ..errors import ConfigError
from ..regions.apply import plan
from ._candidates import CandidateRegions, is_inside, run_span, span_rule
from ._menus import Menus
from ._spans import Span

__all__ = [
    "emit_rules",
    "lost_rules",
    "lean_outside_runs",
    "RECOMPUTED",
    "group_stacks",
    "merged_runs",
    "fallback_at",
]


def _first(sequence: Sequence[str], wanted: Sequence[str]) -> int | None:
    """The first level (1-based) whose strategy is one of ``wanted``."""
    return next((k + 1 for k, s in enumerate(sequence) if s in wanted), None)


def emit_rules(
    regions: CandidateRegions,
    menus: Menus,
    per_level: Sequence[dict[str, str]],
    lean_from: int | None,
    groups_from: int | None = None,
    groups: Sequence[Span] = (),
    whole_from: int | None = None,
    fallback: Sequence[LevelRule] = (),
    runs: Sequence[tuple[Span, int]] = (),
) -> list[LevelRule]:
    """Rules that run ``per_level[k - 1]`` at training level k (NOTE [ Five levels from one
    menu ] in ``_level_search``): per unit a selective rung, one redoing its cheap products, a full
    rung and its inner regions (nested, or alone: NOTE [ Inner regions alone ] in
    ``_level_search``), each from the first level that uses it; per stage the same for its ways;
    runs of units (NOTE [ Runs of units ])."""
    spans = regions.named()
    rules: list[LevelRule] = []
    cheap = {"ops": "heavy", "below": menus.below}  # NOTE [ Products cheap to redo ] in _price
    for stage in dict.fromkeys(menus.stage_of.values()):
        inside = [b.name for b in menus.blocks if menus.stage_of.get(b.name) == stage]
        ways = [lv.get(inside[0], "keep") for lv in per_level]
        # the planner's stage is a module: a traced stage, or one holding two units of the
        # trace's (GhostNet's shortcut holds two cut runs)
        module = Span("module", stage, (stage,), 0)
        first = _first(ways, ("stage",))
        if first is not None:
            rules.append(span_rule(module, first, keep="heavy"))
        below = _first(ways, ("stage_below",))
        if below is not None:
            rules.append(span_rule(module, below, keep=cheap))
        held = _first(ways, ("held", "held_nested"))
        if held is not None:
            rules.append(span_rule(module, held))
    for block in menus.blocks:
        sequence = [lv.get(block.name, "keep") for lv in per_level]
        span = spans[block.name]
        selective = _first(sequence, ("selective",))
        below = _first(sequence, ("selective_below",))
        full = _first(sequence, ("full", "nested", "held_nested"))
        inside = _first(sequence, ("inner", "nested"))
        if selective is not None:
            rules.append(span_rule(span, selective, keep="heavy"))
        if below is not None:
            rules.append(span_rule(span, below, keep=cheap))
        if full is not None:
            rules.append(span_rule(span, full))
        if inside is not None:  # the inner regions the planner priced, with their spans
            rules += [span_rule(spans[n], inside) for n in menus.inner_of[block.name]]
    if groups_from is not None:
        rules += [span_rule(g, groups_from, segments="auto") for g in groups]
    for run, runs_from in runs:  # NOTE [ Runs of units ]
        members = {exact_name_pattern(m) for m in run.members}
        # a member's own full region from the run's level on would run nowhere
        rules = [
            r
            for r in rules
            if not (
                r.match in members
                and r.level >= runs_from
                and not (r.lean or r.offload)
                and r.keep is None
                and r.segments is None
            )
        ]
        rules.append(span_rule(run, runs_from))
    if whole_from is not None:
        rules += [span_rule(s, whole_from) for s in regions.stages]
    if fallback:  # first, so that the derived rules win where both set a module's way
        rules = [*fallback, *rules]
    if lean_from is not None:
        rules += [span_rule(s, lean_from, lean=True) for s in lean_outside_runs(regions, rules)]
    # a unit missing from a level's plan (a level marked as level 0's) is kept there
    return _one_rung_per_way(rules)


# NOTE [ One rung per way ]
#
# A config gives a module one rung per way of checkpointing it (``LevelRule.way``: a region's keep,
# segments, through and offload, or lean): a later rule of the same way replaces the earlier one, at
# whatever level (``apply.plan``), so that a user's rule can move a preset's region to another
# level. The derivation's rules are "from level k on", and two of its sources can name the same way
# of one module: a stage held from level 2 (its own full region) and the whole stages tried at level
# 5 (every stage full again) were both emitted. Applied, the level-5 rule replaced the level-2 one,
# so levels 2-4 ran without that region: MAnet at batch 32 measured 1358 MiB at level 2 during its
# derivation and 1573 MiB from the preset it wrote. The lower rule already covers every level above
# it, so the later one of the same way is dropped here, where every measured plan and the written
# preset are made: what is measured is what is written. A rule at the same level or lower still
# replaces, as it does when applied (the fallback's regions come first so that the derived ones
# win). ``lost_rules`` checks the result against the plan the config makes.


def _one_rung_per_way(rules: Sequence[LevelRule]) -> list[LevelRule]:
    """``rules`` without a rule whose way an earlier rule at a lower level already gives the
    same module (NOTE [ One rung per way ])."""
    kept: list[LevelRule | None] = []
    at: dict[tuple[Any, ...], int] = {}
    for rule in rules:
        way = (rule.match, rule.match_type, rule.way)
        earlier = at.get(way)
        if earlier is not None:
            first = kept[earlier]
            if first is not None and first.level < rule.level:
                continue
            kept[earlier] = None  # replaced, as applying it would
        at[way] = len(kept)
        kept.append(rule)
    return [r for r in kept if r is not None]


def lost_rules(model: nn.Module, rules: Sequence[LevelRule]) -> list[str]:
    """The rules of ``rules`` that decide no rung in the plan they make (a later rule replaced
    them): none, for the derivation's own (NOTE [ One rung per way ])."""
    config = CheckpointConfig(preset=None, rules=list(rules))
    used = {text for e in plan(model, config) for text in e.rule.split("; ")}
    return [str(r) for r in rules if str(r) not in used]


def lean_outside_runs(regions: CandidateRegions, rules: Sequence[LevelRule]) -> list[Span]:
    """The lean MLPs that no run of ``rules`` holds and that hold no region of ``rules``: a run
    calls its members' own forwards, and a lean MLP computes its layers itself, so ``plan()``
    refuses either (a run ``fc1..norm`` inside EdgeNeXt's last block's MLP, outside the
    repeated blocks, is a unit of its own)."""
    spans = [*regions.units, *(p for ps in regions.inner.values() for p in ps)]
    matched = {r.match for r in rules}
    run_matches = {r.match for r in rules if r.through}
    in_runs = {
        m
        for s in spans
        if s.kind == "run" and exact_name_pattern(s.name) in run_matches
        for m in s.members
    }
    holding = {
        lean.name
        for lean in regions.lean
        for s in spans
        if is_inside(s.name, lean.name) and exact_name_pattern(s.name) in matched
    }
    return [s for s in regions.lean if s.name not in in_runs | holding]


# a unit recomputed whole, or its inner regions (NOTE [ Inner regions alone ] in _level_search): a
# group over such units recomputes their forward as nested ones would (a stack that is a full
# region below the groups' level stays one around them: one forward more, which the level's
# measured time shows and the groups' acceptance, by peak, does not weigh)
RECOMPUTED = ("full", "nested", "inner")


def group_stacks(regions: CandidateRegions, plan: dict[str, str]) -> list[Span]:
    """The stacks that may run as groups under ``plan``: those whose blocks it recomputes whole
    or by their inner regions (over kept or selective blocks a group would cost the stack's
    whole forward again)."""
    return [g for g in regions.groups if all(plan.get(m) in RECOMPUTED for m in g.members)]


# NOTE [ Runs of units ]
#
# Consecutive units can be, one after another, a run of the trace: the pieces a long run of
# sibling calls is cut into (one layer with weights each, NOTE [ Regions from a trace ] in
# _candidates), or modules that are units of their own because the run through them was not chosen
# (MONAI VNet's input transition and first down-transition: the runs inside the second were longer).
# Where a level recomputes two or more such units, each region keeps its own input, the
# output of the unit before it. The same units as one run keep only the first one's input,
# for no more work (each member runs once more, as before; a member's inner regions, nested
# or alone, are checkpointed again inside the run); the run's backward then holds all their
# activations at once, which is why the units stay the default and the run is tried as
# an addition, from the top down and from level 4 (a run of units is a large module), kept
# where it lowers the measured peak by EXTRA_GAIN. Each run is tried on its own, on top of
# the runs kept before it: one run can lower the peak where the next raises it (VNet's
# encoder run took its level 4 from 1.78 to 1.62 GiB, its decoder run raised level 5 by 4%,
# and the two tried together were both dropped). VNet: the input transition's output is the
# last up-transition's skip, kept as the first down-transition's input until that
# up-transition's backward, when the step peaks; as one run the two keep the input volume
# instead (1637 to 1509 MiB at batch 8 of 64^3, with the up-transition's inner regions alone:
# NOTE [ Inner regions alone ] in _level_search).
#
# A member's own full region from the run's level on is left out (the run takes over a later
# member's rungs from its level, NOTE [ Runs take over ] in _planning, and the first member's
# region and the run's, at one level, would be two rungs of one module where one decides).


def merged_runs(regions: CandidateRegions, plan: dict[str, str]) -> list[Span]:
    """The runs of two or more consecutive units of one traced run that ``plan`` recomputes
    (whole or by their inner regions, which then nest in the run; a lean MLP runs alone), each
    as one run span (NOTE [ Runs of units ])."""
    lean = {s.name for s in regions.lean}
    out: list[Span] = []
    for chain in regions.chains:
        taken: list[Span] = []
        for unit in [*chain, None]:
            if unit is not None and plan.get(unit.name) in RECOMPUTED and unit.name not in lean:
                taken.append(unit)
                continue
            if len(taken) >= 2:
                members = tuple(m for u in taken for m in u.members)
                out.append(run_span(members, taken[0].order))
            taken = []
    return out


def fallback_at(model: nn.Module, level: int) -> list[LevelRule]:
    """The structural fallback's rules (``presets.fallback_rules``), all from ``level`` on: its
    nesting of trunk, stages, blocks and layers, a candidate for the top level where it holds
    less than the derived regions; none when the fallback finds no structure."""
    try:
        found = fallback_rules(model)
    except ConfigError:
        return []
    return [r.model_copy(update={"level": Level(level)}) for r, _ in found if r.level > 0]
