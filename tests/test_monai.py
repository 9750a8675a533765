"""MONAI's 3D networks: the ``monai_*`` presets and ``examples/train_3d.py``.

- Every ``monai_*`` preset on tiny 3D models of its family (SwinUNETR, UNETR, UNet, BasicUNet,
  DynUNet, SegResNet and variants) through ``check_case``: exact outputs, gradients and norm
  statistics at levels 0-5 with dropout and drop-path on; saved bytes falling and
  recomputation rising with the level; state_dict keys unchanged.
- What the presets promise beyond that: levels 1 and 2 save memory, the CNN decoder is
  checkpointed (MONAI's own ``use_checkpoint`` never reaches it), the plan names the rules.
- The training example runs with its tiny config, and a checkpointed run has the losses of
  the plain one.

Models are tiny (feature sizes 4-16, volumes of 16-32 voxels a side) so that the file runs in
well under a minute on one core; SwinUNETR, whose 32^3 full-resolution convolutions dominate,
is the heaviest case. Skipped as a whole when MONAI is not installed.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

monai = pytest.importorskip("monai")

import torch  # noqa: E402
from _family_check import Case, assert_same, check_case, step  # noqa: E402
from monai.networks import nets  # noqa: E402
from torch import nn  # noqa: E402

import vision_ckpt  # noqa: E402
from vision_ckpt.config import CheckpointConfig  # noqa: E402
from vision_ckpt.config.matching import ModuleMatcher, qualified_class_name  # noqa: E402
from vision_ckpt.config.presets import list_presets, load_preset, preset_family  # noqa: E402
from vision_ckpt.measure._memory import count_saved_bytes  # noqa: E402
from vision_ckpt.regions.apply import apply, plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY_3D = ROOT / "configs" / "train" / "3d" / "swinunetr_tiny.yaml"


def _volume(batch: int, *spatial: int) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        return torch.randn(batch, 1, *spatial, generator=torch.Generator().manual_seed(7))

    return make


def _swinunetr(**kw: Any) -> Callable[[], nn.Module]:
    # 32^3 is the smallest volume SwinUNETR takes (five halvings). BatchNorm, not the default
    # InstanceNorm: the deepest decoder input is 1x1x1, where InstanceNorm cannot train; batch
    # 2 makes it legal and exercises running statistics under recomputation.
    def make() -> nn.Module:
        base: dict[str, Any] = dict(
            in_channels=1,
            out_channels=2,
            feature_size=12,
            depths=(1, 1, 1, 1),
            num_heads=(1, 1, 2, 2),
            window_size=4,
            norm_name="batch",
            drop_rate=0.1,
            attn_drop_rate=0.1,
            dropout_path_rate=0.1,
            spatial_dims=3,
        )
        return nets.SwinUNETR(**{**base, **kw})

    return make


def _unetr(**kw: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        base: dict[str, Any] = dict(
            in_channels=1,
            out_channels=2,
            img_size=16,
            feature_size=4,
            hidden_size=24,
            mlp_dim=48,
            num_heads=2,
            dropout_rate=0.1,
            spatial_dims=3,
        )
        return nets.UNETR(**{**base, **kw})

    return make


def _unet(**kw: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        base: dict[str, Any] = dict(
            spatial_dims=3,
            in_channels=1,
            out_channels=2,
            channels=(4, 8, 16),
            strides=(2, 2),
            num_res_units=2,
            dropout=0.1,
        )
        return nets.UNet(**{**base, **kw})

    return make


def _basicunet() -> nn.Module:
    return nets.BasicUNet(
        spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4), dropout=0.1
    )


def _dynunet(**kw: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        base: dict[str, Any] = dict(
            spatial_dims=3,
            in_channels=1,
            out_channels=2,
            kernel_size=[3, 3, 3, 3],
            strides=[1, 2, 2, 2],
            upsample_kernel_size=[2, 2, 2],
            filters=[4, 8, 16, 32],
            dropout=0.1,
        )
        return nets.DynUNet(**{**base, **kw})

    return make


_SEGRESNET = dict(
    spatial_dims=3,
    in_channels=1,
    out_channels=2,
    init_filters=4,
    blocks_down=(1, 2, 2),
    blocks_up=(1, 1),
    dropout_prob=0.1,
    norm=("group", {"num_groups": 2}),
)


def _segresnet() -> nn.Module:
    return nets.SegResNet(**_SEGRESNET)


def _segresnet_vae() -> nn.Module:
    return nets.SegResNetVAE(input_image_size=(16, 16, 16), vae_nz=8, **_SEGRESNET)


# One or more tiny models of every monai_* preset family.
FAMILIES = [
    Case("swinunetr", _swinunetr(), 32, "monai_swinunetr", make_input=_volume(2, 32, 32, 32)),
    Case(
        "swinunetr_v2",
        _swinunetr(use_v2=True, downsample="mergingv2"),
        32,
        "monai_swinunetr",
        slow=True,
        make_input=_volume(2, 32, 32, 32),
    ),
    Case("unetr", _unetr(), 16, "monai_unetr", make_input=_volume(2, 16, 16, 16)),
    Case(
        "unetr_basic_blocks",
        _unetr(res_block=False),
        16,
        "monai_unetr",
        slow=True,
        make_input=_volume(2, 16, 16, 16),
    ),
    Case("unet", _unet(), 16, "monai_unet", make_input=_volume(2, 16, 16, 16)),
    Case(
        "unet_no_res_units",
        _unet(num_res_units=0),
        16,
        "monai_unet",
        make_input=_volume(2, 16, 16, 16),
    ),
    # Four halvings: 16x16x32 leaves 1x1x2 at the bottom, enough for InstanceNorm.
    Case("basicunet", _basicunet, 16, "monai_basicunet", make_input=_volume(2, 16, 16, 32)),
    Case(
        "dynunet", _dynunet(res_block=True), 16, "monai_dynunet", make_input=_volume(2, 16, 16, 16)
    ),
    Case(
        "dynunet_deep_supervision",
        _dynunet(res_block=False, deep_supervision=True, deep_supr_num=1),
        16,
        "monai_dynunet",
        make_input=_volume(2, 16, 16, 16),
    ),
    Case("segresnet", _segresnet, 16, "monai_segresnet", make_input=_volume(2, 16, 16, 16)),
    Case("segresnet_vae", _segresnet_vae, 16, "monai_segresnet", make_input=_volume(2, 16, 16, 16)),
]


def _params(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


def _case(case_id: str) -> Case:
    return next(c for c in FAMILIES if c.id == case_id)


@pytest.mark.parametrize("case", _params(FAMILIES))
def test_family_preset(case: Case, core_calls: list[Any]) -> None:
    check_case(case, core_calls)


def test_every_monai_preset_has_a_family_case() -> None:
    monai_presets = {p for p in list_presets() if p.startswith("monai_")}
    assert monai_presets == {c.preset for c in FAMILIES}
    # ... and every class a preset's family header names is built by some case.
    built = {qualified_class_name(c.make()) for c in FAMILIES if not c.slow}
    for name in monai_presets:
        for cls in preset_family(name).classes:
            assert cls in built, f"{name}: no case builds {cls}"
        assert "monai" in preset_family(name).written_for, name


@pytest.mark.parametrize("preset", sorted({c.preset for c in FAMILIES}))
def test_every_rule_selects_modules_in_its_family(preset: str) -> None:
    """No rule of a monai_* preset is dead at the MONAI version it was written for: each selects
    callable modules in at least one of the family's cases (variants included)."""
    models = [c.make() for c in FAMILIES if c.preset == preset]
    for i, rule in enumerate(load_preset(preset).rules):
        matcher = ModuleMatcher(rule.match, rule.match_type)
        hits = [
            module
            for model in models
            for name, module in model.named_modules()
            if matcher.matches(name, type(module).__name__, qualified_class_name(module))
        ]
        assert hits, f"preset {preset} rules[{i}] ({rule}) selects nothing"
        assert all(type(m).forward is not nn.Module.forward for m in hits), (preset, i)


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    with count_saved_bytes() as saved:
        model(x)
    return saved.nbytes


