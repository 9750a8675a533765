"""A region made of consecutive calls on one tensor (:class:`ChainRegion`).

Owns the execution of a run of sibling calls as one checkpointed region: opened on the first
call's input, each call run under the region's pack hooks, and the calls replayed in order for
backward (NOTE [ Regions of consecutive calls ]). Which calls join a run is decided by the
install layer (NOTE [ Runs of sibling calls ] in ``regions._install``); this module only runs
it, on ``_frame``'s frame.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ._call_state import (
    accelerator_type,
    capture_autocast,
    capture_settings,
    region_batchnorms,
    settle_settings,
    stash_rng,
    swap_rng,
    thread_state,
)
from ._frame import blank_frame, check_inputs_unwritten
from ._saved_inputs import save_inputs

__all__ = ["ChainRegion"]

_push_hooks = _compat.push_saved_tensors_hooks
_pop_hooks = _compat.pop_saved_tensors_hooks
_user_saved_tensors_hooks = _compat.user_saved_tensors_hooks
_top_pack_hook = _compat.top_pack_hook


# NOTE [ Regions of consecutive calls ]
#
# Some models call a run of sibling modules one after another on one tensor from their own
# forward (ResNet's stem: ``conv1``, ``bn1``, ``act1``, ``maxpool``), so no single call covers
# the run. A ``ChainRegion`` is one region built from such calls: it is opened on the first
# call's input, ``run`` executes each call with the region's pack hooks pushed, and between
# calls the hooks are popped, so whatever the caller does between them is saved as usual.
# The recomputation replays the calls made so far, in order, on the saved input.
#
# Invariants (the caller, the install layer, checks the first two before every ``run``):
#   1. each call after the first receives the previous call's output, the very tensor object,
#      unmodified since (same version), and no other tensor: so replaying the calls in order
#      reproduces every tensor the region saved (further arguments after it, positional or
#      keyword, such as ``attn_mask=None`` or a rotary embedding, are bound into the call and
#      passed again by the replay, which refuses a tensor among them that changed in place);
#   2. every call runs in the context of the first (``same_context``): grad mode on, the same
#      autocast state, and the same saved-tensor hooks below the region's own, i.e. inside the
#      same enclosing region. The replay runs all calls in the first one's context; a call
#      under no_grad, or one whose tensors an enclosing region of its own would recompute,
#      would save different tensors there;
#   3. the RNG state at the start of every call is stashed and reinstalled before that call
#      is replayed, so randomness drawn between calls (outside the region) cannot shift what
#      the region draws;
#   4. the holders of the frame are exactly the tensors saved inside the calls made so far,
#      so a run that stops early (the caller broke invariant 1) stays exact: it is simply a
#      shorter region.


class _Replay:
    """The recomputation of a ChainRegion: its calls so far, with their RNG states."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[[Any], Any], Any]] = []

    def __call__(self, x: Any) -> Any:
        for index, (fn, rng) in enumerate(self.calls):
            if index and rng is not None:  # the first call's state is the frame's own
                swap_rng(rng)
            x = fn(x)
        return x


class ChainRegion:
    """One checkpointed region made of consecutive calls on one tensor (see NOTE [ Regions of
    consecutive calls ]): open it on the first call's input, ``run`` each call, and it is
    recomputed for backward by replaying them. ``modules``: the modules of the calls, whose
    BatchNorm statistics the recomputation must not update again; ``label``: the name errors
    quote.

    >>> import torch
    >>> conv, act = torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()
    >>> x = torch.randn(2, 3, 8, 8, requires_grad=True)
    >>> region = ChainRegion(x, modules=[conv, act], label="stem")
    >>> y = region.run(act, region.run(conv, x))
    >>> y.sum().backward()
    >>> x.grad.shape
    torch.Size([2, 3, 8, 8])
    """

    __slots__ = ("frame", "replay", "device_type", "preserve_rng_state", "outer")

    def __init__(
        self,
        x: torch.Tensor,
        *,
        modules: list[torch.nn.Module],
        label: str,
        preserve_rng_state: bool = True,
    ) -> None:
        self.replay = _Replay()
        frame = blank_frame(self.replay, label, check=True)
        frame.args, frame.kwargs, frame.spec, frame.tensor_pos = (None,), {}, None, [0]
        self.device_type = accelerator_type([x])
        frame.autocast = capture_autocast(self.device_type)
        self.preserve_rng_state = preserve_rng_state
        self.outer = _top_pack_hook()
        batchnorms: list[torch.nn.Module] = []
        for module in modules:
            batchnorms += region_batchnorms(module, module)
        frame.batchnorms = batchnorms
        frame.saved = save_inputs([x])
        self.frame = frame

    def same_context(self) -> str | None:
        """``None`` when a call now runs in the context of the first (invariant 2), else what
        differs."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return "grad mode is off"
        if capture_autocast(self.device_type) != self.frame.autocast:
            return "autocast differs"
        if capture_settings() != self.frame.settings:
            return (
                "the kernel settings differ (SDPA backends, determinism, matmul precision, cuDNN)"
            )
        if _top_pack_hook() is not self.outer:
            return "it runs inside another checkpointed region (or other saved-tensor hooks)"
        return None

    def run(self, fn: Callable[[Any], Any], x: torch.Tensor) -> Any:
        """Call ``fn(x)`` as the region's next call and return its output."""
        frame = self.frame
        rng = stash_rng([x]) if self.preserve_rng_state else None
        first = not self.replay.calls
        version = x._version if first else 0  # only the run's input is saved
        if first:
            frame.rng = rng
        state = thread_state
        state.region_depth += 1
        frame._user_hooks = _user_saved_tensors_hooks()
        _push_hooks(frame, frame.unpack)
        try:
            out = fn(x)
        finally:
            _pop_hooks()
            del frame._user_hooks
            state.region_depth -= 1
        if first:
            check_inputs_unwritten(frame, [x], [version])
        settle_settings(frame)  # the next member is compared with what this one left
        self.replay.calls.append((fn, rng))
        frame.forward_done = True
        return out
