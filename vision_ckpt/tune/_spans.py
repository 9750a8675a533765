"""Candidate regions of a model, found by tracing one forward: what a derivation of levels
chooses from (issue 26, docs/derive.md).

:func:`trace_spans` runs the model once on an example input with global module hooks and
records every call of one of its modules, in order, with the tensors it took and returned.
From that record, and from nothing else (no module names or classes of any model library are
known here), it lists the spans the hand-written presets are made of, each one expressible as
a rule of the config vocabulary (:meth:`Span.rule`):

- ``module``: every module that was called (not the model itself);
- ``run``: consecutive sibling calls, each taking the previous one's output as its first
  argument, registered in the parent in the order they are called (a stem conv-norm-act-pool,
  a transformer layer's attention half): ``match: <first>``, ``through: <last>``;
- ``block``: a member of a repeated sequence, consecutive children of an ``nn.Sequential`` or
  ``nn.ModuleList`` (or all the children of another module, a stage class) of one structure,
  each with children of its own, called one after another;
- ``groups``: a container all of whose children form such a sequence, each taking the
  previous one's output, as groups of about sqrt(n) of them: ``segments: auto``;
- ``stage``: what holds a repeated sequence: the module itself, or for an ``nn.ModuleList``
  (which has no forward) the module holding it; never the model itself;
- ``lean``: a module that runs with the lean MLP backward on the input it was called with
  (``_lean.lean_mlp_call_problem``).

# NOTE [ Runs found by tracing ]
#
# A run is what a rule's ``through`` can express (NOTE [ Regions of consecutive calls ] in
# ``runtime._chain``), so it must hold three things, all checked on the trace:
#
# 1. its members are called directly by one call of their common parent module (the calls'
#    parent in the call stack is the parent module's call), one after the other with no other
#    call of that parent in between;
# 2. each member's first positional tensor argument is the previous member's output: the same
#    tensor, or a tensor with the same storage, offset, shape and strides (an in-place
#    activation returns its input); and every member's other positional arguments, the
#    first member's too, are values a run's replay can pass again (tensors, None, bool, int,
#    float, str; not a tuple of sizes, as PVT-v2's and Twins' attention take), or the
#    installed run stops at that member;
# 3. the members are children the parent registered from the first through the last, in that
#    order (``through`` names a range of registered children); a child registered inside the
#    range that the parent does not call on the chain is skipped (NOTE [ Runs of sibling
#    calls ] in ``_install``): by rules 1 and 2 nothing else is called between the members.
#
# No span starts with a call that writes one of its arguments in place or returns its own
# first argument: an in-place layer (a ReLU(inplace=True)), or a module that begins with one
# (torchvision's MNASNet classifier, an in-place dropout before its linear layer), would
# overwrite the input its region keeps for the recomputation (the checkpoint refuses it), and
# an identity is no region worth its bookkeeping. A block, a stage or a group whose first call
# writes its input is no span either.
#
# Members of a repeated sequence and stages take no part in runs: a sequence of layers is
# expressed by ``segments``, which runs its groups as runs, so a container is offered as groups
# only where its members meet condition 2 too (EfficientViT-MSRA's per-head convolutions,
# each fed its own slice, are called in order but are no chain), and a run through a stage is
# the trunk, not a piece of it. Every maximal run is cut there; every contiguous part of two or
# more calls of what remains is a candidate, except one that is its parent module again (all
# the parent's calls, from the parent's input to its output).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._compat import tree_leaves
from ..measure._measure import model_restored
from ..regions._install import passable
from ..runtime._lean import lean_mlp_call_problem

__all__ = ["Span", "SpanKind", "trace_spans"]

SpanKind = Literal["module", "run", "block", "groups", "stage", "lean"]


@dataclass(frozen=True)
class Span:
    """One candidate region of a traced model."""

    kind: SpanKind
    name: str
    """Qualified name of the module (of a run: its first member)."""
    members: tuple[str, ...]
    """The modules the span covers, in call order: a run's members, a group's or a stage's
    blocks, or just ``name``."""
    order: int
    """Index in the trace of the span's first call (spans sort in forward order)."""
    through: str | None = None
    """A run's last member, as its parent registered it (a rule's ``through``)."""

    @property
    def label(self) -> str:
        """``conv1..maxpool`` for a run (as ``CheckpointPlan.runs`` labels it), else the name."""
        return f"{self.name}..{self.through}" if self.through is not None else self.name

    def rule(self, level: int = 1) -> dict[str, Any]:
        """The span as one rule of a config (``LevelRule`` keys) at ``level``.

        >>> Span("run", "conv1", ("conv1", "bn1"), 0, through="bn1").rule(2)
        {'match': 'conv1', 'level': 2, 'through': 'bn1'}
        >>> Span("groups", "blocks", ("blocks.0", "blocks.1", "blocks.2"), 3).rule(4)
        {'match': 'blocks', 'level': 4, 'segments': 'auto'}
        """
        rule: dict[str, Any] = {"match": self.name, "level": level}
        if self.kind == "run":
            rule["through"] = self.through
        elif self.kind == "groups":
            rule["segments"] = "auto"
        elif self.kind == "lean":
            rule["lean"] = True
        return rule


