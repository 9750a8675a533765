"""plan / apply / remove on the test models and timm models: exactness, memory, model surgery."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import timm
import torch
import yaml
from _models import LEVEL_RULES, make
from torch import nn

from vision_ckpt import (
    CheckpointConfig,
    CheckpointPlan,
    ConfigError,
    Level,
    LevelError,
    apply,
    apply_preset,
    plan,
    remove,
    set_training_level,
    training_level,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "configs" / "examples"

torch.set_num_threads(1)


# --- the five models and their level rules --------------------------------------------------


def _timm_vit() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=3,
        num_classes=10,
        drop_rate=0.1,
        proj_drop_rate=0.1,
        attn_drop_rate=0.1,
        drop_path_rate=0.2,
    ).train()


def _timm_resnet() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "resnet18", pretrained=False, num_classes=10, drop_rate=0.1, drop_path_rate=0.2
    ).train()


def _example_rules(name: str) -> list[dict]:
    return yaml.safe_load((EXAMPLES / name).read_text())["rules"]


CASES = {
    "vit": (lambda: make("vit"), LEVEL_RULES["vit"], (2, 3, 16, 16)),
    "swin": (lambda: make("swin"), LEVEL_RULES["swin"], (2, 3, 16, 16)),
    "densenet": (lambda: make("densenet"), LEVEL_RULES["densenet"], (2, 3, 8, 8)),
    "timm_vit_tiny": (
        _timm_vit,
        _example_rules("vit_small.yaml") + [{"match": "norm", "level": 1}],
        (2, 3, 32, 32),
    ),
    "timm_resnet18": (
        _timm_resnet,
        [
            {"match": "layer?.*.bn1", "level": 1},
            {"match": "layer?.*.downsample", "level": 2},
            *_example_rules("resnet.yaml"),
            {"match_type": "ResNet", "level": 5},
        ],
        (2, 3, 32, 32),
    ),
}


def _learned(result: dict) -> dict:
    """A step's result without the buffers: output, input gradient and parameter gradients."""
    return {k: v for k, v in result.items() if k != "buffers"}


_REFERENCE: dict[str, tuple] = {}


def _reference(case: str, step):
    if case not in _REFERENCE:
        build, _, shape = CASES[case]
        torch.manual_seed(99)
        x = torch.randn(shape)
        _REFERENCE[case] = (x, step(build(), x))
    return _REFERENCE[case]


