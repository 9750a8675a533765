"""Segmentation presets on real models: segmentation_models_pytorch (``smp_*``) and torchvision's
segmentation models (``tvseg_*``), checked as every preset family is (``check_case``: exact
outputs, gradients and BatchNorm statistics at levels 0-5 with dropout and drop-path on, saved
bytes falling and recomputation rising with the level), plus the segmentation training example.

Models are tiny (ResNet-18-sized encoders or smaller, 16-32 decoder channels, 32-64 px, batch 2)
so that each case takes a few seconds on one thread. The smp tests skip when
segmentation_models_pytorch is not installed.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _family_check import Case, check_case
from torch import nn

import vision_ckpt
from vision_ckpt.config import CheckpointConfig
from vision_ckpt.config.presets import list_presets, load_preset, preset_for_model, preset_rules

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("smp_", "tvseg_")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def _smp(arch: str, encoder: str, depth: int = 5, **kwargs: Any) -> Callable[[], nn.Module]:
    """A tiny smp model of class ``arch``: random weights, nothing downloaded."""

    def make() -> nn.Module:
        smp = pytest.importorskip("segmentation_models_pytorch")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # timm/smp deprecation notes
            return getattr(smp, arch)(
                encoder_name=encoder,
                encoder_weights=None,
                encoder_depth=depth,
                classes=3,
                **kwargs,
            )

    return make


def _tv_resnet_backbone(aux: bool) -> nn.Module:
    """A ResNet-10 (BasicBlock, one block per stage) as torchvision's segmentation models
    hold it: an IntermediateLayerGetter returning ``out`` (layer4) and ``aux`` (layer3)."""
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.resnet import BasicBlock, ResNet

    layers = {"layer4": "out", "layer3": "aux"} if aux else {"layer4": "out"}
    return IntermediateLayerGetter(ResNet(BasicBlock, [1, 1, 1, 1]), return_layers=layers)


def _tiny_mobilenet_features() -> nn.Sequential:
    """MobileNetV3 ``features`` with five inverted-residual blocks (SE and hardswish ones too)."""
    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3

    def cfg(*args: Any) -> InvertedResidualConfig:
        return InvertedResidualConfig(*args, width_mult=1.0)

    setting = [  # input, kernel, expanded, out, SE, activation, stride, dilation
        cfg(16, 3, 16, 16, False, "RE", 1, 1),
        cfg(16, 3, 32, 24, False, "RE", 2, 1),
        cfg(24, 5, 48, 24, True, "HS", 1, 1),
        cfg(24, 3, 64, 32, True, "HS", 2, 1),
        cfg(32, 3, 64, 32, True, "HS", 1, 2),
    ]
    return MobileNetV3(setting, last_channel=64, num_classes=3).features


def _tvseg_deeplabv3_resnet() -> nn.Module:
    from torchvision.models.segmentation.deeplabv3 import DeepLabHead, DeepLabV3
    from torchvision.models.segmentation.fcn import FCNHead

    return DeepLabV3(
        _tv_resnet_backbone(aux=True),
        DeepLabHead(512, 3, atrous_rates=(2, 4, 6)),
        FCNHead(256, 3),
    )


def _tvseg_deeplabv3_mobilenet() -> nn.Module:
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation.deeplabv3 import DeepLabHead, DeepLabV3
    from torchvision.models.segmentation.fcn import FCNHead

    features = _tiny_mobilenet_features()  # 0 stem, 1-5 blocks, 6 last 1x1 conv unit
    backbone = IntermediateLayerGetter(features, return_layers={"6": "out", "2": "aux"})
    return DeepLabV3(backbone, DeepLabHead(192, 3, atrous_rates=(2, 4, 6)), FCNHead(24, 3))


def _tvseg_fcn() -> nn.Module:
    from torchvision.models.segmentation.fcn import FCN, FCNHead

    return FCN(_tv_resnet_backbone(aux=True), FCNHead(512, 3), FCNHead(256, 3))


def _tvseg_lraspp() -> nn.Module:
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation.lraspp import LRASPP

    backbone = IntermediateLayerGetter(
        _tiny_mobilenet_features(), return_layers={"2": "low", "6": "high"}
    )
    return LRASPP(backbone, low_channels=24, high_channels=192, num_classes=3)


def _tvseg_builder(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    """A torchvision builder with random weights (``weights=None, weights_backbone=None``)."""

    def make() -> nn.Module:
        import torchvision.models.segmentation as seg

        return getattr(seg, name)(weights=None, weights_backbone=None, num_classes=3, **kwargs)

    return make


_U5 = {"decoder_channels": (16, 16, 16, 16, 16)}
SMP_CASES = [
    Case("smp_unet:resnet18", _smp("Unet", "resnet18", **_U5), 64, "smp_unet"),
    Case(
        "smp_unet:resnet18-depth3-scse",
        _smp("Unet", "resnet18", 3, decoder_channels=(32, 16, 16), decoder_attention_type="scse"),
        32,
        "smp_unet",
    ),
    # timm encoders: TimmUniversalEncoder -> smp_timm_universal -> the timm preset of the
    # architecture, rewritten for the feature wrapper's names
    Case("smp_unet:tu-resnet18", _smp("Unet", "tu-resnet18", **_U5), 64, "smp_unet"),
    Case(
        "smp_unet:tu-efficientnet_b0",
        _smp("Unet", "tu-efficientnet_b0", **_U5, drop_path_rate=0.1),
        32,
        "smp_unet",
    ),
    Case(
        "smp_unetplusplus:resnet18-depth4",
        _smp("UnetPlusPlus", "resnet18", 4, decoder_channels=(16, 16, 16, 16)),
        32,
        "smp_unetplusplus",
    ),
    Case(
        "smp_fpn:resnet18",
        _smp("FPN", "resnet18", decoder_pyramid_channels=32, decoder_segmentation_channels=32),
        64,
        "smp_fpn",
    ),
    Case(
        "smp_fpn:tu-convnext_atto",
        _smp(
            "FPN",
            "tu-convnext_atto",
            decoder_pyramid_channels=32,
            decoder_segmentation_channels=32,
            drop_path_rate=0.1,
        ),
        64,
        "smp_fpn",
    ),
    Case(
        "smp_deeplabv3plus:resnet18",
        _smp("DeepLabV3Plus", "resnet18", decoder_channels=32, decoder_atrous_rates=(2, 4, 6)),
        64,
        "smp_deeplabv3plus",
    ),
    Case(
        "smp_segformer:resnet18-depth3",
        _smp("Segformer", "resnet18", 3, decoder_segmentation_channels=32),
        32,
        "smp_segformer",
    ),
    # SegFormer's own encoder: its levels come from smp_mit (drop-path 0.1 by default)
    Case(
        "smp_segformer:mit_b0",
        _smp("Segformer", "mit_b0", decoder_segmentation_channels=32),
        64,
        "smp_segformer",
    ),
]

TV_CASES = [
    Case("tvseg_deeplabv3:resnet", _tvseg_deeplabv3_resnet, 64, "tvseg_deeplabv3"),
    Case("tvseg_deeplabv3:mobilenet_v3", _tvseg_deeplabv3_mobilenet, 64, "tvseg_deeplabv3"),
    Case("tvseg_fcn:resnet", _tvseg_fcn, 64, "tvseg_fcn"),
    Case("tvseg_lraspp:mobilenet_v3", _tvseg_lraspp, 64, "tvseg_lraspp"),
    # the stock builders, at their full widths: heavier
    Case(
        "tvseg_lraspp:lraspp_mobilenet_v3_large",
        _tvseg_builder("lraspp_mobilenet_v3_large"),
        64,
        "tvseg_lraspp",
        slow=True,
    ),
    Case(
        "tvseg_deeplabv3:deeplabv3_mobilenet_v3_large",
        _tvseg_builder("deeplabv3_mobilenet_v3_large", aux_loss=True),
        64,
        "tvseg_deeplabv3",
        slow=True,
    ),
]

CASES = SMP_CASES + TV_CASES


def _params(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


@pytest.fixture(autouse=True)
def _global_level_off():
    vision_ckpt.set_training_level(0)
    yield
    vision_ckpt.set_training_level(0)


# --------------------------------------------------------------------------------------------
# Every family: exact and monotone
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", _params(SMP_CASES))
def test_smp_family(case: Case, core_calls: list[Any]) -> None:
    pytest.importorskip("segmentation_models_pytorch")
    check_case(case, core_calls)


@pytest.mark.parametrize("case", _params(TV_CASES))
def test_torchvision_family(case: Case, core_calls: list[Any]) -> None:
    check_case(case, core_calls)


# --------------------------------------------------------------------------------------------
# Every preset has models, and every rule selects modules in one of them
# --------------------------------------------------------------------------------------------

_ORIGIN = re.compile(r"preset (\w+) #(\d+)(?: \(timm features\))?$")
_PRESET = re.compile(r"preset (\w+)")


def _used_rules(case: Case) -> set[tuple[str, int]]:
    """``(preset, rule index)`` of every rule that selects a module of the case's model, the
    rules of presets reached through ``parts`` included."""
    model = case.make()
    used = set()
    for _, origin in preset_rules(model, "auto"):
        found = _ORIGIN.search(origin)  # the innermost "preset <name> #<i>" of the label
        if found:
            used.add((found[1], int(found[2])))
    return used


@pytest.fixture(scope="module")
def used_rules() -> set[tuple[str, int]]:
    pytest.importorskip("segmentation_models_pytorch")
    out: set[tuple[str, int]] = set()
    for case in CASES:
        out |= _used_rules(case)
    return out


def test_every_segmentation_preset_has_a_family_model(used_rules) -> None:
    """Each smp_/tvseg_ preset is the preset of a case's model, or (smp_mit) the preset of a
    part of one."""
    ours = set(list_presets("smp_*")) | set(list_presets("tvseg_*"))
    assert ours >= {"smp_unet", "smp_unetplusplus", "smp_fpn", "smp_deeplabv3plus"}
    assert ours >= {"smp_segformer", "tvseg_deeplabv3", "tvseg_fcn", "tvseg_lraspp"}
    reached = {c.preset for c in CASES} | {preset for preset, _ in used_rules}
    reached |= {  # a preset of parts only (smp_timm_universal) appears in the origin labels
        name
        for case in CASES
        for _, origin in preset_rules(case.make(), "auto")
        for name in _PRESET.findall(origin)
    }
    assert ours <= reached, sorted(ours - reached)


@pytest.mark.parametrize("preset", [p for p in list_presets() if p.startswith(PREFIXES)])
def test_every_rule_selects_modules_in_a_family_model(preset: str, used_rules) -> None:
    rules = load_preset(preset).rules
    unused = [f"rules[{i}] ({r})" for i, r in enumerate(rules) if (preset, i) not in used_rules]
    assert not unused, f"{preset}: selects nothing in any test model: {unused}"


def test_smp_encoders_resolve_to_their_own_family() -> None:
    """ResNetEncoder subclasses torchvision's ResNet; the MiT encoder has smp_mit; a timm
    encoder holds timm's feature wrapper, which resolves to its architecture's timm preset."""
    pytest.importorskip("segmentation_models_pytorch")
    unet = _smp("Unet", "resnet18", **_U5)()
    assert preset_for_model(unet.encoder) == "tv_resnet"
    segformer = _smp("Segformer", "mit_b0", decoder_segmentation_channels=32)()
    assert preset_for_model(segformer.encoder) == "smp_mit"
    tu = _smp("Unet", "tu-resnet18", **_U5)()
    assert preset_for_model(tu.encoder) == "smp_timm_universal"
    assert preset_for_model(tu.encoder.model) == "resnet"  # timm's FeatureListNet
    origins = {o for _, o in preset_rules(tu, "auto")}
    assert (
        "preset smp_unet encoder: preset smp_timm_universal model: preset resnet #2 "
        "(timm features)" in origins
    )
    assert not any("fallback" in o for o in origins)


def test_plan_names_each_part_preset() -> None:
    pytest.importorskip("segmentation_models_pytorch")
    model = _smp("Unet", "resnet18", **_U5)()
    the_plan = vision_ckpt.plan(model, CheckpointConfig(training_checkpoint_level=5, preset="auto"))
    origins = {e.name: e.origin for e in the_plan}
    assert origins["encoder.layer1.0"] == "preset smp_unet encoder: preset tv_resnet #3"
    assert origins["encoder"] == "preset smp_unet #4"
    assert origins["decoder.blocks.0"] == "preset smp_unet #2"


# --------------------------------------------------------------------------------------------
# examples/train_segmentation.py
# --------------------------------------------------------------------------------------------

EXAMPLES = ROOT / "examples"
SEG_CONFIGS = sorted((ROOT / "configs" / "train" / "segmentation").glob("*.yaml"))


@pytest.fixture(scope="module")
def train_segmentation():
    pytest.importorskip("segmentation_models_pytorch")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_segmentation
    finally:
        sys.path.remove(str(EXAMPLES))
    return train_segmentation


def test_segmentation_configs_validate_and_plan(train_segmentation) -> None:
    assert {p.stem for p in SEG_CONFIGS} >= {"unet_timm_tiny", "unet_timm_512"}
    for path in SEG_CONFIGS:
        cfg = train_segmentation.load_segmentation_config(path)
        with torch.device("meta"):
            model = train_segmentation.build_model(cfg, device="meta")
        assert preset_for_model(model) == "smp_unet"
        the_plan = vision_ckpt.plan(model, cfg.checkpoint)
        assert the_plan.checkpointed, f"{path.name} checkpoints nothing"


def test_train_segmentation_checkpointed_run_has_the_losses_of_the_plain_run(
    train_segmentation,
) -> None:
    """The default config: a tu-resnet18 U-Net at 64 px with drop-path; recomputation must
    redraw the same masks and BatchNorm statistics must update once per step."""
    plain = train_segmentation.main(["--steps", "2", "--level", "0"])
    ckpt = train_segmentation.main(["--steps", "2", "--level", "5"])
    assert [s.loss for s in ckpt] == [s.loss for s in plain]
    assert all(math.isfinite(s.loss) and s.peak_bytes for s in ckpt)


def test_train_segmentation_real_size_flags(train_segmentation) -> None:
    """``--image-size 512 --batch-size 4`` is what the real run uses; parsed and applied to the
    config here, not run."""
    args = train_segmentation.parse_args(["--image-size", "512", "--batch-size", "4"])
    cfg = train_segmentation.config_from_args(args)
    assert (cfg.image_size, cfg.batch_size) == (512, 4)
    assert cfg.encoder.startswith("tu-")


def test_train_segmentation_rejects_a_bad_image_size(train_segmentation) -> None:
    with pytest.raises(SystemExit, match="divisible by 32"):
        train_segmentation.main(["--image-size", "100", "--steps", "1"])
