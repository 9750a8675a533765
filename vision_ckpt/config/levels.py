"""The level contract shared by every part of vision_ckpt.

Every checkpointable block carries a level from 0 to 5, a run sets one training level, and a
block is checkpointed exactly when ``1 <= block level <= training level``.
"""

from __future__ import annotations

import enum
import numbers
from typing import Literal

from ..errors import LevelError

__all__ = ["Level", "parse_level", "is_checkpointed", "Nesting", "NESTING_MODES"]


class Level(enum.IntEnum):
    """How large a piece of the network a checkpointed region is.

    ===== ======================= =====================================================
    level what is checkpointed    examples
    ===== ======================= =====================================================
    0     nothing
    1     single layers           linear + activation, conv + norm/dropout
    2     small blocks            residual/bottleneck block, attention block, MLP block,
                                  dense layer
    3     medium modules          a transformer layer, a decoder block
    4     large modules           a group of transformer layers, a stage (Swin/ConvNeXt/
                                  ResNet stage, dense block)
    5     very large modules      a whole encoder / decoder / trunk
    ===== ======================= =====================================================

    A higher training level checkpoints more (and larger) regions: less activation memory,
    more recomputation in backward.

    >>> Level(3).name
    'MEDIUM_MODULE'
    >>> Level.STAGE == 4
    True
    """

    NONE = 0
    SINGLE_LAYER = 1
    SMALL_BLOCK = 2
    MEDIUM_MODULE = 3
    LARGE_MODULE = 4
    VERY_LARGE_MODULE = 5

    # Aliases in the vocabulary of vision models.
    LAYER = 1
    BLOCK = 2
    TRANSFORMER_LAYER = 3
    STAGE = 4
    TRUNK = 5


_ALLOWED = ", ".join(f"{lv.value} ({lv.name})" for lv in Level)


def parse_level(value: object, what: str = "level") -> Level:
    """Turn ``value`` into a :class:`Level`, or raise :class:`LevelError` saying what is allowed.

    Accepts a ``Level``, an ``int`` 0-5 (also an integral float such as ``3.0``), a digit string
    ``"3"`` or a level name such as ``"stage"``. ``bool`` is rejected.

    >>> parse_level("stage")
    <Level.LARGE_MODULE: 4>
    >>> parse_level(7)
    Traceback (most recent call last):
    ...
    vision_ckpt.errors.LevelError: level 7 is not a checkpoint level; allowed: 0 (NONE), ...
    """
    if isinstance(value, Level):
        return value
    if isinstance(value, bool):
        pass
    elif isinstance(value, numbers.Integral):
        if 0 <= int(value) <= 5:
            return Level(int(value))
    elif isinstance(value, float) and value.is_integer() and 0 <= value <= 5:
        return Level(int(value))
    elif isinstance(value, str):
        text = value.strip()
        # isdecimal, not isdigit: superscripts such as '²' are digits that int() rejects.
        if text.isdecimal() and 0 <= int(text) <= 5:
            return Level(int(text))
        member = Level.__members__.get(text.upper().replace("-", "_").replace(" ", "_"))
        if member is not None:
            return member
    raise LevelError(
        f"{what} {value!r} is not a checkpoint level; allowed: {_ALLOWED}. "
        "Pass an integer 0-5 (or its name); 0 turns checkpointing off."
    )


def is_checkpointed(block_level: int, training_level: int) -> bool:
    """The one rule of the contract: ``1 <= block_level <= training_level``.

    >>> is_checkpointed(2, 3), is_checkpointed(0, 5), is_checkpointed(4, 3)
    (True, False, False)
    """
    return 1 <= block_level <= training_level


Nesting = Literal["auto", "all", "outermost"]
"""What a checkpointed region does with the checkpointed regions inside it while it is
recomputed; see ``CheckpointConfig.nesting``."""

NESTING_MODES: tuple[str, ...] = ("auto", "all", "outermost")
