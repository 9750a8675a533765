"""Levels derived by measurement, for a model nobody wrote a preset for (issue 26).

:func:`derive_preset` traces one forward to find the model's candidate regions
(``vision_ckpt.tune._spans``), prices every way of running each of them at the target batch with
the per-block planner's measurements (``vision_ckpt.tune._menus``), and solves the planner's
program at five memory goals between no checkpointing and the least memory the menus reach.
Each level keeps what the level below checkpoints (the plan only grows with the level), so the
five answers are one preset: rules in the bundled presets' vocabulary, readable, editable and
applied like any other. Every level is measured, and the model's physical floor
(``vision_ckpt.measure.peak``) says how far each is from the best any region plan could do.

See NOTE [ Regions from a trace ] for the spans the derivation offers, NOTE [ Five levels from
one menu ] for how the levels are chosen, and docs/derive.md for measurements.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import yaml
from torch import nn

from ..config.levels import Level
from ..config.matching import exact_name_pattern
from ..config.presets import fallback_rules, preset_for_model
from ..config.schema import CheckpointConfig, LevelRule
from ..errors import ConfigError, internal_assert
from ..measure._extrapolate import (
    extrapolated_peak,
    peak_measurer,
    predict_from_timelines,
    small_batches,
)
from ..measure._measure import LossFn, Workload, applied, default_loss, model_restored
from ..measure._memory import format_bytes
from ..measure.peak import physical_floor
from ..regions.apply import plan, run_members
from ..runtime.wrapper import training_level
from ._menus import Menus, measure_menus
from ._optimise import Block, Choice, Option, Span as ChainSpan, choose, predict
from ._planner import least_memory
from ._spans import Span, trace_spans

__all__ = [
    "DerivedLevel",
    "DerivedPreset",
    "Regions",
    "derive_preset",
    "regions_of",
    "resolve_derived",
]

# NOTE [ Regions from a trace ]
#
# The derivation knows no module name or class; every region it offers comes from the trace
# (``trace_spans``) by these rules:
#
# - Units (what the planner's program chooses one option for, in forward order): the innermost
#   blocks of repeated sequences (a residual block, a transformer layer, a dense layer); the
#   longest runs of consecutive sibling calls outside every block, cut as a block's inner
#   regions are (below), so that each holds one heavy member (a stem conv-norm-act-pool stays
#   one run; MONAI VNet's up_tr64, up_tr32 and out_tr, called one after the other, are three
#   units: as one run, recomputed whole, its backward held all three decoder stages'
#   activations at once, a peak no region inside could lower); and the outermost other
#   modules outside both that take part in the forward (a patch embedding, a downsampling
#   layer, a transition, the head).
# - Inner regions of a block, or of a module unit that holds no other unit (an up-transition),
#   what a ``nested`` unit checkpoints again while it is recomputed: its direct children,
#   joined into runs where they form one, and cut so that each piece holds one child with
#   weight matrices or kernels (a parameter of two or more dimensions) and the light layers
#   after it; light layers before the first heavy one join it. A ResNet bottleneck gives
#   conv1..act1 | conv2..act2 | conv3..bn3, a ViT layer its attention half and its MLP half.
#   Where one child holds all of the unit's weights (a container around its layers: smp's
#   Linknet decoder block, torchvision's ConvNeXt block, a decoder stage of one residual block
#   in MONAI's SegResNet), the pieces are that child's. A unit with fewer than two pieces has
#   no nested option (nested recomputation of one piece is the unit itself again).
# - Sizes: each unit and inner region has a row of the size table (NOTE [ The size table's
#   rows ]), which anchors levels 2 and 3.
# - Stages: what holds a sequence of blocks may run as one selective region (the planner's
#   ``stage`` option), and a stack of three or more units as groups of about sqrt(n). A module
#   whose units are single layers beside operations of its own is a stage too, in place of
#   the stages inside it (NOTE [ A block of single layers ]).
# - Lean MLPs (``_lean``): not a region; a lean MLP inside a run is cut out of it as an inner
#   region of its own (a run calls its members' own forwards, so it could not run lean).
#   Lean MLPs are decided before the levels, groups tried on top of them (NOTE [ Five levels
#   from one menu ]).

_UNIT_LEVEL = Level(3)
_INNER_LEVEL = Level(2)
_STAGE_LEVEL = Level(4)


def _inside(name: str, outer: str) -> bool:
    return name.startswith(outer + ".") if outer else bool(name)


def _heavy(module: nn.Module) -> bool:
    """Whether a module holds a weight of two or more dimensions (a kernel or a matrix)."""
    return any(p.dim() >= 2 for p in module.parameters())


def _weighted(model: nn.Module, span: Span) -> bool:
    """Whether any member of ``span`` holds a kernel or a weight matrix."""
    return any(_heavy(model.get_submodule(m)) for m in span.members)


def _range(model: nn.Module, run: Span) -> tuple[str, ...]:
    """Every child a ``through`` rule for ``run`` names: its members and the children registered
    between them that it skips (NOTE [ Runs found by tracing ], rule 3). None of them can be a
    region of its own beside the run (NOTE [ Runs take over ])."""
    assert run.through is not None, run
    return tuple(run_members(model, run.members[0], run.through, "the derivation"))


def _run_span(members: tuple[str, ...], order: int) -> Span:
    """The run of sibling calls ``members`` as a span (its ``through``: the last member's name
    in its parent)."""
    return Span("run", members[0], members, order, through=members[-1].rpartition(".")[2])


def _cut(model: nn.Module, run: Span, lean: set[str]) -> list[Span]:
    """``run`` cut before each member with a kernel or a weight matrix but the first, and around
    a lean MLP (which then runs lean in a region of its own: a run would call its forward)."""
    members = list(run.members)
    heavy = [i for i, m in enumerate(members) if _heavy(model.get_submodule(m))]
    cuts = set(heavy[1:])
    for i, m in enumerate(members):
        if m in lean:
            cuts |= {i, i + 1}
    bounds = sorted({0, *cuts, len(members)})
    out = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        part = tuple(members[a:b])
        if len(part) == 1:
            out.append(Span("module", part[0], part, run.order))
        else:
            out.append(_run_span(part, run.order))
    return out


def _pieces(model: nn.Module, block: str, spans: Sequence[Span]) -> list[Span]:
    """The inner regions of ``block`` (NOTE [ Regions from a trace ]): runs and modules among
    its direct children, one heavy child each, a lean MLP alone."""
    lean = {s.name for s in spans if s.kind == "lean"}
    children = [s for s in spans if s.kind == "module" and s.name.rpartition(".")[0] == block]
    runs = [s for s in spans if s.kind == "run" and s.name.rpartition(".")[0] == block]
    ranges = {r.label: set(_range(model, r)) for r in runs}
    longest: list[Span] = []
    for run in sorted(runs, key=lambda r: (-len(r.members), r.order)):
        if not any(ranges[run.label] & ranges[o.label] for o in longest):
            longest.append(run)
    in_runs = {m for r in longest for m in ranges[r.label]}
    units = sorted(
        [*longest, *(c for c in children if c.name not in in_runs)], key=lambda s: s.order
    )
    pieces: list[Span] = []
    for unit in units:
        pieces += [unit] if unit.kind == "module" else _cut(model, unit, lean)
    pieces = [p for p in pieces if _weighted(model, p)]
    if len(pieces) == 1 and pieces[0].kind == "module" and pieces[0].name not in lean:
        # one child holds all of the block's weights: its pieces are the block's
        return _pieces(model, pieces[0].name, spans)
    return pieces


@dataclass(frozen=True)
class Regions:
    """The candidate regions of a traced model (NOTE [ Regions from a trace ])."""

    units: list[Span]
    """What the program chooses one option for, in forward order."""
    inner: dict[str, list[Span]]
    """Block -> its inner regions (blocks with two or more only)."""
    stages: list[Span]
    """What holds a sequence of blocks."""
    lean: list[Span]
    """MLPs that can run with the lean backward."""
    groups: list[Span] = field(default_factory=list)
    """Stacks of three or more units that can run as groups of about sqrt(n) (``segments``)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Unit or inner region -> its row of the size table (NOTE [ The size table's rows ]):
    1 a single layer, 2 a small block, 3 a medium module."""
    chains: list[list[Span]] = field(default_factory=list)
    """Sequences of two or more consecutive units that are, one after another, a run of the
    trace: what may be recomputed as one run (NOTE [ Runs of units ])."""

    def named(self) -> dict[str, Span]:
        """Name -> span, of every unit, inner region and stage (a unit wins over an inner
        region or a stage of the same name)."""
        inner = {s.name: s for ps in self.inner.values() for s in ps}
        return inner | {s.name: s for s in self.stages} | {s.name: s for s in self.units}

    def of_size(self, size: int) -> list[Span]:
        """The outermost regions of at most ``size`` (NOTE [ The size table's rows ]): the
        units that small, and inside a larger unit its inner regions that small."""
        out = []
        for unit in self.units:
            if self.sizes.get(unit.name, size + 1) <= size:  # no row known: not this small
                out.append(unit)
            else:
                out += [p for p in self.inner.get(unit.name, []) if self.sizes[p.name] <= size]
        return out

    def base_rules(self) -> list[LevelRule]:
        """The rules that make the planner's candidates: units at level 3, inner regions at
        level 2, stages at level 4 (NOTE [ Pricing the strategies of a block ] in _menus)."""
        rules = [
            *(_rule(s, _STAGE_LEVEL) for s in self.stages),
            *(_rule(s, _UNIT_LEVEL) for s in self.units),
            *(_rule(p, _INNER_LEVEL) for ps in self.inner.values() for p in ps),
        ]
        return rules


def _rule(span: Span, level: int, **extra: Any) -> LevelRule:
    rule: dict[str, Any] = {"match": exact_name_pattern(span.name), "level": level, **extra}
    if span.kind == "run":
        rule["through"] = span.through
    return LevelRule(**rule)


def regions_of(model: nn.Module, example_input: torch.Tensor) -> Regions:
    """The regions :func:`derive_preset` chooses from, found by tracing one forward on
    ``example_input`` (NOTE [ Regions from a trace ]); the model is left as it was.

    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
    ...                     *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    ...                       for _ in range(3)])
    >>> [s.label for s in regions_of(net, torch.randn(2, 3, 16, 16)).units]
    ['0..2', '3', '4', '5']
    """
    with model_restored(model, None), applied(model, CheckpointConfig(training_checkpoint_level=0)):
        return _regions(model, trace_spans(model, example_input))


def _regions(model: nn.Module, spans: Sequence[Span]) -> Regions:
    """Units, inner regions, stages and lean MLPs of a trace (NOTE [ Regions from a trace ])."""
    blocks = [s for s in spans if s.kind == "block"]
    blocks = [b for b in blocks if not any(_inside(o.name, b.name) for o in blocks)]
    block_names = [b.name for b in blocks]

    def in_block(name: str) -> bool:
        return any(name == b or _inside(name, b) for b in block_names)

    def holds_block(name: str) -> bool:
        return any(_inside(b, name) for b in block_names)

    runs = [
        s
        for s in spans
        if s.kind == "run" and not any(in_block(m) or holds_block(m) for m in s.members)
    ]
    ranges = {r.label: _range(model, r) for r in runs}
    chosen_runs: list[Span] = []
    taken: set[str] = set()
    for run in sorted(runs, key=lambda r: (-len(r.members), r.order)):
        covered = any(
            m == t or _inside(m, t) or _inside(t, m) for m in ranges[run.label] for t in taken
        )
        if not covered:
            chosen_runs.append(run)
            taken.update(ranges[run.label])
    in_runs = taken
    others = [
        s
        for s in spans
        if s.kind == "module"
        and not in_block(s.name)
        and not holds_block(s.name)
        and not any(s.name == m or _inside(s.name, m) for m in in_runs)
    ]
    others = [o for o in others if not any(_inside(o.name, p.name) for p in others)]
    lean_names = {s.name for s in spans if s.kind == "lean"}
    cut: list[Span] = []
    for run in chosen_runs:  # one heavy member each, as a block's pieces; light parts left out
        pieces = _cut(model, run, lean_names)
        cut += [p for p in pieces if _weighted(model, p)] if len(pieces) > 1 else pieces
    units = sorted([*blocks, *cut, *others], key=lambda s: s.order)
    chains = _chains(units, spans)
    # a module unit holding no other unit has inner regions too (a decoder's up-transition)
    holders = [*blocks]
    for u in units:
        if u.kind == "module" and not any(_inside(o.name, u.name) for o in units):
            holders.append(u)
    inner = {b.name: _pieces(model, b.name, spans) for b in holders}
    inner = {b: ps for b, ps in inner.items() if len(ps) >= 2}
    stages = [s for s in spans if s.kind == "stage"]
    lean = [s for s in spans if s.kind == "lean"]
    unit_names = {u.name for u in units}
    groups = [s for s in spans if s.kind == "groups" and all(m in unit_names for m in s.members)]
    sizes: dict[str, int] = {}
    for span in [*units, *(p for ps in inner.values() for p in ps)]:
        sizes[span.name] = _size(model, span, inner)
    holders = _layer_blocks(spans, units, sizes)
    stages = [s for s in stages if not any(_inside(s.name, h.name) for h in holders)]
    stages = sorted([*stages, *holders], key=lambda s: s.order)
    return Regions(units, inner, stages, lean, groups, sizes, chains)


def _chains(units: Sequence[Span], spans: Sequence[Span]) -> list[list[Span]]:
    """The longest sequences of consecutive units (in forward order) whose members, one after
    another, are a run of the trace (NOTE [ Runs of units ])."""
    runs = {s.members for s in spans if s.kind == "run"}
    chains: list[list[Span]] = []
    current: list[Span] = []
    for unit in [*units, None]:
        joined = (*(m for u in current for m in u.members), *unit.members) if unit else ()
        if unit is not None and current and joined in runs:
            current.append(unit)
            continue
        if len(current) >= 2:
            chains.append(current)
        current = [unit] if unit is not None else []
    return chains


# NOTE [ A block of single layers ]
#
# The units are the trace's innermost repeated blocks and the runs and modules around them, so
# a module that no sequence repeats inside can hold several units that are single layers with
# operations of its own between them: MAnet's attention decoder block (a repeated pair of conv
# layers, two squeeze-excitations, an upsampling, a product, a concatenation, two more conv
# layers), VNet's transitions (a strided conv, a repeated sequence of conv layers, a residual
# sum). By the size table such a module is a small block, yet it was neither a unit nor a
# stage: the program could recompute its layers one by one, each keeping its input, or its
# repeated pair whole, never the block whole keeping its own inputs alone. MAnet's decoder
# blocks recomputed whole by hand, on top of its derived level 4, held 0.46x level 0's peak for
# 1.28x its modelled time; its derived levels went from 0.64x to 0.33x at 1.81x.
#
# Such a module is a stage, in place of the stages inside it, and, made of single layers, it
# is offered whole (NOTE [ A stage recomputed whole ]). It is a module the forward calls, no
# unit and in none, that holds two or more units, one after another, all single layers (a
# unit holding units, a squeeze-excitation and the two runs it is cut into, counts by those);
# a repeated block inside it must be one of those units (a stage of MBConv blocks holds only
# single layers, but its repeated blocks are the MBConvs: it stays a stage of blocks), and no
# one stage inside it may hold all of them (a residual wrapper around an MBConv adds a sum,
# nothing kept: the MBConv is the block). The outermost such module is taken. The planner
# prices it as a stage in place of the stages inside it (``measure_menus``'s ``outer``).


def _innermost_units(names: Sequence[str], module: str) -> list[str]:
    """The units of ``names`` inside ``module`` that hold no other unit."""
    inside = [n for n in names if _inside(n, module)]
    return [n for n in inside if not any(_inside(o, n) for o in inside)]


def _layer_blocks(
    spans: Sequence[Span], units: Sequence[Span], sizes: dict[str, int]
) -> list[Span]:
    """The modules that are blocks of single layers (NOTE [ A block of single layers ])."""
    names = [u.name for u in units]
    stages = {s.name for s in spans if s.kind == "stage"}
    repeated = {s.name for s in spans if s.kind == "block"}
    found: dict[str, Span] = {}
    for span in spans:
        m = span.name
        if span.kind not in ("module", "block") or not m or m in found or m in stages:
            continue
        if any(m == u or _inside(m, u) for u in names):  # a unit, or inside one
            continue
        if any(_inside(b, m) and b not in names for b in repeated):  # a stage of blocks
            continue
        inside = [i for i, n in enumerate(names) if _inside(n, m)]
        layers = _innermost_units(names, m)
        if len(layers) < 2 or any(sizes.get(n) != 1 for n in layers):
            continue
        if any(all(_inside(n, g) for n in layers) for g in stages if _inside(g, m)):
            continue  # one stage inside holds them all: that stage is the block
        if inside == list(range(inside[0], inside[-1] + 1)):  # one after another
            found[m] = span
    return [s for s in found.values() if not any(_inside(s.name, o) for o in found)]


# NOTE [ The size table's rows ]
#
# The level contract names what each level checkpoints by size: single layers (1), small blocks
# such as a residual block, an attention block or a dense layer (2), medium modules such as a
# transformer layer (3). A region's row is read off its weights and inner regions, not its
# names: a region holding at most one layer with a weight of two or more dimensions (a conv
# or a linear layer with its norm and activation) is a single layer; a block is one row above
# the least of its inner regions (a bottleneck or a dense layer, whose pieces hold one conv
# each, is a small block; a transformer layer, whose attention and MLP halves hold two matrices
# each, is a medium module; an MBConv block with a squeeze-excitation among single convs is a
# small block); any other region holding two or more such layers is a small block. The rows are
# the derived levels 2 and 3's anchors (NOTE [ Five levels from one menu ]).


def _weighted_layers(model: nn.Module, span: Span) -> int:
    """How many modules in ``span`` hold a weight of two or more dimensions of their own."""
    return sum(
        any(p.dim() >= 2 for p in sub.parameters(recurse=False))
        for member in span.members
        for sub in model.get_submodule(member).modules()
    )


def _size(model: nn.Module, span: Span, inner: dict[str, list[Span]]) -> int:
    """``span``'s row of the size table (NOTE [ The size table's rows ])."""
    pieces = inner.get(span.name)
    if pieces:
        return min(3, 1 + min(_size(model, p, inner) for p in pieces))
    return 1 if _weighted_layers(model, span) <= 1 else 2


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
# Ptop is measured (from level 4, where they lower it by _EXTRA_GAIN), since they can be what
# moves it.
#
# Levels 2 and 3 keep the size table's promise: each goes at least as low as its anchor, the
# measured peak of its row (NOTE [ The size table's rows ]) checkpointed alone, where the model
# has a row of that size holding more than the row below; an anchored level moves the spaced
# levels above it. Level 5 is the least memory the menus reach from level 4, with every stage
# recomputed whole (its blocks checkpointed again inside) as a candidate.
#
# Levels 1-3 recompute a block at most once: ``nested``, groups of blocks and lean MLPs inside
# whole blocks are offered from level 4. A goal of levels 1-3 under the least memory of one
# recomputation takes that least (the knee, past which each few percent cost a second forward);
# only where that least is not _STEP below the level below is the level chosen again past the
# knee, since it would otherwise be marked as the level below's plan.
#
# Invariants:
#   1. Levels grow: level k moves a unit only up keep < selective < full < nested (a stage from
#      keep, and from a stage only to full or nested for all its blocks), so every level is the
#      level below plus more, which is what rules "from level k on" express (a selective stage
#      steps aside where full blocks start inside it: NOTE [ Selective regions step aside ]).
#   2. Every level is measured (the extrapolated step peak from the two small batches). A level
#      of 1-3 whose peak misses its goal by more than _STEP is asked again for the goal times
#      predicted / measured, up to _ROUNDS times, and a new choice replaces the old one only if
#      it lowers the measured peak by _EXTRA_GAIN (it is always slower).
#   3. A level still over its goal, and level 4 always, is then made as cheap as its measured
#      peak allows: a faster mix measured within _STEP (level 4: _TOP_SLACK) of the least peak
#      measured replaces it.
#   4. What the program cannot price is tried last, each from the top level down and kept from
#      the lowest level where it still lowers the measured peak enough: stacks as groups of about
#      sqrt(n) (``segments: auto``), only over stacks the level recomputes whole, from level 4,
#      by _EXTRA_GAIN; whole stages at level 5, by _STEP; the structural fallback's regions,
#      likewise.
#   5. A level that does not lower the peak by _STEP from the level below is marked as that
#      level's plan and runs it.
#
# The measurements behind these choices are in docs/derive.md and benchmarks/results/.

# the derivation's menu: the planner's, the ways that redo cheap products (NOTE [ Products
# cheap to redo ] in _price), a unit's inner regions alone (NOTE [ Inner regions alone ]) and
# stages recomputed whole (NOTE [ A stage recomputed whole ])
_MENU = (
    *("keep", "selective", "selective_below", "full", "nested", "inner"),
    *("stage", "stage_below", "held"),
)
_SPACING = (0.35, 0.75, 0.9)
_ROUNDS = 3
_TOP_SLACK = 0.02
_STEP = 0.05
_EXTRA_GAIN = 0.01
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
) -> tuple[list[Block], list[ChainSpan]]:
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


def _key(choice: Choice) -> tuple[str, ...]:
    return tuple(o.strategy for o in choice.options)


@dataclass
class DerivedLevel:
    """One derived level: what it runs and what it was measured to cost."""

    level: int
    strategies: dict[str, str]
    """Unit -> ``keep``, ``selective``, ``selective_below`` (selective, and its products cheap
    to redo redone: NOTE [ Products cheap to redo ] in ``_price``), ``full``, ``nested``,
    ``inner`` (its inner regions alone, NOTE [ Inner regions alone ]), ``stage`` (its stage
    one selective region), ``stage_below`` (that, redoing its cheap products), ``held`` (its
    stage one region recomputed whole) or ``held_nested`` (that, and the unit recomputed whole
    again inside it): NOTE [ A stage recomputed whole ]."""
    lean: tuple[str, ...] = ()
    """MLPs run with the lean backward at this level."""
    runs: tuple[str, ...] = ()
    """Runs of units recomputed as one region at this level (NOTE [ Runs of units ])."""
    whole: tuple[str, ...] = ()
    """Stages recomputed whole at this level, their blocks checkpointed again inside."""
    fallback: bool = False
    """Whether the structural fallback's regions are added at this level (all nested)."""
    predicted_peak: int = 0
    """The program's peak at the target batch (bytes)."""
    predicted_time: float = 0.0
    """The program's modelled seconds per step at the target batch (the menus' prices, NOTE [ A
    modelled price ] in ``_price``)."""
    peak: int = 0
    """The step peak at the target batch, extrapolated from measured small batches."""
    same_as: int | None = None
    """The level below whose plan this level runs, when its own lowered the peak too little."""

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for strategy in self.strategies.values():
            out[strategy] = out.get(strategy, 0) + 1
        ways = (
            "selective",
            "selective_below",
            "stage",
            "stage_below",
            "held",
            "full",
            "inner",
            "nested",
            "held_nested",
        )
        return {k: out[k] for k in ways if k in out}


