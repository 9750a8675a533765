"""The uniform-level search: what each training level costs (:func:`profile`), and the lowest
level that fits a memory budget (:func:`suggest_level`).

Every level is measured on the same applied config, switching only the global training level;
see NOTE [ Measuring without the memory of the largest level ] in ``vision_ckpt.tune.profile``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..config.levels import parse_level
from ..config.schema import CheckpointConfig, parse_memory_budget
from ..errors import ConfigError
from ..measure._extrapolate import extrapolated_peak, peak_measurer, predict_peak
from ..measure._measure import (
    FitCheck,
    LossFn,
    StepMemory,
    Workload,
    applied,
    confirm_fits,
    default_loss,
    following_global,
    measure_flops,
    measure_memory,
    measure_time,
    meter_for,
    model_restored,
    run_step,
)
from ..measure._record import Measurement
from ..runtime.wrapper import training_level

__all__ = [
    "LevelProfile",
    "ProfileResult",
    "Suggestion",
    "profile",
    "suggest_level",
    "check_margin",
]


@dataclass
class LevelProfile:
    """What one training level costs in a training step."""

    level: int
    """The training level measured."""
    regions: int
    """Modules checkpointed at this level (as the plan reports them)."""
    measurement: Measurement | None = None
    """The step at the example's batch: the byte tracker's peak of live tensor bytes
    (parameters, gradients, optimizer state and activations; deterministic) and the median wall
    time over the timed repetitions. ``None`` when the level was not run (``skipped``)."""
    activation_bytes: int | None = None
    """Peak minus the bytes live before the forward."""
    saved_bytes: int | None = None
    """Activation bytes autograd kept from forward to backward (each storage once; parameters
    and buffers, which layers also save, are not counted)."""
    backward_flops: int | None = None
    """FLOPs of the backward pass, recomputation included."""
    time_ratio: float | None = None
    """The step time over level 0's (or the lowest level measured)."""
    saving: float | None = None
    """``1 - peak / peak at level 0``: the share of level 0's step peak this level saves."""
    cuda_peak_bytes: int | None = None
    """On CUDA: ``torch.cuda.max_memory_allocated`` of a warmed-up step, the figure budgets are
    decided on there (NOTE [ Two meters ] in ``vision_ckpt.measure._measure``), beside the
    tracker's in ``measurement``."""
    cuda_reserved_bytes: int | None = None
    """On CUDA: ``torch.cuda.max_memory_reserved`` of the same step."""
    skipped: str | None = None
    """Why the level was not run (e.g. its predicted peak is over ``memory_limit``)."""


@dataclass
class ProfileResult:
    """The result of :func:`profile`: one :class:`LevelProfile` per level, lowest level first."""

    model: str
    batch_size: int
    input_shape: tuple[int, ...]
    device: str
    steps: int
    levels: list[LevelProfile] = field(default_factory=list)
    meter: str = "bytes"
    """What decided ``memory_limit``: ``bytes`` (the byte tracker) or ``cuda allocator``."""

    def level(self, value: int) -> LevelProfile:
        for entry in self.levels:
            if entry.level == value:
                return entry
        raise KeyError(value)

    def frontier(self) -> dict[int, str]:
        """Per measured level: ``""`` when it is on the memory/time frontier, ``"same as L3"``
        when it checkpoints what a lower level does (same regions and bytes), or ``"dominated
        by L3"`` when another level has no higher peak and no longer step time, and is better
        in one of them. Levels not run are left out.

        >>> def measured(level, regions, peak, saved, seconds):
        ...     step = Measurement(peak=peak, batch=8, meter="bytes", seconds=seconds)
        ...     return LevelProfile(level, regions, step, saved_bytes=saved)
        >>> r = ProfileResult("m", 8, (8, 3), "cpu", 1, [
        ...     measured(0, 0, 100, 90, 1.0), measured(1, 4, 60, 50, 1.1),
        ...     measured(2, 8, 70, 40, 1.3), measured(3, 8, 70, 40, 1.2)])
        >>> r.frontier()  # L3 is L2 again, faster by noise: it dominates nothing
        {0: '', 1: '', 2: 'dominated by L1', 3: 'same as L2'}
        >>> r.levels[1] = measured(1, 4, 60, 50, 1.4)
        >>> r.frontier()
        {0: '', 1: '', 2: '', 3: 'same as L2'}
        """
        run = [e for e in self.levels if e.skipped is None and e.measurement is not None]
        out: dict[int, str] = {}
        for e in run:
            same = next((o for o in run if o.level < e.level and _same_step(o, e)), None)
            if same is not None:
                out[e.level] = f"same as L{same.level}"
                continue
            out[e.level] = ""
            mine = e.measurement
            if mine is None or mine.seconds is None:
                continue
            for o in run:
                theirs = o.measurement
                if o is e or theirs is None or theirs.seconds is None:
                    continue
                if _same_step(o, e):
                    continue  # the same plan measured twice: only noise tells them apart
                no_worse = theirs.peak <= mine.peak and theirs.seconds <= mine.seconds
                better = theirs.peak < mine.peak or theirs.seconds < mine.seconds
                if no_worse and better:
                    out[e.level] = f"dominated by L{o.level}"
                    break
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the CLI's ``--json`` format)."""
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        data["frontier"] = {str(k): v for k, v in self.frontier().items()}
        return data


