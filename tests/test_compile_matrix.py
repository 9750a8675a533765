"""Compile parity: one tiny model per preset family x levels 0-5 under ``torch.compile``.

Each case applies the family's preset at a level, takes one training step eagerly and one under
``torch.compile(backend="aot_eager")`` from the same weights, and compares every gradient within
1e-5 relative to the largest element of that gradient (AOTAutograd runs the same aten kernels as
eager, but the partitioner may reorder a reduction) and every buffer (BatchNorm running stats:
``num_batches_tracked`` exactly, means and variances within the same tolerance).

Dropout and drop-path are off in the comparison: under compile the random operators run in the
graph AOTAutograd traced, which draws in another order than the eager step (and inductor
replaces them with its own Philox-based ones), so the masks differ between the two runs for a
reason unrelated to checkpointing. Random operators inside regions are covered eagerly, where
the masks can be compared (tests/test_strategies.py, tests/test_core.py).

The full 36 cases took 200 s on one thread of the shared CI machine (``pytest -m "slow or not
slow" tests/test_compile_matrix.py --durations=0``: 2-14 s a case, Swin the slowest); the
default suite runs a subset of 7 that covers every family and every level at least once, and
``benchmarks/compile_matrix.py`` runs the issue's own models (64 px, full depth).
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import vision_ckpt

# Tiny configs of one model per preset family (dropout and drop-path off, see above).
FAMILIES: dict[str, tuple[str, dict, int]] = {
    "resnet": ("resnet18", {"layers": (3, 1, 1, 1)}, 32),  # level 5: layer1 in 2 segments
    "vit": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2}, 32),
    "convnext": ("convnext_atto", {"depths": (1, 1, 1, 1), "drop_path_rate": 0.0}, 32),
    "efficientnet": ("test_efficientnet", {"drop_path_rate": 0.0}, 32),
    "swin": (
        "swin_tiny_patch4_window7_224",
        {
            "img_size": 32,
            "window_size": 2,
            "depths": (1, 1, 2, 1),
            "embed_dim": 24,
            "num_heads": (1, 2, 3, 4),
            "drop_path_rate": 0.0,
        },
        32,
    ),
    "densenet": ("densenet121", {"block_config": (1, 2, 2, 1), "growth_rate": 8}, 32),
}
LEVELS = range(6)
# Every family and every level at least once in the default suite (level 5 of the ViT in
# test_compiled_vit_level_5_runs_its_lean_mlps_and_warns_about_its_runs); the rest is slow.
DEFAULT = {
    ("resnet", 1),
    ("resnet", 5),
    ("vit", 0),
    ("convnext", 2),
    ("efficientnet", 3),
    ("swin", 1),
    ("densenet", 4),
}
RTOL = 1e-5


def build(family: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    name, options, size = FAMILIES[family]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5, drop_rate=0.0, **options)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, size, size, generator=gen)
    return model.train(), x, torch.tensor([1, 3])


def step(model: nn.Module, call, x: torch.Tensor, y: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(call(x), y).backward()
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def assert_close(got: dict, expected: dict) -> None:
    assert got["grads"].keys() == expected["grads"].keys()
    for kind in ("grads", "buffers"):
        for name, want in expected[kind].items():
            have = got[kind][name]
            if not want.is_floating_point():
                assert torch.equal(have, want), f"{kind} {name}: {have} != {want}"
                continue
            scale = want.abs().max().item() or 1.0
            error = (have - want).abs().max().item() / scale
            assert error <= RTOL, f"{kind} {name} off by {error:.2e} relative"


def compiled_matches_eager(family: str, level: int, steps: int = 1) -> None:
    model, x, y = build(family)
    eager, compiled = model, copy.deepcopy(model)
    vision_ckpt.apply_preset(eager, level=level)
    vision_ckpt.apply_preset(compiled, level=level)
    torch._dynamo.reset()
    call = torch.compile(compiled, backend="aot_eager")
    with warnings.catch_warnings():
        # runs of sibling calls warn under compile (tested below); nothing else may fail
        warnings.filterwarnings("ignore", message="the checkpointed run")
        for _ in range(steps):
            expected = step(eager, eager, x, y)
            got = step(compiled, call, x, y)
            assert_close(got, expected)


CASES = [
    pytest.param(f, lv, marks=() if (f, lv) in DEFAULT else pytest.mark.slow, id=f"{f}-L{lv}")
    for f in FAMILIES
    for lv in LEVELS
]


@pytest.mark.parametrize(("family", "level"), CASES)
def test_compiled_step_matches_eager(family: str, level: int) -> None:
    compiled_matches_eager(family, level)


def test_batchnorm_running_stats_match_after_compiled_steps() -> None:
    """Two steps: BatchNorm statistics are updated once per step under compile too (the
    partitioner recomputes the traced graph, whose buffer updates are applied once), through
    selective regions (the stem) and full ones (the residual blocks) at level 2."""
    compiled_matches_eager("resnet", 2, steps=2)


def test_compiled_segments_inside_a_stack_match_eager() -> None:
    """A stack recomputed in segments inside its own region, its layers no regions of their
    own: under compile the region runs between graphs, with the same gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(16, 16), nn.GELU()))),
        nn.Linear(16, 5),
    )
    rules = [{"match": "0", "level": 2}, {"match": "0", "level": 3, "segments": 4}]
    eager, compiled = model, copy.deepcopy(model)
    for m in (eager, compiled):
        vision_ckpt.apply(m, {"training_checkpoint_level": 3, "rules": rules})
    torch._dynamo.reset()
    call = torch.compile(compiled, backend="aot_eager")
    x, y = torch.randn(4, 16), torch.tensor([0, 1, 2, 3])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'0' holds checkpointed regions")
        assert_close(step(compiled, call, x, y), step(eager, eager, x, y))
        graphs = {}
        for level in (2, 3):  # the stack's region alone compiles into the graph
            vision_ckpt.apply(compiled, {"training_checkpoint_level": level, "rules": rules})
            torch._dynamo.reset()
            e = torch._dynamo.explain(compiled)(x)
            graphs[level] = (e.graph_count, e.graph_break_count)
    assert graphs[2] == (1, 0) and graphs[3] != (1, 0), graphs


