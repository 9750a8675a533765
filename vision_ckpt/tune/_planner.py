"""The per-block planner: a strategy for every block so a step fits a budget in the least time
(:func:`plan_for_budget`).

Uniform levels are coarse: a budget between two levels forces the costlier one on every block.
The planner prices, for every candidate block, each way of running it (keep its activations,
selective, full checkpoint, full with its inner regions checkpointed again) by the bytes it
keeps and the *measured* time of the work it adds (``_menus``: NOTE [ Pricing the strategies
of a block ]), then picks one per block with the dynamic program of
``vision_ckpt.tune._optimise`` (NOTE [ One strategy per block ]) and checks the answer by
measuring it. This module owns that search: the rounds that correct the model, the comparison
with the uniform levels, the frontier and the least memory of a menu; the answer's record is
``_budget_plan``'s.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.levels import Level
from ..config.schema import CheckpointConfig, parse_memory_budget
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
    meter_for,
    model_restored,
    run_step,
    step_time as measure_step_time,
)
from ..measure._record import Measurement
from ..runtime.wrapper import training_level
from ._budget_plan import PLANNER_MENU, STRATEGIES, BudgetPlan, fastest_fitting_level
from ._menus import Menus, measure_menus, proportional
from ._optimise import Block, Choice, Option, StageOption, choose, predict
from ._search import check_margin

__all__ = [
    "plan_for_budget",
    "planner_frontier",
    "resolve_auto",
    "level_signature",
    "least_memory",
    "step_seconds",
]


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
# block ] in _menus); a uniform level is a different set of regions (a preset's lean MLPs, nested
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
    return proportional(points, target)


def _uniform_levels(
    work: Workload,
    target: int,
    base: CheckpointConfig,
    goal: int,
    limit: int,
    floor: float,
    peak0: int,
) -> dict[int, Measurement]:
    """Per uniform level, its step at ``target``: the predicted peak and, if that fits
    ``goal``, the step time (a level that does not fit is not timed). ``floor`` and ``peak0``
    are the plain step's time and peak, already measured for the menus: a level that
    checkpoints nothing takes them instead of measuring that step again."""
    meter = meter_for(work.device).name
    out: dict[int, Measurement] = {}
    seen: dict[tuple[Any, ...], int] = {}
    with applied(work.model, base) as plan:
        for level in range(5, -1, -1):  # cheapest in memory first
            signature = level_signature(plan, level)
            if signature in seen:
                out[level] = out[seen[signature]]
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
            out[level] = Measurement(
                peak=peak, batch=target, meter=meter, seconds=seconds, predicted=True
            )
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
    work it adds, on the model's own device (NOTE [ Pricing the strategies of a block ] in
    ``_menus``); picks
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
    meter = versus.meter
    per_block = None
    if best is not None:
        choice, chosen, measured = best
        per_block = BudgetPlan(
            config=menus.config_for(chosen),
            blocks=[n for n, s in chosen.items() if s != "keep"],
            measurement=Measurement(
                peak=measured, batch=target, meter=meter, seconds=versus.plan_time, predicted=True
            ),
            strategies=chosen,
            stages=[span.name for span in choice.spans],
            predicted_time=menus.base_time + choice.time,
            check=rounds.checks.get(tuple(chosen.values())),
            seconds=time.perf_counter() - started,
            **common,
        )
    fastest = versus.fastest
    if fastest is not None:
        return BudgetPlan(
            config=base.model_copy(update={"training_checkpoint_level": Level(fastest)}),
            blocks=versus.checkpointed,
            measurement=versus.uniform[fastest],
            predicted_time=versus.uniform[fastest].seconds,
            uniform_level=fastest,
            per_block=per_block,
            check=versus.check,
            seconds=time.perf_counter() - started,
            **common,
        )
    if per_block is None:
        smallest = min([rounds.smallest, *(u.peak for u in versus.uniform.values())])
        return BudgetPlan(
            config=None,
            blocks=[],
            measurement=Measurement(peak=smallest, batch=target, meter=meter, predicted=True),
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
                        check.measurement.peak
                        if check.measurement is not None
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

    uniform: dict[int, Measurement]
    plan_time: float | None
    fastest: int | None
    """The uniform level to return instead of the per-block answer, or ``None``."""
    meter: str
    """The meter the peaks are measured by."""
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
    fastest = fastest_fitting_level(uniform)
    meter = meter_for(work.device).name
    seconds = uniform[fastest].seconds if fastest is not None else None  # a fitting level's
    if seconds is None or (plan_time is not None and seconds >= plan_time):
        return _Versus(uniform, plan_time, None, meter)
    with applied(work.model, base) as level_plan, training_level(fastest):
        check = confirm_fits(work, budget_bytes, target)
        checkpointed = list(level_plan.at_level(fastest).checkpointed)
    if check is not None and not check.fits:
        return _Versus(uniform, plan_time, None, meter)  # the real step did not fit: per block
    return _Versus(uniform, plan_time, fastest, meter, check, checkpointed)


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


def least_memory(blocks: Sequence[Block], base: int, spans: Sequence[StageOption] = ()) -> Choice:
    """Per block the option that keeps the fewest bytes (ties: the smaller transient, then the
    faster), and each stage that keeps fewer than its blocks would, in the way that keeps the
    fewest (same ties). Kept + transient would not tell them apart: for full and selective
    alike it is the block's keep bytes, since what is not kept comes back during its
    backward."""

    def fewest(o: Option) -> tuple[int, int, float]:
        return o.kept, o.transient, o.time

    options = [min(b.options, key=fewest) for b in blocks]
    taken: list[StageOption] = []
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
