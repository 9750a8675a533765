"""vision_ckpt: activation checkpointing for vision models, driven by one number.

Every checkpointable block carries a level 0-5; the run sets one training level; a block is
checkpointed exactly when ``1 <= block level <= training level``.
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
from .config.levels import (
    Level as Level,
    is_checkpointed as is_checkpointed,
    parse_level as parse_level,
)
from .config.schema import (
    CheckpointConfig as CheckpointConfig,
    KeepOps as KeepOps,
    LevelRule as LevelRule,
)
from .errors import (
    CheckpointError as CheckpointError,
    ConfigError as ConfigError,
    LevelError as LevelError,
    PresetMismatchWarning as PresetMismatchWarning,
    VisionCkptError as VisionCkptError,
    VisionCkptInternalError as VisionCkptInternalError,
)

_torch_floor.require_torch()  # torch older than the floor fails here, with how to upgrade

if TYPE_CHECKING:
    from .config.presets import (
        list_presets as list_presets,
        load_preset as load_preset,
        preset_for_model as preset_for_model,
        register_preset as register_preset,
    )
    from .regions.apply import (
        CheckpointPlan as CheckpointPlan,
        PlanEntry as PlanEntry,
        apply as apply,
        apply_preset as apply_preset,
        plan as plan,
        remove as remove,
    )
    from .runtime._core import (
        checkpoint as checkpoint,
        checkpoint_sequential as checkpoint_sequential,
        is_recomputing as is_recomputing,
        set_checkpoint_debug_enabled as set_checkpoint_debug_enabled,
    )
    from .runtime.wrapper import (
        ActivationCheckpointing as ActivationCheckpointing,
        get_training_level as get_training_level,
        set_training_level as set_training_level,
        training_level as training_level,
    )

# Public names that need torch, and the module that defines each (see NOTE [ Lazy package ]).
_LAZY: dict[str, str] = {
    "checkpoint": "runtime._core",
    "checkpoint_sequential": "runtime._core",
    "is_recomputing": "runtime._core",
    "set_checkpoint_debug_enabled": "runtime._core",
    "CheckpointPlan": "regions.apply",
    "PlanEntry": "regions.apply",
    "apply": "regions.apply",
    "apply_preset": "regions.apply",
    "plan": "regions.apply",
    "remove": "regions.apply",
    "list_presets": "config.presets",
    "load_preset": "config.presets",
    "preset_for_model": "config.presets",
    "register_preset": "config.presets",
    "ActivationCheckpointing": "runtime.wrapper",
    "get_training_level": "runtime.wrapper",
    "set_training_level": "runtime.wrapper",
    "training_level": "runtime.wrapper",
}

__all__ = [
    "__version__",
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "set_checkpoint_debug_enabled",
    "CheckpointError",
    "ConfigError",
    "LevelError",
    "PresetMismatchWarning",
    "VisionCkptError",
    "VisionCkptInternalError",
    "Level",
    "is_checkpointed",
    "parse_level",
    "CheckpointConfig",
    "LevelRule",
    "KeepOps",
    "ActivationCheckpointing",
    "training_level",
    "set_training_level",
    "get_training_level",
    "CheckpointPlan",
    "PlanEntry",
    "plan",
    "apply",
    "remove",
    "apply_preset",
    "list_presets",
    "load_preset",
    "preset_for_model",
    "register_preset",
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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