def _subgraph_bodies(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    return [
        getattr(gm, n.args[0].target)
        for n in gm.graph.nodes
        if n.op == "call_function" and "invoke_subgraph" in str(n.target)
    ]


def _regions_in(gm: torch.fx.GraphModule) -> int:
    """How many checkpointed regions a captured graph calls at its top (not nested ones),
    directly or as the body of a region's own subgraph (NOTE [ A region is its own
    subgraph ])."""
    tagged = sum(
        n.op == "call_function" and "tag_activation_checkpoint" in str(n.target)
        for n in gm.graph.nodes
    )
    return tagged + sum(_regions_in(body) for body in _subgraph_bodies(gm))


def _capturing(graphs: list[torch.fx.GraphModule]) -> Any:
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    return backend


def test_compiled_vit_level_5_keeps_its_plan() -> None:
    """ViT's level 5 nests runs and layers inside groups of layers. Runs apply under compile
    (one function over their calls), and the groups, which hold fully checkpointed regions,
    run between graphs (NOTE [ Nested regions under torch.compile ]): the plan leaves nothing
    out, one warning says so, and the gradients are eager's."""
    model, x, y = build("vit")
    eager = copy.deepcopy(model)
    vision_ckpt.apply_preset(eager, level=5)
    plan = vision_ckpt.apply_preset(model, level=5)
    assert plan.not_compiled == ()
    assert any(e.nests_full for e in plan.entries)
    torch._dynamo.reset()
    call = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert_close(step(model, call, x, y), step(eager, eager, x, y))
    assert not [w for w in caught if "checkpointed run" in str(w.message)]
    nested = [w for w in caught if "holds checkpointed regions" in str(w.message)]
    assert len(nested) <= 1  # once per process (an earlier test may have shown it)


def test_compiled_lean_mlps_are_traced_into_the_graph() -> None:
    """Lean MLPs compile: dynamo traces their autograd.Function, one per MLP in the captured
    graph, with no graph break."""
    model, x, y = build("vit")
    eager = copy.deepcopy(model)
    rules = [{"match": "blocks.*.mlp", "level": 1, "lean": True}]
    config = {"training_checkpoint_level": 1, "rules": rules}
    vision_ckpt.apply(eager, config)
    vision_ckpt.apply(model, config)
    graphs: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    call = torch.compile(model, backend=_capturing(graphs))
    assert_close(step(model, call, x, y), step(eager, eager, x, y))
    assert len(graphs) == 1
    code = graphs[0].print_readable(print_output=False)
    mlps = sum(type(m).__name__ == "Mlp" for m in model.modules())
    assert mlps and len(re.findall(r"autograd_function_apply\(", code)) == mlps


def test_no_warning_where_nothing_is_left_out() -> None:
    """A level without runs compiles silently (the warning is not a blanket one)."""
    model, x, y = build("vit")
    assert vision_ckpt.apply_preset(model, level=4).not_compiled == ()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, torch.compile(model, backend="aot_eager"), x, y)
    assert not [w for w in caught if "torch.compile" in str(w.message)]


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(self.norm(x))
        return x + F.gelu(h if bias is None else h + bias)


