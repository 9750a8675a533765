"""Hugging Face transformers: the ``hf_*`` presets and ``vision_ckpt.integrations.hf``.

- Every ``hf_*`` preset on tiny models of every class its ``family:`` header names, through
  ``check_case`` (exact outputs, gradients and statistics at levels 0-5 with dropout and
  drop-path on; saved bytes falling and recomputation rising with the level; state_dict keys
  unchanged).
- The helper: the plan it returns, state dict and ``save_pretrained`` unchanged, clear errors,
  and how it meets Hugging Face's own checkpointing (NOTE [ Hugging Face's own checkpointing ]
  in vision_ckpt/integrations/hf.py).
- A real ``Trainer`` run (``max_steps=2`` on CPU) with vision_ckpt's checkpointing applied.

Skipped as a whole when transformers is not installed.
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from _family_check import Case, check_case, first_tensor  # noqa: E402
from torch import nn  # noqa: E402

import vision_ckpt  # noqa: E402
from vision_ckpt import ConfigError  # noqa: E402
from vision_ckpt.config.matching import ModuleMatcher, qualified_class_name  # noqa: E402
from vision_ckpt.config.presets import list_presets, load_preset, preset_family  # noqa: E402
from vision_ckpt.integrations.hf import (  # noqa: E402
    disable_checkpointing,
    enable_checkpointing,
    hf_checkpointing_on,
)

T = transformers
_DROP = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}


def _vit_config(**kw: Any) -> Any:
    base = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        encoder_stride=8,
        num_labels=5,
        **_DROP,
    )
    return T.ViTConfig(**{**base, **kw})


def _dinov2_config(**kw: Any) -> Any:
    base = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        mlp_ratio=2,
        image_size=32,
        patch_size=8,
        drop_path_rate=0.1,
        num_labels=5,
        **_DROP,
    )
    return T.Dinov2Config(**{**base, **kw})


def _swin_config() -> Any:
    return T.SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 2],
        num_heads=[1, 2],
        window_size=2,
        drop_path_rate=0.1,
        encoder_stride=8,
        num_labels=5,
        **_DROP,
    )


def _convnext_config() -> Any:
    return T.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 2], num_stages=2, drop_path_rate=0.1, num_labels=5
    )


def _segformer_config() -> Any:
    return T.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 2],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        decoder_hidden_size=16,
        drop_path_rate=0.1,
        classifier_dropout_prob=0.1,
        num_labels=3,
        **_DROP,
    )


_TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    attention_dropout=0.1,
)
_TEXT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


def _clip_vision_config() -> Any:
    return T.CLIPVisionConfig(projection_dim=16, **_TOWER)


def _clip_config() -> Any:
    return T.CLIPConfig(text_config=_TEXT, vision_config=_TOWER, num_labels=5)


def _siglip_config() -> Any:
    return T.SiglipConfig(text_config=_TEXT, vision_config=_TOWER, num_labels=5)


def _hf(cls_name: str, config: Callable[[], Any]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        return getattr(T, cls_name)(config())

    make.cls_name = cls_name  # type: ignore[attr-defined]
    return make


# Every class named in an hf_* preset's family header, as a tiny model.
FAMILIES = [
    Case("hf_vit:ViTModel", _hf("ViTModel", _vit_config), 32, "hf_vit"),
    Case(
        "hf_vit:ViTForImageClassification",
        _hf("ViTForImageClassification", lambda: _vit_config(num_hidden_layers=3)),
        32,
        "hf_vit",
    ),
    Case(
        "hf_vit:ViTForMaskedImageModeling",
        _hf("ViTForMaskedImageModeling", _vit_config),
        32,
        "hf_vit",
    ),
    Case("hf_dinov2:Dinov2Model", _hf("Dinov2Model", _dinov2_config), 32, "hf_dinov2"),
    Case(
        "hf_dinov2:Dinov2ForImageClassification_swiglu",
        _hf(
            "Dinov2ForImageClassification",
            lambda: _dinov2_config(use_swiglu_ffn=True, num_hidden_layers=3),  # groups at 4
        ),
        32,
        "hf_dinov2",
    ),
    Case("hf_swin:SwinModel", _hf("SwinModel", _swin_config), 32, "hf_swin"),
    Case(
        "hf_swin:SwinForImageClassification",
        _hf("SwinForImageClassification", _swin_config),
        32,
        "hf_swin",
    ),
    Case(
        "hf_swin:SwinForMaskedImageModeling",
        _hf("SwinForMaskedImageModeling", _swin_config),
        32,
        "hf_swin",
    ),
    Case("hf_convnext:ConvNextModel", _hf("ConvNextModel", _convnext_config), 32, "hf_convnext"),
    Case(
        "hf_convnext:ConvNextForImageClassification",
        _hf("ConvNextForImageClassification", _convnext_config),
        32,
        "hf_convnext",
    ),
    Case(
        "hf_segformer:SegformerModel", _hf("SegformerModel", _segformer_config), 32, "hf_segformer"
    ),
    Case(
        "hf_segformer:SegformerForSemanticSegmentation",
        _hf("SegformerForSemanticSegmentation", _segformer_config),
        32,
        "hf_segformer",
    ),
    Case(
        "hf_segformer:SegformerForImageClassification",
        _hf("SegformerForImageClassification", _segformer_config),
        32,
        "hf_segformer",
    ),
    Case(
        "hf_clip_vision:CLIPVisionModel",
        _hf("CLIPVisionModel", _clip_vision_config),
        32,
        "hf_clip_vision",
    ),
    Case(
        "hf_clip_vision:CLIPVisionModelWithProjection",
        _hf(  # three layers: level 4 groups two of them
            "CLIPVisionModelWithProjection",
            lambda: T.CLIPVisionConfig(projection_dim=16, **{**_TOWER, "num_hidden_layers": 3}),
        ),
        32,
        "hf_clip_vision",
    ),
    Case(
        "hf_clip_vision:CLIPForImageClassification",
        _hf("CLIPForImageClassification", _clip_config),
        32,
        "hf_clip_vision",
    ),
    Case(
        "hf_siglip_vision:SiglipVisionModel",
        _hf(
            "SiglipVisionModel", lambda: T.SiglipVisionConfig(**{**_TOWER, "num_hidden_layers": 3})
        ),
        32,
        "hf_siglip_vision",
    ),
    Case(
        "hf_siglip_vision:SiglipForImageClassification",
        _hf("SiglipForImageClassification", _siglip_config),
        32,
        "hf_siglip_vision",
    ),
]
HF_PRESETS = list_presets("hf_*")
_CASE = {c.id: c for c in FAMILIES}


@pytest.fixture(autouse=True)
def _quiet_hf():
    # transformers warns about deprecated aliases (gradient_checkpointing_enable) and the like.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


# --- the presets ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", FAMILIES, ids=[c.id for c in FAMILIES])
def test_family_preset(case: Case, core_calls: list[Any]) -> None:
    check_case(case, core_calls)


def test_every_hf_preset_has_family_models() -> None:
    assert HF_PRESETS, "no hf_* preset found"
    assert {c.preset for c in FAMILIES} == set(HF_PRESETS)


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_every_named_class_is_checked(preset: str) -> None:
    family = preset_family(preset)
    assert family.written_for.get("transformers"), "hf_* presets say the transformers version"
    made = {qualified_class_name(c.make()) for c in FAMILIES if c.preset == preset}
    assert set(family.classes) == made


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_every_rule_selects_callable_modules(preset: str) -> None:
    models = [c.make() for c in FAMILIES if c.preset == preset]
    for i, rule in enumerate(load_preset(preset).rules):
        matcher = ModuleMatcher(rule.match, rule.match_type)
        hits = [
            (model, name)
            for model in models
            for name, module in model.named_modules()
            if matcher.matches(name, type(module).__name__, qualified_class_name(module))
        ]
        assert hits, f"preset {preset} rules[{i}] ({rule}) selects nothing"
        for model, name in hits:  # a ModuleList, which nobody calls, only to group its layers
            module = model.get_submodule(name)
            runs = rule.segments is not None and isinstance(module, nn.ModuleList)
            assert runs or type(module).forward is not nn.Module.forward, name


@pytest.mark.parametrize("case", FAMILIES, ids=[c.id for c in FAMILIES])
def test_levels_one_and_two_save_something(case: Case) -> None:
    """Each family has layers of level-1 and level-2 size, and those levels keep less than no
    checkpointing (the structural fallback's level 1 kept as much on HF ViT and ConvNeXt)."""
    from vision_ckpt.measure._memory import count_saved_bytes

    torch.manual_seed(0)
    model = case.make().train()
    x = torch.randn(2, 3, case.size, case.size)
    saved = []
    for level in (0, 1, 2):
        vision_ckpt.apply_preset(model, level)
        with count_saved_bytes() as counted:
            first_tensor(model(x)).sum().backward()
        saved.append(counted.nbytes)
    assert saved[1] < saved[0] and saved[2] < saved[0], saved


def test_vit_level_five_nests_the_attention_and_lowers_the_peak(
    exact_step: Callable[..., dict[str, Any]],
    core_calls: list[Any],
    assert_exact: Callable[..., None],
) -> None:
    """hf_vit's level 5 adds each layer's attention as a region inside the layer's
    recomputation: gradients stay bit-exact with dropout on, and the step's peak falls below
    level 4's (the forward saves the same; the recomputed layers' MLP backward no longer holds
    the attention's tensors)."""
    from vision_ckpt.measure._memory import track_peak_memory

    torch.manual_seed(0)
    plain = T.ViTForImageClassification(
        _vit_config(num_hidden_layers=4, hidden_size=64, intermediate_size=128, image_size=64)
    ).train()
    x = torch.randn(4, 3, 64, 64)
    expected = exact_step(plain, x)
    peaks, calls = {}, {}
    for level in (4, 5):
        model = copy.deepcopy(plain)
        vision_ckpt.apply_preset(model, level)
        del core_calls[:], core_calls.labels[:]
        with track_peak_memory(model, x) as mem:
            got = exact_step(model, x)
        assert_exact(got, expected)  # same dropout masks, same gradients, rtol=atol=0
        peaks[level] = mem.activation_bytes
        calls[level] = sorted({str(name) for name in core_calls.labels if "attention" in str(name)})
    assert calls == {4: [], 5: [f"vit.layers.{i}.attention" for i in range(4)]}, calls
    assert peaks[5] < 0.9 * peaks[4], peaks


def test_dinov2_level_five_nests_the_attention_half_and_lowers_the_peak(
    exact_step: Callable[..., dict[str, Any]],
    core_calls: list[Any],
    assert_exact: Callable[..., None],
) -> None:
    """hf_dinov2's level 5 adds norm1 through attention as a run inside each recomputed layer:
    bit-exact with dropout and drop-path on, and a lower step peak than level 4."""
    from vision_ckpt.measure._memory import track_peak_memory

    config = T.Dinov2Config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        mlp_ratio=2,
        image_size=64,
        patch_size=8,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        drop_path_rate=0.1,
    )
    torch.manual_seed(0)
    plain = T.Dinov2ForImageClassification(config).train()
    x = torch.randn(4, 3, 64, 64)
    expected = exact_step(plain, x)
    peaks, runs = {}, {}
    for level in (4, 5):
        model = copy.deepcopy(plain)
        plan = vision_ckpt.apply_preset(model, level)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the run is taken whole, never cut short
            with track_peak_memory(model, x) as mem:
                got = exact_step(model, x)
        assert_exact(got, expected)
        peaks[level] = mem.activation_bytes
        runs[level] = sorted(e.name for e in plan.entries if e.name.endswith(".norm1"))
    assert runs[5] == [f"dinov2.encoder.layer.{i}.norm1" for i in range(4)], runs
    assert peaks[5] < 0.9 * peaks[4], peaks


