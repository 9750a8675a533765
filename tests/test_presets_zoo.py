"""Every preset, and the fallback, on real models: exact, monotone and really recomputing.

For one model of every preset family and for more than 30 timm architectures from
``timm.list_models()`` (those with a preset and those that take the fallback), at every training
level 0..5 with dropout and drop-path active:

- outputs, every parameter gradient and the BatchNorm statistics equal the plain model's exactly
  (both runs start from the same RNG seed);
- the bytes autograd saves for backward never increase with the level, and level 5 saves
  strictly less than level 0;
- backward FLOPs (``FlopCounterMode``, recomputation included) never decrease with the level,
  and level 5 does strictly more than level 0;
- ``state_dict()`` keys are unchanged, and level 0 and eval mode call the core zero times.

Models are tiny (a few blocks, 32-64 px, batch 2) so the whole file runs in a few minutes on one
core; the few heaviest are marked ``slow``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import timm
from _family_check import Case, check_case
from torch import nn

import vision_ckpt
from vision_ckpt.config import CheckpointConfig
from vision_ckpt.config.presets import list_presets
from vision_ckpt.regions.apply import plan

LEVELS = range(6)


def _timm(name: str, size: int | None = None, **kwargs: Any) -> Callable[[], nn.Module]:
    """A tiny timm model with dropout and drop-path on, where the family takes them."""

    def make() -> nn.Module:
        base: dict[str, Any] = {"pretrained": False, "num_classes": 10, **kwargs}
        attempts = [
            {"drop_rate": 0.1, "drop_path_rate": 0.1, **base},
            {"drop_rate": 0.1, **base},
            base,
        ]
        if size is not None:
            attempts = [{"img_size": size, **a} for a in attempts] + attempts
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, attempt in enumerate(attempts):
                try:
                    return timm.create_model(name, **attempt)
                except TypeError:
                    if i == len(attempts) - 1:
                        raise
        raise AssertionError("unreachable")

    make.arch = name  # type: ignore[attr-defined]
    return make


def _tv_resnet() -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 2, 1, 1], num_classes=10, width_per_group=16)


def _tv_densenet() -> nn.Module:
    from torchvision.models import DenseNet

    return DenseNet(
        growth_rate=8,
        block_config=(1, 2, 1, 1),
        num_init_features=16,
        drop_rate=0.1,
        num_classes=10,
    )


def _tv_swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[1, 1, 2, 1],
        num_heads=[1, 1, 2, 2],
        window_size=[2, 2],
        dropout=0.1,
        stochastic_depth_prob=0.1,
        num_classes=10,
    )


def _tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        dropout=0.1,
        attention_dropout=0.1,
        num_classes=10,
    )


_SWIN = {"window_size": 2, "depths": (1, 1, 2, 1), "embed_dim": 16, "num_heads": (1, 1, 2, 2)}
_MAXXVIT = {
    "depths": (1, 1, 1, 1),
    "embed_dim": (8, 16, 24, 32),
    "stem_width": 8,
    "transformer_dim_head": 8,
}

# One model of every preset family (the preset must resolve and every level must hold).
FAMILIES = [
    Case("vit:deit_tiny", _timm("deit_tiny_patch16_224", 32, patch_size=8, depth=2), 32, "vit"),
    Case(
        "vit_hybrid:vit_small_r26_s32",
        _timm("vit_small_r26_s32_224", 64, depth=1),
        64,
        "vit_hybrid",
        slow=True,
    ),
    Case(
        "beit:beit_base",
        _timm("beit_base_patch16_224", 32, patch_size=8, depth=2, embed_dim=32, num_heads=2),
        32,
        "beit",
    ),
    Case("eva:eva02_tiny", _timm("eva02_tiny_patch14_224", 28, depth=2), 28, "eva"),
    Case("swin:swin_tiny", _timm("swin_tiny_patch4_window7_224", 32, **_SWIN), 32, "swin"),
    Case("swin:swinv2_tiny", _timm("swinv2_tiny_window8_256", 32, **_SWIN), 32, "swin"),
    Case(
        "convnext:convnextv2_atto",
        _timm("convnextv2_atto", depths=(1, 1, 2, 1), dims=(8, 16, 24, 32)),
        32,
        "convnext",
    ),
    Case("resnet:test_resnet", _timm("test_resnet"), 32, "resnet"),
    Case("regnet:regnetx_002", _timm("regnetx_002"), 32, "regnet"),
    Case(
        "densenet:densenet121",
        _timm("densenet121", block_config=(1, 2, 1, 1), growth_rate=8),
        32,
        "densenet",
    ),
    Case("efficientnet:test_efficientnet", _timm("test_efficientnet"), 32, "efficientnet"),
    Case("mobilenetv3:mobilenetv3_small_050", _timm("mobilenetv3_small_050"), 32, "mobilenetv3"),
    Case("maxxvit:maxvit_tiny_tf", _timm("maxvit_tiny_tf_224", 32, **_MAXXVIT), 32, "maxxvit"),
    Case("pvt_v2:pvt_v2_b0", _timm("pvt_v2_b0", depths=(1, 1, 1, 1)), 32, "pvt_v2"),
    Case("tv_resnet:resnet50", _tv_resnet, 32, "tv_resnet"),
    Case("tv_densenet:densenet121", _tv_densenet, 32, "tv_densenet"),
    Case("tv_swin:swin_t", _tv_swin, 32, "tv_swin"),
    Case("tv_vit:vit_b_16", _tv_vit, 32, "tv_vit"),
]

# Architectures from timm.list_models(), small variants, presets and fallback alike.
ZOO = [
    Case("test_vit", _timm("test_vit", 32), 32, "vit"),
    Case("test_vit2", _timm("test_vit2", 32), 32, "vit"),
    Case("deit3_small", _timm("deit3_small_patch16_224", 32, patch_size=8, depth=2), 32, "vit"),
    Case("test_convnext", _timm("test_convnext"), 32, "convnext"),
    Case("test_convnext3", _timm("test_convnext3"), 32, "convnext"),
    Case("test_efficientnet_gn", _timm("test_efficientnet_gn"), 32, "efficientnet"),
    Case("tinynet_e", _timm("tinynet_e"), 32, "efficientnet"),
    Case("mnasnet_small", _timm("mnasnet_small"), 32, "efficientnet"),
    Case("lcnet_050", _timm("lcnet_050"), 32, "mobilenetv3"),
    Case("mobilenetv4_conv_small", _timm("mobilenetv4_conv_small"), 32, "mobilenetv3"),
    Case("resnet10t", _timm("resnet10t"), 32, "resnet"),
    Case("regnety_002", _timm("regnety_002"), 32, "regnet"),
    Case("test_coatnet", _timm("test_coatnet", 32), 32, "maxxvit"),
    Case("test_maxvit", _timm("test_maxvit", 32), 32, "maxxvit"),
    # No preset: the fallback (timm group_matcher, else the structure).
    Case("test_byobnet", _timm("test_byobnet"), 32, None),
    Case("test_nfnet", _timm("test_nfnet"), 32, None),
    Case("test_mambaout", _timm("test_mambaout"), 32, None),
    Case("test_vit_relpos", _timm("test_vit_relpos", 32), 32, None),
    Case("mobilevit_xxs", _timm("mobilevit_xxs"), 64, None),
    Case("ghostnet_050", _timm("ghostnet_050"), 32, None),
    Case("edgenext_xx_small", _timm("edgenext_xx_small"), 64, None),
    Case("efficientvit_b0", _timm("efficientvit_b0"), 64, None),
    Case("xcit_nano_12_p16", _timm("xcit_nano_12_p16_224", 32, depth=2), 32, None),
    Case("starnet_s050", _timm("starnet_s050"), 32, None),
    Case("repghostnet_050", _timm("repghostnet_050"), 32, None),
    Case("ese_vovnet19b_slim_dw", _timm("ese_vovnet19b_slim_dw"), 32, None),
    Case("hgnetv2_b0", _timm("hgnetv2_b0"), 32, None),
    Case("inception_next_atto", _timm("inception_next_atto"), 32, None),
    Case("cs3darknet_focus_s", _timm("cs3darknet_focus_s"), 32, None),
    Case("pit_ti", _timm("pit_ti_224", 64), 64, None),
    Case("convit_tiny", _timm("convit_tiny", 32, depth=2), 32, None),
    Case("coat_lite_tiny", _timm("coat_lite_tiny", 32), 32, None),
    Case("tiny_vit_5m", _timm("tiny_vit_5m_224", 64), 64, None, slow=True),
    Case("fastvit_t8", _timm("fastvit_t8"), 64, None, slow=True),
    Case("mobileone_s0", _timm("mobileone_s0"), 32, None, slow=True),
    Case("efficientvit_m0", _timm("efficientvit_m0", 64), 64, None, slow=True),
]


def _params(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


@pytest.fixture(autouse=True)
def _global_level_off():
    vision_ckpt.set_training_level(0)
    yield
    vision_ckpt.set_training_level(0)


@pytest.mark.parametrize("case", _params(FAMILIES))
def test_family_preset(case: Case, core_calls: list[Any]) -> None:
    check_case(case, core_calls)


@pytest.mark.parametrize("case", _params(ZOO))
def test_zoo(case: Case, core_calls: list[Any]) -> None:
    check_case(case, core_calls)


# Presets for other libraries (Hugging Face, smp, MONAI, torchvision segmentation) have their
# family models in their own test files, which check their prefix the same way.
OTHER_LIBRARIES = ("hf_", "smp_", "monai_", "tvseg_")


def test_every_preset_has_a_family_model() -> None:
    timm_and_tv = {p for p in list_presets() if not p.startswith(OTHER_LIBRARIES)}
    assert {c.preset for c in FAMILIES} == timm_and_tv


def test_zoo_is_30_timm_architectures() -> None:
    available = set(timm.list_models())
    names = {getattr(c.make, "arch", None) for c in FAMILIES + ZOO}
    timm_names = {n for n in names if n in available}
    assert len(timm_names) >= 30, sorted(timm_names)
    assert {c.preset for c in ZOO} >= {None}, "the zoo must exercise the fallback"


def test_plan_marks_fallback_modules() -> None:
    model = _timm("test_byobnet")()
    p = plan(model, CheckpointConfig(training_checkpoint_level=3, preset="auto"))
    assert len(p) > 0 and {e.origin for e in p} == {"fallback"}
