"""Any model from one line of text: a timm name or a factory spec such as
``smp:Unet(encoder_name="resnet34", encoder_weights=None, classes=2)`` (:func:`build_model`),
the input it takes (:func:`parse_input_shape`, :func:`default_input_shape`), a training loss
that fits what it returns (:func:`output_loss`) and its library's own checkpointing switch
(:func:`own_switch`).

NOTE [ Reading a model spec without eval ]

A spec is ``[library:]Name`` or ``[library:]Name(arguments)``. The library is one of
:data:`LIBRARIES` (``timm`` when there is none, as a bare timm name always was) or a module
path ``package.module``. ``Name(arguments)`` is parsed with :mod:`ast` as one expression and
then *interpreted*, never evaluated: an argument is a literal (number, string, ``True``,
``False``, ``None``, and tuples, lists and dicts of them, with a sign on numbers) or a call
``Other(...)`` whose ``Other`` is looked up in the same library as ``Name`` (``hf:ViTModel(
ViTConfig(hidden_size=192))``), with arguments of the same kinds. Attribute access, operators,
comprehensions, ``*args``/``**kwargs`` and names that are not called are refused with the spec
quoted, so a spec can only call the library's own factories with plain values. A module path
is imported, which runs that module: it is the user's own code, named on purpose.

Weights are never downloaded: timm models are built with ``pretrained=False``, and an smp model
with no ``encoder_weights`` gets ``None`` (smp's default would fetch ImageNet weights).
"""

from __future__ import annotations

import ast
import difflib
import importlib
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import VisionCkptError

__all__ = [
    "ModelSpecError",
    "LIBRARIES",
    "ModelSpec",
    "parse_spec",
    "build_model",
    "parse_input_shape",
    "default_input_shape",
    "output_loss",
    "OwnSwitch",
    "own_switch",
]


class ModelSpecError(VisionCkptError, ValueError):
    """A ``--model`` spec or ``--input-shape`` that cannot be read, or names a model (or a
    library) that is not there."""


@dataclass(frozen=True)
class _Library:
    module: str
    """What is imported to resolve the spec's names."""
    install: str
    """How to install it."""
    example: str


LIBRARIES: dict[str, _Library] = {
    "timm": _Library("timm", "pip install timm", "timm:vit_small_patch16_224(num_classes=10)"),
    "smp": _Library(
        "segmentation_models_pytorch",
        'pip install "vision_ckpt[smp]"',
        'smp:Unet(encoder_name="resnet34", encoder_weights=None, classes=2)',
    ),
    "monai": _Library(
        "monai.networks.nets",
        'pip install "vision_ckpt[monai]"',
        "monai:SwinUNETR(in_channels=1, out_channels=2, feature_size=48)",
    ),
    "torchvision": _Library(
        "torchvision.models",
        "pip install torchvision",
        "torchvision:deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=21)",
    ),
    "hf": _Library(
        "transformers",
        'pip install "vision_ckpt[hf]"',
        "hf:ViTForImageClassification(ViTConfig(hidden_size=192, num_hidden_layers=4))",
    ),
}
"""The libraries a spec may name before ``:``, and what each resolves names in."""

