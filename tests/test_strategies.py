"""Strategies per module (full, selective, segments), the ``auto`` nesting mode, and the presets
that use them: exact gradients at every level, memory that the cheap levels really save, and the
errors and warnings a user meets."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import timm
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import vision_ckpt
from vision_ckpt import CheckpointConfig, ConfigError
from vision_ckpt.measure._memory import track_peak_memory

# Tiny configs of the six families the frontier benchmark measures, with drop-path on.
FAMILIES = {
    "resnet50": ({}, 32),
    "convnext_tiny": ({"depths": (1, 1, 2, 1), "dims": (8, 16, 24, 32), "drop_path_rate": 0.1}, 32),
    "vit_tiny_patch16_224": (
        {"img_size": 32, "patch_size": 8, "depth": 5, "drop_path_rate": 0.1, "proj_drop_rate": 0.1},
        32,
    ),
    "swin_tiny_patch4_window7_224": (
        {
            "img_size": 56,
            "depths": (2, 2, 2, 2),
            "embed_dim": 24,
            "num_heads": (1, 2, 3, 4),
            "drop_path_rate": 0.1,
        },
        56,
    ),
    "efficientnet_b0": ({"drop_path_rate": 0.1}, 32),
    "densenet121": ({}, 32),
}


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    kwargs, size = FAMILIES[name]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5, **kwargs).train()
    return model, torch.randn(2, 3, size, size)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_presets_are_exact_at_every_level_with_the_new_strategies(
    name: str, assert_exact, exact_step
) -> None:
    model, x = _model(name)
    reference = exact_step(copy.deepcopy(model), x)
    for level in range(1, 6):
        applied = copy.deepcopy(model)
        vision_ckpt.apply_preset(applied, level)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no selective region may run without keeping
            got = exact_step(applied, x)
        assert_exact(got, reference, f"{name} at level {level}")  # BatchNorm statistics too


def _kept_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes alive at the end of the forward above what was alive before it."""
    with track_peak_memory(model, x) as mem:
        out = model(x)
        kept = mem.end_bytes - mem.start_bytes
        out.sum().backward()
    return kept


@pytest.mark.parametrize(
    ("name", "size", "most"),
    [("resnet50", 64, 0.8), ("convnext_tiny", 64, 0.8), ("efficientnet_b0", 64, 0.8)],
)
def test_selective_levels_keep_less_than_no_checkpointing(name: str, size: int, most: float):
    """Level 1 keeps far less than level 0, and level 2 (whole blocks in the high-resolution
    stages, the rest selective) less again."""
    torch.manual_seed(0)
    kwargs = {k: v for k, v in FAMILIES[name][0].items() if k != "drop_path_rate"}
    model = timm.create_model(name, pretrained=False, num_classes=5, **kwargs).train()
    x = torch.randn(2, 3, size, size)
    kept = {}
    for level in (0, 1, 2):
        vision_ckpt.apply_preset(model, level)
        kept[level] = _kept_bytes(model, x)
    vision_ckpt.remove(model)
    assert kept[1] < most * kept[0], kept
    assert kept[2] < kept[1], kept


def test_stage_selective_frees_what_block_selective_cannot():
    """Selective over single ResNet blocks keeps each block's output (its checkpoint input, as
    wide as the block's widest tensor); over a stage it redoes them too."""
    torch.manual_seed(0)
    model = timm.create_model("resnet50", pretrained=False, num_classes=5).train()
    x = torch.randn(2, 3, 64, 64)
    keep = {"training_checkpoint_level": 1, "strict": True}
    per_block = {**keep, "rules": [{"match": "layer*.*", "level": 1, "keep": "heavy"}]}
    per_stage = {**keep, "rules": [{"match": "layer*", "level": 1, "keep": "heavy"}]}
    vision_ckpt.apply(model, per_block)
    block_kept = _kept_bytes(model, x)
    vision_ckpt.apply(model, per_stage)
    stage_kept = _kept_bytes(model, x)
    vision_ckpt.remove(model)
    assert stage_kept < 0.85 * block_kept, (stage_kept, block_kept)


