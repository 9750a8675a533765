"""Measure what each training level costs, and pick a level (or a set of blocks) for a budget.

Everything here runs real training steps (forward, loss, backward, optionally an optimizer step)
of the user's model on the user's input and counts memory in bytes of live tensor storage (see
``vision_ckpt.measure._memory``), so the figures on CPU are the same on every run. On CUDA the
budget questions are decided on the CUDA allocator's ``max_memory_allocated`` of real warmed-up
steps, ``max_memory_reserved`` is reported beside it, and a plan predicted to fit is confirmed by a
real step at the target batch (NOTE [ Two meters ] in ``vision_ckpt.measure._measure``).

NOTE [ Measuring without the memory of the largest level ]

A budget question ("will batch 64 fit in 8 GiB?") must not be answered by running batch 64
at level 0 on a machine where it does not fit. Memory of a training step is, to a very good
approximation, affine in the batch size: parameters, gradients and optimizer state are fixed,
activations grow linearly. So :func:`suggest_level` and :func:`plan_for_budget` measure two small
batches per level and extrapolate; only a configuration predicted to fit is ever run at the
target batch. :func:`profile` runs the levels from the cheapest in memory (the highest level) to
the most expensive, and with ``memory_limit`` stops before a level whose extrapolated peak would
exceed it, reporting that instead of running it.

This module is the public face; the work is split by job into private modules:
``vision_ckpt.measure._measure`` (one training step: memory, FLOPs and time, and the
``Workload`` that carries the model, input, loss and optimizer),
``vision_ckpt.measure._extrapolate`` (a larger batch's peak from smaller ones),
``vision_ckpt.tune._search`` (uniform levels: :func:`profile`, :func:`suggest_level`) and
``vision_ckpt.tune._planner`` (per block: :func:`plan_for_budget`, on the menus of
``vision_ckpt.tune._menus``; its answer in ``vision_ckpt.tune._budget_plan``).
"""

from __future__ import annotations

from ..measure._measure import FitCheck as FitCheck, LossFn as LossFn, default_loss as default_loss
from ._budget_plan import STRATEGIES as STRATEGIES, BudgetPlan as BudgetPlan
from ._planner import (
    plan_for_budget as plan_for_budget,
    planner_frontier as planner_frontier,
    resolve_auto as resolve_auto,
)
from ._search import (
    LevelProfile as LevelProfile,
    ProfileResult as ProfileResult,
    Suggestion as Suggestion,
    profile as profile,
    suggest_level as suggest_level,
)

__all__ = [
    "LevelProfile",
    "ProfileResult",
    "Suggestion",
    "BudgetPlan",
    "FitCheck",
    "profile",
    "suggest_level",
    "plan_for_budget",
    "planner_frontier",
    "resolve_auto",
    "STRATEGIES",
]
