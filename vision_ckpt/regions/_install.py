"""What :func:`vision_ckpt.apply` puts on a model and takes off again.

A selected module gets an instance-level ``forward``: a small picklable object, not a module, so
``named_modules()``, the state dict and parameters stay those of the plain model. It holds the
module's :class:`~vision_ckpt.runtime.wrapper.Policy` and decides at every call, as the
wrapper does, whether to run the module's own forward through the checkpoint core.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..runtime._core import region_depth
from ..runtime._lean import lean_mlp_forward
from ..runtime.wrapper import (
    ChainCall,
    Policy,
    compile_note,
    lean_now,
    note_run_broken_traced,
    run_policy,
    run_segments,
    run_traced_chain,
)

__all__ = [
    "passable",
    "CheckpointedForward",
    "ChainedForward",
    "Chain",
    "install",
    "install_chain",
    "uninstall",
    "installed",
    "reinstall",
]


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
        self.name = name or type(module).__name__

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:  # only reachable through a stray reference to this object
            raise ConfigError(
                f"the module {self.name!r} this checkpointed forward belonged "
                "to no longer exists; call the module, not its saved forward."
            )
        return module

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


_installs = itertools.count()  # numbers the installed objects whose warnings are once each


class _LeanForward:
    """An MLP's forward with the lean backward (NOTE [ Lean MLP ] in ``_lean``), or,
    for a call it cannot take, the module's own forward with a warning (once per reason)."""

    def __init__(self, run: _ModuleForward) -> None:
        self.run = run
        self.warned: set[str] = set()
        self.key = f"{run.name}#{next(_installs)}"  # its warnings under torch.compile

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = self.run
        if len(args) == 1 and not kwargs:
            out, why = lean_mlp_forward(run.module, args[0])
            if out is not None and not why:
                return out
        else:
            out = None
            why = "it was called with other than one tensor"
        message = (
            f"{run.name!r} runs its own forward, not the lean one its level asks for: "
            f"{why}. Its gradients are exact; it holds one hidden-size tensor more."
        )
        if torch.compiler.is_compiling():  # NOTE [ Warnings under torch.compile ] in _traced
            compile_note(f"{self.key}: {why}", message)
        elif why not in self.warned:
            self.warned.add(why)
            warnings.warn(message, UserWarning, stacklevel=4)
        # an MLP with a norm before it went on plainly once the norm had run: its output
        return out if out is not None else run(*args, **kwargs)


class CheckpointedForward:
    """The instance-level ``forward`` that :func:`install` gives a selected module."""

    def __init__(self, module: nn.Module, name: str, policy: Policy) -> None:
        self.run = _ModuleForward(module, name, module.__dict__.get("forward"))
        self.policy = policy
        self.segmented = any(r.segments is not None for r in policy.rungs)
        self.lean = _LeanForward(self.run) if policy.lean is not None else None

    @property
    def fn_checkpoint_level(self) -> int:
        """The lowest level at which the module is checkpointed in any way (0: never)."""
        return int(self.policy.rungs[0].level) if self.policy.rungs else 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_under(self.policy, self.segmented, args, kwargs)

    def _run_under(
        self, policy: Policy, segmented: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The module's forward as ``policy`` decides now: plainly, in segments (``segmented``:
        a rung of it has segments) or as one region."""
        run = self.run
        if not run.module.training or not torch.is_grad_enabled():
            return run(*args, **kwargs)
        fn = self.lean if self.lean is not None and lean_now(policy) else run
        if not policy.rungs:
            return fn(*args, **kwargs)
        if segmented and len(args) == 1 and not kwargs:
            return run_segments(policy, run.module, run, run.name, args[0])
        return run_policy(policy, fn, args, kwargs, module=run.module, label=run.name)

    def __repr__(self) -> str:
        policy = self.policy
        pinned = policy.training_level
        rungs = ", ".join(
            [f"{r.what}@{int(r.level)}" for r in policy.rungs]
            + ([] if policy.lean is None else [f"lean@{int(policy.lean)}"])
        )
        return (
            f"<checkpointed forward of {self.run.name!r}: {rungs or 'never'}, "
            f"training_level={'global' if pinned is None else int(pinned)}, "
            f"nesting={policy.nesting!r}>"
        )


_PASSABLE = (type(None), bool, int, float, str, torch.Tensor)


def passable(rest: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a run's replay may pass these arguments (after the previous member's output)
    again: immutable plain values (``is_causal=False``) and tensors (a rotary embedding, an
    attention mask), not containers or objects."""
    return all(isinstance(value, _PASSABLE) for value in (*rest, *kwargs.values()))