def test_a_selective_rung_steps_aside_where_a_full_region_inside_it_starts(scratch_preset):
    model, _ = _model("resnet50")
    stages_and_blocks = [
        {"match": "layer*", "level": 1, "keep": "heavy"},
        {"match": "layer*.*", "level": 3},
    ]
    cfg = CheckpointConfig(preset=scratch_preset(stages_and_blocks))
    at1 = vision_ckpt.plan(model, cfg).at_level(1)
    assert at1["layer1"].checkpointed and at1["layer1"].rung_at(1).selective
    assert not at1["layer1.0"].checkpointed
    at3 = at1.at_level(3)
    assert not at3["layer2"].checkpointed and at3["layer2"].rung_at(3) is None
    assert at3["layer2.0"].checkpointed and not at3["layer2.0"].rung_at(3).selective
    assert "keep heavy 1-2" in str(at3)


def test_a_selective_rung_steps_aside_where_a_region_inside_it_keeps_less(scratch_preset):
    model, _ = _model("resnet50")
    fewer = {"ops": "heavy", "below": 600}
    rules = [
        {"match": "layer*", "level": 1, "keep": "heavy"},
        {"match": "layer1.*", "level": 2, "keep": fewer},  # keeps less: layer1 steps aside
        {"match": "layer2.*", "level": 2, "keep": "heavy"},  # keeps the same: layer2 stays
    ]
    at2 = vision_ckpt.plan(model, CheckpointConfig(preset=scratch_preset(rules))).at_level(2)
    assert not at2["layer1"].checkpointed and at2["layer1"].rung_at(2) is None
    assert str(at2["layer1.0"].rung_at(2).keep) == "heavy<600"
    assert at2["layer2"].checkpointed and at2["layer2"].rung_at(2).selective
    assert "keep heavy 1 only" in str(at2)


def test_plan_counts_the_regions_the_forward_checkpoints(
    core_calls, monkeypatch, scratch_preset
) -> None:
    runs = []  # regions made of sibling calls (level 5's attention halves) open a ChainRegion
    real_run = vision_ckpt.runtime._chain.ChainRegion

    def counting_run(*args, **kwargs):
        runs.append(kwargs.get("label"))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(vision_ckpt.runtime._chain, "ChainRegion", counting_run)
    model, x = _model("vit_tiny_patch16_224")
    depth = len(model.blocks)
    preset = scratch_preset("vit_like")  # groups from level 4 (the `segments` below)
    for nesting in ("auto", "all", "outermost"):
        for level in range(6):
            cfg = CheckpointConfig(training_checkpoint_level=level, preset=preset, nesting=nesting)
            plan = vision_ckpt.apply(model, cfg)
            del core_calls[:], runs[:]
            out = model(x)  # forward only: the calls recomputation makes come later
            calls = len(core_calls) + len(runs)
            out.sum().backward()
            regions = len(plan.checkpointed)
            if level >= 4:  # the stack counts once in the plan, once per segment in the run
                segments = math.ceil(depth / round(math.sqrt(depth)))
                regions += segments - 1
            assert calls == regions, (nesting, level, calls, str(plan))
    vision_ckpt.remove(model)


def test_segments_checkpoint_groups_of_sqrt_depth_layers(core_calls, scratch_preset) -> None:
    model, x = _model("vit_tiny_patch16_224")  # depth 5: groups of 2, 2, 1
    vision_ckpt.apply_preset(model, 4, preset=scratch_preset("vit_like"))
    model(x).sum().backward()
    labels = [label or "" for label in core_calls.labels]
    assert [x for x in labels if x.startswith("blocks[")] == [
        "blocks[0:2]",
        "blocks[2:4]",
        "blocks[4:6]",
    ]
    # Each layer is a region in the forward and again inside its segment's recomputation: a
    # segment is a group, so its layers stay checkpointed while it is recomputed.
    assert sum(x.startswith("blocks.") for x in labels) == 2 * len(model.blocks)
    plain, _ = _model("vit_tiny_patch16_224")
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert model.state_dict().keys() == plain.state_dict().keys()


