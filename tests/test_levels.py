"""The level contract: Level, parse_level and is_checkpointed."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, strategies as st

from vision_ckpt import Level, LevelError
from vision_ckpt.config import is_checkpointed, parse_level


def test_levels_are_0_to_5_with_names_that_explain_themselves():
    assert [int(lv) for lv in Level] == [0, 1, 2, 3, 4, 5]
    assert [lv.name for lv in Level] == [
        "NONE",
        "SINGLE_LAYER",
        "SMALL_BLOCK",
        "MEDIUM_MODULE",
        "LARGE_MODULE",
        "VERY_LARGE_MODULE",
    ]
    assert (Level.LAYER, Level.BLOCK, Level.TRANSFORMER_LAYER, Level.STAGE, Level.TRUNK) == (
        1,
        2,
        3,
        4,
        5,
    )
    for words in ("single layers", "small blocks", "a stage", "trunk"):
        assert words in Level.__doc__


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, Level.MEDIUM_MODULE),
        (Level.STAGE, Level.STAGE),
        (0, Level.NONE),
        (5.0, Level.TRUNK),
        ("2", Level.SMALL_BLOCK),
        (" 4 ", Level.STAGE),
        ("stage", Level.STAGE),
        ("Small-Block", Level.SMALL_BLOCK),
        ("transformer layer", Level.TRANSFORMER_LAYER),
    ],
)
def test_parse_level_accepts(value, expected):
    assert parse_level(value) is expected


@pytest.mark.parametrize("value", [7, -1, 6, 2.5, "high", "", None, True, False, [3], "3.0"])
def test_parse_level_rejects_with_the_allowed_values(value):
    with pytest.raises(
        LevelError,
        match=rf"level {re.escape(repr(value))} is not a checkpoint level; "
        r"allowed: 0 \(NONE\), 1 \(SINGLE_LAYER\), 2 \(SMALL_BLOCK\), 3 \(MEDIUM_MODULE\), "
        r"4 \(LARGE_MODULE\), 5 \(VERY_LARGE_MODULE\)\. Pass an integer 0-5",
    ):
        parse_level(value)


def test_level_error_is_a_value_error_and_names_the_argument():
    with pytest.raises(ValueError, match=r"^block level 9 is not"):
        parse_level(9, what="block level")


@given(st.integers(0, 5), st.integers(0, 5))
def test_is_checkpointed_is_the_contract(block, training):
    assert is_checkpointed(block, training) == (1 <= block <= training)
    assert is_checkpointed(Level(block), Level(training)) == (1 <= block <= training)


@given(st.integers(0, 5))
def test_level_zero_never_and_training_zero_nothing(level):
    assert not is_checkpointed(0, level)
    assert not is_checkpointed(level, 0)
    assert is_checkpointed(level, 5) == (level >= 1)