# --- the helper ----------------------------------------------------------------------------


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return T.ViTForImageClassification(_vit_config()).train()


def test_enable_returns_the_plan_and_keeps_the_state_dict(
    exact_step: Callable[..., dict[str, Any]], tmp_path: Path, core_calls: list[Any]
) -> None:
    model = _vit()
    keys = list(model.state_dict())
    plan = enable_checkpointing(model)
    assert plan.pinned_training_level == 3  # the default: every layer, as HF's own switch
    assert plan.checkpointed == ("vit.layers.0", "vit.layers.1")
    assert all(e.origin.startswith("preset hf_vit #") for e in plan)
    assert list(model.state_dict()) == keys
    exact_step(model, torch.randn(2, 3, 32, 32))
    assert len(core_calls) == 2

    model.save_pretrained(tmp_path)
    loaded = T.ViTForImageClassification.from_pretrained(tmp_path)
    assert list(loaded.state_dict()) == keys
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)

    again = enable_checkpointing(model, level=1)  # replaces the first
    assert again.checkpointed == plan.checkpointed  # the layers, selective
    assert disable_checkpointing(model) == len(again) == 6  # layers, MLPs, attentions installed
    assert disable_checkpointing(model) == 0


def test_enable_with_a_config_and_options() -> None:
    model = _vit()
    plan = enable_checkpointing(model, config={"training_checkpoint_level": 2, "preset": "auto"})
    assert plan.checkpointed == ("vit.layers.0.mlp", "vit.layers.1.mlp")
    plan = enable_checkpointing(model, 3, nesting="all")
    assert plan.nesting == "all" and plan.pinned_training_level == 3
    plan = enable_checkpointing(model, config={"rules": [{"match": "vit.layers.0", "level": 3}]})
    assert plan.pinned_training_level is None  # follows vision_ckpt.set_training_level
    with vision_ckpt.training_level(3):
        assert len(plan.at_level(3).checkpointed) == 1


