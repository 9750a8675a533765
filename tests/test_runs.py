"""Runs of sibling modules checkpointed as one region (a rule's ``through``): a stem whose conv,
norm, activation and pool are called one by one from the parent's forward."""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref
from typing import Any

import pytest
import timm
import torch
import torch.nn.functional as F
from _models import UpTransition
from torch import nn

import vision_ckpt
from vision_ckpt import CheckpointError, ConfigError
from vision_ckpt.measure._memory import track_peak_memory

STEM = {"match": "conv", "level": 1, "through": "pool"}


class StemNet(nn.Module):
    """ResNet's shape: the parent calls its stem's layers one by one, then a body."""

    def __init__(self, between: str | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.3)
        self.pool = nn.MaxPool2d(2)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = self.bn(x)
        if self.between == "scale":
            x = x * 2  # work between two members: the run must end before it
        elif self.between == "keep":
            self.kept = x  # the output stays alive, but act gets another tensor
            x = x + 1
        elif self.between == "inplace":
            x.mul_(2)
        elif self.between == "no_grad":
            with torch.no_grad():  # a side computation on the very output (a metric, say)
                self.act(x)
        elif self.between == "rng":
            torch.rand(1)  # randomness drawn between two members, outside the run
        x = self.act(x)
        x = self.drop(x)
        x = self.pool(x)
        return self.head(self.body(x).mean((2, 3)))


@pytest.mark.parametrize("between", [None, "rng"])
@pytest.mark.parametrize("level", [0, 1, 3])
def test_run_is_exact_with_dropout_and_batchnorm(
    assert_exact, exact_step, level: int, between
) -> None:
    torch.manual_seed(0)
    plain = StemNet(between)
    model = copy.deepcopy(plain)
    vision_ckpt.apply(model, {"training_checkpoint_level": level, "rules": [STEM]})
    x = torch.randn(4, 3, 16, 16, requires_grad=True)
    ref = exact_step(plain, x)
    got = exact_step(model, x)
    assert_exact(got, ref)


def test_run_keeps_only_its_input_and_recomputes_each_member(saved_bytes, op_counter) -> None:
    model = StemNet()
    x = torch.randn(4, 3, 16, 16)
    with saved_bytes() as plain:
        model(x)
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [STEM]})
    with saved_bytes() as ran:
        model(x)
    # conv output, BN output (the ReLU's, in place), dropout mask and output, pool indices:
    # five (4, 8, 16, 16)-sized tensors or so no longer kept; the input is the run's
    assert plain.nbytes - ran.nbytes >= 4 * 4 * 8 * 16 * 16

    # backward recomputes the stem: its conv and pool run once more, the body's conv does not
    out = model(x).sum()
    with op_counter() as ops:
        out.backward()
    assert ops.counts["convolution"] == 1 and ops.counts["max_pool2d_with_indices"] == 1


@pytest.mark.parametrize(
    ("between", "reason"),
    [
        ("scale", "was called after the previous output was freed"),
        ("keep", "was called with something other than its output"),
        ("inplace", "modified in place"),
        ("no_grad", "was called where grad mode is off"),
    ],
)
def test_work_between_members_ends_the_run_exactly_with_a_warning(
    assert_exact, exact_step, between, reason
) -> None:
    torch.manual_seed(0)
    plain = StemNet(between)
    model = copy.deepcopy(plain)
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [STEM]})
    x = torch.randn(2, 3, 8, 8)
    ref = exact_step(plain, x)
    with pytest.warns(
        UserWarning, match=rf"run 'conv..pool' .* ended after 'bn': 'act' .*{reason}"
    ):
        got = exact_step(model, x)
    assert_exact(got, ref)


