"""Five growing levels chosen on the program's menus (NOTE [ Five levels from one menu ]).

Owns the derivation's search over the priced menus: its menu (``DERIVE_MENU``), which options
grow the level below, the goals spaced towards the top and asked again when a level's measured
peak misses them, the cheapest mix at a measured peak, the stages recomputed whole (NOTE [ A
stage recomputed whole ]) and a unit's inner regions alone (NOTE [ Inner regions alone ]). What
a mix measures is a callback: ``_level_measure`` measures it on the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from ._candidates import CandidateRegions, innermost_units
from ._menus import Menus
from ._optimise import Block, Choice, Option, StageOption, choose, predict
from ._planner import least_memory

__all__ = [
    "DERIVE_MENU",
    "STEP",
    "EXTRA_GAIN",
    "choice_key",
    "plan_of",
    "top_choice",
    "level_plans",
    "small_stages_whole",
    "inner_apart",
    "unnested",
]


# NOTE [ Five levels from one menu ]
#
# The planner's menus (NOTE [ Pricing the strategies of a block ] in _menus) are measured once
# at the target batch: per unit, the bytes and seconds of keep / selective / full / nested, and
# per stage of selective as one region. Bytes are counted and seconds modelled from FLOPs and
# bytes (NOTE [ A modelled price ] in _price), never timed, so a model derives the same preset
# on every run. The program (NOTE [ One strategy per block ] in _optimise) gives, for a memory
# goal, the fastest mix predicted to fit.
#
# The curve is spaced on measured peaks. Ptop, the least *measured* step peak among the top mix
# (the fastest within _TOP_SLACK of the least memory the menus reach), the least-memory mix and
# that mix with its stacks as groups, anchors the low end; levels 1-3 are the fastest mixes
# under goal(k) = P0 * (Ptop / P0) ** _SPACING[k]. Measured, because where a step peaks outside
# what the blocks keep the program's least memory lies under every plan's real peak, and goals
# spaced towards it would each buy a recomputation for no memory. Lean MLPs are decided before
# Ptop is measured (from level 4, where they lower it by EXTRA_GAIN), since they can be what
# moves it.
#
# Levels 2 and 3 keep the size table's promise: each goes at least as low as its anchor, the
# measured peak of its row (NOTE [ The size table's rows ] in _candidates) checkpointed alone, where
# the model has a row of that size holding more than the row below; an anchored level moves the
# spaced levels above it. Level 5 is the least memory the menus reach from level 4, with every stage
# recomputed whole (its blocks checkpointed again inside) as a candidate.
#
# Levels 1-3 recompute a block at most once: ``nested``, groups of blocks and lean MLPs inside
# whole blocks are offered from level 4. A goal of levels 1-3 under the least memory of one
# recomputation takes that least (the knee, past which each few percent cost a second forward);
# only where that least is not STEP below the level below is the level chosen again past the
# knee, since it would otherwise be marked as the level below's plan.
#
# Invariants:
#   1. Levels grow: level k moves a unit only up keep < selective < full < nested (a stage from
#      keep, and from a stage only to full or nested for all its blocks), so every level is the
#      level below plus more, which is what rules "from level k on" express (a selective stage
#      steps aside where full blocks start inside it: NOTE [ Selective regions step aside ]).
#   2. Every level is measured (the extrapolated step peak from the two small batches). A level
#      of 1-3 whose peak misses its goal by more than STEP is asked again for the goal times
#      predicted / measured, up to _ROUNDS times, and a new choice replaces the old one only if
#      it lowers the measured peak by EXTRA_GAIN (it is always slower).
#   3. A level still over its goal, and level 4 always, is then made as cheap as its measured
#      peak allows: a faster mix measured within STEP (level 4: _TOP_SLACK) of the least peak
#      measured replaces it.
#   4. What the program cannot price is tried last, each from the top level down and kept from
#      the lowest level where it still lowers the measured peak enough: stacks as groups of about
#      sqrt(n) (``segments: auto``), only over stacks the level recomputes whole, from level 4,
#      by EXTRA_GAIN; whole stages at level 5, by STEP; the structural fallback's regions,
#      likewise.
#   5. A level that does not lower the peak by STEP from the level below is marked as that
#      level's plan and runs it.
#
# The measurements behind these choices are in docs/derive.md and benchmarks/results/.

# the derivation's menu: the planner's, the ways that redo cheap products (NOTE [ Products
# cheap to redo ] in _price), a unit's inner regions alone (NOTE [ Inner regions alone ]) and
# stages recomputed whole (NOTE [ A stage recomputed whole ])
DERIVE_MENU = (
    *("keep", "selective", "selective_below", "full", "nested", "inner"),
    *("stage", "stage_below", "held"),
)
_SPACING = (0.35, 0.75, 0.9)
_ROUNDS = 3
_TOP_SLACK = 0.02
STEP = 0.05
EXTRA_GAIN = 0.01
_RANK = {
    "keep": 0,
    "selective": 1,
    "stage": 1,
    "selective_below": 2,
    "stage_below": 2,
    "full": 3,
    "held": 3,
    "inner": 3,
    "nested": 4,
    "held_nested": 4,
}


# a level's mix: unit -> strategy, the program's answer, the measured peak
_Best = tuple[dict[str, str], Choice, int]


def _allowed(previous: str, option: str) -> bool:
    """Whether a unit run ``previous`` at the level below may run ``option`` at this one: a
    level only adds regions (NOTE [ Five levels from one menu ])."""
    if previous in ("held", "held_nested"):  # a stage recomputed whole stays so
        return option in ("held_nested", previous)
    if previous == "inner":  # NOTE [ Inner regions alone ]: the unit may only come around them
        return option in ("inner", "nested")
    if previous in ("stage", "stage_below"):
        grown = ("stage", "stage_below") if previous == "stage" else ("stage_below",)
        return option in (*grown, "full", "nested", "inner", "held", "held_nested")
    if option == "held_nested":  # the stage whole around blocks recomputed whole (or kept)
        return previous in ("keep", "full")
    if option == "inner":  # a full region of the unit's own would stay around them
        return previous in ("keep", "selective", "selective_below")
    if previous in ("selective", "selective_below") and option in ("stage", "stage_below", "held"):
        return False
    return _RANK[option] >= _RANK[previous]


def _restricted(
    menus: Menus, previous: Sequence[str], once: bool = False
) -> tuple[list[Block], list[StageOption]]:
    """The menus with only the options that grow ``previous`` (NOTE [ Five levels from one
    menu ]), and with ``once`` none that newly recomputes a block twice (``nested``, unless a
    level below, past its knee, made it so already); a stage stays on offer only while all of
    its blocks are kept or in it."""
    blocks = []
    for block, before in zip(menus.blocks, previous, strict=True):
        options = [
            o
            for o in block.options
            if _allowed(before, o.strategy)
            and not (once and o.strategy == "nested" and before != "nested")
        ]
        blocks.append(Block(block.name, tuple(options)))
    spans = []
    for s in menus.spans:
        inside = range(s.first, s.last + 1)
        way = s.option.strategy
        if way in ("held", "held_nested") and all(previous[i] == way for i in inside):
            # a stage recomputed whole stays so: its blocks carry its price, as when chosen
            for i, member in zip(inside, s.members(), strict=True):
                blocks[i] = Block(blocks[i].name, (member,))
        elif once and way == "held_nested":
            continue  # a second recomputation: from level 4 on
        elif all(_allowed(previous[i], way) for i in inside):
            spans.append(s)
    return blocks, spans


def choice_key(choice: Choice) -> tuple[str, ...]:
    return tuple(o.strategy for o in choice.options)


def plan_of(menus: Menus, choice: Choice) -> dict[str, str]:
    """A choice of the program as unit -> strategy."""
    return dict(zip((b.name for b in menus.blocks), choice_key(choice), strict=True))


def top_choice(menus: Menus) -> tuple[Choice, Choice]:
    """The least memory the menus reach, and the fastest mix within _TOP_SLACK of it."""
    least = least_memory(menus.blocks, menus.base, menus.spans)
    top_goal = int(least.peak * (1 + _TOP_SLACK))
    return least, choose(menus.blocks, menus.base, top_goal, spans=menus.spans) or least


def level_plans(
    menus: Menus,
    measure: Callable[[int, list[dict[str, str]]], int],
    top_peak: int | None = None,
    anchors: dict[int, int] | None = None,
) -> list[_Best]:
    """Levels 1-5 as unit -> strategy, with the program's answer and the measured peak
    (``measure(k, plans)``: level k's peak with the plans of levels 1..k), the goals of levels
    1-3 spaced towards the top mix's measured peak (``top_peak``, measured here if not given),
    no higher than their anchors (``anchors``: level -> the measured peak of the size table's
    row) and corrected by measurement (NOTE [ Five levels from one menu ])."""
    names = [b.name for b in menus.blocks]
    least, top = top_choice(menus)
    if top_peak is None:
        top_peak = measure(1, [plan_of(menus, top)])
    top_peak = min(menus.peak0, top_peak)
    goals = [
        int(menus.peak0 * (top_peak / menus.peak0) ** w)
        for w in _spaced(menus.peak0, top_peak, anchors or {})
    ]
    goals += [top.peak, least.peak]  # level 5: the least memory, and the stages whole on top
    previous: tuple[str, ...] = ("keep",) * len(names)
    out: list[_Best] = []

    def level(k: int, goal: int, blocks: list[Block], spans: list[StageOption]) -> _Best:
        """Level k's mix under ``goal`` from these menus, asked again and made cheaper."""
        asked = goal
        best: _Best | None = None
        for _ in range(_ROUNDS):
            choice = choose(blocks, menus.base, asked, spans=spans)
            reached = choice is not None
            if choice is None:  # the growing plan cannot reach the goal: its least memory
                choice = least_memory(blocks, menus.base, spans)
            plan = plan_of(menus, choice)
            peak = measure(k, [*(p for p, _, _ in out), plan])
            if best is None or peak < best[2] * (1 - EXTRA_GAIN):
                best = (plan, choice, peak)
            if k > len(_SPACING) or best[2] <= goal * (1 + STEP) or not reached:
                break
            # the program under-predicted this mix: ask for less by the factor it missed by
            asked = max(least.peak, int(goal * choice.peak / peak))
        assert best is not None
        if k == len(_SPACING) + 1:  # level 4: as cheap as the least measured top allows
            lowest = min(top_peak, best[2])
            best = _cheaper(menus, blocks, spans, out, best, lowest, _TOP_SLACK, measure)
        elif k < len(_SPACING) + 1 and best[2] > goal * (1 + STEP):  # missed: pay no more
            best = _cheaper(menus, blocks, spans, out, best, best[2], STEP, measure)
        return best

    for k, goal in enumerate(goals, start=1):
        once = k <= len(_SPACING)
        best = level(k, goal, *_restricted(menus, previous, once))
        below = out[-1][2] if out else menus.peak0
        if once and best[2] > below * (1 - STEP):  # the knee is below: past it, or no step
            past = level(k, goal, *_restricted(menus, previous))
            if past[2] < best[2] * (1 - EXTRA_GAIN):
                best = past
        previous = choice_key(best[1])
        out.append(best)
    return out


def _spaced(peak0: int, top_peak: int, anchors: dict[int, int]) -> list[float]:
    """Where levels 1-3 sit between level 0 (0) and the top (1), in the logarithm of the peak:
    _SPACING, a level no higher than its anchor, and the levels above an anchored one spaced
    between it and the top as _SPACING spaces them between that level and the top (NOTE [ Five
    levels from one menu ])."""
    at = list(_SPACING)
    if top_peak >= peak0:
        return at
    for k, anchor in sorted(anchors.items()):
        x = math.log(peak0 / anchor) / math.log(peak0 / top_peak)
        if x <= at[k - 1]:
            continue
        for j in range(k, len(at)):
            share = (_SPACING[j] - _SPACING[k - 1]) / (1 - _SPACING[k - 1])
            at[j] = max(at[j], x + share * (1 - x))
        at[k - 1] = x
    return at


def _cheaper(
    menus: Menus,
    blocks: list[Block],
    spans: list[StageOption],
    below: list[_Best],
    best: _Best,
    lowest: int,
    slack: float,
    measure: Callable[[int, list[dict[str, str]]], int],
) -> _Best:
    """The fastest mix measured within ``slack`` of ``lowest`` (or of a lower peak measured on
    the way), found by halving the program's goal between the level below's mix and
    ``best``'s, up to _ROUNDS times (NOTE [ Five levels from one menu ])."""
    cheap, dear = (below[-1][1].peak if below else menus.peak0), best[1].peak
    for _ in range(_ROUNDS):
        asked = (cheap + dear) // 2
        choice = choose(blocks, menus.base, asked, spans=spans)
        if choice is None or asked in (cheap, dear):
            break
        plan = plan_of(menus, choice)
        peak = measure(len(below) + 1, [*(p for p, _, _ in below), plan])
        lowest = min(lowest, peak)
        if peak <= lowest * (1 + slack) and choice.time < best[1].time:
            best, dear = (plan, choice, peak), asked
        else:
            cheap = asked
    return best


# NOTE [ A stage recomputed whole ]
#
# The units are the trace's innermost repeated blocks, and sometimes those are the single
# layers of a larger block: EfficientViT's MBConv is three conv-norm-act layers of one
# structure, MAnet's decoder blocks and VNet's down-transitions hold a sequence of two or more
# conv layers. The block itself is then what the planner calls a stage (it holds a run of
# units), and a stage was on the menu only as one selective region: recomputed layer by layer,
# an MBConv keeps the input of each of its three layers, two of them at the expanded width,
# where the block recomputed whole keeps its own input alone. EfficientViT-B0's blocks of its
# first two stages recomputed whole by hand held 0.42x level 0's peak for 1.23x its modelled
# time (hand_plans_b32); its derived level 2 paid 1.32x for 0.40x. With the stage below on
# the menu, its level 2 holds 0.36x for 1.26x (derive_nopreset_b32).
#
# So the program is also offered such a stage as one region with nothing kept (``held``): it
# keeps the stage's input (measured, every stage one such region, less the stage's own bytes,
# which the base holds, as for ``stage``), brings back all its units' and its own bytes while
# its backward runs, and costs every operator in it once; from level 4 on also with its units
# recomputed whole again inside it (``held_nested``: while the stage's backward runs, its own
# bytes, its units' inputs and one unit's bytes; each unit's forward a second time). A held
# stage stays held (or becomes held_nested) at the levels above, so the levels remain one
# preset of "from level k on" rules: the stage's rule from the level that holds it, its units'
# full rules from the level that nests them.
#
# Only stages whose units are all single layers (NOTE [ The size table's rows ] in _candidates):
# such a stage is a small block, one recomputation like any other unit's. A stage of blocks is a
# large module, offered whole from level 5 (``whole``); offered at every level, held stages
# chose ResNet-50's level 1 at batch 32 and, since a held stage's blocks cannot go full one
# by one above it, locked the levels above: level 2 at 1413 MiB against 951, the top at 923
# against 739. Models with no stage of single layers derive what they derived before.


# NOTE [ Inner regions alone ]
#
# A unit with inner regions may also have them checkpointed without a region of its own
# (``inner``): each inner region keeps its input, and what the unit runs outside them (a
# concatenation, a residual addition) saves what it saves in a plain step. Against ``nested``
# (the unit recomputed, its inner regions again inside it), the inner regions run once more
# instead of the unit's forward twice, and their inputs are kept instead of the unit's. Where
# the unit's input is held anyway, nested pays its second forward for nothing: MONAI VNet's
# last up-transition takes the encoder's first output as its skip, which the next encoder
# region keeps as its input too. At batch 8 of 64^3 its derived top, that up-transition
# nested, held 1637 MiB for 1.35x level 0's modelled time; with its two halves alone, the same
# peak for 1.22x (``benchmarks/plans/vnet_*.yaml``).
#
# The program cannot see that: it sums what each unit keeps, and a storage two regions keep
# counts twice, so it prices the halves as keeping more than the unit nested. Offered to it
# from level 4 on, ``inner`` moved ResNet-50's level 4 at batch 32 (825.75 MiB for 1.71x
# modelled) onto its level 2's plan. So the planner prices it (the bytes of the forward with
# only inner regions checkpointed, the time of their operators) and the program is not
# offered it; instead each level's nested units are tried with their inner regions alone,
# all of that level's together, once the levels are chosen, and run so where the level's
# measured peak does not rise (less time for the same memory). Rules "from level k on"
# express it for a unit kept, selective, or in a selective stage at the level below (a
# selective region steps aside where full regions inside it start: NOTE [ Selective regions
# step aside ] in wrapper), and nested above it again (the unit's full rule added later); a
# unit recomputed whole below cannot give its region up for its inner ones.


def small_stages_whole(menus: Menus, regions: CandidateRegions) -> list[StageOption]:
    """The stages on the menu, recomputed whole only where they hold single layers (NOTE [ A
    stage recomputed whole ])."""

    names = [u.name for u in regions.units]

    def layers_only(span: StageOption) -> bool:  # a unit holding units counts by those
        layers = innermost_units(names, span.name)
        return bool(layers) and all(regions.sizes.get(n, 2) == 1 for n in layers)

    return [
        s for s in menus.spans if s.option.strategy not in ("held", "held_nested") or layers_only(s)
    ]


def inner_apart(menus: Menus) -> dict[str, Option]:
    """Takes the ``inner`` options off the program's menus, and returns them by unit: they are
    tried by measurement only (NOTE [ Inner regions alone ])."""
    inner = {b.name: o for b in menus.blocks for o in b.options if o.strategy == "inner"}
    menus.blocks = [
        Block(b.name, tuple(o for o in b.options if o.strategy != "inner")) for b in menus.blocks
    ]
    return inner


def unnested(
    menus: Menus,
    inner: dict[str, Option],
    plans: list[_Best],
    measure: Callable[[int, list[dict[str, str]]], int],
) -> list[_Best]:
    """``plans`` with each level's nested units running their inner regions alone (``inner``:
    their options) where that measures no higher (NOTE [ Inner regions alone ]): all of a
    level's nested units or none."""
    names = [b.name for b in menus.blocks]
    out: list[_Best] = []
    for k, (mix, choice, peak) in enumerate(plans, start=1):
        below = out[-1][0] if out else {}
        swap = [
            n
            for n in names
            if mix.get(n) == "nested" and n in inner and _allowed(below.get(n, "keep"), "inner")
        ]
        if swap:
            trial = {**mix, **dict.fromkeys(swap, "inner")}
            measured = measure(k, [*(p for p, _, _ in out), trial])
            if measured <= peak:
                options = tuple(
                    inner[n] if n in swap else o for n, o in zip(names, choice.options, strict=True)
                )
                before = predict(menus.blocks, choice.options, menus.base)
                after = predict(menus.blocks, options, menus.base)
                choice = replace(
                    choice,
                    options=options,
                    peak=choice.peak + after[0] - before[0],
                    time=choice.time + after[1] - before[1],
                )
                mix, peak = trial, measured
        out.append((mix, choice, peak))
    return out
