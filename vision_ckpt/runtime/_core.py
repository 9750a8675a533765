"""The bundled non-reentrant activation checkpoint.

``checkpoint(fn, *args, **kwargs)`` runs ``fn`` without keeping the tensors autograd would save
for backward; backward recomputes them, only as far as it needs, and frees each one as soon as it
is used. It is a drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``
built directly on saved-tensor hooks, and it knows nothing about levels: the wrapper and the plan
layers above decide *what* is checkpointed, this module only does it.

Where it differs from torch's implementation, it does so on purpose:

* BatchNorm running statistics are not updated a second time by the recomputation
  (see NOTE [ Stateful modules during recomputation ]);
* lists, tuples and dicts passed as arguments are captured as they are at call time, so a caller
  that keeps appending to its list (DenseNet's feature list) does not change what is recomputed
  (see NOTE [ Inputs are captured at call time ]);
* meta tensors never touch an RNG or autocast device module;
* errors name the region (function or module) that failed and say how to fix it;
* the per-call bookkeeping is small: nothing is captured that the call does not need.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as _torch_ckpt

from .. import _compat
from .._compat import disable_current_modes, tree_flatten, tree_unflatten
from ..errors import CheckpointError, internal_assert

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "set_checkpoint_debug_enabled",
    "CheckpointError",
]

_make_saved_tensor = _compat.make_saved_tensor
_push_hooks = _compat.push_saved_tensors_hooks
_pop_hooks = _compat.pop_saved_tensors_hooks
_graph_task_id = _compat.graph_task_id
_user_saved_tensors_hooks = _compat.user_saved_tensors_hooks
_top_pack_hook = _compat.top_pack_hook
_NormBase = torch.nn.modules.batchnorm._NormBase

_DETERMINISM_CHECKS = ("default", "none")
_FIX_TIP = (
    "If the region is deliberately data-dependent, pass determinism_check='none'; to see the "
    "operators of both runs, pass debug=True (or wrap the code in "
    "`with vision_ckpt.set_checkpoint_debug_enabled(True):`)."
)


class _ThreadState(threading.local):
    """Per-thread bookkeeping. Autograd may run backward on its own threads (one per device)."""

    # Set per thread in __init__, not as class defaults: torch.compile guards on the instance's
    # __dict__, and an attribute first assigned inside a compiled frame invalidates that guard.
    def __init__(self) -> None:
        self.region_depth = 0  # checkpointed regions running forward or recomputation here
        self.recompute_depth = 0  # recomputations running on this thread
        self.bn_stash: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []


_state = _ThreadState()
_debug_enabled: bool | None = None
_anonymous_graph_ids = itertools.count(-2, -1)


def is_recomputing() -> bool:
    """True while a checkpointed region is being recomputed for backward on this thread.

    Forward hooks, logging and metrics can use it to skip the second run of a region.

    >>> import torch, vision_ckpt
    >>> seen = []
    >>> def f(x):
    ...     seen.append(vision_ckpt.is_recomputing())
    ...     return x.sin().sin()
    >>> vision_ckpt.checkpoint(f, torch.ones(2, requires_grad=True)).sum().backward()
    >>> seen
    [False, True]
    """
    return _state.recompute_depth > 0


def region_depth() -> int:
    """Checkpointed regions currently running (forward or recomputation) on this thread.

    A recomputation starts from depth 1, as if no other region were active, so a decision
    taken from this number is the same in the original forward and in the recomputation.
    While torch.compile traces, regions nested in a region are not counted: the depth only
    tells whether some region runs.
    """
    return _state.region_depth


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Force ``debug`` on (True) or off (False) for every checkpoint started inside the block.

    ``None`` restores the per-call ``debug=`` argument. Only the forward needs to run inside
    the block: the region remembers its setting until backward.

    >>> import torch, vision_ckpt
    >>> with vision_ckpt.set_checkpoint_debug_enabled(True):
    ...     y = vision_ckpt.checkpoint(torch.sin, torch.ones(2, requires_grad=True))
    """
    global _debug_enabled
    previous = _debug_enabled
    _debug_enabled = enabled
    try:
        yield
    finally:
        _debug_enabled = previous


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


class _Frame:
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
                f"vision_ckpt.checkpoint: in region {_region_name(self)}, backward asked for "
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

    def __init__(self, frame: _Frame, gid: Hashable) -> None:
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
                f"vision_ckpt.checkpoint: region {_region_name(frame)} saved more tensors "
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