@pytest.mark.parametrize("nesting", ["all", "outermost"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_level_is_exact_and_saves_memory(
    case, nesting, assert_exact, saved_bytes, exact_step
):
    build, rules, _ = CASES[case]
    x, expected = _reference(case, exact_step)
    model = build()
    the_plan = apply(model, {"rules": rules, "nesting": nesting})
    levels = {int(e.level) for e in the_plan}
    assert levels >= ({1, 2, 3, 5} if case == "timm_vit_tiny" else {1, 2, 3, 4, 5})
    nbytes = []
    for level in range(6):
        set_training_level(level)  # no re-apply: the next forward follows the global level
        model.zero_grad(set_to_none=True)
        model.load_state_dict(build().state_dict())  # fresh weights and BatchNorm statistics
        with saved_bytes() as counter:
            got = exact_step(model, x)
        assert_exact(_learned(got), _learned(expected))
        assert_exact(got["buffers"], expected["buffers"])  # BatchNorm statistics updated once
        nbytes.append(counter.nbytes)
    assert all(a >= b for a, b in zip(nbytes, nbytes[1:], strict=False)), nbytes
    assert nbytes[-1] < nbytes[0], nbytes


@pytest.mark.parametrize("case", ["vit", "densenet"])
def test_eval_mode_and_level_zero_call_the_core_zero_times(case, core_calls, exact_step):
    build, rules, shape = CASES[case]
    model = build()
    apply(model, {"rules": rules})
    x = torch.randn(shape)
    with training_level(0):
        exact_step(model, x)
    with training_level(5):
        model.eval()
        model(x).sum().backward()
        model.train()
        with torch.no_grad():
            model(x)
    assert core_calls == []
    with training_level(5):
        model(x)
    assert core_calls


def test_level_change_after_apply_takes_effect_without_reapplying(core_calls):
    model = make("vit")
    x = torch.randn(2, 3, 16, 16)
    apply(model, {"rules": LEVEL_RULES["vit"], "nesting": "outermost"})
    counts = []
    for level in (0, 2, 3, 0, 1):
        core_calls.clear()
        with training_level(level):
            model(x)
        counts.append(len(core_calls))
    # level 2: 3 blocks x (norm1, attn, norm2, mlp); 1: 3 x (norm1, norm2); 3: the 3 blocks,
    # and since each holds four checkpointed modules, those stay checkpointed inside it even
    # with outermost (a block recomputed in one piece would hold all four: a higher peak than
    # level 2's), so 3 + 12.
    assert counts == [0, 12, 15, 0, 6]


def test_pinned_level_from_the_config(core_calls):
    model = make("vit")
    apply(
        model, {"training_checkpoint_level": 3, "rules": LEVEL_RULES["vit"], "nesting": "outermost"}
    )
    with training_level(0):
        model(torch.randn(2, 3, 16, 16))
    # The 3 blocks, each holding four checkpointed modules that stay checkpointed inside it
    # (see test_level_change_after_apply_takes_effect_without_reapplying).
    assert len(core_calls) == 3 + 12


# --- model surgery ------------------------------------------------------------------------


def _snapshot(model: nn.Module):
    return (
        [n for n, _ in model.named_modules()],
        list(model.state_dict().keys()),
        [(n, id(p)) for n, p in model.named_parameters()],
        {k: v.clone() for k, v in model.state_dict().items()},
    )


@pytest.mark.parametrize("case", ["swin", "timm_vit_tiny"])
def test_apply_and_remove_leave_the_model_as_it_was(case, assert_exact):
    build, rules, _ = CASES[case]
    model = build()
    before = _snapshot(model)
    apply(model, {"rules": rules})
    after = _snapshot(model)
    assert after[:3] == before[:3]
    assert_exact(after[3], before[3])
    assert remove(model) > 0
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert _snapshot(model)[:3] == before[:3]
    assert remove(model) == 0


def test_state_dict_moves_between_plain_and_applied_models(assert_exact):
    plain, applied = make("swin", seed=1), make("swin", seed=2)
    apply(applied, {"rules": LEVEL_RULES["swin"]})
    applied.load_state_dict(plain.state_dict())
    assert_exact(applied.state_dict(), plain.state_dict())
    other = make("swin", seed=3)
    other.load_state_dict(applied.state_dict())
    assert_exact(other.state_dict(), plain.state_dict())


def test_apply_twice_is_apply_once(core_calls):
    model = make("vit")
    first = apply(model, {"rules": LEVEL_RULES["vit"]})
    once = {n: m.__dict__.get("forward") is not None for n, m in model.named_modules()}
    second = apply(model, {"rules": LEVEL_RULES["vit"]})
    assert first == second
    twice = {n: m.__dict__.get("forward") is not None for n, m in model.named_modules()}
    assert once == twice
    with training_level(1):
        model(torch.randn(2, 3, 16, 16))
    assert len(core_calls) == 6  # each norm once, not wrapped twice
    # Re-applying another config replaces the previous plan entirely.
    apply(model, {"rules": [{"match": "head", "level": 1}]})
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == ["head"]


def test_an_instance_forward_that_was_there_is_kept_and_restored(assert_exact):
    model = make("vit")
    calls = []
    original_head = model.head.forward

    def patched(x):
        calls.append(1)
        return original_head(x)

    model.head.forward = patched
    apply(model, {"rules": [{"match": "head", "level": 1}]})
    with training_level(1):
        model(torch.randn(2, 3, 16, 16))
    assert calls == [1]
    remove(model)
    assert model.head.forward is patched


@pytest.mark.parametrize("case", ["vit", "densenet", "timm_resnet18"])
def test_deepcopy_and_pickle_of_an_applied_model(case, core_calls, assert_exact, exact_step):
    build, rules, shape = CASES[case]
    model = build()
    # The keep policy object must survive the copies too.
    if case == "vit":
        keep = {"ops": ["aten.mm", "aten.addmm"]}
        rules = [{**r, "keep": keep} if r["level"] in (2, 3) else r for r in rules]
    apply(model, {"rules": rules})
    x = torch.randn(shape)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        core_calls.clear()
        with training_level(3):
            got = exact_step(clone, x)
        assert core_calls, "the copy lost its checkpointing"
        assert all(
            m.__dict__["forward"].run.module is m
            for m in clone.modules()
            if "forward" in m.__dict__
        )
        with training_level(0):
            ref = exact_step(build(), x)
        assert_exact(_learned(got), _learned(ref))


# --- plan ---------------------------------------------------------------------------------


class _NoForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = make("vit")

    def forward(self, x):
        raise AssertionError("plan() must not run the model")


def test_plan_is_pure_and_comparable():
    model = _NoForward()
    before = _snapshot(model)
    rules = [
        {**r, "match": "body." + r["match"]} if "match" in r else r for r in LEVEL_RULES["vit"]
    ]
    cfg = CheckpointConfig(training_checkpoint_level=3, rules=rules)
    p1, p2 = plan(model, cfg), plan(model, cfg)
    assert p1 == p2 and isinstance(p1, CheckpointPlan)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert _snapshot(model)[:3] == before[:3]
    assert plan(model, cfg.model_copy(update={"nesting": "outermost"})) != p1
    assert p1.at_level(0).checkpointed == ()


def test_plan_entries_last_rule_wins_and_says_which():
    model = make("vit")
    p = plan(
        model,
        {
            "training_checkpoint_level": 2,
            "rules": [
                {"match": "blocks.*", "level": 3},
                {"match": "blocks.*.attn", "level": 2},
                {"match": "blocks.1", "level": 0},
                {"match_type": "Attention", "match": "blocks.2.*", "level": 4},
            ],
        },
    )
    assert p["blocks.0"].level == 3 and p["blocks.0"].origin == "rules[0]"
    assert p["blocks.1"].level == 0 and p["blocks.1"].rule == "match='blocks.1' level=0"
    assert p["blocks.0.attn"].checkpointed and not p["blocks.0"].checkpointed
    assert p["blocks.2.attn"].level == 4 and p["blocks.2.attn"].origin == "rules[3]"
    assert p["blocks.2.attn"].rule == "match='blocks.2.*' match_type='Attention' level=4"
    assert p.checkpointed == ("blocks.0.attn", "blocks.1.attn")
    assert p.levels["blocks.1.attn"] == Level.SMALL_BLOCK
    assert [e.name for e in p] == [
        "blocks.0",
        "blocks.0.attn",
        "blocks.1",
        "blocks.1.attn",
        "blocks.2",
        "blocks.2.attn",
    ]
    text = str(p)
    assert "Checkpoint plan for TinyViT: training level 2 (config), nesting auto" in text
    assert "blocks.2.attn" in text and "rules[3]" in text and "match='blocks.1' level=0" in text
    # A level-0 module is left untouched by apply.
    apply(model, p)
    assert "forward" not in model.blocks[1].__dict__ and "forward" in model.blocks[0].__dict__


def test_plan_outermost_marks_only_the_outermost_eligible():
    p = plan(
        make("swin"),
        {"training_checkpoint_level": 3, "rules": LEVEL_RULES["swin"], "nesting": "outermost"},
    )
    # A block holds two checkpointed modules (attn, mlp): recomputed in one piece it would hold
    # both at once, above level 2's peak, so they stay checkpointed inside it; the plan says so.
    assert p.checkpointed == (
        "stages.0.blocks.0",
        "stages.0.blocks.0.attn",
        "stages.0.blocks.0.mlp",
        "stages.0.blocks.1",
        "stages.0.blocks.1.attn",
        "stages.0.blocks.1.mlp",
        "stages.0.downsample",
        "stages.1.blocks.0",
        "stages.1.blocks.0.attn",
        "stages.1.blocks.0.mlp",
        "stages.1.blocks.1",
        "stages.1.blocks.1.attn",
        "stages.1.blocks.1.mlp",
        "stages.1.downsample",  # an nn.Identity here, selected by 'stages.*.downsample'
    )
    assert "8 checkpointed inside a checkpointed group or a module holding several" in str(p)


def test_plan_from_a_file_and_the_example_configs_fit_timm_models():
    p = plan(_timm_vit(), EXAMPLES / "vit_small.yaml")
    assert p.pinned_training_level == 3 and "blocks.0" in p.checkpointed
    r = plan(_timm_resnet(), str(EXAMPLES / "resnet.yaml"))
    assert r.checkpointed == tuple(f"layer{i}.{j}" for i in range(1, 5) for j in range(2))


def test_glob_semantics_on_a_real_model():
    model = _timm_vit()

    def names(pattern: str) -> list[str]:
        return [e.name for e in plan(model, {"rules": [{"match": pattern, "level": 1}]})]

    assert names("blocks.*") == ["blocks.0", "blocks.1", "blocks.2"]
    assert names("*.0.attn") == ["blocks.0.attn"]
    assert names("**.attn") == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert names("blocks.1.**")[:3] == ["blocks.1", "blocks.1.norm1", "blocks.1.attn"]
    assert names("blocks.?.mlp.fc*") == [f"blocks.{i}.mlp.fc{j}" for i in range(3) for j in (1, 2)]
    assert names(r"re:blocks\.[02]") == ["blocks.0", "blocks.2"]
    assert names("**")[0] == ""  # the root is the empty name, zero components
    by_type = plan(model, {"rules": [{"match_type": "timm.layers.mlp.Mlp", "level": 2}]})
    assert [e.name for e in by_type] == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]


# --- selective checkpointing --------------------------------------------------------------


def test_kept_operators_are_not_recomputed(op_counter, assert_exact, exact_step):
    x = torch.randn(2, 3, 16, 16)
    counts = {}
    for key, keep in (
        ("plain", "nothing"),
        ("selective", {"ops": ["aten.mm", "aten.bmm", "aten.addmm"]}),
    ):
        model = make("vit")
        apply(
            model,
            {
                "training_checkpoint_level": 3,
                "rules": [{"match": "blocks.*", "level": 3, "keep": keep}],
            },
        )
        with op_counter() as ops:
            got = exact_step(model, x)
        counts[key] = ops.counts
        with training_level(0):
            assert_exact(_learned(got), _learned(exact_step(make("vit"), x)))
    mm = lambda c: c["mm"] + c["bmm"] + c["addmm"]  # noqa: E731
    assert mm(counts["selective"]) < mm(counts["plain"])


def test_selective_with_batchnorm(assert_exact, exact_step):
    x = torch.randn(2, 3, 8, 8)
    model = make("densenet")
    keep = {"ops": ["aten.convolution"]}
    rules = [
        r if "segments" in r or "through" in r else {**r, "keep": keep}
        for r in LEVEL_RULES["densenet"]
    ]
    apply(model, {"rules": rules})
    with training_level(2):
        got = exact_step(model, x)
    with training_level(0):
        assert_exact(got, exact_step(make("densenet"), x))


def test_unknown_save_op_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"rules\[0\] \(match='blocks' level=4 keep=aten\.mm\+aten\.nope\): keep: unknown "
        r"operators \['aten\.nope'\]",
    ):
        plan(
            make("vit"),
            {"rules": [{"match": "blocks", "level": 4, "keep": {"ops": ["aten.mm", "aten.nope"]}}]},
        )


