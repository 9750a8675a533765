"""The bundled non-reentrant activation checkpoint.

``checkpoint(fn, *args, **kwargs)`` runs ``fn`` without keeping the tensors autograd would save
for backward; backward recomputes them, only as far as it needs, and frees each one as soon as it
is used. It is a drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``
built directly on saved-tensor hooks, and it knows nothing about levels: the wrapper and the plan
layers above decide *what* is checkpointed, this module only does it.

This module owns the checkpoint functions and the executor of one region's call (what it
captures, and its forward under the frame's hooks); the frame and the recomputation are in
``_frame``, the state a recomputation reinstates in ``_call_state``, how inputs wait in
``_saved_inputs``, and regions of consecutive calls in ``_chain``.

Where it differs from torch's implementation, it does so on purpose:

* BatchNorm running statistics are not updated a second time by the recomputation
  (see NOTE [ Stateful modules during recomputation ] in ``_call_state``);
* lists, tuples and dicts passed as arguments are captured as they are at call time, so a caller
  that keeps appending to its list (DenseNet's feature list) does not change what is recomputed
  (see NOTE [ Inputs are captured at call time ]);
* meta tensors never touch an RNG or autocast device module;
* errors name the region (function or module) that failed and say how to fix it;
* the per-call bookkeeping is small: nothing is captured that the call does not need.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as _torch_ckpt

from .. import _compat
from .._compat import tree_flatten
from ..errors import CheckpointError
from ._call_state import (
    accelerator_type,
    capture_autocast,
    has_running_stats,
    region_batchnorms,
    region_module,
    settle_settings,
    stash_rng,
    thread_state,
)
from ._frame import DebugLogs, Frame, blank_frame, check_inputs_unwritten, region_name
from ._saved_inputs import offload_inputs, save_inputs

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "set_checkpoint_debug_enabled",
    "CheckpointError",
]


_push_hooks = _compat.push_saved_tensors_hooks
_pop_hooks = _compat.pop_saved_tensors_hooks
_user_saved_tensors_hooks = _compat.user_saved_tensors_hooks

_DETERMINISM_CHECKS = ("default", "none")
_debug_enabled: bool | None = None


def is_recomputing() -> bool:
    """True while a checkpointed region is being recomputed for backward on this thread.

    Forward hooks, logging and metrics can use it to skip the second run of a region.

    >>> import torch
    >>> from vision_ckpt.runtime import checkpoint, is_recomputing
    >>> seen = []
    >>> def f(x):
    ...     seen.append(is_recomputing())
    ...     return x.sin().sin()
    >>> checkpoint(f, torch.ones(2, requires_grad=True)).sum().backward()
    >>> seen
    [False, True]
    """
    return thread_state.recompute_depth > 0


def region_depth() -> int:
    """Checkpointed regions currently running (forward or recomputation) on this thread.

    A recomputation starts from depth 1, as if no other region were active, so a decision
    taken from this number is the same in the original forward and in the recomputation.
    While torch.compile traces, regions nested in a region are not counted: the depth only
    tells whether some region runs.
    """
    return thread_state.region_depth


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Force ``debug`` on (True) or off (False) for every checkpoint started inside the block.

    ``None`` restores the per-call ``debug=`` argument. Only the forward needs to run inside
    the block: the region remembers its setting until backward.

    >>> import torch
    >>> from vision_ckpt.runtime import checkpoint, set_checkpoint_debug_enabled
    >>> with set_checkpoint_debug_enabled(True):
    ...     y = checkpoint(torch.sin, torch.ones(2, requires_grad=True))
    """
    global _debug_enabled
    previous = _debug_enabled
    _debug_enabled = enabled
    try:
        yield
    finally:
        _debug_enabled = previous


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
    graph: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> Any:
    """:func:`checkpoint` for vision_ckpt's own callers (the wrapper and installed forwards),
    which know what the region is. ``module``: the module whose BatchNorm statistics the
    recomputation must not update again (NOTE [ Stateful modules during recomputation ] in
    ``_call_state``);
    ``label``: the name errors quote (``'blocks.3'``, ``'blocks[0:4]'``); ``offload``: keep
    the CUDA inputs in pinned host memory (NOTE [ Offloaded inputs ] in ``_saved_inputs``);
    ``graph``: the subgraph it is compiled as (``_Options.graph``)."""
    options = _Options(
        module=module,
        label=label,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        offload=offload,
        graph=graph,
    )
    return _run(function, args, kwargs, options)


@dataclass(frozen=True, slots=True)
class _Options:
    """How one call checkpoints its region: what :func:`checkpoint` or
    :func:`checkpoint_region` was given besides the region and its arguments."""

    module: torch.nn.Module | None = None
    """The module whose BatchNorm statistics the recomputation must not update again; ``None``:
    what the region shows (NOTE [ Stateful modules during recomputation ] in ``_call_state``)."""
    label: str | None = None
    """The region's name in errors; ``None``: derived from the region."""
    use_reentrant: bool | None = None
    """Accepted for compatibility; only ``False``/``None`` run (``True`` is an error in eager)."""
    preserve_rng_state: bool = True
    """Stash and restore the RNG state around the recomputation (NOTE [ RNG state ] in
    ``_call_state``)."""
    context_fn: Callable[[], tuple[Any, Any]] | None = None
    """The contexts entered around the forward and the recomputation, or ``None``."""
    determinism_check: str = "default"
    """``"default"``: compare shape, dtype and device of every recomputed tensor; ``"none"``."""
    debug: bool = False
    """Record the operators of both runs for errors."""
    early_stop: bool = True
    """Stop the recomputation as soon as every saved tensor is back."""
    offload: bool = False
    """Keep the CUDA inputs in pinned host memory (NOTE [ Offloaded inputs ] in
    ``_saved_inputs``)."""
    graph: Callable[..., Any] | None = None
    """Under torch.compile: the region's own subgraph, called with torch's checkpoint and the
    region (NOTE [ A region is its own subgraph ] in ``_traced``); ``None``: traced in place.
    Eager ignores it."""