def _same_step(a: LevelProfile, b: LevelProfile) -> bool:
    """Whether two levels checkpoint the same: the same regions, peak and saved bytes."""
    peak_a = a.measurement.peak if a.measurement is not None else None
    peak_b = b.measurement.peak if b.measurement is not None else None
    return (a.regions, peak_a, a.saved_bytes) == (b.regions, peak_b, b.saved_bytes)


@dataclass
class Suggestion:
    """The answer of :func:`suggest_level`."""

    level: int | None
    """Lowest uniform level whose predicted peak fits the budget with the margin; ``None``
    when no level fits."""
    budget_bytes: int
    margin: float
    """Share of the budget kept free: a level fits when ``predicted * (1 + margin) <= budget``."""
    batch_size: int
    predicted: dict[int, Measurement]
    """Per level, the step peak at ``batch_size``, extrapolated from ``measured`` (a step at
    ``batch_size`` itself when it is 4 or less), by the meter that decides on the device:
    ``bytes`` (the byte tracker) or ``cuda allocator`` (``max_memory_allocated``, NOTE [ Two
    meters ] in ``vision_ckpt.measure._measure``)."""
    measured: dict[int, list[Measurement]]
    """Per level, the steps at small batches the prediction extrapolates from."""
    reserved: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """On CUDA, per level, (batch size, ``max_memory_reserved``) of the measured steps."""
    check: FitCheck | None = None
    """On CUDA, the real step at ``batch_size`` that confirmed ``level``."""
    rejected: dict[int, FitCheck] = field(default_factory=dict)
    """Levels predicted to fit whose real step at ``batch_size`` did not."""

    @property
    def fits(self) -> bool:
        return self.level is not None

    @property
    def meter(self) -> str:
        """The meter of the predictions (``bytes`` or ``cuda allocator``)."""
        return next(iter(self.predicted.values())).meter

    @property
    def smallest_peak(self) -> int:
        """The smallest predicted peak over the levels tried."""
        return min(m.peak for m in self.predicted.values())

    def explain(self) -> str:
        from ..measure._memory import format_bytes

        rejected = "".join(
            f"; level {lv} was predicted to fit, but its {c.explain()}"
            for lv, c in self.rejected.items()
        )
        if self.level is None:
            best = min(self.predicted, key=lambda lv: self.predicted[lv].peak)
            return (
                f"no level fits {format_bytes(self.budget_bytes)} at batch {self.batch_size} "
                f"(margin {self.margin:.0%}): the smallest predicted peak is "
                f"{format_bytes(self.smallest_peak)} at level {best}{rejected}. Lower the "
                "batch size or raise the budget."
            )
        peak = self.predicted[self.level].peak
        checked = f"; {self.check.explain()}" if self.check is not None else ""
        return (
            f"level {self.level} fits: predicted peak {format_bytes(peak)}"
            f" at batch {self.batch_size}, budget {format_bytes(self.budget_bytes)} "
            f"(margin {self.margin:.0%}){checked}{rejected}"
        )


def _regions_at(plan: Any, level: int) -> int:
    return len(plan.at_level(level).checkpointed)


def _check_levels(levels: Iterable[int]) -> list[int]:
    parsed = sorted({int(parse_level(v, what="profiled level")) for v in levels})
    if not parsed:
        raise ConfigError("no level to profile: pass at least one level 0-5, e.g. levels=range(6)")
    return parsed


def check_margin(margin: float) -> None:
    """Reject a budget margin outside ``[0, 1)``."""
    if not 0 <= margin < 1:
        raise ConfigError(f"margin={margin} is not valid; expected a fraction in [0, 1)")