@dataclass
class DerivedPreset:
    """The answer of :func:`derive_preset`: five levels as one preset, and how they were found."""

    model_class: str
    """The qualified class the preset was derived on."""
    batch_size: int
    input_shape: tuple[int, ...]
    """One sample's shape."""
    rules: list[LevelRule]
    """The preset's rules, in the bundled presets' vocabulary."""
    levels: list[DerivedLevel]
    """Levels 1-5."""
    peak0: int
    """Level 0's step peak at the batch (extrapolated from the small batches)."""
    base_time: float
    """Modelled seconds per step with no checkpointing at the batch (extrapolated)."""
    floor: int | None = None
    """The physical floor at the batch (``vision_ckpt.measure.peak``), extrapolated from the small
    batches; ``None`` if not measured."""
    seconds: float = 0.0
    """Wall time of the derivation."""
    units: list[str] = field(default_factory=list)
    """The units the program chose for, in forward order."""
    compared: dict[int, int] | None = None
    """The bundled preset's step peak per level at the batch, when the model has one and it
    was asked for."""
    bundled: str | None = None
    """The bundled preset's name, if the model has one."""

    def config(self, level: int | None = None) -> CheckpointConfig:
        """The derived preset as a config (``preset`` off, its rules), at ``level`` if given.

        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
        ...                     *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        ...                       for _ in range(3)])
        >>> found = derive_preset(net, torch.randn(2, 3, 16, 16), batch_size=16, floor=False)
        >>> cfg = found.config(5)
        >>> cfg.training_checkpoint_level, cfg.preset is None
        (<Level.VERY_LARGE_MODULE: 5>, True)
        """
        update: dict[str, Any] = {}
        if level is not None:
            update["training_checkpoint_level"] = Level(level)
        return CheckpointConfig(preset=None, rules=self.rules, **update)

    def to_yaml(self) -> str:
        """The preset file: a ``family:`` header naming the class, and the rules.

        ``vision_ckpt.register_preset(name, path)`` loads it; bundled preset files have the same
        form (``configs/presets/*.yaml``)."""
        rules = [r.model_dump(exclude_defaults=True) for r in self.rules]
        for rule in rules:
            if isinstance(rule.get("level"), int):
                rule["level"] = int(rule["level"])
        head = (
            f"# Derived by vision_ckpt.tune.derive_preset for {self.model_class} at batch "
            f"{self.batch_size}, input {list(self.input_shape)}.\n"
            + "".join(
                f"# level {lv.level}: "
                + (
                    f"= level {lv.same_as}"
                    if lv.same_as is not None
                    else f"peak {format_bytes(lv.peak)}, predicted "
                    f"{lv.predicted_time / self.base_time:.2f}x time (modelled)"
                )
                + "\n"
                for lv in self.levels
            )
        )
        body = {"family": {"classes": [self.model_class]}, "rules": rules}
        return head + yaml.safe_dump(body, sort_keys=False)

    def table(self) -> list[dict[str, Any]]:
        """One row per level (0-5): peak, predicted time, distance to the floor, the bundled
        preset's peak where compared."""
        rows = [{"level": 0, "peak": self.peak0, "time": 1.0, "plan": "nothing checkpointed"}]
        for lv in self.levels:
            plan = (
                f"= level {lv.same_as}"
                if lv.same_as is not None
                else ", ".join(f"{n} {s}" for s, n in lv.counts().items())
                + (f", {len(lv.lean)} lean" if lv.lean else "")
                + (f", {len(lv.runs)} run(s) of units as one" if lv.runs else "")
                + (f", {len(lv.whole)} stage(s) whole" if lv.whole else "")
                + (", the fallback's regions nested" if lv.fallback else "")
            )
            rows.append(
                {
                    "level": lv.level,
                    "peak": lv.peak,
                    "time": lv.predicted_time / self.base_time if self.base_time else None,
                    "plan": plan,
                }
            )
        for row in rows:
            if self.floor:
                row["x_floor"] = row["peak"] / self.floor
            if self.compared is not None:
                row["bundled"] = self.compared.get(row["level"])
        return rows

    def __str__(self) -> str:
        lines = [
            f"derived levels for {self.model_class} at batch {self.batch_size} "
            f"(input {list(self.input_shape)}), in {self.seconds:.0f} s"
        ]
        if self.floor:
            lines.append(f"physical floor {format_bytes(self.floor)}")
        for row in self.table():
            text = f"  level {row['level']}: peak {format_bytes(row['peak']):>11}"
            if row.get("time") is not None:
                text += f", {row['time']:.2f}x time (modelled)"
            if "x_floor" in row:
                text += f", {row['x_floor']:.2f}x floor"
            if row.get("bundled") is not None:
                text += f", bundled {self.bundled}: {format_bytes(row['bundled'])}"
            lines.append(text + f"; {row['plan']}")
        return "\n".join(lines)


