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
core how many regions are running (``_core.region_depth()``), which the core defines to be the
same in forward and in recomputation.

# NOTE [ Nesting ]

Invariant: whether a region inside a running checkpointed region is checkpointed depends only on
its own policy and on the innermost running region (its level and whether it is a *group*), both
of which ``_RunAtLevel`` re-establishes when the outer region is recomputed; so forward and
recomputation take the same decisions and save the same tensors. ``plan()``
(``_plan_record.decide``) computes the same decisions without running the model; both apply the
rule in ``nests``.

A group is a property of a region's span, never of its level number: a segment of a stack (an
``nn.Sequential``'s segments, a group of a ``ModuleList``'s layers: ``Rung.group``), or, in a
plan, a region whose span holds several fully checkpointed regions at the training level: two
or more directly inside it, or one that is a group itself (``Policy.holds_several``, from
``_planning``; a stage of one block of several layers is a group, a stage of one plain block is
not, and recomputing it whole holds what nesting would, for one forward less). A hand-placed
wrapper has no plan and cannot see what its function calls, so it is a group only as a segment.

- ``all``: every eligible region inside an eligible region is checkpointed too. The outer
  recomputation keeps only the inner regions' inputs (lower backward peak), and each inner block
  runs once more per enclosing region (three forwards for a block two regions deep).
- ``outermost``: an eligible region inside a running region calls its function directly (each
  block runs at most twice), *except* inside a group. Recomputing a group at once would hold
  all of its layers' activations, which is the peak of no checkpointing at all for a
  whole-trunk region; keeping its layers checkpointed bounds that recomputation by their
  inputs. So no level's peak exceeds the peak of a level
  below it merely because a group swallowed the regions of that level.
- ``auto`` (the config default): as ``outermost``, and a *selective* region is checkpointed
  inside any running region, because redoing its cheap operators once more costs little while
  keeping its pointwise outputs out of the outer recomputation. A transformer layer holding its
  attention and MLP regions is a group: recomputed in one piece it would hold both at once, a
  higher peak than the level below, which recomputed them one at a time. A residual block
  holding one region (its shortcut) is not: the extra forward buys too little.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from ..config.levels import NESTING_MODES, Level, Nesting, is_checkpointed, parse_level
from ..config.schema import KeepOps, Region
from ..errors import ConfigError
from . import _chain, _core, _frame, _traced
from ._selective import bind_region
from ._traced import compile_note

__all__ = [
    "ActivationCheckpointing",
    "training_level",
    "set_training_level",
    "get_training_level",
]
# Used by the install layer (vision_ckpt.regions._install), not re-exported by the package:
# Rung, Policy, choose_rung, nests, lean_now, run_policy, run_segments, segment_size, ChainCall,
# run_traced_chain, note_run_broken_traced, compile_note.


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
        # Whether the innermost running region is a group (see NOTE [ Nesting ]).
        self.group = False


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
    level = _innermost()[0]
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


def _check_nesting(nesting: object) -> Nesting:
    """Validate ``nesting`` and return it."""
    if nesting not in NESTING_MODES:
        raise ConfigError(
            f"nesting {nesting!r} is not a nesting mode; allowed: 'auto' (inner blocks are "
            "checkpointed again only inside groups of layers and when selective), 'all' (every "
            "eligible block, inner ones too), 'outermost' (only the outermost eligible block in "
            "a chain, except inside groups)."
        )
    return nesting  # type: ignore[return-value]


class _RunAtLevel:
    """The function given to the core: runs ``fn`` under the ambient level captured at call time,
    and tells regions inside it whether they run inside a group (NOTE [ Nesting ])."""

    __slots__ = ("fn", "level", "group")

    def __init__(self, fn: Callable[..., Any], level: Level, group: bool) -> None:
        self.fn = fn
        self.level = level
        self.group = group

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        region = _region
        previous = region.level, region.group
        region.level, region.group = self.level, self.group
        try:
            return self.fn(*args, **kwargs)
        finally:
            region.level, region.group = previous