def _extra_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What keeps a call from joining a run, for its warning."""
    if not args:
        return "no positional argument, not the previous member's output first"
    names = [f"#{i}" for i, v in enumerate(args[1:], 2) if not isinstance(v, _PASSABLE)]
    names += [key for key, value in kwargs.items() if not isinstance(value, _PASSABLE)]
    return (
        f"arguments {names} that the run cannot pass again (only tensors and None, bool, "
        "int, float and str values join a run)"
    )


class _BoundCall:
    """A run member's call with the arguments it was given after the previous member's
    output, as the run's replay repeats it. A tensor among them is held until the replay, and
    must not change before."""

    __slots__ = ("fn", "rest", "kwargs", "versions", "name")

    def __init__(
        self, fn: Callable[..., Any], rest: tuple[Any, ...], kwargs: dict[str, Any], name: str
    ) -> None:
        self.fn, self.rest, self.kwargs, self.name = fn, rest, kwargs, name
        given = {f"#{i}": v for i, v in enumerate(rest, 2)} | kwargs
        self.versions = {
            k: (v, v._version) for k, v in given.items() if isinstance(v, torch.Tensor)
        }

    def __call__(self, x: Any) -> Any:
        for key, (tensor, version) in self.versions.items():
            if tensor._version != version:
                what = f"argument {key}" if key.startswith("#") else f"{key}=..."
                raise CheckpointError(
                    f"the checkpointed run member {self.name!r} was called with the tensor "
                    f"{what}, which was modified in place before backward recomputed the "
                    "run, so the recomputation cannot repeat the call. Pass a tensor that "
                    "stays unchanged until backward (clone it), or drop 'through' from the rule."
                )
        return self.fn(x, *self.rest, **self.kwargs)


class _OpenRuns(threading.local):
    def __init__(self) -> None:
        # id(Chain) -> (the open run, index of the module expected next, weak reference to
        # the tensor it must receive, that tensor's version when the previous call returned).
        # When that tensor is freed first (the parent computed something else from it,
        # returned early, or a member raised) the run can never go on and must not keep its
        # input: the entry becomes (None, index, None, 0), which only remembers where it ended.
        self.runs: dict[int, tuple[ChainCall | None, int, weakref.ref[Any] | None, int]] = {}


_open_runs = _OpenRuns()


class _TracedRun:
    """A run traced by torch.compile (NOTE [ Runs under torch.compile ] in the wrapper): every
    member's output, computed at once by the first call, and what each later call must match
    to take the next one."""

    def __init__(
        self,
        outs: tuple[Any, ...],
        extra: tuple[tuple[Any, ...], dict[str, Any]],
        context: tuple[bool, bool],
    ) -> None:
        self.outs = outs
        self.extra = extra
        self.context = context
        self.next = 1

    def refuses(self, index: int, one: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Why member ``index``, called so, cannot take its output from the run ('' if it can)."""
        more, named = self.extra
        if index != self.next:
            return f"was called where member {self.next} was expected"
        if one is None or one is not self.outs[index - 1]:
            return "was not called with the previous member's output"
        if len(args) - 1 != len(more) or any(args[i + 1] is not a for i, a in enumerate(more)):
            return "was called with other further arguments than the run's first member"
        if kwargs.keys() != named.keys() or any(kwargs[k] is not named[k] for k in named):
            return "was called with other keyword arguments than the run's first member"
        if _call_context(one) != self.context:
            return "was called under another grad mode or autocast than the first member"
        return ""


def _call_context(x: torch.Tensor) -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_autocast_enabled(x.device.type)


