"""Preset files, the registry, resolution of a model to its preset, and the fallback.

Models here are built on the ``meta`` device: only their module trees are needed, so even the
full-size architectures cost nothing. ``test_presets_zoo.py`` runs the presets on real tensors.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import timm
import torch
import torchvision.models as tvm
from torch import nn

import vision_ckpt
from vision_ckpt import ConfigError
from vision_ckpt.config import CheckpointConfig, LevelRule, PresetFile, _fallback, presets
from vision_ckpt.config.matching import ModuleMatcher
from vision_ckpt.config.presets import (
    fallback_rules,
    list_presets,
    load_preset,
    preset_family,
    preset_for_model,
    preset_rules,
    register_preset,
)
from vision_ckpt.errors import PresetMismatchWarning
from vision_ckpt.regions.apply import CheckpointPlan, plan

PRESET_FILES = sorted((Path(__file__).parent.parent / "configs" / "presets").glob("*.yaml"))


def _meta_timm(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return timm.create_model(name, pretrained=False, **kwargs)

    return make


def _meta_tv(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        with torch.device("meta"):
            return getattr(tvm, name)(weights=None)

    return make


# Full-size members of every family, with the preset each must resolve to. Every rule of every
# preset must select modules in at least one of its family's models here.
FAMILY_MODELS: dict[str, list[tuple[str, Callable[[], nn.Module]]]] = {
    "vit": [
        ("vit_small_patch16_224", _meta_timm("vit_small_patch16_224")),
        ("deit_tiny_distilled_patch16_224", _meta_timm("deit_tiny_distilled_patch16_224")),
        ("deit3_small_patch16_224", _meta_timm("deit3_small_patch16_224")),
    ],
    "vit_hybrid": [
        ("vit_small_r26_s32_224", _meta_timm("vit_small_r26_s32_224")),
        ("vit_small_resnet26d_224", _meta_timm("vit_small_resnet26d_224")),
    ],
    "beit": [("beit_base_patch16_224", _meta_timm("beit_base_patch16_224"))],
    "eva": [("eva02_tiny_patch14_224", _meta_timm("eva02_tiny_patch14_224"))],
    "swin": [
        ("swin_tiny_patch4_window7_224", _meta_timm("swin_tiny_patch4_window7_224")),
        ("swinv2_tiny_window8_256", _meta_timm("swinv2_tiny_window8_256")),
    ],
    "convnext": [
        ("convnext_tiny", _meta_timm("convnext_tiny")),
        ("convnextv2_atto", _meta_timm("convnextv2_atto")),
    ],
    "resnet": [
        ("resnet50", _meta_timm("resnet50")),
        ("seresnext26d_32x4d", _meta_timm("seresnext26d_32x4d")),
        ("resnext50_32x4d", _meta_timm("resnext50_32x4d")),
    ],
    "regnet": [
        ("regnetx_002", _meta_timm("regnetx_002")),
        ("regnety_002", _meta_timm("regnety_002")),
    ],
    "densenet": [("densenet121", _meta_timm("densenet121"))],
    "efficientnet": [
        ("efficientnet_b0", _meta_timm("efficientnet_b0")),
        ("efficientnetv2_rw_t", _meta_timm("efficientnetv2_rw_t")),
        ("efficientnet_es", _meta_timm("efficientnet_es")),  # edge residuals from stage 0
        ("mobilenetv1_100", _meta_timm("mobilenetv1_100")),  # depthwise-separable throughout
        ("fbnetc_100", _meta_timm("fbnetc_100")),  # an inverted residual in stage 0
    ],
    "mobilenetv3": [("mobilenetv3_large_100", _meta_timm("mobilenetv3_large_100"))],
    "maxxvit": [
        ("maxvit_tiny_tf_224", _meta_timm("maxvit_tiny_tf_224")),
        ("coatnet_0_224", _meta_timm("coatnet_0_224")),
    ],
    "pvt_v2": [("pvt_v2_b0", _meta_timm("pvt_v2_b0"))],
    "tv_resnet": [("torchvision resnet50", _meta_tv("resnet50"))],
    "tv_densenet": [("torchvision densenet121", _meta_tv("densenet121"))],
    "tv_swin": [
        ("torchvision swin_t", _meta_tv("swin_t")),
        ("torchvision swin_v2_t", _meta_tv("swin_v2_t")),
    ],
    "tv_vit": [("torchvision vit_b_16", _meta_tv("vit_b_16"))],
}


def _selected(rule: LevelRule, model: nn.Module) -> list[str]:
    matcher = ModuleMatcher(rule.match, rule.match_type)
    return [
        name
        for name, module in model.named_modules()
        if matcher.matches(
            name,
            type(module).__name__,
            f"{type(module).__module__}.{type(module).__qualname__}",
        )
    ]


# --- the files -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", PRESET_FILES, ids=[p.stem for p in PRESET_FILES])
def test_preset_file_validates(path: Path) -> None:
    preset = PresetFile.from_file(path)
    assert preset.rules or preset.family.parts, "a preset without rules or parts says nothing"
    assert preset.family.classes or preset.family.architectures, "a preset names its models"
    assert preset.family.written_for, "a preset says which library version it was read from"
    assert load_preset(path.stem) == CheckpointConfig(rules=preset.rules)
    assert preset_family(path.stem) == preset.family


def test_every_file_is_listed_and_has_models() -> None:
    assert [p.stem for p in PRESET_FILES] != []
    assert set(list_presets()) >= {p.stem for p in PRESET_FILES}
    # Presets for other libraries are checked against their models in their own test files.
    others = ("hf_", "smp_", "monai_", "tvseg_")
    assert set(FAMILY_MODELS) == {p.stem for p in PRESET_FILES if not p.stem.startswith(others)}


@pytest.mark.parametrize("preset", sorted(FAMILY_MODELS))
def test_every_rule_selects_modules_in_its_family(preset: str) -> None:
    cfg = load_preset(preset)
    models = [(label, make()) for label, make in FAMILY_MODELS[preset]]
    for i, rule in enumerate(cfg.rules):
        hits = {label: _selected(rule, model) for label, model in models}
        assert any(hits.values()), f"preset {preset} rules[{i}] ({rule}) selects nothing"
    for label, model in models:
        # Rules select modules that run a forward (a ModuleList only to group its layers:
        # NOTE [ Groups of a ModuleList ]), and a level of whole blocks exists (DenseNet's
        # dense layer, at 2, is its block: its 3-5 are that plan).
        levels = set()
        for rule in cfg.rules:
            for name in _selected(rule, model):
                module = model.get_submodule(name)
                runs = rule.segments is not None and isinstance(module, nn.ModuleList)
                assert runs or type(module).forward is not nn.Module.forward, (preset, label, name)
                levels.add(int(rule.level))
        least = 2 if preset == "densenet" else 3
        assert max(levels) >= least, (preset, label, sorted(levels))


# --- listing and loading -------------------------------------------------------------------


def test_list_presets_natural_order_and_filter() -> None:
    names = list_presets()
    assert names == sorted(names, key=presets._natural_key)
    assert list_presets("tv_*") == ["tv_densenet", "tv_resnet", "tv_swin", "tv_vit"]
    assert list_presets("*vit*") == ["hf_vit", "maxxvit", "tv_vit", "vit", "vit_hybrid"]
    assert list_presets("nothing*") == []


def test_natural_key_sorts_numbers_as_numbers() -> None:
    assert sorted(["net10", "net2", "net1"], key=presets._natural_key) == ["net1", "net2", "net10"]


def test_unknown_preset_lists_names_and_close_matches() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'swim'; did you mean 'swin'\?") as exc:
        load_preset("swim")
    for name in list_presets():
        assert name in str(exc.value)
    with pytest.raises(ConfigError, match=r"unknown preset 'zzz'; available presets: beit, "):
        load_preset("zzz")


def test_load_preset_normalises_the_name() -> None:
    assert load_preset("PVT-V2") is load_preset("pvt_v2")


def test_presets_dir_points_at_the_shipped_files() -> None:
    assert presets.presets_dir().resolve() == PRESET_FILES[0].parent.resolve()


# --- resolution ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "label"),
    [(p, label) for p, models in sorted(FAMILY_MODELS.items()) for label, _ in models],
)
def test_preset_for_model(preset: str, label: str) -> None:
    make = dict(FAMILY_MODELS[preset])[label]
    assert preset_for_model(make()) == preset


def test_timm_and_torchvision_classes_of_one_name_stay_apart() -> None:
    assert preset_for_model(_meta_timm("resnet18")()) == "resnet"
    assert preset_for_model(_meta_tv("resnet18")()) == "tv_resnet"


def test_subclass_resolves_through_its_base() -> None:
    # DeiT's distilled model subclasses VisionTransformer; no preset names it.
    model = _meta_timm("deit_tiny_distilled_patch16_224")()
    assert type(model).__name__ == "VisionTransformerDistilled"
    assert preset_for_model(model) == "vit"


def test_architecture_pattern_beats_plain_class() -> None:
    plain = _meta_timm("vit_small_patch16_224")()
    hybrid = _meta_timm("vit_base_r50_s16_224")()
    assert type(plain) is type(hybrid)
    assert (preset_for_model(plain), preset_for_model(hybrid)) == ("vit", "vit_hybrid")


def test_unknown_model_resolves_to_none() -> None:
    assert preset_for_model(nn.Sequential(nn.Linear(2, 2))) is None
    assert preset_for_model(_meta_timm("test_byobnet")()) is None


class _TieNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.pretrained_cfg = {"architecture": "tie_net_small"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_equally_specific_presets_are_a_tie(scratch_registry) -> None:
    rules = CheckpointConfig(rules=[{"match": "body", "level": 3}])
    cls = f"{__name__}._TieNet"
    register_preset("tie_a", rules, architectures=[(cls, "tie_*")])  # 4 literal characters
    register_preset("tie_b", rules, architectures=[(cls, "*mall")])  # 4 as well
    with pytest.raises(ConfigError, match=r"matches presets 'tie_a', 'tie_b' equally well"):
        preset_for_model(_TieNet())
    register_preset("tie_c", rules, architectures=[(cls, "tie_net_small")])
    assert preset_for_model(_TieNet()) == "tie_c"  # most literal characters wins


def test_register_preset(scratch_registry, tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("rules:\n  - match: body\n    level: 4\n")
    register_preset("mine", path, classes=["_TieNet"])
    assert "mine" in list_presets()
    assert preset_for_model(_TieNet()) == "mine"
    assert [(int(r.level), o) for r, o in preset_rules(_TieNet(), "auto")] == [
        (4, "preset mine #0")
    ]


def test_register_preset_rejects_nested_presets(scratch_registry) -> None:
    with pytest.raises(ConfigError, match=r"sets 'preset: vit'; a preset holds rules only"):
        register_preset("bad", CheckpointConfig(preset="vit", rules=[{"match": "x", "level": 1}]))
    with pytest.raises(ConfigError, match=r"preset 'empty' has no rules and no parts"):
        register_preset("empty", CheckpointConfig())


# --- preset_rules and origins --------------------------------------------------------------


def test_preset_rules_labels_and_drops_rules_that_select_nothing(scratch_preset) -> None:
    model = _meta_timm("resnet50")()
    # a preset written here (not the shipped resnet.yaml, which may be tuned), with a rule for
    # blocks a basic-block ResNet does not have between two that every ResNet has
    name = scratch_preset(
        [
            {"match": "layer*", "level": 1, "keep": "heavy"},
            {"match": "re:layer3\\.[01]", "match_type": "Bottleneck", "level": 2},
            {"match": "layer*.*", "level": 3},
        ],
        name="resnet_like",
    )
    resnet = load_preset(name)
    assert [o for _, o in preset_rules(model, name)] == [
        "preset resnet_like #0",
        "preset resnet_like #1",
        "preset resnet_like #2",
    ]
    basic = [o for _, o in preset_rules(_meta_timm("resnet18")(), name)]
    assert basic == ["preset resnet_like #0", "preset resnet_like #2"]
    # a rule for a deep stem this model does not have selects nothing and is left out
    extra = CheckpointConfig(rules=[{"match": "conv1.0", "level": 1}, *resnet.rules])
    register_preset("resnet_deep", extra)
    pairs = preset_rules(model, "resnet_deep")
    assert [o for _, o in pairs] == [f"preset resnet_deep #{i}" for i in range(1, len(extra.rules))]
    assert [r for r, _ in pairs] == list(extra.rules[1:])


_FEATURE_ARCHS = [
    "resnet18",
    "convnext_atto",
    "efficientnet_b0",
    "mobilenetv3_small_050",
    "densenet121",
    "swin_tiny_patch4_window7_224",
]


@pytest.mark.parametrize("arch", _FEATURE_ARCHS)
def test_timm_feature_wrapper_takes_its_architectures_preset(arch: str) -> None:
    """``features_only=True`` returns a wrapper of another class (FeatureListNet,
    EfficientNetFeatures, ...) in which FeatureListNet lifts a top-level Sequential's children
    to ``a_b``: every module the wrapper kept gets the levels the preset gives it in the
    original model, under the wrapper's names."""
    original = timm.create_model(arch, pretrained=False)
    features = timm.create_model(arch, pretrained=False, features_only=True)
    assert type(features) is not type(original)
    assert preset_for_model(features) == preset_for_model(original) is not None
    lifted = {n for n, _ in features.named_children()} - {n for n, _ in original.named_children()}

    def original_name(name: str) -> str:
        head, dot, rest = name.partition(".")
        return head.replace("_", ".", 1) + dot + rest if head in lifted else name

    kept = {original_name(n) for n, _ in features.named_modules()}
    cfg = CheckpointConfig(training_checkpoint_level=5, preset="auto")

    def rungs(entries) -> dict[str, list[tuple[int, str]]]:
        return {e.name: [(int(r.level), str(r.keep)) for r in e.rungs] for e in entries}

    want = {n: r for n, r in rungs(plan(original, cfg)).items() if n in kept}
    got = {original_name(n): r for n, r in rungs(plan(features, cfg)).items()}
    assert got == want
    assert len({lv for r in got.values() for lv, _ in r}) >= 2  # not a near-empty plan
    if lifted:  # the rules were rewritten for the lifted names and say so
        origins = {e.origin for e in plan(features, cfg)}
        assert all(o.endswith("(timm features)") for o in origins), origins