def _first(sequence: Sequence[str], wanted: Sequence[str]) -> int | None:
    """The first level (1-based) whose strategy is one of ``wanted``."""
    return next((k + 1 for k, s in enumerate(sequence) if s in wanted), None)


def _emit(
    regions: Regions,
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
    menu ]): per unit a selective rung, one redoing its cheap products, a full rung and its
    inner regions (nested, or alone: NOTE [ Inner regions alone ]), each from the first level
    that uses it; per stage the same for its ways; runs of units (NOTE [ Runs of units ])."""
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
            rules.append(_rule(module, first, keep="heavy"))
        below = _first(ways, ("stage_below",))
        if below is not None:
            rules.append(_rule(module, below, keep=cheap))
        held = _first(ways, ("held", "held_nested"))
        if held is not None:
            rules.append(_rule(module, held))
    for block in menus.blocks:
        sequence = [lv.get(block.name, "keep") for lv in per_level]
        span = spans[block.name]
        selective = _first(sequence, ("selective",))
        below = _first(sequence, ("selective_below",))
        full = _first(sequence, ("full", "nested", "held_nested"))
        inside = _first(sequence, ("inner", "nested"))
        if selective is not None:
            rules.append(_rule(span, selective, keep="heavy"))
        if below is not None:
            rules.append(_rule(span, below, keep=cheap))
        if full is not None:
            rules.append(_rule(span, full))
        if inside is not None:  # the inner regions the planner priced, with their spans
            rules += [_rule(spans[n], inside) for n in menus.inner_of[block.name]]
    if groups_from is not None:
        rules += [_rule(g, groups_from, segments="auto") for g in groups]
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
        rules.append(_rule(run, runs_from))
    if whole_from is not None:
        rules += [_rule(s, whole_from) for s in regions.stages]
    if fallback:  # first, so that the derived rules win where both set a module's way
        rules = [*fallback, *rules]
    if lean_from is not None:
        rules += [_rule(s, lean_from, lean=True) for s in _lean_outside_runs(regions, rules)]
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
# win). ``_lost_rules`` checks the result against the plan the config makes.


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


def _lost_rules(model: nn.Module, rules: Sequence[LevelRule]) -> list[str]:
    """The rules of ``rules`` that decide no rung in the plan they make (a later rule replaced
    them): none, for the derivation's own (NOTE [ One rung per way ])."""
    config = CheckpointConfig(preset=None, rules=list(rules))
    used = {text for e in plan(model, config) for text in e.rule.split("; ")}
    return [str(r) for r in rules if str(r) not in used]