def writes_running_stats(module: torch.nn.Module | None) -> bool:
    """Whether ``module`` (``None``: not known, so assume it does) holds a BatchNorm in
    training mode, whose running statistics its forward writes."""
    if module is None:
        return True
    return any(m.training and has_running_stats(m) for m in module.modules())


def traced_region_is_exact(function: Callable[..., Any], module: torch.nn.Module | None) -> bool:
    """Whether torch's compiled checkpoint runs this region as eager would: not where this
    torch updates BatchNorm statistics twice in it (``_compat.COMPILED_CHECKPOINT_KEEPS_
    BATCHNORM``) and the region holds a BatchNorm in training mode."""
    if _compat.COMPILED_CHECKPOINT_KEEPS_BATCHNORM:
        return True
    return not writes_running_stats(region_module(function, module))


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

    frame = blank_frame(function, options.label, check=options.determinism_check == "default")
    tensors = _capture_inputs(frame, args, kwargs)
    debug_on = _debug_enabled if _debug_enabled is not None else options.debug
    frame.early_stop = options.early_stop

    device_type = accelerator_type(tensors) if tensors else "cuda"
    frame.autocast = capture_autocast(device_type)
    cuda_was_initialized = getattr(torch.cuda, "_initialized", False)
    frame.rng = stash_rng(tensors) if options.preserve_rng_state else None
    frame.batchnorms = region_batchnorms(function, options.module)
    forward_ctx = _region_contexts(frame, options.context_fn, debug_on)
    tensors = _unique_inputs(frame, tensors)
    frame.saved = offload_inputs(tensors) if options.offload else save_inputs(tensors)
    versions = [t._version for t in tensors]

    out = _forward(frame, function, args, kwargs, forward_ctx)
    frame.forward_done = True
    check_inputs_unwritten(frame, tensors, versions)
    if (
        options.preserve_rng_state
        and not cuda_was_initialized
        and getattr(torch.cuda, "_initialized", False)
    ):
        raise CheckpointError(
            f"vision_ckpt.checkpoint: region {region_name(frame)} initialised CUDA during its "
            "forward, so its CUDA RNG state could not be stashed for the recomputation. "
            "Initialise CUDA before the call (e.g. move the inputs to the GPU first), or pass "
            "preserve_rng_state=False if the region draws no random numbers on the GPU."
        )
    return out


def _run_traced(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: _Options
) -> Any:
    """The region under torch.compile / export tracing: torch's own non-reentrant checkpoint,
    which dynamo and AOTAutograd understand as a higher-order op."""
    # The region counts as running, as in eager, so that regions inside it take the
    # nesting decisions they take in eager (wrapper's NOTE [ Nesting ]): the partitioner
    # recomputes the traced graph, never this code, so forward and recomputation agree.
    # Only the outermost region writes the depth, outside every checkpoint operator: some
    # releases' dynamo refuse a write inside the operator's body (``_traced``'s NOTE [ The
    # training level under torch.compile ]), and a decision reads only whether it is zero.
    if options.context_fn is not None:
        kwargs["context_fn"] = options.context_fn
    if "early_stop" in _compat.CHECKPOINT_OPTIONS:  # traced, the partitioner decides anyway
        kwargs["early_stop"] = options.early_stop
    state = thread_state
    outermost = state.region_depth == 0
    if outermost:
        state.region_depth = 1
    run = functools.partial(
        _torch_ckpt.checkpoint,
        use_reentrant=False,
        preserve_rng_state=options.preserve_rng_state,
        determinism_check=options.determinism_check,
        debug=options.debug,
        **kwargs,
    )
    try:
        if options.graph is not None:
            return options.graph(run, function, *args)
        return run(function, *args)
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


def _capture_inputs(frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
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
    frame: Frame, context_fn: Callable[[], tuple[Any, Any]] | None, debug_on: bool
) -> Any:
    """The context to run the forward in, or ``None``; the recomputation's goes to ``frame``,
    each with the operator log around it when debugging."""
    forward_ctx = recompute_ctx = None
    if context_fn is not None:
        forward_ctx, recompute_ctx = context_fn()
    frame.logs = None
    if debug_on:
        frame.logs = DebugLogs()
        forward_ctx = _stacked(frame.logs.forward, forward_ctx)
        recompute_ctx = _stacked(frame.logs.recompute, recompute_ctx)
    frame.recompute_ctx = recompute_ctx
    return forward_ctx


def _unique_inputs(frame: Frame, tensors: list[Any]) -> list[Any]:
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
    frame: Frame,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    forward_ctx: Any,
) -> Any:
    """Run the region's forward under ``frame``'s pack hooks (and ``forward_ctx``)."""
    state = thread_state
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
            f"raised inside region {region_name(frame)}; checkpoint has no output to return. "
            "Let the exception propagate from the context manager."
        )
    settle_settings(frame)
    return out


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

    >>> import torch
    >>> from vision_ckpt.runtime import checkpoint_sequential
    >>> seq = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> checkpoint_sequential(seq, 3, x).shape
    torch.Size([2, 4])
    """
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    functions = list(functions)
    count = len(functions)
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= count:
        raise ValueError(
            f"vision_ckpt.runtime.checkpoint_sequential: segments={segments!r} is not valid for "
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