def test_timm_feature_wrapper_exact_names_where_no_glob_fits() -> None:
    """A whole-model class rule selects the wrapper itself (``re:^$``)."""
    features = timm.create_model("mobilenetv3_small_050", pretrained=False, features_only=True)
    rules = {r.level: r for r, _ in preset_rules(features, "auto")}
    assert rules[5].match == "re:^$" and rules[5].match_type is None
    p = plan(features, CheckpointConfig(training_checkpoint_level=5, preset="auto"))
    assert "" in p.checkpointed


def test_preset_that_selects_nothing_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"preset 'swin' selects no module of ResNet .*'resnet'"):
        preset_rules(_meta_timm("resnet18")(), "swin")


def test_plan_reports_preset_origins(scratch_preset) -> None:
    model = _meta_timm("convnext_atto")()
    # The first rules of configs/presets/convnext.yaml as they were, written here so that tuning
    # the shipped preset does not renumber what this test of origins expects.
    downsample = {"match_type": "Sequential"}
    name = scratch_preset(
        [
            {"match": "stem", "level": 1},
            {"match": "stages.*", "level": 1, "keep": "heavy"},
            {"match": "stages.*.blocks.*", "level": 3},
            {"match": "stages.*.downsample", **downsample, "level": 3},
            {"match": "stages.0.blocks.*", "level": 2},
            {"match": "stages.1.blocks.*", "level": 2},
            {"match": "stages.1.downsample", **downsample, "level": 2},
            {"match": "stages.2.blocks.*", "level": 2, "keep": "heavy"},
        ],
        name="convnext_like",
    )
    p = plan(model, CheckpointConfig(training_checkpoint_level=3, preset=name))
    # A block of stage 0: level 3 from rule #2, then level 2 from #4 (the later rule wins).
    assert p["stages.0.blocks.0"].origin == "preset convnext_like #4"
    # A block of stage 2: selective at 2 (#7, inside its selective stage), whole at 3 (#2).
    assert p["stages.2.blocks.0"].origin == "preset convnext_like #7; preset convnext_like #2"
    # The stage: selective at 1 (rule #1), stepping aside from 2 where its blocks are whole;
    # levels 4-5 are level 3's plan, so neither the stage nor all stages is a full region.
    assert p["stages.0"].origin == "preset convnext_like #1"
    assert [str(r) for r in p["stages.0"].rungs] == ["keep heavy 1 only"]
    assert [str(r) for r in p["stages.2"].rungs] == ["keep heavy 1-2"]
    assert "stages" not in {e.name for e in p}
    assert p["stages.1.downsample"].origin == "preset convnext_like #6"
    assert p["stages.2.downsample"].origin == "preset convnext_like #3"