_FORM = (
    "expected 'timm_name', 'library:Name(arg=value, ...)' with library one of "
    f"{', '.join(LIBRARIES)}, or 'package.module:function(...)'"
)
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed spec (see NOTE [ Reading a model spec without eval ]); nothing imported yet."""

    text: str
    """The spec as given."""
    library: str
    """A key of :data:`LIBRARIES`, or a module path."""
    call: ast.expr
    """The ``Name`` or ``Name(...)`` expression."""

    @property
    def name(self) -> str:
        """The factory (or timm model) the spec calls."""
        node = self.call.func if isinstance(self.call, ast.Call) else self.call
        return node.id  # type: ignore[attr-defined]


def parse_spec(text: str) -> ModelSpec:
    """Read a spec without importing anything; the syntax is checked here.

    >>> spec = parse_spec('smp:Unet(encoder_name="resnet34", classes=2)')
    >>> spec.library, spec.name
    ('smp', 'Unet')
    >>> parse_spec("convnext_tiny").library
    'timm'
    >>> parse_spec("smp:Unet(encoder_name=__import__('os'))")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vision_ckpt.measure.models.ModelSpecError: model spec "smp:Unet(encoder_name=...
    """
    stripped = text.strip()
    head, colon, _ = stripped.partition("(")[0].partition(":")
    if colon:
        library, body = head.strip(), stripped[len(head) + 1 :].strip()
    else:
        library, body = "timm", stripped
    if not body:
        raise _malformed(text, "nothing after the library")
    if library not in LIBRARIES and not _DOTTED.match(library):
        raise _malformed(text, f"{library!r} is neither a known library nor a module path")
    try:
        tree = ast.parse(body, mode="eval")
    except SyntaxError as exc:
        raise _malformed(text, f"not a Python call ({exc.msg})") from None
    call = tree.body
    target = call.func if isinstance(call, ast.Call) else call
    if not isinstance(target, ast.Name) or target.id.startswith("_"):
        raise _malformed(text, "the model must be a public plain name, e.g. Unet or resnet18")
    spec = ModelSpec(stripped, library, call)
    _check_arguments(spec, call)
    return spec


def _malformed(text: str, why: str) -> ModelSpecError:
    return ModelSpecError(f"model spec {text!r}: {why}; {_FORM}")


def _check_arguments(spec: ModelSpec, node: ast.expr) -> None:
    """Refuse anything but literals and calls of plain names, before anything is imported."""
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):
            raise _malformed(spec.text, f"{ast.unparse(node.func)!r} is not a plain name")
        if node.func.id.startswith("_"):
            raise _malformed(spec.text, f"{node.func.id!r} is private; call public names only")
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                raise _malformed(spec.text, "*args is not allowed; write the arguments out")
            _check_arguments(spec, arg)
        for kw in node.keywords:
            if kw.arg is None:
                raise _malformed(spec.text, "**kwargs is not allowed; write the arguments out")
            _check_arguments(spec, kw.value)
        return
    if node is spec.call:
        return  # a bare model name
    if isinstance(node, (ast.Tuple, ast.List)):
        for item in node.elts:
            _check_arguments(spec, item)
        return
    if isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                raise _malformed(spec.text, "**mapping is not allowed in a dict")
            _check_arguments(spec, key)
            _check_arguments(spec, value)
        return
    if isinstance(node, ast.Constant):
        return
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, (int, float))
    ):
        return
    raise _malformed(
        spec.text,
        f"argument {ast.unparse(node)!r} is not a literal (number, string, True/False/None, "
        f"tuple, list, dict) nor a call of a {spec.library} name",
    )


def _value(node: ast.expr, resolve: Callable[[str], Any]) -> Any:
    if isinstance(node, ast.Call):
        factory = resolve(node.func.id)  # type: ignore[attr-defined]
        args = [_value(a, resolve) for a in node.args]
        kwargs = {kw.arg: _value(kw.value, resolve) for kw in node.keywords}
        return _call(factory, node.func.id, args, kwargs)  # type: ignore[attr-defined]
    if isinstance(node, ast.Tuple):
        return tuple(_value(e, resolve) for e in node.elts)
    if isinstance(node, ast.List):
        return [_value(e, resolve) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {
            _value(k, resolve): _value(v, resolve)  # type: ignore[arg-type]
            for k, v in zip(node.keys, node.values, strict=True)
        }
    return ast.literal_eval(node)  # a constant or a signed number (checked by parse_spec)


def _call(factory: Any, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    try:
        return factory(*args, **kwargs)
    except TypeError as exc:
        import inspect

        try:
            signature = f"; it takes {name}{inspect.signature(factory)}"
        except (TypeError, ValueError):
            signature = ""
        raise ModelSpecError(f"{name}(...) rejected its arguments: {exc}{signature}") from None


def _import_library(spec: ModelSpec) -> Any:
    lib = LIBRARIES.get(spec.library)
    module_name = lib.module if lib else spec.library
    top = module_name.split(".")[0]
    if lib is None and (top in sys.stdlib_module_names or top in sys.builtin_module_names):
        raise ModelSpecError(
            f"model spec {spec.text!r}: {top!r} is part of Python's standard library, not a "
            f"model library; known libraries: {', '.join(LIBRARIES)}, or your own "
            "package.module:function(...)"
        )
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        if lib is None:
            raise ModelSpecError(
                f"model spec {spec.text!r}: cannot import module {spec.library!r} ({exc}); "
                f"known libraries: {', '.join(LIBRARIES)}, or a module path on sys.path"
            ) from None
        raise ModelSpecError(
            f"model spec {spec.text!r} needs {module_name.split('.')[0]!r}, which is not "
            f"installed ({exc}); install it with: {lib.install}"
        ) from None


def _public_names(module: Any) -> list[str]:
    return [n for n in dir(module) if not n.startswith("_")]


def _unknown(spec: ModelSpec, name: str, names: Sequence[str], where: str) -> ModelSpecError:
    lower: dict[str, str] = {}
    for n in names:
        lower.setdefault(n.lower(), n)
    # compared without case: "vitconfig" is a slip for "ViTConfig"
    close = [lower[c] for c in difflib.get_close_matches(name.lower(), list(lower), 5, 0.6)]
    hint = f"; did you mean: {', '.join(close)}?" if close else ""
    return ModelSpecError(f"model spec {spec.text!r}: {where} has no {name!r}{hint}")


def _resolver(spec: ModelSpec, module: Any) -> Callable[[str], Any]:
    if spec.library == "torchvision":
        registered = module.list_models()

        def resolve(name: str) -> Any:
            if name in registered:
                return module.get_model_builder(name)
            raise _unknown(spec, name, registered, "torchvision.models")

        return resolve

    where = LIBRARIES[spec.library].module if spec.library in LIBRARIES else spec.library
    package = where.split(".")[0]

    def resolve(name: str) -> Any:
        value = getattr(module, name, None) if not name.startswith("_") else None
        if value is None or not callable(value):
            raise _unknown(spec, name, _public_names(module), where)
        owner = str(getattr(value, "__module__", None) or "")
        if owner.split(".")[0] != package:
            # a name the module imported from elsewhere (``from os import system``): a spec
            # calls the library's own factories only
            raise ModelSpecError(
                f"model spec {spec.text!r}: {name!r} in {where} comes from {owner or 'elsewhere'!r}"
                f", not from {package!r}; a spec calls only {package}'s own classes and functions"
            )
        return value

    return resolve


def build_model(spec: str | ModelSpec, *, img_size: int | None = None) -> Any:
    """The model a spec names, built on CPU with random weights, in training mode.

    A bare name is a timm model (``"convnext_tiny"``; ``"timm:resnet18(num_classes=10)"`` takes
    arguments); otherwise ``library:Name(arguments)`` with a library of :data:`LIBRARIES` or a
    module path (``package.module:build(depth=4)``); see NOTE [ Reading a model spec without
    eval ] for what an argument may be.

    Raises:
        ModelSpecError: a malformed spec, an unknown library or name (with close matches), a
            library that is not installed (with the pip command), or arguments the factory
            rejects (with its signature).

    >>> model = build_model("hf:ViTForImageClassification(ViTConfig(hidden_size=32, "
    ...     "num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, "
    ...     "patch_size=8, num_labels=3))")
    >>> type(model).__name__, model.training
    ('ViTForImageClassification', True)
    >>> build_model("tim:resnet18")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vision_ckpt.measure.models.ModelSpecError: model spec 'tim:resnet18': cannot import ...
    """
    if isinstance(spec, str):
        spec = parse_spec(spec)
    module = _import_library(spec)
    if spec.library == "timm":
        model = _build_timm(spec, module, img_size)
    else:
        resolve = _resolver(spec, module)
        call = spec.call
        if isinstance(call, ast.Name):
            call = ast.Call(func=call, args=[], keywords=[])
        if spec.library == "smp" and not any(k.arg == "encoder_weights" for k in call.keywords):
            # smp's default encoder_weights="imagenet" downloads weights; never do that
            call = ast.Call(
                func=call.func,
                args=call.args,
                keywords=[*call.keywords, ast.keyword("encoder_weights", ast.Constant(None))],
            )
        model = _value(call, resolve)
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(
            f"model spec {spec.text!r} built a {type(model).__name__}, not a torch.nn.Module; "
            "name a function or class that returns the model"
        )
    return model.train()


def _build_timm(spec: ModelSpec, timm: Any, img_size: int | None) -> Any:
    name = spec.name
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; did you mean: {', '.join(close)}?" if close else ""
        raise ModelSpecError(f"unknown timm model {name!r}{hint} (see timm.list_models())")
    kwargs: dict[str, Any] = {}
    if isinstance(spec.call, ast.Call):
        if spec.call.args:
            raise _malformed(spec.text, "timm models take keyword arguments only")
        for kw in spec.call.keywords:
            if isinstance(kw.value, ast.Call):
                raise _malformed(spec.text, "timm arguments are literals, not calls")
            kwargs[kw.arg] = ast.literal_eval(kw.value)  # type: ignore[index]
    if kwargs.get("pretrained"):
        raise ModelSpecError(
            f"model spec {spec.text!r}: pretrained=True would download weights; memory and time "
            "do not depend on them, so leave it out"
        )
    kwargs["pretrained"] = False
    if img_size is not None and "img_size" not in kwargs:
        try:
            return timm.create_model(name, img_size=img_size, **kwargs)
        except TypeError:
            pass  # the family takes any input size
    return _call(timm.create_model, name, [name], kwargs)


# --------------------------------------------------------------------------------------------
# The input
# --------------------------------------------------------------------------------------------


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``"3,224,224"`` (C,H,W) or ``"1,96,96,96"`` (C,D,H,W) -> a tuple of positive ints.

    >>> parse_input_shape("1, 96, 96, 96")
    (1, 96, 96, 96)
    >>> parse_input_shape("224,224")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vision_ckpt.measure.models.ModelSpecError: input shape '224,224' has 2 sizes; expected C,H,W ...
    """
    try:
        sizes = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(s < 1 for s in sizes):
        raise ModelSpecError(
            f"input shape {text!r} is not a list of positive sizes; write C,H,W (e.g. 3,224,224) "
            "or C,D,H,W (e.g. 1,96,96,96)"
        )
    if len(sizes) not in (3, 4):
        raise ModelSpecError(
            f"input shape {text!r} has {len(sizes)} sizes; expected C,H,W (e.g. 3,224,224) or "
            "C,D,H,W for a volume (e.g. 1,96,96,96), without the batch"
        )
    return sizes


