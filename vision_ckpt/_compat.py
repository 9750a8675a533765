"""Every torch entry point whose presence differs between the supported releases, in one place.

vision_ckpt supports torch from :data:`vision_ckpt._torch_floor.MIN_TORCH` to the newest
release. The checkpoint core and the meters need a few entry points that torch does not promise
across releases; each is detected once, here, when this module is imported, and the rest of the
package uses only the names below. No other module probes torch with ``hasattr``.

Each feature, where torch has it natively, and the fallback on releases without it:

* :data:`make_saved_tensor`: ``_make_saved_tensor`` (2.12). Before: ``None``, and the core saves
  a region's inputs through an autograd Function (NOTE [ Inputs saved through a Function ] in
  ``runtime._saved_inputs``).
* :func:`top_pack_hook`, :func:`user_saved_tensors_hooks`: ``_top_saved_tensors_default_hooks``
  (2.8; absent in 2.6). Before: the hooks vision_ckpt pushed itself, kept on a per-thread stack
  (NOTE [ Saved-tensor hooks seen on older torch ]).
* :func:`graph_exec_group`: ``_get_graph_exec_group``. Before: ``None``, and a backward is told
  apart by its graph task id alone.
* :data:`SELECTIVE_KEEPS_HOOKS`: the selective mode's ``respect_saved_tensors_hooks`` (2.14).
  Before: the keep policy hands what a selective region keeps to vision_ckpt's counting hooks
  (``runtime._selective``); other hooks, such as ``save_on_cpu``, do not see it.
* :data:`COMPILED_CHECKPOINT_KEEPS_BATCHNORM`: a compiled checkpoint that updates BatchNorm
  statistics once (2.14; 2.6 updates them twice). Before: a region with BatchNorm in training
  mode runs eagerly between compiled graphs.
* :data:`nested_compile_region`: ``torch.compiler.nested_compile_region``, relied on from 2.14
  (the release it is verified on). Before: ``None``, and a compiled region is traced into the
  graph of the code around it (NOTE [ A region is its own subgraph ] in ``runtime._traced``).
* :data:`CHECKPOINT_OPTIONS`: the options torch's own ``checkpoint`` takes (``early_stop`` after
  2.6). Before: an option torch lacks is not passed; under compile it changes nothing.
* :func:`functorch_running`: ``peek_interpreter_stack``. Before: ``False``.

The remaining private names (dispatch modes, pytree, the dispatch-mode keys, the torch-function
stack, grad mode and the hook stack itself) exist unchanged on every supported release; they are
re-exported from here so that a rename in a future release is mended in this file alone.

>>> isinstance(TORCH_VERSION, tuple) and TORCH_VERSION >= (2, 6)
True
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import (  # noqa: F401  (re-exported)
    TorchDispatchMode as TorchDispatchMode,
    _disable_current_modes as disable_current_modes,
    is_traceable_wrapper_subclass as is_traceable_wrapper_subclass,
)
from torch.utils._pytree import (  # noqa: F401  (re-exported)
    tree_flatten as tree_flatten,
    tree_leaves as tree_leaves,
    tree_unflatten as tree_unflatten,
)

__all__ = [
    "TORCH_VERSION",
    "SELECTIVE_KEEPS_HOOKS",
    "TorchDispatchMode",
    "disable_current_modes",
    "is_traceable_wrapper_subclass",
    "tree_flatten",
    "tree_leaves",
    "tree_unflatten",
    "make_saved_tensor",
    "push_saved_tensors_hooks",
    "pop_saved_tensors_hooks",
    "saved_tensors_hooks",
    "top_pack_hook",
    "user_saved_tensors_hooks",
    "graph_task_id",
    "graph_exec_group",
    "set_grad_enabled",
    "CHECKPOINT_OPTIONS",
    "COMPILED_CHECKPOINT_KEEPS_BATCHNORM",
    "nested_compile_region",
    "proxy_tracing",
    "functional_tracing",
    "torch_function_modes_active",
    "default_device",
    "KERNEL_SETTINGS",
    "functorch_running",
    "is_fake_tensor",
    "features",
]


def _parse(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (99, 0)


TORCH_VERSION: tuple[int, int] = _parse(torch.__version__)
"""The running torch's (major, minor)."""

_autograd = torch._C._autograd

make_saved_tensor: Any = getattr(_autograd, "_make_saved_tensor", None)
"""``_make_saved_tensor(tensor, is_output=...)``: a standalone SavedVariable packed by the
hooks active now; ``None`` where torch lacks it (before 2.12)."""

_native_top = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
_raw_push = _autograd._push_saved_tensors_default_hooks
_raw_pop = _autograd._pop_saved_tensors_default_hooks


def _selective_keeps_hooks() -> bool:
    policy = torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    forward_ctx, _ = torch.utils.checkpoint.create_selective_checkpoint_contexts(
        lambda ctx, op, *args, **kwargs: policy
    )
    return hasattr(forward_ctx, "respect_saved_tensors_hooks")


