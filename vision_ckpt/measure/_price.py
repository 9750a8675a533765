"""A modelled price of operators: seconds from FLOPs and bytes moved, the same on every run.

Timing each operator of a forward gives the device's own price, but on a busy machine two
timings of one model differ by more than the choices they decide: two derivations of one model
chose different levels. :func:`op_seconds` prices an operator from its argument and result
shapes alone (NOTE [ A modelled price ]); :class:`ModelledClock` adds the price of every
operator run under it, and :func:`modelled_step_seconds` prices a whole training step, its
recomputation included.

>>> a, b = torch.empty(64, 256), torch.empty(256, 256)
>>> mm = op_seconds(torch.ops.aten.mm.default, (a, b), {}, torch.empty(64, 256), "cpu")
>>> relu = op_seconds(torch.ops.aten.relu.default, (a,), {}, torch.empty(64, 256), "cpu")
>>> mm > relu > 0
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import TorchDispatchMode, tree_leaves
from ..runtime._selective import flops_per_output
from ._measure import Workload, on_fakes, run_step

__all__ = [
    "ModelledClock",
    "cheap_product_flops",
    "modelled_step_seconds",
    "moves_nothing",
    "op_flops",
    "op_seconds",
]

# NOTE [ A modelled price ]
#
# An operator's modelled seconds are max(flops / F, bytes / B): the roofline of a device that
# does F FLOPs a second and moves B bytes a second. flops counts convolutions, matrix products
# and fused attention, forward and backward (op_flops); bytes are every tensor the operator
# reads and writes (its tensor arguments and results). A view moves nothing: neither one the
# schema calls a view nor aten._unsafe_view, which returns its argument's storage without being
# a view in the schema (products on three-dimensional tokens return through it; priced as a
# copy, it would dominate token models' modelled steps for no measured time). So a norm or an
# activation costs the bytes it streams and a convolution its FLOPs, which is what decides, on
# CPUs and GPUs alike, which recomputation is cheap.
#
# Invariants: the price depends only on shapes, dtypes and the operators run, so a model is
# priced the same on every run; and only the ratio F / B changes which plan is fastest (the
# scale only makes the figures readable as seconds). The CPU rates were measured on one machine
# (benchmarks/results/price_calibration); fitted per model, the ratio varies several-fold with the
# operator mix (depthwise convolutions, batch norms), and fitted rates ordered derived plans no
# better on the clock (results: price_calibration, price_rates_b32), so one pair stays. The CUDA
# rates are a data sheet's order for FP32/TF32 work and HBM, not measured.

_RATES: dict[str, tuple[float, float]] = {
    "cpu": (1.0e11, 7.0e9),
    "cuda": (5.0e13, 2.5e12),
}
"""Device type -> (FLOPs per second, bytes per second) of the modelled price."""

# backward of fused attention: the scores are recomputed and four products run (dQ, dK, dV
# and the probabilities' gradient) against the forward's two
_ATTENTION_BACKWARD = 2.5


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """FLOPs of softmax(q kᵀ) v: two batched products, (L x E)(E x S) and (L x S)(S x Ev)."""
    batch = math.prod(q.shape[:-2])
    length, source = q.shape[-2], k.shape[-2]
    return 2 * batch * length * source * (q.shape[-1] + v.shape[-1])


def op_flops(func: Any, args: Sequence[Any], out: Any) -> int:
    """FLOPs of one call of ``func``: convolutions and matrix products (forward and backward)
    and fused attention; 0 for every other operator.

    >>> a, b, out = torch.empty(4, 96), torch.empty(96, 8), torch.empty(4, 8)
    >>> op_flops(torch.ops.aten.mm.default, (a, b), out)
    6144
    """
    packet = getattr(func, "overloadpacket", func)
    name = getattr(packet, "__name__", "")
    aten = torch.ops.aten
    if packet is aten.convolution_backward:
        # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
        # output_padding, groups, output_mask): one forward's FLOPs per gradient computed
        forward_args = (args[1], args[2], None, *args[4:10])
        per = flops_per_output(aten.convolution.default, forward_args) or 0
        computed = sum(bool(m) for m in args[10][:2])
        return per * args[0].numel() * computed
    if "scaled_dot_product" in name:
        q, k, v = args[1:4] if name.endswith("_backward") else args[:3]
        flops = _attention_flops(q, k, v)
        return int(flops * _ATTENTION_BACKWARD) if name.endswith("_backward") else flops
    per = flops_per_output(func, args)
    if per is None:
        return 0
    first = out[0] if isinstance(out, (tuple, list)) else out
    return per * first.numel() if isinstance(first, torch.Tensor) else 0


def _bytes(tensors: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def moves_nothing(func: Any) -> bool:
    """Whether ``func`` returns its argument's storage under another shape (a view, or
    ``aten._unsafe_view``) and so moves no bytes (NOTE [ A modelled price ]).

    >>> moves_nothing(torch.ops.aten._unsafe_view.default), moves_nothing(torch.ops.aten.add.Tensor)
    (True, False)
    """
    packet = getattr(func, "overloadpacket", None)
    if getattr(func, "namespace", None) == "prim":
        return True  # a query of metadata (fake tensors ask for their device through it)
    return bool(getattr(func, "is_view", False)) or packet is torch.ops.aten._unsafe_view


def op_seconds(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, device_type: str
) -> float:
    """The modelled seconds of one call of ``func`` on ``device_type`` (NOTE [ A modelled
    price ]); a view costs nothing. A device type without figures is priced as a GPU."""
    if moves_nothing(func):
        return 0.0
    flops_rate, bytes_rate = _RATES.get(device_type, _RATES["cuda"])
    moved = _bytes(tree_leaves((args, kwargs))) + _bytes(tree_leaves(out))
    return max(op_flops(func, args, out) / flops_rate, moved / bytes_rate)


# NOTE [ Products cheap to redo ]
#
# A selective region (keep: heavy) keeps every product's output and redoes the norms and
# activations between them, which cost the bytes they stream. A product with a short reduction
# (LeViT's and EfficientViT's q @ k^T over 16 channels, a 3x3 convolution of a three-channel
# image, a depthwise convolution) costs fewer seconds per output element to redo than such an
# operator does, so keeping it buys memory at a worse rate than redoing it. The break-even,
# in the price's own rates: an operator that reads one element and writes one moves 2 x the
# element size in bytes, which takes as long as 2 x size x F / B FLOPs; a product below that
# many FLOPs per output element is redone (keep: {ops: heavy, below: N}). On CPU with fp32 that
# is 114 FLOPs, a reduction of 57. Measured on LeViT-128 at batch 32, every block and the stem
# selective: 0.56x of level 0's peak keeping every product, 0.37x with products under 100
# FLOPs redone, each for about 1.18x the clock (hand_plans_levit_s3); its derived level 2 with
# them on the menu holds 0.26x for 1.26x the clock, where it took 1.38x without them.


def cheap_product_flops(device_type: str, element_size: int = 4) -> int:
    """FLOPs per output element under which a product is cheaper to redo than an operator
    that streams one element in and one out (NOTE [ Products cheap to redo ]).

    >>> cheap_product_flops("cpu")
    114
    """
    flops_rate, bytes_rate = _RATES.get(device_type, _RATES["cuda"])
    return int(2 * element_size * flops_rate / bytes_rate)


class ModelledClock(TorchDispatchMode):
    """Adds up the modelled seconds (:func:`op_seconds`) of every operator run under it."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.seconds += op_seconds(func, args, kwargs, out, self.device_type)
        return out


def modelled_step_seconds(work: Workload, x: torch.Tensor) -> float:
    """The modelled seconds of one training step on ``x``: forward, backward and whatever the
    applied checkpointing recomputes (NOTE [ A modelled price ]). The price reads shapes only,
    so the step runs on fake tensors where that is quicker (``_measure.on_fakes``)."""

    def priced(on: Workload, batch: torch.Tensor) -> float:
        with ModelledClock(work.device.type) as clock:
            run_step(on, batch)
        return clock.seconds

    return on_fakes(priced, work, x)[0]