def default_input_shape(model: Any) -> tuple[int, ...] | None:
    """The input a model says it takes: a timm model's ``pretrained_cfg['input_size']``, a
    Hugging Face vision config's ``num_channels`` and ``image_size``; ``None`` otherwise.

    >>> import timm
    >>> default_input_shape(timm.create_model("resnet18", pretrained=False))
    (3, 224, 224)
    """
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, Mapping) and cfg.get("input_size"):
        return tuple(int(v) for v in cfg["input_size"])
    config = getattr(model, "config", None)
    size = getattr(config, "image_size", None)
    channels = getattr(config, "num_channels", None)
    if isinstance(size, int) and isinstance(channels, int):
        return (channels, size, size)
    if isinstance(size, (tuple, list)) and len(size) == 2 and isinstance(channels, int):
        return (channels, int(size[0]), int(size[1]))
    return None


# --------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------


def output_loss(output: Any) -> Any:
    """A training loss that fits what the model returned, with fixed synthetic targets.

    - ``(N, classes)`` logits: cross-entropy (one output: binary cross-entropy);
    - ``(N, C, *spatial)`` maps (segmentation, 2D or 3D): per-pixel cross-entropy (``C == 1``:
      binary);
    - a Hugging Face output: its ``logits`` as above, else ``last_hidden_state``;
    - a tuple, list or dict (deep supervision, torchvision's ``{"out", "aux"}``): the sum over
      its tensors;
    - anything else floating point (features): the mean of squares.

    The targets are a fixed pattern (no random draw), so a measured step is repeatable.

    >>> import torch
    >>> float(output_loss(torch.zeros(2, 4)))  # uniform logits over 4 classes: log 4
    1.3862943649291992
    >>> output_loss({"out": torch.zeros(2, 3, 4, 4), "aux": torch.zeros(2, 3, 4, 4)}).shape
    torch.Size([])
    """
    import torch

    if isinstance(output, torch.Tensor):
        return _tensor_loss(output)
    if isinstance(output, Mapping):
        for key in ("logits", "last_hidden_state"):
            if output.get(key) is not None:
                return _tensor_loss(output[key], features=key != "logits")
        parts = [output_loss(v) for v in output.values() if _has_float(v)]
    elif isinstance(output, (tuple, list)):
        parts = [output_loss(v) for v in output if _has_float(v)]
    else:
        parts = []
    if not parts:
        raise ModelSpecError(
            f"the model returned {type(output).__name__} with no floating-point tensor to build a "
            "loss from; pass loss_fn=... (Python) for this model"
        )
    return sum(parts[1:], parts[0])


