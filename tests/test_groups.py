"""Groups of the layers of an nn.ModuleList that the model calls one by one (BEiT, EVA): a
``segments`` rule on the list makes runs of consecutive layers, whose layers stay checkpointed
inside them (NOTE [ Groups of a ModuleList ])."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import timm
import torch
from torch import nn

import vision_ckpt

LAYERS = {"match": "layers.*", "level": 3}
GROUPS = {"match": "layers", "level": 4, "segments": 2}


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(x) if bias is None else self.fc(x) + bias
        return x + self.drop(self.act(h))


class ListNet(nn.Module):
    """BEiT's shape: layers in a ModuleList, called by the parent with a shared tensor."""

    def __init__(
        self, depth: int = 5, width: int = 16, between: bool = False, positional: bool = False
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.bias = nn.Parameter(torch.zeros(width))
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)
        self.between = between
        self.positional = positional  # Hugging Face's way: layer(x, attention_mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        shared = self.bias * 2  # a tensor every layer gets, as a relative position bias
        for i, layer in enumerate(self.layers):
            x = layer(x, shared) if self.positional else layer(x, bias=shared)
            if self.between and i == 0:
                x = x * 1.5  # work between two layers: the group must end there
        return self.head(x)


@pytest.mark.parametrize("positional", [False, True])
@pytest.mark.parametrize("level", [3, 4])
def test_groups_are_exact_with_dropout(
    assert_exact, exact_step, level: int, positional: bool
) -> None:
    torch.manual_seed(0)
    plain = ListNet(positional=positional)
    model = copy.deepcopy(plain)
    config = {"training_checkpoint_level": level, "rules": [LAYERS, GROUPS]}
    vision_ckpt.apply(model, config)
    x = torch.randn(4, 6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_exact(exact_step(model, x), exact_step(plain, x))


def test_groups_keep_their_inputs_and_recompute_their_layers_again(saved_bytes, op_counter) -> None:
    torch.manual_seed(0)
    model = ListNet()
    x = torch.randn(4, 6, 8)
    held = {}
    counts = {}
    for level in (3, 4):
        vision_ckpt.apply(model, {"training_checkpoint_level": level, "rules": [LAYERS, GROUPS]})
        with saved_bytes() as saved:
            out = model(x).sum()
        held[level] = saved.nbytes
        with op_counter() as ops:
            out.backward()
        counts[level] = ops.counts["addmm"]
    # five layer inputs at level 3; at level 4 the inputs of groups [0, 1], [2, 3] and [4]
    layer_input = 4 * 6 * 16 * 4
    assert held[3] - held[4] == 2 * layer_input
    # level 3 recomputes every layer once; level 4 replays each group of two with its layers
    # checkpointed inside, which stops once the last layer's input is back, and recomputes
    # each layer again: (2 + 1) per group of two, and once the group of one
    assert (counts[3], counts[4]) == (5, 2 * 3 + 1)


def test_plan_lists_each_group_as_a_run_and_apply_changes_no_name() -> None:
    model = ListNet()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_modules()]
    plan = vision_ckpt.apply(model, {"training_checkpoint_level": 4, "rules": [LAYERS, GROUPS]})
    runs = {e.name: e.through for e in plan}
    assert runs == {
        "layers.0": "1",
        "layers.1": None,
        "layers.2": "3",
        "layers.3": None,
        "layers.4": None,
    }
    # a group of one layer that is a region at level 3 already: nothing more
    assert [int(r.level) for r in plan["layers.4"].rungs] == [3]
    alone = vision_ckpt.plan(model, {"training_checkpoint_level": 4, "rules": [GROUPS]})
    assert [int(r.level) for r in alone["layers.4"].rungs] == [4]
    assert "segments through 1/2 4" in str(plan)  # the run of layers.0 to layers.1
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == names
    assert vision_ckpt.remove(model) == 5
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_parent_that_works_between_layers_ends_the_group_exactly(
    assert_exact, exact_step
) -> None:
    torch.manual_seed(0)
    plain = ListNet(between=True)
    model = copy.deepcopy(plain)
    vision_ckpt.apply(model, {"training_checkpoint_level": 4, "rules": [LAYERS, GROUPS]})
    x = torch.randn(2, 6, 8)
    ref = exact_step(plain, x)
    with pytest.warns(UserWarning, match=r"run 'layers.0..1' .* ended after 'layers.0'"):
        got = exact_step(model, x)
    assert_exact(got, ref)


def test_segments_on_a_module_dict_is_refused() -> None:
    class DictNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers["b"](self.layers["a"](x))

    rule = {"match": "layers", "level": 4, "segments": "auto"}
    with pytest.raises(vision_ckpt.ConfigError, match=r"rules\[0\] .* selects no module"):
        vision_ckpt.plan(DictNet(), {"rules": [rule]})


# The levels of configs/presets/beit.yaml and eva.yaml as they were, written here so that tuning
# a shipped preset does not change what the groups test below checks.
_LAYERS = [
    {"match": "blocks.*.mlp", "level": 1},
    {"match": "blocks.*.attn", "level": 2},
    {"match": "blocks.*", "level": 3},
]
_GROUPS = {"match": "blocks", "level": 4, "segments": "auto"}


@pytest.mark.parametrize(
    ("arch", "kwargs", "rules"),
    [
        (  # BEiT's level 4 is lean MLPs, and groups besides them
            "beit_base_patch16_224",
            {"patch_size": 8, "embed_dim": 32, "num_heads": 2},
            [*_LAYERS, {"match": "blocks.*.mlp", "level": 4, "lean": True}, _GROUPS],
        ),
        (  # a rotary embedding passed to each layer, and to the level-5 run of norm1 and attn
            "eva02_tiny_patch14_224",
            {"embed_dim": 32, "num_heads": 2},
            [*_LAYERS, _GROUPS, {"match": "blocks.*.norm1", "level": 5, "through": "attn"}],
        ),
    ],
)
def test_beit_and_eva_groups_are_exact_and_hold_less(
    assert_exact,
    exact_step,
    saved_bytes,
    scratch_preset,
    arch: str,
    kwargs: dict[str, Any],
    rules: list[Any],
) -> None:
    torch.manual_seed(0)
    plain = timm.create_model(
        arch, pretrained=False, img_size=32, depth=4, num_classes=5, drop_path_rate=0.2, **kwargs
    ).train()
    x = torch.randn(2, 3, 32, 32)
    ref = exact_step(plain, x)
    held = {}
    for level in (3, 4, 5):
        model = copy.deepcopy(plain)
        config = {"training_checkpoint_level": level, "preset": scratch_preset(rules)}
        plan = vision_ckpt.apply(model, config)
        assert plan["blocks.0"].through == "1" and plan["blocks.2"].through == "3"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no run ends early
            with saved_bytes() as saved:
                model(x)
            assert_exact(exact_step(model, x), ref)
        held[level] = saved.nbytes
    assert held[4] < held[3]


def test_a_positional_tensor_changed_before_backward_is_an_error() -> None:
    class Changing(ListNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            shared = self.bias * 2
            for layer in self.layers:
                x = layer(x, shared)
            shared.mul_(2)  # after the layers were called with it
            return self.head(x)

    model = Changing(depth=4)  # two groups of two, where only the runs hold the tensor
    vision_ckpt.apply(model, {"training_checkpoint_level": 4, "rules": [GROUPS]})
    out = model(torch.randn(2, 6, 8))
    with pytest.raises(
        vision_ckpt.CheckpointError,
        match=r"member 'layers.\d' was called with the tensor argument #2, which was modified "
        r"in place before backward recomputed the run.*clone it",
    ):
        out.sum().backward()
