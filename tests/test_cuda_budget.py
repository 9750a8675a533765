"""Budgets in the CUDA allocator's terms, checked on CPU with the CUDA memory functions faked.

On a CUDA device, ``profile``, ``suggest_level`` and the planner decide on
``torch.cuda.max_memory_allocated`` of real warmed-up steps and report ``max_memory_reserved``
(NOTE [ Two meters ] in ``vision_ckpt.measure._measure``). There is no GPU here, so these
tests run the model on CPU, tell the measuring code that the device is CUDA (the one detection
function ``meter_for`` consults), and stand in for the allocator: :class:`FakeAllocator` answers
``max_memory_allocated`` with figures far above what the byte tracker counts, so a decision taken on
the tracker's bytes and one taken on the allocator's differ, and each test can tell which meter
decided.
"""

from __future__ import annotations

import pytest
import timm
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import vision_ckpt
from vision_ckpt.measure import Measurement, _measure
from vision_ckpt.measure._measure import (
    FitCheck,
    Snapshot,
    Workload,
    confirm_fits,
    measure_memory,
    meter_for,
    model_restored,
)
from vision_ckpt.tune.profiling import plan_for_budget, profile, suggest_level

MiB = 2**20
GiB = 2**30


class FakeAllocator:
    """The CUDA allocator's statistics for a model running on CPU.

    A step's allocated peak is ``base + per_row[level] * batch`` (level: the training level in
    force, batch: the last batch the model's forward saw), plus ``spike`` at the (level, batch)
    pairs it names; reserved is 64 MiB more than allocated. ``events`` logs the calls in
    order, with the forwards, so tests can check the synchronise/reset/step/read protocol.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        per_row: dict[int, int],
        base: int = 2 * GiB,
        spike: dict[tuple[int, int], int] | None = None,
        out_of_memory: set[tuple[int, int]] | None = None,
    ) -> None:
        self.per_row, self.base = per_row, base
        self.spike = spike or {}
        self.out_of_memory = out_of_memory or set()
        self.batch: int | None = None
        self.events: list[str] = []
        model.register_forward_pre_hook(self._forward)

    def _forward(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.batch = int(args[0].shape[0])
        level = int(vision_ckpt.get_training_level())
        self.events.append(f"forward {self.batch}")
        if (level, self.batch) in self.out_of_memory:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    def allocated(self, level: int, batch: int) -> int:
        per_row = self.per_row.get(level, self.per_row.get(-1, 0))  # -1: any other level
        return self.base + per_row * batch + self.spike.get((level, batch), 0)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_measure, "_uses_allocator", lambda device: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self._log("sync"))
        monkeypatch.setattr(
            torch.cuda, "reset_peak_memory_stats", lambda device=None: self._log("reset")
        )
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self._max_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", self._max_reserved)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self._log("empty_cache"))

    def _log(self, event: str) -> None:
        self.events.append(event)

    def _max_allocated(self, device: object = None) -> int:
        self.events.append("allocated")
        assert self.batch is not None
        return self.allocated(int(vision_ckpt.get_training_level()), self.batch)

    def _max_reserved(self, device: object = None) -> int:
        self.events.append("reserved")
        assert self.batch is not None
        return self.allocated(int(vision_ckpt.get_training_level()), self.batch) + 64 * MiB


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10)


def _x(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def test_the_meter_is_chosen_by_the_device() -> None:
    assert meter_for("cpu").name == "bytes"
    assert meter_for(torch.device("cuda", 0)).name == "cuda allocator"
    assert meter_for("meta").name == "bytes"


def test_on_cuda_a_step_is_read_from_the_allocator_after_a_warm_up(monkeypatch) -> None:
    model, x = _model(), _x(4)
    cpu = measure_memory(Workload(model, x), x)
    assert cpu.allocated is None and cpu.reserved is None and cpu.deciding == cpu.peak
    fake = FakeAllocator(model, {0: 30 * MiB})
    fake.install(monkeypatch)
    timeline: list[int] = []
    step = measure_memory(Workload(model, x), x, timeline)
    assert step.allocated == fake.allocated(0, 4) and step.deciding == step.allocated
    assert step.reserved == 2 * GiB + 184 * MiB and step.peak == cpu.peak
    # the warm-up at this batch reads the allocator's peak after each operator (and resets it);
    # then sync, reset, the step, sync, and only then the readings
    warm_up = fake.events[:-6]
    assert warm_up[:3] == ["sync", "reset", "forward 4"]
    assert warm_up.count("allocated") == warm_up.count("reset") - 1 == len(timeline) > 10
    assert fake.events[-6:] == ["sync", "reset", "forward 4", "sync", "allocated", "reserved"]
    # one entry per operator of the step, its largest the warmed-up step's allocated peak
    assert max(timeline) == step.allocated
    assert min(timeline) > 2 * GiB


class WorkspaceAllocator(FakeAllocator):
    """Allocated bytes that the byte tracker cannot see: ``10 MiB * batch + 100 MiB`` all the
    step, and ``20 MiB * batch`` while ``inner`` runs (a workspace that grows with the batch,
    the peak only from batch 10 on). ``max_memory_allocated`` is the largest since the reset."""

    def __init__(self, model: torch.nn.Module, inner: torch.nn.Module) -> None:
        super().__init__(model, {})
        self.inside = False
        self.peak = 0
        inner.register_forward_pre_hook(lambda m, a: self._enter(True))
        inner.register_forward_hook(lambda m, a, o: self._enter(False))

    def now(self) -> int:
        assert self.batch is not None
        return (20 * self.batch if self.inside else 10 * self.batch + 100) * MiB

    def _enter(self, inside: bool) -> None:
        self.inside = inside
        self.peak = max(self.peak, self.now())

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().install(monkeypatch)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)

    def _reset(self, device: object = None) -> None:
        self.peak = self.now() if self.batch is not None else 0

    def _max_allocated(self, device: object = None) -> int:
        return max(self.peak, self.now())


def test_on_cuda_a_workspace_that_grows_with_the_batch_is_predicted_where_it_happens(
    monkeypatch,
) -> None:
    from vision_ckpt.measure._extrapolate import extrapolated_peak, peak_measurer

    torch.manual_seed(0)
    inner = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), inner, torch.nn.ReLU())
    fake = WorkspaceAllocator(model, inner)
    fake.install(monkeypatch)
    work = Workload(model, torch.randn(2, 16))
    predicted, points = extrapolated_peak(peak_measurer(work), 32, halfway=False)
    # batches 4 and 8 peak outside the workspace (140 and 180 MiB); at 32 it decides: 640 MiB
    assert points == [(4, 140 * MiB), (8, 180 * MiB)]
    assert measure_memory(work, work.batch(32)).allocated == 640 * MiB
    assert predicted == 640 * MiB  # a line through the peaks alone says 420 MiB


def test_suggest_level_on_cuda_decides_on_the_allocator(monkeypatch) -> None:
    model, example = _model(), _x(2)
    on_cpu = suggest_level(model, example, "1GiB", batch_size=16, levels=[0, 5])
    assert on_cpu.level == 0 and on_cpu.meter == "bytes" and on_cpu.check is None
    fake = FakeAllocator(model, {0: 60 * MiB, 5: 20 * MiB})
    fake.install(monkeypatch)
    budget = 3 * GiB  # level 0 at 16: 2 GiB + 960 MiB, over with the margin; level 5: 2.31 GiB
    s = suggest_level(model, example, budget, batch_size=16, levels=[0, 5])
    assert s.meter == "cuda allocator"
    for level in (0, 5):
        # the tracker's prediction plus the allocator's excess on its line: the fake's figure
        # at 16 (the tracker's own extrapolation error is a few hundred KB here)
        predicted = s.predicted[level]
        assert predicted.meter == "cuda allocator" and predicted.predicted
        assert predicted.peak == pytest.approx(fake.allocated(level, 16), abs=2 * MiB)
        assert [b for b, _ in s.reserved[level]] == [m.batch for m in s.measured[level]]
    assert s.level == 5 and not s.rejected
    step = Measurement(peak=fake.allocated(5, 16), batch=16, meter="cuda allocator")
    assert s.check == FitCheck(16, budget, step, 2 * GiB + 384 * MiB)
    assert "real step at batch 16: allocated 2.31 GiB" in s.explain()
    assert fake.events[-7:] == [
        "forward 16",  # the warm-up at the target batch
        "sync",
        "reset",
        "forward 16",
        "sync",
        "allocated",
        "reserved",
    ]


def test_suggest_level_on_cuda_rejects_a_level_whose_real_step_exceeds_the_budget(
    monkeypatch,
) -> None:
    model, example = _model(), _x(2)
    # level 3 is predicted at 2 GiB + 480 MiB, but its real step at batch 16 allocates 1 GiB more
    fake = FakeAllocator(model, {0: 60 * MiB, 3: 30 * MiB, 5: 20 * MiB}, spike={(3, 16): GiB})
    fake.install(monkeypatch)
    s = suggest_level(model, example, "2.75GiB", batch_size=16, levels=[0, 3, 5])
    assert s.predicted[3].peak * 1.05 <= 2.75 * GiB  # predicted to fit...
    assert not s.rejected[3].fits and s.rejected[3].measurement.peak == fake.allocated(3, 16)
    assert s.level == 5 and s.check is not None and s.check.fits  # ...the next one does
    assert "level 3 was predicted to fit, but its real step at batch 16: allocated" in s.explain()


def test_suggest_level_on_cuda_survives_an_out_of_memory_step(monkeypatch) -> None:
    model, example = _model(), _x(2)
    fake = FakeAllocator(model, {3: 30 * MiB, 5: 20 * MiB}, out_of_memory={(3, 16)})
    fake.install(monkeypatch)
    s = suggest_level(model, example, "2.75GiB", batch_size=16, levels=[3, 5])
    assert s.rejected[3].out_of_memory and not s.rejected[3].fits
    assert "empty_cache" in fake.events
    assert s.level == 5
    assert "real step at batch 16: out of memory" in s.explain()


def test_suggest_level_on_cuda_says_when_no_real_step_fits(monkeypatch) -> None:
    model, example = _model(), _x(2)
    fake = FakeAllocator(model, {5: 20 * MiB}, spike={(5, 16): GiB})
    fake.install(monkeypatch)
    s = suggest_level(model, example, "2.75GiB", batch_size=16, levels=[5])
    assert s.level is None and not s.fits
    assert "no level fits" in s.explain() and "level 5 was predicted to fit" in s.explain()


def test_confirm_fits(monkeypatch) -> None:
    model = _model()
    work = Workload(model, _x(2))
    assert confirm_fits(work, GiB, 8) is None  # CPU: the byte count is the measurement
    fake = FakeAllocator(model, {0: 100 * MiB})
    fake.install(monkeypatch)
    allocated = 2 * GiB + 800 * MiB
    step = Measurement(peak=allocated, batch=8, meter="cuda allocator")
    assert confirm_fits(work, 3 * GiB, 8) == FitCheck(8, 3 * GiB, step, allocated + 64 * MiB)
    over = confirm_fits(work, 2 * GiB + 799 * MiB, 8)
    assert over is not None and not over.fits and not over.out_of_memory
    assert over.explain().endswith("does not fit")


def test_profile_on_cuda_reports_the_allocator_and_decides_memory_limit_on_it(
    monkeypatch,
) -> None:
    model, x = _model(), _x(8)
    fake = FakeAllocator(model, {0: 60 * MiB, 5: 20 * MiB})
    fake.install(monkeypatch)
    # level 0 at 8: 2 GiB + 480 MiB; level 5: 2 GiB + 160 MiB. The tracker's peaks are a few MB.
    result = profile(model, x, levels=[0, 5], steps=1, flops=False, memory_limit="2.25GiB")
    assert result.meter == "cuda allocator"
    l0, l5 = result.levels
    assert l0.skipped is not None and "exceeds memory_limit" in l0.skipped
    assert l5.skipped is None
    assert l5.cuda_peak_bytes == fake.allocated(5, 8)
    assert l5.cuda_reserved_bytes == 2 * GiB + 224 * MiB
    tracked = l5.measurement
    assert tracked is not None and tracked.meter == "bytes" and tracked.peak < 100 * MiB


def test_plan_for_budget_on_cuda_decides_on_the_allocator(monkeypatch) -> None:
    model, example = _model(), _x(2)
    on_cpu = plan_for_budget(model, example, "1GiB", batch_size=16, max_rounds=1)
    assert on_cpu.config is not None and on_cpu.measurement.peak < 100 * MiB
    fake = FakeAllocator(model, {-1: 10 * MiB})
    fake.install(monkeypatch)
    on_cuda = plan_for_budget(model, example, "1GiB", batch_size=16, max_rounds=1)
    # the tracker's few MB plus the allocator's 2 GiB: nothing fits 1 GiB
    assert on_cuda.config is None
    assert on_cuda.measurement.meter == "cuda allocator"
    assert on_cuda.measurement.peak == pytest.approx(2 * GiB + 160 * MiB, abs=4 * MiB)


def _optimizer_with_state(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # what a step would create, without running backward
        opt.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return opt


@pytest.mark.needs_fake_cuda
def test_model_restored_keeps_its_copy_on_the_host() -> None:
    """Under FakeTensorMode the model's weights and the optimizer's state live on "cuda"; the
    snapshot that ``model_restored`` keeps must not (it would count in every device peak)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to("cuda")
        opt = _optimizer_with_state(model)
        snapshot = Snapshot.take(model, opt)
        copies = list(snapshot.state.values())
        assert snapshot.optimizer_state is not None
        for state in snapshot.optimizer_state["state"].values():
            copies += list(state.values())
        assert len(copies) == 7 + 4 * 3  # conv: 2, norm: 5 (statistics too); 3 per parameter
        assert {t.device.type for t in copies} == {"cpu"}
        # put back into the device tensors: same objects, still on the device
        params = list(model.parameters())
        snapshot.restore(model, opt)
        assert list(model.parameters()) == params
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        assert {s["exp_avg"].device.type for s in opt.state.values()} == {"cuda"}


def test_model_restored_puts_back_weights_statistics_and_optimizer_state() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_x(2)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    params = list(model.parameters())
    model.eval()
    with model_restored(model, opt):
        assert model.training
        for _ in range(2):
            model(_x(2)).sum().backward()
            opt.step()
    assert not model.training and list(model.parameters()) == params
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            assert torch.equal(v, opt_before[i][k]), (i, k)