@pytest.mark.parametrize(
    "case_id", ["swinunetr", "unetr", "unet", "basicunet", "dynunet", "segresnet"]
)
def test_levels_1_and_2_save_memory(case_id: str) -> None:
    case = _case(case_id)
    torch.manual_seed(0)
    base = case.make().train()
    x = case.make_input()
    saved = []
    for level in (0, 1, 2):
        model = copy.deepcopy(base)
        apply(model, CheckpointConfig(training_checkpoint_level=level, preset="auto"))
        saved.append(_saved_bytes(model, x))
    assert saved[1] < saved[0] and saved[2] < saved[1], saved


def test_swinunetr_decoder_is_checkpointed_unlike_monais_switch() -> None:
    """MONAI's use_checkpoint covers the Swin blocks only; from level 2 every CNN block of the
    encoder and decoder is a region, and level 1 already keeps less than MONAI's switch."""
    p = plan(_swinunetr()(), CheckpointConfig(training_checkpoint_level=3, preset="auto"))
    assert {f"decoder{i}" for i in range(1, 6)} <= set(p.checkpointed)
    cnn = [e for e in p if e.class_name == "UnetResBlock"]
    assert len(cnn) == 10
    assert all(
        [(r.level, r.what) for r in e.rungs] == [(1, "keep heavy<256"), (2, "full")] for e in cnn
    )

    torch.manual_seed(0)
    x = _volume(2, 32, 32, 32)()
    own = _swinunetr(use_checkpoint=True)().train()
    ours = _swinunetr()().train()
    apply(ours, CheckpointConfig(training_checkpoint_level=1, preset="auto"))
    assert _saved_bytes(ours, x) < _saved_bytes(own, x)


