"""The config loader under random input: a valid config or a ``ConfigError``, nothing else.

``CheckpointConfig.model_validate`` gets random dicts (known and unknown keys, values of every
YAML type, random rule lists); ``CheckpointConfig.from_file`` gets the same dicts dumped as
YAML and JSON, and random text. Every outcome must be a :class:`CheckpointConfig` or a
:class:`vision_ckpt.ConfigError` (a :class:`vision_ckpt.VisionCkptError`). Inputs that
once raised a raw exception are kept as regression tests at the end.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from vision_ckpt import CheckpointConfig, ConfigError, LevelError, VisionCkptError
from vision_ckpt.config import parse_level

FIELDS = list(CheckpointConfig.model_fields)
RULE_KEYS = ["match", "match_type", "level"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "auto",
            "stage",
            "block",
            "all",
            "outermost",
            "3",
            " 5 ",
            "6GiB",
            "512MB",
            "vit",
            "blocks.*",
            "**",
            "re:blocks\\.\\d+",
            "re:(",
            "[",
            "aten.mm",
            "Mlp",
            "*.attn",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
rules = st.lists(
    st.dictionaries(st.sampled_from(RULE_KEYS + ["matches", "lvl"]), values, max_size=4) | values,
    max_size=4,
)
configs = st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=10),
    values,
    max_size=5,
).flatmap(
    lambda d: st.one_of(
        st.just(d),
        rules.map(lambda r: {**d, "rules": r}),
        st.builds(
            lambda r, lv: {"training_checkpoint_level": lv, "rules": r},
            rules,
            st.integers(-1, 7) | st.sampled_from(["auto", "stage", None]),
        ),
    )
)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _accepts_or_config_error(load: Any, source: Any) -> None:
    try:
        cfg = load(source)
    except ConfigError as exc:
        assert isinstance(exc, VisionCkptError)
        assert str(exc).strip(), "empty error message"
    else:
        assert isinstance(cfg, CheckpointConfig)
        # A valid config round-trips through its own JSON dump.
        assert CheckpointConfig.model_validate(json.loads(cfg.model_dump_json())) == cfg


@FUZZ
@given(configs)
def test_model_validate_on_random_dicts(data: dict[str, Any]) -> None:
    _accepts_or_config_error(CheckpointConfig.model_validate, data)


@FUZZ
@given(values)
def test_model_validate_on_random_values(data: Any) -> None:
    _accepts_or_config_error(CheckpointConfig.model_validate, data)


def _write(text: str | bytes, suffix: str) -> Path:
    handle = tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False)
    with handle:
        handle.write(text.encode("utf-8") if isinstance(text, str) else text)
    return Path(handle.name)


def _from_text(text: str, suffix: str) -> None:
    path = _write(text, suffix)
    try:
        _accepts_or_config_error(CheckpointConfig.from_file, path)
    finally:
        path.unlink()


@FUZZ
@given(configs, st.sampled_from([".yaml", ".json"]))
def test_from_file_on_random_configs(data: dict[str, Any], suffix: str) -> None:
    try:
        text = yaml.safe_dump(data) if suffix == ".yaml" else json.dumps(data)
    except (ValueError, yaml.YAMLError):
        return  # not representable in this format (NaN in JSON is fine; odd keys are not)
    _from_text(text, suffix)


yaml_pieces = st.sampled_from(
    [
        "rules:",
        "\n",
        "  - ",
        "match: ",
        "level: ",
        "blocks.*",
        "3",
        "{",
        "}",
        "[",
        "]",
        ":",
        "- ",
        "'",
        '"',
        "&a ",
        "*a",
        "!!python/object:os.system ",
        "!!binary ",
        "? ",
        "|",
        ">",
        "\t",
        "#",
        "%YAML 1.1\n",
        "---\n",
        "...",
        "nesting: outermost",
        "preset: vit",
        "training_checkpoint_level: auto",
        "memory_budget: 1GiB",
        "rules: [{match: a, level: 1, keep: {ops: [x]}}]",
        "!!float ",
        ".inf",
        "~",
        "null",
        "0x1F",
        "1e3",
        "2001-12-14",
        "\u00e9",
        "\x00",
    ]
)


@FUZZ
@given(st.lists(yaml_pieces, max_size=25).map("".join) | st.text(max_size=80))
def test_from_file_on_random_yaml_text(text: str) -> None:
    _from_text(text, ".yaml")


@FUZZ
@given(st.text(max_size=60))
def test_from_file_on_random_json_text(text: str) -> None:
    _from_text(text, ".json")


# --------------------------------------------------------------------------------------------
# What the fuzzing found: raw exceptions where a ConfigError / LevelError was due
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["training-checkpoint-level", "-", "rules[0]", "f(x)"])
def test_unknown_key_with_a_dash_is_a_config_error(key: str) -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        CheckpointConfig.model_validate({key: 3})


def test_huge_memory_budget_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        CheckpointConfig.model_validate(
            {"training_checkpoint_level": "auto", "memory_budget": "9" * 400 + "GB"}
        )


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("rules: []  # caf\u00e9".encode("latin-1"))
    with pytest.raises(ConfigError):
        CheckpointConfig.from_file(path)


def test_directory_named_like_a_config_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError):
        CheckpointConfig.from_file(tmp_path / "dir.yaml")


def test_superscript_digit_is_a_level_error() -> None:
    with pytest.raises(LevelError):
        parse_level("\u00b2")


def test_unicode_decimal_digits_are_accepted_as_levels() -> None:
    # Not an error, but worth knowing: str.isdigit()/int() accept other scripts' digits.
    assert parse_level("\u0663") == 3  # ARABIC-INDIC DIGIT THREE
