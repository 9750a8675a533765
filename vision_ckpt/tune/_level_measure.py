"""The derived levels measured on the model, and what the program cannot price tried on top.

Owns the step peaks of the derivation's plans (``measured_peak``, from the two small batches),
the levels chosen and corrected by them (``measured_levels``), the anchors of levels 2 and 3,
the top the levels are spaced towards, and the additions tried from the top level down (lean
MLPs, stacks as groups, runs of units as one, whole stages, the fallback's regions), each kept
where it lowers the measured peak enough; then a level that lowers the peak too little is marked
as running the level below's plan (NOTE [ Five levels from one menu ] in ``_level_search``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ..config.matching import exact_name_pattern
from ..config.schema import CheckpointConfig, LevelRule
from ..errors import ConfigError, internal_assert
from ..measure._extrapolate import MEASURED_UP_TO, extrapolated_peak, peak_measurer
from ..measure._measure import Workload, applied, meter_for
from ..measure._record import Measurement
from ..runtime.wrapper import training_level
from ._candidates import STAGE_LEVEL, CandidateRegions, is_inside, span_rule
from ._derived import DerivedLevel
from ._derived_rules import (
    RECOMPUTED,
    emit_rules,
    fallback_at,
    group_stacks,
    lean_outside_runs,
    lost_rules,
    merged_runs,
)
from ._level_search import (
    EXTRA_GAIN,
    STEP,
    choice_key,
    level_plans,
    plan_of,
    top_choice,
    unnested,
)
from ._menus import Menus
from ._optimise import Choice, Option
from ._spans import Span

__all__ = ["measured_peak", "measured_levels", "plain_steps"]


def plain_steps(work: Workload, menus: Menus, target: int) -> tuple[Measurement, Measurement]:
    """Level 0 at ``target``: its step peak as measured for the menus (extrapolated from the
    small batches, by the device's meter), and the same in the program's terms, with the
    modelled seconds of a step that checkpoints nothing."""
    meter = meter_for(work.device).name
    measured = Measurement(
        peak=menus.peak0, batch=target, meter=meter, predicted=target > MEASURED_UP_TO
    )
    modelled = Measurement(
        peak=menus.peak0, batch=target, meter="modelled", seconds=menus.base_time, predicted=True
    )
    return measured, modelled


def measured_peak(work: Workload, config: CheckpointConfig, level: int, target: int) -> int:
    """The step peak at ``target`` of ``config`` at ``level``, from the two small batches only
    (a derivation measures a dozen plans: the halfway batch would double its time)."""
    with applied(work.model, config), training_level(level):
        return extrapolated_peak(peak_measurer(work), target, None, halfway=False)[0]


@dataclass
class _Additions:
    """What the program cannot price, tried on top of the levels: each the lowest level it is
    kept from, or ``None`` (NOTE [ Five levels from one menu ] in ``_level_search``)."""

    stacks: list[Span]
    """The stacks that may run as groups: those whose blocks the top level recomputes whole."""
    merged: list[Span] = field(default_factory=list)
    """The runs of units the top level recomputes whole, each as one run (NOTE [ Runs of
    units ] in ``_derived_rules``): the candidates, each tried on its own."""
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
        self,
        model: nn.Module,
        regions: CandidateRegions,
        menus: Menus,
        per_level: Sequence[dict[str, str]],
    ) -> list[LevelRule]:
        extra = fallback_at(model, self.fallback) if self.fallback is not None else []
        if extra:  # a later member of a derived run is recomputed with its run, not alone
            runs = [*regions.named().values(), *(r for r, _ in self.kept_runs())]
            inside = {
                exact_name_pattern(m)
                for span in runs
                if span.kind == "run"
                for m in span.members[1:]
            }
            extra = [r for r in extra if r.match not in inside]
        return emit_rules(
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
    regions: CandidateRegions,
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
        group_stacks(regions, per_level[-1]), merged_runs(regions, per_level[-1]), lean=lean
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
        return k >= STAGE_LEVEL and all(
            per_level[k - 1].get(m) in RECOMPUTED for g in found.stacks for m in g.members
        )

    def runs_at(run: Span) -> Callable[[int], bool]:  # a large module: level 4 and up
        return lambda k: k >= STAGE_LEVEL and run in merged_runs(regions, per_level[k - 1])

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
            work, levels, target, config_with(lambda k: {"whole": k}), only_top, STEP
        )
    if fallback_at(work.model, len(levels)):  # _from_top drops it where it does not combine
        found.fallback = _from_top(
            work, levels, target, config_with(lambda k: {"fallback": k}), only_top, STEP
        )
    return found


def _account(
    levels: list[DerivedLevel], found: _Additions, regions: CandidateRegions, menus: Menus
) -> None:
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
            _add_seconds(lv, _forward_seconds(menus, grouped))
        if found.whole is not None and lv.level >= found.whole:
            lv.whole = tuple(s.name for s in regions.stages)
            inside = [n for n in every if any(is_inside(n, s) for s in lv.whole)]
            _add_seconds(lv, _forward_seconds(menus, inside))
        if found.fallback is not None and lv.level >= found.fallback:
            lv.fallback = True
            _add_seconds(lv, _forward_seconds(menus, every))
    for lv in levels:  # a marked level shows the figures of the level whose plan it runs
        if lv.same_as:
            lv.modelled = replace(lv.modelled, seconds=levels[lv.same_as - 1].modelled.seconds)


def _add_seconds(level: DerivedLevel, seconds: float) -> None:
    """Add the seconds of forwards the program did not price to a level's modelled time."""
    level.modelled = replace(level.modelled, seconds=(level.modelled.seconds or 0.0) + seconds)


def measured_levels(
    work: Workload, regions: CandidateRegions, menus: Menus, alone: dict[str, Option], target: int
) -> tuple[list[DerivedLevel], list[LevelRule]]:
    """Levels 1-5 chosen, measured, given what the program cannot price, and marked, and the
    rules that run them (NOTE [ Five levels from one menu ] in ``_level_search``)."""

    seen: dict[tuple[int, tuple[str, ...]], int] = {}

    def measure_with(lean: int | None) -> Callable[[int, list[dict[str, str]]], int]:
        def measure(k: int, plans: list[dict[str, str]]) -> int:
            rules = emit_rules(regions, menus, plans, lean)
            key = (k, tuple(r.model_dump_json() for r in rules))
            if key not in seen:  # a plan asked for again (a goal the program cannot reach)
                config = CheckpointConfig(preset=None, rules=rules)
                seen[key] = measured_peak(work, config, k, target)
            return seen[key]

        return measure

    least, top = top_choice(menus)
    lean, top_peak = _lean_first(regions, menus, top, measure_with)
    lowest = _lowest(work, regions, menus, (least, top), lean, top_peak, target)
    plans = level_plans(menus, measure_with(lean), lowest, _anchors(work, regions, target))
    plans = unnested(menus, alone, plans, measure_with(lean))
    per_level = [strategies for strategies, _, _ in plans]
    plain, plain_modelled = plain_steps(work, menus, target)
    levels = [
        DerivedLevel(
            level=k,
            strategies=strategies,
            measurement=replace(plain, peak=peak),
            modelled=Measurement(
                peak=choice.peak,
                batch=target,
                meter="modelled",
                seconds=menus.base_time + choice.time,
                predicted=True,
            ),
        )
        for k, (strategies, choice, peak) in enumerate(plans, start=1)
    ]
    found = _try_additions(work, regions, menus, per_level, levels, target, lean)
    if found.lean is not None:
        for lv in levels[found.lean - 1 :]:
            lv.lean = tuple(s.name for s in regions.lean)
    _mark_steps(levels, plain, plain_modelled)
    _account(levels, found, regions, menus)
    per_level = [lv.strategies for lv in levels]
    rules = found.rules(work.model, regions, menus, per_level)
    # the fallback's rules come first so that derived ones replace them (_Additions.rules)
    extra = fallback_at(work.model, found.fallback) if found.fallback is not None else []
    replaced = {str(r) for r in extra}
    lost = [r for r in lost_rules(work.model, rules) if r not in replaced]
    internal_assert(not lost, f"derived rules that no level runs: {lost}")
    return levels, rules


def _anchors(work: Workload, regions: CandidateRegions, target: int) -> dict[int, int]:
    """Levels 2 and 3's anchors: the measured peak of every region of the size table's row 2,
    then 3, checkpointed alone (NOTE [ The size table's rows ] in ``_candidates``), where the row
    holds more than the row below."""
    out: dict[int, int] = {}
    below: list[Span] = regions.of_size(1)
    for size in (2, 3):
        spans = regions.of_size(size)
        if spans and [s.name for s in spans] != [s.name for s in below]:
            rules = [span_rule(s, 1) for s in spans]
            out[size] = measured_peak(work, CheckpointConfig(preset=None, rules=rules), 1, target)
        below = spans
    return out


def _lowest(
    work: Workload,
    regions: CandidateRegions,
    menus: Menus,
    least_top: tuple[Choice, Choice],
    lean: int | None,
    top_peak: int | None,
    target: int,
) -> int:
    """Ptop of NOTE [ Five levels from one menu ] in ``_level_search``: the least measured peak of
    the top mix (``top_peak``, if measured already), the least-memory mix, and that mix with its
    stacks as sqrt(n) groups."""
    least, top = least_top

    def peak_of(choice: Choice, grouped: bool) -> int:
        plan = plan_of(menus, choice)
        stacks = group_stacks(regions, plan) if grouped else []
        rules = emit_rules(regions, menus, [plan], lean, 1 if stacks else None, stacks)
        return measured_peak(work, CheckpointConfig(preset=None, rules=rules), 1, target)

    peaks = [top_peak if top_peak is not None else peak_of(top, False)]
    if choice_key(least) != choice_key(top):
        peaks.append(peak_of(least, False))
    if group_stacks(regions, plan_of(menus, least)):
        try:
            peaks.append(peak_of(least, True))
        except ConfigError:  # a group over a block whose own region starts at the same level
            pass  # (HF PoolFormer): it does not combine, as in _from_top
    return min(peaks)


def _lean_first(
    regions: CandidateRegions,
    menus: Menus,
    top: Choice,
    measure_with: Callable[[int | None], Callable[[int, list[dict[str, str]]], int]],
) -> tuple[int | None, int | None]:
    """The level the lean MLPs run from (4, where they lower the top mix's measured peak by
    EXTRA_GAIN, else ``None``) and the top mix's measured peak with that choice (``None``
    where there is no lean MLP to try): decided before the levels are chosen, since it moves
    the peak that they are spaced towards (NOTE [ Five levels from one menu ] in
    ``_level_search``)."""
    plan = [plan_of(menus, top)] * STAGE_LEVEL
    if not lean_outside_runs(regions, emit_rules(regions, menus, plan, None)):
        return None, None
    without = measure_with(None)(STAGE_LEVEL, plan)
    lean = measure_with(STAGE_LEVEL)(STAGE_LEVEL, plan)
    return (STAGE_LEVEL, lean) if lean <= without * (1 - EXTRA_GAIN) else (None, without)


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
    gain: float = EXTRA_GAIN,
) -> int | None:
    """The lowest level from which an addition to the plan (``config_from(k)``: the plan with
    it from level k on) is kept: from the top level down, while it lowers that level's
    measured peak by EXTRA_GAIN; updates those levels' peaks (NOTE [ Five levels from one
    menu ] in ``_level_search``)."""
    start = None
    for k in range(len(levels), 0, -1):
        if not allowed(k):
            break
        try:
            peak = measured_peak(work, config_from(k), k, target)
        except ConfigError:  # the addition does not combine with this level's regions (a
            break  # ModuleList group over a layer whose own region starts at the same level)
        measured = levels[k - 1].measurement
        if peak > measured.peak * (1 - gain):
            break
        levels[k - 1].measurement = replace(measured, peak=peak)
        start = k
    return start


def _mark_steps(
    levels: list[DerivedLevel], plain: Measurement, plain_modelled: Measurement
) -> None:
    """Mark each level that lowers the measured peak by less than STEP from the level below
    as running that level's plan (level 0: nothing checkpointed, ``plain``), with its
    figures."""
    below: DerivedLevel | None = None
    for lv in levels:
        below_step = below.measurement if below is not None else plain
        if lv.measurement.peak <= below_step.peak * (1 - STEP):
            below = lv
            continue
        lv.same_as = below.level if below is not None else 0
        lv.measurement = below_step
        lv.strategies = dict(below.strategies) if below is not None else {}
        lv.lean = below.lean if below is not None else ()
        lv.whole = below.whole if below is not None else ()
        lv.fallback = below.fallback if below is not None else False
        lv.modelled = below.modelled if below is not None else plain_modelled
