"""Strategy ``lean``: timm MLPs whose backward holds one hidden-size tensor fewer, exactly.

The oracle is the plain model: outputs and every gradient bit for bit, with drop-path on, at
every level, alone and inside full and selective regions; memory is counted in bytes."""

from __future__ import annotations

import copy
import re
import warnings
from functools import partial

import pytest
import timm
import torch
import torch.nn.utils.prune
from timm.layers import GELUTanh, Mlp
from timm.models.metaformer import StarReLU
from torch import nn

import vision_ckpt
from vision_ckpt import CheckpointError, ConfigError, _compat
from vision_ckpt.measure._memory import track_peak_memory

LEAN = {"match": "blocks.*.mlp", "level": 1, "lean": True}


def _vit(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        num_classes=5,
        img_size=32,
        patch_size=8,
        depth=3,
        drop_path_rate=0.1,
        **kwargs,
    ).train()


@pytest.mark.parametrize("base", [2, 3, 4])
def test_lean_mlps_are_exact_alone_and_inside_full_and_selective_regions(
    base, assert_exact, exact_step, scratch_preset
):
    """Base levels: 2 makes the MLPs full regions, 3 the layers (the lean MLP inside a
    recomputed layer), 4 groups of layers; at level 1 the layers are selective regions."""
    model, x = _vit(), torch.randn(2, 3, 32, 32)
    preset = scratch_preset("vit_like")
    reference = exact_step(copy.deepcopy(model), x)
    for level in range(0, base + 1):
        applied = copy.deepcopy(model)
        plan = vision_ckpt.apply(
            applied,
            {"training_checkpoint_level": level, "preset": preset, "rules": [LEAN]},
        )
        assert plan["blocks.0.mlp"].lean_at(level) == (level >= 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every lean MLP takes the lean path
            got = exact_step(applied, x)
        assert_exact(got, reference, f"at level {level}")


def test_lean_mlp_is_exact_under_cpu_autocast(assert_exact, exact_step):
    model, x = _vit(), torch.randn(2, 3, 32, 32)
    plain, lean = copy.deepcopy(model), copy.deepcopy(model)
    vision_ckpt.apply(lean, {"training_checkpoint_level": 1, "rules": [LEAN]})
    results = []
    for m in (plain, lean):
        with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("error")
            results.append(exact_step(m, x))
    assert results[0]["out"].dtype == torch.bfloat16
    assert_exact(results[1], results[0], "under autocast")


def _backward_peak(mlp: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Bytes above the start at the end of forward, and at the step's peak."""
    with track_peak_memory(mlp, x) as mem:
        out = mlp(x)
        kept = mem.end_bytes - mem.start_bytes
        out.sum().backward()
    return kept, mem.peak_bytes - mem.start_bytes


def test_lean_mlp_keeps_and_peaks_one_hidden_tensor_lower():
    """A 4x MLP on 2048 tokens of 16 channels (a hidden tensor H is 512 KB, one of the input's
    size H/4, the weights 4 KB). Plain autograd keeps fc1's and GELU's outputs and its
    backward holds three hidden tensors at once; lean keeps fc1's and holds two, beside two of
    the input's size (the input and its gradient)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(Mlp(16, 64)).train()
    x = torch.randn(1, 2048, 16, requires_grad=True)
    hidden = 2048 * 64 * 4
    plain_kept, plain_peak = _backward_peak(mlp, x)
    vision_ckpt.apply(mlp, {"training_checkpoint_level": 1, "rules": [LEAN | {"match": "0"}]})
    lean_kept, lean_peak = _backward_peak(mlp, x)
    assert plain_kept - lean_kept == hidden
    assert plain_peak >= 3 * hidden
    assert lean_peak <= 2.55 * hidden, lean_peak / hidden


def _star(**kwargs) -> nn.Module:
    """A StarReLU with a scale and a bias away from 1 and 0, so a lost factor shows."""
    act = StarReLU(**kwargs)
    with torch.no_grad():
        act.scale.fill_(0.8)
        act.bias.fill_(-0.1)
    return act


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        ({"use_conv": True}, (3, 16, 11, 13)),
        ({"use_conv": True, "bias": False, "act_layer": _star}, (3, 16, 11, 13)),
        ({"use_conv": True, "bias": (False, True), "act_layer": GELUTanh}, (2, 16, 8, 8)),
        ({"bias": False}, (3, 7, 16)),
        ({"bias": False, "act_layer": _star}, (2, 5, 5, 16)),
        ({"act_layer": partial(_star, scale_learnable=False)}, (37, 16)),
        ({"act_layer": nn.SiLU}, (3, 7, 16)),
        ({"use_conv": True, "act_layer": partial(nn.ReLU, inplace=True)}, (2, 16, 8, 8)),
        ({"act_layer": nn.Hardswish, "bias": False}, (37, 16)),
    ],
    ids=[
        "conv",
        "conv, no bias, StarReLU",
        "conv, one bias, tanh GELU",
        "linear, no bias",
        "linear, no bias, StarReLU, NHWC",
        "linear, StarReLU with a fixed scale",
        "linear, SiLU",
        "conv, in-place ReLU",
        "linear, no bias, Hardswish",
    ],
)
def test_every_mlp_layout_lean_takes_is_exact(layout, shape, assert_exact, exact_step):
    """Pointwise convolutions (MetaFormer's, CAFormer's), layers without biases and StarReLU
    with its learnable scale and bias: every gradient equals the plain MLP's bit for bit."""
    torch.manual_seed(0)
    plain = nn.Sequential(Mlp(16, 64, **layout)).train()
    x = torch.randn(*shape)
    want = exact_step(plain, x)
    lean = _lean(copy.deepcopy(plain))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it takes the lean path
        got = exact_step(lean, x)
    assert_exact(got, want, f"lean {layout}")


def test_a_conv_mlp_with_star_relu_peaks_below_autograds():
    """CAFormer's MLP layout (1x1 convs without biases, StarReLU) on 64x64 pixels of 16
    channels, a hidden tensor H of 1 MiB: plain autograd keeps three hidden tensors and its
    backward holds five at once; lean keeps one (fc1's output) and holds three."""
    torch.manual_seed(0)
    mlp = nn.Sequential(Mlp(16, 64, use_conv=True, bias=False, act_layer=_star)).train()
    x = torch.randn(1, 16, 64, 64, requires_grad=True)
    hidden = 64 * 64 * 64 * 4
    plain_kept, plain_peak = _backward_peak(mlp, x)
    _lean(mlp)
    lean_kept, lean_peak = _backward_peak(mlp, x)
    assert plain_kept - lean_kept == 2 * hidden
    assert plain_peak >= 5 * hidden
    assert lean_peak <= 3.3 * hidden, lean_peak / hidden


def test_star_relu_under_autocast_runs_its_own_forward(assert_exact):
    """Autocast computes StarReLU's square in float32 between two low-precision convs."""
    torch.manual_seed(0)
    plain = nn.Sequential(Mlp(16, 64, use_conv=True, act_layer=_star)).train()
    lean = _lean(copy.deepcopy(plain))
    x = torch.randn(2, 16, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(x)
        with pytest.warns(UserWarning, match=r"runs its own forward.*StarReLU's square"):
            got = lean(x)
    assert_exact(got, want, "under autocast")


def test_lean_leaves_the_model_as_it_was():
    model = _vit()
    names = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [LEAN]})
    assert "lean@1" in repr(model.blocks[0].mlp.forward)
    assert list(model.state_dict()) == names and [id(p) for p in model.parameters()] == params
    assert vision_ckpt.remove(model) == 3
    assert "forward" not in model.blocks[0].mlp.__dict__


def test_the_plan_shows_lean_beside_the_regions(scratch_preset):
    preset = scratch_preset("vit_like")
    plan = vision_ckpt.plan(
        _vit(), {"training_checkpoint_level": 2, "preset": preset, "rules": [LEAN]}
    )
    entry = plan["blocks.0.mlp"]
    assert entry.lean == 1 and entry.checkpointed
    row = next(line for line in str(plan).splitlines() if line.startswith("blocks.0.mlp "))
    assert "full 2, lean 1" in row and "full, lean" in row
    assert plan.at_level(0)["blocks.0.mlp"].lean_at(0) is False


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        (
            [{"match": "blocks.*.attn", "level": 1, "lean": True}],
            r"makes 'blocks.0.attn' lean, but it is a Attention, not a timm Mlp.*"
            r"Select the MLP modules themselves",
        ),
        (
            [LEAN, {"match": "blocks.*.mlp.fc1", "level": 1}],
            r"makes 'blocks.0.mlp' lean, and rules\[1\].*selects 'blocks.0.mlp.fc1' inside "
            r"it; a lean MLP computes its layers itself",
        ),
        (
            [LEAN | {"segments": 2}],
            r"is lean and gives segments=2; a lean MLP is not a region",
        ),
        (
            [LEAN | {"through": "norm2"}],
            r"is lean and gives through=norm2; a lean MLP is not a region, so it has no span",
        ),
    ],
)
def test_lean_rules_that_cannot_work_are_errors(rules, message):
    with pytest.raises(ConfigError, match=message):
        vision_ckpt.plan(_vit(), {"training_checkpoint_level": 1, "rules": rules})


