"""The largest batch that fits a memory budget, per training level (:func:`max_batch`).

NOTE [ The largest batch from a few small ones ]

A training step runs the same operators whatever the batch, and the bytes live after each one
are affine in the batch (NOTE [ Predicting the peak of a larger batch ] in
``vision_ckpt.measure._extrapolate``): ``live_i(B) = a_i + s_i * B``. The step peak at ``B`` is the
largest of them, a convex function of ``B``, so the batches that fit a budget form an interval
and its top end has a closed form: ``min over s_i > 0 of (budget - a_i) / s_i``, rounded down.
Each operator's line is drawn through the timelines of the two larger measured batches (a
plain step under the byte counter, the same meter as :func:`vision_ckpt.tune.profile`).

Linearity is checked, not assumed: the lines through the two *smaller* batches predict the
third batch's peak, and the relative miss is reported (``FitRow.linear_error``); above
``linear_tolerance`` the row says so (an operator whose algorithm or workspace changes with the
batch, a model that pads the batch). If the runs did not execute the same operators the
prediction falls back to the line through their peaks, and the row says that too.

Time: the step time at each measured batch (a median after a warm-up) fitted by a line
``t = c + r * B`` (the fixed part is the optimizer and the weights' gradients), read at the
row's largest batch (the row reports it per sample too). Small batches underuse a GPU, so the
time is an upper bound there; on CPU it is close.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

import numpy as np
import torch

from ..config.levels import parse_level
from ..config.schema import CheckpointConfig, parse_memory_budget
from ..errors import ConfigError
from ..measure._extrapolate import Lines
from ..measure._measure import (
    LossFn,
    Workload,
    applied,
    following_global,
    measure_memory,
    measure_time,
    model_restored,
)
from ..measure._memory import format_bytes
from ..measure._price import modelled_step_seconds
from ..measure._record import Measurement
from ..measure.models import output_loss, own_switch as find_own_switch, parse_input_shape
from ..runtime.wrapper import training_level
from ._planner import level_signature

__all__ = ["FitRow", "FitResult", "max_batch"]

Clock = Literal["modelled", "measured"]
"""How a row's step time is had: ``modelled`` prices the step's operators from their shapes
(NOTE [ A modelled price ] in ``vision_ckpt.measure._price``: no kernel runs, the same on every
run, and recomputation always costs more); ``measured`` times real steps (a median after a
warm-up, which a busy machine can reorder)."""


@dataclass
class FitRow:
    """One way of running the model (a level, the library's own switch, the planner's plan)
    and the largest batch it fits."""

    label: str
    """``level 3``, ``own switch (set_grad_checkpointing())`` or ``planner``."""
    level: int | None
    """The training level, or ``None`` for the own switch and the planner."""
    max_batch: int | None
    """The largest batch whose predicted step peak fits the budget (0: not even one sample;
    ``None``: not measured, see ``note``)."""
    measurement: Measurement | None = None
    """The step at ``max_batch``, predicted: its peak and its time (``seconds`` is ``None``
    when not timed; ``seconds_per_sample`` divides it by the batch). ``None`` when
    ``max_batch`` is 0 or not measured."""
    measured: list[Measurement] = field(default_factory=list)
    """The steps at the small batches the prediction comes from."""
    linear_error: float | None = None
    """Relative miss of the third batch's peak predicted from the first two."""
    linear: bool = True
    """Whether ``linear_error`` is within the tolerance and the runs' operators matched (not
    checked, and ``True``, when only two batches were measured: ``note`` says so)."""
    note: str = ""
    """Anything the numbers need beside them (not linear, same plan as another level, ...)."""


@dataclass
class _Points:
    steps: list[Measurement] = field(default_factory=list)
    """One step per small batch (timed when asked), by the device's meter."""
    timelines: list[list[int]] = field(default_factory=list)
    """Each step's bytes after every operator, in the same meter's terms."""

    @property
    def batches(self) -> list[int]:
        return [s.batch for s in self.steps]

    @property
    def peaks(self) -> list[int]:
        return [s.peak for s in self.steps]

    @property
    def times(self) -> list[float]:
        """The steps' seconds, or none when they were not timed."""
        times = [s.seconds for s in self.steps if s.seconds is not None]
        return times if len(times) == len(self.steps) else []


