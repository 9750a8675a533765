"""An exact MLP backward that holds one hidden-size tensor fewer: a rule's ``lean: true``.

Knows nothing of levels; :mod:`vision_ckpt.regions._install` decides when a module runs this way.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .. import _compat
from ..errors import CheckpointError

__all__ = ["lean_mlp_problem", "lean_mlp_call_problem", "lean_mlp_forward"]

# NOTE [ Lean MLP ]
# Autograd runs the backward of layer1 -> act -> layer2 holding three hidden-size tensors at
# once: layer1's output (for the activation's gradient), the activation's output (for layer2's
# weight gradient) and the gradient of the activation's output; then the activation's own
# gradient formula adds its temporaries (StarReLU's s*relu(h)**2+b: four more). On a recomputed
# transformer, ConvNeXt or MetaFormer block that moment is the step's peak. _LeanMlp keeps
# layer1's input and output from forward (not the activation's output); its backward rebuilds
# the activation, takes layer2's weight gradient from it and frees it before layer2's input
# gradient exists, then turns that input gradient into layer1's output gradient in place: two
# hidden-size tensors at most (three for StarReLU), for one activation recomputed.
# Invariant: every value is made by the operator autograd itself uses, on the same shapes and
# layouts, so outputs and gradients equal the plain MLP's bit for bit:
# - a linear layer on a contiguous input is a product on the input flattened to rows, whose
#   backward is grad.mm(weight), grad.t().mm(input) and a sum over rows;
# - a pointwise Conv2d (1x1, stride 1, no padding, one group) backs through
#   aten.convolution_backward, asked for the weight and bias gradients and then, apart, for
#   the input gradient (each output of that operator is computed on its own);
# - GELU, SiLU, ReLU and Hardswish back through the one operator autograd's formula calls
#   (gelu_backward, silu_backward, threshold_backward, hardswish_backward), written over the
#   gradient it takes (SiLU's into a new tensor, one hidden-size tensor more for a moment:
#   see _ONE_OP); StarReLU through the formulas autograd records for mul, pow and relu, taken
#   in place (an elementwise operator gives the same value in place), its scale's and bias's
#   gradients reduced by the sum_to the engine applies.
# Under autocast the tensors are cast to its dtype first, as autocast casts them for each layer
# (the one-operator activations are on none of its lists; StarReLU's pow is, so a StarReLU MLP
# runs plainly there). A
# second derivative (create_graph=True) is an error: this backward is not differentiable, and
# the plain graph's second derivatives, rebuilt, would be summed in another order. Anything else
# (a strided input or weight, a tensor subclass or torch.func transform, dropout between the
# activation and layer2, hooks on the layers, a module changed since planning) runs the
# module's own forward, and lean_mlp_forward says why.

_Kind = Literal["linear", "conv"]


@dataclass(frozen=True)
class _Spec:
    """The static shape of a lean MLP: its layers' kinds and its activation."""

    first: _Kind
    second: _Kind
    act: str
    """A key of ``_ONE_OP`` (``gelu:none``, ``silu``, ...) or ``star``."""
    biases: tuple[bool, bool]


def _layer(kind: _Kind, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b) if kind == "linear" else F.conv2d(x, w, b)


def _conv_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: bool, mask: list[bool]
) -> tuple[torch.Tensor | None, ...]:
    sizes = [w.shape[0]] if bias else None
    return torch.ops.aten.convolution_backward(
        grad, x, w, sizes, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, mask
    )


