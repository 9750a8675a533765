"""vision_ckpt: activation checkpointing for vision models, driven by one number.

Every checkpointable block carries a level 0-5; the run sets one training level; a block is
checkpointed exactly when ``1 <= block level <= training level``.

The top level is what a training script uses every day: the wrapper and the training level
(``ActivationCheckpointing``, ``training_level``, ``set_training_level``,
``get_training_level``), configs and rules (``Level``, ``CheckpointConfig``, ``LevelRule``),
putting them on a model (``plan``, ``apply``, ``apply_preset``, ``remove``, ``CheckpointPlan``),
the presets (``list_presets``, ``load_preset``), the checkpoint function (``checkpoint``) and
the errors to catch (``VisionCkptError``, ``ConfigError``, ``LevelError``, ``CheckpointError``).
The rest is public in the subpackage it lives in, documented there:

- :mod:`vision_ckpt.config`: the schema and level helpers (``KeepOps``, ``parse_level``,
  ``is_checkpointed``); :mod:`vision_ckpt.config.presets`: the preset registry
  (``register_preset``, ``preset_for_model``, ...);
- :mod:`vision_ckpt.runtime`: the checkpoint core's other functions (``checkpoint_sequential``,
  ``is_recomputing``, ``set_checkpoint_debug_enabled``);
- :mod:`vision_ckpt.regions`: the plan's entries (``PlanEntry``);
- :mod:`vision_ckpt.errors`: every error and warning type (``PresetMismatchWarning``,
  ``VisionCkptInternalError``);
- :mod:`vision_ckpt.tune`: the tuning tools (profile, suggest, the budget planner, fit, derive);
- :mod:`vision_ckpt.measure`: the meters and the model specs.
"""

# NOTE [ Lazy package ]
#
# Importing the package must not import torch, so that ``vision_ckpt.config`` (pydantic only)
# validates configs where torch is absent or slow to load. The torch-free modules (errors,
# levels, config) are imported here; every other public name is listed in ``_LAZY`` with the
# module that defines it and is imported on first access by the module ``__getattr__`` below
# (then cached in the package namespace). ``from vision_ckpt import X``, ``vision_ckpt.X`` and
# ``dir(vision_ckpt)`` behave as with eager imports, and ``vision_ckpt.<submodule>`` imports
# the submodule, as it did when this file imported them all.
#
# The modules live in subpackages (``vision_ckpt.regions.apply``, ``vision_ckpt.tune.profiling``),
# so no public function shares its name with a module of the package itself.
# The ``TYPE_CHECKING`` imports give type checkers the same names; tests/test_public_api.py
# checks that they, ``_LAZY`` and ``__all__`` agree.

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import _torch_floor
from ._version import __version__ as __version__
from .config.levels import Level as Level
from .config.schema import CheckpointConfig as CheckpointConfig, LevelRule as LevelRule
from .errors import (
    CheckpointError as CheckpointError,
    ConfigError as ConfigError,
    LevelError as LevelError,
    VisionCkptError as VisionCkptError,
)

_torch_floor.require_torch()  # torch older than the floor fails here, with how to upgrade

if TYPE_CHECKING:
    from .config.presets import list_presets as list_presets, load_preset as load_preset
    from .regions.apply import (
        CheckpointPlan as CheckpointPlan,
        apply as apply,
        apply_preset as apply_preset,
        plan as plan,
        remove as remove,
    )
    from .runtime._core import checkpoint as checkpoint
    from .runtime.wrapper import (
        ActivationCheckpointing as ActivationCheckpointing,
        get_training_level as get_training_level,
        set_training_level as set_training_level,
        training_level as training_level,
    )

# Public names that need torch, and the module that defines each (see NOTE [ Lazy package ]).
_LAZY: dict[str, str] = {
    "checkpoint": "runtime._core",
    "CheckpointPlan": "regions.apply",
    "apply": "regions.apply",
    "apply_preset": "regions.apply",
    "plan": "regions.apply",
    "remove": "regions.apply",
    "list_presets": "config.presets",
    "load_preset": "config.presets",
    "ActivationCheckpointing": "runtime.wrapper",
    "get_training_level": "runtime.wrapper",
    "set_training_level": "runtime.wrapper",
    "training_level": "runtime.wrapper",
}

# Names the top level exported in 0.1.0 and where they live now: asking the top level for one
# says where to import it from (the AttributeError of ``__getattr__``).
_MOVED: dict[str, str] = {
    "KeepOps": "vision_ckpt.config",
    "parse_level": "vision_ckpt.config",
    "is_checkpointed": "vision_ckpt.config",
    "preset_for_model": "vision_ckpt.config.presets",
    "register_preset": "vision_ckpt.config.presets",
    "checkpoint_sequential": "vision_ckpt.runtime",
    "is_recomputing": "vision_ckpt.runtime",
    "set_checkpoint_debug_enabled": "vision_ckpt.runtime",
    "PlanEntry": "vision_ckpt.regions",
    "PresetMismatchWarning": "vision_ckpt.errors",
    "VisionCkptInternalError": "vision_ckpt.errors",
}

__all__ = [
    "__version__",
    # the wrapper and the training level
    "ActivationCheckpointing",
    "training_level",
    "set_training_level",
    "get_training_level",
    # configs and rules
    "Level",
    "CheckpointConfig",
    "LevelRule",
    # putting them on a model
    "plan",
    "apply",
    "apply_preset",
    "remove",
    "CheckpointPlan",
    # presets
    "list_presets",
    "load_preset",
    # the checkpoint function
    "checkpoint",
    # errors
    "VisionCkptError",
    "ConfigError",
    "LevelError",
    "CheckpointError",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is not None:
        module = importlib.import_module(f".{module_name}", __name__)
        namespace = globals()
        for lazy_name, owner in _LAZY.items():
            if owner == module_name:
                namespace[lazy_name] = getattr(module, lazy_name)
        return namespace[name]
    if not name.startswith("__") and importlib.util.find_spec(f".{name}", __name__) is not None:
        return importlib.import_module(f".{name}", __name__)  # a submodule not imported yet
    if name in _MOVED:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}: it moved to {_MOVED[name]} "
            f"(from {_MOVED[name]} import {name})"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