def _strategy_at(p: CheckpointPlan, name: str, level: int) -> str:
    rung = p[name].rung_at(level)
    return "-" if rung is None else ("selective" if rung.selective else "full")


def test_resnet_level_2_makes_the_first_two_stages_blocks_selective_alone() -> None:
    """ResNet's level 2: the blocks of layer1-2 selective on their own, redoing their 1x1
    convs from fewer than 300 channels too, their stages stepping aside; layer3-4 selective as
    at level 1. Level 3 makes layer1-2's blocks whole and each later block selective inside its
    selective stage; level 4 makes every block whole."""
    p = plan(_meta_timm("resnet50")(), CheckpointConfig(training_checkpoint_level=2, preset="auto"))
    assert [_strategy_at(p, n, 1) for n in ("layer1", "layer1.0", "layer2", "layer4")] == [
        "selective",
        "-",
        "selective",
        "selective",
    ]
    assert [_strategy_at(p, n, 2) for n in ("layer1", "layer1.0", "layer2.3", "layer4")] == [
        "-",
        "selective",
        "selective",
        "selective",
    ]
    assert str(p["layer2.3"].rung_at(2).keep) == "heavy<600" and "layer4.0" not in p.checkpointed
    assert (
        _strategy_at(p, "layer2.0", 3) == "full" and _strategy_at(p, "layer4.0", 3) == "selective"
    )
    assert _strategy_at(p, "layer4.0", 4) == "full" and _strategy_at(p, "layer4", 4) == "-"


