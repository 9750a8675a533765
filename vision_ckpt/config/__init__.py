"""The configuration: what a model's modules are checkpointed at each level, as data.

Owns the level contract (``levels``), matching rules to module names and classes
(``matching``), the validated config schema (``schema``: ``CheckpointConfig``, ``LevelRule``,
``KeepOps``), the bundled presets and their YAML (``presets``), and the rules for models no
preset knows (``_fallback``, ``_features``). It imports only the package's base modules
(``errors``), pydantic and PyYAML; the schema, levels and matching import no torch, so a config
validates where torch is absent. Everything above it reads configs through these names.
"""

from .schema import (
    CheckpointConfig as CheckpointConfig,
    KeepOps as KeepOps,
    LevelRule as LevelRule,
    PresetFamily as PresetFamily,
    PresetFile as PresetFile,
    parse_memory_budget as parse_memory_budget,
)

__all__ = [
    "CheckpointConfig",
    "KeepOps",
    "LevelRule",
    "PresetFamily",
    "PresetFile",
    "parse_memory_budget",
]