def test_an_mlp_with_dropout_inside_is_an_error_for_a_rule_and_left_out_by_a_preset(
    scratch_preset,
):
    model = _vit(proj_drop_rate=0.1)
    with pytest.raises(
        ConfigError, match=r"its drop1 drops \(p=0.1\) between the activation and fc2"
    ):
        vision_ckpt.plan(model, {"training_checkpoint_level": 1, "rules": [LEAN]})
    preset = scratch_preset("vit_like")
    plan = vision_ckpt.plan(model, {"training_checkpoint_level": 5, "preset": preset})
    assert plan["blocks.0.mlp"].lean is None
    plan = vision_ckpt.plan(_vit(), {"training_checkpoint_level": 5, "preset": preset})
    assert plan["blocks.0.mlp"].lean_at(5) and not plan["blocks.0.mlp"].lean_at(4)


def test_a_call_lean_cannot_take_warns_once_and_stays_exact(assert_exact, exact_step):
    """Dropout switched on after planning: the MLP runs its own forward, says so once."""
    model, x = _vit(), torch.randn(2, 3, 32, 32)
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [LEAN]})
    model.blocks[0].mlp.drop1.p = 0.2
    reference = copy.deepcopy(model)
    vision_ckpt.remove(reference)
    want = exact_step(reference, x)
    with pytest.warns(UserWarning, match=r"'blocks.0.mlp' runs its own forward.*p=0.2"):
        got = exact_step(model, x)
    assert_exact(got, want, "with dropout switched on")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact_step(model, x)