def test_swinunetr_with_its_own_switch_on_stays_exact(core_calls: list[Any]) -> None:
    """MONAI's use_checkpoint (torch.utils.checkpoint around each Swin block half) nested with
    our regions inside and outside it: slower for nothing, but exact (docs/medical.md)."""
    make = _swinunetr(use_checkpoint=True)
    x = _volume(2, 32, 32, 32)()
    torch.manual_seed(0)
    base = make().train()
    ref = step(copy.deepcopy(base), x)
    model = copy.deepcopy(base)
    apply(model, CheckpointConfig(training_checkpoint_level=3, preset="auto"))
    got = step(model, x)
    assert len(core_calls) > 0
    assert_same(got, ref, 3)


def test_plan_names_the_preset_rules() -> None:
    p = plan(_unet()(), {"training_checkpoint_level": 5, "preset": "auto"})
    assert p["model.1"].origin.startswith("preset monai_unet #")
    assert p["model"].class_name == "Sequential" and p["model"].level == 5
    # the lone conv at the top is never checkpointed
    assert p["model.2.1.conv.unit0"].level == 0 and not p["model.2.1.conv.unit0"].rungs


# --------------------------------------------------------------------------------------------
# examples/train_3d.py
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_3d():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_3d
    finally:
        sys.path.remove(str(EXAMPLES))
    return train_3d


def test_train_3d_checkpointed_run_has_the_losses_of_the_plain_run(train_3d) -> None:
    """The tiny config has dropout and drop-path on, and MONAI's own switch as a last row."""
    rows = train_3d.main(["--config", str(TINY_3D), "--levels", "0,5", "--steps", "2"])
    plain, top, own = rows
    assert (plain.level, top.level, own.level) == (0, 5, None)
    assert plain.losses == top.losses == own.losses
    assert all(math.isfinite(v) for v in plain.losses)
    assert top.saved_bytes < own.saved_bytes < plain.saved_bytes
    assert top.saved_bytes < plain.saved_bytes / 4  # level 5 is level 3: the Swin blocks
    assert top.peak_bytes < own.peak_bytes < plain.peak_bytes


def test_train_3d_config_errors_name_the_key(train_3d) -> None:
    with pytest.raises(vision_ckpt.ConfigError, match="image_size"):
        train_3d.load_config({"image_size": 0})
    with pytest.raises(vision_ckpt.ConfigError, match="model"):
        train_3d.load_config({"model": "NoSuchNet"})
