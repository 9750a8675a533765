"""Where a training step peaks, and how low any region plan could bring it.

:func:`where_peak` runs one training step (forward, loss, backward) under a storage tracker of
its own and reports the moment of the peak: how many bytes of tensor storage were live above
what was live before the step (parameters, buffers, the input), the phase, the aten operator
that had just run, the module call that was running it (also inside a recomputation), and
every live storage at that instant grouped by the module call that created it. It also
measures the model's physical floor at the batch (:class:`Floor`): what no plan of
checkpointed regions can go below with exact gradients.

It is the library form of the hand-tuning loop that produced the bundled presets (run, look
at what is alive at the peak, add a rule, run again), and the measurement the derivation of
levels (issue 26, docs/derive.md) builds on.

# NOTE [ Peak attribution ]
#
# The tracker follows storages exactly as
# ``vision_ckpt.measure._memory.track_peak_memory`` does (NOTE [ What track_peak_memory counts ]
# there): a ``TorchDispatchMode`` counts each new output storage of an aten operator that is not one
# of the operator's own argument storages, a weak reference takes it off when it is freed, and the
# peak is taken after each operator's outputs are counted, while its inputs are still alive. The
# roots (parameters, buffers, gradients and the input) are live at entry. So
# ``PeakReport.peak_bytes`` equals that meter's ``peak_bytes - start_bytes`` for the same step
# (tests/test_peak.py checks it). It is a copy of those rules rather than a use, because the
# attribution needs a record per storage, which the meter does not keep (it is another module's
# private class).
#
# Each storage's record is made when it is created and says who made it:
#
# 1. in forward (and the loss), the innermost call of a module of the model then running, from
#    global forward pre/post hooks (``""`` is the model's own call, ``(loss)`` outside it);
# 2. in backward, while a checkpointed region is recomputed (``_core.is_recomputing``), the
#    innermost module call of the recomputation; a region's own module is recomputed through
#    its class's forward, not through ``__call__``, so operators in its body outside any child
#    are attributed to ``(recomputation)``;
# 3. in backward otherwise, the module whose backward is running: each module call's output
#    node gets, in forward, an autograd pre-hook (the innermost call's, once per node) that
#    records that module when backward reaches that node (a call that returns an argument
#    unchanged, an identity, marks nothing). A module's own operators between its children
#    (a residual block's sum of the two gradients of its input) are attributed to the module
#    marked last, the child whose backward ran just before: the hooks mark where each
#    module's backward starts, not where it ends;
# 4. after the step, records whose storage is a parameter's ``.grad`` become the group
#    ``(parameter gradients)``.
#
# At every new maximum the tracker keeps the list of live records (not copies of tensors), so
# the groups at the peak cost no second run. The groups are deterministic on CPU; the peak's
# operator is the first one to reach the maximum.

# NOTE [ The physical floor ]
#
# A plan of checkpointed regions (full or selective) runs the model's own aten operators: every
# forward operator at least once, every backward operator exactly once, in the same order, with
# the same argument and output sizes (a recomputed saved tensor has its original's size), and
# parameter gradients accumulate in the same order. So at every operator ``o`` of the plain
# step, any such plan holds at least
#
#     working_set(o) + parameter gradients already accumulated when o runs
#
# where ``working_set(o)`` is the bytes of the distinct storages among ``o``'s tensor
# arguments and outputs, leaving out the roots (parameters, buffers, the input: they are below
# the meter's zero) and the parameter gradients (counted in the second term). For a forward
# operator this is its inputs and outputs; for a backward operator (``convolution_backward``,
# ``native_batch_norm_backward``, ``mm``) it is the gradient of its output, the saved tensors it
# reads and the gradients it produces. The floor is the maximum of that sum over the operators
# of one plain step (no region active, measured on the model with its checkpointing taken off
# for the duration). It is a lower bound for region plans, so it is at or below the peak of
# every level; the issue's "parameter gradients plus the largest working set" is the looser
# upper estimate ``param_grad_bytes + max_working_set_bytes``, both reported. Not covered: a
# lean MLP (``lean: true``) replaces the MLP's backward operators by fewer, in place, and
# can go below the floor; scratch memory inside an operator is not counted (as by the meter).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._compat import TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves
from ..config.schema import CheckpointConfig
from ..errors import ConfigError
from ..regions.apply import ConfigLike, as_config
from ..runtime._core import is_recomputing
from ._measure import applied, default_loss, model_restored
from ._memory import format_bytes

__all__ = ["LiveGroup", "Floor", "PeakReport", "where_peak", "physical_floor"]

Phase = Literal["forward", "backward"]
Kind = Literal["input", "activation", "recomputed", "gradient", "parameter gradient"]

_LOSS = "(loss)"
_RECOMPUTATION = "(recomputation)"
_PARAM_GRADS = "(parameter gradients)"
_INPUT = "(before the step)"
_NODE_KEY = "vision_ckpt.measure.peak.module"


@dataclass(frozen=True)
class LiveGroup:
    """Storages live at the peak that one module call created, of one kind."""

    owner: str
    """The module's qualified name (``""`` is the model's own call), or ``(loss)``,
    ``(recomputation)``, ``(parameter gradients)``, or ``(before the step)`` for the roots:
    parameters, buffers and the input (NOTE [ Peak attribution ])."""
    kind: Kind
    """``activation`` (made in forward), ``recomputed`` (made by a recomputation in backward),
    ``gradient`` (made by backward operators), ``parameter gradient``, or ``input`` (the
    roots, live before the step)."""
    nbytes: int
    """Bytes of the group's storages."""
    count: int
    """Number of storages."""

    def __str__(self) -> str:
        return f"{format_bytes(self.nbytes):>11} {self.kind:18s} {self.owner or '(model)'}"