def _lean_outside_runs(regions: Regions, rules: Sequence[LevelRule]) -> list[Span]:
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
        if _inside(s.name, lean.name) and exact_name_pattern(s.name) in matched
    }
    return [s for s in regions.lean if s.name not in in_runs | holding]


def _measured_peak(work: Workload, config: CheckpointConfig, level: int, target: int) -> int:
    """The step peak at ``target`` of ``config`` at ``level``, from the two small batches only
    (a derivation measures a dozen plans: the halfway batch would double its time)."""
    with applied(work.model, config), training_level(level):
        return extrapolated_peak(peak_measurer(work), target, None, halfway=False)[0]


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


def _plan_of(menus: Menus, choice: Choice) -> dict[str, str]:
    """A choice of the program as unit -> strategy."""
    return dict(zip((b.name for b in menus.blocks), _key(choice), strict=True))


def _top_choice(menus: Menus) -> tuple[Choice, Choice]:
    """The least memory the menus reach, and the fastest mix within _TOP_SLACK of it."""
    least = least_memory(menus.blocks, menus.base, menus.spans)
    top_goal = int(least.peak * (1 + _TOP_SLACK))
    return least, choose(menus.blocks, menus.base, top_goal, spans=menus.spans) or least


def _plans(
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
    least, top = _top_choice(menus)
    if top_peak is None:
        top_peak = measure(1, [_plan_of(menus, top)])
    top_peak = min(menus.peak0, top_peak)
    goals = [
        int(menus.peak0 * (top_peak / menus.peak0) ** w)
        for w in _spaced(menus.peak0, top_peak, anchors or {})
    ]
    goals += [top.peak, least.peak]  # level 5: the least memory, and the stages whole on top
    previous: tuple[str, ...] = ("keep",) * len(names)
    out: list[_Best] = []

    def level(k: int, goal: int, blocks: list[Block], spans: list[ChainSpan]) -> _Best:
        """Level k's mix under ``goal`` from these menus, asked again and made cheaper."""
        asked = goal
        best: _Best | None = None
        for _ in range(_ROUNDS):
            choice = choose(blocks, menus.base, asked, spans=spans)
            reached = choice is not None
            if choice is None:  # the growing plan cannot reach the goal: its least memory
                choice = least_memory(blocks, menus.base, spans)
            plan = _plan_of(menus, choice)
            peak = measure(k, [*(p for p, _, _ in out), plan])
            if best is None or peak < best[2] * (1 - _EXTRA_GAIN):
                best = (plan, choice, peak)
            if k > len(_SPACING) or best[2] <= goal * (1 + _STEP) or not reached:
                break
            # the program under-predicted this mix: ask for less by the factor it missed by
            asked = max(least.peak, int(goal * choice.peak / peak))
        assert best is not None
        if k == len(_SPACING) + 1:  # level 4: as cheap as the least measured top allows
            lowest = min(top_peak, best[2])
            best = _cheaper(menus, blocks, spans, out, best, lowest, _TOP_SLACK, measure)
        elif k < len(_SPACING) + 1 and best[2] > goal * (1 + _STEP):  # missed: pay no more
            best = _cheaper(menus, blocks, spans, out, best, best[2], _STEP, measure)
        return best

    for k, goal in enumerate(goals, start=1):
        once = k <= len(_SPACING)
        best = level(k, goal, *_restricted(menus, previous, once))
        below = out[-1][2] if out else menus.peak0
        if once and best[2] > below * (1 - _STEP):  # the knee is below: past it, or no step
            past = level(k, goal, *_restricted(menus, previous))
            if past[2] < best[2] * (1 - _EXTRA_GAIN):
                best = past
        previous = _key(best[1])
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
    spans: list[ChainSpan],
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
        plan = _plan_of(menus, choice)
        peak = measure(len(below) + 1, [*(p for p, _, _ in below), plan])
        lowest = min(lowest, peak)
        if peak <= lowest * (1 + slack) and choice.time < best[1].time:
            best, dear = (plan, choice, peak), asked
        else:
            cheap = asked
    return best


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

    Traces one forward for the candidate regions (NOTE [ Regions from a trace ]), prices each
    unit's options at two small batches as the per-block planner does, chooses five levels on
    the resulting memory/time curve that each grow the level below (NOTE [ Five levels from one
    menu ]), and measures every level's step peak. Nothing about the model's library or classes
    is used; the model's own checkpointing and any applied config are left as they were.

    Args:
        model: the model, on its device, in the state it trains in.
        example_input: one input batch of any size (a sample's shape is what matters).
        batch_size: the batch the levels are for (default: the example's).
        loss_fn: maps the output to a scalar loss (default: mean of squares).
        floor: also measure the physical floor (two more small steps).
        compare: when a bundled preset knows the model, measure its levels' peaks too (ten
            more small steps), for :meth:`DerivedPreset.table`.

    Returns:
        A :class:`DerivedPreset`: ``rules``, ``config(level)``, ``to_yaml()``, and per level its
        peak and predicted time.

    Raises:
        ConfigError: the trace finds nothing to checkpoint.

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
    ...                     *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    ...                       for _ in range(3)])
    >>> found = derive_preset(net, torch.randn(2, 3, 16, 16), batch_size=16, floor=False)
    >>> found.levels[-1].peak < found.peak0
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
        menus = measure_menus(work, target, base, _MENU, None, True, outer)
        menus.spans = _small_stages_whole(menus, regions)
        alone = _inner_apart(menus)
        levels, rules = _levels(work, regions, menus, alone, target)
        floor_bytes = _floor_at(model, work, target, loss_fn) if floor else None
        bundled = preset_for_model(model)
        compared = None
        if compare and bundled is not None:
            own = CheckpointConfig(preset=bundled)
            compared = {k: _measured_peak(work, own, k, target) for k in range(1, 6)}
    return DerivedPreset(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        batch_size=target,
        input_shape=tuple(example_input.shape[1:]),
        rules=rules,
        levels=levels,
        peak0=menus.peak0,
        base_time=menus.base_time,
        floor=floor_bytes,
        seconds=time.perf_counter() - started,
        units=[b.name for b in menus.blocks],
        compared=compared,
        bundled=bundled,
    )


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
# Only stages whose units are all single layers (NOTE [ The size table's rows ]): such a
# stage is a small block, one recomputation like any other unit's. A stage of blocks is a
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