def test_a_member_the_parent_calls_elsewhere_is_skipped(
    assert_exact, exact_step, op_counter
) -> None:
    """up..drop's range holds skip_drop, which the parent calls on the skip before the run:
    the run joins up, bn, act and drop, replays them (drop's mask included) and warns of
    nothing."""
    torch.manual_seed(0)
    plain = UpTransition().train()
    model = copy.deepcopy(plain)
    vision_ckpt.apply(
        model,
        {"training_checkpoint_level": 1, "rules": [{"match": "up", "through": "drop", "level": 1}]},
    )
    x = torch.randn(4, 8, 8, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = exact_step(model, x)
    assert_exact(got, exact_step(plain, x))
    out = model(x).sum()
    with op_counter() as ops:
        out.backward()
    # the run's conv and dropout run again; the concatenation's conv and the skip's dropout not
    assert ops.counts["convolution"] == 1 and ops.counts["bernoulli_"] == 1


def test_a_run_inside_a_recomputed_region_is_exact(assert_exact, exact_step) -> None:
    torch.manual_seed(0)
    plain = StemNet()
    model = copy.deepcopy(plain)
    cfg = {
        "training_checkpoint_level": 5,
        "nesting": "all",
        "rules": [STEM, {"match_type": "StemNet", "level": 5}],
    }
    vision_ckpt.apply(model, cfg)
    x = torch.randn(2, 3, 8, 8)
    assert_exact(exact_step(model, x), exact_step(plain, x))


def test_a_run_split_by_an_enclosing_region_ends_at_its_boundary(assert_exact, exact_step) -> None:
    """Segments of a stack put the run's members in two regions: a member must not join a run
    opened in another region, whose recomputation would not see it."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(4)])
    model = copy.deepcopy(plain)
    rules = [
        {"match": "1", "level": 1, "through": "2"},
        {"match_type": "Sequential", "level": 4, "segments": 2},
    ]
    vision_ckpt.apply(model, {"training_checkpoint_level": 4, "rules": rules})
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    ref = exact_step(plain, x)
    with pytest.warns(UserWarning, match=r"'2' was called where it runs inside another"):
        got = exact_step(model, x)
    assert_exact(got, ref)


def test_a_run_the_parent_leaves_unfinished_keeps_nothing_alive() -> None:
    class Partial(StemNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.conv(x)).sum()  # never calls act, drop, pool

    model = Partial()
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [STEM]})
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    model(x).backward()
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None


def test_run_leaves_the_model_as_it_was_and_survives_copies() -> None:
    model = StemNet()
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    names = [n for n, _ in model.named_modules()]
    the_plan = vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [STEM]})
    assert "full through pool 1" in str(the_plan)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert [n for n, _ in model.named_modules()] == names
    assert "member 2 of the checkpointed run 'conv..pool'" in repr(model.act.forward)
    x = torch.randn(2, 3, 8, 8)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        torch.manual_seed(1)
        a = other(x)
        torch.manual_seed(1)
        b = model(x)
        assert torch.equal(a, b)
        assert other.act.forward.chain is not model.act.forward.chain
    assert vision_ckpt.remove(model) == 5
    assert "forward" not in model.act.__dict__


def test_eval_and_no_grad_run_plainly(core_calls) -> None:
    model = StemNet()
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [STEM]})
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        model(x)
    model.eval()
    y = model(x.requires_grad_())
    assert y.grad_fn is not None and not core_calls


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            {"match": "conv", "level": 1, "through": "nope"},
            r"rules\[0\] .* runs 'conv' through 'nope', which is not a later child of the "
            r"model; its children after 'conv' are: bn, act, drop, pool, body, head\.",
        ),
        (
            {"match": "pool", "level": 1, "through": "conv"},
            r"runs 'pool' through 'conv', which is not a later child .* after 'pool' are: "
            r"body, head",
        ),
        (
            {"match_type": "StemNet", "level": 1, "through": "conv"},
            r"runs the model itself through 'conv'; 'through' names a later sibling",
        ),
        (
            {"match": "conv", "level": 1, "through": "body.0"},
            r"through 'body\.0' is not a sibling's name",
        ),
        (
            {"match": "conv", "level": 1, "through": "pool", "keep": "heavy"},
            r"keeps heavy in a region spanned by through; a run of calls or a group of layers "
            r"is recomputed whole",
        ),
    ],
)
def test_bad_runs_say_what_is_allowed(rule, message) -> None:
    with pytest.raises(ConfigError, match=message):
        vision_ckpt.plan(StemNet(), {"rules": [rule]})


def test_a_member_with_a_level_of_its_own_is_refused() -> None:
    rules = [STEM, {"match": "pool", "level": 2}]
    with pytest.raises(
        ConfigError,
        match=r"'pool' is inside the run 'conv' through 'pool' of rules\[0\] .* and has a level "
        r"of its own, not below the run's 1, from rules\[1\]",
    ):
        vision_ckpt.plan(StemNet(), {"rules": rules})
    # below the run's level a member may be a region alone, but not start another run
    overlapping = [{**STEM, "level": 2}, {"match": "bn", "level": 1, "through": "act"}]
    with pytest.raises(ConfigError, match=r"'bn' is inside the run 'conv' .* starts a run of its"):
        vision_ckpt.plan(StemNet(), {"rules": overlapping})
    # a level-0 rule only says "not on its own": allowed
    vision_ckpt.plan(StemNet(), {"rules": [STEM, {"match": "pool", "level": 0}]})
    with pytest.raises(ConfigError, match=r"'conv' starts runs through 'pool', 'act'"):
        vision_ckpt.plan(StemNet(), {"rules": [STEM, {**STEM, "level": 2, "through": "act"}]})


@pytest.mark.parametrize("arch", ["resnet18", "efficientnet_b0", "densenet121"])
def test_timm_stems_are_one_region_at_level_1(arch: str, assert_exact, exact_step) -> None:
    torch.manual_seed(0)
    kwargs = {"num_classes": 10, "drop_rate": 0.2}
    if arch == "densenet121":
        kwargs.update(growth_rate=4, block_config=(1, 1, 1, 1))
    plain = timm.create_model(arch, pretrained=False, **kwargs)
    model = copy.deepcopy(plain)
    the_plan = vision_ckpt.apply_preset(model, 1)
    stem = [e for e in the_plan if e.checkpointed and e.through is not None]
    assert len(stem) == 1 and stem[0].checkpointed
    x = torch.randn(2, 3, 64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole stem joins the run: no member breaks it
        got = exact_step(model, x)
    assert_exact(got, exact_step(plain, x))


def test_torchvision_resnet_stem_lowers_the_peak() -> None:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    y = torch.randint(0, 10, (2,))

    def peak() -> int:
        with track_peak_memory(model, x) as mem:
            F.cross_entropy(model(x), y).backward()
        return mem.peak_bytes

    vision_ckpt.apply_preset(model, 3)
    with_stem = peak()
    vision_ckpt.apply_preset(model, 3, rules=[{"match": "conv1", "level": 0}])
    without = peak()
    # the stem's conv and BN outputs and the pool indices at 32x32 (2 x 64 channels)
    assert without - with_stem >= 2 * 64 * 32 * 32 * 4 * 2


@pytest.mark.parametrize(
    ("arch", "indices", "head", "rung"),
    [
        ("resnet18", (0,), "conv1", "full through act1 1"),
        ("resnet18", (0, 1), "conv1", "full through maxpool 1"),
        ("densenet121", (0,), "features_conv0", "full through features_norm0 1"),
        ("densenet121", (1,), "features_conv0", "full through features_pool0 1"),
    ],
)
def test_a_feature_wrapper_keeps_the_part_of_the_stem_it_has(arch, indices, head, rung) -> None:
    """timm's ``features_only`` wrapper lifts DenseNet's stem out of ``features`` and, with
    ``out_indices``, may drop the end of a stem: the run ends at its last member kept."""
    model = timm.create_model(arch, pretrained=False, features_only=True, out_indices=indices)
    the_plan = vision_ckpt.plan(model, {"preset": "auto", "training_checkpoint_level": 1})
    assert [str(r) for r in the_plan[head].rungs] == [rung]


def test_a_presets_run_applies_to_the_blocks_that_have_it() -> None:
    """timm's EfficientNet class holds inverted residuals (conv_pw, bn1, conv_dw, bn2, ...) and
    depthwise-separable blocks (conv_dw, bn1, se, conv_pw, bn2): the preset's level-4 runs
    'conv_pw through bn1' and 'conv_dw through bn1' each take the blocks where bn1 comes later,
    while the same rule given by a user is strict."""

    def runs(arch: str) -> dict[str, str]:
        with torch.device("meta"):
            model = timm.create_model(arch, pretrained=False)
        p = vision_ckpt.plan(model, {"training_checkpoint_level": 4, "preset": "auto"})
        return {e.name: e.through for e in p if e.through is not None and e.checkpointed}

    b0 = runs("efficientnet_b0")
    assert b0["blocks.0.0.conv_dw"] == "bn1"  # depthwise-separable
    assert b0["blocks.1.0.conv_pw"] == "bn1" and "blocks.1.0.conv_dw" not in b0
    with torch.device("meta"):
        b0_model = timm.create_model("efficientnet_b0", pretrained=False)
    at3 = vision_ckpt.plan(b0_model, {"training_checkpoint_level": 3, "preset": "auto"})
    # level 3 nests bn1 alone; from level 4 the run takes its place (NOTE [ Runs take over ])
    assert at3["blocks.1.0.bn1"].checkpointed and not at3["blocks.1.0.conv_pw"].checkpointed
    at4 = at3.at_level(4)
    assert at4["blocks.1.0.conv_pw"].checkpointed and not at4["blocks.1.0.bn1"].checkpointed
    # the later stages stay selective at every level: no whole block, no run there
    for level in range(1, 6):
        p = at3.at_level(level)
        assert p["blocks.2"].checkpointed and p["blocks.2"].rung_at(level).selective
        assert not any(e.checkpointed for e in p if e.name.startswith("blocks.2."))
    v1 = runs("mobilenetv1_100")  # depthwise-separable blocks in every stage
    assert "blocks.1.0.conv_dw" in v1 and not any(n.endswith("conv_pw") for n in v1)
    assert "blocks.2.0.conv_dw" not in v1  # only in the two stages recomputed whole
    with torch.device("meta"):
        model = timm.create_model("mobilenetv1_100", pretrained=False)
    with pytest.raises(ConfigError, match=r"runs 'blocks.0.0.conv_pw' through 'bn1', which is not"):
        vision_ckpt.plan(
            model, {"rules": [{"match": "blocks.*.*.conv_pw", "level": 4, "through": "bn1"}]}
        )


def test_a_presets_run_keeps_its_glob_in_a_feature_wrapper() -> None:
    """In timm's features_only wrapper the EfficientNet runs still select by the preset's glob
    (the blocks without the run are left out there too), not by a list of names."""
    with torch.device("meta"):
        model = timm.create_model("efficientnet_b0", pretrained=False, features_only=True)
    runs = {
        r.match: r for r, _ in vision_ckpt.config.presets.preset_rules(model, "auto") if r.through
    }
    assert {"blocks.1.*.conv_pw", "blocks.0.*.conv_dw"} <= set(runs)
    p = vision_ckpt.plan(model, {"training_checkpoint_level": 4, "preset": "auto"})
    assert p["blocks.1.0.conv_pw"].checkpointed and "blocks.0.0.conv_pw" not in {e.name for e in p}


@pytest.mark.parametrize("level", [1, 2])
def test_a_run_takes_over_a_members_finer_region_from_its_level(
    level: int, assert_exact, exact_step, core_calls, op_counter
) -> None:
    """A member may have a level of its own below the run's: BN alone at level 1, the stem run
    from level 2, where BN's own region steps aside (NOTE [ Runs take over ])."""
    rules = [{"match": "bn", "level": 1}, {**STEM, "level": 2}]
    torch.manual_seed(0)
    plain = StemNet()
    model = copy.deepcopy(plain)
    p = vision_ckpt.apply(model, {"training_checkpoint_level": level, "rules": rules})
    assert p["bn"].checkpointed == (level == 1) and p["conv"].checkpointed == (level == 2)
    assert str(p["bn"].rung_at(1)) == "full 1 only"
    x = torch.randn(4, 3, 16, 16, requires_grad=True)
    ref = exact_step(plain, x)
    core_calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run is whole at level 2: no member breaks it
        got = exact_step(model, x)
    assert_exact(got, ref)
    # level 1: BN's own region; level 2: the run's, which opens no region of BN's
    assert (core_calls.labels == ["bn"]) if level == 1 else ("bn" not in core_calls.labels)
    if level == 2:
        out = model(x).sum()
        with op_counter() as ops:
            out.backward()
        assert ops.counts["convolution"] == 1 and ops.counts["max_pool2d_with_indices"] == 1
    vision_ckpt.remove(model)
    assert type(model.bn).forward is nn.BatchNorm2d.forward and "forward" not in vars(model.bn)


class _Gate(nn.Module):
    """A layer called with keyword arguments, as timm's ``Attention`` is
    (``attn_mask=None, is_causal=False``; EVA's also with a rotary embedding tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: Any = None, scale: float = 1.0) -> torch.Tensor:
        y = F.gelu(self.fc(x)) * scale
        if isinstance(mask, list):
            mask = mask[0]
        return y if mask is None else y * mask


class _KeywordBlock(nn.Module):
    def __init__(self, mask: str | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.gate = _Gate()
        self.drop = nn.Dropout(0.2)
        self.scale = nn.Parameter(torch.rand(8)) if mask else None
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = None if self.mask is None else self.scale * 2  # a tensor with a grad_fn
        if self.mask == "list":
            mask = [mask]
        out = self.gate(self.norm(x), mask=mask, scale=0.5)
        if self.mask == "modified":
            mask.mul_(3)  # after the call: the replay cannot repeat it
        return x + self.drop(out)


def _keyword_model(mask: str | None) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = _KeywordBlock(mask)
    model = copy.deepcopy(plain)
    rule = {"match": "norm", "through": "drop", "level": 1}
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [rule]})
    return plain, model


@pytest.mark.parametrize("mask", [None, "tensor"])
def test_keyword_arguments_join_the_run(assert_exact, exact_step, saved_bytes, mask) -> None:
    plain, model = _keyword_model(mask)
    x = torch.randn(4, 6, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run does not end early
        got = exact_step(model, x)
        with saved_bytes() as ran:
            model(x)
    ref = exact_step(plain, x)
    assert_exact(got, ref)  # the mask's gradient included: it reaches the scale parameter
    # what the run keeps is its input; the mask is held by the run's replay, not saved
    assert ran.nbytes == x.numel() * x.element_size()


def test_a_keyword_container_ends_the_run_and_names_the_argument(assert_exact, exact_step) -> None:
    plain, model = _keyword_model("list")
    x = torch.randn(4, 6, 8, requires_grad=True)
    with pytest.warns(
        UserWarning,
        match=r"ended after 'norm': 'gate' was called with arguments \['mask'\] that "
        r"the run cannot pass again \(only tensors and None, bool, int, float and str",
    ):
        got = exact_step(model, x)
    ref = exact_step(plain, x)
    assert_exact(got, ref)


def test_a_keyword_tensor_changed_before_backward_is_an_error() -> None:
    _, model = _keyword_model("modified")
    out = model(torch.randn(4, 6, 8))
    with pytest.raises(
        CheckpointError,
        match=r"member 'gate' was called with the tensor mask=\.\.\., which was modified in "
        r"place before backward recomputed the run.*clone it",
    ):
        out.sum().backward()


def test_a_run_whose_first_member_writes_its_input_is_refused_by_name() -> None:
    # torchvision's MNASNet classifier as a run: its in-place dropout writes the run's input
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(8, 2))
    )
    rule = {"match": "1.0", "through": "1", "level": 1}
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [rule]})
    with pytest.raises(CheckpointError, match=r"region '1\.0\.\.1' wrote its input 0"):
        model(torch.randn(3, 4))