def test_unknown_save_op_in_a_preset_is_a_config_error_at_plan(scratch_preset):
    bad = scratch_preset([{"match": "blocks", "level": 4, "keep": {"ops": ["aten.nope"]}}])
    with pytest.raises(
        ConfigError,
        match=r"preset scratch #0 \(match='blocks' level=4 keep=aten\.nope\): keep: unknown "
        r"operators \['aten\.nope'\]",
    ):
        plan(make("vit"), {"preset": bad})


# --- errors -------------------------------------------------------------------------------


def test_rule_without_match_is_an_error_naming_the_rule_and_the_children():
    with pytest.raises(
        ConfigError,
        match=r"rules\[1\] \(match='stages\.\*' level=3\) selects no module of TinyViT; "
        r"top-level children: patch_embed \(Conv2d\), pos_drop \(Dropout\), blocks \(Sequential\)"
        r".*strict: false",
    ):
        plan(
            make("vit"),
            {"rules": [{"match": "blocks.*", "level": 3}, {"match": "stages.*", "level": 3}]},
        )


def test_rule_without_match_names_close_names_and_timm_architecture():
    with pytest.raises(
        ConfigError, match=r"of vit_tiny_patch16_224 \(VisionTransformer\).*Close names: blocks"
    ):
        plan(_timm_vit(), {"rules": [{"match": "block", "level": 3}]})
    with pytest.raises(
        ConfigError, match=r"match_type='MLP' level=2\) selects no module.*Close classes: Mlp"
    ):
        plan(_timm_vit(), {"rules": [{"match_type": "MLP", "level": 2}]})