@dataclass(frozen=True)
class Floor:
    """The model's physical floor at a batch: see NOTE [ The physical floor ]."""

    floor_bytes: int
    """The largest ``working set + parameter gradients then`` over the plain step's operators:
    no plan of regions peaks below it (in :attr:`PeakReport.peak_bytes`'s terms)."""
    working_set_bytes: int
    """The working set of the operator that sets the floor (gradients of parameters left out)."""
    param_grad_bytes_then: int
    """Parameter gradients already live when that operator ran."""
    operator: str
    """That operator, e.g. ``aten.convolution_backward.default``."""
    phase: Phase
    module: str
    """The module call it belongs to (as :attr:`PeakReport.module`)."""
    max_working_set_bytes: int
    """The largest working set of any one operator of the step."""
    param_grad_bytes: int
    """All parameter gradients (what the step ends holding)."""
    operator_bytes: tuple[int, ...] = field(default=(), repr=False)
    """``working set + parameter gradients then`` of every operator of the step, in the order
    they ran (:attr:`floor_bytes` is their largest). Each is affine in the batch, so the floor
    of a larger batch is the largest of their lines, not the line through two floors: which
    operator sets the floor can change with the batch (NOTE [ Predicting the peak of a larger
    batch ] in ``_extrapolate``)."""

    def __str__(self) -> str:
        return (
            f"floor {format_bytes(self.floor_bytes)}: {self.operator} in {self.phase} "
            f"({self.module or '(model)'}) holds {format_bytes(self.working_set_bytes)} beside "
            f"{format_bytes(self.param_grad_bytes_then)} of parameter gradients"
        )


@dataclass(frozen=True)
class PeakReport:
    """Where one training step peaked (NOTE [ Peak attribution ])."""

    peak_bytes: int
    """Peak of live tensor storage above what was live before the step (parameters, buffers,
    the input): ``track_peak_memory``'s ``peak_bytes - start_bytes``."""
    start_bytes: int
    """What was live before the step (the roots)."""
    phase: Phase
    """Whether the peak came in forward (the loss included) or in backward."""
    operator: str
    """The aten operator whose outputs brought the peak, e.g. ``aten.convolution.default``."""
    operator_shapes: tuple[tuple[int, ...], ...]
    """Shapes of its tensor arguments, then of its outputs."""
    module: str
    """The innermost module call running at the peak (qualified name, ``""`` the model itself;
    ``(loss)``, ``(recomputation)``; in backward outside a recomputation, the module whose
    backward was running)."""
    recomputing: bool
    """Whether a checkpointed region was being recomputed at the peak."""
    groups: tuple[LiveGroup, ...]
    """Every storage live at the peak, grouped by owner and kind, largest first; the roots'
    group (``(before the step)``: parameters, buffers, the input) is last."""
    param_grad_bytes: int
    """All parameter gradients at the end of the step."""
    floor: Floor | None = None
    """The model's physical floor at this batch (``where_peak(..., floor=True)``)."""

    def group(self, owner: str, kind: Kind | None = None) -> int:
        """Bytes live at the peak that ``owner`` created (of ``kind``, or of every kind)."""
        return sum(g.nbytes for g in self.groups if g.owner == owner and kind in (None, g.kind))

    def __str__(self) -> str:
        where = self.module or "(model)"
        lines = [
            f"peak {format_bytes(self.peak_bytes)} above {format_bytes(self.start_bytes)} in "
            f"{self.phase}{' (recomputing)' if self.recomputing else ''}: {self.operator} "
            f"{[list(s) for s in self.operator_shapes]} in {where}"
        ]
        if self.floor is not None:
            left = self.peak_bytes - self.floor.floor_bytes
            lines.append(f"{self.floor}; {format_bytes(left)} above it")
        lines.append("live at the peak:")
        lines += [f"  {g}" for g in self.groups if g.kind != "input"]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The tracker