class Chain:
    """A run of sibling modules that their parent calls one after another on one tensor,
    checkpointed as one region (a rule's ``through``). It holds the members' forwards, which
    refer to their modules weakly, and tracks the run open on each thread (in eager) or in the
    trace (under torch.compile)."""

    def __init__(self, label: str, nested: bool = False) -> None:
        self.label = label
        self.nested = nested  # members keep their own policies inside the run
        self.key = f"{label}#{next(_installs)}"  # this run's warnings, apart from other models'
        self.members: list[_ModuleForward] = []
        self.forwards: list[ChainedForward] = []
        self.traced: _TracedRun | None = None

    def modules(self) -> list[nn.Module]:
        return [m.module for m in self.members]

    def pending(self) -> tuple[ChainCall | None, int, weakref.ref[Any] | None, int] | None:
        return _open_runs.runs.get(id(self))

    def expect(self, call: ChainCall, index: int, out: Any) -> None:
        """After the call of member ``index - 1`` returned ``out``: wait for member ``index``,
        or end the run when it was the last member or ``out`` is not one tensor."""
        if index < len(self.members) and isinstance(out, torch.Tensor):
            runs, key = _open_runs.runs, id(self)

            def forget(ref: weakref.ref[Any]) -> None:  # on whichever thread frees ``out``
                entry = runs.get(key)
                if entry is not None and entry[2] is ref:
                    runs[key] = (None, index, None, 0)

            runs[key] = (call, index, weakref.ref(out, forget), out._version)
        else:
            self.close()

    def close(self) -> None:
        _open_runs.runs.pop(id(self), None)

    def broken(self, index: int, reason: str, member: int | None = None) -> None:
        """End the run after the member before ``index`` with a warning: ``member`` (by
        default the one at ``index``) did what ``reason`` says."""
        self.close()
        names = [m.name for m in self.members]
        warnings.warn(
            f"the checkpointed run {self.label!r} ({' -> '.join(names)}) ended after "
            f"{names[index - 1]!r}: {names[index if member is None else member]!r} {reason}. "
            "What ran is checkpointed "
            "exactly; the rest of the run is not. Check that the parent's forward calls these "
            "modules one after another on one tensor, or drop 'through' from the rule.",
            UserWarning,
            stacklevel=5,  # the parent's forward: this, __call__, nn.Module's two call frames
        )