# NOTE [ RNG state ]
#
# Dropout and drop-path draw from the generators. The recomputation must draw exactly what the
# forward drew, so the forward stashes the CPU generator state, and the state of every
# accelerator device that a tensor argument lives on (only if that device's runtime is already
# initialised: stashing must never initialise CUDA). The recomputation installs the stashed
# states, runs, and puts back the states it found, so the RNG stream seen by the rest of the
# program is the same whether or not a region was recomputed. Meta tensors have no generator
# and are skipped. As with torch, RNG use on a device that no tensor argument lives on is not
# preserved.


def _stash_rng(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[Any, int, Any]]]:
    devices: list[tuple[str, int]] = []
    for t in tensors:
        if t.is_cpu or t.is_meta:
            continue
        dev = t.device
        key = (dev.type, dev.index if dev.index is not None else 0)
        if key not in devices:
            devices.append(key)
    device_states = []
    for dtype_name, index in devices:
        module = getattr(torch, dtype_name, None)
        if module is None or not getattr(module, "is_initialized", lambda: False)():
            continue
        device_states.append((module, index, module.get_rng_state(index)))
    return torch.get_rng_state(), device_states


def _swap_rng(
    rng: tuple[torch.Tensor, list[tuple[Any, int, Any]]],
) -> tuple[torch.Tensor, list[tuple[Any, int, Any]]]:
    """Install the given RNG states; returns the states that were current, to swap back later."""
    cpu_state, device_states = rng
    current = torch.get_rng_state(), [(m, i, m.get_rng_state(i)) for m, i, _ in device_states]
    torch.set_rng_state(cpu_state)
    for module, index, state in device_states:
        module.set_rng_state(state, index)
    return current


def _accelerator_type(tensors: list[torch.Tensor]) -> str:
    for t in tensors:
        if not (t.is_cpu or t.is_meta):
            return t.device.type
    return "cuda"


def _capture_autocast(device_type: str) -> tuple[Any, ...] | None:
    """Autocast state at call time; None when autocast is off on both CPU and the accelerator."""
    cpu_on = torch.is_autocast_enabled("cpu")
    dev_on = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    if not cpu_on and not dev_on:
        return None
    return (
        device_type,
        cpu_on,
        torch.get_autocast_dtype("cpu"),
        dev_on,
        torch.get_autocast_dtype(device_type) if dev_on else None,
        torch.is_autocast_cache_enabled(),
    )


# NOTE [ Settings that choose kernels ]
#
# Besides autocast, global switches decide which kernel an operator runs, and so what it
# computes and saves: the SDPA backends (``torch.nn.attention.sdpa_kernel`` flips the
# flash/mem-efficient/math/cuDNN flags and their priority), deterministic algorithms (and
# warn_only), the float32 matmul precision, cuBLAS's TF32 and reduced-precision reductions, and
# cuDNN's enabled/benchmark/deterministic/TF32 flags. A forward run under
# ``with sdpa_kernel(...)`` whose backward runs outside it would otherwise recompute with another
# kernel: different values, a different set of saved tensors, or a kernel that must not be
# used. So every region reads these switches when it is called (``_capture_settings``, next to
# the autocast state), and its recomputation sets back those that differ and restores the
# current ones afterwards (``_Settings``). Invariant: the recomputation runs under the settings
# its forward ran under, whatever the code around backward set. A switch can also change for
# good inside the forward: on a Hopper GPU torch reordered the SDPA backends' priority during a
# process's first attention call, before choosing its kernel (torch 2.11, an H200), so a region
# read at its call recomputed with another backend than its forward ran (CheckpointError: other
# saved tensors). So the settings are read again when the forward returns and those are the
# ones replayed: a change scoped by a context manager inside the forward is undone by then, a
# change for good is what the forward's operators after it ran under. (Operators before such a
# change that depend on it would be recomputed under the new value; the lazy reorder comes
# before the first attention kernel runs.) A run of sibling calls compares each call with what
# the call before it left. A switch torch refuses to read (a mix of its legacy and new TF32
# APIs) is left as it is. The values are restored through the legacy setters, in the order of
# the table, so the float32 matmul precision is set before the TF32 flag it implies.


_SETTINGS = _compat.KERNEL_SETTINGS
_UNREADABLE = object()