class _Stacks(nn.Module):
    """A Sequential stack (segments) and a ModuleList the parent calls layer by layer with a
    shared tensor (groups of a ModuleList, as BEiT and EVA)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.seq = nn.Sequential(*(_Layer(width) for _ in range(4)))
        self.bias = nn.Parameter(torch.zeros(width))
        self.layers = nn.ModuleList(_Layer(width) for _ in range(4))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.seq(self.stem(x))
        shared = self.bias * 2
        for layer in self.layers:
            x = layer(x, bias=shared)
        return self.head(x)


RULES = [
    {"match": "seq.*", "level": 1, "keep": "heavy"},
    {"match": "seq.*", "level": 2},
    {"match": "seq", "level": 4, "segments": 2},
    {"match": "layers.*", "level": 3},
    {"match": "layers", "level": 4, "segments": 2},
]


@pytest.mark.parametrize(("level", "regions"), [(1, 4), (2, 4), (3, 8), (4, 0)])
def test_strategies_under_compile_match_eager(level: int, regions: int) -> None:
    """Selective (1) and full (2, 3) regions compile into one graph. At level 4 the segments
    of the Sequential and the groups of the ModuleList (runs of calls with a shared tensor)
    hold fully checkpointed layers, so they run between graphs (NOTE [ Nested regions under
    torch.compile ]): no region is left in a graph, and the gradients are eager's."""
    torch.manual_seed(0)
    eager = _Stacks().train()
    compiled = copy.deepcopy(eager)
    config = {"training_checkpoint_level": level, "rules": RULES}
    plan = vision_ckpt.apply(eager, config)
    vision_ckpt.apply(compiled, config)
    assert plan.not_compiled == ()
    x, y = torch.randn(4, 5, 8), torch.tensor([0, 1, 2, 0])

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.mean(1), y)

    graphs: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    call = torch.compile(compiled, backend=_capturing(graphs))
    for fn in (eager, call):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss(fn(x)).backward()
        assert not [w for w in caught if "not applied" in str(w.message)]
    assert sum(_regions_in(g) for g in graphs) == regions
    assert len(graphs) == 1 or level == 4
    expected = {n: p.grad for n, p in eager.named_parameters()}
    got = {n: p.grad for n, p in compiled.named_parameters()}
    assert_close({"grads": got, "buffers": {}}, {"grads": expected, "buffers": {}})