def _subgraph_now(module: nn.Module | None) -> bool:
    """Whether an outermost region of ``module`` is compiled as a subgraph now: where this
    torch has them, while dynamo traces (not export's other tracers), and when the module
    writes no running statistics (NOTE [ A region is its own subgraph ] in ``_traced``)."""
    return (
        _traced.region_subgraph is not None
        and torch.compiler.is_dynamo_compiling()
        and not _core.writes_running_stats(module)
    )


def _checkpoint(
    region: _RunAtLevel,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    exact: bool | None = None,
    nested: bool = False,
    subgraph: bool = False,
) -> Any:
    """``_core.checkpoint_region`` of ``region`` called on ``args`` and ``kwargs``, with the
    core's ``options``. In eager the core is given the region itself, which recomputation runs
    again; while torch.compile traces, the bare function, the region's level and group pushed
    on the trace's stack around the call (NOTE [ The training level under torch.compile ] in
    ``_traced``),
    or, where torch's compiled checkpoint would not be exact, the region run eagerly between
    graphs. ``exact``: whether the traced checkpoint is exact, where the caller knows better
    than the region's module can say (a run of several modules); ``nested``: the region holds
    fully checkpointed regions (NOTE [ Nested regions under torch.compile ]); ``subgraph``:
    the region may be compiled as a subgraph when outermost (:func:`_subgraph_now`)."""
    if not _core.compiling():
        return _core.checkpoint_region(region, *args, **options, **kwargs)
    if nested:
        _note_nested_between_graphs(options["label"])
        return _traced.checkpoint_between_graphs(region, *args, **options, **kwargs)
    if exact is None:
        exact = _core.traced_region_is_exact(region.fn, options.get("module"))
    if not exact:
        _traced.note_batchnorm_between_graphs()
        return _traced.checkpoint_between_graphs(region, *args, **options, **kwargs)
    if _core.region_depth() == 0:
        _traced.traced_reset()
        if subgraph and _subgraph_now(options["module"]):
            options = {**options, "graph": _traced.region_subgraph}
    _traced.traced_push(int(region.level), region.group)
    try:
        return _core.checkpoint_region(region.fn, *args, **options, **kwargs)
    finally:
        _traced.traced_pop()


# NOTE [ Nested regions under torch.compile ]
#
# torch's compiled checkpoint tags a region's operators for the partitioner, which recomputes
# the tagged part of one graph in one piece: a region nested inside another does not bound the
# outer one's recomputation as it does in eager, where the outer recomputation keeps only the
# inner regions' inputs. So a full region that holds a fully checkpointed region at the
# training level (``Policy.nests_full``, from the plan) would hold more compiled than the plan
# says, often more than the level below. Such a region runs eagerly between compiled graphs,
# where the core nests as in eager: the compiled step keeps what the plan says, at eager speed
# for that region; the first one warns once. A selective region is not one of them: its kept
# operators are tagged per operator and flatten without that cost.


def _nests_now(policy: Policy) -> bool:
    """While torch.compile traces: whether the region runs between graphs at the training
    level now (NOTE [ Nested regions under torch.compile ])."""
    return int(_policy_level(policy)) in policy.nests_full and _core.compiling()


def _note_nested_between_graphs(label: str) -> None:
    compile_note(
        "nested-between-graphs",
        f"{label!r} holds checkpointed regions, which torch.compile would recompute in one "
        "piece with it: to keep the plan's memory, such regions run eagerly between compiled "
        "graphs (graph breaks; gradients exact). Where the model calls one forward at several "
        "sizes (the stages of a pyramid), compile with dynamic=False: after a graph break "
        "dynamo otherwise compiles that forward again with symbolic sizes, which can take "
        "minutes. (Shown once.)",
    )


# Each level by its value, for code dynamo traces: an enum's constructor is Python that some
# releases (2.11) cannot trace (NOTE [ The training level under torch.compile ]).
_LEVELS: tuple[Level, ...] = tuple(Level)
assert all(level.value == i for i, level in enumerate(_LEVELS))


