"""Counting a training step on fake tensors gives the real step's bytes, byte for byte.

The oracle is the real step under the same byte tracker (``step_memory(..., fake=False)``):
peak, activation and saved bytes, and the live bytes after every operator, at every level.
"""

from __future__ import annotations

import pytest
import timm
import torch
from test_cli_models import HF_VIT, SWIN3D, UNET
from torch import nn

import vision_ckpt
from vision_ckpt.measure import build_model, step_memory
from vision_ckpt.measure._measure import FakeMeter, Workload, run_step, tracked_step
from vision_ckpt.measure._price import ModelledClock, modelled_step_seconds
from vision_ckpt.measure.models import output_loss

# the six frontier presets, shrunk to run in seconds (the slow test runs them at full size)
SMALL = [
    ("resnet50", {}, 32),
    ("convnext_atto", {}, 64),  # at 32 px its last stage runs on 1x1 maps: see the NOTE
    ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8}, 32),
    ("efficientnet_b0", {}, 32),
    ("swin_tiny_patch4_window7_224", {"img_size": 64, "window_size": 4}, 64),
    ("densenet121", {}, 32),
]
FRONTIER = [
    "resnet50",
    "convnext_tiny",
    "vit_small_patch16_224",
    "efficientnet_b0",
    "swin_tiny_patch4_window7_224",
    "densenet121",
]


def _regularised(name: str, **kwargs: object) -> nn.Module:
    """A timm model with its dropout or drop-path on, so the RNG is part of what is compared."""
    extra = {"drop_rate": 0.1} if name.startswith("densenet") else {"drop_path_rate": 0.1}
    return timm.create_model(name, pretrained=False, **extra, **kwargs).train()


def _both(model: nn.Module, x: torch.Tensor) -> tuple[object, object, list[int], list[int]]:
    """The real and the fake step's memory and timelines, at the training level in force."""
    work = Workload(model, x, output_loss)
    real_line: list[int] = []
    fake_line: list[int] = []
    real = tracked_step(work, x, real_line)
    meter = FakeMeter(smallest=0)
    fake = meter.read(work, x, fake_line)
    assert meter.fallback is None
    return real, fake, real_line, fake_line


def _assert_every_level_equal(model: nn.Module, x: torch.Tensor, timelines: bool = True) -> None:
    """Peak, activation and saved bytes equal at every level; with ``timelines``, also the
    live bytes after every operator (a convolution's weight gradient can take one copy more on
    fakes: NOTE [ Counting a step without kernels ])."""
    vision_ckpt.apply(model, vision_ckpt.CheckpointConfig(preset="auto"))
    for level in range(6):
        with vision_ckpt.training_level(level):
            real, fake, real_line, fake_line = _both(model, x)
        assert fake == real, f"level {level}: fake {fake} != real {real}"
        assert max(fake_line) == max(real_line)
        if timelines:
            assert fake_line == real_line, f"level {level}: the timelines differ"


@pytest.mark.parametrize(("name", "kwargs", "px"), SMALL, ids=[s[0] for s in SMALL])
def test_fake_bytes_equal_the_real_step_at_every_level(name, kwargs, px) -> None:
    torch.manual_seed(0)
    model = _regularised(name, **kwargs)
    _assert_every_level_equal(model, torch.randn(4, 3, px, px))


@pytest.mark.parametrize(
    ("spec", "shape"),
    [(UNET, (3, 64, 64)), (SWIN3D, (1, 32, 32, 32)), (HF_VIT, (3, 32, 32))],
    ids=["smp-unet", "monai-swinunetr", "hf-vit"],
)
def test_fake_bytes_equal_the_real_step_for_other_libraries(spec, shape) -> None:
    torch.manual_seed(0)
    model = build_model(spec).train()
    _assert_every_level_equal(model, torch.randn(2, *shape), timelines=len(shape) == 3)


@pytest.mark.slow
@pytest.mark.parametrize("name", FRONTIER)
def test_fake_bytes_equal_the_real_step_for_the_frontier_at_batch_8(name) -> None:
    torch.manual_seed(0)
    _assert_every_level_equal(_regularised(name), torch.randn(8, 3, 224, 224))


def test_a_fake_step_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = _regularised("resnet18", num_classes=10)
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    params = {name: p for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    step_memory(model, torch.randn(2, 3, 32, 32))
    assert not model.training  # the mode is put back
    assert {name: p for name, p in model.named_parameters()} == params
    for key, value in model.state_dict().items():
        assert type(value) is torch.Tensor
        assert torch.equal(value, state[key]), key  # BatchNorm's statistics included
    assert torch.equal(model.fc.weight.grad, torch.ones_like(model.fc.weight))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "fc.weight")


