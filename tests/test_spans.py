"""trace_spans (vision_ckpt/tune/_spans.py): the candidate regions one traced forward gives, on a
hand-built model whose every span is known, and on timm models against what their
hand-written presets name; every emitted rule plans, and training under it stays exact."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import timm
import torch
from _models import UpTransition
from timm.layers import Mlp
from torch import nn

import vision_ckpt
from vision_ckpt.regions.apply import apply, plan
from vision_ckpt.tune._spans import Span, trace_spans


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.BatchNorm2d(c)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.norm(self.conv(x))))


class _Net(nn.Module):
    """A stem that is no module (conv, bn, act, pool called one by one), four equal residual
    blocks, a timm Mlp called after the head was registered (so mlp..head is no run)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.blocks = nn.Sequential(*[_Block(8) for _ in range(4)])
        self.head = nn.Linear(8, 10)
        self.mlp = Mlp(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act(self.bn(self.conv(x))))
        x = self.blocks(x).mean((2, 3))
        return self.head(self.mlp(x))


def _pairs(names: list[str], prefix: str = "") -> set[str]:
    """Labels of every contiguous run of two or more of ``names``."""
    return {
        f"{prefix}{names[i]}..{names[j]}"
        for i in range(len(names))
        for j in range(i + 1, len(names))
    }


def _by_kind(spans: list[Span], kind: str) -> set[str]:
    return {s.label for s in spans if s.kind == kind}