def _innermost() -> tuple[Level | None, bool]:
    """The level and group of the innermost running region (``None`` and ``False`` outside
    every region): while torch.compile traces, from the trace's own stack (NOTE [ The training
    level under torch.compile ])."""
    if _core.compiling():
        top = _traced.traced_top()
        return (None, False) if top is None else (_LEVELS[top[0]], top[1])
    return _region.level, _region.group


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
        nesting: what to do when called inside another checkpointed region: ``"all"``
            (default) checkpoint again, so the outer region's recomputation holds only this
            one's inputs; ``"auto"`` only inside a group (a segment of
            :func:`checkpoint_sequential`, or a module of a plan whose span holds several
            regions), or when selective; ``"outermost"`` never outside groups. A wrapper cannot
            see what its function will call, so it is a group only as a segment: hence
            ``"all"`` here and ``"auto"`` in a config. See NOTE [ Nesting ].
        preserve_rng_state: stash and restore the RNG state so dropout and drop-path give exact
            gradients.
        context_fn: passed to the core, e.g. a selective-checkpoint policy made with
            ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    Raises:
        LevelError: a level is not 0-5; the message lists the allowed values.
        ConfigError: ``nesting`` is not ``"auto"``, ``"all"`` or ``"outermost"``.

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
        level = parse_level(fn_checkpoint_level, what="fn_checkpoint_level")
        pinned = (
            None
            if training_checkpoint_level is None
            else parse_level(training_checkpoint_level, what="training_checkpoint_level")
        )
        rungs = (Rung(level, context_fn=context_fn),) if level > 0 else ()
        self.policy = Policy(rungs, pinned, _check_nesting(nesting), bool(preserve_rng_state))
        self.fn_checkpoint_level = level
        self.context_fn = context_fn

    @property
    def training_checkpoint_level(self) -> Level | None:
        return self.policy.training_level

    @property
    def nesting(self) -> Nesting:
        return self.policy.nesting

    @property
    def preserve_rng_state(self) -> bool:
        return self.policy.preserve_rng_state

    def forward(
        self, fn: Callable[..., Any], *args: Any, use_reentrant: bool | None = False, **kwargs: Any
    ) -> Any:
        if not self.policy.rungs or not self.training or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return run_policy(self.policy, fn, args, kwargs, bool(use_reentrant))

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


# NOTE [ Selective regions step aside ]
#
# A selective region keeps the outputs of the heavy operators that run inside it, through a
# dispatch mode active during its whole forward, nested regions included. A region inside it
# that keeps less (a full one, or a selective one that redoes more of the same operators: a
# higher ``below``) would therefore still have the outputs it means to redo kept by the outer
# region, and free almost nothing. So a selective rung stops applying (``Rung.until``) at the
# lowest training level at which a region inside its module that keeps less is checkpointed;
# from that level on the module runs plainly, or by a higher rung of its own. An inner region
# that keeps the same (a selective block in its selective stage) leaves the outer one in place.
# ``apply`` computes ``until`` from the plan, and ``plan()`` shows the same decision.