def _read(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except RuntimeError:  # torch refuses a mix of its legacy and new TF32 APIs
        return _UNREADABLE


def _capture_settings() -> tuple[Any, ...]:
    """The kernel-choosing switches now (NOTE [ Settings that choose kernels ])."""
    return tuple(_read(get) for get, _ in _SETTINGS)


def _settle_settings(frame: Any) -> None:
    """After a region's forward: the switches it ended under are the ones it is recomputed
    under (NOTE [ Settings that choose kernels ])."""
    frame.settings = _capture_settings()


class _Settings:
    """Sets back the switches of a region's forward that differ now, and restores them after."""

    __slots__ = ("state", "previous")

    def __init__(self, state: tuple[Any, ...]) -> None:
        self.state = state
        self.previous: list[Any] = []

    def __enter__(self) -> None:
        previous = self.previous = []
        for (get, put), want in zip(_SETTINGS, self.state, strict=True):
            now = _UNREADABLE if want is _UNREADABLE else _read(get)
            if now is _UNREADABLE or now == want:
                previous.append(_UNREADABLE)
            else:
                put(want)
                previous.append(now)

    def __exit__(self, *exc: Any) -> None:
        for (_, put), old in reversed(list(zip(_SETTINGS, self.previous, strict=True))):
            if old is not _UNREADABLE:
                put(old)


def _autocast_contexts(state: tuple[Any, ...] | None, device_type: str, out: list[Any]) -> None:
    """Re-enter the call-time autocast state (also switching off autocast active at backward)."""
    if state is None:
        for kind in ("cpu", device_type):
            if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
                out.append(torch.autocast(kind, enabled=False))
        return
    kind, cpu_on, cpu_dtype, dev_on, dev_dtype, cache = state
    out.append(torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu_on, cache_enabled=cache))
    if torch.amp.is_autocast_available(kind):
        if dev_on:
            out.append(torch.autocast(kind, dtype=dev_dtype, enabled=True, cache_enabled=cache))
        elif torch.is_autocast_enabled(kind):
            out.append(torch.autocast(kind, enabled=False))


# NOTE [ Stateful modules during recomputation ]
#
# Recomputing a region runs its modules' forward a second time. For BatchNorm in training mode
# that forward also updates running_mean, running_var and num_batches_tracked, so a plain
# recomputation counts every batch twice. The same holds for InstanceNorm with running stats and
# for any module that keeps buffers under those names (timm's BatchNormAct2d, EvoNorm); below,
# "BatchNorm" means all of them. During a recomputation each training-mode BatchNorm of
# the region therefore works on fresh copies of its running buffers, and the originals are put
# back when the recomputation ends (also when it stops early or raises): the recomputed
# normalisation, which uses batch statistics in training mode, is unchanged, and the real
# buffers are updated exactly once, by the original forward.
#
# Which BatchNorms belong to the region: when the region is a module (or a bound method of one,
# or the ``module`` its caller names), its BatchNorm submodules, found once at forward time.
# For any other callable the region's modules are unknown, so while such a recomputation runs a
# global forward pre-hook swaps the buffers of every training-mode BatchNorm it meets on this
# thread and the matching forward hook swaps them back. The global hooks exist only while such a
# recomputation runs, so ordinary forwards keep torch's fast module-call path.

_BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _has_running_stats(module: torch.nn.Module) -> bool:
    """BatchNorm/InstanceNorm (``_NormBase``), or any module owning running-statistics buffers
    (timm's BatchNormAct2d and EvoNorm variants, custom norms following torch's naming)."""
    if isinstance(module, _NormBase):
        return True
    buffers = module._buffers
    return bool(buffers) and any(buffers.get(k) is not None for k in _BN_BUFFERS)


_UNKNOWN_MODULES: list[torch.nn.Module] = []  # sentinel: the region's modules are not known


def _region_module(fn: Any, module: torch.nn.Module | None) -> torch.nn.Module | None:
    """The module a region runs: the one its caller named, else ``fn`` itself or the module
    ``fn`` is a bound method of; ``None`` when it is not known."""
    if module is None:
        module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return module if isinstance(module, torch.nn.Module) else None


def _region_batchnorms(fn: Any, module: torch.nn.Module | None) -> list[torch.nn.Module]:
    module = _region_module(fn, module)
    if module is None:
        return _UNKNOWN_MODULES
    found: list[torch.nn.Module] = [module] if _has_running_stats(module) else []
    _collect_batchnorms(module, found)
    return found


def _collect_batchnorms(module: torch.nn.Module, found: list[torch.nn.Module]) -> None:
    # A plain walk over _modules: named_modules() builds prefix strings we do not need.
    for child in module._modules.values():
        if child is not None:
            if _has_running_stats(child):
                found.append(child)
            _collect_batchnorms(child, found)


