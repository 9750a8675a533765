"""Tuning: choosing levels and plans from measurements.

Owns the profile of every level and the lowest level that fits (``profiling``, ``_search``), the
per-block planner for a budget (``_planner``, with its candidate blocks in ``_blocks``, their
priced menus in ``_menus``, its answer in ``_budget_plan`` and its program in ``_optimise``),
the largest batch that fits (``fit``), and levels derived by measurement for any model
(``derive``, with the candidate spans of a traced forward in ``_spans``, the regions made of
them in ``_candidates``, the levels chosen in ``_level_search`` and measured in
``_level_measure``, written as rules in ``_derived_rules``, the answer in ``_derived``). It
imports every layer below; only the integrations and the command line sit above it. Its public
names are the tuning tools:

>>> import timm, torch, vision_ckpt.tune as tune
>>> model = timm.create_model("resnet18", pretrained=False, num_classes=4)
>>> result = tune.profile(model, torch.randn(2, 3, 32, 32), levels=[0, 2], steps=1)
>>> [row.level for row in result.levels]
[0, 2]
"""

from .derive import (
    DerivedLevel as DerivedLevel,
    DerivedPreset as DerivedPreset,
    derive_preset as derive_preset,
)
from .fit import FitResult as FitResult, FitRow as FitRow, max_batch as max_batch
from .profiling import (
    BudgetPlan as BudgetPlan,
    LevelProfile as LevelProfile,
    ProfileResult as ProfileResult,
    Suggestion as Suggestion,
    plan_for_budget as plan_for_budget,
    profile as profile,
    resolve_auto as resolve_auto,
    suggest_level as suggest_level,
)

__all__ = [
    "profile",
    "suggest_level",
    "plan_for_budget",
    "resolve_auto",
    "ProfileResult",
    "LevelProfile",
    "Suggestion",
    "BudgetPlan",
    "max_batch",
    "FitResult",
    "FitRow",
    "derive_preset",
    "DerivedPreset",
    "DerivedLevel",
]
