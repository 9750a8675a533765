"""The configuration: what a model's modules are checkpointed at each level, as data.

Owns the level contract (``levels``), matching rules to module names and classes
(``matching``), the validated config schema (``schema``) and what its errors say
(``_messages``), the bundled presets and their YAML (``presets``), and the rules for models no
preset knows (``_fallback``, ``_features``). It imports only the package's base modules
(``errors``), pydantic and PyYAML; the schema, levels and matching import no torch, so a config
validates where torch is absent. Everything above it
reads configs through these names.

Its public names: the schema (``CheckpointConfig``, ``LevelRule``, ``KeepOps``, ``Region``, the
preset file's ``PresetFile`` and ``PresetFamily``, ``parse_memory_budget``) and the level contract
(``Level``, ``parse_level``, ``is_checkpointed``). The preset registry needs torch and is its
own public module, :mod:`vision_ckpt.config.presets` (``list_presets``, ``load_preset``,
``register_preset``, ``preset_for_model``, ``preset_rules``, ``fallback_rules``, ...).

>>> from vision_ckpt.config import is_checkpointed, parse_level
>>> is_checkpointed(parse_level("block"), 3)
True
"""

from .levels import (
    Level as Level,
    is_checkpointed as is_checkpointed,
    parse_level as parse_level,
)
from .schema import (
    CheckpointConfig as CheckpointConfig,
    KeepOps as KeepOps,
    LevelRule as LevelRule,
    PresetFamily as PresetFamily,
    PresetFile as PresetFile,
    Region as Region,
    parse_memory_budget as parse_memory_budget,
)

__all__ = [
    "CheckpointConfig",
    "LevelRule",
    "KeepOps",
    "PresetFile",
    "PresetFamily",
    "Region",
    "parse_memory_budget",
    "Level",
    "parse_level",
    "is_checkpointed",
]
