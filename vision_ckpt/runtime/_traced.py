"""What the wrapper needs while torch.compile traces a model, apart from its decisions:
warnings that do not break the graph, the trace's own stack of region levels, and regions run
eagerly between compiled graphs where torch's traced checkpoint would not be exact. Below the
wrapper; imports only the core."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch import nn

from . import _core

__all__ = [
    "compile_note",
    "note_batchnorm_between_graphs",
    "checkpoint_between_graphs",
    "run_between_graphs",
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
