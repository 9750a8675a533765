"""The per-block planner: which blocks to checkpoint so a step fits a budget with the least
recompute (:func:`plan_for_budget`).

Uniform levels are coarse; the planner picks individual blocks instead. It ranks the candidate
blocks by the bytes each keeps for backward per FLOP of its forward (the price of recomputing
it), guesses a set from those figures, and corrects the guess by measuring it: see NOTE
[ Choosing blocks for a budget ] below, and NOTE [ Measuring without the memory of the largest
level ] in ``vision_ckpt.profile``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ._extrapolate import extrapolated_peak, peak_measurer, small_batches
from ._measure import LossFn, Workload, applied, default_loss, following_global, model_restored
from ._memory import count_saved_bytes
from ._search import check_margin
from .apply import plan as _plan
from .config import CheckpointConfig, LevelRule, parse_memory_budget
from .errors import ConfigError
from .levels import Level
from .matching import exact_name_pattern
from .wrapper import training_level

__all__ = ["BudgetPlan", "plan_for_budget"]


@dataclass
class BudgetPlan:
    """The answer of :func:`plan_for_budget`: which blocks to checkpoint, as an editable config."""

    config: CheckpointConfig | None
    """A config whose rules checkpoint exactly the chosen blocks; ``None`` if nothing fits."""
    blocks: list[str]
    """Qualified names of the blocks chosen, in the order they were chosen."""
    budget_bytes: int
    batch_size: int
    predicted_peak: int
    """Peak at ``batch_size`` extrapolated from small-batch measurements of the final plan."""
    candidates: list[dict[str, Any]]
    """Every candidate block with its kept bytes (at ``batch_size``) and recompute FLOPs."""


def _candidate_blocks(plan: Any) -> list[Any]:
    """Non-overlapping blocks to choose from: the plan's entries at the finest level that covers
    repeated blocks (level 3 if present, else 2, else 4)."""
    by_level: dict[int, list[Any]] = {}
    for entry in plan.entries:
        by_level.setdefault(int(entry.level), []).append(entry)
    for level in (3, 2, 4, 1, 5):
        entries = by_level.get(level, [])
        names = [e.name for e in entries]
        independent = [
            e for e in entries if not any(o != e.name and e.name.startswith(o + ".") for o in names)
        ]
        if independent:
            return independent
    return []


def _block_costs(work: Workload, x: torch.Tensor, names: list[str]) -> dict[str, tuple[int, int]]:
    """Per block: (activation bytes saved for backward inside it, forward FLOPs), from one plain
    forward on ``x``. Bytes go to the innermost block running when autograd saves them, each
    storage once; weights are not counted (checkpointing does not free them)."""
    model = work.model
    modules = dict(model.named_modules())
    active: list[str] = []
    handles = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            active.append(name)

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            active.pop()

        return hook

    for name in names:
        handles.append(modules[name].register_forward_pre_hook(pre(name)))
        handles.append(modules[name].register_forward_hook(post(name)))

    def innermost() -> str | None:
        return active[-1] if active else None

    try:
        with count_saved_bytes(model, region=innermost) as saved:
            with FlopCounterMode(display=False) as counter:
                out = model(x)
        del out
    finally:
        for h in handles:
            h.remove()
    flop_table = counter.get_flop_counts()
    root = next(iter(flop_table), None)
    costs = {}
    for name in names:
        key = f"{type(model).__name__}.{name}" if root is not None else name
        per_op = flop_table.get(key, {})
        costs[name] = (saved.by_region.get(name, 0), int(sum(per_op.values())))
    return costs


# NOTE [ Choosing blocks for a budget ]
#
# 1. Candidates: the blocks of the plan at the finest level that covers repeated blocks (3, else
#    2, 4, 1, 5), with nested ones dropped so that no two candidates overlap
#    (_candidate_blocks).
# 2. Costs, from one plain forward at each of the two small batches (_block_costs): the bytes
#    autograd saves inside each block (what checkpointing it frees, weights excluded), projected
#    to the target batch along the line through the two batches, and its forward FLOPs (what
#    recomputing it costs).
# 3. Order: most bytes freed per recomputed FLOP first.
# 4. First guess (none when level 0's predicted peak already fits the goal, budget / (1 +
#    margin)): take blocks in that order until level 0's peak, minus the bytes they free,
#    plus the largest of them (one block is recomputed at a time, so its activations come back
#    during backward), is under the goal.
# 5. Correction: measure the guess (extrapolated from small batches, like everything here); while
#    it is over the goal, add blocks in order until their freed bytes cover the excess, and
#    measure again, at most max_rounds times. The answer is the last measured set, if it fits.
#
# The chosen blocks keep their plan level (at least 1) and every other planned module gets 0, so
# a training level equal to the highest chosen level checkpoints exactly them (_config_for).


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
    max_rounds: int = 8,
) -> BudgetPlan:
    """Choose which blocks to checkpoint so the step fits ``budget`` with the least recompute.

    Uniform levels are coarse: a budget between two levels forces the costlier one. This
    measures, in one small-batch forward, the bytes each candidate block keeps for backward and
    its forward FLOPs (the price of recomputing it), then checkpoints the blocks that free the
    most memory per recomputed FLOP first (typically the high-resolution early stages of a CNN)
    until the extrapolated peak fits, checking each guess by measurement at two small batches.

    Returns:
        A :class:`BudgetPlan` whose ``config`` gives the chosen blocks their level and every other
        candidate level 0, with ``training_checkpoint_level`` set so exactly the chosen blocks
        are checkpointed; ``config`` is ``None`` when even checkpointing every candidate does not
        fit (``predicted_peak`` is then the smallest peak reached).
    """
    budget_bytes = parse_memory_budget(budget)
    work = Workload(model, example_input, loss_fn or default_loss, optimizer)
    target = batch_size or work.batch_size
    base = following_global(config)
    check_margin(margin)
    small = small_batches(target)
    with model_restored(model, optimizer):
        full_plan = _plan(model, base)
        candidates = _candidate_blocks(full_plan)
        if not candidates:
            raise ConfigError(
                "plan_for_budget found no checkpointable block in the model; give it a config "
                "with rules (or a preset) that select its blocks"
            )
        names = [e.name for e in candidates]
        all_entries = list(full_plan.entries)
        levels = {e.name: int(e.level) for e in full_plan.entries}
        with applied(model, CheckpointConfig()):  # block costs of the plain model
            per_batch = [_block_costs(work, work.batch(b), names) for b in small]
        scale = (target - small[0]) / (small[1] - small[0])
        kept = {
            n: int(per_batch[0][n][0] + (per_batch[1][n][0] - per_batch[0][n][0]) * scale)
            for n in names
        }
        flops = {n: per_batch[1][n][1] for n in names}
        order = sorted(names, key=lambda n: kept[n] / max(flops[n], 1), reverse=True)

        step_peak = peak_measurer(work)

        def measure(chosen: list[str]) -> int:
            cfg = _config_for(base, chosen, all_entries, levels)
            with applied(model, cfg):
                with training_level(_training_level_for(chosen, levels)):
                    return extrapolated_peak(step_peak, target, budget_bytes)[0]

        with training_level(0):
            with applied(model, base):
                peak0 = extrapolated_peak(step_peak, target, budget_bytes)[0]
        goal = budget_bytes / (1 + margin)
        chosen: list[str] = []
        predicted = peak0
        if peak0 > goal:
            # First guess from the per-block figures, then correct by measurement.
            estimate = peak0
            for name in order:
                if estimate <= goal:
                    break
                chosen.append(name)
                estimate = peak0 - sum(kept[n] for n in chosen) + max(kept[n] for n in chosen)
            predicted = measure(chosen)
            rounds = 0
            while predicted > goal and len(chosen) < len(order) and rounds < max_rounds:
                rounds += 1
                missing = predicted - goal
                while missing > 0 and len(chosen) < len(order):
                    nxt = order[len(chosen)]
                    chosen.append(nxt)
                    missing -= kept[nxt]
                predicted = measure(chosen)
        fits = predicted <= goal
        return BudgetPlan(
            config=_config_for(base, chosen, all_entries, levels, fixed_level=True)
            if fits
            else None,
            blocks=list(chosen),
            budget_bytes=budget_bytes,
            batch_size=target,
            predicted_peak=predicted,
            candidates=[
                {"name": n, "level": levels[n], "kept_bytes": kept[n], "forward_flops": flops[n]}
                for n in order
            ],
        )


def _training_level_for(chosen: list[str], levels: dict[str, int]) -> int:
    return max((max(levels[n], 1) for n in chosen), default=0)


def _config_for(
    base: CheckpointConfig,
    chosen: list[str],
    entries: list[Any],
    levels: dict[str, int],
    fixed_level: bool = False,
) -> CheckpointConfig:
    """Rules that keep the chosen blocks' levels and give every other planned module level 0."""
    chosen_set = set(chosen)
    top = _training_level_for(chosen, levels)
    rules = []
    for entry in entries:
        level = Level(max(levels[entry.name], 1) if entry.name in chosen_set else 0)
        rules.append(LevelRule(match=exact_name_pattern(entry.name), level=level))
    return base.model_copy(
        update={
            "rules": tuple(base.rules) + tuple(rules),
            "training_checkpoint_level": Level(top) if fixed_level else None,
            "nesting": "all",
        }
    )
