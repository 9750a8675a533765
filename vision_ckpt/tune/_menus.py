"""The per-block planner's menus: every candidate block's strategies priced at the target batch.

Owns the measurement behind the planner and the derivation (NOTE [ Pricing the strategies of a
block ]): forward hooks that tell which candidate block runs, the bytes each strategy keeps and
the seconds of the work it adds (timed, or modelled: NOTE [ A modelled price ] in ``_price``),
per block and per stage, at the two small batches and extrapolated to the target batch, and the
result as :class:`Menus` for the program of ``_optimise``. Which blocks and which configs is
``_blocks``'s; choosing among the options is ``_planner``'s and the derivation's.
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
from ..config.matching import exact_name_pattern
from ..config.schema import CheckpointConfig, LevelRule
from ..errors import ConfigError
from ..measure._extrapolate import Lines, extrapolated_peak, peak_measurer, small_batches
from ..measure._measure import Workload, applied, on_fakes, step_time as measure_step_time
from ..measure._memory import count_saved_bytes
from ..measure._price import cheap_product_flops, modelled_step_seconds, op_seconds
from ..regions.apply import plan as _plan, run_members
from ..runtime._selective import HEAVY_OPS, SaveOps
from ..runtime.wrapper import training_level
from ._blocks import (
    STRATEGY_LEVEL,
    block_run,
    candidate_blocks,
    inner_rules,
    only_rules,
    run_ends,
    stage_groups,
    strategy_config,
    with_stage_blocks,
)
from ._optimise import Block, Option, StageOption

__all__ = ["Menus", "measure_menus", "proportional"]


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
# recomputed whole ] in _level_search).
#
# Base. Level 0's step peak (extrapolated like every peak) minus the keep bytes of all blocks.
# The step time with no checkpointing is measured at the small batches and extrapolated; the
# predicted time of a plan is that plus its extra work.


class _BlockTracker:
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
        tracker: _BlockTracker,
        keeps: SaveOps,
        device: torch.device,
        modelled: bool = False,
        below: int | None = None,
    ) -> None:
        super().__init__()
        self.tracker = tracker
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
        block = self.tracker.innermost()
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
        if self.tracker.inner:
            self.inner[block] += spent
        return out


@contextlib.contextmanager
def _tracking_blocks(
    model: torch.nn.Module, blocks: Sequence[str], inner: Sequence[str], runs: dict[str, list[str]]
) -> Iterator[Any]:
    tracker = _BlockTracker(model, blocks, inner, runs)
    try:
        yield tracker
    finally:
        tracker.remove()


def _saved_by_block(
    work: Workload, x: torch.Tensor, blocks: Sequence[str], runs: dict[str, list[str]]
) -> dict[str, int]:
    """The bytes each block's forward keeps for backward (counted on fakes where quicker)."""

    def saved_by_block(on: Workload, batch: torch.Tensor) -> dict[str, int]:
        with _tracking_blocks(on.model, blocks, (), runs) as tracker:
            with count_saved_bytes(on.model, region=tracker.innermost) as saved:
                out = on.model(batch)
            del out
        return {name: saved.by_region.get(name, 0) for name in blocks}

    return on_fakes(saved_by_block, work, x)[0]


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

    def timed(on: Workload, batch: torch.Tensor) -> _OpTimes:
        with _tracking_blocks(on.model, blocks, inner, runs) as tracker:
            with _OpTimes(tracker, keeps, work.device, modelled, below) as times:
                out = on.model(batch)
            del out
        return times

    # modelled prices read shapes only: on fakes where quicker; timed ones run the kernels
    return on_fakes(timed, work, x)[0] if modelled else timed(work, x)


def _line(points: Sequence[tuple[int, float]], target: int) -> float:
    """Bytes at ``target`` along the line through two (batch, bytes) points."""
    return Lines.through_peaks(points[0], points[1]).at(target)


def proportional(points: Sequence[tuple[int, float]], target: int) -> float:
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
    spans: list[StageOption] = field(default_factory=list)
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
        return strategy_config(
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
    full_plan = with_stage_blocks(model, base_config, _plan(model, base_config))
    candidates = candidate_blocks(full_plan)
    if not candidates:
        raise ConfigError(
            "plan_for_budget found no checkpointable block in the model; give it a config "
            "with rules (or a preset) that select its blocks"
        )
    names = [e.name for e in candidates]
    runs = {
        e.name: run_members(model, e.name, end, "the planner")[1:]
        for e in candidates
        if (end := block_run(e)) is not None
    }
    entries = list(full_plan.entries)
    ends = run_ends(entries)
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
    groups = stage_groups(full_plan, names, outer) if "stage" in menu else []
    stage_of = {names[first]: g for g, first, _ in groups}

    def every_stage(way: str) -> CheckpointConfig:  # every stage one region run ``way``
        strategies = dict.fromkeys(stage_of, way)
        return strategy_config(base_config, entries, strategies, inner_of, stage_of, below)

    return _Setup(
        names=names,
        runs=runs,
        entries=entries,
        inner_of=inner_of,
        inner_all=inner_all,
        uniform={
            s: strategy_config(base_config, entries, dict.fromkeys(names, s), inner_of, None, below)
            for s in ("selective", "selective_below", "full")
        },
        inner_only=only_rules(base_config, inner_rules(ends, inner_all)),
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
            whole = [
                LevelRule(match=exact_name_pattern(g), level=STRATEGY_LEVEL["full"]) for g in stages
            ]
            with applied(model, only_rules(setup.uniform["full"], whole)):
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
        return max(0.0, proportional(points, target))

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
            if "inner" in menu:  # NOTE [ Inner regions alone ] in _level_search
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
) -> tuple[list[StageOption], list[dict[str, Any]]]:
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
            seconds = max(0.0, proportional(spent[strategy][g], target))
            return Option(strategy, max(0, k - own), max(0, held - k), seconds)

        option = way("stage")
        spans.append(StageOption(g, first, last, option))
        if kept["stage_below"].get(g) and spent["stage_below"][g] not in (
            spent["stage"][g],
            spent["held"][g],
        ):  # NOTE [ Products cheap to redo ] in _price
            spans.append(StageOption(g, first, last, way("stage_below")))
        if kept["held"].get(g):  # NOTE [ A stage recomputed whole ] in _level_search
            k = int(max(0.0, _line(kept["held"][g], target)))
            seconds = max(0.0, proportional(spent["held"][g], target))
            whole = Option("held", max(0, k - own), max(0, held - k), seconds)
            spans.append(StageOption(g, first, last, whole))
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
                spans.append(StageOption(g, first, last, again))
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
        base_time=max(0.0, proportional(step_time, target)),
        spans=spans,
        stage_table=stage_table,
        stage_of={names[i]: g for g, first, last in setup.groups for i in range(first, last + 1)},
        through={e.name: end for e in setup.candidates if (end := block_run(e)) is not None},
        below=setup.below,
    )