def test_strict_false_warns_instead():
    with pytest.warns(
        UserWarning, match=r"rules\[0\] \(match='stages' level=4\) selects no module"
    ):
        p = plan(make("vit"), {"strict": False, "rules": [{"match": "stages", "level": 4}]})
    assert len(p) == 0


def test_container_without_forward_is_explained():
    with pytest.raises(
        ConfigError,
        match=r"selects only 'features\.1\.layers' \(ModuleList\), containers that are never "
        r"called.*'features\.1\.layers\.\*'",
    ):
        plan(make("densenet"), {"rules": [{"match": "features.1.layers", "level": 2}]})


def test_auto_level_is_refused_until_the_profiler_picks_it():
    cfg = {
        "training_checkpoint_level": "auto",
        "memory_budget": "1GiB",
        "rules": [{"match": "blocks.*", "level": 3}],
    }
    with pytest.raises(
        ConfigError,
        match=r"'auto' \(memory_budget '1GiB'\) cannot be applied directly"
        r".*vision_ckpt\.tune\.resolve_auto",
    ):
        apply(make("vit"), cfg)


def test_plan_for_another_model_is_refused():
    p = plan(make("vit"), {"rules": [{"match": "blocks.*", "level": 3}]})
    with pytest.raises(
        ConfigError,
        match=r"the plan does not fit this model: it has module 'blocks\.0' as a Block, "
        r"the model has not found",
    ):
        apply(make("swin"), p)


