"""The per-block planner's answer: :class:`BudgetPlan`, and the strategies it names.

Owns the vocabulary of a block's menu (:data:`STRATEGIES`, :data:`PLANNER_MENU`) and the record
:func:`~vision_ckpt.tune.plan_for_budget` returns: the config that runs the chosen strategies,
what was measured on the way, and the uniform levels it was compared with (NOTE [ Never slower
than a uniform level ] in ``_planner``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..config.schema import CheckpointConfig
from ..measure._measure import FitCheck
from ..measure._memory import format_bytes
from ..measure._record import Measurement

__all__ = ["STRATEGIES", "PLANNER_MENU", "BudgetPlan", "fastest_fitting_level"]

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


@dataclass
class BudgetPlan:
    """The answer of :func:`plan_for_budget`: a strategy per block, as an editable config."""

    config: CheckpointConfig | None
    """A config whose rules run exactly the chosen strategies (``None`` if nothing fits)."""
    blocks: list[str]
    """Qualified names of the blocks that are checkpointed (any strategy but ``keep``)."""
    budget_bytes: int
    batch_size: int
    measurement: Measurement
    """The returned config's step at ``batch_size``, predicted: its peak extrapolated from
    small-batch measurements, by the device's meter, and its step time measured at the small
    batches and extrapolated the way each uniform level's is (the figure the two are compared
    on, NOTE [ Never slower than a uniform level ] in ``_planner``). When nothing fits: the
    smallest peak predicted for any plan or level, untimed."""
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
    """The program's seconds per step at ``batch_size``: the plain step's time (extrapolated
    from the small batches) plus the chosen strategies' extra work as the menus price it
    (for a uniform level returned instead, its step time)."""
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
    uniform: dict[int, Measurement] = field(default_factory=dict)
    """Per uniform training level, its step at ``batch_size``, predicted: the peak and, for a
    level that fits the budget with the margin, the step time measured at the small batches and
    extrapolated, the way ``measurement``'s is; a level that does not fit is not timed
    (``seconds`` is ``None``)."""
    uniform_level: int | None = None
    """The uniform level returned instead of a per-block plan (it fits and no per-block plan was
    faster); ``None`` when ``config`` is a per-block plan (or nothing fits)."""
    per_block: BudgetPlan | None = None
    """When ``uniform_level`` is returned: the per-block plan it beat (``None`` if none fit)."""
    check: FitCheck | None = None
    """The real step at ``batch_size`` that confirmed the answer where the device needs one
    (CUDA); ``None`` on CPU, where the prediction extrapolates the deterministic byte count."""

    def fastest_uniform(self) -> int | None:
        """The fitting uniform level with the shortest step time, or ``None``."""
        return fastest_fitting_level(self.uniform)

    def explain(self) -> str:
        """One line: what was chosen and what it is predicted to cost."""
        if self.uniform_level is not None:
            return (
                f"level {self.uniform_level} (uniform) fits and no per-block plan was faster: "
                f"predicted peak {format_bytes(self.measurement.peak)} at batch {self.batch_size} "
                f"(budget {format_bytes(self.budget_bytes)})"
            )
        if self.config is None:
            return (
                f"no plan fits {format_bytes(self.budget_bytes)} at batch {self.batch_size}: "
                f"the smallest predicted peak is {format_bytes(self.measurement.peak)}"
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
            f"plan fits: predicted peak {format_bytes(self.measurement.peak)} at batch "
            f"{self.batch_size} (budget {format_bytes(self.budget_bytes)}{slower}); blocks: {mix}"
        )


def fastest_fitting_level(uniform: dict[int, Measurement]) -> int | None:
    """The fitting level of ``uniform`` (as ``_planner``'s ``_uniform_levels`` gives it: a
    level is timed when it fits) with the shortest step time, the lower level on a tie;
    ``None`` when none fits.

    >>> step = lambda s: Measurement(peak=10, batch=8, meter="bytes", seconds=s, predicted=True)
    >>> fastest_fitting_level({0: step(None), 3: step(1.5), 5: step(1.5)})
    3
    """
    timed = {lv: u.seconds for lv, u in uniform.items() if u.seconds is not None}
    return min(timed, key=lambda lv: (timed[lv], lv), default=None)
