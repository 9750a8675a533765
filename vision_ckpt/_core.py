"""TEMPORARY stand-in: delegates to torch until the bundled core lands (being written now)."""

from __future__ import annotations

import torch.utils.checkpoint as _tc

from .errors import CheckpointError

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "set_checkpoint_debug_enabled",
    "CheckpointError",
]


def checkpoint(function, *args, use_reentrant=None, **kwargs):
    return _tc.checkpoint(function, *args, use_reentrant=False, **kwargs)


def checkpoint_sequential(functions, segments, input, use_reentrant=None, **kwargs):
    return _tc.checkpoint_sequential(functions, segments, input, use_reentrant=False, **kwargs)


def is_recomputing() -> bool:
    return False


set_checkpoint_debug_enabled = _tc.set_checkpoint_debug_enabled