def test_bad_config_argument_types():
    with pytest.raises(ConfigError, match=r"config of type int is not a checkpoint config"):
        plan(make("vit"), 3)
    with pytest.raises(ConfigError, match=r"rules\[0\]\.level: value 9"):
        apply(make("vit"), {"rules": [{"match": "blocks", "level": 9}]})
    with pytest.raises(LevelError, match=r"training level 8 is not a checkpoint level"):
        apply_preset(make("vit"), 8)


def test_apply_preset_is_exact_at_every_level(assert_exact, exact_step):
    x, expected = _reference("timm_vit_tiny", exact_step)
    model = _timm_vit()
    checkpointed = []
    for level in range(6):
        p = apply_preset(model, level)
        assert p.pinned_training_level == level
        assert all(e.origin.startswith("preset ") for e in p)
        checkpointed.append(len(p.checkpointed))
        model.zero_grad(set_to_none=True)
        assert_exact(_learned(exact_step(model, x)), _learned(expected))
    assert checkpointed[0] == 0 and checkpointed[-1] > 0


def test_config_rules_override_the_preset_and_the_plan_says_so():
    p = plan(
        make("swin"),
        {
            "preset": "auto",
            "training_checkpoint_level": 3,
            "rules": [{"match": "stages.0", "level": 0}],
        },
    )
    assert p["stages.0"].level == 0 and p["stages.0"].origin == "rules[0]"
    others = [e for e in p if e.name != "stages.0"]
    assert others and all(e.origin != "rules[0]" for e in others)
    assert "rules[0]" in str(p)


