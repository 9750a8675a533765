"""vision_ckpt: activation checkpointing for vision models, driven by one number.

Every checkpointable block carries a level 0-5; the run sets one training level; a block is
checkpointed exactly when ``1 <= block level <= training level``.
"""

from ._core import (
    checkpoint as checkpoint,
    checkpoint_sequential as checkpoint_sequential,
    is_recomputing as is_recomputing,
    set_checkpoint_debug_enabled as set_checkpoint_debug_enabled,
)
from ._version import __version__ as __version__
from .apply import (
    CheckpointPlan as CheckpointPlan,
    PlanEntry as PlanEntry,
    apply as apply,
    apply_preset as apply_preset,
    plan as plan,
    remove as remove,
)
from .config import (
    CheckpointConfig as CheckpointConfig,
    LevelRule as LevelRule,
    SelectiveConfig as SelectiveConfig,
)
from .errors import (
    CheckpointError as CheckpointError,
    ConfigError as ConfigError,
    LevelError as LevelError,
    VisionCkptError as VisionCkptError,
    VisionCkptInternalError as VisionCkptInternalError,
)
from .levels import Level as Level, is_checkpointed as is_checkpointed, parse_level as parse_level
from .presets import (
    list_presets as list_presets,
    load_preset as load_preset,
    preset_for_model as preset_for_model,
)
from .profile import (
    BudgetPlan as BudgetPlan,
    LevelProfile as LevelProfile,
    ProfileResult as ProfileResult,
    Suggestion as Suggestion,
    plan_for_budget as plan_for_budget,
    profile as profile,
    suggest_level as suggest_level,
)
from .wrapper import (
    ActivationCheckpointing as ActivationCheckpointing,
    get_training_level as get_training_level,
    set_training_level as set_training_level,
    training_level as training_level,
)

__all__ = [
    "__version__",
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "set_checkpoint_debug_enabled",
    "CheckpointError",
    "ConfigError",
    "LevelError",
    "VisionCkptError",
    "VisionCkptInternalError",
    "Level",
    "is_checkpointed",
    "parse_level",
    "CheckpointConfig",
    "LevelRule",
    "SelectiveConfig",
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
    "profile",
    "suggest_level",
    "plan_for_budget",
    "ProfileResult",
    "LevelProfile",
    "Suggestion",
    "BudgetPlan",
]