def test_convnext_level_2_recomputes_the_high_resolution_blocks() -> None:
    """ConvNeXt's level 2: the blocks of the first two stages whole, each later block selective
    inside its selective stage; level 3 makes every block whole."""
    dense, later, stage = "stages.1.blocks.0", "stages.2.blocks.0", "stages.2"
    p = plan(
        _meta_timm("convnext_atto")(), CheckpointConfig(training_checkpoint_level=2, preset="auto")
    )
    assert p[dense].checkpointed and _strategy_at(p, dense, 2) == "full"
    assert p[later].checkpointed and _strategy_at(p, later, 2) == "selective"
    assert p[stage].checkpointed and _strategy_at(p, stage, 2) == "selective"
    assert _strategy_at(p, dense, 1) == "-" and _strategy_at(p, later, 1) == "-"
    assert _strategy_at(p, later, 3) == "full" and _strategy_at(p, stage, 3) == "-"


def test_bottleneck_resnet_level_3_also_recomputes_two_layer3_blocks() -> None:
    """In a bottleneck ResNet the first two layer3 blocks are whole from level 3 too, so
    layer3 steps aside and its other blocks are selective on their own; a basic-block ResNet
    keeps layer3 selective with each block selective inside it."""
    p = plan(_meta_timm("resnet50")(), CheckpointConfig(training_checkpoint_level=3, preset="auto"))
    assert [_strategy_at(p, f"layer3.{i}", 3) for i in range(4)] == [
        "full",
        "full",
        "selective",
        "selective",
    ]
    assert _strategy_at(p, "layer3", 3) == "-"
    p18 = plan(
        _meta_timm("resnet18")(), CheckpointConfig(training_checkpoint_level=3, preset="auto")
    )
    assert _strategy_at(p18, "layer3", 3) == "selective"
    assert _strategy_at(p18, "layer3.0", 3) == "selective"