# --------------------------------------------------------------------------------------------


class _Record:
    """One followed storage: its bytes and who made it."""

    __slots__ = ("nbytes", "owner", "kind", "index")

    def __init__(self, nbytes: int, owner: str, kind: Kind, index: int) -> None:
        self.nbytes = nbytes
        self.owner = owner
        self.kind: Kind = kind
        self.index = index  # the operator that made it (-1: a root)


def _plain(t: torch.Tensor) -> Iterator[torch.Tensor]:
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                yield from _plain(inner)
    else:
        yield t


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return storage if storage.nbytes() else None


def _storages(obj: Any) -> Iterator[torch.UntypedStorage]:
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            for t in _plain(leaf):
                s = _storage(t)
                if s is not None:
                    yield s


class _Calls:
    """The module calls running now, from global forward hooks (NOTE [ Peak attribution ])."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        # each running call, with the autograd nodes of its arguments when it began
        self.stack: list[tuple[nn.Module, str, tuple[list[Any], set[int]]]] = []
        self.backward_module = _LOSS  # rule 3; until a module's backward begins
        self.forward_done = False
        self.recomputed = False  # calls of a recomputation are on the stack
        self.stack_before_recompute = 0
        self._handles: list[Any] = []

    def __enter__(self) -> _Calls:
        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def _settle(self) -> None:
        """Forget the calls of a recomputation that has ended: the core stops a recomputation
        as soon as it has the tensors backward needs, inside the calls then running, whose
        post-hooks then never run."""
        if self.recomputed and not is_recomputing():
            del self.stack[self.stack_before_recompute :]
            self.recomputed = False

    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self._settle()
            if is_recomputing() and not self.recomputed:
                self.recomputed = True
                self.stack_before_recompute = len(self.stack)
            # the nodes themselves, not only their ids: a node's Python object lives only while
            # something holds it (torch 2.6), and a freed one's id is reused by the next
            nodes = [
                t.grad_fn
                for t in tree_leaves(args)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None
            ]
            self.stack.append((module, name, (nodes, {id(n) for n in nodes})))

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        self._settle()
        if not self.stack or self.stack[-1][0] is not module:
            return
        _, name, (_, before) = self.stack.pop()
        if self.forward_done or is_recomputing():
            return
        for t in tree_leaves(out):
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            if node is None or id(node) in before:
                continue  # an identity's output: the node is its input's maker's
            if _NODE_KEY not in node.metadata:
                node.metadata[_NODE_KEY] = name  # the innermost call's output: first to end
                node.register_prehook(functools.partial(self._entered, name))

    def _entered(self, name: str, grad_outputs: Any) -> None:
        self.backward_module = name

    def running(self) -> str:
        """Who runs an operator now (NOTE [ Peak attribution ], rules 1-3)."""
        self._settle()
        if self.stack:
            return self.stack[-1][1]
        if not self.forward_done:
            return _LOSS
        if is_recomputing():
            return _RECOMPUTATION
        return self.backward_module


class _Tracker(TorchDispatchMode):
    """Counts storages as ``track_peak_memory`` does and keeps the live records at the peak,
    and each operator's working set (NOTE [ The physical floor ])."""

    def __init__(self, calls: _Calls, working_sets: bool) -> None:
        super().__init__()
        self.calls = calls
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[weakref.ref[torch.UntypedStorage], _Record]] = {}
        self.index = 0
        self.at_peak: list[_Record] = []
        self.peak_op: tuple[str, tuple[tuple[int, ...], ...], str, bool, Phase] | None = None
        self.working_sets: list[tuple[int, list[_Record], str, str, Phase]] | None = (
            [] if working_sets else None
        )

    def phase(self) -> Phase:
        return "backward" if self.calls.forward_done else "forward"

    def root(self, storage: torch.UntypedStorage) -> None:
        if self._record_of(storage) is None:
            self._follow(storage, _Record(storage.nbytes(), _INPUT, "input", -1))

    def _record_of(self, storage: torch.UntypedStorage) -> _Record | None:
        entry = self._live.get(storage.data_ptr())
        return entry[1] if entry is not None and entry[0]() is storage else None

    def _follow(self, storage: torch.UntypedStorage, record: _Record) -> None:
        ptr = storage.data_ptr()
        self._live[ptr] = (weakref.ref(storage, functools.partial(self._release, ptr)), record)
        self.live_bytes += record.nbytes

    def _release(self, ptr: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        entry = self._live.get(ptr)
        if entry is not None and entry[0] is ref:
            del self._live[ptr]
            self.live_bytes -= entry[1].nbytes

    def stop(self) -> None:
        self._live.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.index += 1
        inputs = list(_storages((args, kwargs)))
        input_ptrs = {s.data_ptr() for s in inputs}
        outputs = list(_storages(out))
        owner: str | None = None
        for storage in outputs:
            record = self._record_of(storage)
            if record is not None:
                if storage.nbytes() != record.nbytes:  # resized in place
                    self.live_bytes += storage.nbytes() - record.nbytes
                    record.nbytes = storage.nbytes()
                continue
            if storage.data_ptr() in input_ptrs:
                continue  # a view of a storage from before entry: not an allocation
            if owner is None:
                owner = self.calls.running()
            kind: Kind = "activation"
            if self.calls.forward_done:
                kind = "recomputed" if is_recomputing() else "gradient"
            self._follow(storage, _Record(storage.nbytes(), owner, kind, self.index))
        if self.working_sets is not None:
            seen: dict[int, _Record] = {}
            for storage in inputs + outputs:
                record = self._record_of(storage)
                if record is not None and record.kind != "input":
                    seen[id(record)] = record
            if seen:
                where = owner if owner is not None else self.calls.running()
                self.working_sets.append(
                    (self.index, list(seen.values()), str(func), where, self.phase())
                )
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.at_peak = [record for _, record in self._live.values()]
            leaves = tree_leaves((args, kwargs, out))
            shapes = tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))
            where = owner if owner is not None else self.calls.running()
            self.peak_op = (str(func), shapes, where, is_recomputing(), self.phase())
        return out