@dataclass
class FitResult:
    """The answer of :func:`max_batch`: one :class:`FitRow` per level (and own switch / plan)."""

    model: str
    input_shape: tuple[int, ...]
    """One sample's shape (without the batch)."""
    device: str
    budget_bytes: int
    margin: float
    """Share of the budget kept free: a batch fits when ``peak * (1 + margin) <= budget``."""
    batches: tuple[int, ...]
    """The small batches measured."""
    clock: str = "modelled"
    """How the step times were had: ``modelled`` or ``measured`` (:data:`Clock`)."""
    rows: list[FitRow] = field(default_factory=list)
    _points: dict[str, _Points] = field(default_factory=dict, repr=False)
    """The measurements behind each measured row, to solve for another budget."""
    _tolerance: float = field(default=0.02, repr=False)
    _largest: int = field(default=1 << 20, repr=False)

    def for_budget(self, budget: int | str) -> FitResult:
        """The same measurements solved for another budget (nothing is run again).

        >>> import timm
        >>> model = timm.create_model("resnet18", pretrained=False, num_classes=10)
        >>> fit = max_batch(model, (3, 32, 32), "128MiB", levels=[0], time_steps=0)
        >>> fit.for_budget("256MiB").row("level 0").max_batch > fit.row("level 0").max_batch
        True
        """
        budget_bytes = parse_memory_budget(budget)
        goal = budget_bytes / (1 + self.margin)
        rows = []
        for r in self.rows:
            points = self._points.get(r.label)
            if points is None:  # a copy of another row, or not measured
                source = next((n for n in rows if r.note.startswith(_same(n))), None)
                rows.append(r if source is None else _copy(source, r.label, r.level, _same(source)))
                continue
            rows.append(_row(r.label, r.level, points, goal, self._largest, self._tolerance))
        return replace(self, budget_bytes=budget_bytes, rows=rows)

    def row(self, label: str) -> FitRow:
        """The row called ``label`` (``"level 3"``, ``"own switch"``, ``"planner"``); a prefix
        is enough."""
        for r in self.rows:
            if r.label == label or r.label.startswith(label):
                return r
        raise KeyError(f"no row {label!r}; rows: {', '.join(r.label for r in self.rows)}")

    def levels(self) -> list[FitRow]:
        """The rows of uniform levels."""
        return [r for r in self.rows if r.level is not None]

    def best_level(self) -> FitRow | None:
        """The level that fits the largest batch (ties: the faster, then the lower level)."""
        rows = [r for r in self.levels() if r.max_batch]
        if not rows:
            return None
        return max(rows, key=lambda r: (r.max_batch, -(_per_sample(r) or 0.0), -r.level))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the CLI's ``--json`` format)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        data["rows"] = [asdict(r) for r in self.rows]
        data["input_shape"] = list(self.input_shape)
        data["batches"] = list(self.batches)
        best = self.best_level()
        data["best_level"] = None if best is None else best.level
        return data

    def explain(self) -> str:
        """One line: the level that fits the most, and against the own switch if measured."""
        best = self.best_level()
        budget = format_bytes(self.budget_bytes)
        if best is None:
            return f"no level fits one sample of {self.input_shape} in {budget}"
        text = f"level {best.level} fits the largest batch in {budget}: {best.max_batch}"
        switch = next((r for r in self.rows if r.label.startswith("own switch")), None)
        if switch is not None and switch.max_batch:
            text += f" ({best.max_batch / switch.max_batch:.2f}x the {switch.label}'s"
            text += f" {switch.max_batch})"
        bent = [r.label for r in self.rows if not r.linear]
        if bent:
            text += f"; not linear in the batch, read with care: {', '.join(bent)}"
        return text


def _per_sample(row: FitRow) -> float | None:
    return row.measurement.seconds_per_sample if row.measurement is not None else None


@dataclass(frozen=True)
class _How:
    """How each small batch is measured: its times, and what is said before it runs."""

    time_steps: int
    clock: Clock
    say: Callable[[str], None] | None = None


def _measure(work: Workload, batches: Sequence[int], how: _How, label: str) -> _Points:
    time_steps, clock = how.time_steps, how.clock
    points = _Points()
    for i, b in enumerate(batches):
        if how.say is not None:
            how.say(f"{label}: batch {b} ({i + 1} of {len(batches)})")
        x = work.batch(b)  # a storage of its own at every batch (see _measure.batch_of)
        timeline: list[int] = []
        step = measure_memory(work, x, timeline)
        if not time_steps:
            seconds = None
        elif clock == "modelled":
            seconds = modelled_step_seconds(work, x)
        else:
            seconds = measure_time(work, x, time_steps)
        points.steps.append(step.measurement(b, seconds))
        points.timelines.append(timeline)
    return points