class _Detour(nn.Module):
    """A parent that calls its run's members out of order once in a while: ``a`` and ``b`` are
    a run, but with ``detour`` set the parent scales ``a``'s output before ``b`` takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.detour = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h * 2 if self.detour else h)


def test_a_run_its_parent_breaks_under_compile_warns_and_stays_exact() -> None:
    torch.manual_seed(0)
    eager = _Detour().train()
    eager.detour = True
    compiled = copy.deepcopy(eager)
    config = {"training_checkpoint_level": 2, "rules": [{"match": "a", "through": "b", "level": 2}]}
    vision_ckpt.apply(compiled, config)
    x = torch.randn(3, 8)
    eager(x).sum().backward()
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"run 'a\.\.b' ended at 'b', which was not called with"):
        torch.compile(compiled, backend="aot_eager")(x).sum().backward()
    got = {n: p.grad for n, p in compiled.named_parameters()}
    expected = {n: p.grad for n, p in eager.named_parameters()}
    assert_close({"grads": got, "buffers": {}}, {"grads": expected, "buffers": {}})


def test_offload_under_compile_is_a_full_region_and_warns() -> None:
    torch.manual_seed(0)
    eager = _Stacks().train()
    compiled = copy.deepcopy(eager)
    config = {
        "training_checkpoint_level": 3,
        "rules": [{"match": "seq.1", "level": 3, "offload": True}],
    }
    plan = vision_ckpt.apply(eager, config)
    vision_ckpt.apply(compiled, config)
    assert plan.not_compiled == ("seq.1 (offload)",)
    x = torch.randn(4, 5, 8)
    eager(x).square().sum().backward()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(compiled, backend="aot_eager")(x).square().sum().backward()
    assert [str(w.message) for w in caught if "offload" in str(w.message)] == [
        "'seq.1' is offloaded (offload: true), which torch.compile does not apply: under "
        "compile the region is a full one whose inputs stay on the device (gradients are exact). "
        "CheckpointPlan.not_compiled lists such modules. (Shown once.)"
    ]
    expected = {n: p.grad for n, p in eager.named_parameters()}
    got = {n: p.grad for n, p in compiled.named_parameters()}
    assert_close({"grads": got, "buffers": {}}, {"grads": expected, "buffers": {}})


class _Residual(nn.Module):
    def __init__(self, width: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.norm = norm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


@pytest.mark.skipif(
    not vision_ckpt._compat.features()["region_subgraphs"],
    reason=f"torch {torch.__version__} traces every region into the graph around it",
)
def test_outermost_regions_compile_as_their_own_subgraphs() -> None:
    """Each outermost region is torch's checkpoint inside a subgraph, so that the compiled
    backward recomputes one region at a time (NOTE [ A region is its own subgraph ]): three
    identical LayerNorm blocks share one subgraph body, called three times; the two BatchNorm
    blocks stay in the graph (a shared subgraph may not write their statistics). One graph, no
    break, and the gradients and statistics are eager's."""
    torch.manual_seed(0)
    eager = nn.Sequential(
        *[_Residual(16, nn.LayerNorm) for _ in range(3)],
        *[_Residual(16, nn.BatchNorm1d) for _ in range(2)],
    ).train()
    compiled = copy.deepcopy(eager)
    config = {"training_checkpoint_level": 2, "rules": [{"match": "*", "level": 2}]}
    vision_ckpt.apply(eager, config)
    vision_ckpt.apply(compiled, config)
    graphs: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    call = torch.compile(compiled, backend=_capturing(graphs))
    # the input needs a gradient: torch traces in place a region none of whose inputs does
    x = torch.randn(8, 16, requires_grad=True)
    for fn in (eager, call):
        fn(x).square().sum().backward()
    assert len(graphs) == 1
    bodies = _subgraph_bodies(graphs[0])
    assert len(bodies) == 3  # the LayerNorm blocks
    assert all(_regions_in(body) == 1 for body in bodies)
    assert _regions_in(graphs[0]) == 5  # and the BatchNorm blocks in the graph itself
    expected = {n: p.grad for n, p in eager.named_parameters()}
    got = {n: p.grad for n, p in compiled.named_parameters()}
    assert_close(
        {"grads": got, "buffers": dict(compiled.named_buffers())},
        {"grads": expected, "buffers": dict(eager.named_buffers())},
    )