def _has_float(value: Any) -> bool:
    import torch

    from .._compat import tree_leaves

    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves(value))


def _tensor_loss(t: Any, features: bool = False) -> Any:
    import torch
    import torch.nn.functional as F

    if not t.is_floating_point():
        raise ModelSpecError(f"the model returned a {t.dtype} tensor; a loss needs floats")
    if features or t.dim() not in (2, 4, 5) or t.shape[0] == 0:
        return t.float().square().mean()
    classes = t.shape[1]
    shape = (t.shape[0], *t.shape[2:])
    index = torch.arange(int(torch.Size(shape).numel()), device=t.device).reshape(shape)
    if classes == 1:
        target = (index % 2).to(t.dtype).unsqueeze(1)
        return F.binary_cross_entropy_with_logits(t, target)
    return F.cross_entropy(t, index % classes)


# --------------------------------------------------------------------------------------------
# The library's own switch
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OwnSwitch:
    """A model library's own activation checkpointing, to measure beside the levels."""

    name: str
    """How the library spells it, e.g. ``set_grad_checkpointing()``."""
    enable: Callable[[], None]
    disable: Callable[[], None]


def own_switch(model: Any) -> OwnSwitch | None:
    """The model's own checkpointing switch, or ``None`` if its library has none for it:
    Hugging Face ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()``
    before transformers 5), timm ``set_grad_checkpointing()``, MONAI ``use_checkpoint``.

    >>> import timm
    >>> own_switch(timm.create_model("resnet18", pretrained=False)).name
    'set_grad_checkpointing()'
    """
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):
            return OwnSwitch(
                "activation_checkpointing_enable()",
                model.activation_checkpointing_enable,
                model.activation_checkpointing_disable,
            )
        if hasattr(model, "gradient_checkpointing_enable"):
            return OwnSwitch(
                "gradient_checkpointing_enable()",
                model.gradient_checkpointing_enable,
                model.gradient_checkpointing_disable,
            )
    if callable(getattr(model, "set_grad_checkpointing", None)):
        return OwnSwitch(
            "set_grad_checkpointing()",
            lambda: model.set_grad_checkpointing(True),
            lambda: model.set_grad_checkpointing(False),
        )
    flagged = [
        m
        for m in model.modules()
        if type(m).__module__.startswith("monai.")
        and isinstance(getattr(m, "use_checkpoint", None), bool)
    ]
    if flagged:
        before = [m.use_checkpoint for m in flagged]

        def enable() -> None:
            for m in flagged:
                m.use_checkpoint = True

        def disable() -> None:
            for m, value in zip(flagged, before, strict=True):
                m.use_checkpoint = value

        return OwnSwitch("use_checkpoint=True", enable, disable)
    return None