@dataclass(frozen=True)
class Rung:
    """One :class:`~vision_ckpt.config.Region` of a module from a level on (a module may have
    several), and when it applies. What ``plan()`` decides (``PlanEntry.rungs``, with no
    ``context_fn``) and what an installed forward runs (the same rung with its ``context_fn``).

    >>> print(Rung(Level.SMALL_BLOCK), Rung(Level.STAGE, Region(through="maxpool"), until=Level(5)))
    full 2 full through maxpool 4 only
    """

    level: Level
    """The lowest training level at which this rung applies (1-5)."""
    region: Region = Region()
    """The span and what it keeps; a selective one's operators are kept by ``context_fn`` when
    the rung is installed."""
    context_fn: Callable[[], tuple[Any, Any]] | None = None
    """Passed to the core (what a region that keeps operator outputs keeps), or ``None``."""
    until: Level | None = None
    """The rung stops applying at this training level: one that keeps operator outputs where a
    region inside it that keeps less starts (NOTE [ Selective regions step aside ]), a later
    member's of a run where the run starts (NOTE [ Runs take over ] in ``_planning.py``); ``None``:
    it applies at every level from ``level`` on."""
    inside: bool = False
    """Set by ``plan()`` on a rung with ``segments`` of a stack that is a full region from a
    lower level: the segments run inside one region of the whole stack instead of replacing it
    (NOTE [ Segments inside their stack's region ])."""

    @property
    def keep(self) -> KeepOps | None:
        """The region's ``keep``."""
        return self.region.keep

    @property
    def segments(self) -> int | Literal["auto"] | None:
        """The region's ``segments``."""
        return self.region.segments

    @property
    def through(self) -> str | None:
        """The region's ``through``."""
        return self.region.through

    @property
    def offload(self) -> bool:
        """The region's ``offload``."""
        return self.region.offload

    @property
    def selective(self) -> bool:
        """The region's ``selective``."""
        return self.region.selective

    @property
    def group(self) -> bool:
        """The region's ``group``."""
        return self.region.group

    @property
    def layer_group_run(self) -> bool:
        """A run that is a group of a ModuleList's layers, whose layers keep their own rungs
        inside it (NOTE [ Groups of a ModuleList ] in ``_planning``)."""
        return self.through is not None and self.segments is not None

    @property
    def what(self) -> str:
        """The region in words, without its levels: ``full``, ``keep heavy<40``, ``full through
        maxpool``, ``segments/2``, ``full in segments/2``, ``offload``."""
        return f"full in {self.region}" if self.inside else str(self.region)

    def __str__(self) -> str:
        text = self.what
        if self.until is not None:
            last = int(self.until) - 1
            if last == int(self.level):
                return f"{text} {last} only"
            return f"{text} {int(self.level)}-{last}"
        return f"{text} {int(self.level)}"


@dataclass(frozen=True)
class Policy:
    """Everything that decides, at call time, whether and how one region is checkpointed.

    Shared by :class:`ActivationCheckpointing` and the forwards :func:`vision_ckpt.apply`
    installs, so both decide with :func:`choose_rung`.
    """

    rungs: tuple[Rung, ...]
    """The region's rungs by increasing level, one per level; empty: never checkpointed."""
    training_level: Level | None
    """A fixed training level, or ``None`` to follow the global one."""
    nesting: Nesting
    """``auto``, ``all`` or ``outermost`` (NOTE [ Nesting ])."""
    preserve_rng_state: bool
    """Stash and restore the RNG state around the region."""
    holds_several: frozenset[int] = frozenset()
    """Training levels at which the region directly holds two or more fully checkpointed
    regions: at those it is recomputed like a group (NOTE [ Nesting ])."""
    lean: Level | None = None
    """The training level from which the module runs its lean forward (an MLP,
    NOTE [ Lean MLP ] in ``_lean``), inside a region or not; ``None``: never."""
    nests_full: frozenset[int] = frozenset()
    """Training levels at which the region is full and holds a fully checkpointed region: under
    torch.compile it runs between graphs there (NOTE [ Nested regions under torch.compile ])."""
    own_subgraph: bool = False
    """Under torch.compile, the region is compiled as a subgraph when it is outermost (NOTE [ A
    region is its own subgraph ] in ``_traced``): set for regions ``apply`` installs, not for a
    wrapper, whose function may change from call to call."""


def lean_now(policy: Policy) -> bool:
    """Whether a module with ``policy`` runs its lean forward now: at the training level the
    regions see (NOTE [ The training level seen by recomputation ]), so that a recomputation
    runs the forward its first call ran."""
    return policy.lean is not None and is_checkpointed(policy.lean, _policy_level(policy))


RungT = TypeVar("RungT")


def rung_within(rungs: Sequence[RungT], level: int) -> RungT | None:
    """Of ``rungs`` (by increasing level, each with ``level`` and ``until``), the one that
    applies at training ``level``: the highest within it, skipping a rung past its ``until``
    (NOTE [ Selective regions step aside ], NOTE [ Runs take over ] in ``_planning.py``)."""
    chosen = None
    for rung in rungs:
        if not is_checkpointed(rung.level, level):  # type: ignore[attr-defined]
            break
        until = rung.until  # type: ignore[attr-defined]
        if until is None or level < until:
            chosen = rung
    return chosen


