"""Toy building blocks and a checkpoint-call spy shared by the examples and the benchmarks.

The examples' nets, the test suite's tiny models (``tests/_models.py``) and the benchmarks
build on these instead of keeping their own copies:

* :class:`DropPath`: stochastic depth per sample;
* :class:`PatchMerging`: Swin's 2x2 patch merging on ``(b, h, w, c)`` maps;
* :class:`Transition`: DenseNet's BN-ReLU-1x1 conv-pool between dense blocks;
* :func:`record_core_calls`: records every call of vision_ckpt's core checkpoint while it is
  active (what the wrappers and ``vision_ckpt.apply`` go through).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from einops import rearrange
from torch import nn

import vision_ckpt
from vision_ckpt.runtime import _core

__all__ = ["DropPath", "PatchMerging", "Transition", "record_core_calls"]


class DropPath(nn.Module):
    """Drops the whole residual branch of a sample with probability ``p`` (stochastic depth)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class PatchMerging(nn.Module):
    """2x2 neighbourhood to channels, then a linear reduction: halves h and w, doubles c."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, h, w, c)
        return self.reduction(self.norm(rearrange(x, "b (h p) (w q) c -> b h w (p q c)", p=2, q=2)))


class Transition(nn.Sequential):
    """BN, ReLU, 1x1 conv and 2x2 average pooling between dense blocks."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, cout, 1), nn.AvgPool2d(2))


@contextlib.contextmanager
def record_core_calls() -> Iterator[list[bool]]:
    """Record the calls of the core (``checkpoint``, ``checkpoint_region``) while the block runs.

    Yields a list that gets one entry per call: ``True`` when the call was made while a region
    was being recomputed for backward (a nested region met again), ``False`` for a region the
    forward started. ``calls.count(False)`` is the number of regions the forward started.
    """
    calls: list[bool] = []
    real, real_region = _core.checkpoint, _core.checkpoint_region

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(vision_ckpt.runtime.is_recomputing())
        return real(*args, **kwargs)

    def recording_region(*args: Any, **kwargs: Any) -> Any:  # the wrapper's entry point
        calls.append(vision_ckpt.runtime.is_recomputing())
        return real_region(*args, **kwargs)

    _core.checkpoint, _core.checkpoint_region = recording, recording_region
    try:
        yield calls
    finally:
        _core.checkpoint, _core.checkpoint_region = real, real_region
