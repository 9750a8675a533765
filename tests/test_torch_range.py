"""What holds on every supported torch, whichever of its entry points are native
(``vision_ckpt._compat``): CI runs this file on the newest torch and on the floor."""

from __future__ import annotations

import warnings

import timm
import torch
from torch import nn

import vision_ckpt
from vision_ckpt import _compat, checkpoint
from vision_ckpt.measure._memory import count_saved_bytes


def test_features_name_what_is_native() -> None:
    features = _compat.features()
    assert set(features) == {
        "compiled_checkpoint_keeps_batchnorm",
        "make_saved_tensor",
        "top_saved_hooks",
        "graph_exec_group",
        "selective_keeps_hooks",
        "region_subgraphs",
    }
    assert all(isinstance(v, bool) for v in features.values())


def test_a_region_sees_counting_hooks_below_its_own() -> None:
    """The protocol torch's selective mode and the selective fallback read: inside a region, the
    first hooks that are not a checkpoint's own are the counting hooks around it."""
    seen = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def region(t: torch.Tensor) -> torch.Tensor:
        seen.append(_compat.user_saved_tensors_hooks())
        return t.sin().cos()

    x = torch.randn(4, requires_grad=True)
    with _compat.saved_tensors_hooks(pack, lambda t: t):
        checkpoint(region, x).sum().backward()
    assert [hooks[0] for hooks in seen] == [pack, pack]  # forward and recomputation
    assert _compat.top_pack_hook() is None


class _Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _saved(keep: dict[str, str]) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    rules = [{"match": "*", "level": 2, **keep}]
    vision_ckpt.apply(model, {"training_checkpoint_level": 2, "rules": rules})
    x = torch.randn(8, 16, requires_grad=True)
    with count_saved_bytes(model) as saved:
        out = model(x)
    out.sum().backward()
    return saved.nbytes, x.grad


def test_a_selective_region_is_counted_keeping_its_heavy_outputs() -> None:
    full, full_grad = _saved({})
    selective, selective_grad = _saved({"keep": "heavy"})
    f32 = 4
    assert full == 8 * 16 * f32 * 2  # each region keeps its input
    # each region keeps its input (the residual sum before it) and its two linear outputs
    assert selective == 2 * (8 * 16 + 8 * 64 + 8 * 16) * f32
    torch.testing.assert_close(selective_grad, full_grad, rtol=0, atol=0)


def _graph_breaks(name: str, level: int) -> tuple[int, list[str]]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=4)
    vision_ckpt.apply_preset(model, level=level)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(torch.randn(2, 3, 32, 32)).sum().backward()
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return breaks, [str(w.message) for w in caught]


def test_a_compiled_level_breaks_the_graph_no_more_than_level_0() -> None:
    """The regions' training level is handed to them outside torch's checkpoint operator, and
    a selective policy as constants: no release's dynamo breaks the graph at such a region
    (ConvNeXt's level 2 nests its blocks in selective stages)."""
    assert _graph_breaks("convnext_atto", 2)[0] == _graph_breaks("convnext_atto", 0)[0] == 0


def test_batchnorm_regions_compile_where_torch_updates_statistics_once(monkeypatch) -> None:
    """Where torch's compiled checkpoint updates BatchNorm statistics twice, such regions run
    between graphs, and the first says so; elsewhere they compile into one graph."""
    from vision_ckpt.runtime import _traced

    monkeypatch.setattr(_traced, "_compile_notes_shown", set())  # shown once per process
    breaks, messages = _graph_breaks("resnet18", 2)
    between = [m for m in messages if "BatchNorm running statistics twice" in m]
    if _compat.COMPILED_CHECKPOINT_KEEPS_BATCHNORM:
        assert breaks == 0 and not between
    else:
        assert breaks > 0 and len(between) == 1