def test_hand_built_model_gives_exactly_its_spans() -> None:
    torch.manual_seed(0)
    spans = trace_spans(_Net().train(), torch.randn(2, 3, 8, 8))
    mlp = ["fc1", "act", "drop1", "norm", "fc2", "drop2"]
    expected_runs = (
        (_pairs(["conv", "bn", "act", "pool"]) - {"act..pool"})  # act is in place
        | {r for i in range(4) for r in _pairs(["conv", "norm", "act", "drop"], f"blocks.{i}.")}
        # all of the Mlp is the module itself; its p=0 dropout and identity norm return their
        # input and start nothing
        | {r for r in _pairs(mlp, "mlp.") if r.startswith(("mlp.fc1", "mlp.act", "mlp.fc2"))}
        - {"mlp.fc1..drop2"}
    )
    assert _by_kind(spans, "run") == expected_runs
    assert _by_kind(spans, "block") == {f"blocks.{i}" for i in range(4)}
    assert _by_kind(spans, "stage") == {"blocks"}
    assert _by_kind(spans, "groups") == {"blocks"}
    assert _by_kind(spans, "lean") == {"mlp"}
    modules = _by_kind(spans, "module")
    assert {"blocks.0", "conv", "pool"} <= modules and not {"", "act"} & modules
    stem = next(s for s in spans if s.label == "conv..pool")
    assert stem.members == ("conv", "bn", "act", "pool")
    assert stem.rule(2) == {"match": "conv", "level": 2, "through": "pool"}
    assert [s.order for s in spans] == sorted(s.order for s in spans)


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class _Bottleneck(nn.Module):
    """Three units of one class side by side, and an activation: layers, not a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.u1, self.u2, self.u3 = _Unit(), _Unit(), _Unit()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x + self.u3(self.u2(self.u1(x))))


class _Stage(nn.Module):
    """A stage class (no Sequential) holding only its blocks, calling them in order."""

    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2 = _Bottleneck(), _Bottleneck()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b2(self.b1(x))


def test_a_stage_class_holds_blocks_and_a_bottleneck_holds_layers() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 1), _Stage())
    spans = trace_spans(net, torch.randn(2, 3, 4, 4))
    assert _by_kind(spans, "block") == {"1.b1", "1.b2"}
    assert _by_kind(spans, "stage") == {"1"}
    assert _by_kind(spans, "groups") == set()  # segments split only a Sequential or ModuleList
    assert {"1.b1.u1..u2", "1.b1.u1..u3", "1.b1.u2..u3"} <= _by_kind(spans, "run")


def _step(model: nn.Module, x: torch.Tensor, counter: Any = None) -> dict[str, Any]:
    torch.manual_seed(7)  # dropout and drop-path draw the same masks in every run
    with counter if counter is not None else contextlib.nullcontext():
        out = model(x)
        out.float().square().mean().backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _ops(counter: Any) -> int:
    return sum(counter.counts.values())


def test_every_span_of_the_hand_built_model_trains_exactly(assert_exact, op_counter) -> None:
    torch.manual_seed(0)
    base = _Net().train()
    x = torch.randn(2, 3, 8, 8)
    spans = trace_spans(base, x)
    plain = op_counter()
    ref = _step(copy.deepcopy(base), x, plain)
    for span in spans:
        model = copy.deepcopy(base)
        apply(model, {"training_checkpoint_level": 3, "rules": [span.rule(3)]})
        counted = op_counter()
        got = _step(model, x, counted)
        assert_exact(got, ref, where=f"{span.kind} {span.label}")
        if span.kind != "lean":  # a region runs its forward again in backward
            assert _ops(counted) > _ops(plain), f"{span.kind} {span.label} recomputed nothing"


MODELS = {
    "resnet18": (lambda: timm.create_model("resnet18", drop_path_rate=0.1), 64),
    "vit_tiny": (
        lambda: timm.create_model(
            "vit_tiny_patch16_224",
            img_size=32,
            patch_size=8,
            depth=3,
            drop_rate=0.1,
            drop_path_rate=0.1,
        ),
        32,
    ),
    "convnext_atto": (lambda: timm.create_model("convnext_atto", drop_path_rate=0.1), 64),
    "efficientnet_b0": (lambda: timm.create_model("efficientnet_b0", drop_path_rate=0.1), 64),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_tracer_finds_what_the_preset_names(name: str) -> None:
    make, size = MODELS[name]
    torch.manual_seed(0)
    model = make().train()
    spans = trace_spans(model, torch.randn(1, 3, size, size))
    preset = plan(model, {"preset": "auto", "training_checkpoint_level": 5})
    # the runs of sibling calls the hand-tuning wrote (stems, attention halves, conv + BN-act)
    assert {label for _, label in preset.runs} <= _by_kind(spans, "run")
    # the stacks it groups by sqrt(n), the MLPs it makes lean
    grouped = {e.name for e in preset for r in e.rungs if r.segments is not None}
    assert grouped <= _by_kind(spans, "groups")
    assert {e.name for e in preset if e.lean is not None} <= _by_kind(spans, "lean")
    # and every rule the tracer emits is one plan() accepts on this model
    for span in spans:
        plan(model, {"training_checkpoint_level": 5, "rules": [span.rule(5)]})
    if name in ("resnet18", "efficientnet_b0", "vit_tiny"):
        assert preset.runs, "the preset names runs: the comparison above must not be empty"


def _config_of(spans: list[Span], labels: list[str], kinds: tuple[str, ...]) -> dict[str, Any]:
    chosen = [s for s in spans if s.label in labels and s.kind in kinds]
    assert {s.label for s in chosen} == set(labels)
    return {"training_checkpoint_level": 3, "rules": [s.rule(3) for s in chosen]}


@pytest.mark.parametrize(
    ("name", "labels", "kinds"),
    [
        ("resnet18", ["conv1..maxpool", "layer2", "layer3.0"], ("run", "stage", "block")),
        (
            "vit_tiny",
            ["blocks", "blocks.0.norm1..drop_path1", "blocks.1.norm2..drop_path2", "blocks.2.mlp"],
            ("run", "groups", "lean"),
        ),
    ],
)
def test_traced_rules_train_exactly_on_timm(
    name: str, labels: list[str], kinds: tuple[str, ...], assert_exact, op_counter
) -> None:
    make, size = MODELS[name]
    torch.manual_seed(0)
    base = make().train()
    x = torch.randn(2, 3, size, size)
    cfg = _config_of(trace_spans(base, x), labels, kinds)
    plain = op_counter()
    ref = _step(copy.deepcopy(base), x, plain)
    model = copy.deepcopy(base)
    apply(model, cfg)
    counted = op_counter()
    assert_exact(_step(model, x, counted), ref)
    assert _ops(counted) > _ops(plain)


class _SizedAttention(nn.Module):
    """A layer called with its input and a tuple of sizes, as PVT-v2's and Twins' are."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return self.proj(x) * (size[0] / size[1])


class _SizedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = _SizedAttention(width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.attn(self.norm(x), (4, 2)))