def choose_rung(policy: Policy) -> Rung | None:
    """The rung to checkpoint with now, or ``None`` to call the function directly.

    Training mode and grad mode are the caller's to check; this applies the level contract
    (the highest rung within the training level) and the nesting mode. See NOTE [ The training
    level seen by recomputation ] and NOTE [ Nesting ].
    """
    chosen = rung_within(policy.rungs, _policy_level(policy))
    if chosen is None or _core.region_depth() == 0:
        return chosen
    return chosen if nests(policy.nesting, chosen, _innermost()[1]) else None


def nests(nesting: str, rung: Rung, inside_group: bool) -> bool:
    """The nesting rule, the one place it is written (NOTE [ Nesting ]): whether a region whose
    ``rung`` applies is checkpointed while another region runs, given the nesting mode and
    whether the innermost running region is a group. ``plan()`` decides with it too.

    >>> full = Rung(Level.SMALL_BLOCK)
    >>> nests("all", full, False), nests("outermost", full, True), nests("auto", full, False)
    (True, True, False)
    """
    if nesting == "all" or inside_group:
        return True
    return nesting == "auto" and rung.selective


def _ambient_level() -> Level:
    """The training level regions see now: the one captured when the innermost running region
    was called, else the global one (NOTE [ The training level seen by recomputation ])."""
    ambient = _innermost()[0]
    return _training_level if ambient is None else ambient


def _policy_level(policy: Policy) -> Level:
    """The training level ``policy`` decides by now: its pinned one, else the ambient one."""
    pinned = policy.training_level
    return _ambient_level() if pinned is None else pinned


def _run_context(policy: Policy, rung: Rung) -> tuple[Level, bool]:
    """The ambient level a region checkpointed with ``rung`` runs under, and whether it is a
    group at the level that chose it (NOTE [ Nesting ])."""
    return _ambient_level(), rung.group or int(_policy_level(policy)) in policy.holds_several


def run_policy(
    policy: Policy,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    use_reentrant: bool = False,
    *,
    module: nn.Module | None = None,
    label: str | None = None,
) -> Any:
    """Call ``fn(*args, **kwargs)``, checkpointed as ``policy`` decides (training and grad mode
    already checked by the caller). ``fn`` runs as one region, which is ``module`` (whose
    BatchNorm statistics the core guards) and is called ``label`` in errors; both default to
    what ``fn`` itself shows (a module, or a module's bound method). See :func:`run_segments`
    for a stack of layers."""
    rung = choose_rung(policy)
    if rung is None:
        return fn(*args, **kwargs)
    region = _RunAtLevel(fn, *_run_context(policy, rung))
    if use_reentrant:
        if rung.context_fn is not None:
            raise ConfigError(
                "use_reentrant=True cannot honour context_fn (selective checkpointing): torch's "
                "reentrant checkpoint has no such option. Drop use_reentrant=True, or the "
                "context_fn / selective setting."
            )
        return _reentrant_checkpoint(region, args, kwargs, policy.preserve_rng_state)
    if module is None:
        owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
        module = owner if isinstance(owner, nn.Module) else None
    if label is None:
        label = _frame.region_label(fn)
    options = _region_options(policy, rung, label, module)
    return _checkpoint(
        region, args, kwargs, options, nested=_nests_now(policy), subgraph=policy.own_subgraph
    )


def _region_options(
    policy: Policy, rung: Rung, label: str, module: nn.Module | None
) -> dict[str, Any]:
    """The core's options for a region of ``policy`` checkpointed with ``rung``."""
    return dict(
        module=module,
        label=label,
        preserve_rng_state=policy.preserve_rng_state,
        context_fn=bind_region(rung.context_fn, label),
        offload=_offload_now(rung, label),
    )