def test_helper_errors() -> None:
    model = _vit()
    with pytest.raises(ConfigError, match="got level=3 and a config; give one"):
        enable_checkpointing(model, 3, config={"preset": "auto"})
    with pytest.raises(ConfigError, match=r"a config and the options \['nesting'\]"):
        enable_checkpointing(model, config={"preset": "auto"}, nesting="all")
    with pytest.raises(ConfigError, match="got level=2 and memory_budget='1GiB'; give one"):
        enable_checkpointing(model, 2, memory_budget="1GiB")
    with pytest.raises(ConfigError, match="and a config with training_checkpoint_level 3; give"):
        enable_checkpointing(model, config={"training_checkpoint_level": 3}, memory_budget=9)
    with pytest.raises(ConfigError, match="needs example_input=<a batch of pixel_values>"):
        enable_checkpointing(model, memory_budget="1GiB")
    with pytest.raises(vision_ckpt.LevelError):
        enable_checkpointing(model, 7)
    assert vision_ckpt.remove(model) == 0  # nothing was applied by the failed calls


def test_memory_budget_chooses_a_level() -> None:
    model = _vit()
    x = torch.randn(2, 3, 32, 32)
    plan = enable_checkpointing(model, memory_budget="1GiB", example_input=x)
    assert plan.pinned_training_level == 0  # everything fits: no checkpointing
    with pytest.raises(ConfigError, match="memory_budget 1024: no level fits"):
        enable_checkpointing(model, memory_budget=1024, example_input=x)
    cfg = {"preset": "auto", "training_checkpoint_level": "auto", "memory_budget": "1GiB"}
    assert enable_checkpointing(model, config=cfg, example_input=x).pinned_training_level == 0