@dataclass
class _Call:
    index: int
    name: str
    module: nn.Module
    parent: int | None
    """Index of the call running when this one began (``None``: called from outside)."""
    first: tuple[Any, ...] | None
    """Identity of the first positional tensor argument (see :func:`_key`)."""
    inputs: set[tuple[Any, ...]] = field(default_factory=set)
    output: tuple[Any, ...] | None = None
    """Identity of the output, when it is one tensor."""
    replayable: bool = True
    """Whether its positional arguments after the first could be passed again by a run's
    replay (NOTE [ Runs found by tracing ], 2)."""
    lean: bool = False
    """Whether the module, a lean MLP, would run lean on this call (its input's layout)."""
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """Its tensor arguments with their version counters when it began (for ``wrote``)."""
    wrote: bool = False
    """Whether it wrote one of its tensor arguments in place."""


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same value for a run (NOTE [ Runs found by tracing ], 2)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def _follows(call: _Call, previous: _Call) -> bool:
    """Whether ``call`` can come after ``previous`` in a run (NOTE [ Runs found by tracing ],
    2): it takes ``previous``'s output first, and nothing a replay cannot pass again."""
    return call.first is not None and call.first == previous.output and call.replayable


def _trace(model: nn.Module, example_input: Any) -> list[_Call]:
    """Every call of a module of ``model`` during one forward, in the order they began."""
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[_Call] = []
    stack: list[int] = []
    keep: list[Any] = []  # every traced tensor stays alive: no address is reused meanwhile
    alone: dict[int, Any] = {}  # a call's one argument, when it had one

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        name = names.get(id(module))
        if name is None:
            return
        first = _first_tensor(args)
        call = _Call(
            len(calls),
            name,
            module,
            stack[-1] if stack else None,
            None if first is None else _key(first),
            replayable=passable(args[1:], {}),  # a global hook sees no keyword arguments
        )
        if len(args) == 1:
            alone[call.index] = args[0]
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor):
                call.inputs.add(_key(t))
                if not t.is_inference():  # an inference tensor has no version counter
                    call.versions.append((t, t._version))
                keep.append(t)
        calls.append(call)
        stack.append(call.index)

    def post(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if not stack or calls[stack[-1]].module is not module:
            return
        call = calls[stack.pop()]
        call.wrote = any(t._version != v for t, v in call.versions)
        call.versions = []
        if isinstance(out, torch.Tensor):
            call.output = _key(out)
            keep.append(out)

    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(pre),
        torch.nn.modules.module.register_module_forward_hook(post, always_call=True),
    ]
    try:
        with model_restored(model, None), torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    # after the trace: recognising an MLP of another class runs its forward once (NOTE [ MLPs
    # of any class ] in _lean), which the trace's hooks must not record
    for index, arg in alone.items():
        calls[index].lean = lean_mlp_call_problem(calls[index].module, arg) is None
    return calls


def _returns_input(call: _Call) -> bool:
    """Whether the call returned its first argument (an in-place activation, an identity)."""
    return call.output is not None and call.output == call.first


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _signature(module: nn.Module) -> tuple[Any, ...]:
    """What two members of a repeated sequence share: their class, and for a generic container
    (``Sequential``, ``ModuleList``, ``ModuleDict``) the classes of its children as well."""
    if isinstance(module, _CONTAINERS):
        return (type(module), tuple(_signature(c) for c in module.children()))
    return (type(module),)


def _repeated(model: nn.Module, calls: list[_Call]) -> Iterator[tuple[str, list[str]]]:
    """(container, members) for each repeated sequence: two or more consecutive children of
    one module with one signature, each with children of its own (a block, not a layer: two
    identities side by side are no sequence), each called once, in order. Outside an
    ``nn.Sequential``/``nn.ModuleList`` the sequence must be all the module's children (a stage
    class holding only its blocks), not a bottleneck's three conv-norm-act units beside its
    other layers."""
    called: dict[str, list[int]] = {}
    for call in calls:
        called.setdefault(call.name, []).append(call.index)
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        children = [(prefix + k, c) for k, c in module._modules.items() if c is not None]
        stackable = isinstance(module, (nn.Sequential, nn.ModuleList))
        start = 0
        while start < len(children):
            end = start + 1
            sig = _signature(children[start][1])
            while end < len(children) and _signature(children[end][1]) == sig:
                end += 1
            members = [n for n, _ in children[start:end]]
            order = [called.get(n, []) for n in members]
            if (
                len(members) >= 2
                and (stackable or len(members) == len(children))
                and next(children[start][1].children(), None) is not None
                and all(len(o) == 1 for o in order)
                and all(a[0] < b[0] for a, b in zip(order, order[1:], strict=False))
            ):
                yield name, members
            start = end


