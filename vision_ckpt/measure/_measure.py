"""Measuring one training step: memory in bytes, backward FLOPs and wall time.

A :class:`Workload` carries what every measurement runs (the model, an example batch, the loss
and the optimizer); the functions here run one step of it on a batch cut from the example and
report what it cost. Setting a model up for measurement lives here too: applying a config for
the duration of a measurement (:func:`applied`) and putting the model back as it was
(:func:`model_restored`). ``vision_ckpt.tune.profile`` builds the level search and the block
planner on these.

Which figure decides a budget depends on the device, and is chosen in one place,
:func:`meter_for`; see NOTE [ Two meters ].
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from torch.utils.flop_counter import FlopCounterMode

from .._compat import tree_leaves
from ..config.schema import CheckpointConfig
from ..errors import VisionCkptError
from ..regions._install import installed, reinstall
from ..regions.apply import ConfigLike, apply as _apply_config, as_config
from ._fake import FAKE_FROM, faked, value_dependent
from ._memory import count_saved_bytes, format_bytes, track_peak_memory
from ._record import Measurement

__all__ = [
    "LossFn",
    "default_loss",
    "Workload",
    "batch_of",
    "run_step",
    "StepMemory",
    "FitCheck",
    "Meter",
    "meter_for",
    "on_fakes",
    "FakeMeter",
    "tracked_step",
    "step_memory",
    "measure_memory",
    "confirm_fits",
    "measure_flops",
    "measure_time",
    "step_time",
    "following_global",
    "applied",
    "Snapshot",
    "model_restored",
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


@dataclass(frozen=True)
class Workload:
    """What a measured training step runs: ``loss_fn(model(x)).backward()``, then
    ``optimizer.step()`` if there is one, on a batch ``x`` cut from ``example``."""

    model: torch.nn.Module
    example: torch.Tensor
    """An input batch (dim 0 is the batch); measured batches are sliced or tiled from it."""
    loss_fn: LossFn = default_loss
    optimizer: torch.optim.Optimizer | None = None

    @property
    def device(self) -> torch.device:
        """The example's device, where the step runs."""
        return self.example.device

    @property
    def batch_size(self) -> int:
        return int(self.example.shape[0])

    def batch(self, size: int) -> torch.Tensor:
        """The example resized to ``size`` rows (see :func:`batch_of`)."""
        return batch_of(self.example, size)


def batch_of(example: torch.Tensor, batch: int) -> torch.Tensor:
    """``example`` resized along dim 0 to ``batch`` rows (cut, or tiled when larger).

    A smaller batch is a copy, not a view: the byte meters count a tensor by its storage, and a
    view would carry the whole example's bytes into every small batch, so the per-sample slope
    the extrapolation reads would leave out the input.

    >>> x = torch.zeros(8, 3)
    >>> batch_of(x, 2).untyped_storage().nbytes(), batch_of(x, 16).shape
    (24, torch.Size([16, 3]))
    """
    have = example.shape[0]
    if batch == have:
        return example
    if batch < have:
        return example[:batch].clone()
    reps = math.ceil(batch / have)
    return example.repeat(reps, *([1] * (example.dim() - 1)))[:batch]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(work: Workload, x: torch.Tensor) -> torch.Tensor:
    """One training step on ``x``; returns the detached loss."""
    work.model.zero_grad(set_to_none=True)
    loss = work.loss_fn(work.model(x))
    loss.backward()
    if work.optimizer is not None:
        work.optimizer.step()
    return loss.detach()


class StepMemory(NamedTuple):
    """The memory of one training step, as :func:`measure_memory` reports it."""

    peak: int
    """Peak of live tensor-storage bytes (the byte tracker: deterministic)."""
    activation: int
    """``peak`` minus the bytes live before the step."""
    saved: int
    """Bytes autograd kept from forward to backward (see ``count_saved_bytes``)."""
    allocated: int | None = None
    """On CUDA: ``torch.cuda.max_memory_allocated`` of a warmed-up step; else ``None``."""
    reserved: int | None = None
    """On CUDA: ``torch.cuda.max_memory_reserved`` of the same step; else ``None``."""

    @property
    def deciding(self) -> int:
        """The figure a budget is decided on: the allocator's on CUDA, else the tracker's
        (NOTE [ Two meters ])."""
        return self.peak if self.allocated is None else self.allocated

    def measurement(self, batch: int, seconds: float | None = None) -> Measurement:
        """The deciding figure as the :class:`Measurement` of this step, run at ``batch``
        (and timed at ``seconds``).

        >>> StepMemory(100, 60, 40).measurement(2)
        Measurement(peak=100, batch=2, meter='bytes', seconds=None, predicted=False)
        """
        meter = "bytes" if self.allocated is None else "cuda allocator"
        return Measurement(peak=self.deciding, batch=batch, meter=meter, seconds=seconds)