def _small_stages_whole(menus: Menus, regions: Regions) -> list[ChainSpan]:
    """The stages on the menu, recomputed whole only where they hold single layers (NOTE [ A
    stage recomputed whole ])."""

    names = [u.name for u in regions.units]

    def layers_only(span: ChainSpan) -> bool:  # a unit holding units counts by those
        layers = _innermost_units(names, span.name)
        return bool(layers) and all(regions.sizes.get(n, 2) == 1 for n in layers)

    return [
        s for s in menus.spans if s.option.strategy not in ("held", "held_nested") or layers_only(s)
    ]


@dataclass
class _Additions:
    """What the program cannot price, tried on top of the levels: each the lowest level it is
    kept from, or ``None`` (NOTE [ Five levels from one menu ])."""

    stacks: list[Span]
    """The stacks that may run as groups: those whose blocks the top level recomputes whole."""
    merged: list[Span] = field(default_factory=list)
    """The runs of units the top level recomputes whole, each as one run (NOTE [ Runs of
    units ]): the candidates, each tried on its own."""
    groups: int | None = None
    lean: int | None = None
    whole: int | None = None
    fallback: int | None = None
    runs: dict[str, int] = field(default_factory=dict)
    """A kept run of units (its label) -> the level it runs from."""

    def kept_runs(self) -> list[tuple[Span, int]]:
        """Each kept run of units with the level it runs from, in the trace's order."""
        return [(r, self.runs[r.label]) for r in self.merged if r.label in self.runs]

    def rules(
        self, model: nn.Module, regions: Regions, menus: Menus, per_level: Sequence[dict[str, str]]
    ) -> list[LevelRule]:
        extra = _fallback_at(model, self.fallback) if self.fallback is not None else []
        if extra:  # a later member of a derived run is recomputed with its run, not alone
            runs = [*regions.named().values(), *(r for r, _ in self.kept_runs())]
            inside = {
                exact_name_pattern(m)
                for span in runs
                if span.kind == "run"
                for m in span.members[1:]
            }
            extra = [r for r in extra if r.match not in inside]
        return _emit(
            regions,
            menus,
            per_level,
            self.lean,
            self.groups,
            self.stacks,
            self.whole,
            extra,
            self.kept_runs(),
        )


