"""What the wrapper needs while torch.compile traces a model, apart from its decisions:
warnings that do not break the graph, the trace's own stack of region levels, and regions run
eagerly between compiled graphs where torch's traced checkpoint would not be exact. Below the
wrapper; imports only the core."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _compat
from . import _core

__all__ = [
    "compile_note",
    "note_batchnorm_between_graphs",
    "checkpoint_between_graphs",
    "run_between_graphs",
    "region_subgraph",
    "traced_reset",
    "traced_push",
    "traced_pop",
    "traced_top",
]


# NOTE [ Warnings under torch.compile ]
#
# While dynamo traces a forward, a call to warnings.warn would break the graph (and inside a
# checkpointed region, dynamo could not capture the region as one higher-order op at all). So
# what must warn under torch.compile calls compile_note, which is marked as a function with a
# constant result: dynamo runs it for real while it traces (at the first compiled call, and
# again only when it traces again), puts its result into the graph as a constant, and traces
# on. It warns once per key, so a retrace says nothing new.

_compile_notes_shown: set[str] = set()


@torch.compiler.assume_constant_result
def compile_note(key: str, message: str) -> bool:
    """Warn ``message`` once per ``key``, also from code dynamo traces (NOTE [ Warnings under
    torch.compile ]); True when it warned.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     compile_note("doctest", "shown once"), compile_note("doctest", "shown once")
    (True, False)
    >>> len(caught)
    1
    """
    if key in _compile_notes_shown:
        return False
    _compile_notes_shown.add(key)
    warnings.warn(message, UserWarning, stacklevel=2)
    return True


# ``_core.checkpoint_region`` run eagerly while torch.compile traces its caller (a graph break),
# for a region whose traced checkpoint would not be exact. Made here, not in the core, which
# does not import dynamo (the wrapper does already, for its compile notes).
checkpoint_between_graphs = torch.compiler.disable(_core.checkpoint_region)


@torch.compiler.disable
def run_between_graphs(
    region: Any, x: torch.Tensor, modules: list[nn.Module], options: dict[str, Any]
) -> Any:
    """A run of several modules as one region, run eagerly between compiled graphs: the core
    is told its modules (whose BatchNorm statistics it guards) through one container, made
    here, outside the trace."""
    return _core.checkpoint_region(region, x, **{**options, "module": nn.ModuleList(modules)})


# NOTE [ A region is its own subgraph ]
#
# Within one compiled graph, neither AOTAutograd's backward order nor inductor's schedule
# recomputes a region only when its backward starts: the recomputations of several consecutive
# regions can be alive at once, so a compiled step would hold more than the plan says. A
# region compiled as a subgraph (``torch.compiler.nested_compile_region``) is partitioned on
# its own: its backward is one call in the outer backward, which runs only once the gradient of
# the region's output exists, and recomputes only that region. So while dynamo traces, an
# outermost region installed by ``apply`` is torch's checkpoint called through
# ``region_subgraph``. Dynamo traces every such call (its arguments are not ones it reuses a
# traced body for) and gives regions whose traced bodies are identical one shared subgraph; a
# body traced once stays in the graph around it, as it would without the subgraph. Kept in the
# graph on purpose: a region with a BatchNorm in training mode (dynamo refuses a shared
# subgraph that writes a buffer; a module that writes another buffer in its forward is not
# recognised, and none in the bundled presets does), a run of calls (its extra outputs break
# dynamo's clean-up of a shared subgraph), and anything traced by other means than dynamo.


def _in_subgraph(checkpoint: Callable[..., Any], function: Callable[..., Any], *args: Any) -> Any:
    """``checkpoint(function, *args)``: the body of every region's subgraph."""
    return checkpoint(function, *args)


region_subgraph: Callable[..., Any] | None = (
    None if _compat.nested_compile_region is None else _compat.nested_compile_region(_in_subgraph)
)
"""``_in_subgraph`` as a subgraph (NOTE [ A region is its own subgraph ]), or ``None`` where
this torch is not relied on for subgraphs."""


def note_batchnorm_between_graphs() -> None:
    compile_note(
        "batchnorm-between-graphs",
        f"torch {torch.__version__} updates BatchNorm running statistics twice in a "
        "compiled checkpoint, so checkpointed regions that hold a BatchNorm in training "
        "mode run eagerly between compiled graphs (graph breaks; statistics and gradients "
        "exact). torch>=2.14 compiles them into the graph. (Shown once.)",
    )


class _TracedRegions(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[int, bool]] = []


_traced = _TracedRegions()


@torch.compiler.assume_constant_result
def traced_reset() -> bool:
    _traced.stack.clear()
    return True


@torch.compiler.assume_constant_result
def traced_push(level: int, group: bool) -> bool:
    _traced.stack.append((level, group))
    return True


@torch.compiler.assume_constant_result
def traced_pop() -> bool:
    if _traced.stack:
        _traced.stack.pop()
    return True


@torch.compiler.assume_constant_result
def traced_top() -> tuple[int, bool] | None:
    return _traced.stack[-1] if _traced.stack else None


# NOTE [ The training level under torch.compile ]
#
# Under torch.compile a region is torch's checkpoint operator, whose body dynamo traces once
# and the partitioner recomputes as a graph; the Python that set the region's level never runs
# again. Some releases (2.6 among them) refuse a body that writes state it did not create
# ("mutating a variable not in the current scope") and break the graph at every such region.
# So while tracing, a region's level and group live on a stack of the trace's own, which the
# functions below change and read: dynamo runs them for real while it traces and treats what
# they return as a constant, so the operator's body writes nothing dynamo sees. The decisions
# taken from them depend only on the model's structure and the training level, which dynamo
# guards where the outermost region reads it. A trace that dynamo abandons half way can leave
# entries behind, so the outermost region empties the stack first; eager code never reads it.
# The stack holds plain ints, and the traced code that reads it turns one into a Level by
# indexing a tuple of the members, never by calling Level(...): dynamo in 2.11 cannot trace an
# enum's constructor and fails the whole compile (InternalTorchDynamoError).