def test_apply_preset_pins_the_level_and_a_null_level_follows_the_global_one(core_calls):
    model = _timm_vit()
    x = torch.randn(2, 3, 32, 32)
    apply_preset(model, 3)
    counts = []
    for level in (3, 0, 5):
        with training_level(level):
            core_calls.clear()
            model(x).sum().backward()
            counts.append(len(core_calls))
    assert counts[0] == counts[1] == counts[2] > 0  # pinned at 3 whatever the global level
    apply(model, {"preset": "auto"})
    counts = []
    for level in (3, 0, 5):
        with training_level(level):
            core_calls.clear()
            model(x).sum().backward()
            counts.append(len(core_calls))
    assert counts[1] == 0 < counts[0] < counts[2]


def test_an_applied_model_is_freed_without_the_cycle_collector():
    import gc
    import weakref

    gc.disable()
    try:
        model = _timm_vit()
        apply_preset(model, 3)
        alive = weakref.ref(model.blocks[0])
        del model
        assert alive() is None
    finally:
        gc.enable()


class _Unit(nn.Module):
    """Two layers, each a region of its own at level 1 when ``split``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU())
        self.b = nn.Sequential(nn.Linear(4 * width, width), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x))


class _Stage(nn.Module):
    """A stage of one unit, then a head outside it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stage = nn.Sequential(_Unit(width))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(x))


_STAGE_RULES = [{"match": "stage", "level": 4}, {"match": "stage.0", "level": 2}]


@pytest.mark.parametrize("nesting", ["auto", "outermost"])
def test_a_group_is_what_a_span_holds_not_its_level(nesting):
    # A level-4 stage holding one plain unit is no group: recomputing it whole holds what
    # nesting the unit would, so the unit runs inside it plainly. Once the unit holds two
    # regions of its own, the unit is a group, and so is the stage that holds it.
    model = _Stage()
    cfg = {"training_checkpoint_level": 4, "rules": _STAGE_RULES, "nesting": nesting}
    assert plan(model, cfg).checkpointed == ("stage",)
    split = [*_STAGE_RULES, {"match": "stage.0.*", "level": 1}]
    assert plan(model, {**cfg, "rules": split}).checkpointed == (
        "stage",
        "stage.0",
        "stage.0.a",
        "stage.0.b",
    )


def test_a_stage_recomputed_whole_peaks_where_nesting_its_one_unit_would(core_calls):
    from vision_ckpt.measure import step_memory

    model, x = _Stage(width=64), torch.randn(256, 64)
    peaks, calls = {}, {}
    for nesting in ("auto", "all"):
        apply(model, {"training_checkpoint_level": 4, "rules": _STAGE_RULES, "nesting": nesting})
        core_calls.clear()
        peaks[nesting] = step_memory(model, x, fake=False).peak
        calls[nesting] = len(core_calls)
        remove(model)
    assert peaks["auto"] == peaks["all"]
    assert calls["auto"] < calls["all"]


def test_a_rule_a_plan_and_the_installed_forward_share_one_region():
    from vision_ckpt.config import KeepOps, LevelRule, Region

    rule = LevelRule(match="stage.0", level=2, keep="heavy")
    assert rule.region == Region(keep=KeepOps())
    assert LevelRule(match="stage", level=2, lean=True).region is None
    p = plan(_Stage(), {"training_checkpoint_level": 2, "rules": [rule]})
    (entry,) = [e for e in p.entries if e.name == "stage.0"]
    assert [r.region for r in entry.rungs] == [rule.region]
    assert str(entry.rungs[0]) == "keep heavy 2"


def test_a_region_holding_one_segmented_stack_is_a_group():
    # The stack's segments are several regions, so recomputing the trunk in one piece would
    # hold every layer's activations: the segments stay checkpointed inside it.
    model = nn.Sequential()
    model.add_module("trunk", nn.Sequential(nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))))
    rules = [{"match": "trunk", "level": 5}, {"match": "trunk.0", "level": 4, "segments": 2}]
    for nesting in ("auto", "outermost"):
        cfg = {"training_checkpoint_level": 5, "rules": rules, "nesting": nesting}
        assert plan(model, cfg).checkpointed == ("trunk", "trunk.0")