def _try_additions(
    work: Workload,
    regions: Regions,
    menus: Menus,
    per_level: Sequence[dict[str, str]],
    levels: list[DerivedLevel],
    target: int,
    lean: int | None,
) -> _Additions:
    """Groups, runs of units as one, whole stages and the fallback's regions, each from the top
    down and kept where it lowers the measured peak enough, each on top of the ones kept before
    it and of the lean MLPs (``lean``: the level they run from, decided before the levels)."""
    found = _Additions(
        _stacks(regions, per_level[-1]), _merged_runs(regions, per_level[-1]), lean=lean
    )

    def config_with(change: Callable[[int], dict[str, Any]]) -> Callable[[int], CheckpointConfig]:
        """The plan with what was kept so far and ``change(k)`` (fields of ``found``) from
        level k on."""

        def config_from(k: int) -> CheckpointConfig:
            trial = replace(found, **change(k))
            return CheckpointConfig(
                preset=None, rules=trial.rules(work.model, regions, menus, per_level)
            )

        return config_from

    def run_from(run: Span) -> Callable[[int], dict[str, Any]]:  # on top of the runs kept
        return lambda k: {"runs": {**found.runs, run.label: k}}

    def whole_at(k: int) -> bool:  # a group of blocks is a large module: level 4 and up
        return k >= _STAGE_LEVEL and all(
            per_level[k - 1].get(m) in _RECOMPUTED for g in found.stacks for m in g.members
        )

    def runs_at(run: Span) -> Callable[[int], bool]:  # a large module: level 4 and up
        return lambda k: k >= _STAGE_LEVEL and run in _merged_runs(regions, per_level[k - 1])

    def only_top(k: int) -> bool:
        return k == len(levels)

    if found.stacks:
        found.groups = _from_top(
            work, levels, target, config_with(lambda k: {"groups": k}), whole_at
        )
    for run in found.merged:  # each on its own: one may lower the peak, the next raise it
        start = _from_top(work, levels, target, config_with(run_from(run)), runs_at(run))
        if start is not None:
            found.runs[run.label] = start
    if regions.stages:
        found.whole = _from_top(
            work, levels, target, config_with(lambda k: {"whole": k}), only_top, _STEP
        )
    if _fallback_at(work.model, len(levels)):  # _from_top drops it where it does not combine
        found.fallback = _from_top(
            work, levels, target, config_with(lambda k: {"fallback": k}), only_top, _STEP
        )
    return found