def _runs(calls: list[_Call], excluded: set[str]) -> Iterator[list[_Call]]:
    """Every run of NOTE [ Runs found by tracing ]."""
    by_parent: dict[int, list[_Call]] = {}
    for call in calls:
        if call.parent is not None:
            by_parent.setdefault(call.parent, []).append(call)
    for parent_index, children in by_parent.items():
        parent = calls[parent_index]
        prefix = f"{parent.name}." if parent.name else ""
        # the parent's direct children only (rule 1); a call of a deeper module whose own
        # parent was not called through __call__ ends any run
        segment: list[_Call] = []
        segments: list[list[_Call]] = []
        for call in children:
            direct = call.name.startswith(prefix) and "." not in call.name[len(prefix) :]
            ok = direct and call.name not in excluded and call.replayable
            if not ok:
                segments.append(segment)
                segment = []
                continue
            if segment and not _follows(call, segment[-1]):
                segments.append(segment)
                segment = []
            segment.append(call)
        segments.append(segment)
        registered = list(parent.module._modules)
        for seg in segments:
            for i in range(len(seg)):
                for j in range(i + 1, len(seg)):
                    run = seg[i : j + 1]
                    if _returns_input(run[0]):
                        continue
                    at = [registered.index(c.name[len(prefix) :]) for c in run]
                    if any(b <= a for a, b in zip(at, at[1:], strict=False)):  # rule 3
                        continue
                    whole = (
                        len(run) == len(children)
                        and run[0].first is not None
                        and run[0].first in parent.inputs
                        and run[-1].output == parent.output
                    )
                    if not whole:
                        yield run


def trace_spans(model: nn.Module, example_input: Any) -> list[Span]:
    """The candidate regions of ``model``, found by running one forward on ``example_input``
    (in training mode under ``torch.no_grad``; weights, buffers and mode are put back after).

    Args:
        model: any ``nn.Module``; nothing about its library or classes is assumed.
        example_input: its input, a tensor or a tuple of positional arguments, valid in
            training mode (BatchNorm needs two values per channel); keep it small: every
            module's output is held until the trace ends.

    Returns:
        The spans of the module docstring, sorted by the first call each covers; a module
        that is also a block, a stage or a lean MLP appears once per kind.

    >>> block = lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
    ...                     nn.Sequential(*[block() for _ in range(4)]))
    >>> spans = trace_spans(net, torch.randn(1, 3, 16, 16))
    >>> [s.label for s in spans if s.kind == "run"]
    ['0..1', '0..2', '1..2']
    >>> [s.rule(4) for s in spans if s.kind == "groups"]
    [{'match': '3', 'level': 4, 'segments': 'auto'}]
    """
    calls = _trace(model, example_input)
    first_call: dict[str, int] = {}
    for call in calls:
        first_call.setdefault(call.name, call.index)
    spans: list[Span] = []
    excluded: set[str] = set()
    for container, members in _repeated(model, calls):
        excluded.update(members)
        module = model.get_submodule(container)
        for m in members:
            spans.append(Span("block", m, (m,), first_call[m]))
        stackable = isinstance(module, (nn.Sequential, nn.ModuleList))  # what segments split
        member_calls = [calls[first_call[m]] for m in members]
        chained = all(_follows(b, a) for a, b in zip(member_calls, member_calls[1:], strict=False))
        if stackable and chained and len(members) == len(module._modules) and len(members) >= 3:
            spans.append(Span("groups", container, tuple(members), first_call[members[0]]))
        # the stage: the container, or for a list nobody calls, the module holding it
        holder = container if container in first_call else container.rpartition(".")[0]
        if holder and holder in first_call:
            excluded.add(holder)
            spans.append(Span("stage", holder, tuple(members), first_call[holder]))
    seen: set[tuple[str, str]] = set()
    for call in calls:
        if _returns_input(call):
            continue  # an in-place layer or an identity: see NOTE [ Runs found by tracing ]
        if call.name and ("module", call.name) not in seen:
            seen.add(("module", call.name))
            spans.append(Span("module", call.name, (call.name,), call.index))
            # a lean MLP with linear layers computes on its input as one matrix: a transposed
            # input (MLP-Mixer's token MLPs) would make it run its own forward, warning on
            # every step
            if call.lean:
                spans.append(Span("lean", call.name, (call.name,), call.index))
    for run in _runs(calls, excluded):
        names = tuple(c.name for c in run)
        if ("run", names[0] + ".." + names[-1]) in seen:
            continue
        seen.add(("run", names[0] + ".." + names[-1]))
        last = names[-1].rpartition(".")[2]
        spans.append(Span("run", names[0], names, run[0].index, through=last))
    kinds = ("stage", "groups", "block", "module", "run", "lean")
    spans.sort(key=lambda s: (s.order, kinds.index(s.kind), len(s.members)))
    # one span per kind and name (a container holding two sequences is one stage); none that
    # begins with a call writing its input (NOTE [ Runs found by tracing ])
    unique: dict[tuple[str, str], Span] = {}
    for s in spans:
        if s.kind == "lean" or not calls[s.order].wrote:
            unique.setdefault((s.kind, s.label), s)
    return list(unique.values())