SELECTIVE_KEEPS_HOOKS: bool = _selective_keeps_hooks()
"""Whether torch's selective-checkpoint mode can pack what it keeps through the saved-tensor
hooks around the region (``respect_saved_tensors_hooks``, 2.14)."""


# NOTE [ Saved-tensor hooks seen on older torch ]
#
# The core must know which saved-tensor hooks are active below its own: a run of sibling calls
# is one region only while every call sees the same hooks (NOTE [ Regions of consecutive calls ]
# in _chain), and torch's selective mode hands what it keeps to the first hooks that are not a
# checkpoint's own (the ``_checkpoint_internal``/``_user_hooks`` protocol). Torch 2.8 and newer
# answer "which hooks are on top" directly. On older releases only the hooks vision_ckpt pushes
# itself, through push_saved_tensors_hooks or saved_tensors_hooks below, can be seen: they are
# kept on a per-thread stack beside torch's (per thread, as torch's is; backward runs on its
# own threads). Hooks pushed by other code (torch's save_on_cpu, a user's saved_tensors_hooks)
# are invisible there: a run of sibling calls that such hooks enter or leave between its calls
# is not noticed, and the selective fallback hands what it keeps to vision_ckpt's counting
# hooks only. Every push is paired with a pop on the same thread, so the stack stays in step
# with torch's as long as nobody pops what they did not push.


class _Pushed(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[Any, Any]] = []


_pushed = _Pushed()


if _native_top is not None:
    # torch's own entry points, with no layer between: every region pushes and pops
    push_saved_tensors_hooks = _raw_push
    pop_saved_tensors_hooks = _raw_pop

    def _top_hooks() -> tuple[Any, Any] | None:
        return _native_top(False)

else:

    def push_saved_tensors_hooks(pack: Any, unpack: Any) -> None:
        """Push ``pack``/``unpack`` as the innermost saved-tensor hooks of this thread."""
        _raw_push(pack, unpack)
        _pushed.stack.append((pack, unpack))

    def pop_saved_tensors_hooks() -> None:
        """Pop the innermost saved-tensor hooks pushed by :func:`push_saved_tensors_hooks`."""
        _raw_pop()
        _pushed.stack.pop()

    def _top_hooks() -> tuple[Any, Any] | None:
        stack = _pushed.stack
        return stack[-1] if stack else None


class saved_tensors_hooks:  # noqa: N801  (named as torch's context manager)
    """``torch.autograd.graph.saved_tensors_hooks`` whose hooks the core can see on every
    supported release (NOTE [ Saved-tensor hooks seen on older torch ])."""

    def __init__(self, pack: Any, unpack: Any) -> None:
        self.pack, self.unpack = pack, unpack

    def __enter__(self) -> None:
        push_saved_tensors_hooks(self.pack, self.unpack)

    def __exit__(self, *exc: Any) -> None:
        pop_saved_tensors_hooks()


def top_pack_hook() -> Any:
    """The innermost pack hook active now, or ``None``."""
    hooks = _top_hooks()
    return None if hooks is None else hooks[0]


