"""One region's frame: the saved-tensor hooks of its forward, and its recomputation.

Owns what a checkpointed region leaves between its forward and its backward: the frame that is
the forward's pack hook and backward's unpack hook (NOTE [ Pack/unpack lifetime ], NOTE [ Nested
checkpoints ]), the recomputation that refills it once per graph task, the check that the
recomputation saved what the forward saved, the operator logs of ``debug=True``, and the name
errors give the region. What fills a frame at call time is ``_core``'s (one callable) or
``_chain``'s (consecutive calls); what the recomputation reinstates around the region is
``_call_state``'s.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .. import _compat
from .._compat import tree_flatten, tree_unflatten
from ..errors import CheckpointError, internal_assert
from ._call_state import (
    KernelSettings,
    autocast_contexts,
    capture_settings,
    enter_bn_guard,
    exit_bn_guard,
    swap_rng,
    thread_state,
)
from ._saved_inputs import HostCopy

__all__ = [
    "Frame",
    "DebugLogs",
    "blank_frame",
    "check_inputs_unwritten",
    "region_label",
    "region_name",
]

_push_hooks = _compat.push_saved_tensors_hooks
_pop_hooks = _compat.pop_saved_tensors_hooks
_graph_task_id = _compat.graph_task_id
_user_saved_tensors_hooks = _compat.user_saved_tensors_hooks

_FIX_TIP = (
    "If the region is deliberately data-dependent, pass determinism_check='none'; to see the "
    "operators of both runs, pass debug=True (or wrap the code in "
    "`with vision_ckpt.runtime.set_checkpoint_debug_enabled(True):`)."
)
_anonymous_graph_ids = itertools.count(-2, -1)


class _StopRecomputation(BaseException):
    """Raised from the recomputation's pack hook once every needed tensor is back.

    A BaseException, so that ``except Exception`` inside user code cannot swallow it.
    """


# NOTE [ Pack/unpack lifetime ]
#
# In the original forward every tensor autograd wants to save is replaced by an empty _Holder;
# the frame keeps only a weak reference to it, in save order. The holder lives exactly as long
# as the SavedVariable of the graph that owns it.
#
# Backward asks for a holder (unpack). The first unpack of a frame within one graph task
# recomputes the region once; the recomputation's pack hook walks the holders in the same
# order and puts the recomputed tensor into the holder's slot for that graph task -- only if
# the holder is still alive (a holder whose part of the graph was already freed is skipped).
# Each unpack takes its tensor out of the slot, so a recomputed tensor is freed as soon as the
# node that needed it has used it, even with retain_graph=True. A second backward over a
# retained graph is a new graph task and recomputes again.
#
# Invariants:
#   1. holders[i] of a frame corresponds to the i-th tensor saved inside the region, in the
#      forward and in every recomputation (checked by the determinism check);
#   2. a slot is filled at most once per graph task and emptied by its unpack;
#   3. nothing but holders is kept from the forward; the frame does not own the holders.


class _Holder:
    __slots__ = ("slots", "__weakref__")

    def __init__(self) -> None:
        self.slots: dict[Hashable, torch.Tensor] | None = None


# NOTE [ Nested checkpoints ]
#
# A region's inputs are kept as SavedVariables created while the *enclosing* hooks are active.
# When a checkpoint runs inside another one, its inputs are therefore holders of the outer
# region: to rebuild them, backward recomputes the outer region first. Tensors saved inside the
# inner region belong to the inner region only. So unpacking any tensor recomputes exactly the
# regions that enclosed it, outermost first, each once per graph task.
#
# A recomputation runs as if no other region were active (region depth restarts at 1), and
# checkpoints met while recomputing are honoured like in the forward, so both runs save the
# same tensors in the same order.


class Frame:
    """Everything one call of ``checkpoint`` needs to recompute its region later.

    The frame object is itself the forward pack hook (``__call__``), and ``unpack`` its unpack
    hook. ``_checkpoint_internal`` and ``_user_hooks`` follow the attribute protocol torch's
    selective-checkpoint modes use to tell checkpoint hooks apart from a user's own
    ``saved_tensors_hooks`` (such as ``save_on_cpu``).
    """

    _checkpoint_internal = True

    __slots__ = (
        "fn",
        "label",
        "args",
        "kwargs",
        "spec",
        "leaves",
        "tensor_pos",
        "same_as",
        "saved",
        "holders",
        "metas",
        "early_stop",
        "rng",
        "batchnorms",
        "autocast",
        "settings",
        "recompute_ctx",
        "device_ctx",
        "done",
        "forward_done",
        "ignore_count",
        "logs",
        "_user_hooks",
        "__weakref__",
    )

    def __call__(self, x: torch.Tensor) -> _Holder:  # pack hook of the original forward
        holder = _Holder()
        self.holders.append(weakref.ref(holder))
        metas = self.metas
        if metas is not None:
            metas.append((x.shape, x.dtype, x.device))
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        gid = _current_graph_id()
        if gid not in self.done:
            _recompute(self, gid)
        slots = holder.slots
        tensor = None if slots is None else slots.pop(gid, None)
        if tensor is None:
            raise CheckpointError(
                f"vision_ckpt.checkpoint: in region {region_name(self)}, backward asked for "
                "a saved tensor that this backward pass already used, or that the "
                "recomputation did not produce. A custom autograd.Function must read "
                "ctx.saved_tensors only once per backward; if the region saves fewer tensors "
                f"when recomputed, make it deterministic. {_FIX_TIP}"
            )
        return tensor

    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tensors = [s.unpack() for s in self.saved] if self.saved else []
        if self.same_as is not None:  # one tensor passed in several places: one object again
            tensors = [tensors[i] for i in self.same_as]
        if self.spec is None:
            if not tensors:
                return self.args, self.kwargs
            args = list(self.args)
            for pos, t in zip(self.tensor_pos, tensors, strict=True):
                args[pos] = t
            return tuple(args), self.kwargs
        leaves = list(self.leaves)
        for pos, t in zip(self.tensor_pos, tensors, strict=True):
            leaves[pos] = t
        return tree_unflatten(leaves, self.spec)


def _current_graph_id() -> Hashable:
    group = _compat.graph_exec_group()
    if group is not None:
        # The group object itself, not id(group): an id can be reused once a group is freed,
        # and a frame that remembered it would skip the recomputation a new group needs.
        return group
    gid = _graph_task_id()
    if gid == -1:  # unpacked outside of a backward pass: every such access recomputes
        gid = next(_anonymous_graph_ids)
    return gid


class _RecomputePack:
    """Pack hook active while a frame is recomputed for one graph task."""

    _checkpoint_internal = True
    __slots__ = ("frame", "gid", "count", "expected", "_user_hooks")

    def __init__(self, frame: Frame, gid: Hashable) -> None:
        self.frame = frame
        self.gid = gid
        self.count = 0
        self.expected = len(frame.holders)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # What this hook returns is what the recomputation's own graph saves. It must be
        # detached: an op that saves its own output (exp, softmax, in-place ReLU) would otherwise
        # hold a tensor whose grad_fn is that op itself -- a C++ reference cycle that Python's
        # garbage collector cannot see, leaking one tensor per such op and step.
        if x.requires_grad:
            x = x.detach()
        frame = self.frame
        index = self.count
        self.count = index + 1
        if index >= self.expected:
            if not frame.forward_done:
                # A backward inside the region's own forward: the region has not finished
                # saving yet, so more tensors than known so far is expected.
                frame.ignore_count = True
                return x
            raise CheckpointError(
                f"vision_ckpt.checkpoint: region {region_name(frame)} saved more tensors "
                f"for backward when recomputed than in its original forward ({self.expected}). "
                f"The region ran different operations the second time. {_FIX_TIP}"
            )
        holder = frame.holders[index]()
        if holder is not None:
            slots = holder.slots
            if slots is None:
                holder.slots = slots = {}
            internal_assert(self.gid not in slots, "a holder was filled twice in one backward")
            slots[self.gid] = x
        if frame.early_stop and index + 1 == self.expected:
            raise _StopRecomputation
        return x


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _recompute(frame: Frame, gid: Hashable) -> None:
    args, kwargs = frame.inputs()
    pack = _RecomputePack(frame, gid)
    state = thread_state
    outer_depth = state.region_depth
    grad_was_enabled = torch.is_grad_enabled()
    # The buffer copies are made before the recompute contexts are entered: a selective-
    # checkpoint mode in recompute_ctx must see exactly the region's own operators.
    mark = enter_bn_guard(frame.batchnorms)
    rng_now = swap_rng(frame.rng) if frame.rng is not None else None
    contexts = _recompute_contexts(frame)
    stack = contextlib.ExitStack() if contexts else None
    try:
        if stack is not None:
            for ctx in contexts:
                stack.enter_context(ctx)
        _compat.set_grad_enabled(True)
        state.region_depth = 1  # see NOTE [ Nested checkpoints ]
        state.recompute_depth += 1
        pack._user_hooks = _user_saved_tensors_hooks()
        _push_hooks(pack, _identity)
        try:
            frame.fn(*args, **kwargs)
        except _StopRecomputation:
            pass
        finally:
            _pop_hooks()
            del pack._user_hooks
            state.recompute_depth -= 1
            state.region_depth = outer_depth
            _compat.set_grad_enabled(grad_was_enabled)
    finally:
        if stack is not None:
            stack.close()
        if rng_now is not None:
            swap_rng(rng_now)
        exit_bn_guard(frame.batchnorms, mark)
    frame.done.add(gid)
    _check_recomputed(frame, pack)


def _recompute_contexts(frame: Frame) -> list[Any]:
    contexts: list[Any] = []
    device_type = frame.autocast[0] if frame.autocast is not None else "cuda"
    autocast_contexts(frame.autocast, device_type, contexts)
    if frame.settings != capture_settings():  # NOTE [ Settings that choose kernels ] in _call_state
        contexts.append(KernelSettings(frame.settings))
    if frame.device_ctx is not None:
        contexts.append(torch.device(frame.device_ctx))
    if frame.recompute_ctx is not None:
        contexts.append(frame.recompute_ctx)
    return contexts


def _check_recomputed(frame: Frame, pack: _RecomputePack) -> None:
    if frame.metas is None or frame.ignore_count:
        return
    try:
        if pack.count != pack.expected:
            raise CheckpointError(
                f"vision_ckpt.checkpoint: region {region_name(frame)} saved {pack.expected} "
                f"tensors for backward in its original forward but {pack.count} when recomputed "
                f"for backward. The region ran different operations the second time. {_FIX_TIP}"
            )
        differences = []
        for index, ref in enumerate(frame.holders):
            holder = ref()
            if holder is None or not holder.slots or pack.gid not in holder.slots:
                continue
            x = holder.slots[pack.gid]
            now = (x.shape, x.dtype, x.device)
            before = frame.metas[index]
            if now != before:
                differences.append(_describe_difference(index, before, now))
        if differences:
            raise CheckpointError(
                f"vision_ckpt.checkpoint: region {region_name(frame)} recomputed tensors "
                "that differ from the ones its original forward saved:\n  "
                + "\n  ".join(differences)
                + f"\n{_FIX_TIP}"
            )
    except CheckpointError as error:
        if frame.logs is not None:
            raise CheckpointError(f"{error}\n\n{frame.logs.report()}") from None
        raise


def _describe_difference(index: int, before: tuple[Any, ...], now: tuple[Any, ...]) -> str:
    parts = []
    for label, a, b in zip(("shape", "dtype", "device"), before, now, strict=True):
        if a != b:
            a_text = tuple(a) if label == "shape" else a
            b_text = tuple(b) if label == "shape" else b
            parts.append(f"{label} {a_text} in the forward but {b_text} when recomputed")
    return f"saved tensor #{index}: " + ", ".join(parts)


def region_label(fn: Any) -> str:
    """The plain name of a checkpointed callable: the module's class, ``Class.method`` for a
    module's bound method (also inside a ``functools.partial``), or the function's qualified
    name."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None and callable(inner):
        return region_label(inner)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__}.{getattr(fn, '__name__', 'forward')}"
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def region_name(frame: Frame) -> str:
    """The region as error messages quote it: ``'blocks.3'`` (a label its caller gave),
    ``'Block' (module)``, ``'Block.forward'``."""
    if frame.label is not None:
        return repr(frame.label)
    text = repr(region_label(frame.fn))
    if isinstance(frame.fn, torch.nn.Module):
        text += " (module)"
    return text