def _sequential_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(Mlp(8, 32)).train(), torch.randn(2, 5, 8, requires_grad=True)


def _lean(model: nn.Module) -> nn.Module:
    vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": [LEAN | {"match": "0"}]})
    return model


def test_a_second_derivative_is_an_error_that_says_how_to_opt_out():
    """A gradient penalty differentiates the MLP's backward, which lean takes in place."""
    plain, x = _sequential_mlp()
    lean = _lean(copy.deepcopy(plain))
    with pytest.raises(CheckpointError, match=r"create_graph=True.*'level': 0, 'lean': True"):
        torch.autograd.grad(lean(x).square().sum(), x, create_graph=True)
    vision_ckpt.apply(
        lean, {"training_checkpoint_level": 1, "rules": [LEAN | {"match": "0", "level": 0}]}
    )
    (gx,) = torch.autograd.grad(lean(x).square().sum(), x, create_graph=True)
    gx.square().sum().backward()


def test_torch_func_transforms_run_the_mlps_own_forward(assert_exact):
    plain, x = _sequential_mlp()
    lean = _lean(copy.deepcopy(plain))
    params = {k: v.detach() for k, v in plain.named_parameters()}

    def loss(m):
        return lambda p: torch.func.functional_call(m, p, (x,)).sum()

    want = torch.func.grad(loss(plain))(params)
    with pytest.warns(UserWarning, match=r"runs its own forward.*torch\.func transform"):
        got = torch.func.grad(loss(lean))(params)
    assert_exact(got, want, "gradients under torch.func.grad")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda m: setattr(
                m[0].fc1, "weight", nn.Parameter(m[0].fc1.weight.t().contiguous().t())
            ),
            "a weight is not contiguous",
        ),
        (lambda m: setattr(m[0], "act", nn.Tanh()), "its act is a Tanh, not one lean takes"),
        (
            lambda m: torch.nn.utils.prune.l1_unstructured(m[0].fc1, "weight", 0.5),
            r"its fc1 has hooks \(pruning",
        ),
    ],
    ids=["transposed weight", "activation swapped", "pruned"],
)
def test_a_module_changed_after_planning_runs_its_own_forward(
    change, message, assert_exact, exact_step
):
    plain, x = _sequential_mlp()
    lean = _lean(copy.deepcopy(plain))
    change(plain)
    change(lean)
    for _ in range(2):  # two training steps: pruning's hook rebuilds the weight each time
        want = exact_step(plain, x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = exact_step(lean, x)
        assert_exact(got, want, "after the change")
    assert any(re.search(message, str(w.message)) for w in caught) or lean[0].forward.lean.warned


def test_a_rule_on_an_mlp_with_hooks_is_an_error():
    model = _vit()
    model.blocks[1].mlp.fc2.register_forward_hook(lambda *a: None)
    with pytest.raises(ConfigError, match=r"makes 'blocks.1.mlp' lean, but its fc2 has hooks"):
        vision_ckpt.plan(model, {"training_checkpoint_level": 1, "rules": [LEAN]})


def test_a_level_0_lean_rule_takes_away_the_lean_level_only(scratch_preset):
    opt_out = {"match": "blocks.*.mlp", "level": 0, "lean": True}
    preset = scratch_preset("vit_like")
    plan = vision_ckpt.plan(
        _vit(), {"training_checkpoint_level": 2, "preset": preset, "rules": [opt_out]}
    )
    entry = plan["blocks.0.mlp"]
    assert entry.lean is None and entry.checkpointed and str(entry.rungs[0]) == "full 2"


def test_a_lean_mlp_in_a_run_is_an_error():
    run = {"match": "blocks.*.norm2", "level": 2, "through": "mlp"}
    with pytest.raises(ConfigError, match=r"makes 'blocks.0.mlp' lean, and rules\[1\].*runs it"):
        vision_ckpt.plan(_vit(), {"training_checkpoint_level": 2, "rules": [LEAN, run]})


@pytest.mark.parametrize("act", [nn.GELU, nn.SiLU, nn.ReLU, nn.Hardswish])
def test_every_one_operator_activation_is_lean_and_exact_under_autocast(act, assert_exact):
    """None of them is on autocast's lists: the layers run in bfloat16, the activation on
    their output as it is, lean or not."""
    torch.manual_seed(0)
    plain = nn.Sequential(Mlp(16, 64, use_conv=True, act_layer=act)).train()
    lean = _lean(copy.deepcopy(plain))
    results = []
    for m in (plain, lean):
        x = torch.randn(2, 16, 6, 6, generator=torch.Generator().manual_seed(1))
        x.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("error")
            out = m(x)
        out.float().sum().backward()
        results.append((out.detach(), [x.grad, *(p.grad for p in m.parameters())]))
    assert results[0][0].dtype == torch.bfloat16
    assert_exact(results[1], results[0], f"{act.__name__} under autocast")


@pytest.mark.parametrize("act", [nn.GELU, nn.SiLU, nn.ReLU, nn.Hardswish])
def test_a_dispatch_mode_around_backward_sees_the_same_operators(act, assert_exact):
    """FlopCounterMode runs silu_backward's composite kernel in place of the CPU one; lean
    calls each operator as autograd does, so its gradients follow the plain MLP's there too."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    plain = nn.Sequential(Mlp(32, 128, act_layer=act)).train()
    lean = _lean(copy.deepcopy(plain))
    x = torch.randn(2, 8, 8, 32)
    results = []
    for m in (plain, lean):
        xi = x.clone().requires_grad_()
        loss = m(xi).square().mean()
        with FlopCounterMode(display=False):
            loss.backward()
        results.append([xi.grad, *(p.grad for p in m.parameters())])
    assert_exact(results[1], results[0], f"{act.__name__} under FlopCounterMode")


def test_autocast_with_a_low_precision_input_stays_lean_and_exact(assert_exact):
    plain, x = _sequential_mlp()
    lean = _lean(copy.deepcopy(plain))
    results = []
    for m in (plain, lean):
        xi = x.detach().bfloat16().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("error")
            out = m(xi)
        out.float().sum().backward()
        results.append((out.detach(), [xi.grad, *(p.grad for p in m.parameters())]))
    assert_exact(results[1], results[0], "with a bf16 input under autocast")


class _ConvMlp(nn.Module):
    """An MLP of its own class, laid out as Hugging Face's PoolFormer output: one drop module
    called twice, registered in another order than it is called."""

    def __init__(self, drop: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 32, 1)
        self.conv2 = nn.Conv2d(32, 8, 1)
        self.drop = nn.Dropout(drop)
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.drop(self.conv2(self.drop(self.act_fn(self.conv1(x)))))


class _Residual(_ConvMlp):
    def forward(self, x):
        return x + self.conv2(self.act_fn(self.conv1(x)))


class _Scaled(_ConvMlp):
    def forward(self, x):
        hidden = self.conv1(x)
        hidden.mul_(2.0)
        return self.conv2(self.act_fn(hidden))


def _wrapped(mlp: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(mlp).train()


@pytest.mark.parametrize(
    "mlp",
    [
        lambda: nn.Sequential(nn.Conv2d(8, 32, 1), nn.GELU(), nn.Conv2d(32, 8, 1), nn.Dropout(0.3)),
        lambda: nn.Sequential(nn.Linear(8, 32, bias=False), GELUTanh(), nn.Linear(32, 8)),
        _ConvMlp,
    ],
    ids=["Sequential, dropout after", "Sequential, linear", "own class"],
)
def test_an_mlp_of_any_class_found_by_its_forward_is_lean_and_exact(mlp, assert_exact, exact_step):
    plain = _wrapped(mlp())
    linear = any(isinstance(m, nn.Linear) for m in plain.modules())
    x = torch.randn(3, 4, 8) if linear else torch.randn(2, 8, 5, 5)
    lean = _lean(copy.deepcopy(plain))
    assert "lean@1" in repr(lean[0].forward)
    want = exact_step(plain, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it takes the lean path, dropout after it included
        got = exact_step(lean, x)
    assert_exact(got, want, "an MLP found by its forward")


@pytest.mark.parametrize(
    ("mlp", "message"),
    [
        (_Residual, r"probed, does not call .*: it did not return the last call's output"),
        (_Scaled, r"probed, does not call .*: call 2 \(GELU\) did not take the previous output"),
        (
            lambda: _ConvMlp(drop=0.1),
            r"its drop \(Dropout\) ran between the activation and the second layer",
        ),
        (
            lambda: nn.Sequential(
                nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.5, inplace=True), nn.Linear(32, 8)
            ),
            r"its 2 \(Dropout\) ran between .* did not pass its input on unchanged",
        ),
        (
            lambda: nn.Sequential(nn.Conv2d(8, 32, 3), nn.GELU(), nn.Conv2d(32, 8, 1)),
            r"its 0 is a Conv2d that is not pointwise",
        ),
        (
            lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)),
            r"it is a Sequential, not a timm Mlp, and not a module whose children are two",
        ),
        (
            lambda: nn.Sequential(nn.GELU(), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)),
            r"it is a Sequential, not a timm Mlp, and not a module whose children are two",
        ),
    ],
    ids=[
        "residual inside",
        "changed in place",
        "dropout between",
        "in-place dropout between",
        "3x3 conv",
        "Tanh",
        "two activations",
    ],
)
def test_a_module_whose_forward_is_no_lean_chain_is_an_error_that_says_why(mlp, message):
    with pytest.raises(ConfigError, match=message):
        _lean(_wrapped(mlp()))


class _NormFirst(nn.Module):
    """An MLP with a norm before its first layer, laid out as TinyViT's: norm -> fc1 -> act ->
    drop -> fc2 -> drop."""

    def __init__(self, norm: nn.Module, conv: bool = False) -> None:
        super().__init__()
        self.norm = norm
        self.fc1 = nn.Conv2d(8, 32, 1) if conv else nn.Linear(8, 32)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.0)
        self.fc2 = nn.Conv2d(32, 8, 1) if conv else nn.Linear(32, 8)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(self.norm(x))))))


class _Strided(nn.Module):
    """A leaf that returns its input's values with other strides, and counts its calls."""

    calls = 0

    def forward(self, x):
        _Strided.calls += 1
        return x.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize(
    ("norm", "conv", "x"),
    [
        (lambda: nn.LayerNorm(8), False, lambda: torch.randn(4, 3, 8)),
        # TinyViT's MLP takes its windows' tokens transposed: the norm makes them contiguous
        (lambda: nn.LayerNorm(8), False, lambda: torch.randn(3, 8, 4).transpose(1, 2)),
        (lambda: nn.BatchNorm2d(8), True, lambda: torch.randn(2, 8, 5, 5)),
    ],
    ids=["layer norm", "layer norm, strided input", "batch norm, convs"],
)
def test_an_mlp_with_a_norm_before_its_first_layer_is_lean_and_exact(
    norm, conv, x, assert_exact, exact_step
):
    """NOTE [ MLPs of any class ]: the norm runs as itself, the chain after it lean; the
    BatchNorm's statistics are those of the plain step (the probe puts them back)."""
    plain = _wrapped(_NormFirst(norm(), conv))
    lean = _lean(copy.deepcopy(plain))
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffer, lean.get_buffer(name)), f"the probe changed {name}"
    assert "lean@1" in repr(lean[0].forward)
    want = exact_step(plain, x())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = exact_step(lean, x())
    assert_exact(got, want, "an MLP with a norm before its first layer")