def test_resnet_level_5_recomputes_layer1_in_segments_inside_its_region() -> None:
    """Level 5 keeps layer1 one region and recomputes its three blocks in segments of two
    inside it; a two-block layer1 (ResNet-18) would make one segment of the whole stage, which
    adds nothing, so there level 5 keeps level 4's layer1."""
    for name, rungs in (
        ("resnet50", ["keep heavy 1 only", "full 4", "full in segments/2 5"]),
        ("resnet18", ["keep heavy 1 only", "full 4"]),
    ):
        p = plan(_meta_timm(name)(), CheckpointConfig(training_checkpoint_level=5, preset="auto"))
        assert [str(r) for r in p["layer1"].rungs] == rungs, name


def test_swin_level_3_nests_attention_and_mlp_in_the_first_stage_blocks() -> None:
    """Swin: level 2 makes the first two stages' blocks whole and keeps the later ones
    selective; level 3 nests the attention and MLP of the first stage's blocks (a block
    holding two regions is a group) and makes the third stage's blocks whole but its first
    three, which stay selective; level 4 makes those three whole too and every MLP lean
    (no region for it); level 5 is level 4's."""
    model = _meta_timm("swin_tiny_patch4_window7_224")()
    p1, p2, p3, p4, p5 = (
        plan(model, CheckpointConfig(training_checkpoint_level=lv, preset="auto"))
        for lv in (1, 2, 3, 4, 5)
    )
    mlps = [e for e in p4 if e.name.endswith(".mlp")]
    assert len(mlps) == 12 and all(e.lean_at(4) and not e.lean_at(3) for e in mlps)
    assert not p4["layers.1.blocks.0.mlp"].checkpointed
    assert _strategy_at(p2, "layers.1.blocks.1", 2) == "full"
    assert _strategy_at(p2, "layers.2.blocks.0", 2) == "selective"
    assert not p2["layers.0.blocks.0.attn"].checkpointed
    assert p3["layers.0.blocks.0.attn"].checkpointed and p3["layers.0.blocks.1.mlp"].checkpointed
    assert _strategy_at(p3, "layers.1.blocks.1", 3) == "full"
    assert "layers.1.blocks.1.mlp" not in {e.name for e in p1 if e.rungs}
    third = [_strategy_at(p3, f"layers.2.blocks.{i}", 3) for i in range(6)]
    assert third == ["selective"] * 3 + ["full"] * 3
    assert [_strategy_at(p4, f"layers.2.blocks.{i}", 4) for i in range(6)] == ["full"] * 6
    assert _strategy_at(p3, "layers.3.blocks.0", 3) == "selective"
    assert not p3["layers.2.blocks.0.mlp"].checkpointed
    assert p4.checkpointed == p5.checkpointed