def _inputs_of(example_input: Any) -> tuple[Any, ...]:
    return example_input if isinstance(example_input, tuple) else (example_input,)


def _traced_step(
    model: nn.Module, example_input: Any, loss_fn: Callable[[Any], torch.Tensor], floor: bool
) -> tuple[_Tracker, int, int]:
    """One training step under the tracker; the model's gradients are cleared first. Returns
    the tracker, the bytes live at entry and the parameter gradients' bytes at the end."""
    params = list(model.parameters())
    model.zero_grad(set_to_none=True)
    with _Calls(model) as calls:
        tracker = _Tracker(calls, floor)
        for storage in _storages((params, list(model.buffers()), example_input)):
            tracker.root(storage)
        start = tracker.live_bytes
        tracker.peak_bytes = start
        try:
            with tracker:
                out = model(*_inputs_of(example_input))
                loss = loss_fn(out)
                del out
                calls.forward_done = True
                loss.backward()
                del loss
            grads = {}
            for p in params:
                if p.grad is not None:
                    for s in _storages(p.grad):
                        record = tracker._record_of(s)
                        if record is not None and record.kind != "input":
                            record.owner, record.kind = _PARAM_GRADS, "parameter gradient"
                            grads[id(record)] = record.nbytes
        finally:
            tracker.stop()
    return tracker, start, sum(grads.values())


def _floor_of(tracker: _Tracker, param_grad_bytes: int) -> Floor:
    """NOTE [ The physical floor ] from one plain step's working sets."""
    sets = tracker.working_sets or []
    grads = sorted(
        {
            id(r): r for _, records, *_ in sets for r in records if r.kind == "parameter gradient"
        }.values(),
        key=lambda r: r.index,
    )
    best: tuple[int, int, int, str, str, Phase] | None = None
    widest = 0
    totals: list[int] = []
    g, accumulated = 0, 0
    for index, records, op, where, phase in sets:
        working = sum(r.nbytes for r in records if r.kind != "parameter gradient")
        widest = max(widest, working)
        # the gradients made by this operator or before it
        while g < len(grads) and grads[g].index <= index:
            accumulated += grads[g].nbytes
            g += 1
        total = working + accumulated
        totals.append(total)
        if best is None or total > best[0]:
            best = (total, working, accumulated, op, where, phase)
    if best is None:
        return Floor(0, 0, 0, "", "forward", "", 0, param_grad_bytes)
    total, working, accumulated, op, where, phase = best
    return Floor(
        floor_bytes=max(total, param_grad_bytes),
        working_set_bytes=working,
        param_grad_bytes_then=accumulated,
        operator=op,
        phase=phase,
        module=where,
        max_working_set_bytes=widest,
        param_grad_bytes=param_grad_bytes,
        operator_bytes=tuple(totals),
    )