def _lines(points: _Points, i: int, j: int) -> Lines | None:
    """The per-operator lines through runs i and j, or ``None`` when the two runs did not
    execute the same operators."""
    return Lines.through(
        (points.batches[i], points.timelines[i]), (points.batches[j], points.timelines[j])
    )


def _peak_lines(points: _Points, i: int, j: int) -> Lines:
    return Lines.through_peaks(
        (points.batches[i], points.peaks[i]), (points.batches[j], points.peaks[j])
    )


def _time_at(points: _Points, batch: int) -> float | None:
    """The step seconds at ``batch`` along the line through the timed steps."""
    if not points.times or batch < 1:
        return None
    b = np.asarray(points.batches, dtype=np.float64)
    t = np.asarray(points.times, dtype=np.float64)
    rate, fixed = np.polyfit(b, t, 1) if len(set(points.batches)) > 1 else (t[0] / b[0], 0.0)
    if fixed < 0 or rate <= 0:  # noise: proportional to the batch, through the origin
        rate, fixed = float((b * t).sum() / (b * b).sum()), 0.0
    return float(fixed + rate * batch)


def _row(
    label: str,
    level: int | None,
    points: _Points,
    goal: float,
    cap: int,
    tolerance: float,
) -> FitRow:
    notes = []
    error = None
    check = _lines(points, 0, 1)
    if len(points.batches) >= 3:
        if check is None:
            check = _peak_lines(points, 0, 1)
            notes.append("the runs executed different operators: line through the peaks")
        third = points.peaks[2]
        error = abs(check.at(points.batches[2]) - third) / third
    last = _lines(points, -2, -1)
    if last is None:
        last = _peak_lines(points, -2, -1)
        if not notes:
            notes.append("the runs executed different operators: line through the peaks")
    linear = not notes and (error is None or error <= tolerance)
    if error is not None and error > tolerance:
        notes.append(
            f"not linear in the batch: batch {points.batches[2]}'s peak is {error:.1%} off the "
            f"line through batches {points.batches[0]} and {points.batches[1]}"
        )
    if error is None:
        notes.append("linearity not checked (two batches measured)")
    top = last.largest_within(goal, cap)
    at_top = None
    if top:
        peak, meter = int(round(last.at(top))), points.steps[-1].meter
        seconds = _time_at(points, top)
        at_top = Measurement(peak=peak, batch=top, meter=meter, seconds=seconds, predicted=True)
    return FitRow(
        label=label,
        level=level,
        max_batch=top,
        measurement=at_top,
        measured=list(points.steps),
        linear_error=error,
        linear=linear,
        note="; ".join(notes),
    )


def _check_batches(batches: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(b) for b in batches)
    if (
        len(out) not in (2, 3)
        or len(set(out)) != len(out)
        or list(out) != sorted(out)
        or out[0] < 1
    ):
        raise ConfigError(
            f"batches={tuple(batches)} is not valid; expected two or three increasing positive "
            "batch sizes, e.g. (2, 3, 4): the third checks that bytes are linear in the batch"
        )
    return out