def _swap_in_copies(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    if not (module.training and getattr(module, "track_running_stats", True)):
        return None
    buffers = module._buffers
    originals = {k: buffers[k] for k in _BN_BUFFERS if buffers.get(k) is not None}
    for name, tensor in originals.items():
        buffers[name] = tensor.clone()
    return originals


def _bn_pre_hook(module: torch.nn.Module, args: Any) -> None:
    if _state.recompute_depth and _has_running_stats(module):
        # The copies are bookkeeping, not part of the region: hide them from dispatch modes
        # (a selective-checkpoint mode would otherwise expect a matching op in the forward).
        with disable_current_modes():
            originals = _swap_in_copies(module)
        if originals is not None:
            _state.bn_stash.append((module, originals))


def _bn_post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    stash = _state.bn_stash
    if _state.recompute_depth and stash and _has_running_stats(module):
        for i in range(len(stash) - 1, -1, -1):
            if stash[i][0] is module:
                module._buffers.update(stash.pop(i)[1])
                break


_bn_handles: list[Any] = []
_bn_users = 0
_bn_lock = threading.Lock()


def _enter_bn_guard(batchnorms: list[torch.nn.Module]) -> int:
    """Swap BatchNorm buffers for copies; returns the stash mark to pass to ``_exit_bn_guard``."""
    global _bn_users
    stash = _state.bn_stash
    mark = len(stash)
    if batchnorms is _UNKNOWN_MODULES:
        with _bn_lock:
            _bn_users += 1
            if _bn_users == 1:
                register = torch.nn.modules.module
                _bn_handles.append(register.register_module_forward_pre_hook(_bn_pre_hook))
                _bn_handles.append(register.register_module_forward_hook(_bn_post_hook))
    else:
        for module in batchnorms:
            originals = _swap_in_copies(module)
            if originals is not None:
                stash.append((module, originals))
    return mark


def _exit_bn_guard(batchnorms: list[torch.nn.Module], mark: int) -> None:
    global _bn_users
    stash = _state.bn_stash
    while len(stash) > mark:
        module, originals = stash.pop()
        module._buffers.update(originals)
    if batchnorms is _UNKNOWN_MODULES:
        with _bn_lock:
            _bn_users -= 1
            if _bn_users == 0:
                for handle in _bn_handles:
                    handle.remove()
                _bn_handles.clear()


def _recompute(frame: _Frame, gid: Hashable) -> None:
    args, kwargs = frame.inputs()
    pack = _RecomputePack(frame, gid)
    state = _state
    outer_depth = state.region_depth
    grad_was_enabled = torch.is_grad_enabled()
    # The buffer copies are made before the recompute contexts are entered: a selective-
    # checkpoint mode in recompute_ctx must see exactly the region's own operators.
    mark = _enter_bn_guard(frame.batchnorms)
    rng_now = _swap_rng(frame.rng) if frame.rng is not None else None
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
            _swap_rng(rng_now)
        _exit_bn_guard(frame.batchnorms, mark)
    frame.done.add(gid)
    _check_recomputed(frame, pack)


def _recompute_contexts(frame: _Frame) -> list[Any]:
    contexts: list[Any] = []
    device_type = frame.autocast[0] if frame.autocast is not None else "cuda"
    _autocast_contexts(frame.autocast, device_type, contexts)
    if frame.settings != _capture_settings():  # NOTE [ Settings that choose kernels ]
        contexts.append(_Settings(frame.settings))
    if frame.device_ctx is not None:
        contexts.append(torch.device(frame.device_ctx))
    if frame.recompute_ctx is not None:
        contexts.append(frame.recompute_ctx)
    return contexts


def _check_recomputed(frame: _Frame, pack: _RecomputePack) -> None:
    if frame.metas is None or frame.ignore_count:
        return
    try:
        if pack.count != pack.expected:
            raise CheckpointError(
                f"vision_ckpt.checkpoint: region {_region_name(frame)} saved {pack.expected} "
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
                f"vision_ckpt.checkpoint: region {_region_name(frame)} recomputed tensors "
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


def _region_name(frame: _Frame) -> str:
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


def _user_frame() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and not path.endswith("vision_ckpt/runtime/_core.py"):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class _DebugLogs:
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


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    Backward recomputes the region (with the RNG and autocast state of the original call) only as
    far as it needs, and frees each recomputed tensor once used. Outputs and gradients are exactly
    those of the plain call. Same semantics as
    ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, ...)``.

    Args:
        function: the region: any callable, typically an ``nn.Module`` or a block's method.
        *args: positional arguments; tensors may also sit inside (nested) lists, tuples and
            dicts, which are captured as they are at call time.
        use_reentrant: accepted for drop-in compatibility; only ``False``/``None`` are supported.
        preserve_rng_state: stash and restore the RNG state so dropout and drop-path draw the same
            values when recomputed. ``False`` saves a little time for regions without randomness.
        context_fn: returns two context managers, entered around the forward and around the
            recomputation (e.g. ``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
        determinism_check: ``"default"`` compares shape, dtype and device of every recomputed
            tensor with the forward's; ``"none"`` skips that check.
        debug: record the operators of both runs and add them to any ``CheckpointError``.
        early_stop: stop the recomputation as soon as every saved tensor is back.
        **kwargs: keyword arguments for ``function``.

    Returns:
        Whatever ``function`` returns.

    Raises:
        CheckpointError: the recomputation saved different tensors than the forward.
        ValueError: an unsupported ``use_reentrant`` or ``determinism_check``.

    >>> import torch, vision_ckpt
    >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = vision_ckpt.checkpoint(block, x)
    >>> y.sum().backward()
    >>> x.grad.shape
    torch.Size([4, 8])
    """
    options = _Options(
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
    )
    return _run(function, args, kwargs, options)


def checkpoint_region(
    function: Callable[..., Any],
    *args: Any,
    module: torch.nn.Module | None,
    label: str,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    offload: bool = False,
    **kwargs: Any,
) -> Any:
    """:func:`checkpoint` for vision_ckpt's own callers (the wrapper and installed forwards),
    which know what the region is. ``module``: the module whose BatchNorm statistics the
    recomputation must not update again (NOTE [ Stateful modules during recomputation ]);
    ``label``: the name errors quote (``'blocks.3'``, ``'blocks[0:4]'``); ``offload``: keep
    the CUDA inputs in pinned host memory (NOTE [ Offloaded inputs ])."""
    options = _Options(
        module=module,
        label=label,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        offload=offload,
    )
    return _run(function, args, kwargs, options)


@dataclass(frozen=True, slots=True)
class _Options:
    """How one call checkpoints its region: what :func:`checkpoint` or
    :func:`checkpoint_region` was given besides the region and its arguments."""

    module: torch.nn.Module | None = None
    """The module whose BatchNorm statistics the recomputation must not update again; ``None``:
    what the region shows (NOTE [ Stateful modules during recomputation ])."""
    label: str | None = None
    """The region's name in errors; ``None``: derived from the region."""
    use_reentrant: bool | None = None
    """Accepted for compatibility; only ``False``/``None`` run (``True`` is an error in eager)."""
    preserve_rng_state: bool = True
    """Stash and restore the RNG state around the recomputation (NOTE [ RNG state ])."""
    context_fn: Callable[[], tuple[Any, Any]] | None = None
    """The contexts entered around the forward and the recomputation, or ``None``."""
    determinism_check: str = "default"
    """``"default"``: compare shape, dtype and device of every recomputed tensor; ``"none"``."""
    debug: bool = False
    """Record the operators of both runs for errors."""
    early_stop: bool = True
    """Stop the recomputation as soon as every saved tensor is back."""
    offload: bool = False
    """Keep the CUDA inputs in pinned host memory (NOTE [ Offloaded inputs ])."""


def traced_region_is_exact(function: Callable[..., Any], module: torch.nn.Module | None) -> bool:
    """Whether torch's compiled checkpoint runs this region as eager would: not where this
    torch updates BatchNorm statistics twice in it (``_compat.COMPILED_CHECKPOINT_KEEPS_
    BATCHNORM``) and the region holds a BatchNorm in training mode."""
    if _compat.COMPILED_CHECKPOINT_KEEPS_BATCHNORM:
        return True
    module = _region_module(function, module)
    if module is None:
        return False  # its modules are not known: assume the worst
    return not any(m.training and _has_running_stats(m) for m in module.modules())


def _run(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: _Options,
) -> Any:
    """Call ``function(*args, **kwargs)`` as one checkpointed region: save its inputs and the
    state of the call in a frame, and run the forward under the frame's pack hooks."""
    if torch.compiler.is_compiling() or _proxy_tracing():
        return _run_traced(function, args, kwargs, options)
    _check_options(options)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)

    frame = _blank_frame(function, options.label, check=options.determinism_check == "default")
    tensors = _capture_inputs(frame, args, kwargs)
    debug_on = _debug_enabled if _debug_enabled is not None else options.debug
    frame.early_stop = options.early_stop

    device_type = _accelerator_type(tensors) if tensors else "cuda"
    frame.autocast = _capture_autocast(device_type)
    cuda_was_initialized = getattr(torch.cuda, "_initialized", False)
    frame.rng = _stash_rng(tensors) if options.preserve_rng_state else None
    frame.batchnorms = _region_batchnorms(function, options.module)
    forward_ctx = _region_contexts(frame, options.context_fn, debug_on)
    tensors = _unique_inputs(frame, tensors)
    frame.saved = _offload_inputs(tensors) if options.offload else _save_inputs(tensors)
    versions = [t._version for t in tensors]

    out = _forward(frame, function, args, kwargs, forward_ctx)
    frame.forward_done = True
    _check_inputs_unwritten(frame, tensors, versions)
    if (
        options.preserve_rng_state
        and not cuda_was_initialized
        and getattr(torch.cuda, "_initialized", False)
    ):
        raise CheckpointError(
            f"vision_ckpt.checkpoint: region {_region_name(frame)} initialised CUDA during its "
            "forward, so its CUDA RNG state could not be stashed for the recomputation. "
            "Initialise CUDA before the call (e.g. move the inputs to the GPU first), or pass "
            "preserve_rng_state=False if the region draws no random numbers on the GPU."
        )
    return out


def _check_inputs_unwritten(frame: _Frame, tensors: list[Any], versions: list[int]) -> None:
    """Refuse a region that wrote one of its inputs in place during its forward."""
    # NOTE [ Inputs written by their region ]
    # The recomputation starts from the inputs the region was called with. A region whose
    # forward writes one of them in place (it begins with Dropout(inplace=True) or
    # ReLU(inplace=True), as torchvision's MNASNet classifier does) leaves only the written
    # values to start from; autograd would refuse the saved input in backward with a message
    # that names no region. Offloaded inputs are copied before the forward and are unaffected.
    for i, (t, before) in enumerate(zip(tensors, versions, strict=True)):
        if t._version != before and not isinstance(frame.saved[i], _HostCopy):
            raise CheckpointError(
                f"vision_ckpt.checkpoint: region {_region_name(frame)} wrote its input "
                f"{i} (a tensor of shape {list(t.shape)}) in place during its forward, so its "
                "recomputation cannot start from the values it was called with. An in-place "
                "layer at its start (Dropout(inplace=True), ReLU(inplace=True)) does this. "
                "Checkpoint a span that begins after that layer, make the layer out of place "
                "(inplace=False), or leave this module out with a rule of level 0."
            )


def _run_traced(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: _Options
) -> Any:
    """The region under torch.compile / export tracing: torch's own non-reentrant checkpoint,
    which dynamo and AOTAutograd understand as a higher-order op."""
    # The region counts as running, as in eager, so that regions inside it take the
    # nesting decisions they take in eager (wrapper's NOTE [ Nesting ]): the partitioner
    # recomputes the traced graph, never this code, so forward and recomputation agree.
    # Only the outermost region writes the depth, outside every checkpoint operator: some
    # releases' dynamo refuse a write inside the operator's body (wrapper's NOTE [ The
    # training level under torch.compile ]), and a decision reads only whether it is zero.
    if options.context_fn is not None:
        kwargs["context_fn"] = options.context_fn
    if "early_stop" in _compat.CHECKPOINT_OPTIONS:  # traced, the partitioner decides anyway
        kwargs["early_stop"] = options.early_stop
    state = _state
    outermost = state.region_depth == 0
    if outermost:
        state.region_depth = 1
    try:
        return _torch_ckpt.checkpoint(
            function,
            *args,
            use_reentrant=False,
            preserve_rng_state=options.preserve_rng_state,
            determinism_check=options.determinism_check,
            debug=options.debug,
            **kwargs,
        )
    finally:
        if outermost:
            state.region_depth = 0


def _check_options(options: _Options) -> None:
    """ValueError for a reentrant call or an unknown determinism check (eager only)."""
    if options.use_reentrant:
        raise ValueError(
            "vision_ckpt.checkpoint is the non-reentrant checkpoint; got use_reentrant=True. "
            "Pass use_reentrant=False (or leave it out), or call "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=True) for the reentrant variant."
        )
    if options.determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"vision_ckpt.checkpoint: determinism_check={options.determinism_check!r} is not "
            f"supported; expected one of {list(_DETERMINISM_CHECKS)}."
        )


