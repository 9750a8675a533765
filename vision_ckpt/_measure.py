"""Measuring one training step: memory in bytes, backward FLOPs and wall time.

A :class:`Workload` carries what every measurement runs (the model, an example batch, the loss
and the optimizer); the functions here run one step of it on a batch cut from the example and
report what it cost. Setting a model up for measurement lives here too: applying a config for
the duration of a measurement (:func:`applied`) and putting the model back as it was
(:func:`model_restored`). ``vision_ckpt.profile`` builds the level search and the block
planner on these.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from ._install import installed, reinstall
from ._memory import count_saved_bytes, track_peak_memory
from .apply import apply as _apply_config
from .config import CheckpointConfig
from .errors import VisionCkptError

__all__ = [
    "LossFn",
    "default_loss",
    "Workload",
    "batch_of",
    "run_step",
    "measure_memory",
    "measure_flops",
    "measure_time",
    "step_time",
    "following_global",
    "applied",
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


def run_step(work: Workload, x: torch.Tensor) -> torch.Tensor:
    """One training step on ``x``; returns the detached loss."""
    work.model.zero_grad(set_to_none=True)
    loss = work.loss_fn(work.model(x))
    loss.backward()
    if work.optimizer is not None:
        work.optimizer.step()
    return loss.detach()


def measure_memory(
    work: Workload, x: torch.Tensor, timeline: list[int] | None = None
) -> tuple[int, int, int, int | None]:
    """(peak, activation, saved, cuda peak) bytes of one training step on ``x``; with
    ``timeline``, the live bytes after every operation are appended to it."""
    model, optimizer = work.model, work.optimizer
    model.zero_grad(set_to_none=True)
    roots: list[Any] = [model, x]
    if optimizer is not None:
        roots.append(optimizer)
    device = work.device
    count_device = device if device.type != "cpu" else "cpu"
    with track_peak_memory(*roots, device=count_device, timeline=timeline is not None) as mem:
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
    return mem.peak_bytes, mem.activation_bytes, saved.nbytes, mem.cuda_peak_bytes


def measure_flops(work: Workload, x: torch.Tensor) -> int:
    """FLOPs of the backward of one step on ``x`` (recomputation included)."""
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


def following_global(config: CheckpointConfig | None) -> CheckpointConfig:
    """The config to apply for profiling: the user's (or the model's preset) with the training
    level left to the global level, so each level can be selected without re-applying."""
    if config is None:
        return CheckpointConfig(preset="auto")
    return config.model_copy(update={"training_checkpoint_level": None, "memory_budget": None})


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


@contextlib.contextmanager
def model_restored(
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
