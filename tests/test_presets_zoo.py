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

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import timm
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import vision_ckpt
from vision_ckpt._memory import count_saved_bytes
from vision_ckpt.apply import apply, plan, remove
from vision_ckpt.config import CheckpointConfig
from vision_ckpt.presets import list_presets, preset_for_model

LEVELS = range(6)


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[], nn.Module]
    size: int
    preset: str | None
    """The preset the model must resolve to; ``None``: it takes the fallback."""
    slow: bool = False


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


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models: with several threads on a shared machine, synchronisation dominates
    # (a 50 ms step takes seconds).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _global_level_off():
    vision_ckpt.set_training_level(0)
    yield
    vision_ckpt.set_training_level(0)


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """One training step from a fixed seed: output, gradients, buffers, saved bytes, FLOPs."""
    torch.manual_seed(1234)
    with count_saved_bytes() as saved:
        out = model(x)
    if isinstance(out, (tuple, list)):
        out = out[0]
    loss = out.float().square().mean()
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "saved": saved.nbytes,
        "flops": flops.get_total_flops(),
    }


def _assert_same(got: dict[str, Any], ref: dict[str, Any], level: int) -> None:
    where = f"level {level}"
    torch.testing.assert_close(got["out"], ref["out"], rtol=0, atol=0, msg=f"{where}: output")
    assert got["grads"].keys() == ref["grads"].keys(), f"{where}: gradients of other parameters"
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(
            got["grads"][name], grad, rtol=0, atol=0, msg=lambda m, n=name: f"{where}: {n}: {m}"
        )
    for name, buf in ref["buffers"].items():
        torch.testing.assert_close(
            got["buffers"][name], buf, rtol=0, atol=0, msg=lambda m, n=name: f"{where}: {n}: {m}"
        )


def _check_case(case: Case, core_calls: list[Any]) -> None:
    torch.manual_seed(0)
    base = case.make().train()
    assert preset_for_model(base) == case.preset
    x = torch.randn(2, 3, case.size, case.size)
    ref = _step(copy.deepcopy(base), x)
    keys = list(base.state_dict())

    saved, flops, counts, selective = [], [], [], []
    for level in LEVELS:
        model = copy.deepcopy(base)
        applied = apply(model, CheckpointConfig(training_checkpoint_level=level, preset="auto"))
        if case.preset is None:
            assert {e.origin for e in applied} == {"fallback"}
        else:
            assert all(e.origin.startswith(f"preset {case.preset} #") for e in applied)
        assert list(model.state_dict()) == keys
        selective.append(
            any(e.rung_at(level).strategy == "selective" for e in applied if e.checkpointed)
        )
        del core_calls[:]
        got = _step(model, x)
        counts.append(len(core_calls))
        _assert_same(got, ref, level)
        saved.append(got["saved"])
        flops.append(got["flops"])
        if level == max(LEVELS):
            model.eval()
            del core_calls[:]
            with torch.no_grad():
                model(x)
            model(x)
            assert core_calls == [], "eval mode must not checkpoint"
            assert remove(model) > 0
    assert counts[0] == 0, "training level 0 must not checkpoint"
    assert counts[-1] > 0
    # Within each kind of level (selective ones; level 0 and the full ones) a higher level keeps
    # no more and recomputes no less. Across kinds the order is the model's: a stage-wide
    # selective level can keep less than per-block full checkpoints (their inputs) on a tiny
    # config, for far less recomputation. Every level keeps at most level 0's bytes, and the top
    # level keeps the least and recomputes the most.
    for kind in (True, False):
        levels = [lv for lv in LEVELS if selective[lv] == kind]
        kept = [saved[lv] for lv in levels]
        work = [flops[lv] for lv in levels]
        assert all(a >= b for a, b in zip(kept, kept[1:], strict=False)), (
            f"saved bytes by level: {saved} (selective: {selective})"
        )
        # 1%: with nesting auto a level-3 region recomputes its body once, which can be a hair
        # less than what the level-2 regions inside it redid (0.02% on efficientvit_b0).
        assert all(a <= b * 1.01 for a, b in zip(work, work[1:], strict=False)), (
            f"backward FLOPs by level: {flops} (selective: {selective})"
        )
    assert all(s <= saved[0] for s in saved), f"saved bytes by level: {saved}"
    assert saved[-1] < saved[0] and saved[-1] == min(saved), f"saved bytes by level: {saved}"
    assert all(f >= flops[0] for f in flops), f"backward FLOPs by level: {flops}"
    assert flops[-1] > flops[0] and flops[-1] == max(flops), f"backward FLOPs by level: {flops}"


@pytest.mark.parametrize("case", _params(FAMILIES))
def test_family_preset(case: Case, core_calls: list[Any]) -> None:
    _check_case(case, core_calls)


@pytest.mark.parametrize("case", _params(ZOO))
def test_zoo(case: Case, core_calls: list[Any]) -> None:
    _check_case(case, core_calls)


def test_every_preset_has_a_family_model() -> None:
    assert {c.preset for c in FAMILIES} == set(list_presets())


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