# --- the fallback --------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Linear(dim, dim))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x + self.attn(x))


class _Stage(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim))
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(x)
        for block in self.blocks:
            x = block(x)
        return x


class _SwinLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(3, 8), nn.LayerNorm(8))
        self.stages = nn.Sequential(_Stage(8, 2), _Stage(8, 1))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def test_fallback_on_a_custom_model() -> None:
    levels = {r.match: int(r.level) for r, o in fallback_rules(_SwinLike())}
    assert levels == {
        "stem": 1,  # Linear + LayerNorm: a layer with its norm
        "stages": 5,  # the trunk
        "stages.0": 4,
        "stages.0.down": 1,
        "stages.0.blocks.0": 3,
        "stages.0.blocks.0.attn": 2,
        "stages.0.blocks.0.mlp": 2,
        "stages.0.blocks.1": 3,
        "stages.0.blocks.1.attn": 2,
        "stages.0.blocks.1.mlp": 2,
        "stages.1": 4,
        "stages.1.down": 1,
        "stages.1.blocks.0": 3,
        "stages.1.blocks.0.attn": 2,
        "stages.1.blocks.0.mlp": 2,
    }
    assert "head" not in levels  # a lone Linear is never a level-1 unit


def test_fallback_runs_and_is_exact() -> None:
    torch.manual_seed(0)
    model = _SwinLike()
    x = torch.randn(4, 3)
    ref = model(x).square().sum()
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    from vision_ckpt.regions.apply import apply, remove

    applied = apply(
        model, CheckpointConfig(training_checkpoint_level=5, preset="auto", nesting="all")
    )
    assert {e.origin for e in applied} == {"fallback"}
    assert len(applied.checkpointed) == len(applied)
    out = model(x).square().sum()
    out.backward()
    assert torch.equal(out, ref)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    remove(model)


