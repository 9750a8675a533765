"""The runtime: what runs while a model trains.

Owns the bundled checkpoint core (``_core``: the checkpoint functions and the call of one
region; ``_frame``: its saved-tensor hooks and recomputation; ``_call_state``: the RNG,
autocast, kernel settings and BatchNorm statistics a recomputation reinstates;
``_saved_inputs``: how a region's inputs wait; ``_chain``: a region of consecutive calls), the
operator keep policy of selective regions (``_selective``), the exact leaner MLP backward
(``_lean``), what the wrapper needs while torch.compile traces (``_traced``: warnings that keep
the graph, the trace's stack of region levels, regions run between graphs), and the wrapper
with the training level (``wrapper``). It imports the base modules
and the config's levels and schema, never a layer above it.

Its public names: the checkpoint functions (``checkpoint``, ``checkpoint_sequential``), what a
checkpointed function may ask (``is_recomputing``) and the recomputation's debug log
(``set_checkpoint_debug_enabled``), from ``_core``; the wrapper and the training level
(``ActivationCheckpointing``, ``training_level``, ``set_training_level``,
``get_training_level``), from ``wrapper``. The everyday ones are also at the top level.

>>> import torch
>>> from vision_ckpt.runtime import checkpoint, is_recomputing
>>> seen = []
>>> def f(x):
...     seen.append(is_recomputing())
...     return x.sin()
>>> checkpoint(f, torch.ones(2, requires_grad=True)).sum().backward()
>>> seen  # the forward, then its recomputation in backward
[False, True]
"""

from ._core import (
    checkpoint as checkpoint,
    checkpoint_sequential as checkpoint_sequential,
    is_recomputing as is_recomputing,
    set_checkpoint_debug_enabled as set_checkpoint_debug_enabled,
)
from .wrapper import (
    ActivationCheckpointing as ActivationCheckpointing,
    get_training_level as get_training_level,
    set_training_level as set_training_level,
    training_level as training_level,
)

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "set_checkpoint_debug_enabled",
    "ActivationCheckpointing",
    "training_level",
    "set_training_level",
    "get_training_level",
]