def profile(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    levels: Iterable[int] = range(6),
    config: CheckpointConfig | None = None,
    steps: int = 3,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    memory_limit: int | str | None = None,
    flops: bool = True,
    on_level: Callable[[LevelProfile], None] | None = None,
    model_name: str | None = None,
) -> ProfileResult:
    """Measure memory and time of a training step at each training level.

    The model gets ``config`` (default: its preset, or the structural fallback) applied for the
    duration of the call and is restored afterwards. For each level: one step under byte
    counting (peak, activation and saved bytes), one under a FLOP counter (backward FLOPs) and
    ``steps`` timed steps after a warm-up (median).

    Args:
        model: the model, in training mode, on its device.
        example_input: one input batch (dim 0 is the batch).
        levels: training levels to measure (0-5).
        config: level rules; its ``training_checkpoint_level`` is ignored here.
        steps: timed steps per level.
        loss_fn: turns the model output into a scalar loss; default mean of squares.
        optimizer: if given, each step also runs ``optimizer.step()`` (and its state counts).
        memory_limit: skip levels whose step peak, extrapolated from two small batches, would
            exceed this (bytes or a size such as ``"6GiB"``); they are reported, not run.
        flops: also count backward FLOPs.
        on_level: called with each level's result as soon as it is measured (progress bars).
        model_name: a name for the report.

    Returns:
        A :class:`ProfileResult` with one :class:`LevelProfile` per level, lowest level first.

    >>> import torch, timm, vision_ckpt
    >>> model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    >>> result = vision_ckpt.tune.profile(model, torch.randn(2, 3, 32, 32), levels=[0, 5], steps=1)
    >>> r0, r5 = result.level(0), result.level(5)
    >>> r5.saved_bytes < r0.saved_bytes
    True
    """
    chosen = _check_levels(levels)
    if steps < 1:
        raise ConfigError(f"steps={steps} is not valid; at least one timed step is needed")
    limit = parse_memory_budget(memory_limit) if memory_limit is not None else None
    work = Workload(model, example_input, loss_fn or default_loss, optimizer)
    result = ProfileResult(
        model=model_name or type(model).__name__,
        batch_size=work.batch_size,
        input_shape=tuple(example_input.shape),
        device=str(work.device),
        steps=steps,
        meter=meter_for(work.device).name,
    )
    with model_restored(model, optimizer), applied(model, following_global(config)) as plan:
        if optimizer is not None:
            # One step first, so that every level is measured with the optimizer state present
            # (not only the first level measured, which would otherwise create it).
            with training_level(max(chosen)):
                run_step(work, work.batch(2))
        by_level = _profile_levels(work, plan, chosen, limit, steps, flops, on_level)
    result.levels = [by_level[level] for level in chosen]
    _fill_ratios(result)
    return result


def _profile_levels(
    work: Workload,
    plan: Any,
    chosen: list[int],
    limit: int | None,
    steps: int,
    flops: bool,
    on_level: Callable[[LevelProfile], None] | None,
) -> dict[int, LevelProfile]:
    """:func:`profile`'s levels, cheapest in memory first; once one is predicted over
    ``limit``, it and every level below are skipped."""
    by_level: dict[int, LevelProfile] = {}
    over_limit_from: int | None = None
    for level in sorted(chosen, reverse=True):  # cheapest in memory first
        entry = LevelProfile(level=level, regions=_regions_at(plan, level))
        by_level[level] = entry
        with training_level(level):
            predicted = None
            if over_limit_from is None and limit is not None:
                predicted = predict_peak(work, limit)
            if over_limit_from is not None:
                entry.skipped = f"not run: level {over_limit_from} already exceeded memory_limit"
            elif predicted is not None and predicted > limit:  # type: ignore[operator]
                entry.skipped = (
                    f"not run: predicted peak {predicted} bytes exceeds memory_limit {limit} bytes"
                )
                over_limit_from = level
            else:
                _profile_level(entry, work, steps, flops)
        if on_level is not None:
            on_level(entry)
    return by_level


def _profile_level(entry: LevelProfile, work: Workload, steps: int, flops: bool) -> None:
    """Measure one level at the example's batch, at the training level in force."""
    x = work.example
    step = measure_memory(work, x)
    entry.activation_bytes, entry.saved_bytes = step.activation, step.saved
    entry.cuda_peak_bytes, entry.cuda_reserved_bytes = step.allocated, step.reserved
    if flops:
        entry.backward_flops = measure_flops(work, x)
    seconds = measure_time(work, x, steps)
    entry.measurement = Measurement(
        peak=step.peak, batch=work.batch_size, meter="bytes", seconds=seconds
    )


def _fill_ratios(result: ProfileResult) -> None:
    measured = [e.measurement for e in result.levels if e.measurement is not None]
    if not measured:
        return
    base = measured[0]
    for entry in result.levels:
        step = entry.measurement
        if step is None:
            continue
        if base.seconds:
            entry.time_ratio = step.seconds / base.seconds  # type: ignore[operator]
        if base.peak:
            entry.saving = 1.0 - step.peak / base.peak