class _ListNet(nn.Module):
    """Blocks in a ModuleList that the model's own forward iterates: no trunk module."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_fallback_without_trunk_module_takes_the_model() -> None:
    pairs = fallback_rules(_ListNet())
    assert (pairs[0][0].match, int(pairs[0][0].level)) == ("re:^$", 5)
    assert _selected(pairs[0][0], _ListNet()) == [""]
    p = plan(_ListNet(), CheckpointConfig(training_checkpoint_level=5, preset="auto"))
    assert p[""].checkpointed and p[""].origin == "fallback"


def test_fallback_names_are_exact_and_escaped() -> None:
    model = nn.Sequential()
    model.add_module("odd name", nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    model.add_module("b", nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    rules = [r.match for r, _ in fallback_rules(model)]
    assert rules == ["re:odd\\ name", "b"]
    assert _selected(LevelRule(match=rules[0], level=1), model) == ["odd name"]


def test_fallback_on_timm_uses_group_matcher() -> None:
    model = _meta_timm("test_byobnet")()
    levels = {r.match: int(r.level) for r, _ in fallback_rules(model)}
    assert {n for n, lv in levels.items() if lv == 4} == {f"stages.{i}" for i in range(4)}
    assert levels["stages"] == 5
    assert levels["stages.0.0"] == 3
    assert preset_rules(model, "auto") == fallback_rules(model)


def test_fallback_with_coarse_equal_to_fine_has_no_stages() -> None:
    # ViT's group_matcher gives the same groups coarse and fine: blocks (3) and the trunk (5).
    levels = {
        r.match: int(r.level) for r, _ in fallback_rules(_meta_timm("vit_tiny_patch16_224")())
    }
    assert levels["blocks"] == 5 and levels["blocks.0"] == 3 and levels["blocks.0.mlp"] == 2
    assert 4 not in levels.values()


def test_fallback_skips_units_that_start_in_place() -> None:
    unit = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2))
    assert not _fallback._is_unit(unit)
    assert _fallback._is_unit(nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2), nn.ReLU(True)))
    assert not _fallback._is_unit(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU()))


def test_fallback_with_nothing_to_do_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"the fallback found nothing to checkpoint in Linear"):
        fallback_rules(nn.Linear(2, 2))


# --- family headers: parts, and presets that no longer fit -----------------------------------


class _SegNet(nn.Module):
    """An encoder with a preset of its own (torchvision's ResNet) and a decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = tvm.resnet18(num_classes=4)
        self.decoder = nn.Sequential(
            nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()), nn.Sequential(nn.Conv2d(4, 2, 1))
        )
        self.head = nn.Sequential(nn.Linear(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.encoder(x)[:, :, None, None]
        return self.head(self.decoder(feats).flatten(1))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "seg.yaml"
    path.write_text(text)
    return path


def test_parts_take_their_own_presets_under_their_names(scratch_registry, tmp_path) -> None:
    path = _write(
        tmp_path,
        f"""
family:
  classes: [{__name__}._SegNet]
  written_for: {{torchvision: "0.1"}}
  parts: {{encoder: auto, neck: tv_resnet, head: mine}}
rules:
  - match: "decoder.*"
    level: 3
  - match: "decoder"
    level: 5
""",
    )
    register_preset("mine", CheckpointConfig(rules=[{"match": "re:\\d", "level": 1}]))
    register_preset("segnet", path)  # the file names its class: no classes= needed
    model = _SegNet()
    assert preset_for_model(model) == "segnet"
    rules = preset_rules(model, "auto")
    encoder = [(r, o) for r, o in rules if o.startswith("preset segnet encoder: ")]
    # every tv_resnet rule but the bottleneck one, in order, made to select under "encoder."
    tv = load_preset("tv_resnet").rules
    bottleneck = next(i for i, r in enumerate(tv) if r.match_type == "Bottleneck")
    assert [o for _, o in encoder] == [
        f"preset segnet encoder: preset tv_resnet #{i}" for i in range(len(tv)) if i != bottleneck
    ]
    assert [(r.match, r.through) for r, _ in encoder][0] == ("encoder.conv1", "maxpool")
    assert [r.match for r, _ in encoder] == [
        "encoder.conv1",
        "encoder.layer*",
        "encoder.layer*.*",
        "encoder.layer1.*",
        "encoder.layer2.*",
        "encoder.layer3.*",
        "encoder.layer4.*",
        "encoder.layer1",
    ]
    # "neck" does not exist: skipped; a regex rule stays anchored under its part
    head = ("re:head\\.(?:\\d)", "preset segnet head: preset mine #0")
    assert (rules[-3][0].match, rules[-3][1]) == head
    assert [o for _, o in rules[-2:]] == ["preset segnet #0", "preset segnet #1"]
    entries = {e.name: int(e.level) for e in plan(model, {"preset": "auto"}).entries}
    assert entries["encoder.layer1.0"] == 2 and entries["encoder.layer4"] == 1
    assert entries["head.0"] == 1 and entries["decoder.1"] == 3 and entries["decoder"] == 5
    assert "encoder" not in entries and "encoder.fc" not in entries


def test_a_part_class_rule_stays_inside_the_part(scratch_registry) -> None:
    register_preset("lin", CheckpointConfig(rules=[{"match_type": "Linear", "level": 2}]))
    register_preset(
        "outer",
        PresetFile(family={"parts": {"head": "lin"}}, rules=[{"match": "decoder", "level": 4}]),
    )
    model = nn.Sequential()
    model.add_module("head", nn.Sequential(nn.Linear(2, 2)))
    model.add_module("other", nn.Linear(2, 2))
    model.add_module("decoder", nn.Sequential(nn.Linear(2, 2)))
    entries = {e.name: int(e.level) for e in plan(model, {"preset": "outer"}).entries}
    assert entries == {"head.0": 2, "decoder": 4}


def test_a_level_of_the_preset_that_selects_nothing_is_reported(scratch_registry) -> None:
    register_preset(
        "old",
        PresetFile(
            family={"written_for": {"somelib": "1.2"}},
            rules=[
                {"match": "body", "level": 3},
                {"match": "body.layer_renamed", "level": 2},
                {"match": "body.other_renamed", "level": 2},
            ],
        ),
    )
    with pytest.warns(
        PresetMismatchWarning,
        match=r"preset 'old' leaves levels \[2\] empty on _TieNet: no module matches level 2: "
        r"rules\[1\] \(match='body.layer_renamed' level=2\), rules\[2\] .*"
        r"written for somelib 1.2; installed: somelib none",
    ):
        rules = preset_rules(_TieNet(), "old")
    assert [o for _, o in rules] == ["preset old #0"]
    # at the version it was written for, an empty level is the family's design (RegNetX has no
    # SE modules): no warning
    major_minor = ".".join(torch.__version__.split(".")[:2])
    register_preset(
        "same",
        PresetFile(
            family={"written_for": {"torch": major_minor}},
            rules=[{"match": "body", "level": 3}, {"match": "body.layer_renamed", "level": 2}],
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(preset_rules(_TieNet(), "same")) == 1


def test_a_preset_that_selects_nothing_names_its_versions(scratch_registry) -> None:
    register_preset(
        "gone",
        PresetFile(family={"written_for": {"torch": "0.1"}}, rules=[{"match": "x", "level": 3}]),
    )
    with pytest.raises(
        ConfigError,
        match=r"preset 'gone' selects no module of _TieNet \(top-level children: body\) "
        r"\(the preset was written for torch 0.1; installed: torch 2\.",
    ):
        preset_rules(_TieNet(), "gone")


def test_a_preset_file_by_its_path(tmp_path: Path) -> None:
    """`preset: FILE`, `apply_preset(..., preset=FILE)` and CheckpointConfig.from_file take a
    preset file; one that is missing is a ConfigError naming it."""
    source = presets.presets_dir() / "resnet.yaml"
    path = tmp_path / "derived.yaml"
    path.write_text(source.read_text())
    model = timm.create_model("resnet18", pretrained=False)
    named = vision_ckpt.plan(model, {"preset": "resnet", "training_checkpoint_level": 3})
    by_path = vision_ckpt.plan(model, {"preset": str(path), "training_checkpoint_level": 3})
    assert by_path.checkpointed == named.checkpointed
    cfg = CheckpointConfig.from_file(path)
    assert cfg.preset == str(path) and not cfg.rules
    applied = vision_ckpt.apply_preset(copy.deepcopy(model), 3, preset=str(path))
    assert applied.checkpointed == named.checkpointed
    with pytest.raises(ConfigError, match=r"preset file '.*missing\.yaml' does not exist"):
        vision_ckpt.plan(model, {"preset": str(tmp_path / "missing.yaml")})
