"""Exception types shared by every layer of vision_ckpt.

User errors (bad input, bad config, a checkpointed function that behaves differently when it is
recomputed) derive from :class:`VisionCkptError`. Broken internal invariants go through
:func:`internal_assert`, which raises :class:`VisionCkptInternalError`: that one means a bug in
vision_ckpt, never in the caller's code.

Its public names are every error and warning type. The four a caller catches
(``VisionCkptError``, ``ConfigError``, ``LevelError``, ``CheckpointError``) are also at the top
level; ``PresetMismatchWarning`` (to filter with :mod:`warnings`) and
``VisionCkptInternalError`` are imported from here.

This module imports nothing from the package (nor torch), so every other module may import it.
"""

from __future__ import annotations

__all__ = [
    "VisionCkptError",
    "CheckpointError",
    "LevelError",
    "ConfigError",
    "PresetMismatchWarning",
    "VisionCkptInternalError",
]


class VisionCkptError(RuntimeError):
    """Base class of every error vision_ckpt raises because of how it was used."""


class CheckpointError(VisionCkptError):
    """A checkpointed region cannot be recomputed faithfully (or was used in a way it cannot be)."""


class LevelError(VisionCkptError, ValueError):
    """A checkpoint level outside 0-5, or of the wrong type."""


class ConfigError(VisionCkptError, ValueError):
    """A checkpoint config, rule or preset that cannot be applied to the model at hand."""


class PresetMismatchWarning(UserWarning):
    """A preset fits the model only in part: a whole level of it selects no module (the model's
    library renamed its modules, or the model is not of the preset's family)."""


class VisionCkptInternalError(AssertionError):
    """An invariant of vision_ckpt itself was broken: a bug in vision_ckpt, please report it."""


def internal_assert(cond: bool, what: str) -> None:
    if not cond:
        raise VisionCkptInternalError(
            f"vision_ckpt internal error: {what}. This is a bug in vision_ckpt, not in your code; "
            "please report it with the model and the call that triggered it."
        )