def suggest_level(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    budget: int | str,
    batch_size: int | None = None,
    *,
    levels: Iterable[int] = range(6),
    config: CheckpointConfig | None = None,
    margin: float = 0.05,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Suggestion:
    """The lowest uniform training level whose predicted step peak fits ``budget``.

    Each level is measured at two small batch sizes and its peak extrapolated to ``batch_size``
    (see NOTE [ Measuring without the memory of the largest level ]). A level fits when
    ``predicted * (1 + margin) <= budget``. On CUDA the peaks are the allocator's
    (``max_memory_allocated`` of warmed-up steps) and the lowest level predicted to fit is then
    run once at ``batch_size`` to confirm it; if its real step allocates more than ``budget``,
    the next level predicted to fit is tried (NOTE [ Two meters ] in
    ``vision_ckpt.measure._measure``).
    Elsewhere the target batch is never run.

    Args:
        model: the model (training mode), on its device.
        example_input: an input batch; rows are sliced or tiled to the batch sizes measured.
        budget: bytes, or a size such as ``"6GiB"`` / ``"8 GB"``.
        batch_size: the batch size to predict for (default: the example's).
        levels: levels to consider.
        config: level rules (default: the model's preset or the structural fallback).
        margin: fraction of the budget kept free.
        loss_fn: as in :func:`profile`.
        optimizer: as in :func:`profile`.

    Returns:
        A :class:`Suggestion`; ``level`` is ``None`` when nothing fits, and ``explain()`` then
        gives the smallest achievable peak.

    >>> import torch, timm, vision_ckpt
    >>> model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    >>> x = torch.randn(4, 3, 32, 32)
    >>> s = vision_ckpt.tune.suggest_level(model, x, "1GiB", batch_size=8, levels=[0, 5])
    >>> s.level
    0
    """
    budget_bytes = parse_memory_budget(budget)
    check_margin(margin)
    chosen = _check_levels(levels)
    work = Workload(model, example_input, loss_fn or default_loss, optimizer)
    target = batch_size or work.batch_size
    if target < 1:
        raise ConfigError(f"batch_size={batch_size} is not valid; expected a positive integer")
    with model_restored(model, optimizer):
        with applied(model, following_global(config)):
            predicted, measured, reserved = _predict_levels(work, chosen, target, budget_bytes)
            fitting = [lv for lv in chosen if predicted[lv].peak * (1 + margin) <= budget_bytes]
            chosen_level, check, rejected = _confirm_lowest(work, fitting, budget_bytes, target)
    return Suggestion(
        level=chosen_level,
        budget_bytes=budget_bytes,
        margin=margin,
        batch_size=target,
        predicted=dict(sorted(predicted.items())),
        measured=dict(sorted(measured.items())),
        reserved={lv: r for lv, r in sorted(reserved.items()) if r},
        check=check,
        rejected=rejected,
    )


def _predict_levels(
    work: Workload, chosen: list[int], target: int, budget_bytes: int
) -> tuple[dict[int, Measurement], dict[int, list[Measurement]], dict[int, list[tuple[int, int]]]]:
    """Per level, cheapest in memory first: the peak predicted at ``target``, the steps it
    extrapolates from, and the (batch, reserved) points where the meter gives them."""
    predicted: dict[int, Measurement] = {}
    measured: dict[int, list[Measurement]] = {}
    reserved: dict[int, list[tuple[int, int]]] = {}
    meter = meter_for(work.device).name
    for level in sorted(chosen, reverse=True):  # cheapest in memory first
        readings: list[tuple[int, StepMemory]] = []
        with training_level(level):
            peak, points = extrapolated_peak(peak_measurer(work, readings), target, budget_bytes)
        ran = any(b == target for b, _ in points)  # a target of 4 or less is simply run
        predicted[level] = Measurement(peak=peak, batch=target, meter=meter, predicted=not ran)
        measured[level] = [step.measurement(b) for b, step in readings]
        reserved[level] = [(b, r.reserved) for b, r in readings if r.reserved is not None]
    return predicted, measured, reserved


def _confirm_lowest(
    work: Workload, fitting: list[int], budget_bytes: int, target: int
) -> tuple[int | None, FitCheck | None, dict[int, FitCheck]]:
    """The lowest level predicted to fit whose real step at the target fits too (on CUDA;
    elsewhere the prediction is the answer): NOTE [ Two meters ] in _measure. Returns it (or
    ``None``), its check, and the levels whose real step did not fit."""
    rejected: dict[int, FitCheck] = {}
    for level in fitting:
        with training_level(level):
            result = confirm_fits(work, budget_bytes, target)
        if result is None or result.fits:
            return level, result, rejected
        rejected[level] = result
    return None, None, rejected