def test_a_leaf_before_the_first_layer_runs_once_when_the_rest_cannot_run_lean(
    assert_exact, exact_step
):
    """Its output is strided, which lean's linear layer does not take: the call goes on through
    the layers themselves, says why, and calls the leaf once, as the plain forward does."""
    plain = _wrapped(_NormFirst(_Strided()))
    lean = _lean(copy.deepcopy(plain))
    x = torch.randn(4, 3, 8)
    _Strided.calls = 0
    want = exact_step(plain, x)
    assert _Strided.calls == 1
    with pytest.warns(UserWarning, match=r"'0' runs its own forward.*not a contiguous tensor"):
        got = exact_step(lean, x)
    assert _Strided.calls == 2
    assert_exact(got, want, "an MLP whose leaf before it makes a strided input")


def test_the_probe_changes_neither_the_random_state_nor_the_modes():
    model = _wrapped(_ConvMlp(drop=0.2)).eval()
    model[0].drop.p = 0.0
    state = torch.random.get_rng_state()
    _lean(model)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not any(m.training for m in model.modules())


def test_a_dropout_switched_on_after_planning_is_seen_and_runs_the_own_forward(
    assert_exact, exact_step
):
    """NOTE [ MLPs of any class ]: a changed attribute probes the module again."""
    plain = _wrapped(_ConvMlp())
    lean = _lean(copy.deepcopy(plain))
    x = torch.randn(2, 8, 5, 5)
    exact_step(lean, x)
    plain[0].drop.p = lean[0].drop.p = 0.3
    want = exact_step(plain, x)
    with pytest.warns(UserWarning, match=r"'0' runs its own forward.*its drop \(Dropout\) ran"):
        got = exact_step(lean, x)
    assert_exact(got, want, "with dropout between the layers")


