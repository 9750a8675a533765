"""The level policy at call time: the training level, and the wrapper that applies it.

A block carries a level 0-5 and the run sets one *training level*; the block is checkpointed
exactly when ``1 <= block level <= training level``, the module is in training mode and grad is
enabled. Otherwise the block runs as plain code: that path is a few attribute reads.

.. code-block:: python

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
            self.ckpt = ActivationCheckpointing(2)       # block level 2
        def forward(self, x):
            return x + self.ckpt(self.mlp, x)

    set_training_level(3)                                # or: with training_level(3): ...

# NOTE [ The training level seen by recomputation ]

Backward recomputes a checkpointed region by running its code again, and every wrapper inside it
decides again whether to checkpoint. That decision must be the one taken in forward, or the
recomputation saves different tensors than the forward did. Grad mode and ``module.training``
are the same in both runs, but the global training level may not be: ``with training_level(3):
loss = model(x)`` followed by ``loss.backward()`` outside the block recomputes at the level
outside it. So each checkpointed region runs its code under the ambient training level captured
when it was called (a thread-local override, see ``_RunAtLevel``), and wrappers that follow the
global level read that override first. The same holds for ``nesting="outermost"``: it asks the
core how many regions are running (``_core._region_depth()``), which the core defines to be the
same in forward and in recomputation.

# NOTE [ Nesting ]

With ``nesting="all"`` (the level contract), every eligible wrapper inside an eligible wrapper is
checkpointed too: the outer region's recomputation then keeps only the inner regions' inputs,
which lowers the peak of backward, and each inner block runs once more (three forwards for a
block two regions deep). With ``nesting="outermost"``, a wrapper that finds itself inside a
running checkpointed region calls its function directly: each block runs at most twice, and the
outer region's recomputation holds all of its activations at once.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from . import _core
from .errors import ConfigError
from .levels import Level, parse_level

__all__ = [
    "ActivationCheckpointing",
    "training_level",
    "set_training_level",
    "get_training_level",
]

Nesting = Literal["all", "outermost"]
_NESTINGS = ("all", "outermost")

# The process-wide training level (not thread-local: DataParallel replicas run forward on their
# own threads and must follow the level the main thread set).
_training_level: Level = Level.NONE


class _RegionState(threading.local):
    # The ambient training level captured when the innermost running region was called, or None
    # outside every region. See NOTE [ The training level seen by recomputation ].
    # Set per thread in __init__ (not as a class default): dynamo guards on the instance's
    # __dict__, and an attribute that appears there later fails the guard of its own frame.
    def __init__(self) -> None:
        self.level: Level | None = None


_region = _RegionState()


def set_training_level(level: int | str | Level) -> None:
    """Set the global training level (0-5) that wrappers without their own level follow.

    Takes effect at the next forward: change it between steps, not between a forward and its
    backward (a region that is recomputed uses the level it ran forward with anyway).

    Args:
        level: 0-5 or a level name (``"stage"``); 0 turns checkpointing off.

    Raises:
        LevelError: ``level`` is not a checkpoint level; the message lists the allowed values.

    >>> set_training_level(3); get_training_level()
    <Level.MEDIUM_MODULE: 3>
    >>> set_training_level(0)
    """
    global _training_level
    _training_level = parse_level(level, what="training level")


def get_training_level() -> Level:
    """The training level wrappers that follow the global level use right now.

    Inside a running (or recomputing) checkpointed region this is the level that was in effect
    when the region was called.

    >>> with training_level(2):
    ...     get_training_level()
    <Level.SMALL_BLOCK: 2>
    """
    level = _region.level
    return _training_level if level is None else level


@contextlib.contextmanager
def training_level(level: int | str | Level) -> Iterator[Level]:
    """Set the global training level inside a ``with`` block, and restore the previous one after.

    Args:
        level: 0-5 or a level name.

    Raises:
        LevelError: ``level`` is not a checkpoint level.

    >>> with training_level("stage") as lv:
    ...     int(lv), int(get_training_level())
    (4, 4)
    >>> int(get_training_level())
    0
    """
    global _training_level
    new = parse_level(level, what="training level")
    previous = _training_level
    _training_level = new
    try:
        yield new
    finally:
        _training_level = previous


def _check_nesting(nesting: object) -> bool:
    """Validate ``nesting`` and return whether it is "outermost"."""
    if nesting not in _NESTINGS:
        raise ConfigError(
            f"nesting {nesting!r} is not a nesting mode; allowed: 'all' (every eligible block, "
            "inner ones too), 'outermost' (only the outermost eligible block in a chain)."
        )
    return nesting == "outermost"


class _RunAtLevel:
    """The function given to the core: runs ``fn`` under the ambient level captured at call time.

    It also tells the core which module the region is (for its name in errors and for the
    BatchNorm guard), since the core no longer sees ``fn`` itself.
    """

    __slots__ = ("fn", "level")

    def __init__(self, fn: Callable[..., Any], level: Level) -> None:
        self.fn = fn
        self.level = level

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        previous = _region.level
        _region.level = self.level
        try:
            return self.fn(*args, **kwargs)
        finally:
            _region.level = previous

    @property
    def __vision_ckpt_module__(self) -> nn.Module | None:
        fn = self.fn
        if isinstance(fn, nn.Module):
            return fn
        module = getattr(fn, "__vision_ckpt_module__", None)
        if module is None:
            module = getattr(fn, "__self__", None)
        return module if isinstance(module, nn.Module) else None

    @property
    def __vision_ckpt_region__(self) -> str:
        return _core._region_label(self.fn)


_reentrant_warned = False


def _reentrant_checkpoint(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], preserve: bool
) -> Any:
    global _reentrant_warned
    if not _reentrant_warned:
        _reentrant_warned = True
        warnings.warn(
            "ActivationCheckpointing(..., use_reentrant=True) runs torch's reentrant checkpoint, "
            "kept only for code written against the seed API: it needs an input that requires "
            "grad, does not support torch.autograd.grad with inputs= or nested checkpoints, and "
            "updates BatchNorm statistics twice. Drop use_reentrant=True to use vision_ckpt's "
            "non-reentrant core. (This warning is shown once.)",
            FutureWarning,
            stacklevel=6,  # the code that called the wrapper module
        )
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=True, preserve_rng_state=preserve
    )


class ActivationCheckpointing(nn.Module):
    """Checkpoint a function when its level is within the training level; no parameters.

    Call it as ``wrapper(fn, *args, **kwargs)``: ``fn(*args, **kwargs)`` is checkpointed through
    vision_ckpt's core exactly when ``1 <= fn_checkpoint_level <= training level``, the wrapper
    is in training mode and grad is enabled; otherwise ``fn`` is called directly. Register it as
    a submodule of the block that uses it so that ``model.train()``/``model.eval()`` reach it.

    Args:
        fn_checkpoint_level: the level 0-5 of what this wrapper runs (0: never checkpointed).
        training_checkpoint_level: a fixed training level for this wrapper; ``None`` (default)
            follows the global one (:func:`set_training_level`, :func:`training_level`).
        nesting: ``"all"`` (default) also checkpoints when called inside another checkpointed
            region; ``"outermost"`` then calls ``fn`` directly. See NOTE [ Nesting ].
        preserve_rng_state: stash and restore the RNG state so dropout and drop-path give exact
            gradients.
        context_fn: passed to the core, e.g. a selective-checkpoint policy made with
            ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    Raises:
        LevelError: a level is not 0-5; the message lists the allowed values.
        ConfigError: ``nesting`` is not ``"all"`` or ``"outermost"``.

    >>> import torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> ckpt = ActivationCheckpointing(2)
    >>> ckpt
    ActivationCheckpointing(level=2 (SMALL_BLOCK), training_level=global)
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> with training_level(3):
    ...     y = x + ckpt(mlp, x)
    >>> y.sum().backward()
    """

    def __init__(
        self,
        fn_checkpoint_level: int | str | Level,
        training_checkpoint_level: int | str | Level | None = None,
        *,
        nesting: Nesting = "all",
        preserve_rng_state: bool = True,
        context_fn: Callable[[], tuple[Any, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.fn_checkpoint_level = parse_level(fn_checkpoint_level, what="fn_checkpoint_level")
        self.training_checkpoint_level = (
            None
            if training_checkpoint_level is None
            else parse_level(training_checkpoint_level, what="training_checkpoint_level")
        )
        self.nesting = nesting
        self._outermost = _check_nesting(nesting)
        self.preserve_rng_state = bool(preserve_rng_state)
        self.context_fn = context_fn

    def forward(
        self, fn: Callable[..., Any], *args: Any, use_reentrant: bool | None = False, **kwargs: Any
    ) -> Any:
        level = self.fn_checkpoint_level
        if level == 0 or not self.training or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return _maybe_checkpoint(self, fn, args, kwargs, bool(use_reentrant))

    def extra_repr(self) -> str:
        level = self.fn_checkpoint_level
        pinned = self.training_checkpoint_level
        text = f"level={int(level)} ({level.name}), training_level="
        text += "global" if pinned is None else f"{int(pinned)}"
        if self.nesting != "all":
            text += f", nesting={self.nesting!r}"
        if not self.preserve_rng_state:
            text += ", preserve_rng_state=False"
        if self.context_fn is not None:
            text += f", context_fn={self.context_fn!r}"
        return text


def _maybe_checkpoint(
    policy: Any,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    use_reentrant: bool = False,
) -> Any:
    """The rest of the decision once level, mode and grad allow it; ``policy`` holds the options.

    ``policy`` is an :class:`ActivationCheckpointing` or a ``_CheckpointedForward`` (installed by
    :func:`vision_ckpt.apply`): both carry ``fn_checkpoint_level``,
    ``training_checkpoint_level``, ``_outermost``, ``preserve_rng_state`` and ``context_fn``.
    """
    ambient = _region.level
    if ambient is None:
        ambient = _training_level
    pinned = policy.training_checkpoint_level
    if policy.fn_checkpoint_level > (ambient if pinned is None else pinned):
        return fn(*args, **kwargs)
    if policy._outermost and _core._region_depth() > 0:
        return fn(*args, **kwargs)
    if use_reentrant:
        if policy.context_fn is not None:
            raise ConfigError(
                "use_reentrant=True cannot honour context_fn (selective checkpointing): torch's "
                "reentrant checkpoint has no such option. Drop use_reentrant=True, or the "
                "context_fn / selective setting."
            )
        return _reentrant_checkpoint(
            _RunAtLevel(fn, ambient), args, kwargs, policy.preserve_rng_state
        )
    return _core.checkpoint(
        _RunAtLevel(fn, ambient),
        *args,
        preserve_rng_state=policy.preserve_rng_state,
        context_fn=policy.context_fn,
        **kwargs,
    )


class _ModuleForward:
    """Calls the forward a module had before :func:`vision_ckpt.apply` (its class's, usually).

    It lives in the module's own ``__dict__``, so it refers to the module weakly: a strong
    reference would make every applied module part of a reference cycle, freed (with its GPU
    memory) only when Python's cycle collector happens to run. Copies and pickles carry the
    module strongly in their state, which deepcopy and pickle map to the copied module.
    """

    def __init__(self, module: nn.Module, name: str, original: Callable[..., Any] | None) -> None:
        self._module = weakref.ref(module)
        self.original = original  # an instance-level forward that was already there, if any
        self.__vision_ckpt_region__ = name or type(module).__name__

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:  # only reachable through a stray reference to this object
            raise ConfigError(
                f"the module {self.__vision_ckpt_region__!r} this checkpointed forward belonged "
                "to no longer exists; call the module, not its saved forward."
            )
        return module

    @property
    def __vision_ckpt_module__(self) -> nn.Module:
        return self.module

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_module"] = self.module
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["_module"] = weakref.ref(state["_module"])
        self.__dict__.update(state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class _CheckpointedForward:
    """The instance-level ``forward`` that :func:`vision_ckpt.apply` gives a selected module.

    A plain picklable object (not a module: it adds nothing to ``named_modules()`` or the state
    dict) holding the module's level and the run options; it decides like
    :class:`ActivationCheckpointing` and runs the module's own forward, checkpointed or not.
    """

    def __init__(
        self,
        module: nn.Module,
        name: str,
        level: Level,
        training_level: Level | None,
        nesting: Nesting,
        preserve_rng_state: bool,
        context_fn: Callable[[], tuple[Any, Any]] | None,
    ) -> None:
        self.run = _ModuleForward(module, name, module.__dict__.get("forward"))
        self.fn_checkpoint_level = level
        self.training_checkpoint_level = training_level
        self.nesting = nesting
        self._outermost = _check_nesting(nesting)
        self.preserve_rng_state = preserve_rng_state
        self.context_fn = context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = self.run
        if self.fn_checkpoint_level == 0 or not run.module.training or not torch.is_grad_enabled():
            return run(*args, **kwargs)
        return _maybe_checkpoint(self, run, args, kwargs)

    def __repr__(self) -> str:
        pinned = self.training_checkpoint_level
        return (
            f"<checkpointed forward of {self.run.__vision_ckpt_region__!r}: "
            f"level={int(self.fn_checkpoint_level)}, training_level="
            f"{'global' if pinned is None else int(pinned)}, nesting={self.nesting!r}>"
        )


class _SaveOps:
    """A picklable ``context_fn`` that saves the outputs of the named ops (selective checkpoint).

    Op names (``"aten.mm"``) are resolved to ``torch.ops`` overload packets (or, with a third
    component, single overloads) when first needed; the policy saves the output of every op of
    those and recomputes all others.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._ops: frozenset[Any] | None = None

    def resolve(self) -> frozenset[Any]:
        """The ``torch.ops`` objects for the names; ConfigError naming the unknown ones."""
        if self._ops is None:
            ops, unknown = [], []
            for name in self.names:
                op = _lookup_op(name)
                if op is None:
                    unknown.append(name)
                else:
                    ops.append(op)
            if unknown:
                raise ConfigError(
                    f"selective.save_ops: unknown operators {unknown}; write them as in "
                    "torch.ops, e.g. 'aten.mm', 'aten.addmm', 'aten.convolution', "
                    "'aten._scaled_dot_product_efficient_attention' (check with "
                    "hasattr(torch.ops.aten, name))."
                )
            self._ops = frozenset(ops)
        return self._ops

    def _policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        ops = self._ops if self._ops is not None else self.resolve()
        policy = torch.utils.checkpoint.CheckpointPolicy
        if op in ops or getattr(op, "overloadpacket", None) in ops:
            return policy.MUST_SAVE
        return policy.PREFER_RECOMPUTE

    def __call__(self) -> tuple[Any, Any]:
        return torch.utils.checkpoint.create_selective_checkpoint_contexts(self._policy)

    def __getstate__(self) -> dict[str, Any]:
        return {"names": self.names, "_ops": None}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SaveOps) and other.names == self.names

    def __hash__(self) -> int:
        return hash(self.names)

    def __repr__(self) -> str:
        return f"save_ops{list(self.names)}"


def _lookup_op(name: str) -> Any | None:
    parts = name.split(".")
    if len(parts) not in (2, 3):
        return None
    namespace, op_name = parts[0], parts[1]
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError):
        return None
    if len(parts) == 2:
        return packet
    return getattr(packet, parts[2], None)
