"""The candidate regions of a traced model: what the derivation chooses from.

Owns the reading of one traced forward (``_spans``) into the derivation's candidates (NOTE
[ Regions from a trace ]): the units the program chooses one option for, their inner regions,
the stages and stacks that hold them, the lean MLPs, the runs of units, and each region's row of
the size table (NOTE [ The size table's rows ], NOTE [ A block of single layers ]), with the
rule that makes a candidate a region. It knows no module name or class, and measures nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config.levels import Level
from ..config.matching import exact_name_pattern
from ..config.schema import CheckpointConfig, LevelRule
from ..measure._measure import applied, model_restored
from ..regions.apply import run_members
from ._spans import Span, trace_spans

__all__ = [
    "CandidateRegions",
    "regions_of",
    "STAGE_LEVEL",
    "is_inside",
    "run_span",
    "span_rule",
    "innermost_units",
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
#   from one menu ] in _level_search).

_UNIT_LEVEL = Level(3)
_INNER_LEVEL = Level(2)
STAGE_LEVEL = Level(4)


def is_inside(name: str, outer: str) -> bool:
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


def run_span(members: tuple[str, ...], order: int) -> Span:
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
            out.append(run_span(part, run.order))
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
class CandidateRegions:
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
    trace: what may be recomputed as one run (NOTE [ Runs of units ] in ``_derived_rules``)."""

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
            *(span_rule(s, STAGE_LEVEL) for s in self.stages),
            *(span_rule(s, _UNIT_LEVEL) for s in self.units),
            *(span_rule(p, _INNER_LEVEL) for ps in self.inner.values() for p in ps),
        ]
        return rules


def span_rule(span: Span, level: int, **extra: Any) -> LevelRule:
    rule: dict[str, Any] = {"match": exact_name_pattern(span.name), "level": level, **extra}
    if span.kind == "run":
        rule["through"] = span.through
    return LevelRule(**rule)


def regions_of(model: nn.Module, example_input: torch.Tensor) -> CandidateRegions:
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


def _regions(model: nn.Module, spans: Sequence[Span]) -> CandidateRegions:
    """Units, inner regions, stages and lean MLPs of a trace (NOTE [ Regions from a trace ])."""
    blocks = [s for s in spans if s.kind == "block"]
    blocks = [b for b in blocks if not any(is_inside(o.name, b.name) for o in blocks)]
    block_names = [b.name for b in blocks]

    def in_block(name: str) -> bool:
        return any(name == b or is_inside(name, b) for b in block_names)

    def holds_block(name: str) -> bool:
        return any(is_inside(b, name) for b in block_names)

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
            m == t or is_inside(m, t) or is_inside(t, m) for m in ranges[run.label] for t in taken
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
        and not any(s.name == m or is_inside(s.name, m) for m in in_runs)
    ]
    others = [o for o in others if not any(is_inside(o.name, p.name) for p in others)]
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
        if u.kind == "module" and not any(is_inside(o.name, u.name) for o in units):
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
    stages = [s for s in stages if not any(is_inside(s.name, h.name) for h in holders)]
    stages = sorted([*stages, *holders], key=lambda s: s.order)
    return CandidateRegions(units, inner, stages, lean, groups, sizes, chains)


def _chains(units: Sequence[Span], spans: Sequence[Span]) -> list[list[Span]]:
    """The longest sequences of consecutive units (in forward order) whose members, one after
    another, are a run of the trace (NOTE [ Runs of units ] in ``_derived_rules``)."""
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
# is offered whole (NOTE [ A stage recomputed whole ] in _level_search). It is a module the forward
# calls, no unit and in none, that holds two or more units, one after another, all single layers (a
# unit holding units, a squeeze-excitation and the two runs it is cut into, counts by those);
# a repeated block inside it must be one of those units (a stage of MBConv blocks holds only
# single layers, but its repeated blocks are the MBConvs: it stays a stage of blocks), and no
# one stage inside it may hold all of them (a residual wrapper around an MBConv adds a sum,
# nothing kept: the MBConv is the block). The outermost such module is taken. The planner
# prices it as a stage in place of the stages inside it (``measure_menus``'s ``outer``).


def innermost_units(names: Sequence[str], module: str) -> list[str]:
    """The units of ``names`` inside ``module`` that hold no other unit."""
    inside = [n for n in names if is_inside(n, module)]
    return [n for n in inside if not any(is_inside(o, n) for o in inside)]


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
        if any(m == u or is_inside(m, u) for u in names):  # a unit, or inside one
            continue
        if any(is_inside(b, m) and b not in names for b in repeated):  # a stage of blocks
            continue
        inside = [i for i, n in enumerate(names) if is_inside(n, m)]
        layers = innermost_units(names, m)
        if len(layers) < 2 or any(sizes.get(n) != 1 for n in layers):
            continue
        if any(all(is_inside(n, g) for n in layers) for g in stages if is_inside(g, m)):
            continue  # one stage inside holds them all: that stage is the block
        if inside == list(range(inside[0], inside[-1] + 1)):  # one after another
            found[m] = span
    return [s for s in found.values() if not any(is_inside(s.name, o) for o in found)]


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
# the derived levels 2 and 3's anchors (NOTE [ Five levels from one menu ] in _level_search).


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
