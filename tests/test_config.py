"""The checkpoint config schema: loading, defaults, docs, and every validation message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from vision_ckpt import CheckpointConfig, ConfigError, Level, LevelRule
from vision_ckpt.config import KeepOps, PresetFamily, PresetFile, parse_memory_budget

ROOT = Path(__file__).resolve().parents[1]
# configs/train/ holds training-run configs (examples/_train_config.py validates them in
# tests/test_examples.py); they embed a checkpoint config under `checkpoint:`.
CONFIG_FILES = sorted(
    p
    for p in (ROOT / "configs").rglob("*")
    if p.suffix.lower() in (".yaml", ".yml", ".json")
    and p.relative_to(ROOT / "configs").parts[0] != "train"
)
SCHEMAS: list[type[BaseModel]] = [
    CheckpointConfig,
    LevelRule,
    KeepOps,
    PresetFamily,
    PresetFile,
]
# A rule without a level says nothing, nor a preset without rules: the fields with no default.
REQUIRED = {("LevelRule", "level"), ("PresetFile", "rules")}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_validates(path: Path) -> None:
    schema = PresetFile if path.parent.name == "presets" else CheckpointConfig
    assert isinstance(schema.from_file(path), schema)


def test_config_files_exist() -> None:
    assert any(p.parent.name == "examples" for p in CONFIG_FILES)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_every_field_has_a_docstring_and_a_default(schema: type[BaseModel]) -> None:
    for name, field in schema.model_fields.items():
        assert field.description and len(field.description) > 20, f"{schema.__name__}.{name}"
        if (schema.__name__, name) not in REQUIRED:
            assert not field.is_required(), f"{schema.__name__}.{name} has no default"
    assert schema.model_config.get("extra") == "forbid"
    assert schema.__doc__


def test_defaults() -> None:
    cfg = CheckpointConfig()
    assert cfg.training_checkpoint_level is None
    assert cfg.rules == () and cfg.preset is None
    assert cfg.nesting == "auto" and cfg.preserve_rng_state and cfg.strict


def test_levels_accept_ints_names_and_digit_strings() -> None:
    cfg = CheckpointConfig(
        training_checkpoint_level="stage",
        rules=[
            {"match": "a", "level": 2},
            {"match": "b", "level": "3"},
            {"match_type": "Block", "level": "small_block"},
            {"match": "c", "level": 4.0},
        ],
    )
    assert cfg.training_checkpoint_level is Level.STAGE
    assert [r.level for r in cfg.rules] == [2, 3, 2, 4]
    assert all(isinstance(r.level, Level) for r in cfg.rules)


def test_round_trip_through_json_and_yaml(tmp_path: Path) -> None:
    import yaml

    cfg = CheckpointConfig(
        training_checkpoint_level=2,
        preset="vit",
        rules=[
            {"match": "blocks.*", "match_type": "Block", "level": 3},
            {"match": "blocks.*", "level": 1, "keep": "heavy"},
            {"match": "blocks.*.mlp", "level": 2, "keep": {"ops": ["aten.mm"], "below": 40}},
            {"match": "blocks.*.mlp", "level": 5, "lean": True},
            {"match": "blocks.*.attn", "level": 4, "offload": True},
        ],
        nesting="outermost",
        strict=False,
    )
    data = cfg.model_dump(mode="json")
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(data))
    assert CheckpointConfig.from_file(tmp_path / "c.json") == cfg
    assert CheckpointConfig.from_file(tmp_path / "c.yml") == cfg
    assert CheckpointConfig.model_validate(data) == cfg


def test_auto_level_with_budget() -> None:
    cfg = CheckpointConfig(training_checkpoint_level="auto", memory_budget="6GiB")
    assert cfg.training_checkpoint_level == "auto"
    assert cfg.memory_budget_bytes == 6 * 2**30
    assert parse_memory_budget("512MB") == 512 * 10**6
    assert parse_memory_budget(" 1.5 kib ") == 1536


def test_json_schema_export() -> None:
    schema = CheckpointConfig.json_schema()
    json.dumps(schema)
    props = schema["properties"]
    assert set(props) == set(CheckpointConfig.model_fields)
    assert schema["additionalProperties"] is False
    for name, prop in props.items():
        assert prop.get("description"), name
    rule = schema["$defs"]["LevelRule"]
    assert rule["required"] == ["level"]
    assert rule["properties"]["level"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 5,
    }


def test_rule_str_and_hashable() -> None:
    rule = LevelRule(match="blocks.*", match_type="Block", level=3)
    assert str(rule) == "match='blocks.*' match_type='Block' level=3"
    assert hash(rule) == hash(LevelRule(match="blocks.*", match_type="Block", level="3"))


def test_config_module_does_not_import_torch() -> None:
    # vision_ckpt/__init__ imports torch through the core, so load the file as a lone package.
    code = (
        "import sys, types, importlib.util, pathlib\n"
        f"root = pathlib.Path({str(ROOT / 'vision_ckpt')!r})\n"
        "pkg = types.ModuleType('vision_ckpt'); pkg.__path__ = [str(root)]\n"
        "sys.modules['vision_ckpt'] = pkg\n"
        "import vision_ckpt.config as c\n"
        f"c.CheckpointConfig.from_file({str(ROOT / 'configs/examples/vit_small.yaml')!r})\n"
        "assert 'torch' not in sys.modules, 'config imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- every validation message -------------------------------------------------------------

ALLOWED_LEVELS = r"allowed: 0 \(NONE\), 1 \(SINGLE_LAYER\), 2 \(SMALL_BLOCK\)"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"nesting": "inner"}, r"nesting: got 'inner'; allowed: 'auto', 'all', 'outermost'"),
        (
            {"rulez": []},
            r"rulez: unknown key 'rulez'; allowed keys: training_checkpoint_level, .*"
            r"Did you mean 'rules'\?",
        ),
        (
            {"rules": [{"match": "a", "level": 7}]},
            r"rules\[0\]\.level: value 7 .*" + ALLOWED_LEVELS,
        ),
        ({"rules": [{"match": "a", "level": -1}]}, r"rules\[0\]\.level: value -1 .*"),
        ({"rules": [{"match": "a", "level": 2.5}]}, r"rules\[0\]\.level: value 2\.5 "),
        ({"rules": [{"match": "a", "level": "high"}]}, r"rules\[0\]\.level: value 'high' "),
        ({"rules": [{"match": "a", "level": True}]}, r"rules\[0\]\.level: value True "),
        ({"rules": [{"match": "a"}]}, r"rules\[0\]\.level: required key is missing"),
        (
            {"rules": [{"match": "a", "level": 1}, {"level": 3}]},
            r"rules\[1\]: rule with level 3 selects no module: give 'match' .* or 'match_type'",
        ),
        (
            {"rules": [{"match": "a", "levle": 1}]},
            r"rules\[0\]\.levle: unknown key 'levle'; allowed keys: match, match_type, level, "
            r"keep, segments, through, lean, offload\. "
            r"Did you mean 'level'\?",
        ),
        ({"rules": [{"match": "a..b", "level": 1}]}, r"rules\[0\]\.match: .*empty component"),
        ({"rules": [{"match": "blocks.a**", "level": 1}]}, r"invalid component 'a\*\*'"),
        ({"rules": [{"match": "blocks.0/attn", "level": 1}]}, r"invalid component '0/attn'"),
        ({"rules": [{"match": "", "level": 1}]}, r"name pattern '' is empty"),
        ({"rules": [{"match": "re:blocks(", "level": 1}]}, r"not a valid regular expression"),
        ({"rules": [{"match_type": "My Block", "level": 1}]}, r"class pattern 'My Block' is not"),
        ({"rules": "blocks"}, r"rules: expected a list, got 'blocks'"),
        (
            {"training_checkpoint_level": 7},
            r"training_checkpoint_level: value 7 .*" + ALLOWED_LEVELS + r".*Or 'auto'",
        ),
        ({"training_checkpoint_level": "high"}, r"training_checkpoint_level: value 'high'"),
        ({"training_checkpoint_level": "auto"}, r"'auto' needs memory_budget"),
        (
            {"training_checkpoint_level": 3, "memory_budget": "6GiB"},
            r"memory_budget '6GiB' is only used with training_checkpoint_level: auto, but the "
            r"level is 3",
        ),
        (
            {"memory_budget": "6GiB"},
            r"but the level is null \(follow the global training level\)",
        ),
        (
            {"training_checkpoint_level": "auto", "memory_budget": "6 gigs"},
            r"memory_budget: memory budget '6 gigs' is not a memory size.*'6GiB'",
        ),
        (
            {"training_checkpoint_level": "auto", "memory_budget": -5},
            r"memory budget -5 is not a memory size",
        ),
        ({"preset": " "}, r"preset: preset ' ' is empty; give a family name"),
        (
            {"rules": [{"match": "a", "level": 1, "keep": {"ops": ["mm"]}}]},
            r"rules\[0\]\.keep\.ops: operator names \['mm'\] are not written 'namespace\.op'",
        ),
        (
            {"rules": [{"match": "a", "level": 1, "keep": {"save": ["aten.mm"]}}]},
            r"rules\[0\]\.keep\.save: unknown key 'save'; allowed keys: ops, below",
        ),
        (
            {"selective": {"save_ops": ["aten.mm"]}},
            r"unknown key 'selective'.*What a region keeps is given per rule",
        ),
        ({"preserve_rng_state": "maybe"}, r"preserve_rng_state: .*boolean.*got 'maybe'"),
        ({"strict": 3}, r"strict: .*got 3"),
    ],
)
def test_validation_messages(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig(**data)
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig.model_validate(data)


def test_all_errors_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointConfig(nesting="x", rules=[{"match": "a", "level": 9}], foo=1)
    text = str(info.value)
    assert text.startswith("invalid checkpoint config:")
    assert "nesting:" in text and "rules[0].level:" in text and "foo:" in text


def test_direct_rule_errors() -> None:
    with pytest.raises(ConfigError, match=r"invalid LevelRule:\n  level: value 9 .*allowed"):
        LevelRule(match="x", level=9)
    with pytest.raises(ConfigError, match=r"invalid KeepOps:\n  ops: "):
        KeepOps(ops=["mm"])


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has suffix '\.toml'; allowed: \.yaml, \.yml, \.json"):
        CheckpointConfig.from_file(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match=r"config file '.*missing\.yaml' does not exist"):
        CheckpointConfig.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml' does not parse as YAML"):
        CheckpointConfig.from_file(bad)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ConfigError, match=r"bad\.json' does not parse"):
        CheckpointConfig.from_file(bad_json)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"holds a list, expected a mapping of config keys"):
        CheckpointConfig.from_file(listed)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("nesting: inner\n")
    with pytest.raises(ConfigError, match=r"invalid checkpoint config \(from .*wrong\.yaml\):"):
        CheckpointConfig.from_file(wrong)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert CheckpointConfig.from_file(empty) == CheckpointConfig()