def _offload_now(rung: Rung, label: str) -> bool:
    """Whether the region offloads its inputs now: in eager only (torch's checkpoint, which
    compiled code uses, keeps them on the device), with a warning once under compile."""
    if not rung.offload:
        return False
    if torch.compiler.is_compiling():
        compile_note(
            f"offload:{label}",
            f"{label!r} is offloaded (offload: true), which torch.compile does not apply: under "
            "compile the region is a full one whose inputs stay on the device (gradients are "
            "exact). CheckpointPlan.not_compiled lists such modules. (Shown once.)",
        )
        return False
    return True


class ChainCall:
    """One run of sibling modules, called one after another by their parent, checkpointed as
    one region (a rule's ``through``; NOTE [ Regions of consecutive calls ] in ``_chain``).

    :meth:`open` decides with the first module's policy, as :func:`run_policy` does, and
    :meth:`run` runs each call under the training level captured then, so regions inside the
    run take the same decisions in forward and recomputation.
    """

    __slots__ = ("region", "level", "group")

    def __init__(self, region: _chain.ChainRegion, level: Level, group: bool) -> None:
        self.region = region
        self.level = level
        self.group = group

    @classmethod
    def open(cls, policy: Policy, modules: list[nn.Module], label: str, x: Any) -> ChainCall | None:
        """The run starting at input ``x``, or ``None`` when the policy's rung now is not a
        run (the first module is then called as :func:`run_policy` decides). Eager only: while
        torch.compile traces, a run is one function (:func:`run_traced_chain`)."""
        rung = choose_rung(policy)
        if rung is None or rung.through is None or not isinstance(x, torch.Tensor):
            return None
        if torch.compiler.is_compiling():  # traced, a run is one function: run_traced_chain
            return None
        region = _chain.ChainRegion(
            x, modules=modules, label=label, preserve_rng_state=policy.preserve_rng_state
        )
        return cls(region, *_run_context(policy, rung))

    def run(self, fn: Callable[[Any], Any], x: torch.Tensor) -> Any:
        """Call ``fn(x)`` as the run's next call."""
        return self.region.run(_RunAtLevel(fn, self.level, self.group), x)

    def same_context(self) -> str | None:
        """``None`` when a call now may join the run, else why not (grad mode, autocast or
        the enclosing region differ from the first call's)."""
        return self.region.same_context()


# NOTE [ Runs under torch.compile ]
#
# In eager, a run of sibling calls is one region opened by its first call and joined by each
# next one (NOTE [ Runs of sibling calls ] in ``regions._install``). torch's compiled checkpoint
# needs a region as one function, so while dynamo traces, the first call runs the whole run at
# once: one function that calls every member in order, each on the previous one's output (with
# the first call's further arguments, for a group of layers), checkpointed as one region that
# returns every member's output. The first call returns its own; each later call returns the
# next one, but only if it receives exactly the output the run gave its predecessor, under the
# grad mode and autocast of the first call; that is what eager checks too, so both run the same
# computation. A call that does anything else ends the run: it runs as its own rules say, the
# outputs computed ahead for it and later members are dropped (exact, at the cost of computing
# them once for nothing), and the first compiled call warns once. Dynamo traces the state of
# the run (outputs, next member) as plain Python attributes, so a run left open holds its
# outputs until its first member is called again.


def run_traced_chain(
    policy: Policy,
    calls: Sequence[Callable[..., Any]],
    label: str,
    x: Any,
    extra: tuple[tuple[Any, ...], dict[str, Any]],
    modules: Sequence[nn.Module],
) -> tuple[Any, ...] | None:
    """While torch.compile traces: the run of ``calls`` from ``x`` as one region (NOTE [ Runs
    under torch.compile ]), every call's output in order up to the first that is not one
    tensor; ``None`` when the policy's rung now is not a run. ``extra``: the further arguments
    every call takes; ``modules``: the run's modules (whether torch's traced checkpoint is
    exact for them)."""
    rung = choose_rung(policy)
    if rung is None or rung.through is None or not isinstance(x, torch.Tensor):
        return None
    more, named = extra

    def whole(x: torch.Tensor) -> tuple[Any, ...]:
        outs: list[Any] = []
        for call in calls:
            x = call(x, *more, **named)
            outs.append(x)
            if not isinstance(x, torch.Tensor):
                break
        return tuple(outs)

    region = _RunAtLevel(whole, *_run_context(policy, rung))
    options = _region_options(policy, rung, label, None)
    if _nests_now(policy):
        _note_nested_between_graphs(label)
    elif all(_core.traced_region_is_exact(m, m) for m in modules):
        return _checkpoint(region, (x,), {}, options, exact=True)
    else:
        _traced.note_batchnorm_between_graphs()
    return _traced.run_between_graphs(region, x, list(modules), options)