class _Deep(nn.Module):
    """A stack of units with dropout between them, then ``tail`` units outside it."""

    def __init__(self, tail: int = 2, width: int = 64) -> None:
        super().__init__()
        self.stack = nn.Sequential(*(m for _ in range(4) for m in (_Unit(width), nn.Dropout(0.1))))
        self.tail = nn.Sequential(*(_Unit(width) for _ in range(tail)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.stack(x))


# the stack's units regions of their own, the stack one region from level 2, in segments from 3
_DEEP_RULES = [
    {"match": "stack.*", "match_type": "_Unit", "level": 1},
    {"match": "stack", "level": 2},
    {"match": "stack", "level": 3, "segments": 4},
]


@pytest.mark.parametrize("nesting", ["auto", "all", "outermost"])
def test_segments_of_a_stack_that_is_a_region_run_inside_it(nesting, core_calls):
    model, x = _Deep(), torch.randn(256, 64)
    cfg = {"training_checkpoint_level": 3, "rules": _DEEP_RULES, "nesting": nesting}
    (entry,) = [e for e in plan(model, cfg).entries if e.name == "stack"]
    assert [str(r) for r in entry.rungs] == ["full 2", "full in segments/4 3"]
    apply(model, cfg)
    core_calls.clear()
    model(x).sum().backward()
    labels = set(core_calls.labels)
    remove(model)
    # the stack's region, its segments inside it (groups: nested in every mode), their units
    assert {"stack", "stack[0:4]", "stack[4:8]", "stack.0", "stack.6"} <= labels


def test_a_stack_whose_segments_run_inside_it_holds_regions_at_their_level():
    # Under torch.compile such a region runs between graphs (NOTE [ Nested regions under
    # torch.compile ]) even when the stack's layers are no regions of their own.
    model = nn.Sequential()
    model.add_module("stack", nn.Sequential(*(nn.Linear(8, 8) for _ in range(4))))
    rules = [{"match": "stack", "level": 2}, {"match": "stack", "level": 3, "segments": 2}]
    (entry,) = plan(model, {"training_checkpoint_level": 3, "rules": rules}).entries
    assert entry.nests_full == frozenset({3, 4, 5})
    one_group = [rules[0], {"match": "stack", "level": 3, "segments": 4}]
    (entry,) = plan(model, {"training_checkpoint_level": 3, "rules": one_group}).entries
    assert [str(r) for r in entry.rungs] == ["full 2"] and not entry.nests_full
    finer = [*rules, {"match": "stack", "level": 4, "segments": 1}]  # still inside the region
    (entry,) = plan(model, {"training_checkpoint_level": 3, "rules": finer}).entries
    assert [str(r) for r in entry.rungs] == [
        "full 2",
        "full in segments/2 3",
        "full in segments/1 4",
    ]


@pytest.mark.parametrize(("tail", "worse"), [(0, "whole"), (2, "sibling")])
def test_segments_inside_a_stack_keep_less_than_the_stack_or_sibling_segments(
    tail, worse, assert_exact, exact_step
):
    from vision_ckpt.measure import step_memory

    torch.manual_seed(0)
    model, x = _Deep(tail), torch.randn(2048, 64)  # activations well above the gradients
    reference = exact_step(copy.deepcopy(model), x)
    sibling = [_DEEP_RULES[0], _DEEP_RULES[2]]  # no region of the whole stack: segments alone
    peaks = {}
    for name, level, rules in (
        ("whole", 2, _DEEP_RULES),
        ("inside", 3, _DEEP_RULES),
        ("sibling", 3, sibling),
    ):
        applied = copy.deepcopy(model)
        apply(applied, {"training_checkpoint_level": level, "rules": rules})
        assert_exact(exact_step(applied, x), reference, name)  # dropout replayed, bit for bit
        peaks[name] = step_memory(applied, x, fake=False).peak
    # Inside the stack's region its recomputation holds one segment's unit inputs at a time
    # (the peak without a tail); while a tail runs backward only the stack's input is kept,
    # not each segment's (the peak with one).
    assert peaks["inside"] < peaks[worse], peaks
    assert peaks["inside"] == min(peaks.values()), peaks