def _capture_inputs(frame: _Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Record in ``frame`` how to rebuild the region's arguments; return their tensors in order."""
    # NOTE [ Inputs are captured at call time ]
    # Tensor arguments are kept as SavedVariables (so enclosing regions and user hooks see them,
    # and in-place changes after the call are detected), and every list/tuple/dict around them is
    # flattened now and rebuilt for the recomputation. A container the caller mutates after the
    # call (DenseNet appends each new feature map to the list it passed) thus cannot change what
    # the recomputation sees. Plain positional arguments skip the flattening.
    tensors: list[torch.Tensor]
    simple = not kwargs
    if simple:
        for a in args:
            if isinstance(a, (list, tuple, dict)):
                simple = False
                break
    if simple:
        frame.spec = None
        frame.args = args
        frame.kwargs = {}
        frame.tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        tensors = [args[i] for i in frame.tensor_pos]
        if tensors:
            rest = list(args)
            for i in frame.tensor_pos:
                rest[i] = None
            frame.args = tuple(rest)
    else:
        leaves, frame.spec = tree_flatten((args, kwargs))
        frame.tensor_pos = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
        tensors = [leaves[i] for i in frame.tensor_pos]
        for i in frame.tensor_pos:
            leaves[i] = None
        frame.leaves = leaves
    return tensors


def _region_contexts(
    frame: _Frame, context_fn: Callable[[], tuple[Any, Any]] | None, debug_on: bool
) -> Any:
    """The context to run the forward in, or ``None``; the recomputation's goes to ``frame``,
    each with the operator log around it when debugging."""
    forward_ctx = recompute_ctx = None
    if context_fn is not None:
        forward_ctx, recompute_ctx = context_fn()
    frame.logs = None
    if debug_on:
        frame.logs = _DebugLogs()
        forward_ctx = _stacked(frame.logs.forward, forward_ctx)
        recompute_ctx = _stacked(frame.logs.recompute, recompute_ctx)
    frame.recompute_ctx = recompute_ctx
    return forward_ctx


def _unique_inputs(frame: _Frame, tensors: list[Any]) -> list[Any]:
    """``tensors`` with each tensor once; ``frame`` records where each one recurs."""
    # NOTE [ Repeated tensor arguments ]
    # A tensor passed in several places (MultiheadAttention(x, x, x)) is saved once and handed
    # back as one object in all of them: code that tests identity (``query is key``) must take
    # the same path when recomputed, or it saves different tensors.
    frame.same_as = None
    if len(tensors) > 1:
        index_of: dict[int, int] = {}
        unique: list[torch.Tensor] = []
        same_as = []
        for t in tensors:
            index = index_of.get(id(t))
            if index is None:
                index = index_of[id(t)] = len(unique)
                unique.append(t)
            same_as.append(index)
        if len(unique) < len(tensors):
            frame.same_as = same_as
            tensors = unique
    return tensors


def _forward(
    frame: _Frame,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    forward_ctx: Any,
) -> Any:
    """Run the region's forward under ``frame``'s pack hooks (and ``forward_ctx``)."""
    state = _state
    state.region_depth += 1
    frame._user_hooks = _user_saved_tensors_hooks()
    _push_hooks(frame, frame.unpack)
    finished = False
    try:
        if forward_ctx is None:
            out = function(*args, **kwargs)
            finished = True
        else:
            with forward_ctx:
                out = function(*args, **kwargs)
                finished = True
    finally:
        _pop_hooks()
        del frame._user_hooks
        state.region_depth -= 1
    if not finished:  # the forward context swallowed an exception raised by the region
        raise CheckpointError(
            f"vision_ckpt.checkpoint: the forward context from context_fn suppressed an exception "
            f"raised inside region {_region_name(frame)}; checkpoint has no output to return. "
            "Let the exception propagate from the context manager."
        )
    _settle_settings(frame)
    return out


def _blank_frame(function: Callable[..., Any], label: str | None, check: bool) -> _Frame:
    """A frame with nothing saved yet; the caller fills in the inputs and the call's state."""
    frame = _Frame()
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
    frame.settings = _capture_settings()  # beside the autocast state, which needs the device
    return frame


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


class _HostCopy:
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


def _offload_inputs(tensors: list[torch.Tensor]) -> list[Any]:
    """The region's inputs, those on CUDA as pinned host copies (NOTE [ Offloaded inputs ])."""
    offload = [_offloadable(t) for t in tensors]
    kept = iter(_save_inputs([t for t, off in zip(tensors, offload, strict=True) if not off]))
    return [
        _HostCopy(t, pin=True) if off else next(kept)
        for t, off in zip(tensors, offload, strict=True)
    ]


def _save_inputs(tensors: list[torch.Tensor]) -> list[Any]:
    """The region's tensor inputs as SavedVariables of the enclosing hooks (NOTE [ Nested
    checkpoints ]), through ``_make_saved_tensor`` where torch has it."""
    if _make_saved_tensor is not None:
        return [_make_saved_tensor(t, is_output=False) for t in tensors]
    return _save_with_function(tensors)


_proxy_tracing = _compat.proxy_tracing


def compiling() -> bool:
    """True while torch.compile or export traces the running code: dynamo, or AOTAutograd
    running a region's higher-order op on functional or proxy tensors (where a region's
    ``context_fn`` is called). Code that must hand torch something it can trace checks this.

    >>> compiling()
    False
    """
    if torch.compiler.is_compiling() or _proxy_tracing():
        return True
    return _compat.functional_tracing()


@contextlib.contextmanager
def _stacked(first: Any, second: Any) -> Iterator[None]:
    with first:
        if second is None:
            yield
        else:
            with second:
                yield


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


def checkpoint_sequential(
    functions: torch.nn.Sequential | list[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run a sequence of modules in ``segments`` chunks, checkpointing all but the last chunk.

    Same semantics as ``torch.utils.checkpoint.checkpoint_sequential``: the last segment runs
    normally because its activations are needed right away by backward.

    Args:
        functions: an ``nn.Sequential`` or a list of callables applied one after the other.
        segments: number of chunks, between 1 and the number of functions.
        input: the input of the first function.
        use_reentrant: only ``False``/``None`` are supported.
        **kwargs: passed to :func:`checkpoint` (``preserve_rng_state``, ``context_fn``, ...).

    >>> import torch, vision_ckpt
    >>> seq = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> vision_ckpt.checkpoint_sequential(seq, 3, x).shape
    torch.Size([2, 4])
    """
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    functions = list(functions)
    count = len(functions)
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= count:
        raise ValueError(
            f"vision_ckpt.checkpoint_sequential: segments={segments!r} is not valid for "
            f"{count} functions; expected an integer from 1 to {count}."
        )

    def run(start: int, end: int) -> Callable[[Any], Any]:
        def forward(x: Any) -> Any:
            for fn in functions[start : end + 1]:
                x = fn(x)
            return x

        forward.__qualname__ = f"checkpoint_sequential[{start}:{end + 1}]"
        return forward

    size = count // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(run(start, end), input, use_reentrant=use_reentrant, **kwargs)
    return run(end + 1, count - 1)(input)


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
                _swap_rng(rng)
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
        frame = _blank_frame(self.replay, label, check=True)
        frame.args, frame.kwargs, frame.spec, frame.tensor_pos = (None,), {}, None, [0]
        self.device_type = _accelerator_type([x])
        frame.autocast = _capture_autocast(self.device_type)
        self.preserve_rng_state = preserve_rng_state
        self.outer = _top_pack_hook()
        batchnorms: list[torch.nn.Module] = []
        for module in modules:
            batchnorms += _region_batchnorms(module, module)
        frame.batchnorms = batchnorms
        frame.saved = _save_inputs([x])
        self.frame = frame

    def same_context(self) -> str | None:
        """``None`` when a call now runs in the context of the first (invariant 2), else what
        differs."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return "grad mode is off"
        if _capture_autocast(self.device_type) != self.frame.autocast:
            return "autocast differs"
        if _capture_settings() != self.frame.settings:
            return (
                "the kernel settings differ (SDPA backends, determinism, matmul precision, cuDNN)"
            )
        if _top_pack_hook() is not self.outer:
            return "it runs inside another checkpointed region (or other saved-tensor hooks)"
        return None

    def run(self, fn: Callable[[Any], Any], x: torch.Tensor) -> Any:
        """Call ``fn(x)`` as the region's next call and return its output."""
        frame = self.frame
        rng = _stash_rng([x]) if self.preserve_rng_state else None
        first = not self.replay.calls
        version = x._version if first else 0  # only the run's input is saved
        if first:
            frame.rng = rng
        state = _state
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
            _check_inputs_unwritten(frame, [x], [version])
        _settle_settings(frame)  # the next member is compared with what this one left
        self.replay.calls.append((fn, rng))
        frame.forward_done = True
        return out
