"""Deterministic memory accounting in bytes (for the demo, benchmarks, tests and the profiler).

Two measurements, both counted from tensor storages (never from the process RSS, which depends on
the allocator, the page cache and whatever else runs on the machine):

* :func:`count_saved_bytes` counts what autograd keeps for backward: the bytes of every distinct
  storage that reaches the pack hook of an outer ``saved_tensors_hooks``.
* :func:`track_peak_memory` follows every storage that tensor operations create while it is
  active and reports the peak of the bytes alive at the same time.

Both give the same numbers on every run of the same program on CPU, so tests can compare them
exactly.

# NOTE [ What track_peak_memory counts ]

A ``TorchDispatchMode`` sees every aten operation that runs while it is active: forward, backward
(the autograd engine runs through the dispatcher too, and carries the mode into backward), the
recomputation of checkpointed regions, factory functions such as ``torch.empty``, the creation
of ``.grad`` and optimizer updates. For each operation:

1. every output tensor whose storage is not yet followed, and is not the storage of one of the
   operation's own tensor arguments, is a new allocation: its ``untyped_storage().nbytes()`` is
   added to the live count, and a weak reference on the storage subtracts it again when the
   storage is freed. A storage is counted once however many views of it exist; views,
   ``detach`` and in-place operations return a storage that is already known, so they add
   nothing.
2. an output whose storage is already followed but changed size (``resize_``, ``out=`` that had
   to grow) updates the count by the difference.
3. after the outputs are accounted, the peak is ``max(peak, live)``. The operation's inputs are
   still alive at that moment, so inputs and outputs are counted together, as they are in memory.

Storages created before entry are invisible to the mode unless they are handed over as *roots*
(modules: parameters, buffers and ``.grad``; optimizers: their state; tensors; or containers of
these): those count as live at entry (``start_bytes``) and, like every followed storage, stop
counting when they are freed. A view made inside the region of a storage that was neither
created inside nor handed over is not counted at all (it is not an allocation).

Not counted: scratch memory an operator allocates internally and frees before returning (it is
not an output), memory outside tensor storages (CUDA workspaces, allocator caching and
fragmentation), tensors of the ``meta`` device, and storages of size zero. On CUDA the result
also carries ``torch.cuda.max_memory_allocated`` figures, which do include the first two.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _compat
from .._compat import TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves

__all__ = [
    "SavedBytes",
    "PeakMemory",
    "count_saved_bytes",
    "track_peak_memory",
    "format_bytes",
]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float) -> str:
    """Format a byte count with binary units, two decimals above 1 KiB.

    Args:
        n: number of bytes (may be negative, e.g. a difference).

    Returns:
        A short human-readable string.

    >>> format_bytes(1536 * 1024)
    '1.50 MiB'
    >>> format_bytes(512)
    '512 B'
    >>> format_bytes(-4 * 2**30)
    '-4.00 GiB'
    """
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(value)} B"
    return f"{sign}{value:.2f} {_UNITS[unit]}"


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t`` itself, or for a wrapper subclass (DTensor, FSDP2 parameters) the plain tensors
    it wraps: only those own storage."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its device mesh
                yield from _plain_tensors(inner)
    else:
        yield t


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``t``, or ``None`` for meta, sparse, empty or storage-less tensors.

    A fake tensor (``FakeTensorMode``) reports the device it stands for and keeps a storage
    on the meta device: that storage is counted like a real one (NOTE [ Fake storages ])."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        if storage.device.type != "meta":
            storage.data_ptr()  # wrapper subclasses hand out an invalid storage that fails here
    except (RuntimeError, NotImplementedError):  # sparse, nested or storage-less subclasses
        return None
    if storage.nbytes() == 0:
        return None
    return storage


# NOTE [ Fake storages ]
#
# Under ``FakeTensorMode`` no memory is allocated: a fake tensor's storage lives on the meta
# device and has no address (reading ``data_ptr`` warns, and every one would read 0). It still is
# one storage object per allocation, shared by views, with its size in bytes, created by the
# operator that made it and released when the last tensor using it goes. So the meters key a
# storage by its address when it has one and by the storage object's own identity
# (``_cdata``, the C++ storage it wraps) when it is fake, and take the device from the tensor,
# which reports the device it stands for. The rules of counting are the same for both, so a
# step run on fake tensors gives the figure the same step gives on real ones.
#
# One operator differs: ``aten.lift_fresh`` hands a tensor that ``torch.tensor`` built outside
# the dispatcher (a constant written into a mask, say) to the operators. On real tensors it
# returns its argument, whose storage no operator created, so nothing is counted; under fake
# tensors it returns a fake copy with a storage of its own. The tracker never counts its output.

_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def _storage_key(storage: torch.UntypedStorage) -> int:
    """What identifies ``storage`` while it lives: its address, or for a fake tensor's storage
    the C++ storage it wraps (NOTE [ Fake storages ])."""
    if storage.device.type == "meta":
        return int(storage._cdata)
    return int(storage.data_ptr())


# --------------------------------------------------------------------------------------------
# Saved-for-backward bytes
# --------------------------------------------------------------------------------------------


@dataclass
class SavedBytes:
    """What autograd saved for backward while :func:`count_saved_bytes` was active.

    The fields grow while the block runs and are final when it exits.
    """

    nbytes: int = 0
    """Bytes of the distinct storages that were packed (each storage counted once)."""
    num_packed: int = 0
    """Number of tensors that reached the pack hook (views of one storage count separately)."""
    num_storages: int = 0
    """Number of distinct storages among them."""
    by_region: dict[Hashable, int] = field(default_factory=dict)
    """With ``count_saved_bytes(region=...)``: ``nbytes`` split by the region that packed each
    storage first."""

    def __str__(self) -> str:
        return (
            f"{format_bytes(self.nbytes)} saved in {self.num_storages} storages "
            f"({self.num_packed} tensors packed)"
        )


@contextlib.contextmanager
def count_saved_bytes(
    *exclude: Any, region: Callable[[], Hashable | None] | None = None
) -> Iterator[SavedBytes]:
    """Count the bytes autograd keeps for backward while the block runs.

    Installs an outer ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook records the
    storage of every tensor saved for backward, counting each storage once, and hands the tensor
    back unchanged (so gradients are not affected).

    Checkpointing composes with it: a checkpointed region installs its own, inner hooks, and
    saved-tensor hooks do not stack (only the innermost pair is called), so what the operators
    inside a region save goes to the region's hooks and is not counted here. What the checkpoint
    keeps for its recomputation is: ``vision_ckpt.checkpoint`` saves the region's tensor inputs
    (also those inside lists, tuples and dicts) as saved variables while the enclosing hooks are
    active, so each distinct input tensor reaches this pack hook once per call (see NOTE
    [ Nested checkpoints ] and NOTE [ Inputs are captured at call time ] in
    ``vision_ckpt.runtime._core``). What the core holds by plain Python reference (RNG states,
    non-tensor arguments) never reaches a pack hook; use :func:`track_peak_memory` for all the
    memory held between forward and backward.

    Storages are counted cumulatively: building and freeing two graphs inside one block counts
    both. A storage freed and a new one at the same address count as two. Meta tensors are
    ignored.

    Args:
        *exclude: tensors, modules or containers (as for :func:`track_peak_memory`'s roots)
            whose storages are not counted: pass the model to count activations only, since
            layers also save their weights for backward.
        region: attributes the bytes to regions. Called at each pack, it returns the region
            running now (any hashable, e.g. the name of the innermost block) or ``None``. Only
            tensors packed while it returns a region are counted (and marked as seen), and
            ``by_region`` gets each storage's bytes under the region that packed it first.

    Yields:
        A :class:`SavedBytes` that is updated as tensors are packed.

    >>> x = torch.ones(256, requires_grad=True)
    >>> with count_saved_bytes() as saved:
    ...     y = x.sin().sum()
    >>> saved.nbytes, saved.num_packed
    (1024, 1)

    A checkpointed region's input is counted; what the region's operators save is not:

    >>> import vision_ckpt
    >>> with count_saved_bytes() as saved:
    ...     y = vision_ckpt.checkpoint(lambda t: t.sin().sin(), x * 2)
    >>> saved.nbytes, saved.num_packed
    (1024, 1)
    """
    result = SavedBytes()
    pack = _saved_bytes_pack_hook(result, _storage_pointers(exclude), region)

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    # pushed through _compat, so that the core sees them on every torch (NOTE [ Saved-tensor
    # hooks seen on older torch ])
    with _compat.saved_tensors_hooks(pack, unpack):
        yield result


def _storage_pointers(exclude: tuple[Any, ...]) -> set[int]:
    """Keys of the storages behind ``exclude`` (as :func:`track_peak_memory`'s roots)."""
    excluded = set()
    for t in _root_tensors(exclude):
        storage = _storage_of(t)
        if storage is not None:
            excluded.add(_storage_key(storage))
    return excluded


def _saved_bytes_pack_hook(
    result: SavedBytes, excluded: set[int], region: Callable[[], Hashable | None] | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The pack hook of :func:`count_saved_bytes`: adds each storage not seen before and not in
    ``excluded`` to ``result``, and hands the tensor back unchanged."""
    # Keyed by data pointer; the weak reference tells a storage seen before from a new storage
    # that reuses the address of a freed one.
    seen: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    # What a pack hook returns is what the saved variable holds. Handing back ``t`` itself, an
    # op that saves its own output (ReLU, exp) would hold a tensor whose grad_fn is that op: a
    # C++ reference cycle that the garbage collector cannot see, so a forward never followed by
    # backward (the planner's counting passes) would keep its graph, and with it the model's
    # parameters, alive for good. A detached alias shares the storage and breaks the cycle;
    # autograd restores the grad_fn when it unpacks.
    def pack(t: torch.Tensor) -> torch.Tensor:
        key = region() if region is not None else None
        if region is not None and key is None:
            return t.detach()  # outside every region: not counted
        result.num_packed += 1
        for plain in _plain_tensors(t):
            count(_storage_of(plain), key)
        return t.detach()

    pack.counts_kept_outputs = True  # type: ignore[attr-defined]  # NOTE [ Kept outputs on older torch ]

    def count(storage: torch.UntypedStorage | None, key: Hashable | None) -> None:
        if storage is None:
            return
        ptr = _storage_key(storage)
        known = seen.get(ptr)
        if ptr not in excluded and (known is None or known() is not storage):
            seen[ptr] = weakref.ref(storage)
            result.nbytes += storage.nbytes()
            result.num_storages += 1
            if key is not None:
                result.by_region[key] = result.by_region.get(key, 0) + storage.nbytes()

    return pack


# --------------------------------------------------------------------------------------------
# Peak of live storage bytes
# --------------------------------------------------------------------------------------------


@dataclass
class PeakMemory:
    """Live tensor-storage bytes seen by :func:`track_peak_memory`.

    While the block runs, ``peak_bytes`` and ``end_bytes`` hold the figures so far
    (``end_bytes`` is then the live count); they are final when it exits. The ``cuda_*`` fields
    are set only when a CUDA device was tracked.
    """

    start_bytes: int = 0
    """Bytes live at entry: the storages of the roots handed over (see the module NOTE)."""
    peak_bytes: int = 0
    """Largest number of bytes live at the same time, ``start_bytes`` included."""
    end_bytes: int = 0
    """Bytes still live at exit (at the current moment while the block runs)."""
    device: str | None = None
    """The device whose storages were counted; ``None`` counts every device but ``meta``."""
    num_allocations: int = 0
    """Number of new storages created inside the block."""
    cuda_start_bytes: int | None = None
    """``torch.cuda.memory_allocated`` at entry."""
    cuda_peak_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` over the block (the peak statistic is reset at entry)."""
    cuda_end_bytes: int | None = None
    """``torch.cuda.memory_allocated`` at exit."""
    timeline: list[int] | None = None
    """With ``timeline=True``: the live bytes right after each operation, in order (or what
    the ``probe`` read then)."""

    @property
    def activation_bytes(self) -> int:
        """Peak minus what was live at entry: the memory the block itself needed."""
        return self.peak_bytes - self.start_bytes

    @property
    def cuda_activation_bytes(self) -> int | None:
        """The CUDA allocator's view of :attr:`activation_bytes`, when CUDA was tracked."""
        if self.cuda_peak_bytes is None or self.cuda_start_bytes is None:
            return None
        return self.cuda_peak_bytes - self.cuda_start_bytes

    def __str__(self) -> str:
        text = (
            f"peak {format_bytes(self.peak_bytes)} "
            f"(start {format_bytes(self.start_bytes)}, "
            f"activations {format_bytes(self.activation_bytes)}, "
            f"end {format_bytes(self.end_bytes)})"
        )
        if self.cuda_peak_bytes is not None:
            text += f"; cuda peak {format_bytes(self.cuda_peak_bytes)}"
        return text


def _root_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from a root: a tensor, module, optimizer or container of them."""
    if isinstance(obj, torch.Tensor):
        yield from _plain_tensors(obj)
        if obj.grad is not None:
            yield from _plain_tensors(obj.grad)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield from _root_tensors(p)
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            yield from _root_tensors(group["params"])
        for state in obj.state.values():
            yield from _root_tensors(state)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _root_tensors(value)
    elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        for item in obj:
            yield from _root_tensors(item)


class _StorageTracker(TorchDispatchMode):
    """Follows the storages aten operations create; see NOTE [ What track_peak_memory counts ]."""

    def __init__(
        self,
        device: torch.device | None,
        result: PeakMemory,
        probe: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self.device = device
        self.result = result
        self.probe = probe
        self.live_bytes = 0
        # data_ptr -> (weak reference to the storage, bytes counted for it)
        self._live: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}

    def _wanted(self, dev: torch.device) -> bool:
        """Whether storages of tensors on ``dev`` are counted (a fake tensor's storage is on
        the meta device: its tensor's device decides, NOTE [ Fake storages ])."""
        if self.device is None:
            return True
        if dev.type != self.device.type:
            return False
        return self.device.index is None or dev.index == self.device.index

    def follow(self, storage: torch.UntypedStorage) -> bool:
        """Start counting ``storage``; return whether it was new to the tracker."""
        ptr = _storage_key(storage)
        entry = self._live.get(ptr)
        if entry is not None and entry[0]() is storage:
            nbytes = storage.nbytes()
            if nbytes != entry[1]:  # resized in place
                self.live_bytes += nbytes - entry[1]
                self._live[ptr] = (entry[0], nbytes)
            return False
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, functools.partial(self._release, ptr))
        self._live[ptr] = (ref, nbytes)
        self.live_bytes += nbytes
        return True

    def _release(self, ptr: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        # Called by the garbage of a followed storage (possibly deep inside an operator).
        entry = self._live.get(ptr)
        if entry is not None and entry[0] is ref:
            del self._live[ptr]
            self.live_bytes -= entry[1]
            self.result.end_bytes = self.live_bytes

    def stop(self) -> None:
        """Forget every storage; dropping the weak references disarms their callbacks."""
        self._live.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _LIFT_FRESH:
            return out  # NOTE [ Fake storages ]: it stands for its argument
        if isinstance(out, torch.Tensor):
            outputs: list[Any] = [out]
        elif isinstance(out, (tuple, list)):
            outputs = tree_leaves(out)
        else:
            return out
        outputs = [p for t in outputs if isinstance(t, torch.Tensor) for p in _plain_tensors(t)]
        input_ptrs: set[int] | None = None
        for t in outputs:
            if not isinstance(t, torch.Tensor):
                continue
            storage = _storage_of(t)
            if storage is None or not self._wanted(t.device):
                continue
            ptr = _storage_key(storage)
            entry = self._live.get(ptr)
            if entry is None or entry[0]() is not storage:
                if input_ptrs is None:
                    input_ptrs = set()
                    for a in tree_leaves((args, kwargs)):
                        if isinstance(a, torch.Tensor):
                            for plain in _plain_tensors(a):
                                s = _storage_of(plain)
                                if s is not None:
                                    input_ptrs.add(_storage_key(s))
                if ptr in input_ptrs:
                    continue  # a view of (or in-place result on) a storage from before entry
                self.result.num_allocations += 1
            self.follow(storage)
        if self.live_bytes > self.result.peak_bytes:
            self.result.peak_bytes = self.live_bytes
        self.result.end_bytes = self.live_bytes
        if self.result.timeline is not None:
            self.result.timeline.append(self.live_bytes if self.probe is None else self.probe())
        return out


@contextlib.contextmanager
def track_peak_memory(
    *roots: Any,
    device: torch.device | str | None = None,
    timeline: bool = False,
    probe: Callable[[], int] | None = None,
) -> Iterator[PeakMemory]:
    """Measure the peak of live tensor-storage bytes while the block runs.

    Every storage created by a tensor operation inside the block (forward, backward,
    recomputation, ``.grad``, optimizer state) is counted from its creation to its release,
    each storage once however many views it has; see NOTE [ What track_peak_memory counts ] in
    this module for the exact rules. The figures are deterministic on CPU.

    Args:
        *roots: things already alive at entry whose storages should count as live: tensors,
            modules (parameters, their ``.grad`` and buffers), optimizers (parameters and state)
            and lists, tuples or dicts of these. Their bytes form ``start_bytes``.
        device: count only storages on this device (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
            ``None`` counts every device except ``meta``. For a CUDA device the result also
            carries the CUDA allocator's figures; this resets its peak statistic at entry.
        timeline: also record the live bytes after every operation (``result.timeline``).
        probe: with ``timeline``, what each entry reads after an operation in place of the
            live bytes (the CUDA meter reads the allocator's peak during the operation, NOTE
            [ Two meters ] in ``_measure``). A probe that resets the allocator's peak
            statistic makes ``cuda_peak_bytes`` the largest entry or the peak after it.

    Yields:
        A :class:`PeakMemory`, updated while the block runs and final at exit.

    >>> with track_peak_memory() as mem:
    ...     a = torch.empty(1024, 1024)  # 4 MiB of float32
    ...     del a
    ...     b = torch.empty(256)
    >>> mem.peak_bytes, mem.end_bytes
    (4194304, 1024)
    """
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    result = PeakMemory(device=str(dev) if dev is not None else None)
    if timeline:
        result.timeline = []
    tracker = _StorageTracker(dev, result, probe)
    for t in _root_tensors(roots):
        storage = _storage_of(t)
        if storage is not None and tracker._wanted(t.device):
            tracker.follow(storage)
    result.start_bytes = result.peak_bytes = result.end_bytes = tracker.live_bytes

    use_cuda = dev is not None and dev.type == "cuda" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.synchronize(dev)
        result.cuda_start_bytes = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        with tracker:
            yield result
    finally:
        if use_cuda:
            torch.cuda.synchronize(dev)
            result.cuda_peak_bytes = max(
                torch.cuda.max_memory_allocated(dev),
                max(result.timeline or [0]) if probe is not None else 0,
            )
            result.cuda_end_bytes = torch.cuda.memory_allocated(dev)
        result.end_bytes = tracker.live_bytes
        tracker.stop()