def test_tied_weights_count_as_in_a_real_step() -> None:
    torch.manual_seed(0)
    tied = nn.Sequential(nn.Embedding(10, 32), nn.Linear(32, 10))
    tied[1].weight = tied[0].weight
    tokens = torch.randint(0, 10, (4, 6))
    loss = lambda out: out.float().square().mean()  # noqa: E731
    assert step_memory(tied, tokens, loss_fn=loss) == step_memory(
        tied, tokens, loss_fn=loss, fake=False
    )


def test_an_optimizer_that_reads_its_step_count_is_counted_for_real() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 32)
    work = Workload(model, x, lambda out: out.square().mean(), optimizer)
    tracked_step(work, x, None)  # the optimizer has its state now
    meter = FakeMeter(smallest=0)
    fake = meter.read(work, x, None)
    assert meter.fallback is not None and "DataDependentOutputException" in meter.fallback
    assert fake == tracked_step(work, x, None)


class _ValueDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        return y[y > 0]  # a shape read from the data


def test_a_step_that_depends_on_values_is_counted_for_real_and_says_so() -> None:
    torch.manual_seed(0)
    model = _ValueDependent()
    x = torch.randn(4, 8)
    work = Workload(model, x, lambda out: out.sum())
    meter = FakeMeter(smallest=0)
    step = meter.read(work, x, None)
    assert meter.fallback is not None
    assert "depends on values" in meter.fallback
    assert step == tracked_step(work, x, None)


def test_a_modelled_step_on_fakes_is_priced_as_the_real_step() -> None:
    torch.manual_seed(0)
    model = _regularised("vit_tiny_patch16_224", img_size=112)
    x = torch.randn(4, 3, 112, 112)  # over FAKE_FROM elements: priced on fakes
    work = Workload(model, x, output_loss)
    vision_ckpt.apply(model, vision_ckpt.CheckpointConfig(preset="auto"))
    for level in (0, 3):
        with vision_ckpt.training_level(level), ModelledClock("cpu") as clock:
            run_step(work, x)
        with vision_ckpt.training_level(level):
            assert modelled_step_seconds(work, x) == pytest.approx(clock.seconds, rel=1e-12)


def test_fit_counts_on_fakes_says_what_it_measures_and_models_its_times() -> None:
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    said: list[str] = []
    # batches of 2-4 images of 160 px: over FAKE_FROM elements, so counted and priced on fakes
    # batches of 2-4 images of 160 px: over FAKE_FROM elements, so counted and priced on fakes
    fit = vision_ckpt.tune.max_batch(
        model,
        (3, 160, 160),
        "2GiB",
        levels=[0, 5],
        include_own_switch=False,
        on_progress=said.append,
    )
    assert said[:3] == [f"level 0: batch {b} ({i} of 3)" for i, b in enumerate((2, 3, 4), 1)]
    assert fit.clock == "modelled"
    level0, level5 = fit.row("level 0"), fit.row("level 5")
    # recomputation costs time on the modelled clock, always
    assert level5.measurement.seconds_per_sample > level0.measurement.seconds_per_sample
    with pytest.raises(vision_ckpt.ConfigError, match="clock='wall' is not valid"):
        vision_ckpt.tune.max_batch(model, (3, 32, 32), "256MiB", clock="wall")  # type: ignore[arg-type]


class _Caching(nn.Module):
    """Caches a tensor on first use, as rotary tables and attention masks are."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.by_shape: dict[tuple[int, ...], torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "table"):
            self.table = torch.ones(8, device=x.device)
        key = tuple(x.shape)
        if key not in self.by_shape:
            self.by_shape[key] = torch.full((8,), 2.0, device=x.device)
        return self.layer(x) * self.table * self.by_shape[key]


def test_what_a_fake_step_caches_in_a_module_is_taken_out_again() -> None:
    model = _Caching()
    x = torch.randn(4, 8)
    step_memory(model, x)  # on fakes: the caches it fills would hold fakes
    assert not hasattr(model, "table") and model.by_shape == {}
    out = model(x)  # a real forward runs on real tensors again
    assert type(out) is torch.Tensor and type(model.table) is torch.Tensor
    step_memory(model, x)
    assert type(model.table) is torch.Tensor
    assert all(type(v) is torch.Tensor for v in model.by_shape.values())