class _Heads(nn.Module):
    """A list of blocks called in order, each on its own slice: no chain (EfficientViT-MSRA's
    per-head convolutions)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.chunk(3, dim=0)
        return torch.cat([head(p) for head, p in zip(self.heads, parts, strict=True)])


def test_a_run_holds_no_call_whose_other_arguments_it_cannot_pass_again() -> None:
    # the replay of a run passes a member's further arguments again only if they are tensors
    # or plain values; a tuple of sizes would end the installed run there, with a warning
    spans = trace_spans(_SizedBlock(8), torch.randn(2, 5, 8))
    runs = [s for s in spans if s.kind == "run"]
    assert all("attn" not in s.members for s in runs), [s.label for s in runs]
    assert "attn" in {s.name for s in spans if s.kind == "module"}


def test_a_run_skips_a_child_registered_inside_it_and_called_elsewhere() -> None:
    torch.manual_seed(0)
    spans = trace_spans(UpTransition().train(), torch.randn(2, 8, 4, 4))
    runs = {s.label: s for s in spans if s.kind == "run"}
    # act is in place: no run starts there; skip_drop is called on the skip, before the run
    assert set(runs) == {"up..bn", "up..act", "up..drop", "bn..act", "bn..drop"}
    assert runs["up..drop"].members == ("up", "bn", "act", "drop")
    assert runs["up..drop"].rule(1) == {"match": "up", "level": 1, "through": "drop"}


def test_a_list_of_blocks_that_do_not_chain_is_no_groups() -> None:
    # `segments` runs its groups as runs: blocks each fed their own slice cannot be one
    spans = trace_spans(_Heads(8), torch.randn(6, 8))
    assert {s.name for s in spans if s.kind == "block"} == {"heads.0", "heads.1", "heads.2"}
    assert [s for s in spans if s.kind == "groups"] == []


def test_traced_attention_with_sizes_derives_without_a_broken_run(recwarn) -> None:
    # PVT-v2 calls its attention with the feature map's size: before, a derived run through it
    # stopped at that call on every step, warning each time
    torch.manual_seed(0)
    model = timm.create_model("pvt_v2_b0", pretrained=False, num_classes=10)
    found = vision_ckpt.tune.derive_preset(model, torch.randn(2, 3, 64, 64), 8, floor=False)
    for level in range(1, 6):
        m = copy.deepcopy(model)
        apply(m, found.config(level))
        m(torch.randn(2, 3, 64, 64)).sum().backward()
    assert not [w for w in recwarn if "ended after" in str(w.message)]


class _Mixing(nn.Module):
    """Two timm MLPs, one across channels and one across tokens on a transposed view, as
    MLP-Mixer's are."""

    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        self.channels = Mlp(width, 2 * width)
        self.tokens = Mlp(tokens, 2 * tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(x.transpose(1, 2)).transpose(1, 2)
        return x + self.channels(x)


def test_an_mlp_called_on_a_transposed_input_is_not_offered_lean() -> None:
    # the lean backward computes on its input as one matrix: on a transposed view it would run
    # the MLP's own forward instead, warning on every step
    spans = trace_spans(_Mixing(6, 8), torch.randn(2, 6, 8))
    assert {s.name for s in spans if s.kind == "lean"} == {"channels"}


def test_no_span_begins_with_a_call_that_writes_its_input() -> None:
    # torchvision's MNASNet head: the classifier begins with an in-place dropout, so neither
    # the classifier nor a run from its dropout can keep its input for the recomputation
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(8, 2)),
    )
    spans = trace_spans(net.train(), torch.randn(2, 3, 8, 8))
    labels = {(s.kind, s.label) for s in spans}
    assert ("module", "5.1") in labels
    assert not {lab for lab in labels if lab[1] == "5" or lab[1].startswith("5.0")}, labels
    # an out-of-place dropout leaves both
    net[5][0].inplace = False
    labels = {(s.kind, s.label) for s in trace_spans(net, torch.randn(2, 3, 8, 8))}
    assert {("module", "5"), ("module", "5.0")} <= labels


def test_an_input_made_under_inference_mode_traces() -> None:
    # an inference tensor has no version counter for the in-place check to read
    with torch.inference_mode():
        x = torch.randn(2, 3, 8, 8)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 2, 1))
    assert ("run", "0..2") in {(s.kind, s.label) for s in trace_spans(net.train(), x)}