def test_refuses_hf_checkpointing_and_guards_against_it(
    exact_step: Callable[..., dict[str, Any]], core_calls: list[Any]
) -> None:
    model = _vit()
    model.gradient_checkpointing_enable()
    assert hf_checkpointing_on(model)
    with pytest.raises(ConfigError, match="has Hugging Face's own activation checkpointing on"):
        enable_checkpointing(model)
    model.gradient_checkpointing_disable()

    enable_checkpointing(model, level=3)
    for switch in (model.gradient_checkpointing_enable, model.activation_checkpointing_enable):
        with pytest.raises(ConfigError, match="vision_ckpt already checkpoints"):
            switch()
    assert not model.is_activation_checkpointing and not hf_checkpointing_on(model)

    # Copies keep the guard and the checkpointing; nothing refers back to the original.
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with pytest.raises(ConfigError, match="vision_ckpt already checkpoints"):
            other.gradient_checkpointing_enable()
        del core_calls[:]
        exact_step(other, torch.randn(2, 3, 32, 32))
        assert len(core_calls) == 2

    disable_checkpointing(model)
    model.gradient_checkpointing_enable()  # Hugging Face's own switch works again
    assert model.is_activation_checkpointing
    model.gradient_checkpointing_disable()


@pytest.mark.parametrize(
    "make", [_vit, _CASE["hf_swin:SwinForImageClassification"].make], ids=["vit", "swin"]
)
def test_apply_refuses_a_model_that_checkpoints_itself(make: Callable[[], nn.Module]) -> None:
    """With Hugging Face's switch also on, a region of ours outside and inside one of their
    checkpoints would be recomputed in one of torch's runs of the layer and not in the other
    (torch raises CheckpointError at backward from level 3): apply refuses, naming the fix."""
    model = make().train()
    model.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match=r"checkpoints itself: gradient_checkpointing is on in"):
        vision_ckpt.apply_preset(model, 3)
    assert vision_ckpt.remove(model) == 0  # nothing was installed
    model.gradient_checkpointing_disable()
    vision_ckpt.apply_preset(model, 3)