def note_run_broken_traced(label: str, key: str, name: str, reason: str) -> None:
    """Warn once per ``key`` that the run ``label`` ended early under torch.compile."""
    compile_note(
        key,
        f"under torch.compile the checkpointed run {label!r} ended at {name!r}, which {reason}: "
        "it runs as its own rules say, and the outputs the run computed ahead for it are "
        "dropped. Gradients are exact; the run's memory is not the plan's. Check that the "
        "parent's forward calls these modules one after another on one tensor. (Shown once.)",
    )


def segment_size(rung: Rung, n: int) -> int:
    """How many of ``n`` layers one segment of ``rung`` holds.

    >>> segment_size(Rung(Level.LARGE_MODULE, Region(segments="auto")), 16)
    4
    """
    if rung.segments == "auto":
        return max(1, round(math.sqrt(n)))
    return max(1, int(rung.segments or n))


class _Segment:
    """Some consecutive layers of a stack, called in order: one region of a segmented stack."""

    __slots__ = ("layers",)

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def run_segments(
    policy: Policy, stack: nn.Module, whole: Callable[..., Any], label: str, x: Any
) -> Any:
    """Run an ``nn.Sequential`` ``stack`` on ``x`` as ``policy`` decides: a segmented rung runs
    its layers as consecutive groups, each checkpointed as one group region, inside one region
    of the whole stack where the rung says so (``Rung.inside``); any other rung runs ``whole``
    (the stack's forward) as :func:`run_policy` does."""
    rung = choose_rung(policy)
    if rung is None or rung.segments is None:
        return run_policy(policy, whole, (x,), {}, module=stack, label=label)
    if rung.inside:  # NOTE [ Segments inside their stack's region ]
        segmented = functools.partial(_in_segments, policy, stack, rung, label)
        return run_policy(policy, segmented, (x,), {}, module=stack, label=label)
    return _in_segments(policy, stack, rung, label, x)


# NOTE [ Segments inside their stack's region ]
#
# A stack that is a full region from one level and is split into segments from a higher one
# stays one region at the higher level, with its segments nested inside it (``Rung.inside``,
# set by the plan), rather than the segments replacing it. So the layers after the stack still
# run backward with only the stack's input kept, as at the level below, where sibling segments
# would keep every segment's input. Inside the stack's own backward the segments bound what its
# recomputation holds: the segments' inputs and one segment's layer inputs at a time, instead
# of every layer's input. The price is one more forward of every segment. Segments are groups
# (NOTE [ Nesting ]), so their layers' regions stay checkpointed inside them in every nesting
# mode.


def _in_segments(policy: Policy, stack: nn.Module, rung: Rung, label: str, x: Any) -> Any:
    """The layers of ``stack`` on ``x``, each group of ``rung``'s segment size one group
    region."""
    layers = list(stack)
    size = segment_size(rung, len(layers))
    ambient = _ambient_level()
    for start in range(0, len(layers), size):
        part_label = f"{label}[{start}:{start + size}]"
        region = _RunAtLevel(_Segment(layers[start : start + size]), ambient, True)
        options = dict(
            module=stack,
            label=part_label,
            preserve_rng_state=policy.preserve_rng_state,
            context_fn=bind_region(rung.context_fn, part_label),
        )
        x = _checkpoint(region, (x,), {}, options, nested=_nests_now(policy))
    return x