def _account(levels: list[DerivedLevel], found: _Additions, regions: Regions, menus: Menus) -> None:
    """After marking: each addition from the first level that runs its own plan, and the
    forward each adds that the program did not price (a group, a whole stage or the
    fallback's trunk runs its blocks' forwards once more; a run of units none)."""
    for name in ("groups", "lean", "whole", "fallback"):
        setattr(found, name, _first_unmarked(levels, getattr(found, name)))
    starts = {label: _first_unmarked(levels, k) for label, k in found.runs.items()}
    found.runs = {label: k for label, k in starts.items() if k is not None}
    every = [b.name for b in menus.blocks]
    for lv in levels:
        if lv.same_as is not None:
            continue
        if found.lean is not None and lv.level >= found.lean:
            lv.lean = tuple(s.name for s in regions.lean)
        lv.runs = tuple(r.label for r, k in found.kept_runs() if lv.level >= k)
        if found.groups is not None and lv.level >= found.groups:
            grouped = [m for g in found.stacks for m in g.members]
            lv.predicted_time += _forward_seconds(menus, grouped)
        if found.whole is not None and lv.level >= found.whole:
            lv.whole = tuple(s.name for s in regions.stages)
            inside = [n for n in every if any(_inside(n, s) for s in lv.whole)]
            lv.predicted_time += _forward_seconds(menus, inside)
        if found.fallback is not None and lv.level >= found.fallback:
            lv.fallback = True
            lv.predicted_time += _forward_seconds(menus, every)
    for lv in levels:  # a marked level shows the figures of the level whose plan it runs
        if lv.same_as:
            lv.predicted_time = levels[lv.same_as - 1].predicted_time


def _levels(
    work: Workload, regions: Regions, menus: Menus, alone: dict[str, Option], target: int
) -> tuple[list[DerivedLevel], list[LevelRule]]:
    """Levels 1-5 chosen, measured, given what the program cannot price, and marked, and the
    rules that run them (NOTE [ Five levels from one menu ])."""

    seen: dict[tuple[int, tuple[str, ...]], int] = {}

    def measure_with(lean: int | None) -> Callable[[int, list[dict[str, str]]], int]:
        def measure(k: int, plans: list[dict[str, str]]) -> int:
            rules = _emit(regions, menus, plans, lean)
            key = (k, tuple(r.model_dump_json() for r in rules))
            if key not in seen:  # a plan asked for again (a goal the program cannot reach)
                config = CheckpointConfig(preset=None, rules=rules)
                seen[key] = _measured_peak(work, config, k, target)
            return seen[key]

        return measure

    least, top = _top_choice(menus)
    lean, top_peak = _lean_first(regions, menus, top, measure_with)
    lowest = _lowest(work, regions, menus, (least, top), lean, top_peak, target)
    plans = _plans(menus, measure_with(lean), lowest, _anchors(work, regions, target))
    plans = _unnested(menus, alone, plans, measure_with(lean))
    per_level = [strategies for strategies, _, _ in plans]
    levels = [
        DerivedLevel(
            level=k,
            strategies=strategies,
            predicted_peak=choice.peak,
            predicted_time=menus.base_time + choice.time,
            peak=peak,
        )
        for k, (strategies, choice, peak) in enumerate(plans, start=1)
    ]
    found = _try_additions(work, regions, menus, per_level, levels, target, lean)
    if found.lean is not None:
        for lv in levels[found.lean - 1 :]:
            lv.lean = tuple(s.name for s in regions.lean)
    _mark_steps(levels, menus.peak0, menus.base_time)
    _account(levels, found, regions, menus)
    per_level = [lv.strategies for lv in levels]
    rules = found.rules(work.model, regions, menus, per_level)
    # the fallback's rules come first so that derived ones replace them (_Additions.rules)
    extra = _fallback_at(work.model, found.fallback) if found.fallback is not None else []
    replaced = {str(r) for r in extra}
    lost = [r for r in _lost_rules(work.model, rules) if r not in replaced]
    internal_assert(not lost, f"derived rules that no level runs: {lost}")
    return levels, rules


def _inner_apart(menus: Menus) -> dict[str, Option]:
    """Takes the ``inner`` options off the program's menus, and returns them by unit: they are
    tried by measurement only (NOTE [ Inner regions alone ])."""
    inner = {b.name: o for b in menus.blocks for o in b.options if o.strategy == "inner"}
    menus.blocks = [
        Block(b.name, tuple(o for o in b.options if o.strategy != "inner")) for b in menus.blocks
    ]
    return inner


