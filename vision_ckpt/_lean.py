"""An exact MLP backward that holds one hidden-size tensor fewer: a rule's ``lean: true``.

Knows nothing of levels; :mod:`vision_ckpt._install` decides when a module runs this way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import CheckpointError

__all__ = ["lean_mlp_problem", "lean_mlp_forward"]

# NOTE [ Lean MLP ]
# Autograd runs the backward of fc1 -> GELU -> fc2 holding three hidden-size tensors at once:
# fc1's output (for GELU's gradient), GELU's output (for fc2's weight gradient) and the
# gradient of GELU's output; and then the gradient of fc1's output beside the first and the
# third. On a recomputed transformer or ConvNeXt block that moment is the step's peak.
# _LeanMlp keeps fc1's input and output from forward (not GELU's output); its backward rebuilds
# GELU's output, takes fc2's weight gradient from it and frees it before fc2's input gradient
# exists, then writes GELU's gradient over that input gradient in place: two hidden-size
# tensors at most, for one GELU recomputed. Invariant: every value is made by the operator
# autograd itself uses for F.linear on a contiguous input with a bias (an addmm on the input
# flattened to rows, whose backward is grad.mm(weight), grad.t().mm(input) and a sum over
# rows), on the same shapes and layouts, so outputs and gradients equal the plain MLP's bit for
# bit. Under autocast the five tensors are cast to its dtype first, as autocast casts them for
# each linear (GELU is on none of its lists). A second derivative (create_graph=True) is an
# error: this backward is not differentiable, and the plain graph's second derivatives, rebuilt,
# would be summed in another order. Anything else (a strided input or weight, a tensor
# subclass or torch.func transform, dropout between GELU and fc2, hooks on the layers, a module
# changed since planning) runs the module's own forward, and lean_mlp_forward says why.


class _LeanMlp(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w1: torch.Tensor,
        b1: torch.Tensor,
        w2: torch.Tensor,
        b2: torch.Tensor,
        approximate: str,
    ) -> torch.Tensor:
        hidden = F.linear(x, w1, b1)
        out = F.linear(F.gelu(hidden, approximate=approximate), w2, b2)
        ctx.save_for_backward(x, hidden, w1, w2)
        ctx.approximate = approximate
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, hidden, w1, w2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():
            raise CheckpointError(
                "a lean MLP's backward ran with create_graph=True (for a second derivative, a "
                "gradient penalty): it takes GELU's gradient in place and is not itself "
                "differentiable. Take the lean level away for such training, with a "
                "rule {'match': '<the MLPs>', 'level': 0, 'lean': True} after the preset."
            )
        grad = grad.reshape(-1, grad.shape[-1])
        hidden = hidden.view(-1, hidden.shape[-1])
        act = F.gelu(hidden, approximate=ctx.approximate)
        grad_w2 = grad.t().mm(act) if need[3] else None
        del act  # before the gradient of fc2's input exists (NOTE [ Lean MLP ])
        grad_b2 = grad.sum(0) if need[4] else None
        grad_hidden = grad.mm(w2)
        del grad
        torch.ops.aten.gelu_backward.grad_input(
            grad_hidden, hidden, approximate=ctx.approximate, grad_input=grad_hidden
        )
        del hidden
        grad_w1 = grad_hidden.t().mm(x.reshape(-1, x.shape[-1])) if need[1] else None
        grad_b1 = grad_hidden.sum(0) if need[2] else None
        grad_x = grad_hidden.mm(w1).view(x.shape) if need[0] else None
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None


def _gelu_approximation(act: nn.Module) -> str | None:
    """``none`` or ``tanh`` for a GELU module whose forward is exactly ``F.gelu``, else ``None``."""
    if type(act) is nn.GELU:
        return act.approximate
    try:
        from timm.layers import activations
    except ImportError:  # pragma: no cover - timm is a dependency
        return None
    return {activations.GELU: "none", activations.GELUTanh: "tanh"}.get(type(act))


def lean_mlp_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot run as a lean MLP, or ``None`` when it can: it must be a timm
    ``Mlp`` (its own forward) with linear ``fc1``/``fc2`` with biases, a GELU ``act``, an
    identity ``norm`` and no dropout between them (``drop1``).

    >>> from timm.layers import Mlp
    >>> lean_mlp_problem(Mlp(8, 32)) is None
    True
    >>> lean_mlp_problem(nn.Linear(8, 8))
    'it is a Linear, not a timm Mlp (fc1 -> act -> drop1 -> norm -> fc2 -> drop2)'
    """
    try:
        from timm.layers import Mlp
    except ImportError:  # pragma: no cover - timm is a dependency
        Mlp = None
    if Mlp is None or not isinstance(module, Mlp) or type(module).forward is not Mlp.forward:
        return (
            f"it is a {type(module).__name__}, not a timm Mlp "
            "(fc1 -> act -> drop1 -> norm -> fc2 -> drop2)"
        )
    for part in ("fc1", "fc2"):
        layer = getattr(module, part)
        if type(layer) is not nn.Linear:
            return f"its {part} is a {type(layer).__name__}, not an nn.Linear (use_conv=False)"
        if layer.bias is None:
            return f"its {part} has no bias"
    if _gelu_approximation(module.act) is None:
        return f"its act is a {type(module.act).__name__}, not a GELU"
    if type(module.norm) is not nn.Identity:
        return f"its norm is a {type(module.norm).__name__}, not an Identity"
    drop1 = module.drop1
    if not isinstance(drop1, (nn.Dropout, nn.Identity)):
        return f"its drop1 is a {type(drop1).__name__}, not a Dropout"
    if isinstance(drop1, nn.Dropout) and drop1.p > 0:
        return f"its drop1 drops (p={drop1.p}) between GELU and fc2"
    for part in ("fc1", "act", "drop1", "norm", "fc2"):
        child = getattr(module, part)
        if (
            child._forward_hooks
            or child._forward_pre_hooks
            or child._backward_hooks
            or child._backward_pre_hooks
        ):
            return (
                f"its {part} has hooks (pruning, weight_norm, a user's), which a lean MLP, "
                "computing its layers itself, would not run"
            )
    return None


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def _functorch_running() -> bool:
    if torch.compiler.is_compiling():
        # while dynamo traces, this query sees dynamo's own state, not a user's transform;
        # dynamo traces the autograd.Function's forward and backward itself
        return False
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def lean_mlp_forward(module: nn.Module, x: Any) -> tuple[torch.Tensor | None, str]:
    """``module(x)`` for a module :func:`lean_mlp_problem` accepts, with the lean backward
    (NOTE [ Lean MLP ]); or ``(None, why)`` when this call must run the module's own forward.

    >>> import torch
    >>> from timm.layers import Mlp
    >>> mlp = Mlp(8, 32)
    >>> x = torch.randn(2, 5, 8, requires_grad=True)
    >>> out, _ = lean_mlp_forward(mlp, x)
    >>> torch.equal(out, mlp(x))
    True
    """
    problem = lean_mlp_problem(module)  # the module may have changed since it was planned
    if problem is not None:
        return None, problem
    fc1, fc2 = module.fc1, module.fc2
    tensors = (x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None, "its input is not a floating-point tensor"
    if not all(_plain(t) for t in tensors) or _functorch_running():
        return None, "a tensor subclass or a torch.func transform (DTensor, vmap, grad) is involved"
    if x.dim() < 2 or not x.is_contiguous():
        return None, "its input is not a contiguous tensor of two or more dimensions"
    if not (fc1.weight.is_contiguous() and fc2.weight.is_contiguous()):
        # autograd picks another product for a column-major weight (a transposed, tied one)
        return None, "a weight is not contiguous"
    device = x.device.type
    if len({t.device for t in tensors}) > 1:
        return None, "its input and parameters are on different devices"
    autocast = torch.is_autocast_enabled(device)
    if autocast:
        if any(t.dtype == torch.float64 for t in tensors):
            return None, "autocast leaves a float64 tensor as it is"
    elif len({t.dtype for t in tensors}) > 1:
        return None, "its input and parameters differ in dtype"
    approximate = _gelu_approximation(module.act)
    if autocast:
        # autocast would cast the five tensors for each linear: cast them once here, where
        # autograd records the casts as it does under autocast (NOTE [ Lean MLP ])
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            out = _LeanMlp.apply(*(t.to(dtype) for t in tensors), approximate)
    else:
        out = _LeanMlp.apply(*tensors, approximate)
    return module.drop2(out), ""
