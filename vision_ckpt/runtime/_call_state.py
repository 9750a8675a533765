"""The state around a region's call that its recomputation must see again.

Owns the checkpoint core's per-thread bookkeeping (how many regions run on this thread, and how
many are being recomputed), and what a region captures when it is called and reinstates while it
is recomputed: the RNG states (NOTE [ RNG state ]), the autocast state, the switches that choose
kernels (NOTE [ Settings that choose kernels ]), and fresh copies of the running statistics of
its BatchNorm layers, so that the recomputation does not update them a second time (NOTE
[ Stateful modules during recomputation ]). It knows nothing of frames or saved-tensor hooks
(``_frame``) and nothing of levels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from .._compat import disable_current_modes

__all__ = [
    "ThreadState",
    "thread_state",
    "stash_rng",
    "swap_rng",
    "accelerator_type",
    "capture_autocast",
    "autocast_contexts",
    "capture_settings",
    "settle_settings",
    "KernelSettings",
    "has_running_stats",
    "region_module",
    "region_batchnorms",
    "enter_bn_guard",
    "exit_bn_guard",
]

_NormBase = torch.nn.modules.batchnorm._NormBase


class ThreadState(threading.local):
    """Per-thread bookkeeping. Autograd may run backward on its own threads (one per device)."""

    # Set per thread in __init__, not as class defaults: torch.compile guards on the instance's
    # __dict__, and an attribute first assigned inside a compiled frame invalidates that guard.
    def __init__(self) -> None:
        self.region_depth = 0  # checkpointed regions running forward or recomputation here
        self.recompute_depth = 0  # recomputations running on this thread
        self.bn_stash: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []


thread_state = ThreadState()


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


def stash_rng(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[Any, int, Any]]]:
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


def swap_rng(
    rng: tuple[torch.Tensor, list[tuple[Any, int, Any]]],
) -> tuple[torch.Tensor, list[tuple[Any, int, Any]]]:
    """Install the given RNG states; returns the states that were current, to swap back later."""
    cpu_state, device_states = rng
    current = torch.get_rng_state(), [(m, i, m.get_rng_state(i)) for m, i, _ in device_states]
    torch.set_rng_state(cpu_state)
    for module, index, state in device_states:
        module.set_rng_state(state, index)
    return current


def accelerator_type(tensors: list[torch.Tensor]) -> str:
    for t in tensors:
        if not (t.is_cpu or t.is_meta):
            return t.device.type
    return "cuda"


def capture_autocast(device_type: str) -> tuple[Any, ...] | None:
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
# used. So every region reads these switches when it is called (``capture_settings``, next to
# the autocast state), and its recomputation sets back those that differ and restores the
# current ones afterwards (``KernelSettings``). Invariant: the recomputation runs under the settings
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


def capture_settings() -> tuple[Any, ...]:
    """The kernel-choosing switches now (NOTE [ Settings that choose kernels ])."""
    return tuple(_read(get) for get, _ in _SETTINGS)


def settle_settings(frame: Any) -> None:
    """After a region's forward: the switches it ended under are the ones it is recomputed
    under (NOTE [ Settings that choose kernels ])."""
    frame.settings = capture_settings()


class KernelSettings:
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


def autocast_contexts(state: tuple[Any, ...] | None, device_type: str, out: list[Any]) -> None:
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


def has_running_stats(module: torch.nn.Module) -> bool:
    """BatchNorm/InstanceNorm (``_NormBase``), or any module owning running-statistics buffers
    (timm's BatchNormAct2d and EvoNorm variants, custom norms following torch's naming)."""
    if isinstance(module, _NormBase):
        return True
    buffers = module._buffers
    return bool(buffers) and any(buffers.get(k) is not None for k in _BN_BUFFERS)


_UNKNOWN_MODULES: list[torch.nn.Module] = []  # sentinel: the region's modules are not known


def region_module(fn: Any, module: torch.nn.Module | None) -> torch.nn.Module | None:
    """The module a region runs: the one its caller named, else ``fn`` itself or the module
    ``fn`` is a bound method of; ``None`` when it is not known."""
    if module is None:
        module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return module if isinstance(module, torch.nn.Module) else None


def region_batchnorms(fn: Any, module: torch.nn.Module | None) -> list[torch.nn.Module]:
    module = region_module(fn, module)
    if module is None:
        return _UNKNOWN_MODULES
    found: list[torch.nn.Module] = [module] if has_running_stats(module) else []
    _collect_batchnorms(module, found)
    return found


def _collect_batchnorms(module: torch.nn.Module, found: list[torch.nn.Module]) -> None:
    # A plain walk over _modules: named_modules() builds prefix strings we do not need.
    for child in module._modules.values():
        if child is not None:
            if has_running_stats(child):
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
    if thread_state.recompute_depth and has_running_stats(module):
        # The copies are bookkeeping, not part of the region: hide them from dispatch modes
        # (a selective-checkpoint mode would otherwise expect a matching op in the forward).
        with disable_current_modes():
            originals = _swap_in_copies(module)
        if originals is not None:
            thread_state.bn_stash.append((module, originals))


def _bn_post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    stash = thread_state.bn_stash
    if thread_state.recompute_depth and stash and has_running_stats(module):
        for i in range(len(stash) - 1, -1, -1):
            if stash[i][0] is module:
                module._buffers.update(stash.pop(i)[1])
                break


_bn_handles: list[Any] = []
_bn_users = 0
_bn_lock = threading.Lock()


def enter_bn_guard(batchnorms: list[torch.nn.Module]) -> int:
    """Swap BatchNorm buffers for copies; returns the stash mark to pass to ``exit_bn_guard``."""
    global _bn_users
    stash = thread_state.bn_stash
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


def exit_bn_guard(batchnorms: list[torch.nn.Module], mark: int) -> None:
    global _bn_users
    stash = thread_state.bn_stash
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
