"""The per-block planner: a strategy for every block so a step fits a budget in the least time
(:func:`plan_for_budget`).

Uniform levels are coarse: a budget between two levels forces the costlier one on every block.
The planner prices, for every candidate block, each way of running it (keep its activations,
selective, full checkpoint, full with its inner regions checkpointed again) by the bytes it
keeps and the *measured* time of the work it adds, then picks one per block with the dynamic
program of ``vision_ckpt.tune._optimise`` and checks the answer by measuring it: see NOTE [ Pricing
the strategies of a block ] below and NOTE [ One strategy per block ] in ``_optimise``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import TorchDispatchMode
from ..config.levels import Level
from ..config.matching import exact_name_pattern
from ..config.schema import CheckpointConfig, LevelRule, parse_memory_budget
from ..errors import ConfigError
from ..measure._extrapolate import extrapolated_peak, peak_measurer, small_batches
from ..measure._measure import (
    FitCheck,
    LossFn,
    Workload,
    applied,
    confirm_fits,
    default_loss,
    following_global,
    model_restored,
    run_step,
    step_time as measure_step_time,
)
from ..measure._memory import count_saved_bytes, format_bytes
from ..measure._price import cheap_product_flops, modelled_step_seconds, op_seconds
from ..regions.apply import plan as _plan, run_members
from ..runtime._selective import HEAVY_OPS, SaveOps
from ..runtime.wrapper import training_level
from ._optimise import Block, Choice, Option, Span, choose, predict
from ._search import check_margin

__all__ = [
    "BudgetPlan",
    "plan_for_budget",
    "planner_frontier",
    "resolve_auto",
    "level_signature",
    "PLANNER_MENU",
    "STRATEGIES",
    "Menus",
    "measure_menus",
    "least_memory",
    "step_seconds",
]

STRATEGIES: tuple[str, ...] = ("keep", "selective", "selective_below", "full", "nested", "stage")
"""The menu of a block: ``keep`` (no checkpoint), ``selective`` (keep the outputs of
convolutions, matrix products and attention; recompute the rest), ``selective_below``
(selective, and the products cheaper to redo than a norm are redone too: NOTE [ Products
cheap to redo ] in ``_price``), ``full`` (keep only the block's input), ``nested`` (full, and
while the block is recomputed its inner regions of the plan are checkpointed again: less
memory during its backward, for a second recomputation of them; offered only for blocks that
have inner regions), ``stage`` (the module holding a run of blocks, a stage, is one selective
region: it also recomputes what the blocks pass each other; every block of the stage takes it
or none does). :data:`PLANNER_MENU` is the planner's default."""

PLANNER_MENU: tuple[str, ...] = ("keep", "selective", "full", "nested", "stage")
"""The strategies :func:`plan_for_budget` and :func:`planner_frontier` offer unless told others."""

# The levels the planner's config gives each strategy: a selective block is a rung of its own
# (level 1), full blocks are medium modules (3), the inner regions of nested blocks small ones
# (2); a training level of 3 then runs exactly the chosen strategies.
_LEVEL = {"selective": Level(1), "selective_below": Level(1), "full": Level(3), "nested": Level(3)}
_INNER_LEVEL = Level(2)
_TRAINING_LEVEL = Level(3)


@dataclass
class BudgetPlan:
    """The answer of :func:`plan_for_budget`: a strategy per block, as an editable config."""

    config: CheckpointConfig | None
    """A config whose rules run exactly the chosen strategies (``None`` if nothing fits)."""
    blocks: list[str]
    """Qualified names of the blocks that are checkpointed (any strategy but ``keep``)."""
    budget_bytes: int
    batch_size: int
    predicted_peak: int
    """Peak at ``batch_size`` extrapolated from small-batch measurements of the final plan."""
    candidates: list[dict[str, Any]]
    """Every candidate block with its menu: per strategy, kept bytes, transient bytes and
    seconds, at ``batch_size``."""
    strategies: dict[str, str] = field(default_factory=dict)
    """Candidate block -> chosen strategy (one of :data:`STRATEGIES`)."""
    stages: list[str] = field(default_factory=list)
    """The stages run as one selective region (their blocks' strategy is ``stage``)."""
    stage_candidates: list[dict[str, Any]] = field(default_factory=list)
    """Every stage on the menu: its blocks, and kept and transient bytes and seconds at
    ``batch_size`` as one selective region (the ``stage`` strategy)."""
    predicted_time: float | None = None
    """Predicted seconds per step at ``batch_size``: the plain step's time (extrapolated from
    the small batches) plus the chosen strategies' extra work."""
    base_time: float | None = None
    """Predicted seconds per step at ``batch_size`` with no checkpointing."""
    base_bytes: int = 0
    """What the step holds besides the candidate blocks' kept bytes (the planner's model)."""
    rounds: int = 0
    """How many answers were measured (each over-budget one corrected the model)."""
    seconds: float = 0.0
    """Wall time the planning took, ``measure_seconds`` + the check."""
    measure_seconds: float = 0.0
    """Of which: pricing the blocks' menus and level 0's peak (the rest measured the answers)."""
    uniform: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per uniform training level: ``peak`` (predicted at ``batch_size``), ``fits`` and, for one
    that fits, ``time``: its step time measured at the small batches and extrapolated, the way
    ``step_time`` is (NOTE [ Never slower than a uniform level ])."""
    uniform_level: int | None = None
    """The uniform level returned instead of a per-block plan (it fits and no per-block plan was
    faster); ``None`` when ``config`` is a per-block plan (or nothing fits)."""
    step_time: float | None = None
    """The returned config's step time at ``batch_size``, measured and extrapolated like each
    uniform level's ``time``: the figure the two are compared on."""
    per_block: BudgetPlan | None = None
    """When ``uniform_level`` is returned: the per-block plan it beat (``None`` if none fit)."""
    check: FitCheck | None = None
    """The real step at ``batch_size`` that confirmed the answer where the device needs one
    (CUDA); ``None`` on CPU, where the prediction extrapolates the deterministic byte count."""

    def fastest_uniform(self) -> int | None:
        """The fitting uniform level with the shortest step time, or ``None``."""
        return _fastest_uniform(self.uniform)

    def explain(self) -> str:
        """One line: what was chosen and what it is predicted to cost."""
        if self.uniform_level is not None:
            return (
                f"level {self.uniform_level} (uniform) fits and no per-block plan was faster: "
                f"predicted peak {format_bytes(self.predicted_peak)} at batch {self.batch_size} "
                f"(budget {format_bytes(self.budget_bytes)})"
            )
        if self.config is None:
            return (
                f"no plan fits {format_bytes(self.budget_bytes)} at batch {self.batch_size}: "
                f"the smallest predicted peak is {format_bytes(self.predicted_peak)}"
            )
        counts: dict[str, int] = defaultdict(int)
        for strategy in self.strategies.values():
            counts[strategy] += 1
        mix = ", ".join(
            f"{counts[s]} in {len(self.stages)} selective stage(s)"
            if s == "stage"
            else f"{counts[s]} {s}"
            for s in STRATEGIES
            if counts[s]
        )
        slower = (
            f", +{self.predicted_time / self.base_time - 1:.0%} time"
            if self.predicted_time and self.base_time
            else ""
        )
        return (
            f"plan fits: predicted peak {format_bytes(self.predicted_peak)} at batch "
            f"{self.batch_size} (budget {format_bytes(self.budget_bytes)}{slower}); blocks: {mix}"
        )