def _unnested(
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


def _anchors(work: Workload, regions: Regions, target: int) -> dict[int, int]:
    """Levels 2 and 3's anchors: the measured peak of every region of the size table's row 2,
    then 3, checkpointed alone (NOTE [ The size table's rows ]), where the row holds more than
    the row below."""
    out: dict[int, int] = {}
    below: list[Span] = regions.of_size(1)
    for size in (2, 3):
        spans = regions.of_size(size)
        if spans and [s.name for s in spans] != [s.name for s in below]:
            rules = [_rule(s, 1) for s in spans]
            out[size] = _measured_peak(work, CheckpointConfig(preset=None, rules=rules), 1, target)
        below = spans
    return out


def _lowest(
    work: Workload,
    regions: Regions,
    menus: Menus,
    least_top: tuple[Choice, Choice],
    lean: int | None,
    top_peak: int | None,
    target: int,
) -> int:
    """Ptop of NOTE [ Five levels from one menu ]: the least measured peak of the top mix
    (``top_peak``, if measured already), the least-memory mix, and that mix with its stacks
    as sqrt(n) groups."""
    least, top = least_top

    def peak_of(choice: Choice, grouped: bool) -> int:
        plan = _plan_of(menus, choice)
        stacks = _stacks(regions, plan) if grouped else []
        rules = _emit(regions, menus, [plan], lean, 1 if stacks else None, stacks)
        return _measured_peak(work, CheckpointConfig(preset=None, rules=rules), 1, target)

    peaks = [top_peak if top_peak is not None else peak_of(top, False)]
    if _key(least) != _key(top):
        peaks.append(peak_of(least, False))
    if _stacks(regions, _plan_of(menus, least)):
        try:
            peaks.append(peak_of(least, True))
        except ConfigError:  # a group over a block whose own region starts at the same level
            pass  # (HF PoolFormer): it does not combine, as in _from_top
    return min(peaks)


# a unit recomputed whole, or its inner regions (NOTE [ Inner regions alone ]): a group over
# such units recomputes their forward as nested ones would
_RECOMPUTED = ("full", "nested", "inner")


def _stacks(regions: Regions, plan: dict[str, str]) -> list[Span]:
    """The stacks that may run as groups under ``plan``: those whose blocks it recomputes whole
    or by their inner regions (over kept or selective blocks a group would cost the stack's
    whole forward again)."""
    return [g for g in regions.groups if all(plan.get(m) in _RECOMPUTED for m in g.members)]


# NOTE [ Runs of units ]
#
# Consecutive units can be, one after another, a run of the trace: the pieces a long run of
# sibling calls is cut into (one layer with weights each, NOTE [ Regions from a trace ]), or
# modules that are units of their own because the run through them was not chosen (MONAI
# VNet's input transition and first down-transition: the runs inside the second were longer).
# Where a level recomputes two or more such units, each region keeps its own input, the
# output of the unit before it. The same units as one run keep only the first one's input,
# for no more work (each member runs once more, as before; a member's inner regions, nested
# or alone, are checkpointed again inside the run); the run's backward then holds all their
# activations at once, which is why the units stay the default and the run is tried as
# an addition, from the top down and from level 4 (a run of units is a large module), kept
# where it lowers the measured peak by _EXTRA_GAIN. Each run is tried on its own, on top of
# the runs kept before it: one run can lower the peak where the next raises it (VNet's
# encoder run took its level 4 from 1.78 to 1.62 GiB, its decoder run raised level 5 by 4%,
# and the two tried together were both dropped). VNet: the input transition's output is the
# last up-transition's skip, kept as the first down-transition's input until that
# up-transition's backward, when the step peaks; as one run the two keep the input volume
# instead (1637 to 1509 MiB at batch 8 of 64^3, with the up-transition's inner regions alone:
# NOTE [ Inner regions alone ]).
#
# A member's own full region from the run's level on is left out (the run takes over a later
# member's rungs from its level, NOTE [ Runs take over ] in _planning, and the first member's
# region and the run's, at one level, would be two rungs of one module where one decides).


def _merged_runs(regions: Regions, plan: dict[str, str]) -> list[Span]:
    """The runs of two or more consecutive units of one traced run that ``plan`` recomputes
    (whole or by their inner regions, which then nest in the run; a lean MLP runs alone), each
    as one run span (NOTE [ Runs of units ])."""
    lean = {s.name for s in regions.lean}
    out: list[Span] = []
    for chain in regions.chains:
        taken: list[Span] = []
        for unit in [*chain, None]:
            if unit is not None and plan.get(unit.name) in _RECOMPUTED and unit.name not in lean:
                taken.append(unit)
                continue
            if len(taken) >= 2:
                members = tuple(m for u in taken for m in u.members)
                out.append(_run_span(members, taken[0].order))
            taken = []
    return out


def _lean_first(
    regions: Regions,
    menus: Menus,
    top: Choice,
    measure_with: Callable[[int | None], Callable[[int, list[dict[str, str]]], int]],
) -> tuple[int | None, int | None]:
    """The level the lean MLPs run from (4, where they lower the top mix's measured peak by
    _EXTRA_GAIN, else ``None``) and the top mix's measured peak with that choice (``None``
    where there is no lean MLP to try): decided before the levels are chosen, since it moves
    the peak that they are spaced towards (NOTE [ Five levels from one menu ])."""
    plan = [_plan_of(menus, top)] * _STAGE_LEVEL
    if not _lean_outside_runs(regions, _emit(regions, menus, plan, None)):
        return None, None
    without = measure_with(None)(_STAGE_LEVEL, plan)
    lean = measure_with(_STAGE_LEVEL)(_STAGE_LEVEL, plan)
    return (_STAGE_LEVEL, lean) if lean <= without * (1 - _EXTRA_GAIN) else (None, without)


def _fallback_at(model: nn.Module, level: int) -> list[LevelRule]:
    """The structural fallback's rules (``presets.fallback_rules``), all from ``level`` on: its
    nesting of trunk, stages, blocks and layers, a candidate for the top level where it holds
    less than the derived regions; none when the fallback finds no structure."""
    try:
        found = fallback_rules(model)
    except ConfigError:
        return []
    return [r.model_copy(update={"level": Level(level)}) for r, _ in found if r.level > 0]


def _forward_seconds(menus: Menus, names: Sequence[str]) -> float:
    """Seconds of one more forward of the named units, as the menus priced ``full``."""
    wanted = set(names)
    return sum(
        o.time for b in menus.blocks if b.name in wanted for o in b.options if o.strategy == "full"
    )


def _first_unmarked(levels: list[DerivedLevel], start: int | None) -> int | None:
    """``start``, moved up past levels marked as the level below's plan (which run that plan,
    additions included only from a level of their own)."""
    while start is not None and levels[start - 1].same_as is not None:
        start = start + 1 if start < len(levels) else None
    return start


def _from_top(
    work: Workload,
    levels: list[DerivedLevel],
    target: int,
    config_from: Callable[[int], CheckpointConfig],
    allowed: Callable[[int], bool] = lambda k: True,
    gain: float = _EXTRA_GAIN,
) -> int | None:
    """The lowest level from which an addition to the plan (``config_from(k)``: the plan with
    it from level k on) is kept: from the top level down, while it lowers that level's
    measured peak by _EXTRA_GAIN; updates those levels' peaks (NOTE [ Five levels from one
    menu ])."""
    start = None
    for k in range(len(levels), 0, -1):
        if not allowed(k):
            break
        try:
            peak = _measured_peak(work, config_from(k), k, target)
        except ConfigError:  # the addition does not combine with this level's regions (a
            break  # ModuleList group over a layer whose own region starts at the same level)
        if peak > levels[k - 1].peak * (1 - gain):
            break
        levels[k - 1].peak = peak
        start = k
    return start


def _mark_steps(levels: list[DerivedLevel], peak0: int, base_time: float) -> None:
    """Mark each level that lowers the measured peak by less than _STEP from the level below
    as running that level's plan (level 0: nothing checkpointed), with its figures."""
    below: DerivedLevel | None = None
    for lv in levels:
        below_peak = below.peak if below is not None else peak0
        if lv.peak <= below_peak * (1 - _STEP):
            below = lv
            continue
        lv.same_as = below.level if below is not None else 0
        lv.peak = below_peak
        lv.strategies = dict(below.strategies) if below is not None else {}
        lv.lean = below.lean if below is not None else ()
        lv.whole = below.whole if below is not None else ()
        lv.fallback = below.fallback if below is not None else False
        lv.predicted_peak = below.predicted_peak if below is not None else peak0
        lv.predicted_time = below.predicted_time if below is not None else base_time


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