def _weight_grads(
    kind: _Kind, grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: bool, need: tuple
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of a layer's weight and bias (``need``: which), given its input ``x``."""
    need_w, need_b = need[0], need[1] and bias
    if kind == "conv":
        _, gw, gb = _conv_backward(grad, x, w, bias, [False, need_w, need_b])
        return gw, gb
    rows = grad.reshape(-1, grad.shape[-1])
    gw = rows.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
    return gw, rows.sum(0) if need_b else None


def _input_grad(
    kind: _Kind, grad: torch.Tensor, like: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """The gradient of a layer's input; ``like`` has the input's shape and layout (its values
    are not read)."""
    if kind == "conv":
        return _conv_backward(grad, like, w, False, [True, False, False])[0]
    return grad.reshape(-1, grad.shape[-1]).mm(w).view(like.shape)


# The activations taken with one operator each way: the function the plain module calls, and
# its gradient as autograd computes it, written over the gradient of the activation's output.
# ReLU's formula reads relu's result, which is at or under 0 exactly where its input is.
# silu_backward also has a composite kernel, which a Python dispatch mode (FlopCounterMode)
# runs in place of the CPU one for the overload autograd calls: it is called as autograd calls
# it, into a new tensor, so it rounds as the plain MLP's does under any mode.
_ONE_OP: dict[str, tuple[Any, Any]] = {
    "gelu:none": (
        lambda h: F.gelu(h),
        lambda g, h: torch.ops.aten.gelu_backward.grad_input(g, h, grad_input=g),
    ),
    "gelu:tanh": (
        lambda h: F.gelu(h, approximate="tanh"),
        lambda g, h: torch.ops.aten.gelu_backward.grad_input(
            g, h, approximate="tanh", grad_input=g
        ),
    ),
    "silu": (F.silu, lambda g, h: torch.ops.aten.silu_backward(g, h)),
    "relu": (
        F.relu,
        lambda g, h: torch.ops.aten.threshold_backward.grad_input(g, h, 0, grad_input=g),
    ),
    "hardswish": (F.hardswish, lambda g, h: torch.ops.aten.hardswish_backward.out(g, h, out=g)),
}


def _act(act: str, hidden: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The activation as the plain module computes it."""
    if act == "star":
        scale, bias = params
        return scale * F.relu(hidden) ** 2 + bias
    return _ONE_OP[act][0](hidden)


def _act_again(act: str, hidden: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """:func:`_act`'s values, in one new tensor (StarReLU's steps in place)."""
    if act != "star":
        return _act(act, hidden, params)
    scale, bias = params
    out = F.relu(hidden)
    return out.pow_(2).mul_(scale).add_(bias)


def _act_backward(
    act: str, grad: torch.Tensor, hidden: torch.Tensor, params: tuple, need: tuple
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The gradient of ``hidden`` from ``grad`` (of the activation's output), written over
    ``grad`` where the operator allows, and the activation's parameters' gradients."""
    if act != "star":
        return _ONE_OP[act][1](grad, hidden), ()
    scale, bias = params
    grad_bias = grad.sum_to_size(bias.shape) if need[1] else None  # add: grad, reduced
    grad_scale = None
    if need[0]:  # mul: grad * relu(h)**2, reduced
        square = F.relu(hidden).pow_(2).mul_(grad)
        grad_scale = square.sum_to_size(scale.shape)
        del square
    grad.mul_(scale)  # mul: grad * scale
    twice = F.relu(hidden).mul_(2.0)  # pow: grad * (2.0 * relu(h).pow(1.0))
    grad.mul_(twice)
    # relu: zero where relu's result is not above 0, as where twice it is not
    torch.ops.aten.threshold_backward.grad_input(grad, twice, 0, grad_input=grad)
    return grad, (grad_scale, grad_bias)


class _LeanMlp(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        spec: _Spec,
        x: torch.Tensor,
        w1: torch.Tensor,
        b1: torch.Tensor | None,
        w2: torch.Tensor,
        b2: torch.Tensor | None,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        hidden = _layer(spec.first, x, w1, b1)
        out = _layer(spec.second, _act(spec.act, hidden, params), w2, b2)
        ctx.save_for_backward(x, hidden, w1, w2, *params)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, hidden, w1, w2, *params = ctx.saved_tensors
        spec: _Spec = ctx.spec
        need = ctx.needs_input_grad  # spec, x, w1, b1, w2, b2, *params
        if torch.is_grad_enabled():
            raise CheckpointError(
                "a lean MLP's backward ran with create_graph=True (for a second derivative, a "
                "gradient penalty): it takes the activation's gradient in place and is not "
                "itself differentiable. Take the lean level away for such training, with a "
                "rule {'match': '<the MLPs>', 'level': 0, 'lean': True} after the preset."
            )
        act = _act_again(spec.act, hidden, tuple(params))
        grad_w2, grad_b2 = _weight_grads(spec.second, grad, act, w2, spec.biases[1], need[4:6])
        del act  # before the gradient of layer2's input exists (NOTE [ Lean MLP ])
        grad_hidden = _input_grad(spec.second, grad, hidden, w2)
        del grad
        grad_hidden, grad_params = _act_backward(
            spec.act, grad_hidden, hidden, tuple(params), need[6:]
        )
        del hidden
        grad_w1, grad_b1 = _weight_grads(spec.first, grad_hidden, x, w1, spec.biases[0], need[2:4])
        grad_x = _input_grad(spec.first, grad_hidden, x, w1) if need[1] else None
        return None, grad_x, grad_w1, grad_b1, grad_w2, grad_b2, *grad_params


@dataclass(frozen=True)
class _Parts:
    """A recognised MLP: ``before`` (a norm) on the input, ``first -> act -> second``, then
    ``after`` (dropout) on the output; only the middle runs lean."""

    first: nn.Module
    act: nn.Module
    second: nn.Module
    after: tuple[nn.Module, ...]
    spec: _Spec
    before: tuple[nn.Module, ...] = ()


_POINTWISE = ((1, 1), (1, 1), (0, 0), (1, 1), 1, "zeros")


def _layer_kind(part: str, layer: nn.Module) -> _Kind | str:
    """``linear`` or ``conv``, or why the layer cannot be one of a lean MLP."""
    if type(layer) is nn.Linear:
        return "linear"
    if type(layer) is nn.Conv2d:
        shape = (layer.kernel_size, layer.stride, layer.padding, layer.dilation)
        if (*shape, layer.groups, layer.padding_mode) == _POINTWISE:
            return "conv"
        return (
            f"its {part} is a Conv2d that is not pointwise (it must have a 1x1 kernel, stride "
            "1, no padding, one group)"
        )
    return f"its {part} is a {type(layer).__name__}, not an nn.Linear or a pointwise nn.Conv2d"


def _act_kind(act: nn.Module) -> str | None:
    """The kind of an activation module whose forward is exactly that function (a key of
    ``_ONE_OP``, or ``star``), else ``None``."""
    if type(act) is nn.GELU:
        return f"gelu:{act.approximate}"
    torch_kind = {nn.SiLU: "silu", nn.ReLU: "relu", nn.Hardswish: "hardswish"}.get(type(act))
    if torch_kind is not None:
        return torch_kind
    try:
        from timm.layers import activations
        from timm.models.metaformer import StarReLU
    except ImportError:  # pragma: no cover - timm is a dependency
        return None
    gelu = {activations.GELU: "gelu:none", activations.GELUTanh: "gelu:tanh"}.get(type(act))
    if gelu is not None:
        return gelu
    if type(act) is StarReLU and type(act.relu) is nn.ReLU:
        return "star"
    hf = sys.modules.get("transformers.activations")  # imported when such a module exists
    if hf is not None and type(act) is hf.GELUActivation and act.act is F.gelu:
        return "gelu:none"
    return None


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def _hooks_problem(parts: Iterable[tuple[str, nn.Module]]) -> str | None:
    """Why hooks on one of an MLP's named parts (or inside it) keep it from running lean."""
    for part, child in parts:
        if any(_hooked(m) for m in child.modules()):
            return (
                f"its {part} has hooks (pruning, weight_norm, a user's), which a lean MLP, "
                "computing its layers itself, would not run"
            )
    return None


def _is_timm_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a timm ``Mlp`` with its own forward."""
    try:
        from timm.layers import Mlp
    except ImportError:  # pragma: no cover - timm is a dependency
        return False
    return isinstance(module, Mlp) and type(module).forward is Mlp.forward


def _timm_mlp(module: nn.Module) -> _Parts | str:
    """The parts of a timm ``Mlp`` (fc1 -> act -> drop1 -> norm -> fc2 -> drop2), or why it
    has none a lean MLP takes."""
    kinds = []
    for part in ("fc1", "fc2"):
        kind = _layer_kind(part, getattr(module, part))
        if kind not in ("linear", "conv"):
            return kind
        kinds.append(kind)
    act = _act_kind(module.act)
    if act is None:
        return (
            f"its act is a {type(module.act).__name__}, not one lean takes (GELU, SiLU, ReLU, "
            "Hardswish, StarReLU)"
        )
    if type(module.norm) is not nn.Identity:
        return f"its norm is a {type(module.norm).__name__}, not an Identity"
    drop1 = module.drop1
    if not isinstance(drop1, (nn.Dropout, nn.Identity)):
        return f"its drop1 is a {type(drop1).__name__}, not a Dropout"
    if isinstance(drop1, nn.Dropout) and drop1.p > 0:
        return f"its drop1 drops (p={drop1.p}) between the activation and fc2"
    hooked = _hooks_problem((p, getattr(module, p)) for p in ("fc1", "act", "drop1", "norm", "fc2"))
    if hooked is not None:
        return hooked
    fc1, fc2 = module.fc1, module.fc2
    biases = (fc1.bias is not None, fc2.bias is not None)
    spec = _Spec(kinds[0], kinds[1], act, biases)
    return _Parts(fc1, module.act, fc2, (module.drop2,), spec)


# NOTE [ MLPs of any class ]
# A module of another class is a lean MLP when its forward is the chain a lean MLP computes,
# found by a probe rather than by its class: its children are two layers, one activation (as
# above) and other leaves (modules without children: dropouts, drop-paths, identities, norms),
# and one forward on a small input (no gradients, in training mode, the random state put back)
# calls, each on exactly the previous output, unmodified and alone: any leaves on the module's
# input (a pre-norm, as TinyViT's MLP has), the first layer, the activation, leaves that return
# their input itself, unmodified, the second layer, then any modules, whose last output the
# forward returns. The lean forward calls the leaves before the first layer itself, computes
# the chain to the second layer (the leaves' output is the lean part's input, so a call is
# checked for lean once they have run, and a call that cannot run lean then goes on through
# the modules themselves, never through a leaf twice) and calls the modules after it itself.
# Invariant: a probe's verdict stands only while the module's structure and its descendants'
# plain attributes (a drop probability, the training flag) are those it was probed with; any
# change probes again, so a drop-path switched on between the activation and the second layer
# is seen, never skipped. What no probe sees, as no trace does: a forward that branches on its
# input's shape or values and calls another chain for another input; such a module must not be
# given ``lean: true``.


def _structure(module: nn.Module) -> tuple[Any, ...]:
    """What a probe's verdict on ``module`` depends on besides its class's forward."""
    plain = (bool, int, float, str, type(None))
    return tuple(
        (
            name,
            id(m),
            type(m),
            _hooked(m),
            tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, plain))),
        )
        for name, m in module.named_modules()
    )


_probed: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], _Parts | str]] = (
    weakref.WeakKeyDictionary()
)


def _traced_mlp(module: nn.Module) -> _Parts | str:
    """The parts of a module of any class whose forward is a lean MLP's chain (NOTE [ MLPs of
    any class ]), or why it is not one; its children are looked at on every call, its forward
    probed once per structure."""
    problem = _children_problem(module)
    if problem is not None:
        return problem
    structure = _structure(module)
    known = _probed.get(module)
    if known is not None and known[0] == structure:
        return known[1]
    parts = _probe(module)
    _probed[module] = (structure, parts)
    return parts


def _layers(module: nn.Module) -> list[nn.Module]:
    return [c for c in module.children() if type(c) in (nn.Linear, nn.Conv2d)]


def _children_problem(module: nn.Module) -> str | None:
    """Why the children of ``module`` are not those of a lean MLP (two layers, one activation,
    other leaves, no hooks), or ``None``."""
    children = dict(module.named_children())
    layers = _layers(module)
    acts = [c for c in children.values() if _act_kind(c) is not None]
    leaves = [
        c
        for c in children.values()
        if c not in layers and c not in acts and not any(True for _ in c.children())
    ]
    what = (
        f"it is a {type(module).__name__}, not a timm Mlp, and not a module whose children are "
        "two linear or pointwise conv layers, one activation lean takes (GELU, SiLU, ReLU, "
        "Hardswish, StarReLU) and other leaves (modules without children)"
    )
    if len(layers) != 2 or len(acts) != 1 or len(leaves) + 3 != len(children):
        return what
    if module._parameters or module._buffers:
        return f"{what} (it has parameters or buffers of its own)"
    for name, child in children.items():
        if child in layers:
            kind = _layer_kind(name, child)
            if kind not in ("linear", "conv"):
                return kind
    hooked = _hooks_problem(children.items())
    if hooked is not None:
        return hooked
    if _hooked(module):
        return "it has hooks, which a lean MLP would not run"
    return None


def _probe(module: nn.Module) -> _Parts | str:
    """The chain one forward of ``module`` calls, tried with each layer's input shape."""
    reasons = []
    for layer in _layers(module):  # which layer comes first, the probe finds out
        chain = _probe_chain(module, layer)
        if isinstance(chain, _Parts):
            return chain
        reasons.append(chain)
    ran = [r for r in reasons if not r.startswith("it did not run")]
    return (
        "its forward, probed, does not call its children as a lean MLP's chain (the first "
        "layer on its input, the activation, leaves that pass it on, the second layer, each on "
        f"the previous output): {(ran or reasons)[0]}"
    )


def _probe_chain(module: nn.Module, first: nn.Module) -> _Parts | str:
    """One forward of ``module`` on a small input for ``first``, and the chain it called."""
    weight = first.weight
    if type(first) is nn.Linear:
        x = torch.ones(1, 2, first.in_features, dtype=weight.dtype, device=weight.device)
    else:
        x = torch.ones(1, first.in_channels, 2, 2, dtype=weight.dtype, device=weight.device)
    calls: list[tuple[nn.Module, Any, int, Any, int]] = []
    pending: list[tuple[Any, int]] = []

    def before(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        one = args[0] if len(args) == 1 and not kwargs else None
        pending.append((one, one._version if isinstance(one, torch.Tensor) else -1))

    def after(m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        one, version = pending.pop()
        calls.append((m, one, version, out, getattr(out, "_version", -1)))

    modes = {m: m.training for m in module.modules()}
    # a norm before the first layer, run in training mode, would update its running statistics
    buffers = [(b, b.clone()) for b in module.buffers()]
    handles = []
    for child in module.children():
        handles.append(child.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(child.register_forward_hook(after, with_kwargs=True))
    devices = [weight.device] if weight.device.type == "cuda" else []
    try:
        module.train()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            out = type(module).forward(module, x)
    except Exception as error:  # the probe's input is not one this forward takes
        return f"it did not run on a {tuple(x.shape)} input ({type(error).__name__})"
    finally:
        for handle in handles:
            handle.remove()
        for m, mode in modes.items():
            m.training = mode
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return _chain_parts(module, x, calls, out)


def _chain_parts(
    module: nn.Module, x: torch.Tensor, calls: list[tuple[nn.Module, Any, int, Any, int]], out: Any
) -> _Parts | str:
    """The parts of a probed chain of ``calls`` from ``x`` to ``out``, or why it is not one."""
    value, version = x, x._version
    for i, (m, one, seen, result, result_version) in enumerate(calls):
        if one is not value or seen != version:
            return f"call {i + 1} ({type(m).__name__}) did not take the previous output alone"
        value, version = result, result_version
    if value is not out or not isinstance(out, torch.Tensor):
        return "it did not return the last call's output"
    kinds = [
        "layer" if type(m) in (nn.Linear, nn.Conv2d) else "act" if _act_kind(m) else "leaf"
        for m, *_ in calls
    ]
    start = kinds.index("layer") if "layer" in kinds else len(kinds)
    if kinds[start : start + 2] != ["layer", "act"] or kinds.count("layer") != 2:
        return "it did not call a layer, then the activation, then the other layer"
    second = kinds.index("layer", start + 1)
    first, act, layer2 = calls[start][0], calls[start + 1][0], calls[second][0]
    if first is layer2:
        return "it called one layer twice"
    names = {id(c): n for n, c in module.named_children()}
    for m, one, seen, result, result_version in calls[start + 2 : second]:
        # passing on means returning the input itself, unmodified: an in-place dropout
        # returns its input too, written over
        if result is not one or result_version != seen or m is act:
            return (
                f"its {names[id(m)]} ({type(m).__name__}) ran between the activation and the "
                "second layer and did not pass its input on unchanged (a dropout with p > 0?)"
            )
    spec = _Spec(
        _layer_kind("", first),  # type: ignore[arg-type]
        _layer_kind("", layer2),  # type: ignore[arg-type]
        _act_kind(act) or "",
        (first.bias is not None, layer2.bias is not None),
    )
    after = tuple(c[0] for c in calls[second + 1 :])
    return _Parts(first, act, layer2, after, spec, tuple(c[0] for c in calls[:start]))


def _recognised(module: nn.Module) -> _Parts | str:
    """The parts of a timm ``Mlp`` or of a module probed to compute as one."""
    return _timm_mlp(module) if _is_timm_mlp(module) else _traced_mlp(module)


def lean_mlp_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot run as a lean MLP, or ``None`` when it can. Two layers, each
    linear or a pointwise (1x1) conv, with or without biases, around a GELU, SiLU, ReLU,
    Hardswish or StarReLU, with no dropout between them: a timm ``Mlp`` (its own forward, with
    an identity ``norm``), or a module of any class whose forward a probe finds calling its
    children as such a chain (NOTE [ MLPs of any class ]).

    >>> from timm.layers import Mlp
    >>> lean_mlp_problem(Mlp(8, 32)) is None
    True
    >>> lean_mlp_problem(nn.Sequential(nn.Conv2d(8, 32, 1), nn.GELU(), nn.Conv2d(32, 8, 1)))
    >>> lean_mlp_problem(nn.Linear(8, 8)).startswith("it is a Linear, not a timm Mlp")
    True
    """
    parts = _recognised(module)
    return parts if isinstance(parts, str) else None


def _plain(t: torch.Tensor) -> bool:
    """A tensor the lean MLP's operators see as they are: plain, a parameter, or a fake tensor
    (a stand-in with a plain tensor's behaviour and no data: NOTE [ Counting a step without
    kernels ] in ``vision_ckpt.measure._fake``)."""
    return type(t) in (torch.Tensor, nn.Parameter) or _compat.is_fake_tensor(t)


def _functorch_running() -> bool:
    if torch.compiler.is_compiling():
        # while dynamo traces, this query sees dynamo's own state, not a user's transform;
        # dynamo traces the autograd.Function's forward and backward itself
        return False
    return _compat.functorch_running()


def _call_problem(
    parts: _Parts, x: Any, tensors: list[torch.Tensor], layout: bool = True
) -> str | None:
    """Why this call cannot run lean, or ``None``; ``layout=False`` leaves the input's shape
    and strides unchecked (the module's input, before leaves that make the lean part's)."""
    spec = parts.spec
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return "its input is not a floating-point tensor"
    if not all(_plain(t) for t in tensors) or _functorch_running():
        return "a tensor subclass or a torch.func transform (DTensor, vmap, grad) is involved"
    if layout and spec.first == "conv":
        if x.dim() != 4:  # a 1x1 conv takes any layout: its backward is asked for the same
            return "its input is not a batch of images (N, C, H, W) for its first 1x1 conv"
    elif layout and (x.dim() < 2 or not x.is_contiguous()):
        return "its input is not a contiguous tensor of two or more dimensions"
    if not all(t.is_contiguous() for t in tensors[1:]):
        # autograd picks another product for a column-major weight (a transposed, tied one)
        return "a weight is not contiguous"
    if len({t.device for t in tensors}) > 1:
        return "its input and parameters are on different devices"
    if torch.is_autocast_enabled(x.device.type):
        if spec.act == "star":
            return "autocast computes StarReLU's square in float32"
        if any(t.dtype == torch.float64 for t in tensors):
            return "autocast leaves a float64 tensor as it is"
    elif len({t.dtype for t in tensors}) > 1:
        return "its input and parameters differ in dtype"
    return None


def _lean_args(parts: _Parts, x: Any, layout: bool = True) -> tuple[list[Any], str | None]:
    """The arguments of the lean call on ``x`` after the spec (the lean part's input, layers'
    weights and biases, activation's parameters), and why it cannot run lean, or ``None``."""
    first, second = parts.first, parts.second
    params = [parts.act.scale, parts.act.bias] if parts.spec.act == "star" else []
    args = [x, first.weight, first.bias, second.weight, second.bias, *params]
    return args, _call_problem(parts, x, [t for t in args if t is not None], layout)


def _prepared(module: nn.Module, x: Any) -> tuple[_Parts, list[torch.Tensor | None]] | str:
    """The parts of ``module`` and the arguments of its lean call on ``x`` (for an MLP with
    leaves before its first layer, checked on the module's input but for its layout: the
    leaves, which have not run, make the lean part's), or why it cannot run lean."""
    parts = _recognised(module)  # the module may have changed since it was planned
    if isinstance(parts, str):
        return parts
    args, why = _lean_args(parts, x, layout=not parts.before)
    return why if why is not None else (parts, args)


def lean_mlp_call_problem(module: nn.Module, x: Any) -> str | None:
    """Why ``module(x)`` would run the module's own forward rather than the lean one, or
    ``None`` when it runs lean.

    >>> import torch
    >>> from timm.layers import Mlp
    >>> lean_mlp_call_problem(Mlp(8, 32), torch.randn(2, 5, 8)) is None
    True
    >>> lean_mlp_call_problem(Mlp(8, 32), torch.randn(2, 8, 5).transpose(1, 2))
    'its input is not a contiguous tensor of two or more dimensions'
    """
    prepared = _prepared(module, x)
    return prepared if isinstance(prepared, str) else None


def lean_mlp_forward(module: nn.Module, x: Any) -> tuple[torch.Tensor | None, str]:
    """``module(x)`` for a module :func:`lean_mlp_problem` accepts, with the lean backward
    (NOTE [ Lean MLP ]), and ``""``; or ``(None, why)`` when this call must run the module's own
    forward; or, for an MLP with leaves before its first layer whose lean part cannot run lean
    on their output, that output taken through the modules themselves, and why.

    >>> import torch
    >>> from timm.layers import Mlp
    >>> mlp = Mlp(8, 32)
    >>> x = torch.randn(2, 5, 8, requires_grad=True)
    >>> out, _ = lean_mlp_forward(mlp, x)
    >>> torch.equal(out, mlp(x))
    True
    """
    prepared = _prepared(module, x)
    if isinstance(prepared, str):
        return None, prepared
    parts, args = prepared
    if parts.before:  # NOTE [ MLPs of any class ]: the leaves run once, whatever follows
        for before in parts.before:
            x = before(x)
        args, why = _lean_args(parts, x)
        if why is not None:
            out = parts.second(parts.act(parts.first(x)))
            for after in parts.after:
                out = after(out)
            return out, why
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # autocast would cast the tensors for each layer: cast them once here, where autograd
        # records the casts as it does under autocast (NOTE [ Lean MLP ]); a StarReLU MLP
        # does not come here
        dtype = torch.get_autocast_dtype(device)
        cast = [None if t is None else t.to(dtype) for t in args]
        with torch.autocast(device, enabled=False):
            out = _LeanMlp.apply(parts.spec, *cast)
    else:
        out = _LeanMlp.apply(parts.spec, *args)
    for after in parts.after:
        out = after(out)
    return out, ""