class _OpLog(_compat.TorchDispatchMode):
    """Records every operator with its output shapes and the user code line that ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.detach.default:  # the recomputation detaches what it stores
            return out
        shapes = [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.lines.append(f"{func} -> {shapes}  [{_user_frame()}]")
        return out


# The checkpoint core's own files: a frame in one of them is never the user code that ran an op.
_CORE_FILES = tuple(
    f"vision_ckpt/runtime/{name}.py"
    for name in ("_core", "_frame", "_call_state", "_saved_inputs", "_chain")
)


def _user_frame() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and not path.endswith(_CORE_FILES):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class DebugLogs:
    def __init__(self) -> None:
        self.forward = _OpLog()
        self.recompute = _OpLog()

    def report(self) -> str:
        fwd, rec = self.forward.lines, self.recompute.lines
        first = next(
            (
                i
                for i, (a, b) in enumerate(zip(fwd, rec, strict=False))
                if a.split("  [")[0] != b.split("  [")[0]
            ),
            min(len(fwd), len(rec)),
        )

        def block(lines: list[str]) -> str:
            return "\n".join(f"  {i:4d}  {line}" for i, line in enumerate(lines)) or "  (none)"

        return (
            "debug=True: operators of both runs (the recomputation may stop early once it has "
            f"every saved tensor back); they first differ at operator #{first}.\n"
            f"Operators run in the original forward ({len(fwd)}):\n{block(fwd)}\n"
            f"Operators run in the recomputation ({len(rec)}):\n{block(rec)}"
        )


def check_inputs_unwritten(frame: Frame, tensors: list[Any], versions: list[int]) -> None:
    """Refuse a region that wrote one of its inputs in place during its forward."""
    # NOTE [ Inputs written by their region ]
    # The recomputation starts from the inputs the region was called with. A region whose
    # forward writes one of them in place (it begins with Dropout(inplace=True) or
    # ReLU(inplace=True), as torchvision's MNASNet classifier does) leaves only the written
    # values to start from; autograd would refuse the saved input in backward with a message
    # that names no region. Offloaded inputs are copied before the forward and are unaffected.
    for i, (t, before) in enumerate(zip(tensors, versions, strict=True)):
        if t._version != before and not isinstance(frame.saved[i], HostCopy):
            raise CheckpointError(
                f"vision_ckpt.checkpoint: region {region_name(frame)} wrote its input "
                f"{i} (a tensor of shape {list(t.shape)}) in place during its forward, so its "
                "recomputation cannot start from the values it was called with. An in-place "
                "layer at its start (Dropout(inplace=True), ReLU(inplace=True)) does this. "
                "Checkpoint a span that begins after that layer, make the layer out of place "
                "(inplace=False), or leave this module out with a rule of level 0."
            )


def blank_frame(function: Callable[..., Any], label: str | None, check: bool) -> Frame:
    """A frame with nothing saved yet; the caller fills in the inputs and the call's state."""
    frame = Frame()
    frame.fn = function
    frame.label = label
    frame.holders = []
    frame.metas = [] if check else None
    frame.early_stop = True
    frame.done = set()
    frame.forward_done = False
    frame.ignore_count = False
    frame.recompute_ctx = None
    frame.logs = None
    frame.same_as = None
    frame.device_ctx = _compat.default_device() if _compat.torch_function_modes_active() else None
    frame.settings = capture_settings()  # beside the autocast state, which needs the device
    return frame