# --- Hugging Face's every_n_layers and offload --------------------------------------------


def _vit4() -> nn.Module:
    torch.manual_seed(0)
    return T.ViTForImageClassification(_vit_config(num_hidden_layers=4)).train()


def _hf_checkpointed(model: nn.Module) -> tuple[str, ...]:
    """The layers Hugging Face's own switch checkpoints: its ``GradientCheckpointingLayer``
    modules whose ``gradient_checkpointing`` flag it set."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return tuple(
        name
        for name, module in model.named_modules()
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing
    )


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_n_layers_checkpoints_hugging_faces_layers(
    exact_step: Callable[..., dict[str, Any]],
    n: int,
    core_calls: list[Any],
    assert_exact: Callable[..., None],
) -> None:
    plain = _vit4()
    x = torch.randn(2, 3, 32, 32)
    expected = exact_step(plain, x)

    theirs = copy.deepcopy(plain)
    theirs.activation_checkpointing_enable(every_n_layers=n)
    marked = _hf_checkpointed(theirs)
    assert marked == tuple(f"vit.layers.{i}" for i in range(0, 4, n))  # from layer 0, every n

    ours = copy.deepcopy(plain)
    plan = enable_checkpointing(ours, every_n_layers=n)
    assert plan.checkpointed == marked and plan.pinned_training_level == 3
    del core_calls[:]
    assert_exact(exact_step(ours, x), expected)  # dropout on: same masks, same gradients
    assert len(core_calls) == len(marked)  # one region per chosen layer, nothing inside others
    assert_exact(exact_step(theirs, x), expected)
    if n == 1:
        assert plan == enable_checkpointing(copy.deepcopy(plain), level=3)


def test_every_n_layers_keeps_between_none_and_every_layer(saved_bytes: Any) -> None:
    x = torch.randn(2, 3, 32, 32)
    kept = {}
    for what, kwargs in {
        "none": {"level": 0},
        "every 2nd": {"every_n_layers": 2},
        "every": {"level": 3},
    }.items():
        model = _vit4()
        enable_checkpointing(model, **kwargs)
        with saved_bytes() as counter:
            loss = first_tensor(model(x)).square().mean()
        loss.backward()
        kept[what] = counter.nbytes
    assert kept["every"] < kept["every 2nd"] < kept["none"], kept
    # Two of four layers keep everything: about half-way between the two.
    middle = (kept["none"] + kept["every"]) / 2
    assert abs(kept["every 2nd"] - middle) < 0.1 * (kept["none"] - kept["every"]), kept


def test_offload_on_cpu_is_a_reported_no_op(
    exact_step: Callable[..., dict[str, Any]],
    core_calls: list[Any],
    assert_exact: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vision_ckpt.integrations.hf as hf_helper

    monkeypatch.setattr(hf_helper, "_offload_warned", False)
    plain = _vit4()
    x = torch.randn(2, 3, 32, 32)
    expected = exact_step(plain, x)
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match=r"offload=True\): the model is on cpu, where offload"):
        plan = enable_checkpointing(model, offload=True)
    layers = tuple(f"vit.layers.{i}" for i in range(4))
    assert plan.device == "cpu" and plan.checkpointed == layers
    assert tuple(e.name for e in plan.offloaded) == layers
    assert plan.not_compiled == tuple(f"{name} (offload)" for name in layers)
    assert "pinned host memory on CUDA only: on cpu this does nothing" in str(plan)
    del core_calls[:]
    assert_exact(exact_step(model, x), expected)
    assert len(core_calls) == 4

    with warnings.catch_warnings(record=True) as caught:  # warned once
        warnings.simplefilter("always")
        plan = enable_checkpointing(copy.deepcopy(plain), every_n_layers=3, offload=True)
    assert not [w for w in caught if "offload" in str(w.message)]
    assert tuple(e.name for e in plan.offloaded) == ("vit.layers.0", "vit.layers.3")


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "2"])
def test_every_n_layers_must_be_an_int_from_one(bad: Any) -> None:
    model = _vit4()
    with pytest.raises(ConfigError, match=rf"every_n_layers={bad!r}: expected an int >= 1"):
        enable_checkpointing(model, every_n_layers=bad)
    assert vision_ckpt.remove(model) == 0


def test_every_n_layers_and_offload_errors() -> None:
    model = _vit4()
    with pytest.raises(ConfigError, match="offload='yes': expected True or False"):
        enable_checkpointing(model, offload="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="every_n_layers=2 with level=2, where it checkpoints "):
        enable_checkpointing(model, level=2, every_n_layers=2)
    with pytest.raises(ConfigError, match="offload=True with level=4, where it checkpoints groups"):
        enable_checkpointing(model, level="large_module", offload=True)
    with pytest.raises(ConfigError, match="every_n_layers=1 with level=0, where nothing is"):
        enable_checkpointing(model, level=0, every_n_layers=1)
    with pytest.raises(ConfigError, match="got every_n_layers=2, offload=True and a config"):
        enable_checkpointing(model, config={"preset": "auto"}, every_n_layers=2, offload=True)
    with pytest.raises(ConfigError, match="got every_n_layers=2 and memory_budget='1GiB'"):
        enable_checkpointing(model, every_n_layers=2, memory_budget="1GiB")
    with pytest.raises(ConfigError, match="Sequential has no repeated layers that its preset"):
        enable_checkpointing(nn.Sequential(nn.Linear(2, 2)), preset=None, every_n_layers=2)
    assert vision_ckpt.remove(model) == 0  # the failed calls installed nothing
    assert enable_checkpointing(model, level=3, every_n_layers=4).checkpointed == ("vit.layers.0",)


def test_import_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, vision_ckpt, vision_ckpt.integrations, vision_ckpt.integrations.hf; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- Trainer -------------------------------------------------------------------------------


class _Images(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 32, 32, generator=gen)
        self.y = torch.randint(0, 5, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def _trainer(model: nn.Module, out: Path, **args: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    targs = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **args,
    )
    return Trainer(model=model, args=targs, train_dataset=_Images())


def test_trainer_runs_with_our_checkpointing(tmp_path: Path, core_calls: list[Any]) -> None:
    model = _vit()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    enable_checkpointing(model, level=3)
    result = _trainer(model, tmp_path).train()
    assert math.isfinite(result.training_loss)
    assert len(core_calls) == 2 * 2  # two layers, two steps
    assert not model.is_activation_checkpointing
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_trainer_with_hf_checkpointing_too_fails_before_a_step(
    tmp_path: Path, core_calls: list[Any]
) -> None:
    model = _vit()
    enable_checkpointing(model, level=3)
    trainer = _trainer(model, tmp_path, gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="TrainingArguments\\(gradient_checkpointing=False"):
        trainer.train()
    assert core_calls == []