@dataclass(frozen=True)
class FitCheck:
    """A real training step at the target batch, run to confirm a plan predicted to fit."""

    batch_size: int
    """The batch the step ran (the target batch of the plan)."""
    budget_bytes: int
    """The budget it is checked against."""
    measurement: Measurement | None
    """The step's allocated peak (``torch.cuda.max_memory_allocated``, meter ``cuda
    allocator``) at ``batch_size``; ``None`` when it ran out of memory."""
    reserved_bytes: int | None
    """``torch.cuda.max_memory_reserved`` of the step (reported; the budget is decided on
    the measurement's peak); ``None`` when it ran out of memory."""

    @property
    def out_of_memory(self) -> bool:
        return self.measurement is None

    @property
    def fits(self) -> bool:
        """Whether the step ran and its allocated peak is within the budget."""
        return self.measurement is not None and self.measurement.peak <= self.budget_bytes

    def explain(self) -> str:
        """One line: what the real step at the target batch took.

        >>> step = Measurement(peak=3 * 2**28, batch=64, meter="cuda allocator")
        >>> FitCheck(64, 2**30, step, 2**30 + 2**20).explain()
        'real step at batch 64: allocated 768.00 MiB, reserved 1.00 GiB of 1.00 GiB budget: fits'
        """
        if self.measurement is None:
            return (
                f"real step at batch {self.batch_size}: out of memory "
                f"(budget {format_bytes(self.budget_bytes)})"
            )
        return (
            f"real step at batch {self.batch_size}: allocated "
            f"{format_bytes(self.measurement.peak)}, reserved "
            f"{format_bytes(self.reserved_bytes or 0)} of {format_bytes(self.budget_bytes)} "
            f"budget: {'fits' if self.fits else 'does not fit'}"
        )


# NOTE [ Two meters ]
#
# A budget is a number of bytes the user's device must hold during a step. Off CUDA, the
# deciding figure is the byte tracker's peak
# (``vision_ckpt.measure._memory.track_peak_memory``): live tensor storage, the same on every run.
# On CUDA what runs out is the caching allocator, whose ``max_memory_allocated`` also holds what the
# tracker cannot see: cuDNN and cuBLAS workspaces, each block rounded up, scratch tensors freed
# inside an operator, and every tensor on the device that no root handed to the tracker. So on CUDA:
#
# 1. The deciding figure is ``max_memory_allocated`` of a real step, warmed up: the same batch
#    has run once just before (cuDNN's autotuning, cuBLAS's workspace and the optimizer state
#    exist), the device is synchronised, the peak statistics are reset, the step runs and the
#    device is synchronised again. ``max_memory_reserved`` is read beside it and reported; it is
#    not decided on (what the allocator keeps cached is its own choice, freed on demand).
# 2. Predictions draw a line per operator through the timelines of two measured batches (NOTE
#    [ Predicting the peak of a larger batch ] in ``_extrapolate``). On CUDA an operator's entry
#    is the allocator's peak while it ran (read and reset after each operator of the measured
#    step), so a workspace or scratch tensor that grows with the batch gets its own line where
#    it happens. Moving the tracker's timeline up by one constant, the allocator's excess at the
#    measured batch, missed such growth wherever it decides the peak: at ViT-S/16's level 5
#    the allocator's excess over the live tensors at the peak grew from 80 MB (batches 2-16) to
#    112 MB (batch 32), and the peak was predicted at 0.94x on an H100. The readings are
#    taken in the warm-up step and moved by a constant so that their largest is the warmed-up
#    step's peak.
# 3. That line is a model, not a measurement. A plan predicted to fit is confirmed by a real step
#    at the target batch (:func:`confirm_fits`); one whose step allocates more than the budget,
#    or runs out of memory, is reported as not fitting.
# 4. Measuring does not itself hold device memory: ``model_restored`` keeps its copy of the
#    weights and optimizer state on the host.
#
# :func:`meter_for` is the only place that chooses between the two.


class Meter(Protocol):
    """How a device's memory is measured for budgets (NOTE [ Two meters ])."""

    name: str

    def read(self, work: Workload, x: torch.Tensor, timeline: list[int] | None) -> StepMemory:
        """One training step of ``work`` on ``x``; with ``timeline``, the live bytes after
        every operation (in the meter's terms) are appended to it."""
        ...

    def confirm(self, work: Workload, batch: int, budget: int) -> FitCheck | None:
        """A real step at ``batch`` against ``budget``, or ``None`` when the meter's prediction
        is the measurement itself."""
        ...


