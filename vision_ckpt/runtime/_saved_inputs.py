"""How a region's tensor inputs wait for its recomputation.

Owns the ways a checkpointed region keeps its tensor inputs until backward: as SavedVariables of
the enclosing saved-tensor hooks (``save_inputs``: an enclosing region or a user's hooks see
them, NOTE [ Nested checkpoints ] in ``_frame``), saved through an autograd Function on a torch
without ``_make_saved_tensor`` (NOTE [ Inputs saved through a Function ]), or as pinned host
copies of the CUDA ones (``offload_inputs``, NOTE [ Offloaded inputs ]). Each kept input has
``unpack()``, which gives the tensor back for the recomputation.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat

__all__ = ["HostCopy", "offload_inputs", "save_inputs"]

_make_saved_tensor = _compat.make_saved_tensor


# NOTE [ Offloaded inputs ]
#
# A region with ``offload=True`` keeps its CUDA tensor inputs in pinned host memory instead of
# on the device (torch's CPU_OFFLOAD policies, Hugging Face's ``offload=True``): at the call each
# one is copied into a pinned host tensor of the same shape, strides and dtype, without waiting
# (non_blocking); the recomputation copies it back to its device, on the stream backward runs,
# which orders the copies after the forward's. The values are the forward's, bit for bit, so
# gradients stay exact. A CPU tensor (nothing to offload to), a tensor that is neither contiguous
# nor channels-last, and a tensor subclass are kept as usual; so on CPU offload does nothing.
# Unlike a SavedVariable, the host copy does not see in-place changes of the input after the
# call: the recomputation uses the values the region was called with.


class HostCopy:
    """A region input held in host memory until its recomputation (NOTE [ Offloaded inputs ])."""

    __slots__ = ("host", "device", "requires_grad")

    def __init__(self, tensor: torch.Tensor, pin: bool) -> None:
        self.device = tensor.device
        self.requires_grad = tensor.requires_grad
        host = torch.empty_strided(
            tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=pin
        )
        host.copy_(tensor.detach(), non_blocking=pin)
        self.host = host

    def unpack(self) -> torch.Tensor:
        back = self.host.to(self.device, non_blocking=True)
        return back.requires_grad_(self.requires_grad) if self.requires_grad else back


def _offloadable(t: torch.Tensor) -> bool:
    return (
        t.is_cuda
        and type(t) in (torch.Tensor, torch.nn.Parameter)
        and (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last))
    )


def offload_inputs(tensors: list[torch.Tensor]) -> list[Any]:
    """The region's inputs, those on CUDA as pinned host copies (NOTE [ Offloaded inputs ])."""
    offload = [_offloadable(t) for t in tensors]
    kept = iter(save_inputs([t for t, off in zip(tensors, offload, strict=True) if not off]))
    return [
        HostCopy(t, pin=True) if off else next(kept)
        for t, off in zip(tensors, offload, strict=True)
    ]


def save_inputs(tensors: list[torch.Tensor]) -> list[Any]:
    """The region's tensor inputs as SavedVariables of the enclosing hooks (NOTE [ Nested
    checkpoints ] in ``_frame``), through ``_make_saved_tensor`` where torch has it."""
    if _make_saved_tensor is not None:
        return [_make_saved_tensor(t, is_output=False) for t in tensors]
    return _save_with_function(tensors)


class _SaveInputs(torch.autograd.Function):  # for torch without _make_saved_tensor
    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (None,) * (1 + len(ctx.saved_tensors))


class _SavedThroughFunction:  # for torch without _make_saved_tensor
    """A region's inputs saved by one ``_SaveInputs`` node (NOTE [ Inputs saved through a
    Function ]); ``views()`` gives one handle per input, each with ``unpack()``."""

    __slots__ = ("output", "taken", "count")

    def __init__(self, output: torch.Tensor, count: int) -> None:
        self.output = output
        self.taken: list[torch.Tensor | None] | None = None
        self.count = count

    def views(self) -> list[_SavedInput]:
        return [_SavedInput(self, i) for i in range(self.count)]

    def take(self, index: int) -> torch.Tensor:
        taken = self.taken
        if taken is None or taken[index] is None:  # a new round of unpacking
            taken = self.taken = list(self.output.grad_fn.saved_tensors)
        tensor = taken[index]
        taken[index] = None
        if all(t is None for t in taken):
            self.taken = None
        assert tensor is not None
        return tensor


class _SavedInput:  # for torch without _make_saved_tensor
    __slots__ = ("group", "index")

    def __init__(self, group: _SavedThroughFunction, index: int) -> None:
        self.group = group
        self.index = index

    def unpack(self) -> torch.Tensor:
        return self.group.take(self.index)


# NOTE [ Inputs saved through a Function ]
#
# Without ``_make_saved_tensor``, a region's inputs are saved by an autograd Function's
# ``save_for_backward``, so that the enclosing hooks pack them as they would a SavedVariable.
# Two invariants make this equal to the direct path:
# * The Function's output (an empty tensor) lives as long as the handles: torch releases a
#   node's saved tensors once its outputs are gone (seen on 2.11).
# * ``grad_fn.saved_tensors`` unpacks every input at once, and an enclosing region's unpack
#   hook hands each tensor out once per backward. So one access serves all inputs of a round,
#   and the next access happens only when an input is asked for again (a later backward).


def _save_with_function(tensors: list[torch.Tensor]) -> list[Any]:
    if not tensors:
        return []
    dummy = torch.empty(0, requires_grad=True)
    return _SavedThroughFunction(_SaveInputs.apply(dummy, *tensors), len(tensors)).views()