class ChainedForward(CheckpointedForward):
    """The forward :func:`install_chain` gives each member of a :class:`Chain`.

    NOTE [ Runs of sibling calls ]
    The first member opens the run (when its policy checkpoints it now) and a later member
    joins it only if it receives exactly the previous member's output, unmodified, with grad
    mode, autocast and the enclosing region unchanged: then replaying the members that joined,
    in order, recomputes the region (NOTE [ Regions of consecutive calls ] in
    ``runtime._chain``). The member that joins may be a later one than the next: the members
    are a range of the parent's registered children, and a parent may register a child inside
    that range that it calls elsewhere (MONAI's up-transition registers the skip's dropout
    between its norm and activation, and calls it first); such a member is skipped, never
    replayed. Any other call ends the run where it is and runs plainly, so a parent that does
    something else between them gets exact gradients and a warning, never a wrong
    recomputation. Under torch.compile the same condition decides, over outputs the first
    call computed for the whole run at once (NOTE [ Runs under torch.compile ] in the
    wrapper): there a skipped member ends the run.
    """

    def __init__(
        self,
        module: nn.Module,
        name: str,
        policy: Policy,
        chain: Chain,
        index: int,
        own: Policy | None = None,
    ) -> None:
        super().__init__(module, name, policy)
        self.chain = chain
        self.index = index
        # a later member's rungs below the run's level (NOTE [ Runs take over ] in _planning)
        self.own = own

    def _alone(self, *args: Any, **kwargs: Any) -> Any:
        """A member called outside the run, or inside a nested one (a group of layers, in
        forward and recomputation alike): plainly, or as its own rungs say."""
        if self.own is None:
            return self.run(*args, **kwargs)
        return self._run_under(self.own, False, args, kwargs)  # no segments: _check_runs

    def _in_run(
        self, call: ChainCall, one: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """This member's call as the run's next one, with its further arguments bound for the
        replay."""
        member = self._alone if self.chain.nested else self.run
        if len(args) > 1 or kwargs:
            return call.run(_BoundCall(member, args[1:], kwargs, self.run.name), one)
        return call.run(member, one)

    def _traced(self, one: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """This member's call while torch.compile traces (NOTE [ Runs under torch.compile ] in
        the wrapper). Inside an enclosing region the members run as their own rules say: the
        enclosing region recomputes them, and a trace may not change state outside it."""
        chain = self.chain
        if region_depth() > 0:
            return self._alone(*args, **kwargs)
        if self.index:
            traced = chain.traced
            if traced is None:
                return self._alone(*args, **kwargs)
            reason = traced.refuses(self.index, one, args, kwargs)
            if reason:
                chain.traced = None
                note_run_broken_traced(chain.label, chain.key, self.run.name, reason)
                return self._alone(*args, **kwargs)
            traced.next += 1
            if traced.next == len(traced.outs):
                chain.traced = None
            return traced.outs[self.index]
        chain.traced = None
        module = self.run.module
        if not self.policy.rungs or not module.training or not torch.is_grad_enabled():
            return self.run(*args, **kwargs)
        extra = (tuple(args[1:]), dict(kwargs))
        outs = None
        if one is None or (len(args) > 1 or kwargs) and not chain.nested:
            note_run_broken_traced(
                chain.label, chain.key, self.run.name, "takes more than one tensor"
            )
        else:
            calls = [f._alone if chain.nested else f.run for f in chain.forwards]
            outs = run_traced_chain(self.policy, calls, chain.label, one, extra, chain.modules())
        if outs is None:
            label = self.run.name
            return run_policy(self.policy, self.run, args, kwargs, module=module, label=label)
        if len(outs) > 1:
            chain.traced = _TracedRun(outs, extra, _call_context(one))
        return outs[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        chain = self.chain
        one = args[0] if args and passable(args[1:], kwargs) else None
        if torch.compiler.is_compiling():
            return self._traced(one, args, kwargs)
        if self.index == 0:
            chain.close()  # a run the parent left unfinished (another branch, an exception)
            module = self.run.module
            if not self.policy.rungs or not module.training or not torch.is_grad_enabled():
                return self.run(*args, **kwargs)
            call = ChainCall.open(self.policy, chain.modules(), chain.label, one)
            if call is None:
                return run_policy(
                    self.policy, self.run, args, kwargs, module=module, label=self.run.name
                )
            out = self._in_run(call, one, args, kwargs)
            chain.expect(call, 1, out)
            return out
        pending = chain.pending()
        if pending is None:
            return self._alone(*args, **kwargs)
        call, index, ref, version = pending
        me = self.index
        if call is None or ref is None:  # the output it waited for was freed
            if index == me:
                chain.broken(index, "was called after the previous output was freed")
            else:
                chain.close()
        elif me < index or (me > index and (one is None or ref() is not one)):
            chain.broken(index, f"was not called next ({self.run.name!r} was)")
        elif one is None:
            chain.broken(index, f"was called with {_extra_arguments(args, kwargs)}")
        elif ref() is not one:
            chain.broken(index, "was called with something other than its output")
        elif one._version != version:
            chain.broken(index, "was called with its output after it was modified in place", me)
        elif (differs := call.same_context()) is not None:
            chain.broken(index, f"was called where {differs}", me)
        else:  # the next member, or a later one on the previous output (NOTE [ Runs of ...
            out = self._in_run(call, one, args, kwargs)
            chain.expect(call, me + 1, out)
            return out
        return self._alone(*args, **kwargs)

    def __repr__(self) -> str:
        alone = ""
        if self.own is not None and self.own.rungs:
            rungs = ", ".join(f"{r.what}@{int(r.level)}" for r in self.own.rungs)
            alone = f"; alone below the run: {rungs}"
        return f"<member {self.index} of the checkpointed run {self.chain.label!r}{alone}>"


def install(items: Iterable[tuple[nn.Module, str, Policy]]) -> None:
    """Give each ``(module, qualified name, policy)`` its checkpointed forward."""
    for module, name, policy in items:
        module.__dict__["forward"] = CheckpointedForward(module, name, policy)


def install_chain(
    members: list[tuple[nn.Module, str, Policy | None]],
    policy: Policy,
    label: str,
    nested: bool = False,
) -> None:
    """Give a run of sibling modules, in call order, forwards that checkpoint them as one
    region as the first one's ``policy`` decides (NOTE [ Runs of sibling calls ]); a later
    member's own policy applies where it is called outside the run. ``nested``: the run is a
    group of layers, and every member's own policy applies inside the run too."""
    chain = Chain(label, nested)
    for index, (module, name, own) in enumerate(members):
        forward = ChainedForward(
            module, name, policy, chain, index, own if index or nested else None
        )
        chain.members.append(forward.run)
        chain.forwards.append(forward)
        module.__dict__["forward"] = forward


def uninstall(model: nn.Module) -> int:
    """Give every module of ``model`` back the forward it had before :func:`install`; returns
    how many were changed."""
    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward):
            original = forward.run.original
            if original is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = original
            count += 1
    return count


def installed(model: nn.Module) -> dict[nn.Module, CheckpointedForward]:
    """What is installed on ``model`` now, to put back later with :func:`reinstall`."""
    found = {}
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward):
            found[module] = forward
    return found


def reinstall(model: nn.Module, recorded: dict[nn.Module, CheckpointedForward]) -> None:
    """Replace whatever is installed on ``model`` now by what :func:`installed` recorded."""
    uninstall(model)
    for module, forward in recorded.items():
        module.__dict__["forward"] = forward