def tracked_step(
    work: Workload,
    x: torch.Tensor,
    timeline: list[int] | None,
    probe: Callable[[], int] | None = None,
) -> StepMemory:
    """One step under the byte tracker and the saved-bytes counter; the timeline holds what
    ``probe`` reads after each operation (default: the tracker's live bytes)."""
    model, optimizer = work.model, work.optimizer
    model.zero_grad(set_to_none=True)
    roots: list[Any] = [model, x]
    if optimizer is not None:
        roots.append(optimizer)
    recording = timeline is not None
    with track_peak_memory(*roots, device=x.device, timeline=recording, probe=probe) as mem:
        with count_saved_bytes(model) as saved:
            out = model(x)
        loss = work.loss_fn(out)
        del out
        loss.backward()
        del loss
        if optimizer is not None:
            optimizer.step()
    if timeline is not None:
        timeline.extend(mem.timeline or ())
    return StepMemory(mem.peak_bytes, mem.activation_bytes, saved.nbytes)


class _ByteMeter:
    """The byte tracker: deterministic, and what decides off CUDA."""

    name = "bytes"

    def read(self, work: Workload, x: torch.Tensor, timeline: list[int] | None) -> StepMemory:
        return tracked_step(work, x, timeline)

    def confirm(self, work: Workload, batch: int, budget: int) -> FitCheck | None:
        return None  # the prediction extrapolates this very count