def _groups(records: list[_Record]) -> tuple[LiveGroup, ...]:
    sums: dict[tuple[str, Kind], list[int]] = {}
    for r in records:
        entry = sums.setdefault((r.owner, r.kind), [0, 0])
        entry[0] += r.nbytes
        entry[1] += 1
    groups = [LiveGroup(o, k, n, c) for (o, k), (n, c) in sums.items()]
    groups.sort(key=lambda g: (g.kind == "input", -g.nbytes, g.owner, g.kind))
    return tuple(groups)


def _config_of(config: ConfigLike | None, level: int | None) -> CheckpointConfig | None:
    if config is not None and level is not None:
        raise ConfigError(
            f"where_peak got both level={level!r} and a config; give one: a level applies the "
            "model's preset at that level (preset 'auto'), a config is applied as it is."
        )
    if level is not None:
        return CheckpointConfig(preset="auto", training_checkpoint_level=level)
    return as_config(config) if config is not None else None


def physical_floor(
    model: nn.Module,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Floor:
    """The model's physical floor for a training step on ``example_input``: the most that any
    operator of the step holds at once (its inputs and outputs, or in backward its output's
    gradient, saved tensors and input gradients) beside the parameter gradients accumulated by
    then; no plan of checkpointed regions peaks below it (NOTE [ The physical floor ]).

    Runs one step with the model's checkpointing taken off; weights, buffers, gradients and
    what was applied are put back afterwards.

    Args:
        model: the model (training mode is used for the step).
        example_input: its input: a tensor, or a tuple of positional arguments.
        loss_fn: maps the output to a scalar loss; default: mean of squares of every
            floating-point output tensor.

    Returns:
        A :class:`Floor`, in bytes above what was live before the step.

    >>> net = nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 16))
    >>> found = physical_floor(net, torch.randn(256, 16))
    >>> found.operator, found.working_set_bytes == 3 * 256 * 4096 * 4
    ('aten.threshold_backward.default', True)
    """
    with model_restored(model, None), applied(model, CheckpointConfig(training_checkpoint_level=0)):
        tracker, _, grads = _traced_step(model, example_input, loss_fn or default_loss, True)
    return _floor_of(tracker, grads)


def where_peak(
    model: nn.Module,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    config: ConfigLike | None = None,
    *,
    level: int | None = None,
    floor: bool = False,
) -> PeakReport:
    """Run one training step and report where its memory peaked (NOTE [ Peak attribution ]).

    Args:
        model: the model, with whatever checkpointing is applied to it (or none).
        example_input: its input: a tensor, or a tuple of positional arguments.
        loss_fn: maps the output to a scalar loss; default: mean of squares of every
            floating-point output tensor.
        config: a config to apply for the duration of the step (what was applied before is
            put back afterwards).
        level: shorthand for ``config={"preset": "auto", "training_checkpoint_level": level}``.
        floor: also measure the physical floor (:func:`physical_floor`, one more step).

    Returns:
        A :class:`PeakReport`; ``str(report)`` is a readable summary.

    Raises:
        ConfigError: both ``config`` and ``level``, or an invalid config.

    The model's weights, buffers (BatchNorm statistics), gradients and training mode are put
    back after the step.

    >>> net = nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 16))
    >>> report = where_peak(net, torch.randn(256, 16))
    >>> report.phase, report.operator, report.module
    ('backward', 'aten.threshold_backward.default', '1')
    >>> report.group("1", "activation") == 256 * 4096 * 4  # ReLU's output, saved for backward
    True
    """
    cfg = _config_of(config, level)
    loss = loss_fn or default_loss
    with (
        model_restored(model, None),
        applied(model, cfg) if cfg is not None else contextlib.nullcontext(),
    ):
        tracker, start, grads = _traced_step(model, example_input, loss, False)
    floor_found = physical_floor(model, example_input, loss_fn) if floor else None
    op, shapes, where, recomputing, phase = tracker.peak_op or ("", (), "", False, "forward")
    return PeakReport(
        peak_bytes=tracker.peak_bytes - start,
        start_bytes=start,
        phase=phase,
        operator=op,
        operator_shapes=shapes,
        module=where,
        recomputing=recomputing,
        groups=_groups(tracker.at_peak),
        param_grad_bytes=grads,
        floor=floor_found,
    )
