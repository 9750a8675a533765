"""What a selective policy keeps when the model runs on CUDA, seen without a GPU.

The installed torch is a CUDA build: under ``FakeTensorMode`` a model moved to ``"cuda"`` runs
its forward with fake tensors and CUDA's dispatch (batch norm as ``cudnn_batch_norm``; under
bf16 autocast, ``_to_copy`` casts before each convolution and matrix product), and no kernel
runs. Backward does not run this way, and SDPA takes its math path (a GPU would pick flash or
memory-efficient attention, which the default policy names too).

For a ResNet, a ViT and a ConvNeXt at levels 1-2 of their presets, in fp32 and bf16, these
tests record what each selective region's policy decides about every operator of its forward
(``SaveOps.keeps``, attributed to the innermost selective region running) and check that on
CUDA every selective region keeps the outputs of the operators its policy names, the same ones
as on CPU, and that under bf16 what it keeps are the bf16 results (the casts before them are
recomputed).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import timm
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import vision_ckpt
from vision_ckpt.runtime._selective import HEAVY_OPS, SaveOps

pytestmark = pytest.mark.needs_fake_cuda

# Fused attention on CPU / a GPU, and what SDPA's math path (fake CUDA) multiplies with.
ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten.bmm",
    "aten.baddbmm",
}


def _resnet() -> torch.nn.Module:
    return timm.create_model("resnet18", pretrained=False, num_classes=10)


def _vit() -> torch.nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3, num_classes=10
    )


def _convnext() -> torch.nn.Module:
    return timm.create_model("convnext_atto", pretrained=False, num_classes=10)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "resnet18": _resnet,
    "vit_tiny": _vit,
    "convnext_atto": _convnext,
}


def _op_name(op: Any) -> str:
    packet = getattr(op, "overloadpacket", op)
    return packet._qualified_op_name.replace("::", ".")


class Decisions:
    """What the selective policies decided during one forward, by innermost selective region."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.kept: dict[str, Counter[str]] = defaultdict(Counter)
        self.kept_dtypes: dict[str, set[torch.dtype]] = defaultdict(set)
        self.policies: set[SaveOps] = set()

    def covered(self, regions: list[str]) -> set[str]:
        """The regions that kept an output, themselves or in a region nested in them."""
        return {r for r in regions if any(k == r or k.startswith(r + ".") for k in self.kept)}

    def kept_except_attention(self) -> dict[str, Counter[str]]:
        return {
            r: Counter({op: n for op, n in ops.items() if op not in ATTENTION})
            for r, ops in self.kept.items()
        }


@contextlib.contextmanager
def _recorded(model: torch.nn.Module, regions: list[str], monkeypatch) -> Iterator[Decisions]:
    seen = Decisions()
    keeps = SaveOps.keeps

    def recording_keeps(self: SaveOps, op: Any, args: Any, *rest: Any, **kw: Any) -> bool:
        kept = keeps(self, op, args, *rest, **kw)
        seen.policies.add(self)
        if kept and seen.running:
            seen.kept[seen.running[-1]][_op_name(op)] += 1
            first = next(a for a in args if isinstance(a, torch.Tensor))
            seen.kept_dtypes[_op_name(op)].add(first.dtype)
        return kept

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:  # a hook's return value would replace the input
            seen.running.append(name)

        return hook

    def leave(*_: Any) -> None:  # ... or the output
        seen.running.pop()

    handles = []
    for name in regions:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    monkeypatch.setattr(SaveOps, "keeps", recording_keeps)
    try:
        yield seen
    finally:
        monkeypatch.undo()
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _cuda_autocast_bf16() -> Iterator[None]:
    """bf16 autocast for device "cuda" without a GPU: ``torch.autocast("cuda")`` turns itself
    off when no device is present, so the state is set directly."""
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.autocast_decrement_nesting()
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", torch.float16)


def _selective_regions(plan: Any, level: int) -> list[str]:
    out = []
    for entry in plan:
        rung = entry.rung_at(level)
        if entry.checkpointed and rung is not None and rung.selective:
            out.append(entry.name)
    return out


def _forward(
    family: str, level: int, device: str, bf16: bool, monkeypatch
) -> tuple[list[str], Decisions]:
    torch.manual_seed(0)
    model = MODELS[family]().train()
    plan = vision_ckpt.apply_preset(model, level)
    regions = _selective_regions(plan, level)
    with _recorded(model, regions, monkeypatch) as seen:
        if device == "cpu":
            model(torch.randn(2, 3, 32, 32))
        else:
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = model.to("cuda")
                x = torch.randn(2, 3, 32, 32, device="cuda")
                with _cuda_autocast_bf16() if bf16 else contextlib.nullcontext():
                    out = model(x)
                assert out.device.type == "cuda"
                assert out.dtype == (torch.bfloat16 if bf16 else torch.float32)
    return regions, seen