def user_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The innermost hooks that are not a checkpoint's own: walk past every pack hook marked
    ``_checkpoint_internal`` through its ``_user_hooks`` (the protocol torch's selective mode
    reads)."""
    hooks = _top_hooks()
    while hooks is not None and getattr(hooks[0], "_checkpoint_internal", False):
        hooks = getattr(hooks[0], "_user_hooks", None)
    return hooks


graph_task_id = torch._C._current_graph_task_id
"""The id of the backward running on this thread, ``-1`` outside backward."""

_exec_group = getattr(torch._C, "_get_graph_exec_group", None)


def graph_exec_group() -> Any:
    """The object that identifies the running backward across threads, or ``None`` where torch
    has none."""
    return None if _exec_group is None else _exec_group()


COMPILED_CHECKPOINT_KEEPS_BATCHNORM: bool = TORCH_VERSION >= (2, 14)
"""Whether a compiled ``torch.utils.checkpoint`` updates BatchNorm running statistics once, as
eager does. 2.6 updates them in the forward and again in the recomputation (a momentum-0.1
running mean moves 1.9 times as far); 2.14 updates them once. The releases between were not
checked and are treated as 2.6."""

nested_compile_region: Callable[[Callable[..., Any]], Callable[..., Any]] | None = (
    torch.compiler.nested_compile_region if TORCH_VERSION >= (2, 14) else None
)
"""torch's decorator that compiles a function as a subgraph of the graph that calls it, from
2.14 (the release it is verified on); ``None`` before."""

CHECKPOINT_OPTIONS: frozenset[str] = frozenset(
    inspect.signature(torch.utils.checkpoint.checkpoint).parameters
)
"""The keyword options torch's own ``checkpoint`` takes (2.6 has no ``early_stop``: it would
pass that on to the checkpointed function)."""

set_grad_enabled = torch._C._set_grad_enabled
"""Switch grad mode without a context manager (for the core's hot path)."""

_dispatch_keys = torch._C._TorchDispatchModeKey


def proxy_tracing() -> bool:
    """Whether a proxy tensor mode (make_fx, AOTAutograd) is active."""
    return torch._C._get_dispatch_mode(_dispatch_keys.PROXY) is not None


def functional_tracing() -> bool:
    """Whether a functionalisation mode (AOTAutograd) is active."""
    return torch._C._get_dispatch_mode(_dispatch_keys.FUNCTIONAL) is not None


def torch_function_modes_active() -> bool:
    """Whether any torch-function mode (such as a ``with torch.device(...)`` block) is active."""
    return torch._C._len_torch_function_stack() > 0


def default_device() -> torch.device | None:
    """The device of the innermost ``with torch.device(...)`` block, or ``None``."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


_peek_interpreter = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def is_fake_tensor(value: object) -> bool:
    """Whether ``value`` is a ``FakeTensor``: metadata standing in for a tensor, no data.

    >>> is_fake_tensor(torch.zeros(1))
    False
    """
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def functorch_running() -> bool:
    """Whether a functorch transform (vmap, grad, jvp) is running."""
    return _peek_interpreter is not None and _peek_interpreter() is not None


def _kernel_settings() -> tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...]:
    """Getter and setter of each kernel-choosing switch this torch has (SDPA backends,
    determinism, matmul precision, cuBLAS and cuDNN flags); releases add switches, so each is
    taken only where both halves exist."""
    C = torch._C
    simple = (
        ("_get_flash_sdp_enabled", "_set_sdp_use_flash"),
        ("_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
        ("_get_math_sdp_enabled", "_set_sdp_use_math"),
        ("_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
        ("_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable"),
        ("_get_fa3_sdp_enabled", "_set_sdp_use_fa3"),
        ("_get_sdp_priority_order", "_set_sdp_priority_order"),
        ("_get_math_sdp_allow_fp16_bf16_reduction", "_set_math_sdp_allow_fp16_bf16_reduction"),
        (
            "_get_deterministic_fill_uninitialized_memory",
            "_set_deterministic_fill_uninitialized_memory",
        ),
        ("_get_float32_matmul_precision", "_set_float32_matmul_precision"),
        ("_get_cublas_allow_tf32", "_set_cublas_allow_tf32"),
        ("_get_cublas_allow_fp16_accumulation", "_set_cublas_allow_fp16_accumulation"),
        (
            "_get_cpu_allow_fp16_reduced_precision_reduction",
            "_set_cpu_allow_fp16_reduced_precision_reduction",
        ),
        ("_get_cudnn_enabled", "_set_cudnn_enabled"),
        ("_get_cudnn_benchmark", "_set_cudnn_benchmark"),
        ("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
        ("_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
        ("_get_mkldnn_deterministic", "_set_mkldnn_deterministic"),
    )
    pairs = (
        (
            "_get_cublas_allow_fp16_reduced_precision_reduction",
            "_set_cublas_allow_fp16_reduced_precision_reduction",
        ),
        (
            "_get_cublas_allow_bf16_reduced_precision_reduction",
            "_set_cublas_allow_bf16_reduced_precision_reduction",
        ),
    )
    table: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []
    for get, put in simple:
        if hasattr(C, get) and hasattr(C, put):
            table.append((getattr(C, get), getattr(C, put)))
    if hasattr(C, "_get_deterministic_algorithms"):
        table.append(
            (
                lambda: (
                    C._get_deterministic_algorithms(),
                    C._get_deterministic_algorithms_warn_only(),
                ),
                lambda value: C._set_deterministic_algorithms(value[0], warn_only=value[1]),
            )
        )
    for get, put in pairs:  # (allow, allow_splitk) in torch 2.14; one bool before
        if hasattr(C, get) and hasattr(C, put):
            setter = getattr(C, put)
            table.append(
                (getattr(C, get), lambda v, s=setter: s(*v) if isinstance(v, tuple) else s(v))
            )
    return tuple(table)


KERNEL_SETTINGS = _kernel_settings()
"""The switches the core captures with a region and restores for its recomputation."""


def features() -> dict[str, bool]:
    """Which entry points this torch has natively (``False``: the fallback runs).

    >>> sorted(features())  # doctest: +NORMALIZE_WHITESPACE
    ['compiled_checkpoint_keeps_batchnorm', 'graph_exec_group', 'make_saved_tensor',
     'region_subgraphs', 'selective_keeps_hooks', 'top_saved_hooks']
    """
    return {
        "make_saved_tensor": make_saved_tensor is not None,
        "top_saved_hooks": _native_top is not None,
        "graph_exec_group": _exec_group is not None,
        "selective_keeps_hooks": SELECTIVE_KEEPS_HOOKS,
        "compiled_checkpoint_keeps_batchnorm": COMPILED_CHECKPOINT_KEEPS_BATCHNORM,
        "region_subgraphs": nested_compile_region is not None,
    }