def max_batch(
    model: torch.nn.Module,
    input_shape: Sequence[int] | str,
    budget: int | str,
    *,
    levels: Iterable[int] = range(6),
    include_own_switch: bool = True,
    planner: bool = False,
    config: CheckpointConfig | None = None,
    batches: Sequence[int] = (2, 3, 4),
    margin: float = 0.0,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    time_steps: int = 1,
    clock: Clock = "modelled",
    linear_tolerance: float = 0.02,
    largest: int = 1 << 20,
    model_name: str | None = None,
    on_row: Callable[[FitRow], None] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> FitResult:
    """The largest batch whose step peak fits ``budget``, at each training level.

    Each level (and the model library's own switch, and optionally the per-block planner) is
    measured at the small ``batches`` on the model's device, and the largest batch is solved
    for from the per-operator lines (NOTE [ The largest batch from a few small ones ]); a batch
    larger than the smallest ones is never run.

    Args:
        model: the model, on its device (trained in place and restored afterwards).
        input_shape: one sample, ``(C, H, W)`` or ``(C, D, H, W)``, or ``"3,224,224"``.
        budget: bytes, or a size such as ``"24GiB"``.
        levels: training levels to measure (0-5).
        include_own_switch: also measure the library's own checkpointing (timm
            ``set_grad_checkpointing``, Hugging Face ``activation_checkpointing_enable``,
            MONAI ``use_checkpoint``) with the same meter, as the row ``own switch (...)``.
        planner: also run :func:`vision_ckpt.tune.plan_for_budget` at the best level's batch and
            report its predicted time there (row ``planner``); it measures batches of 1/8 and
            1/4 of that batch, so it is off by default.
        config: level rules (default: the model's preset, or the structural fallback).
        batches: the small batches measured; the third checks linearity.
        margin: share of the budget kept free.
        loss_fn: the loss (default :func:`vision_ckpt.measure.models.output_loss`, fitted to
            the output).
        optimizer: if given, each step runs it too (its state counts).
        time_steps: timed steps per batch, ``measured`` clock (median after a warm-up); 0: none.
        clock: ``modelled`` (default) or ``measured`` step times (:data:`Clock`).
        linear_tolerance: largest relative miss of the third batch's peak still called linear.
        largest: the largest batch considered.
        model_name: a name for the report.
        on_row: called with each row as soon as it is measured.
        on_progress: called with what is measured next (``level 3: batch 4 (3 of 3)``).

    Returns:
        A :class:`FitResult`; ``best_level()`` is the level fitting the largest batch.

    >>> import timm, vision_ckpt
    >>> model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    >>> fit = vision_ckpt.tune.max_batch(model, (3, 32, 32), "256MiB", levels=[0, 5], time_steps=0)
    >>> fit.row("level 5").max_batch > fit.row("level 0").max_batch > 8, fit.rows[-1].label
    (True, 'own switch (set_grad_checkpointing())')
    """
    shape, budget_bytes, small, chosen = _checked(
        input_shape, budget, margin, batches, levels, clock
    )
    device, example = _example_batch(model, shape, small[-1])
    result = FitResult(
        model=model_name or type(model).__name__,
        input_shape=tuple(int(s) for s in shape),
        device=str(device),
        budget_bytes=budget_bytes,
        margin=margin,
        batches=small,
        clock=clock,
        _tolerance=linear_tolerance,
        _largest=largest,
    )
    work = Workload(model, example, loss_fn or output_loss, optimizer)
    how = _How(time_steps, clock, on_progress)
    return _fill_rows(result, work, config, chosen, include_own_switch, planner, how, on_row)


def _checked(
    input_shape: Sequence[int] | str,
    budget: int | str,
    margin: float,
    batches: Sequence[int],
    levels: Iterable[int],
    clock: str,
) -> tuple[tuple[int, ...], int, tuple[int, ...], list[int]]:
    """:func:`max_batch`'s arguments checked: the sample's shape, the budget in bytes, the
    small batches and the levels, sorted (and the clock known)."""
    if clock not in ("modelled", "measured"):
        raise ConfigError(f"clock={clock!r} is not valid; expected 'modelled' or 'measured'")
    shape = parse_input_shape(input_shape) if isinstance(input_shape, str) else tuple(input_shape)
    if len(shape) not in (3, 4) or any(int(s) < 1 for s in shape):
        raise ConfigError(
            f"input_shape={shape} is not valid; expected one sample as (C, H, W) or (C, D, H, W)"
        )
    budget_bytes = parse_memory_budget(budget)
    if not 0 <= margin < 1:
        raise ConfigError(f"margin={margin} is not valid; expected a fraction in [0, 1)")
    small = _check_batches(batches)
    chosen = sorted({int(parse_level(v, what="level")) for v in levels})
    if not chosen:
        raise ConfigError("no level to measure: pass at least one level 0-5, e.g. levels=range(6)")
    return shape, budget_bytes, small, chosen


def _example_batch(
    model: torch.nn.Module, shape: tuple[int, ...], rows: int
) -> tuple[torch.device, torch.Tensor]:
    """The model's device (its first parameter's, else the CPU) and a seeded random batch of
    ``rows`` samples on it."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    return device, torch.randn(rows, *shape, generator=generator).to(device)


def _fill_rows(
    result: FitResult,
    work: Workload,
    config: CheckpointConfig | None,
    chosen: list[int],
    include_own_switch: bool,
    planner: bool,
    how: _How,
    on_row: Callable[[FitRow], None] | None,
) -> FitResult:
    """Measure :func:`max_batch`'s rows into ``result`` (levels, own switch, planner), solved
    for its budget, margin, batches, largest batch and tolerance, and return it; each row goes
    to ``on_row`` as soon as it is measured."""
    goal = result.budget_bytes / (1 + result.margin)
    small, largest, tolerance = result.batches, result._largest, result._tolerance

    def add(row: FitRow, points: _Points | None = None) -> None:
        if points is not None:
            result._points[row.label] = points
        result.rows.append(row)
        if on_row is not None:
            on_row(row)

    model, optimizer = work.model, work.optimizer
    with model_restored(model, optimizer):
        with applied(model, following_global(config)) as plan:
            _level_rows(work, plan, chosen, small, how, goal, largest, tolerance, add)
        switch = find_own_switch(model) if include_own_switch else None
        if switch is not None:
            add(*_switch_row(work, switch, small, how, goal, largest, tolerance))
    if planner:
        example, loss = work.example, work.loss_fn
        add(_planner_row(result, model, example, config, result.margin, loss, optimizer))
    return result


def _level_rows(
    work: Workload,
    plan: Any,
    chosen: list[int],
    small: tuple[int, ...],
    how: _How,
    goal: float,
    largest: int,
    tolerance: float,
    add: Callable[[FitRow, _Points | None], None],
) -> None:
    """One row per level, handed to ``add``; a level whose plan is a lower level's (same
    signature) copies that row instead of being measured again."""
    seen: dict[tuple[Any, ...], FitRow] = {}
    for level in chosen:
        signature = level_signature(plan, level)
        same = seen.get(signature)
        if same is not None:
            add(_copy(same, f"level {level}", level, _same(same)), None)
            continue
        with training_level(level):
            points = _measure(work, small, how, f"level {level}")
        row = _row(f"level {level}", level, points, goal, largest, tolerance)
        seen[signature] = row
        add(row, points)


def _same(row: FitRow) -> str:
    return f"same plan as {row.label}"


def _copy(row: FitRow, label: str, level: int, note: str) -> FitRow:
    notes = "; ".join(n for n in (note, row.note) if n)
    return replace(row, label=label, level=level, note=notes, measured=list(row.measured))


def _switch_row(
    work: Workload,
    switch: Any,
    small: tuple[int, ...],
    how: _How,
    goal: float,
    largest: int,
    tolerance: float,
) -> tuple[FitRow, _Points | None]:
    label = f"own switch ({switch.name})"
    try:
        switch.enable()
    except Exception as exc:  # timm families without support assert; report, do not guess
        note = f"the switch refused: {type(exc).__name__}: {exc}"
        return FitRow(label, None, None, note=note), None
    try:
        points = _measure(work, small, how, label)
    finally:
        switch.disable()
    return _row(label, None, points, goal, largest, tolerance), points


def _planner_row(
    result: FitResult,
    model: torch.nn.Module,
    example: torch.Tensor,
    config: CheckpointConfig | None,
    margin: float,
    loss: LossFn,
    optimizer: torch.optim.Optimizer | None,
) -> FitRow:
    from ._planner import plan_for_budget

    best = result.best_level()
    if best is None or not best.max_batch:
        return FitRow("planner", None, None, note="no level fits one sample; nothing to plan")
    batch = best.max_batch
    planned = plan_for_budget(
        model,
        example,
        result.budget_bytes,
        batch_size=batch,
        config=config,
        margin=margin,
        loss_fn=loss,
        optimizer=optimizer,
    )
    if planned.config is None:
        return FitRow(
            "planner", None, None, note=f"no per-block plan fits batch {batch}: {planned.explain()}"
        )
    seconds = planned.measurement.seconds or planned.predicted_time or None
    at_batch = replace(planned.measurement, seconds=seconds)
    per_sample = at_batch.seconds_per_sample
    fastest = planned.fastest_uniform()
    scale = ""
    if fastest is not None and per_sample is not None:
        # the planner times the plan and the levels on its own small batches: compare there
        level_time = planned.uniform[fastest].seconds_per_sample
        scale = (
            f"; timed beside the levels: {per_sample * 1000:.3g} ms/sample against level "
            f"{fastest}'s {level_time * 1000:.3g}"
        )
    return FitRow(
        "planner",
        None,
        batch,
        measurement=at_batch,
        note=f"the planner at level {best.level}'s batch: {planned.explain()}{scale}",
    )