class _AllocatorMeter:
    """The CUDA caching allocator's peak of real, warmed-up steps."""

    name = "cuda allocator"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _allocator_step(self, work: Workload, x: torch.Tensor) -> tuple[int, int]:
        """(allocated, reserved) peaks of one plain step on ``x``; the caller warms up."""
        work.model.zero_grad(set_to_none=True)  # freed before the reset: not this step's
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        run_step(work, x)
        torch.cuda.synchronize(self.device)
        return (
            int(torch.cuda.max_memory_allocated(self.device)),
            int(torch.cuda.max_memory_reserved(self.device)),
        )

    def _peak_since_last_read(self) -> int:
        """The allocator's peak since the previous call (the peak statistic is reset)."""
        peak = int(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def read(self, work: Workload, x: torch.Tensor, timeline: list[int] | None) -> StepMemory:
        start = len(timeline) if timeline is not None else 0
        # The tracked step runs this batch first: it is also the allocator step's warm-up.
        if timeline is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        tracked = tracked_step(work, x, timeline, self._peak_since_last_read)
        allocated, reserved = self._allocator_step(work, x)
        if timeline is not None and len(timeline) > start:
            # the warmed-up step's peak decides; the warm-up's per-operator readings are moved
            # to it (they differ where the warm-up created a workspace that then stays)
            excess = allocated - max(timeline[start:])
            timeline[start:] = [v + excess for v in timeline[start:]]
        return tracked._replace(allocated=allocated, reserved=reserved)

    def confirm(self, work: Workload, batch: int, budget: int) -> FitCheck | None:
        x = work.batch(batch)
        try:
            run_step(work, x)  # warm-up at the target batch
            allocated, reserved = self._allocator_step(work, x)
        except torch.OutOfMemoryError:
            out_of_memory = True
        else:
            out_of_memory = False
        if out_of_memory:  # outside the handler: its traceback no longer holds the step's tensors
            work.model.zero_grad(set_to_none=True)
            del x
            torch.cuda.empty_cache()
            return FitCheck(batch, budget, None, None)
        step = Measurement(peak=allocated, batch=batch, meter=self.name)
        return FitCheck(batch, budget, step, reserved)


_T = TypeVar("_T")


def on_fakes(
    fn: Callable[[Workload, torch.Tensor], _T],
    work: Workload,
    x: torch.Tensor,
    smallest: int = FAKE_FROM,
) -> tuple[_T, str | None]:
    """``fn(work, x)`` with the model, optimizer and batch on fake tensors (NOTE [ Counting a
    step without kernels ] in ``_fake``), and why it ran on real ones instead, or ``None``: a
    batch of fewer than ``smallest`` elements runs real (quicker, the same figures), and so does
    a step that depends on values (fake tensors refuse it, and it is run again for real).

    >>> net = torch.nn.Linear(4, 2)
    >>> on_fakes(lambda w, x: type(w.model(x)).__name__, Workload(net, torch.zeros(3, 4)),
    ...          torch.zeros(3, 4), smallest=0)
    ('FakeTensor', None)
    """
    if x.numel() < smallest:
        return fn(work, x), f"{x.numel()} input elements: a real step is quicker"
    try:
        with faked(work.model, x, work.optimizer) as (fake_x, optimizer):
            on = dataclasses.replace(work, example=fake_x, optimizer=optimizer)
            return fn(on, fake_x), None
    except Exception as error:
        if not value_dependent(error):
            raise
        why = f"the step depends on values ({type(error).__name__}): counted on a real step"
    return fn(work, x), why


class FakeMeter(_ByteMeter):
    """The byte tracker's count of a step run on fake tensors (NOTE [ Counting a step without
    kernels ] in ``_fake``): the real step's figure, without running a kernel.

    >>> meter = FakeMeter(smallest=0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    >>> step = meter.read(Workload(net, torch.zeros(8, 64)), torch.zeros(8, 64), None)
    >>> step.peak > 0, meter.fallback
    (True, None)
    """

    def __init__(self, smallest: int = FAKE_FROM) -> None:
        self.smallest = smallest
        """The fewest batch elements counted on fakes; a smaller batch runs for real (NOTE
        [ Counting a step without kernels ]: the same figure, sooner)."""
        self.fallback: str | None = None
        """Why the last step ran on real tensors instead (``None``: it ran on fakes)."""

    def read(self, work: Workload, x: torch.Tensor, timeline: list[int] | None) -> StepMemory:
        start = len(timeline) if timeline is not None else 0

        def step(on: Workload, batch: torch.Tensor) -> StepMemory:
            if timeline is not None:
                del timeline[start:]  # a real step after a refused fake one starts afresh
            return tracked_step(on, batch, timeline)

        out, self.fallback = on_fakes(step, work, x, self.smallest)
        return out


def _uses_allocator(device: torch.device) -> bool:
    """Whether budgets on ``device`` are decided by the CUDA allocator."""
    return device.type == "cuda"


def meter_for(device: torch.device | str, *, fake: bool = True) -> Meter:
    """The meter that decides budgets on ``device``: the CUDA allocator on a CUDA device, the
    byte tracker everywhere else (NOTE [ Two meters ]), which counts a step on fake tensors
    unless ``fake=False`` (NOTE [ Counting a step without kernels ] in ``_fake``).

    >>> meter_for("cpu").name, type(meter_for("cpu")).__name__
    ('bytes', 'FakeMeter')
    """
    dev = torch.device(device)
    if _uses_allocator(dev):
        return _AllocatorMeter(dev)
    return FakeMeter() if fake else _ByteMeter()


def measure_memory(
    work: Workload, x: torch.Tensor, timeline: list[int] | None = None
) -> StepMemory:
    """The memory of a training step on ``x``, by the meter of ``work``'s device: the byte
    tracker's peak, activation and saved bytes, and on CUDA the allocator's peaks of a warmed-up
    step (NOTE [ Two meters ]). With ``timeline``, the live bytes after every operation are
    appended to it, in the deciding meter's terms."""
    return meter_for(work.device).read(work, x, timeline)


def confirm_fits(work: Workload, budget: int, batch: int | None = None) -> FitCheck | None:
    """Run one real training step at ``batch`` (default: the example's) and check it against
    ``budget``, where the device's meter needs it (on CUDA: NOTE [ Two meters ], point 3);
    ``None`` elsewhere, where the prediction extrapolates the deterministic byte count.

    Call it only for a plan predicted to fit: it runs the target batch. It runs at the
    training level and with the checkpointing in force.

    >>> import torch
    >>> work = Workload(torch.nn.Linear(4, 4), torch.randn(2, 4))
    >>> confirm_fits(work, 2**20) is None  # on CPU the byte count is the measurement
    True
    """
    return meter_for(work.device).confirm(work, batch or work.batch_size, budget)


def measure_flops(work: Workload, x: torch.Tensor) -> int:
    """FLOPs of the backward of one step on ``x`` (recomputation included), counted from
    shapes on fake tensors where that is quicker (:func:`on_fakes`)."""
    return on_fakes(_backward_flops, work, x)[0]


def _backward_flops(work: Workload, x: torch.Tensor) -> int:
    work.model.zero_grad(set_to_none=True)
    loss = work.loss_fn(work.model(x))
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return int(counter.get_total_flops())


def step_time(work: Workload, x: torch.Tensor) -> float:
    """Wall time of one training step on ``x`` (the device synchronised around it)."""
    _sync(work.device)
    start = time.perf_counter()
    run_step(work, x)
    _sync(work.device)
    return time.perf_counter() - start


def measure_time(work: Workload, x: torch.Tensor, steps: int) -> float:
    """Median wall time of ``steps`` training steps on ``x``, after one warm-up step."""
    run_step(work, x)  # warm-up
    return statistics.median(step_time(work, x) for _ in range(steps))


# --------------------------------------------------------------------------------------------
# Setting the model up for a measurement
# --------------------------------------------------------------------------------------------


def following_global(config: ConfigLike | None) -> CheckpointConfig:
    """The config to apply for profiling: the user's (a config, a dict of its keys or a file;
    default: the model's preset) with the training level left to the global level, so each
    level can be selected without re-applying."""
    if config is None:
        return CheckpointConfig(preset="auto")
    return as_config(config).model_copy(
        update={"training_checkpoint_level": None, "memory_budget": None}
    )


@contextlib.contextmanager
def applied(model: torch.nn.Module, config: CheckpointConfig) -> Iterator[Any]:
    """Apply ``config`` for the duration of the block (yielding its plan), then put back
    whatever checkpointing the user had applied before (or none)."""
    before = installed(model)
    plan = _apply_config(model, config)
    try:
        yield plan
    finally:
        reinstall(model, before)


def _host_copy(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor copied to host memory."""
    tensors = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
    memo: dict[int, Any] = {id(t): t.detach().to("cpu", copy=True) for t in tensors}
    return copy.deepcopy(obj, memo)


@dataclass
class Snapshot:
    """What :func:`model_restored` puts back: weights and buffers, optimizer state (copied to
    the host, NOTE [ Two meters ] point 4), gradients (by reference) and training mode."""

    state: dict[str, Any]
    optimizer_state: dict[str, Any] | None
    grads: dict[torch.nn.Parameter, torch.Tensor | None]
    training: bool

    @classmethod
    def take(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Snapshot:
        return cls(
            state=_host_copy(model.state_dict()),
            optimizer_state=_host_copy(optimizer.state_dict()) if optimizer is not None else None,
            grads={p: p.grad for p in model.parameters()},
            training=model.training,
        )

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        # load_state_dict copies into the existing tensors (and the optimizer casts its state to
        # each parameter's device), so parameters keep their identity and device.
        model.load_state_dict(self.state)
        if optimizer is not None:
            optimizer.load_state_dict(self.optimizer_state)  # type: ignore[arg-type]
        for p, g in self.grads.items():
            p.grad = g
        model.train(self.training)


@contextlib.contextmanager
def model_restored(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> Iterator[None]:
    """Measuring runs real training steps: put back the weights, buffers (BatchNorm statistics),
    optimizer state, gradients and training mode the model had before. The copy is kept on
    the host, so that it is no part of a device peak measured meanwhile."""
    snapshot = Snapshot.take(model, optimizer)
    model.train()
    try:
        yield
    finally:
        snapshot.restore(model, optimizer)


def step_memory(
    model: torch.nn.Module,
    x: torch.Tensor,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    fake: bool = True,
) -> StepMemory:
    """The bytes of one training step of ``model`` on ``x`` with the checkpointing in force:
    forward, loss, backward (recomputation included) and ``optimizer.step()`` if given.

    With ``fake`` (the default) no kernel runs: the step runs on fake tensors and gives the byte
    tracker's figure of the real step (NOTE [ Counting a step without kernels ] in ``_fake``);
    ``fake=False`` runs it. Either way the model's weights, buffers, gradients and training
    mode are left as they were. Off CUDA, ``peak`` is what a budget is decided on; on CUDA the
    allocator holds more than the tensors (NOTE [ Two meters ]).

    Args:
        model: the model (its checkpointing, if applied, runs).
        x: a batch, on the model's device.
        loss_fn: the loss on the output (default: fitted to the output, as the CLI's).
        optimizer: stepped too when given (its state counts).
        fake: count without running kernels.

    Returns:
        The step's peak, activation and saved bytes.

    >>> import timm
    >>> net = timm.create_model("resnet18", pretrained=False, num_classes=10)
    >>> x = torch.randn(4, 3, 64, 64)
    >>> step_memory(net, x) == step_memory(net, x, fake=False)
    True
    """
    from .models import output_loss

    work = Workload(model, x, loss_fn or output_loss, optimizer)
    with model_restored(model, optimizer):  # a step that depends on values runs for real
        return FakeMeter(smallest=0).read(work, x, None) if fake else tracked_step(work, x, None)