# (family, level) with selective regions; ViT's level 2 has none (its layers' selective rung
# steps aside for the full MLP regions inside them, NOTE [ Selective regions step aside ]).
CASES = [
    ("resnet18", 1),
    ("resnet18", 2),
    ("vit_tiny", 1),
    ("convnext_atto", 1),
    ("convnext_atto", 2),
]


def test_vit_level_2_has_no_selective_region() -> None:
    plan = vision_ckpt.plan(_vit(), vision_ckpt.CheckpointConfig(preset="auto"))
    assert _selective_regions(plan.at_level(2), 2) == []
    assert _selective_regions(plan.at_level(1), 1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("family", "level"), CASES)
def test_selective_policies_keep_the_operators_they_name_on_cuda(
    family: str, level: int, dtype: str, monkeypatch
) -> None:
    bf16 = dtype == "bf16"
    regions, cuda = _forward(family, level, "cuda", bf16, monkeypatch)
    assert regions
    assert cuda.policies and all(p.default and p.names == HEAVY_OPS for p in cuda.policies)
    # every selective region kept what its policy names (itself or in a selective region nested
    # in it), and only named operators
    assert cuda.covered(regions) == set(regions)
    named = set(HEAVY_OPS)
    assert all(set(ops) <= named for ops in cuda.kept.values())
    # the same convolutions and linear layers as on CPU, region by region; attention is fused
    # on CPU and a GPU, and the matrix products of SDPA's math path under fake CUDA
    _, cpu = _forward(family, level, "cpu", False, monkeypatch)
    assert set(cpu.kept) == set(cuda.kept)
    assert cuda.kept_except_attention() == cpu.kept_except_attention()
    for region in cuda.kept:
        assert any(op in ATTENTION for op in cuda.kept[region]) == any(
            op in ATTENTION for op in cpu.kept[region]
        ), region
    # under bf16 autocast the kept outputs are the bf16 products (the casts are recomputed);
    # SDPA's math path, which only fake CUDA takes, computes in fp32
    dtypes = {op: d for op, d in cuda.kept_dtypes.items() if op not in ATTENTION}
    assert dtypes and all(d == {torch.bfloat16 if bf16 else torch.float32} for d in dtypes.values())
    # and the policy's own check, run when a region is first recomputed, finds nothing unmet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for policy in cuda.policies:
            policy.report_unmet("after a fake CUDA forward")


def test_a_policy_naming_cpu_batch_norm_keeps_nothing_on_cuda_and_says_so(monkeypatch) -> None:
    """Batch norm on CUDA is ``cudnn_batch_norm``: a policy written for CPU's
    ``native_batch_norm`` keeps it on CPU, nothing on CUDA, and says so there instead of
    silently keeping nothing."""
    names = ("aten.native_batch_norm",)
    stages = [f"layer{i}" for i in range(1, 5)]
    kept = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = _resnet().train()
        keep = {"match": "layer*", "level": 1, "keep": {"ops": names}}
        vision_ckpt.apply_preset(model, 1, rules=[keep])
        with _recorded(model, stages, monkeypatch) as seen:
            if device == "cpu":
                model(torch.randn(2, 3, 32, 32))
            else:
                with FakeTensorMode(allow_non_fake_inputs=True):
                    model = model.to("cuda")
                    model(torch.randn(2, 3, 32, 32, device="cuda"))
        kept[device] = sum(seen.kept.values(), Counter())
        (policy,) = {p for p in seen.policies if p.names == names}
    assert kept["cpu"] == Counter({"aten.native_batch_norm": 19})
    assert kept["cuda"] == Counter()
    with pytest.warns(UserWarning, match=r"ran none of the operators aten\.native_batch_norm"):
        policy.report_unmet("layer1")


class _Clones(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket is torch.ops.aten.clone:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_selective_forward_on_fake_cuda_copies_no_kept_output() -> None:
    """The guard that copies a kept output before an in-place write into it (NOTE [ Kept
    outputs written in place ] in ``_selective``) must tell storages apart under fake tensors, what
    torch.compile traces with: it used to compare data pointers, 0 for every fake tensor, and
    cloned every kept output at every in-place operator (134 clones in resnet18's level-1
    forward, 0 on CPU)."""
    clones = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = _resnet().train()
        vision_ckpt.apply_preset(model, 1)
        counter = _Clones()
        if device == "cpu":
            with counter:
                model(torch.randn(2, 3, 32, 32))
        else:
            with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # FakeTensor's data_ptr deprecation
                model = model.to("cuda")
                x = torch.randn(2, 3, 32, 32, device="cuda")
                with counter:
                    model(x)
        clones[device] = counter.count
    assert clones["cpu"] == 0  # resnet18 writes into no kept convolution output
    assert clones["cuda"] == clones["cpu"]
