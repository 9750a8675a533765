"""Measure what each training level costs, and pick a level (or a set of blocks) for a budget.

Everything here runs real training steps (forward, loss, backward, optionally an optimizer step)
of the user's model on the user's input and counts memory in bytes of live tensor storage (see
``vision_ckpt._memory``), so the figures on CPU are the same on every run. On CUDA the CUDA
allocator's peak is reported beside them.

NOTE [ Measuring without the memory of the largest level ]

A budget question ("will batch 64 fit in 8 GiB?") must not be answered by running batch 64
at level 0 on a machine where it does not fit. Memory of a training step is, to a very good
approximation, affine in the batch size: parameters, gradients and optimizer state are fixed,
activations grow linearly. So :func:`suggest_level` and :func:`plan_for_budget` measure two small
batches per level and extrapolate; only a configuration predicted to fit is ever run at the
target batch. :func:`profile` runs the levels from the cheapest in memory (the highest level) to
the most expensive, and with ``memory_limit`` stops before a level whose extrapolated peak would
exceed it, reporting that instead of running it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from ._memory import count_saved_bytes, track_peak_memory
from .apply import _installed, _reinstall, apply as _apply_config, plan as _plan
from .config import CheckpointConfig, LevelRule, parse_memory_budget
from .errors import ConfigError, VisionCkptError
from .levels import Level, parse_level
from .matching import exact_name_pattern
from .wrapper import training_level

__all__ = [
    "LevelProfile",
    "ProfileResult",
    "Suggestion",
    "BudgetPlan",
    "profile",
    "suggest_level",
    "plan_for_budget",
]

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """Mean of squares over every floating-point tensor of the output: a real scalar loss that
    reaches every output element, so backward is the full backward of the model."""
    tensors = [
        t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not tensors:
        raise VisionCkptError(
            "the model returned no floating-point tensor to build a loss from; pass loss_fn=..."
        )
    return sum(t.float().square().mean() for t in tensors)  # type: ignore[return-value]


@dataclass
class LevelProfile:
    """What one training level costs in a training step."""

    level: int
    """The training level measured."""
    regions: int
    """Modules checkpointed at this level (as the plan reports them)."""
    peak_bytes: int | None = None
    """Peak of live tensor bytes during the step: parameters, gradients, optimizer state and
    activations (deterministic byte count)."""
    activation_bytes: int | None = None
    """Peak minus the bytes live before the forward."""
    saved_bytes: int | None = None
    """Activation bytes autograd kept from forward to backward (each storage once; parameters
    and buffers, which layers also save, are not counted)."""
    backward_flops: int | None = None
    """FLOPs of the backward pass, recomputation included."""
    step_time_s: float | None = None
    """Median wall time of a step over the timed repetitions."""
    time_ratio: float | None = None
    """``step_time_s`` over level 0's (or the lowest level measured)."""
    saving: float | None = None
    """``1 - peak / peak at level 0``: the share of level 0's step peak this level saves."""
    cuda_peak_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` over the step, on CUDA."""
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

    def level(self, value: int) -> LevelProfile:
        for entry in self.levels:
            if entry.level == value:
                return entry
        raise KeyError(value)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the CLI's ``--json`` format)."""
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        return data


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
    predicted_peak: dict[int, int]
    """Predicted step peak at ``batch_size`` per level."""
    measured: dict[int, list[tuple[int, int]]]
    """Per level, the (batch size, measured peak) points the prediction extrapolates from."""
    smallest_peak: int
    """The smallest predicted peak over the levels tried."""

    @property
    def fits(self) -> bool:
        return self.level is not None

    def explain(self) -> str:
        from ._memory import format_bytes

        if self.level is None:
            best = min(self.predicted_peak, key=self.predicted_peak.__getitem__)
            return (
                f"no level fits {format_bytes(self.budget_bytes)} at batch {self.batch_size} "
                f"(margin {self.margin:.0%}): the smallest predicted peak is "
                f"{format_bytes(self.smallest_peak)} at level {best}. Lower the batch size or "
                "raise the budget."
            )
        peak = self.predicted_peak[self.level]
        return (
            f"level {self.level} fits: predicted peak {format_bytes(peak)}"
            f" at batch {self.batch_size}, budget {format_bytes(self.budget_bytes)} "
            f"(margin {self.margin:.0%})"
        )


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


# --------------------------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------------------------


def _batch_of(example: torch.Tensor, batch: int) -> torch.Tensor:
    """``example`` resized along dim 0 to ``batch`` rows (sliced, or tiled when larger)."""
    have = example.shape[0]
    if batch == have:
        return example
    if batch < have:
        return example[:batch]
    reps = math.ceil(batch / have)
    return example.repeat(reps, *([1] * (example.dim() - 1)))[:batch]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(
    model: torch.nn.Module,
    x: torch.Tensor,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x))
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


def _measure_memory(
    model: torch.nn.Module,
    x: torch.Tensor,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    timeline: list[int] | None = None,
) -> tuple[int, int, int, int | None]:
    """(peak, activation, saved, cuda peak) bytes of one training step; with ``timeline``, the
    live bytes after every operation are appended to it."""
    model.zero_grad(set_to_none=True)
    roots: list[Any] = [model, x]
    if optimizer is not None:
        roots.append(optimizer)
    count_device = device if device.type != "cpu" else "cpu"
    with track_peak_memory(*roots, device=count_device, timeline=timeline is not None) as mem:
        with count_saved_bytes(model) as saved:
            out = model(x)
        loss = loss_fn(out)
        del out
        loss.backward()
        del loss
        if optimizer is not None:
            optimizer.step()
    if timeline is not None:
        timeline.extend(mem.timeline or ())
    return mem.peak_bytes, mem.activation_bytes, saved.nbytes, mem.cuda_peak_bytes


def _measure_flops(model: torch.nn.Module, x: torch.Tensor, loss_fn: LossFn) -> int:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x))
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return int(counter.get_total_flops())


def _measure_time(
    model: torch.nn.Module,
    x: torch.Tensor,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    steps: int,
) -> float:
    _step(model, x, loss_fn, optimizer)  # warm-up
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        _step(model, x, loss_fn, optimizer)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------
# Applying a config for measurement
# --------------------------------------------------------------------------------------------


def _following_global(config: CheckpointConfig | None) -> CheckpointConfig:
    """The config to apply for profiling: the user's (or the model's preset) with the training
    level left to the global level, so each level can be selected without re-applying."""
    if config is None:
        return CheckpointConfig(preset="auto")
    return config.model_copy(update={"training_checkpoint_level": None, "memory_budget": None})


@contextlib.contextmanager
def _applied(model: torch.nn.Module, config: CheckpointConfig) -> Iterator[Any]:
    """Apply ``config`` for the duration of the block, then put back whatever checkpointing the
    user had applied before (or none)."""
    before = _installed(model)
    plan = _apply_config(model, config)
    try:
        yield plan
    finally:
        _reinstall(model, before)


@contextlib.contextmanager
def _model_restored(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> Iterator[None]:
    """Measuring runs real training steps: put back the weights, buffers (BatchNorm statistics),
    optimizer state, gradients and training mode the model had before."""
    state = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    grads = {p: p.grad for p in model.parameters()}
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.load_state_dict(state)
        if optimizer is not None:
            optimizer.load_state_dict(opt_state)
        for p, g in grads.items():
            p.grad = g
        model.train(was_training)


def _regions_at(plan: Any, level: int) -> int:
    return len(plan.at_level(level).checkpointed)


def _check_levels(levels: Iterable[int]) -> list[int]:
    parsed = sorted({int(parse_level(v, what="profiled level")) for v in levels})
    if not parsed:
        raise ConfigError("no level to profile: pass at least one level 0-5, e.g. levels=range(6)")
    return parsed


def _affine(points: Sequence[tuple[int, int]], batch: int) -> int:
    """Extrapolate peak(batch) along the line through the last two (batch, peak) points."""
    (b1, p1), (b2, p2) = points[-2], points[-1]
    slope = (p2 - p1) / (b2 - b1)
    return int(round(p2 + slope * (batch - b2)))


# NOTE [ Predicting the peak of a larger batch ]
#
# A training step runs the same operators in the same order whatever the batch size, and the
# bytes live after each operator are, to a very good approximation, affine in the batch
# (weights, gradients and optimizer state fixed; activations per sample). The *peak* is the
# largest of these affine functions, so it is convex in the batch: a line through the peaks of
# two small batches underestimates a larger one whenever the moment of the peak moves (at small
# batches the end of backward, with every gradient allocated, can be the peak; at large ones the
# start of backward, with every activation alive). So the prediction fits a line per operator
# through two measured timelines and takes the largest value at the target batch. If the two
# runs did not execute the same number of operators, it falls back to the line through peaks.


def _predict_from_timelines(
    lines: Sequence[tuple[int, list[int]]], points: Sequence[tuple[int, int]], batch: int
) -> int:
    (b1, t1), (b2, t2) = lines[-2], lines[-1]
    if not t1 or len(t1) != len(t2):
        return _affine(points, batch)
    scale = (batch - b2) / (b2 - b1)
    return int(round(max(y2 + (y2 - y1) * scale for y1, y2 in zip(t1, t2, strict=True))))


def _small_batches(target: int) -> tuple[int, int]:
    # Never batch 1: BatchNorm refuses a single value per channel (e.g. after global pooling).
    b1 = max(2, target // 8)
    return b1, max(b1 + 1, target // 4)


def _extrapolated_peak(
    measure: Callable[[int, list[int]], int], target: int, limit: int | None = None
) -> tuple[int, list[tuple[int, int]]]:
    """Step peak at ``target`` from small batches: ``target/8`` and ``target/4``, then
    ``target/2`` only if the first two predict that it stays under ``limit``. See NOTE
    [ Predicting the peak of a larger batch ].

    ``measure(batch, timeline)`` runs one step at that batch, appends the live bytes after each
    operator to ``timeline`` and returns the peak. Batches at or above ``target`` are never run
    unless ``target`` itself is tiny (<= 4), when it is simply measured.
    """
    if target <= 4:
        peak = measure(target, [])
        return peak, [(target, peak)]
    lines: list[tuple[int, list[int]]] = []
    points: list[tuple[int, int]] = []
    for batch in _small_batches(target):
        timeline: list[int] = []
        points.append((batch, measure(batch, timeline)))
        lines.append((batch, timeline))
    b3 = target // 2
    if b3 > points[-1][0] and (
        limit is None or _predict_from_timelines(lines, points, b3) <= limit
    ):
        timeline = []
        points.append((b3, measure(b3, timeline)))
        lines.append((b3, timeline))
    return _predict_from_timelines(lines, points, target), points


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


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
    >>> result = vision_ckpt.profile(model, torch.randn(2, 3, 32, 32), levels=[0, 5], steps=1)
    >>> r0, r5 = result.level(0), result.level(5)
    >>> r5.saved_bytes < r0.saved_bytes
    True
    """
    chosen = _check_levels(levels)
    if steps < 1:
        raise ConfigError(f"steps={steps} is not valid; at least one timed step is needed")
    limit = parse_memory_budget(memory_limit) if memory_limit is not None else None
    loss_fn = loss_fn or default_loss
    device = example_input.device
    result = ProfileResult(
        model=model_name or type(model).__name__,
        batch_size=int(example_input.shape[0]),
        input_shape=tuple(example_input.shape),
        device=str(device),
        steps=steps,
    )
    by_level: dict[int, LevelProfile] = {}
    with _model_restored(model, optimizer), _applied(model, _following_global(config)) as plan:
        if optimizer is not None:
            # One step first, so that every level is measured with the optimizer state present
            # (not only the first level measured, which would otherwise create it).
            with training_level(max(chosen)):
                _step(model, _batch_of(example_input, 2), loss_fn, optimizer)
        over_limit_from: int | None = None
        for level in sorted(chosen, reverse=True):  # cheapest in memory first
            entry = LevelProfile(level=level, regions=_regions_at(plan, level))
            by_level[level] = entry
            with training_level(level):
                predicted = None
                if over_limit_from is None and limit is not None:
                    predicted = _predict_peak(
                        model, example_input, loss_fn, optimizer, device, limit
                    )
                if over_limit_from is not None:
                    entry.skipped = (
                        f"not run: level {over_limit_from} already exceeded memory_limit"
                    )
                elif predicted is not None and predicted > limit:  # type: ignore[operator]
                    entry.skipped = (
                        f"not run: predicted peak {predicted} bytes exceeds memory_limit "
                        f"{limit} bytes"
                    )
                    over_limit_from = level
                else:
                    _profile_level(
                        entry, model, example_input, loss_fn, optimizer, device, steps, flops
                    )
            if on_level is not None:
                on_level(entry)
    result.levels = [by_level[level] for level in chosen]
    _fill_ratios(result)
    return result


def _profile_level(
    entry: LevelProfile,
    model: torch.nn.Module,
    x: torch.Tensor,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    steps: int,
    flops: bool,
) -> None:
    peak, activation, saved, cuda_peak = _measure_memory(model, x, loss_fn, optimizer, device)
    entry.peak_bytes, entry.activation_bytes, entry.saved_bytes = peak, activation, saved
    entry.cuda_peak_bytes = cuda_peak
    if flops:
        entry.backward_flops = _measure_flops(model, x, loss_fn)
    entry.step_time_s = _measure_time(model, x, loss_fn, optimizer, device, steps)


def _fill_ratios(result: ProfileResult) -> None:
    measured = [e for e in result.levels if e.skipped is None]
    if not measured:
        return
    base = measured[0]
    for entry in measured:
        if base.step_time_s:
            entry.time_ratio = entry.step_time_s / base.step_time_s  # type: ignore[operator]
        if base.peak_bytes:
            entry.saving = 1.0 - entry.peak_bytes / base.peak_bytes  # type: ignore[operator]


def _peak_measurer(
    model: torch.nn.Module,
    example: torch.Tensor,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> Callable[[int, list[int]], int]:
    def measure(batch: int, timeline: list[int]) -> int:
        x = _batch_of(example, batch)
        return _measure_memory(model, x, loss_fn, optimizer, device, timeline)[0]

    return measure


def _predict_peak(
    model: torch.nn.Module,
    example: torch.Tensor,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    limit: int | None = None,
) -> int:
    """Step peak at the example's batch size, extrapolated from smaller batches, at the
    training level currently in force."""
    measure = _peak_measurer(model, example, loss_fn, optimizer, device)
    return _extrapolated_peak(measure, int(example.shape[0]), limit)[0]


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
    (see NOTE [ Measuring without the memory of the largest level ]); the target batch itself is
    never run. A level fits when ``predicted * (1 + margin) <= budget``.

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
    >>> s = vision_ckpt.suggest_level(model, torch.randn(4, 3, 32, 32), "1GiB", batch_size=8)
    >>> s.level
    0
    """
    budget_bytes = parse_memory_budget(budget)
    if not 0 <= margin < 1:
        raise ConfigError(f"margin={margin} is not valid; expected a fraction in [0, 1)")
    chosen = _check_levels(levels)
    loss_fn = loss_fn or default_loss
    device = example_input.device
    target = batch_size or int(example_input.shape[0])
    if target < 1:
        raise ConfigError(f"batch_size={batch_size} is not valid; expected a positive integer")
    predicted: dict[int, int] = {}
    measured: dict[int, list[tuple[int, int]]] = {}
    with _model_restored(model, optimizer):
        with _applied(model, _following_global(config)):
            measure = _peak_measurer(model, example_input, loss_fn, optimizer, device)
            for level in sorted(chosen, reverse=True):  # cheapest in memory first
                with training_level(level):
                    predicted[level], measured[level] = _extrapolated_peak(
                        measure, target, budget_bytes
                    )
    fitting = [lv for lv in chosen if predicted[lv] * (1 + margin) <= budget_bytes]
    return Suggestion(
        level=fitting[0] if fitting else None,
        budget_bytes=budget_bytes,
        margin=margin,
        batch_size=target,
        predicted_peak=dict(sorted(predicted.items())),
        measured=dict(sorted(measured.items())),
        smallest_peak=min(predicted.values()),
    )


# --------------------------------------------------------------------------------------------
# Per-block planning
# --------------------------------------------------------------------------------------------


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


def _block_costs(
    model: torch.nn.Module,
    x: torch.Tensor,
    loss_fn: LossFn,
    names: list[str],
) -> dict[str, tuple[int, int]]:
    """Per block: (activation bytes saved for backward inside it, forward FLOPs), from one plain
    forward."""
    modules = dict(model.named_modules())
    saved = dict.fromkeys(names, 0)
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

    # Weights are saved for backward too, but checkpointing does not free them: skip them.
    seen: set[int] = {
        t.untyped_storage().data_ptr()
        for t in (*model.parameters(), *model.buffers())
        if t.device.type != "meta"
    }

    def pack(t: torch.Tensor) -> torch.Tensor:
        if active and t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                saved[active[-1]] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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
        costs[name] = (saved[name], int(sum(per_op.values())))
    return costs


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
    loss_fn = loss_fn or default_loss
    device = example_input.device
    target = batch_size or int(example_input.shape[0])
    base = _following_global(config)
    if not 0 <= margin < 1:
        raise ConfigError(f"margin={margin} is not valid; expected a fraction in [0, 1)")
    small = _small_batches(target)
    with _model_restored(model, optimizer):
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
        with _applied(model, CheckpointConfig()):  # block costs of the plain model
            per_batch = [
                _block_costs(model, _batch_of(example_input, b), loss_fn, names) for b in small
            ]
        scale = (target - small[0]) / (small[1] - small[0])
        kept = {
            n: int(per_batch[0][n][0] + (per_batch[1][n][0] - per_batch[0][n][0]) * scale)
            for n in names
        }
        flops = {n: per_batch[1][n][1] for n in names}
        order = sorted(names, key=lambda n: kept[n] / max(flops[n], 1), reverse=True)

        step_peak = _peak_measurer(model, example_input, loss_fn, optimizer, device)

        def measure(chosen: list[str]) -> int:
            cfg = _config_for(base, chosen, all_entries, levels)
            with _applied(model, cfg):
                with training_level(_training_level_for(chosen, levels)):
                    return _extrapolated_peak(step_peak, target, budget_bytes)[0]

        with training_level(0):
            with _applied(model, base):
                peak0 = _extrapolated_peak(step_peak, target, budget_bytes)[0]
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