def _candidate_blocks(plan: Any) -> list[Any]:
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


def _with_stage_blocks(model: torch.nn.Module, base: CheckpointConfig, plan: Any) -> Any:
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


def _block_run(entry: Any) -> str | None:
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


def _stage_groups(
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


# NOTE [ Pricing the strategies of a block ]
#
# Everything is measured at the two small batches of NOTE [ Predicting the peak of a larger
# batch ] and extrapolated along the line through them to the target batch.
#
# Bytes. Four forwards with count_saved_bytes, the bytes going to the innermost candidate block
# running when autograd saves them: nothing checkpointed (keep), every block selective, every
# block full, and only the blocks' inner regions checkpointed (what a nested block holds while it
# is recomputed, and what an ``inner`` block keeps: its inner regions without a region of its
# own, on the derivation's menu). kept(s) is the block's figure under strategy s; a full or
# nested block keeps its input. transient(s) is what recomputation brings back: keep's bytes
# minus kept(s); for nested, the inner-checkpointed figure minus the input, plus one inner
# region's share; for inner, that share.
#
# Time. One forward with every operator timed (synchronising the device around each one), each
# operator's time going to the innermost candidate block running it. The extra work of full is
# the block's whole forward; of selective, the operators whose outputs it does not keep (the same
# decision SaveOps makes when it runs); of nested, full plus the operators inside its inner
# regions, which run a third time; of inner, those operators once more. So the price is the
# device's own: on a GPU norms and activations cost far more per FLOP than convolutions, and
# the plan sees it.
#
# Stages. A module holding a run of the blocks (a stage) may be one selective region instead:
# it then also recomputes the tensors its blocks pass each other, which per-block regions keep
# as their inputs. The forwards above also attribute what runs in a stage outside its blocks to
# the stage (its own bytes and operators), and one more forward, every stage selective, gives
# its kept bytes. Those enter the chain less the stage's own keep bytes (which are in the base),
# its transient is its keep bytes (its blocks' and its own) minus its kept bytes, its time the
# operators selective recomputes in it (NOTE [ One strategy per block ], Spans). With ``held``
# on the menu (the derivation's), one more forward, every stage one region recomputed whole,
# gives what such a stage keeps, and its time is every operator in it (NOTE [ A stage
# recomputed whole ] in ``derive``).
#
# Base. Level 0's step peak (extrapolated like every peak) minus the keep bytes of all blocks.
# The step time with no checkpointing is measured at the small batches and extrapolated; the
# predicted time of a plan is that plus its extra work.


class _Regions:
    """Forward hooks that track the innermost candidate block running, and whether an inner
    region of it is running."""

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: Sequence[str],
        inner: Sequence[str],
        runs: dict[str, list[str]],
    ):
        self.blocks: list[str] = []
        self.inner = 0
        modules = dict(model.named_modules())
        self._handles = []
        for name in blocks:
            # a block that is a run of sibling modules (``through``) runs in each of them
            for member in [name, *runs.get(name, ())]:
                self._handles += self._track(
                    modules[member], self.blocks.append, self.blocks.pop, name
                )
        for name in inner:
            self._handles += self._track(modules[name], self._enter, self._leave, name)

    @staticmethod
    def _track(
        module: torch.nn.Module, enter: Callable[[str], Any], leave: Callable[[], Any], name: str
    ) -> list[Any]:
        def pre(*_: Any) -> None:  # a hook's return value would replace the input / output
            enter(name)

        def post(*_: Any) -> None:
            leave()

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _enter(self, name: str) -> None:
        self.inner += 1

    def _leave(self) -> None:
        self.inner -= 1

    def innermost(self) -> str | None:
        return self.blocks[-1] if self.blocks else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _OpTimes(TorchDispatchMode):
    """Seconds spent in each candidate block's operators: all of them, those a selective
    strategy recomputes, and those inside its inner regions; timed, or with ``modelled`` the
    modelled price of each operator (NOTE [ A modelled price ] in ``_price``)."""

    def __init__(
        self,
        regions: _Regions,
        keeps: SaveOps,
        device: torch.device,
        modelled: bool = False,
        below: int | None = None,
    ) -> None:
        super().__init__()
        self.regions = regions
        self.keeps = keeps
        self.keeps_below = SaveOps(keeps.names, below) if below is not None else None
        self.device_type = device.type
        self.modelled = modelled
        self.total: dict[str, float] = defaultdict(float)
        self.recomputed: dict[str, float] = defaultdict(float)
        self.recomputed_below: dict[str, float] = defaultdict(float)
        self.inner: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        block = self.regions.innermost()
        if block is None:
            return func(*args, **kwargs)
        if self.modelled:
            out = func(*args, **kwargs)
            spent = op_seconds(func, args, kwargs, out, self.device_type)
        else:
            cuda = self.device_type == "cuda"
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = func(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            spent = time.perf_counter() - start
        self.total[block] += spent
        # the cheap-product policy keeps a subset of what the heavy one keeps: ask it only there
        if not self.keeps.keeps(func, args):
            self.recomputed[block] += spent
            self.recomputed_below[block] += spent
        elif self.keeps_below is not None and not self.keeps_below.keeps(func, args):
            self.recomputed_below[block] += spent
        if self.regions.inner:
            self.inner[block] += spent
        return out


@contextlib.contextmanager
def _regions(
    model: torch.nn.Module, blocks: Sequence[str], inner: Sequence[str], runs: dict[str, list[str]]
) -> Iterator[Any]:
    regions = _Regions(model, blocks, inner, runs)
    try:
        yield regions
    finally:
        regions.remove()


def _saved_by_block(
    work: Workload, x: torch.Tensor, blocks: Sequence[str], runs: dict[str, list[str]]
) -> dict[str, int]:
    with _regions(work.model, blocks, (), runs) as regions:
        with count_saved_bytes(work.model, region=regions.innermost) as saved:
            out = work.model(x)
        del out
    return {name: saved.by_region.get(name, 0) for name in blocks}


def _timed_forward(
    work: Workload,
    x: torch.Tensor,
    blocks: Sequence[str],
    inner: Sequence[str],
    runs: dict[str, list[str]],
    modelled: bool,
    below: int | None = None,
) -> _OpTimes:
    keeps = SaveOps(HEAVY_OPS, default=True)
    with _regions(work.model, blocks, inner, runs) as regions:
        with _OpTimes(regions, keeps, work.device, modelled, below) as times:
            out = work.model(x)
        del out
    return times


def _strategy_config(
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
    ends = _run_ends(entries)
    rules = []
    for entry in entries:
        if entry.name in stages:
            rules.append(
                LevelRule(
                    match=exact_name_pattern(entry.name),
                    level=_LEVEL["selective"],
                    keep=stages[entry.name],
                )
            )
            continue
        strategy = strategies.get(entry.name, "keep")
        if strategy in ("keep", "stage", "stage_below"):
            continue
        if strategy == "inner":  # its inner regions alone (NOTE [ Inner regions alone ] in derive)
            rules += _inner_rules(ends, inner_of[entry.name])
            continue
        rules.append(
            LevelRule(
                match=exact_name_pattern(entry.name),
                level=_LEVEL[strategy],
                keep=_keep_of(strategy, below),
                through=None if strategy.startswith("selective") else _block_run(entry),
            )
        )
        if strategy == "nested":
            rules += _inner_rules(ends, inner_of[entry.name])
    return _only(base, rules)


def _keep_of(strategy: str, below: int | None) -> Any:
    """What a region of ``strategy`` keeps, as a rule's ``keep``."""
    if strategy.endswith("_below"):  # NOTE [ Products cheap to redo ] in _price
        return {"ops": "heavy", "below": below}
    return "heavy" if strategy in ("selective", "stage") else None


def _run_ends(entries: Sequence[Any]) -> dict[str, str]:
    """Entry name -> the last sibling of the run it starts (``_block_run``), for the runs."""
    return {e.name: end for e in entries if (end := _block_run(e)) is not None}


def _inner_rules(ends: dict[str, str], names: Sequence[str]) -> list[LevelRule]:
    """Rules that make the inner regions ``names`` of blocks regions on their own, each with
    its span (``ends``: ``_run_ends``): a run of siblings stays a run (``conv_pw`` through
    ``bn1``), else the module."""
    return [
        LevelRule(match=exact_name_pattern(n), level=_INNER_LEVEL, through=ends.get(n))
        for n in names
    ]


def _only(base: CheckpointConfig, rules: Sequence[LevelRule]) -> CheckpointConfig:
    return base.model_copy(
        update={
            "preset": None,
            "rules": tuple(rules),
            "training_checkpoint_level": _TRAINING_LEVEL,
            "nesting": "all",
        }
    )


def _line(points: Sequence[tuple[int, float]], target: int) -> float:
    """Bytes at ``target`` along the line through two (batch, bytes) points."""
    (b1, v1), (b2, v2) = points
    return v2 + (v2 - v1) * (target - b2) / (b2 - b1)


def _proportional(points: Sequence[tuple[int, float]], target: int) -> float:
    """Seconds at ``target`` from (batch, seconds) points, as proportional to the batch (least
    squares through the origin): a line through two noisy timings of small batches would
    multiply their noise by the distance to the target."""
    return target * sum(b * v for b, v in points) / sum(b * b for b, _ in points)


@dataclass
class Menus:
    """What :func:`measure_menus` found: the blocks' menus at the target batch and the rest."""

    base_config: CheckpointConfig
    entries: list[Any]
    inner_of: dict[str, list[str]]
    blocks: list[Block]
    table: list[dict[str, Any]]
    peak0: int
    base: int
    """Level 0's peak minus the blocks' keep bytes (NOTE [ Pricing the strategies of a block ])."""
    base_time: float
    spans: list[Span] = field(default_factory=list)
    """The stages on the menu, over the blocks' chain."""
    stage_table: list[dict[str, Any]] = field(default_factory=list)
    stage_of: dict[str, str] = field(default_factory=dict)
    """Block -> the stage holding it (for the blocks of ``spans``)."""
    through: dict[str, str] = field(default_factory=dict)
    """Block -> the last sibling of the run it is (a stem's ``through``), for the blocks that
    are runs."""
    below: int | None = None
    """The ``below`` of the ``selective_below`` strategy (NOTE [ Products cheap to redo ])."""

    def config_for(self, strategies: dict[str, str]) -> CheckpointConfig:
        return _strategy_config(
            self.base_config, self.entries, strategies, self.inner_of, self.stage_of, self.below
        )


@dataclass
class _Setup:
    """What :func:`measure_menus` measures: the candidate blocks and the configs it applies."""

    names: list[str]
    runs: dict[str, list[str]]
    entries: list[Any]
    inner_of: dict[str, list[str]]
    inner_all: list[str]
    uniform: dict[str, CheckpointConfig]
    inner_only: CheckpointConfig
    groups: list[tuple[str, int, int]]
    stages: list[str]
    every_stage: CheckpointConfig
    every_stage_below: CheckpointConfig | None
    candidates: list[Any]
    below: int | None


def _setup(
    model: torch.nn.Module,
    base_config: CheckpointConfig,
    menu: tuple[str, ...],
    outer: Sequence[str] = (),
    below: int | None = None,
) -> _Setup:
    """The candidate blocks of ``base_config``'s plan, their inner regions and stages (those of
    ``outer`` in place of the stages inside them), and the configs that run every block one way
    (NOTE [ Pricing the strategies of a block ])."""
    full_plan = _with_stage_blocks(model, base_config, _plan(model, base_config))
    candidates = _candidate_blocks(full_plan)
    if not candidates:
        raise ConfigError(
            "plan_for_budget found no checkpointable block in the model; give it a config "
            "with rules (or a preset) that select its blocks"
        )
    names = [e.name for e in candidates]
    runs = {
        e.name: run_members(model, e.name, end, "the planner")[1:]
        for e in candidates
        if (end := _block_run(e)) is not None
    }
    entries = list(full_plan.entries)
    ends = _run_ends(entries)
    # a run's later members are left to the run (its span: NOTE [ Runs take over ] in _planning)
    in_runs = {m for e, end in ends.items() for m in run_members(model, e, end, "the planner")[1:]}
    inner_of = {  # the regions inside each block (a lean MLP alone is none)
        n: [
            e.name
            for e in entries
            if e.name.startswith(n + ".") and e.rungs and e.name not in in_runs
        ]
        for n in names
    }
    inner_all = [i for n in names for i in inner_of[n]]
    groups = _stage_groups(full_plan, names, outer) if "stage" in menu else []
    stage_of = {names[first]: g for g, first, _ in groups}

    def every_stage(way: str) -> CheckpointConfig:  # every stage one region run ``way``
        strategies = dict.fromkeys(stage_of, way)
        return _strategy_config(base_config, entries, strategies, inner_of, stage_of, below)

    return _Setup(
        names=names,
        runs=runs,
        entries=entries,
        inner_of=inner_of,
        inner_all=inner_all,
        uniform={
            s: _strategy_config(
                base_config, entries, dict.fromkeys(names, s), inner_of, None, below
            )
            for s in ("selective", "selective_below", "full")
        },
        inner_only=_only(base_config, _inner_rules(ends, inner_all)),
        groups=groups,
        stages=[g for g, _, _ in groups],
        every_stage=every_stage("stage"),
        every_stage_below=every_stage("stage_below") if "stage_below" in menu else None,
        candidates=candidates,
        below=below if {"selective_below", "stage_below"} & set(menu) else None,
    )


_Points = dict[str, dict[str, list[tuple[int, float]]]]


def _measure_points(
    work: Workload, target: int, setup: _Setup, menu: tuple[str, ...], modelled: bool
) -> tuple[_Points, _Points, list[tuple[int, float]]]:
    """Per strategy and block, (batch, bytes) and (batch, seconds) points at the small batches,
    and the plain step's (batch, seconds); seconds timed, or modelled."""
    model, names, runs, stages = work.model, setup.names, setup.runs, setup.stages
    kept: _Points = defaultdict(lambda: defaultdict(list))
    spent: _Points = defaultdict(lambda: defaultdict(list))
    step_time: list[tuple[int, float]] = []
    for b in small_batches(target):
        x = work.batch(b)
        with applied(model, CheckpointConfig()):
            # a stage's own figures (what runs in it outside its blocks) go to the stage
            for n, v in _saved_by_block(work, x, [*names, *stages], runs).items():
                kept["keep"][n].append((b, v))
            times = _timed_forward(
                work, x, [*names, *stages], setup.inner_all, runs, modelled, setup.below
            )
            # timed: warmed by the forwards above
            step = modelled_step_seconds if modelled else measure_step_time
            step_time.append((b, step(work, x)))
        cheap = times.recomputed_below != times.recomputed  # a product under ``below`` ran
        if stages:
            with applied(model, setup.every_stage):
                for g, v in _saved_by_block(work, x, stages, runs).items():
                    kept["stage"][g].append((b, v))
        if stages and setup.every_stage_below is not None and cheap:
            with applied(model, setup.every_stage_below):
                for g, v in _saved_by_block(work, x, stages, runs).items():
                    kept["stage_below"][g].append((b, v))
        if stages and "held" in menu:
            whole = [LevelRule(match=exact_name_pattern(g), level=_LEVEL["full"]) for g in stages]
            with applied(model, _only(setup.uniform["full"], whole)):
                for g, v in _saved_by_block(work, x, stages, runs).items():
                    kept["held"][g].append((b, v))
        for s in ("selective", "selective_below", "full"):
            if (s in menu or (s == "full" and "nested" in menu)) and (
                s != "selective_below" or cheap
            ):
                with applied(model, setup.uniform[s]):
                    for n, v in _saved_by_block(work, x, names, runs).items():
                        kept[s][n].append((b, v))
        if {"nested", "inner"} & set(menu) and setup.inner_all:
            with applied(model, setup.inner_only):
                for n, v in _saved_by_block(work, x, names, runs).items():
                    kept["inner"][n].append((b, v))
        for g, first, last in setup.groups:
            inside = [*names[first : last + 1], g]
            spent["stage"][g].append((b, sum(times.recomputed[n] for n in inside)))
            spent["stage_below"][g].append((b, sum(times.recomputed_below[n] for n in inside)))
            spent["held"][g].append((b, sum(times.total[n] for n in inside)))
        for n in names:
            spent["full"][n].append((b, times.total[n]))
            spent["selective"][n].append((b, times.recomputed[n]))
            spent["selective_below"][n].append((b, times.recomputed_below[n]))
            spent["nested"][n].append((b, times.total[n] + times.inner[n]))
            spent["inner"][n].append((b, times.inner[n]))
    return kept, spent, step_time


def _block_menus(
    setup: _Setup, kept: _Points, spent: _Points, menu: tuple[str, ...], target: int
) -> tuple[list[Block], list[dict[str, Any]]]:
    """Each block's options at ``target``, and the same as a table."""

    def nbytes(points: list[tuple[int, float]]) -> int:
        return int(max(0.0, _line(points, target)))

    def seconds(points: list[tuple[int, float]]) -> float:
        return max(0.0, _proportional(points, target))

    blocks: list[Block] = []
    table: list[dict[str, Any]] = []
    for n in setup.names:
        keep_bytes = nbytes(kept["keep"][n])
        options = [Option("keep", keep_bytes, 0, 0.0)]
        for s in ("selective", "selective_below", "full"):
            if s == "selective" and (spent["selective"][n] == spent["full"][n] or n in setup.runs):
                # no operator it would keep (a max pool): selective is full, but warns; a run
                # of sibling modules is one full region only
                continue
            if s == "selective_below" and (
                n in setup.runs or spent[s][n] in (spent["selective"][n], spent["full"][n])
            ):
                continue  # no product cheap to redo, or none dear: another option already
            if s in menu:
                k = nbytes(kept[s][n])
                options.append(Option(s, k, max(0, keep_bytes - k), seconds(spent[s][n])))
        if {"nested", "inner"} & set(menu) and setup.inner_of[n]:
            held = nbytes(kept["inner"][n])
            # one inner region's activations, back during that region's own backward
            share = max(0, keep_bytes - held) // len(setup.inner_of[n])
            if "nested" in menu:
                # while recomputed: the inner-checkpointed forward's bytes (its input is
                # already in k), then that share
                k = nbytes(kept["full"][n])
                options.append(
                    Option("nested", k, max(0, held - k) + share, seconds(spent["nested"][n]))
                )
            if "inner" in menu:  # NOTE [ Inner regions alone ] in derive
                options.append(Option("inner", held, share, seconds(spent["inner"][n])))
        blocks.append(Block(n, tuple(options)))
        table.append(
            {
                "name": n,
                "options": {
                    o.strategy: {"kept": o.kept, "transient": o.transient, "seconds": o.time}
                    for o in options
                },
            }
        )
    return blocks, table


def _stage_spans(
    setup: _Setup, kept: _Points, spent: _Points, blocks: list[Block], target: int
) -> tuple[list[Span], list[dict[str, Any]]]:
    """Each stage as one selective region over its blocks' chain and, where measured, as one
    region recomputed whole (alone, and around its blocks recomputed whole), and the stages
    as a table."""
    spans, stage_table = [], []
    for g, first, last in setup.groups:
        own = int(max(0.0, _line(kept["keep"][g], target)))
        held = own + sum(blocks[i].options[0].kept for i in range(first, last + 1))

        def way(strategy: str, g: str = g, own: int = own, held: int = held) -> Option:
            """The stage as one selective region (keeping its products, or the dear ones)."""
            k = int(max(0.0, _line(kept[strategy][g], target)))
            seconds = max(0.0, _proportional(spent[strategy][g], target))
            return Option(strategy, max(0, k - own), max(0, held - k), seconds)

        option = way("stage")
        spans.append(Span(g, first, last, option))
        if kept["stage_below"].get(g) and spent["stage_below"][g] not in (
            spent["stage"][g],
            spent["held"][g],
        ):  # NOTE [ Products cheap to redo ] in _price
            spans.append(Span(g, first, last, way("stage_below")))
        if kept["held"].get(g):  # NOTE [ A stage recomputed whole ]
            k = int(max(0.0, _line(kept["held"][g], target)))
            seconds = max(0.0, _proportional(spent["held"][g], target))
            whole = Option("held", max(0, k - own), max(0, held - k), seconds)
            spans.append(Span(g, first, last, whole))
            fulls = [
                o for i in range(first, last + 1) for o in blocks[i].options if o.strategy == "full"
            ]
            if len(fulls) == last - first + 1:
                inner = own + sum(o.kept for o in fulls) + max(o.transient for o in fulls)
                time = seconds + sum(o.time for o in fulls)
                # never more than the stage brings back whole (shared inputs count once)
                again = Option(
                    "held_nested", whole.kept, min(whole.transient, max(0, inner - k)), time
                )
                spans.append(Span(g, first, last, again))
        stage_table.append(
            {
                "name": g,
                "blocks": setup.names[first : last + 1],
                "kept": option.kept,
                "transient": option.transient,
                "seconds": option.time,
            }
        )
    return spans, stage_table


def measure_menus(
    work: Workload,
    target: int,
    base_config: CheckpointConfig,
    menu: tuple[str, ...],
    limit: int | None,
    modelled: bool = False,
    outer: Sequence[str] = (),
) -> Menus:
    """Price every candidate block's menu at ``target`` (NOTE [ Pricing the strategies of a
    block ]), in timed seconds or, with ``modelled``, in the modelled seconds of NOTE [ A
    modelled price ] (``_price``), which are the same on every run; ``outer``: modules priced
    as stages in place of the stages inside them. The model must be restored by the caller."""
    size = next((p.element_size() for p in work.model.parameters() if p.is_floating_point()), 4)
    setup = _setup(
        work.model, base_config, menu, outer, cheap_product_flops(work.device.type, size)
    )
    kept, spent, step_time = _measure_points(work, target, setup, menu, modelled)
    blocks, table = _block_menus(setup, kept, spent, menu, target)
    spans, stage_table = _stage_spans(setup, kept, spent, blocks, target)
    with training_level(0):
        with applied(work.model, base_config):
            peak0 = extrapolated_peak(peak_measurer(work), target, limit)[0]
    names = setup.names
    return Menus(
        base_config=base_config,
        entries=setup.entries,
        inner_of=setup.inner_of,
        blocks=blocks,
        table=table,
        peak0=peak0,
        base=peak0 - sum(b.options[0].kept for b in blocks),
        base_time=max(0.0, _proportional(step_time, target)),
        spans=spans,
        stage_table=stage_table,
        stage_of={names[i]: g for g, first, last in setup.groups for i in range(first, last + 1)},
        through={e.name: end for e in setup.candidates if (end := _block_run(e)) is not None},
        below=setup.below,
    )


def _check_menu(strategies: Sequence[str]) -> tuple[str, ...]:
    menu = tuple(dict.fromkeys(("keep", *strategies)))
    unknown = [s for s in menu if s not in STRATEGIES]
    if unknown:
        raise ConfigError(
            f"unknown strategies {unknown}; allowed: {', '.join(STRATEGIES)} (keep is always "
            "on the menu)."
        )
    return menu


# NOTE [ Never slower than a uniform level ]
#
# The per-block program prices blocks in its own model (NOTE [ Pricing the strategies of a
# block ]); a uniform level is a different set of regions (a preset's lean MLPs, nested
# halves, whole stages), which that model cannot price. A uniform level that fits is always a
# valid answer, so the planner must never return something predicted slower than the fastest
# one. Both are therefore put on one scale: the step time of the config, measured at the two
# small batches (after a warm-up step each) and extrapolated in proportion to the batch (as
# ``base_time`` is). Every uniform level's peak is predicted as in ``suggest_level``; among those
# that fit, the fastest is compared with the per-block plan, and the faster of the two is
# returned (a tie goes to the plan). Levels that run the same regions as a higher level
# (``level_signature``) are measured once. Recomputation only adds work, so no config is
# faster than the step with no checkpointing (``base_time``, measured the same way): a time
# under it is timing noise and is read as ``base_time``. Without that floor, noise would pick a
# checkpointed level over no checkpointing at a budget where nothing needs checkpointing.


def level_signature(plan: Any, level: int) -> tuple[Any, ...]:
    """What a training level runs under ``plan``: per entry, its rung in force, lean MLP and
    grouping; two levels with equal signatures run the same step."""
    at = plan.at_level(level)
    return tuple(
        (
            e.name,
            str(e.rung_at(level)) if e.checkpointed else None,
            e.lean_at(level),
            level in e.holds_several,
        )
        for e in at.entries
    )


def step_seconds(work: Workload, target: int) -> float:
    """The step time at ``target`` of what is applied now: measured at the small batches after a
    warm-up each, proportional to the batch."""
    points = []
    for b in small_batches(target):
        x = work.batch(b)
        run_step(work, x)  # warm-up
        points.append((b, measure_step_time(work, x)))
    return _proportional(points, target)


def _fastest_uniform(uniform: dict[int, dict[str, Any]]) -> int | None:
    """The fitting level of ``uniform`` (as :func:`_uniform_levels` gives it) with the shortest
    step time, the lower level on a tie; ``None`` when none fits."""
    fitting = [lv for lv, u in uniform.items() if u["fits"] and u["time"] is not None]
    return min(fitting, key=lambda lv: (uniform[lv]["time"], lv), default=None)


def _uniform_levels(
    work: Workload,
    target: int,
    base: CheckpointConfig,
    goal: int,
    limit: int,
    floor: float,
    peak0: int,
) -> dict[int, dict[str, Any]]:
    """Per uniform level: predicted peak, whether it fits ``goal``, and its step time if so.
    ``floor`` and ``peak0`` are the plain step's time and peak, already measured for the menus:
    a level that checkpoints nothing takes them instead of measuring that step again."""
    out: dict[int, dict[str, Any]] = {}
    seen: dict[tuple[Any, ...], int] = {}
    with applied(work.model, base) as plan:
        for level in range(5, -1, -1):  # cheapest in memory first
            signature = level_signature(plan, level)
            if signature in seen:
                out[level] = dict(out[seen[signature]])
                continue
            seen[signature] = level
            plain = not any(rung is not None or lean for _, rung, lean, _ in signature)
            with training_level(level):
                if plain:
                    peak = peak0
                else:
                    peak = extrapolated_peak(peak_measurer(work), target, limit)[0]
                fits = peak <= goal
                if not fits:
                    seconds = None
                elif plain:  # checkpoints nothing: the plain step, timed as base_time already
                    seconds = floor
                else:
                    seconds = max(floor, step_seconds(work, target))
            out[level] = {"peak": peak, "fits": fits, "time": seconds}
    return dict(sorted(out.items()))


def plan_for_budget(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    budget: int | str,
    batch_size: int | None = None,
    *,
    config: CheckpointConfig | None = None,
    margin: float = 0.05,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    max_rounds: int = 3,
    strategies: Sequence[str] = PLANNER_MENU,
) -> BudgetPlan:
    """A strategy per block so the step fits ``budget`` at ``batch_size`` in the least time.

    For every candidate block (the plan's finest repeated blocks: residual blocks, transformer
    layers) it measures, at two small batches, the bytes each strategy keeps and the time of the
    work it adds, on the model's own device (NOTE [ Pricing the strategies of a block ]); picks
    one strategy per block minimising the predicted step time under the budget (NOTE [ One
    strategy per block ] in ``vision_ckpt.tune._optimise``); then measures the answer at the small
    batches and, if its extrapolated peak is over, corrects the model and solves again.

    Args:
        model, example_input: the model (on its device) and one input batch of any size.
        budget: bytes, or a string such as ``"6GiB"``.
        batch_size: the batch to plan for (default: the example's).
        config: the config whose plan gives the candidate blocks (default: the model's preset).
        margin: share of the budget kept free: plans aim at ``budget / (1 + margin)``.
        max_rounds: how many answers may be measured and corrected.
        strategies: the menu (a subset of :data:`STRATEGIES`, by default :data:`PLANNER_MENU`;
            ``keep`` is always on it).

    Returns:
        A :class:`BudgetPlan`; its ``config`` is ``None`` when nothing fits, neither a plan
        of the menu nor a uniform level.

    >>> import timm, torch
    >>> model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    >>> result = plan_for_budget(model, torch.randn(2, 3, 64, 64), "120MiB", batch_size=8)
    >>> print(result.explain())  # doctest: +ELLIPSIS
    plan fits: predicted peak ... at batch 8 (budget 120.00 MiB...); blocks: ...
    """
    started = time.perf_counter()
    menu = _check_menu(strategies)
    budget_bytes = parse_memory_budget(budget)
    work = Workload(model, example_input, loss_fn or default_loss, optimizer)
    target = batch_size or work.batch_size
    check_margin(margin)
    with model_restored(model, optimizer):
        menus = measure_menus(work, target, following_global(config), menu, budget_bytes)
        measured_in = time.perf_counter() - started
        goal = int(budget_bytes / (1 + margin))
        rounds = _Rounds(work, menus, target, budget_bytes, goal)
        best = rounds.solve(max_rounds)
        base = following_global(config)
        versus = _versus_uniform(work, menus, base, target, budget_bytes, goal, best)
    return _answer(menus, rounds, versus, best, base, target, budget_bytes, measured_in, started)


def _answer(
    menus: Menus,
    rounds: _Rounds,
    versus: _Versus,
    best: _Best | None,
    base: CheckpointConfig,
    target: int,
    budget_bytes: int,
    measured_in: float,
    started: float,
) -> BudgetPlan:
    """:func:`plan_for_budget`'s result: the faster of the per-block plan and the fastest
    fitting uniform level, or no config when neither fits."""
    common: dict[str, Any] = {
        "budget_bytes": budget_bytes,
        "batch_size": target,
        "candidates": menus.table,
        "stage_candidates": menus.stage_table,
        "base_time": menus.base_time,
        "base_bytes": menus.base,
        "rounds": rounds.count,
        "measure_seconds": measured_in,
        "uniform": versus.uniform,
    }
    per_block = None
    if best is not None:
        choice, chosen, measured = best
        per_block = BudgetPlan(
            config=menus.config_for(chosen),
            blocks=[n for n, s in chosen.items() if s != "keep"],
            predicted_peak=measured,
            strategies=chosen,
            stages=[span.name for span in choice.spans],
            predicted_time=menus.base_time + choice.time,
            step_time=versus.plan_time,
            check=rounds.checks.get(tuple(chosen.values())),
            seconds=time.perf_counter() - started,
            **common,
        )
    fastest = versus.fastest
    if fastest is not None:
        return BudgetPlan(
            config=base.model_copy(update={"training_checkpoint_level": Level(fastest)}),
            blocks=versus.checkpointed,
            predicted_peak=versus.uniform[fastest]["peak"],
            predicted_time=versus.uniform[fastest]["time"],
            step_time=versus.uniform[fastest]["time"],
            uniform_level=fastest,
            per_block=per_block,
            check=versus.check,
            seconds=time.perf_counter() - started,
            **common,
        )
    if per_block is None:
        return BudgetPlan(
            config=None,
            blocks=[],
            predicted_peak=min([rounds.smallest, *(u["peak"] for u in versus.uniform.values())]),
            seconds=time.perf_counter() - started,
            **common,
        )
    return per_block


_Best = tuple[Choice, dict[str, str], int]


class _Rounds:
    """The planner's answers measured one after another, each over-budget one correcting the
    model for the next (:func:`plan_for_budget`)."""

    def __init__(
        self, work: Workload, menus: Menus, target: int, budget_bytes: int, goal: int
    ) -> None:
        self.work, self.menus, self.target = work, menus, target
        self.budget_bytes, self.goal = budget_bytes, goal
        self.step_peak = peak_measurer(work)
        self.count = 0
        self.smallest = menus.peak0
        self.tried: set[tuple[str, ...]] = set()
        self.checks: dict[tuple[str, ...], FitCheck | None] = {}

    def measure(self, key: tuple[str, ...]) -> tuple[dict[str, str], int]:
        """Block -> strategy of ``key`` and its extrapolated peak (level 0's if none)."""
        menus = self.menus
        self.tried.add(key)
        chosen = {b.name: s for b, s in zip(menus.blocks, key, strict=True)}
        if all(s == "keep" for s in key):
            return chosen, menus.peak0
        with applied(self.work.model, menus.config_for(chosen)):
            measured = extrapolated_peak(self.step_peak, self.target, self.budget_bytes)[0]
            if measured <= self.goal:
                # on CUDA a real step at the target decides (NOTE [ Two meters ], _measure)
                check = confirm_fits(self.work, self.budget_bytes, self.target)
                self.checks[key] = check
                if check is not None and not check.fits:
                    measured = (
                        check.allocated_bytes
                        if check.allocated_bytes is not None
                        else max(measured, self.budget_bytes) + 1
                    )
        self.count += 1
        self.smallest = min(self.smallest, measured)
        return chosen, measured

    def solve(self, max_rounds: int) -> _Best | None:
        """The first measured answer that fits the goal, or ``None``."""
        menus, goal = self.menus, self.goal
        correction = 0
        while self.count < max_rounds:
            choice = choose(menus.blocks, menus.base + correction, goal, spans=menus.spans)
            if choice is None or tuple(o.strategy for o in choice.options) in self.tried:
                # The corrected model rules every plan out (the error of one plan is not every
                # plan's): measure the plan that holds the least, once, before giving up.
                choice = least_memory(menus.blocks, menus.base + correction, menus.spans)
                if tuple(o.strategy for o in choice.options) in self.tried:
                    break
            chosen, measured = self.measure(tuple(o.strategy for o in choice.options))
            if measured <= goal:
                return choice, chosen, measured
            # the model was short by `error` on this plan; ask the next one for at least that
            error = measured - (choice.peak - correction)
            correction = max(error, correction + measured - goal)
        least = least_memory(menus.blocks, menus.base, menus.spans)
        key = tuple(o.strategy for o in least.options)
        if key not in self.tried:  # the last resort, measured once
            chosen, measured = self.measure(key)
            if measured <= goal:
                return least, chosen, measured
        return None


@dataclass
class _Versus:
    """The per-block answer against the uniform levels (NOTE [ Never slower than a uniform
    level ])."""

    uniform: dict[int, dict[str, Any]]
    plan_time: float | None
    fastest: int | None
    """The uniform level to return instead of the per-block answer, or ``None``."""
    check: FitCheck | None = None
    checkpointed: list[str] = field(default_factory=list)


def _versus_uniform(
    work: Workload,
    menus: Menus,
    base: CheckpointConfig,
    target: int,
    budget_bytes: int,
    goal: int,
    best: _Best | None,
) -> _Versus:
    floor = menus.base_time
    uniform = _uniform_levels(work, target, base, goal, budget_bytes, floor, menus.peak0)
    plan_time = None
    if best is not None and all(v == "keep" for v in best[1].values()):
        plan_time = floor  # no checkpointing: the plain step, base_time itself
    elif best is not None:
        with applied(work.model, menus.config_for(best[1])):
            plan_time = max(floor, step_seconds(work, target))
    fastest = _fastest_uniform(uniform)
    if fastest is None or (plan_time is not None and uniform[fastest]["time"] >= plan_time):
        return _Versus(uniform, plan_time, None)
    with applied(work.model, base) as level_plan, training_level(fastest):
        check = confirm_fits(work, budget_bytes, target)
        checkpointed = list(level_plan.at_level(fastest).checkpointed)
    if check is not None and not check.fits:
        return _Versus(uniform, plan_time, None)  # the real step did not fit: the per-block plan
    return _Versus(uniform, plan_time, fastest, check, checkpointed)


def planner_frontier(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    batch_size: int | None = None,
    *,
    points: int = 12,
    config: CheckpointConfig | None = None,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strategies: Sequence[str] = PLANNER_MENU,
) -> list[dict[str, Any]]:
    """The planner's predicted time/peak trade at ``points`` budgets, from one measurement.

    The blocks' menus are measured once (as :func:`plan_for_budget` does) and the program is
    solved for budgets evenly spaced between the lowest peak the menu can reach and level 0's;
    nothing is verified by measurement, so the figures are predictions.

    Returns:
        One dict per distinct plan, by increasing peak: ``budget``, ``peak`` (predicted bytes),
        ``time`` (predicted seconds per step), ``base_time`` and ``strategies`` (counts).
    """
    menu = _check_menu(strategies)
    work = Workload(model, example_input, loss_fn or default_loss, optimizer)
    target = batch_size or work.batch_size
    with model_restored(model, optimizer):
        menus = measure_menus(work, target, following_global(config), menu, None)
    lowest = menus.base + min(_uniform_peak(menus.blocks, option) for option in STRATEGIES)
    found: dict[tuple[str, ...], dict[str, Any]] = {}
    for i in range(points):
        budget = int(lowest + (menus.peak0 - lowest) * i / max(1, points - 1))
        choice = choose(menus.blocks, menus.base, budget, spans=menus.spans)
        if choice is None:
            continue
        key = tuple(o.strategy for o in choice.options)
        counts: dict[str, int] = defaultdict(int)
        for s in key:
            counts[s] += 1
        found.setdefault(
            key,
            {
                "budget": budget,
                "peak": choice.peak,
                "time": menus.base_time + choice.time,
                "base_time": menus.base_time,
                "strategies": dict(counts),
            },
        )
    return sorted(found.values(), key=lambda p: p["peak"])


def least_memory(blocks: Sequence[Block], base: int, spans: Sequence[Span] = ()) -> Choice:
    """Per block the option that keeps the fewest bytes (ties: the smaller transient, then the
    faster), and each stage that keeps fewer than its blocks would, in the way that keeps the
    fewest (same ties). Kept + transient would not tell them apart: for full and selective
    alike it is the block's keep bytes, since what is not kept comes back during its
    backward."""

    def fewest(o: Option) -> tuple[int, int, float]:
        return o.kept, o.transient, o.time

    options = [min(b.options, key=fewest) for b in blocks]
    taken: list[Span] = []
    for span in sorted(spans, key=lambda s: (s.first, *fewest(s.option))):
        inside = range(span.first, span.last + 1)
        if any(t.first <= span.last and span.first <= t.last for t in taken):
            continue
        if span.option.kept < sum(options[i].kept for i in inside):
            options[span.first : span.last + 1] = span.members()
            taken.append(span)
    peak, seconds = predict(blocks, options, base)
    return Choice(tuple(options), peak, seconds, tuple(taken))


def _uniform_peak(blocks: Sequence[Block], strategy: str) -> int:
    """Predicted peak (without the base) when every block takes ``strategy`` where it can (its
    cheapest-in-memory option otherwise)."""
    options = []
    for block in blocks:
        same = [o for o in block.options if o.strategy == strategy]
        options.append(same[0] if same else min(block.options, key=lambda o: o.kept + o.transient))
    return predict(blocks, options, 0)[0]


def resolve_auto(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    config: CheckpointConfig | dict[str, Any],
    batch_size: int | None = None,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> CheckpointConfig:
    """The config to apply for ``training_checkpoint_level: auto``: the per-block plan of
    :func:`plan_for_budget` for the config's ``memory_budget``.

    Raises:
        ConfigError: the config is not ``auto`` with a budget, or no plan fits the budget.

    >>> import timm, torch, vision_ckpt
    >>> model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    >>> cfg = {"training_checkpoint_level": "auto", "memory_budget": "1GiB", "preset": "auto"}
    >>> planned = resolve_auto(model, torch.randn(2, 3, 64, 64), cfg, batch_size=8)
    >>> _ = vision_ckpt.apply(model, planned)
    """
    if isinstance(config, dict):
        config = CheckpointConfig.model_validate(config)
    if config.training_checkpoint_level != "auto" or config.memory_budget is None:
        raise ConfigError(
            f"resolve_auto needs training_checkpoint_level 'auto' and a memory_budget; got "
            f"training_checkpoint_level {config.training_checkpoint_level!r}, memory_budget "
            f"{config.memory_budget!r}. Apply a config with a level directly instead."
        )
    result = plan_for_budget(
        model,
        example_input,
        config.memory_budget,
        batch_size,
        config=config,
        loss_fn=loss_fn,
        optimizer=optimizer,
    )
    if result.config is None:
        raise ConfigError(
            f"memory_budget {config.memory_budget!r}: {result.explain()}. Lower the batch size "
            "or raise the budget."
        )
    return result.config.model_copy(update={"memory_budget": None})