def test_segments_need_a_plain_sequential() -> None:
    model, _ = _model("vit_tiny_patch16_224")
    with pytest.raises(ConfigError, match=r"gives segments to 'blocks.0', a Block; segments split"):
        vision_ckpt.plan(
            model,
            {
                "training_checkpoint_level": 4,
                "rules": [{"match": "blocks.0", "level": 4, "segments": 2}],
            },
        )


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            {"match": "a", "level": 4, "segments": "auto", "keep": "heavy"},
            r"keeps heavy in a region spanned by segments; a run of calls or a group of layers "
            r"is recomputed whole: drop keep",
        ),
        (
            {"match": "a", "level": 4, "segments": 2, "through": "b"},
            r"gives both through and segments; a region spans one module, a run",
        ),
        (
            {"match": "a", "level": 1, "keep": "partial"},
            r"keep 'partial' is not a keep policy; allowed: 'nothing'",
        ),
        (
            {"match": "a", "level": 1, "keep": {"ops": []}},
            r"keep\.ops: an empty list keeps nothing; write keep: nothing",
        ),
        (
            {"match": "a", "level": 1, "keep": {"below": 0}},
            r"keep\.below: Input should be greater than or equal to 1",
        ),
        (
            {"match": "a", "level": 1, "strategy": "selective"},
            r"unknown key 'strategy'.*'strategy: selective' is now 'keep: heavy'",
        ),
        (
            {"match": "a", "level": 1, "recompute_below": 64},
            r"unknown key 'recompute_below'.*'keep: \{ops: heavy, below: N\}'",
        ),
        ({"match": "a", "level": 4, "segments": 0}, r"segments"),
    ],
)
def test_region_options_are_validated(rule: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(rules=[rule])


def test_an_operator_no_region_runs_is_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
    model.append(nn.Linear(4 * 36, 2)).train()
    cfg = {
        "training_checkpoint_level": 3,
        "rules": [
            {
                "match": str(i),
                "level": 3,
                "keep": {"ops": ["aten.mkldnn_convolution", "aten.addmm"]},
            }
            for i in range(5)
        ],
    }
    vision_ckpt.apply(model, cfg)
    with pytest.warns(
        UserWarning,
        match=r"never ran aten.mkldnn_convolution in their forward, so nothing was kept for "
        r"them .*Operators they ran: .*aten.convolution",
    ) as record:
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert len(record) == 1  # addmm ran (in the Linear): only the unmet name, and only once
    model(torch.randn(2, 3, 8, 8)).sum().backward()  # not again
    vision_ckpt.remove(model)


def test_the_default_heavy_set_warns_only_when_none_of_it_runs() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    vision_ckpt.apply(
        model,
        {
            "training_checkpoint_level": 1,
            "rules": [{"match": "0", "level": 1, "keep": "heavy"}],
        },
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the conv ran: no warning for the unmet matmuls
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    norm_only = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).train()
    vision_ckpt.apply(
        norm_only,
        {
            "training_checkpoint_level": 1,
            "rules": [{"match": "1", "level": 1, "keep": "heavy"}],
        },
    )
    with pytest.warns(UserWarning, match=r"ran none of the operators aten.convolution, aten.mm"):
        norm_only(torch.randn(2, 4)).sum().backward()


def test_a_kept_output_written_in_place_stays_exact(assert_exact, exact_step) -> None:
    """Linear then ReLU(inplace=True) (SwinV2's position-bias MLP): the kept Linear output is
    copied before the ReLU writes into it (NOTE [ Kept outputs written in place ])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)).train()
    x = torch.randn(3, 8)
    reference = exact_step(model, x)
    vision_ckpt.apply(
        model,
        {
            "training_checkpoint_level": 1,
            "rules": [{"match_type": "Sequential", "level": 1, "keep": "heavy"}],
        },
    )
    assert_exact(exact_step(model, x), reference)


def test_recompute_below_redoes_cheap_convolutions_only() -> None:
    from vision_ckpt.runtime._selective import flops_per_output

    conv = torch.ops.aten.convolution.default
    x = torch.empty(1, 64, 8, 8)
    pointwise = (x, torch.empty(256, 64, 1, 1), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    depthwise = (x, torch.empty(64, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 64)
    dense3x3 = (x, torch.empty(64, 64, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert flops_per_output(conv, pointwise) == 128
    assert flops_per_output(conv, depthwise) == 18
    assert flops_per_output(conv, dense3x3) == 1152
    assert flops_per_output(torch.ops.aten.relu.default, (x,)) is None


class _SeededThenRandom(nn.Module):
    """A seeded operator (native_dropout) followed by dropout and drop-path (bernoulli_), all in
    one region: if the first one's output were kept, recomputation would not advance the
    generator and the later masks would differ from the forward's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = torch.native_dropout(self.fc1(x), 0.3, True)
        h = nn.functional.dropout(nn.functional.gelu(h), 0.2, training=True)
        keep = x.new_empty(x.shape[0], 1).bernoulli_(0.7) / 0.7  # drop-path
        return x + self.fc2(h) * keep


def test_a_seeded_operator_named_in_keep_is_recomputed(assert_exact, exact_step) -> None:
    """NOTE [ Random operators are recomputed ]: keep names aten.native_dropout, yet its
    output is not kept, so the recomputation draws what the forward drew and the gradients equal
    the plain model's exactly (keeping it would shift the dropout and drop-path masks after it)."""
    torch.manual_seed(0)
    model = nn.Sequential(_SeededThenRandom(), _SeededThenRandom()).train()
    x = torch.randn(6, 8)
    reference = exact_step(model, x)
    vision_ckpt.apply(
        model,
        {
            "training_checkpoint_level": 1,
            "rules": [
                {"match": "*", "level": 1, "keep": {"ops": ["aten.native_dropout", "aten.addmm"]}}
            ],
        },
    )
    assert_exact(exact_step(model, x), reference)
    from vision_ckpt.runtime._selective import SaveOps

    keep = SaveOps(["aten.native_dropout", "aten.addmm"])
    op = torch.ops.aten.native_dropout.default
    assert not keep.keeps(op, (x, 0.3, True))
    sdpa = torch.ops.aten._scaled_dot_product_efficient_attention.default
    fused = SaveOps(["aten._scaled_dot_product_efficient_attention"])
    assert not fused.keeps(sdpa, (x, x, x, None, True, 0.1))  # dropout_p > 0: it draws
    assert fused.keeps(sdpa, (x, x, x, None, True, 0.0))  # no dropout: kept as before


def test_a_kept_output_written_in_place_under_fake_tensors() -> None:
    """The write guard tells storages apart by identity, not data pointer: under FakeTensorMode
    (how CUDA dispatch is checked without a GPU) there is no data to point at."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)).train()
        vision_ckpt.apply(
            model,
            {
                "training_checkpoint_level": 1,
                "rules": [{"match_type": "Sequential", "level": 1, "keep": "heavy"}],
            },
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(torch.randn(3, 8)).square().sum().backward()
        assert model[0].weight.grad.shape == (16, 8)


def test_offload_is_a_full_region_that_does_nothing_on_cpu_and_says_so(
    assert_exact, exact_step
) -> None:
    """offload: true (NOTE [ Offloaded inputs ]): on CPU the region keeps its inputs as a
    full one does (the gradients are the plain model's), and the plan says that offload does
    nothing here and is not applied under torch.compile."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 4)).train()
    model = copy.deepcopy(plain)
    plan = vision_ckpt.apply(
        model,
        {
            "training_checkpoint_level": 2,
            "rules": [{"match": "0", "level": 2, "offload": True}],
        },
    )
    entry = plan["0"]
    assert entry.checkpointed and entry.rungs[0].offload and not entry.rungs[0].selective
    assert str(entry.rungs[0]) == "offload 2"
    assert plan.offloaded == (entry,) and plan.not_compiled == ("0 (offload)",)
    assert "on CUDA only: on cpu this does nothing" in str(plan)
    assert plan.at_level(1).offloaded == ()
    x = torch.randn(5, 8)
    assert_exact(exact_step(model, x), exact_step(plain, x))


def test_offload_takes_no_segments_or_through() -> None:
    with pytest.raises(ValueError, match="offloads and gives segments=2; an offloaded region"):
        CheckpointConfig.model_validate(
            {"rules": [{"match": "a", "level": 4, "offload": True, "segments": 2}]}
        )
    with pytest.raises(ValueError, match="offloads and gives through=b; an offloaded region is"):
        CheckpointConfig.model_validate(
            {"rules": [{"match": "a", "level": 1, "offload": True, "through": "b"}]}
        )


class _WritesIntoKeptOutputs(nn.Module):
    """Three kept products, written into in place at different times: one before the third
    exists, the other two after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc1(x), self.fc2(x)
        a = a.relu_()
        c = self.fc3(x).relu_()
        b = b.relu_()
        return self.fc4(a + b + c)


class _Clones(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func.overloadpacket is torch.ops.aten.clone
        return func(*args, **(kwargs or {}))


def test_each_kept_output_written_in_place_is_copied_once(assert_exact, exact_step) -> None:
    """NOTE [ Kept outputs written in place ]: a kept output written after later ones were
    kept is still found, each written one is copied once, and the gradients stay exact."""
    torch.manual_seed(0)
    model = nn.Sequential(_WritesIntoKeptOutputs()).train()
    x = torch.randn(3, 8)
    reference = exact_step(model, x)
    rule = {"match": "0", "level": 1, "keep": "heavy"}
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [rule]})
    with _Clones() as clones:
        model(x)
    assert clones.count == 3
    assert_exact(exact_step(model, x), reference)