def test_hugging_face_poolformer_outputs_are_lean_and_exact(assert_exact, exact_step):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.PoolFormerConfig(depths=[1, 1, 2, 1], hidden_sizes=[16, 32, 48, 64])
    model = transformers.PoolFormerForImageClassification(config).train()
    x = torch.randn(2, 3, 64, 64)
    want = exact_step(model, x)
    rules = [
        {"match": "poolformer.encoder.block.*.*.output", "level": 1, "lean": True},
        {"match": "poolformer.encoder.block.*.*", "level": 2},  # recomputed around them
    ]
    for level in (1, 2):
        applied = copy.deepcopy(model)
        plan = vision_ckpt.apply(applied, {"training_checkpoint_level": level, "rules": rules})
        assert sum(e.lean is not None for e in plan) == 5
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = exact_step(applied, x)
        assert_exact(got, want, f"PoolFormer's outputs lean at level {level}")


def test_an_mlp_of_any_class_compiles_lean_and_exact(assert_exact, exact_step):
    """Planned in eval mode, probed again in training under torch.compile: the lean
    autograd.Function is in a captured graph and the step equals eager's plain one."""
    plain = _wrapped(_ConvMlp())
    lean = _lean(copy.deepcopy(plain).eval()).train()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    x = torch.randn(2, 8, 5, 5)
    got = exact_step(torch.compile(lean, backend=backend), x)
    got["grads"] = {k.removeprefix("_orig_mod."): v for k, v in got["grads"].items()}
    got["buffers"] = {k.removeprefix("_orig_mod."): v for k, v in got["buffers"].items()}
    assert_exact(got, exact_step(plain, x), "compiled")
    code = "".join(g.print_readable(print_output=False) for g in graphs)
    # torch 2.6's dynamo cannot trace the probe's read of a version counter: the Function
    # runs between graphs there, exact all the same (docs/torch.md)
    captured = 1 if _compat.TORCH_VERSION >= (2, 14) else 0
    assert len(re.findall(r"autograd_function_apply\(", code)) == captured


def test_monai_unetr_mlp_blocks_are_lean_and_exact(assert_exact, exact_step):
    """MONAI's MLPBlock (linear1 -> GELU -> drop1 -> linear2 -> drop2), a class of its own,
    found by its forward: a 3D transformer's MLPs run lean with exact gradients."""
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.UNETR(
        in_channels=1,
        out_channels=2,
        img_size=(16, 16, 16),
        feature_size=4,
        hidden_size=32,
        mlp_dim=64,
        num_heads=2,
        dropout_rate=0.0,
    ).train()
    x = torch.randn(2, 1, 16, 16, 16)
    want = exact_step(model, x)
    rules = [{"match": "vit.blocks.*.mlp", "level": 1, "lean": True}]
    plan = vision_ckpt.apply(model, {"training_checkpoint_level": 1, "rules": rules})
    assert sum(e.lean is not None for e in plan) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = exact_step(model, x)
    assert_exact(got, want, "UNETR's MLP blocks lean")
