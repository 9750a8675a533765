"""Training steps on fake tensors: a step's bytes without running a kernel.

# NOTE [ Counting a step without kernels ]

The byte tracker's figure (NOTE [ What track_peak_memory counts ] in ``_memory``) depends on the
shapes, dtypes and devices of the storages a step creates and on the order in which they are
created and released, never on the values in them. Under ``FakeTensorMode`` every operator
works out its outputs' metadata and gives each new output a storage of the right size on the
meta device, without running a kernel or taking memory; autograd, saved-tensor hooks, module
hooks and the checkpoint core's recomputation run exactly as on real tensors. So the same step
with the model's parameters, buffers and input swapped for fake tensors hands the tracker the
same storages in the same order, and its figure is the real step's (``tests/test_fake_meter.py``
holds them equal, byte for byte, for the bundled frontier presets at every level).

What :func:`faked` swaps, and puts back on exit whatever happens: every parameter (one fake
``Parameter`` per real one, so tied weights stay tied), every buffer, the input and the
optimizer (one of the same class over the fake parameters, its state faked too; one that
reads its step count with ``.item()``, as Adam's bias correction does, depends on values and
is counted on a real step). The model's
modules, hooks and installed checkpointing are its own, so the plan that runs is the user's;
its real parameters, buffers (BatchNorm's statistics) and gradients are never touched.

Fake tensors can stand for a device the machine lacks, and a forward on fake CUDA tensors
dispatches as on a GPU; but autograd's engine asks the CUDA driver about the device before it
runs a node of a CUDA graph, so no backward runs on fake CUDA tensors without a GPU (seen on
torch 2.14). A step is therefore counted on the device its model is on.

One difference is known. A fake convolution can give the weight's gradient another memory
layout than the CPU kernel does (3D convolutions; 2D ones on 1x1 maps), and then accumulating
it into ``.grad`` copies it once more, for a moment: a weight's bytes, at an instant far from
the peak. The peaks agree (``tests/test_fake_meter.py``: MONAI's SwinUNETR at every level);
the live bytes after each operator differ there by that copy.

Counting on fakes costs a fixed overhead per operator (the fake tensors dispatch in Python),
while a real operator costs what its tensors hold: on a batch of a few thousand elements (a
test's 32-pixel images) a real step is quicker, on one of an image model's real batches the
fake step is several times quicker. Since both give the same figure, the meter counts small
batches on real steps (:data:`FAKE_FROM`, 2^17 elements: one 224-pixel RGB image is 150k).

A forward may cache a tensor in its module (a mask, a rotary table, a dict of them by shape):
on fakes it would cache a fake, and the next real forward would read it. So whatever a fake
step leaves in a module's attributes, or in a list or dict attribute, is put back as it was.

Where a step depends on values (an operator whose output's shape depends on data, ``.item()``,
a Python branch on a tensor), fake tensors raise (:func:`value_dependent` tells); the fake
meter in ``_measure`` then runs the real step and says why.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .._compat import is_fake_tensor

__all__ = ["FAKE_FROM", "faked", "value_dependent"]

FAKE_FROM = 1 << 17
"""The fewest batch elements a step is counted on fakes from; a smaller batch runs for real,
which is quicker and gives the same figure (NOTE [ Counting a step without kernels ])."""


def value_dependent(error: BaseException) -> bool:
    """Whether ``error`` is fake tensors refusing a step that depends on values (a shape read
    from data, ``.item()``, an operator without a fake implementation).

    >>> value_dependent(RuntimeError("no"))
    False
    """
    from torch._subclasses import fake_tensor

    kinds = tuple(
        getattr(fake_tensor, name)
        for name in (
            "DataDependentOutputException",
            "DynamicOutputShapeException",
            "UnsupportedOperatorException",
            "UnsupportedFakeTensorException",
        )
        if hasattr(fake_tensor, name)
    )
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    except ImportError:  # pragma: no cover - every supported torch has it
        pass
    else:
        kinds += (GuardOnDataDependentSymNode,)
    return isinstance(error, kinds)


def _fake_optimizer(
    optimizer: torch.optim.Optimizer,
    fakes: dict[int, torch.nn.Parameter],
    convert: Any,
) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and settings over the fake parameters, with its
    state (moments, step counts) faked."""
    groups = [
        {**group, "params": [fakes[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    fake = type(optimizer)(groups)  # type: ignore[call-arg]
    for p, state in optimizer.state.items():
        fake.state[fakes[id(p)]] = {
            k: convert(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()
        }
    return fake


@contextlib.contextmanager
def faked(
    model: torch.nn.Module,
    x: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
) -> Iterator[tuple[torch.Tensor, torch.optim.Optimizer | None]]:
    """``model`` on fake tensors for the duration of the block (NOTE [ Counting a step without
    kernels ]).

    Yields the fake batch and optimizer; the model is the same object, its parameters and
    buffers swapped for fakes until the block exits.

    >>> net = torch.nn.Linear(4, 2)
    >>> weight = net.weight
    >>> with faked(net, torch.zeros(3, 4)) as (x, _):
    ...     out = net(x)
    >>> type(out).__name__, tuple(out.shape), net.weight is weight
    ('FakeTensor', (3, 2), True)
    """
    mode, kept = _standing_in(model)
    attributes = {m: dict(vars(m)) for m in model.modules()}  # what a forward may cache
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    fakes: dict[int, Any] = {}
    convert = mode.from_tensor

    try:
        with mode:
            for module in model.modules():
                for table, wrap in ((module._parameters, True), (module._buffers, False)):
                    for name, value in list(table.items()):
                        if value is None:
                            continue
                        if id(value) not in fakes:
                            fakes[id(value)] = _fake_of(value, wrap, kept, convert)
                        swapped.append((table, name, value))
                        table[name] = fakes[id(value)]
            fake_optimizer = None
            if optimizer is not None:
                fake_optimizer = _fake_optimizer(optimizer, fakes, convert)
            yield convert(x), fake_optimizer
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value
        for fake in fakes.values():
            fake.grad = None  # the next step starts without them, as a real one does
        _drop_cached_fakes(attributes)


def _drop_cached_fakes(before: dict[torch.nn.Module, dict[str, Any]]) -> None:
    """Undo what a forward on fakes cached in its modules (NOTE [ Counting a step without
    kernels ]): an attribute that now holds a fake gets its old value back (or goes), and
    fakes put into a list or dict attribute are taken out again."""
    for module, old in before.items():
        for name, value in list(vars(module).items()):
            if is_fake_tensor(value):
                if name in old:
                    setattr(module, name, old[name])
                else:
                    delattr(module, name)
            elif isinstance(value, dict):
                for key in [k for k, v in value.items() if is_fake_tensor(v)]:
                    del value[key]
            elif isinstance(value, list) and any(is_fake_tensor(v) for v in value):
                value[:] = [v for v in value if not is_fake_tensor(v)]


# NOTE [ One fake model per model ]
#
# Swapping a model's parameters and buffers for fakes costs as much as a third of a counted
# step (one conversion per tensor). The tools count many steps of one model, so each model keeps
# its fake mode and the fakes made for it (a weak reference: they go with the model), and a
# parameter or buffer gets a new fake only when it is another tensor than last time or its
# shape, strides, dtype, device or requires_grad changed. What a fake holds between steps is
# metadata: its gradient is dropped when a step ends, and an in-place update of a buffer changes
# no metadata of it.

_STANDING_IN: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, dict[int, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _standing_in(model: torch.nn.Module) -> tuple[Any, dict[int, Any]]:
    """The fake mode of ``model`` and the fakes made for its tensors (NOTE [ One fake model
    per model ])."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    found = _STANDING_IN.get(model)
    if found is None:
        found = _STANDING_IN[model] = (FakeTensorMode(allow_non_fake_inputs=True), {})
    return found


def _fake_of(value: torch.Tensor, wrap: bool, kept: dict[int, Any], convert: Any) -> Any:
    """The fake standing in for ``value`` (a ``Parameter`` when ``wrap``), made anew unless the
    one kept for it still matches it."""
    look = (
        tuple(value.shape),
        value.stride(),
        value.dtype,
        value.device,
        value.requires_grad,
        wrap,
    )
    entry = kept.get(id(value))
    if entry is not None and entry[0]() is value and entry[1] == look:
        return entry[2]
    fake = convert(value.detach())
    if wrap:
        fake = torch.nn.Parameter(fake, value.requires_grad)
    kept[id(value)] = (weakref.ref(value), look, fake)
    return fake
