"""``vision_ckpt.tune.max_batch`` (issue 27): the largest batch whose step peak fits a budget, per
level and for the library's own switch, solved from a few small batches.

- the batch it finds fits and one more does not, measured with the same meter at that batch;
- a step whose bytes are not linear in the batch is flagged, not silently extrapolated;
- another budget is solved from the same measurements and agrees with measuring again;
- the model comes back as it was; bad arguments are refused with what was expected.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from _models import TinyViT
from torch import nn

import vision_ckpt
from vision_ckpt import CheckpointConfig
from vision_ckpt.measure._measure import Workload, measure_memory
from vision_ckpt.measure.models import output_loss


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False, num_classes=10)


def _real_peak(model: nn.Module, level: int, batch: int) -> int:
    """One real step at ``batch`` with the model's preset at ``level``, by the same meter."""
    x = torch.randn(batch, 3, 32, 32)
    vision_ckpt.apply(model, CheckpointConfig(preset="auto", training_checkpoint_level=level))
    try:
        return measure_memory(Workload(model, x, output_loss), x).peak
    finally:
        vision_ckpt.remove(model)


def test_the_largest_batch_fits_and_one_more_does_not() -> None:
    model = _resnet()
    budget = 128 * 2**20
    fit = vision_ckpt.tune.max_batch(model, (3, 32, 32), budget, levels=[0, 5], time_steps=0)
    assert [r.label for r in fit.rows] == [
        "level 0",
        "level 5",
        "own switch (set_grad_checkpointing())",
    ]
    for level in (0, 5):
        row = fit.row(f"level {level}")
        assert row.linear and row.linear_error == 0.0, row
        assert [m.batch for m in row.measured] == [2, 3, 4]
        assert not any(m.predicted for m in row.measured) and row.measurement.predicted
        assert row.measurement.batch == row.max_batch and row.measurement.meter == "bytes"
        at = _real_peak(model, level, row.max_batch)
        assert at == row.measurement.peak  # bytes per operator are exactly lines in the batch
        assert at <= budget < _real_peak(model, level, row.max_batch + 1)
    assert fit.row("level 5").max_batch > fit.row("level 0").max_batch
    assert fit.best_level() is fit.row("level 5")
    assert fit.explain().startswith("level 5 fits the largest batch in 128.00 MiB: ")


class _Gram(nn.Module):
    """A step whose bytes grow with the square of the batch (a batch-by-batch product kept for
    backward), the case the third batch is there to catch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.conv(x).flatten(1)
        big = (f @ f.T).repeat_interleave(4096, dim=1)
        return big.square().mean(1, keepdim=True)


def test_a_step_not_linear_in_the_batch_is_flagged() -> None:
    config = CheckpointConfig(rules=[{"match": "conv", "level": 3}])
    fit = vision_ckpt.tune.max_batch(
        _Gram(), (3, 4, 4), "64MiB", levels=[0], config=config, time_steps=0
    )
    row = fit.row("level 0")
    assert not row.linear and row.linear_error > 0.02
    assert "not linear in the batch: batch 4's peak is" in row.note
    assert "off the line through batches 2 and 3" in row.note
    assert "not linear in the batch, read with care: level 0" in fit.explain()


def test_another_budget_is_solved_from_the_same_measurements() -> None:
    model = _resnet()
    fit = vision_ckpt.tune.max_batch(model, "3,32,32", "128MiB", levels=[0, 4, 5], time_steps=0)
    again = vision_ckpt.tune.max_batch(model, (3, 32, 32), "192MiB", levels=[0, 4, 5], time_steps=0)
    wider = fit.for_budget("192MiB")
    assert wider.budget_bytes == 192 * 2**20
    for a, b, c in zip(fit.rows, wider.rows, again.rows, strict=True):
        assert a.label == b.label == c.label
        assert b.max_batch == c.max_batch and b.max_batch > a.max_batch
    same = [r for r in fit.rows if r.note.startswith("same plan as")]
    for row in same:  # a level that runs another's plan is reported, not measured again
        source = fit.row(row.note.removeprefix("same plan as ").split(";")[0])
        assert row.max_batch == source.max_batch


def test_the_model_comes_back_as_it_was_and_time_is_predicted() -> None:
    model = _resnet()
    before = copy.deepcopy(model.state_dict())
    fit = vision_ckpt.tune.max_batch(model, (3, 32, 32), "128MiB", levels=[3], time_steps=1)
    row = fit.row("level 3")
    assert row.measurement.seconds_per_sample == row.measurement.seconds / row.max_batch > 0
    assert all(m.seconds > 0 for m in row.measured)
    assert fit.to_dict()["best_level"] == 3
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert (
        not any(type(m).__name__ == "ActivationCheckpointing" for m in model.modules())
        and vision_ckpt.plan(model, CheckpointConfig(preset="auto")).checkpointed == ()
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_shape": (3, 32)}, r"input_shape=\(3, 32\) is not valid; expected one sample"),
        ({"batches": (3, 2)}, r"batches=\(3, 2\) is not valid; expected two or three increasing"),
        ({"batches": (2,)}, r"expected two or three increasing positive batch sizes"),
        ({"margin": 1.5}, r"margin=1.5 is not valid"),
        ({"levels": [7]}, r"level 7 is not a checkpoint level; allowed: 0"),
    ],
)
def test_bad_arguments_say_what_was_expected(kwargs, message) -> None:
    args = {"input_shape": (3, 32, 32), "budget": "1GiB"} | kwargs
    with pytest.raises(vision_ckpt.VisionCkptError, match=message):
        vision_ckpt.tune.max_batch(_resnet(), **args)


def test_the_planner_row_plans_at_the_best_levels_batch() -> None:
    config = CheckpointConfig(
        rules=[
            {"match": "blocks.*", "level": 1, "keep": "heavy"},
            {"match": "blocks.*", "level": 3},
        ]
    )
    torch.manual_seed(0)
    fit = vision_ckpt.tune.max_batch(
        TinyViT(img=32, depth=6), (3, 32, 32), "8MiB", levels=[0, 3], config=config, planner=True
    )
    best, planner = fit.best_level(), fit.row("planner")
    assert best.level == 3 and planner.max_batch == best.max_batch
    assert planner.measurement.peak <= 8 * 2**20 and planner.level is None
    assert planner.note.startswith("the planner at level 3's batch: ")
    assert "timed beside the levels: " in planner.note


def test_one_extrapolator_for_every_tool() -> None:
    """max_batch, the level search, the planner's menus and the derivation read bytes off the
    same lines (``measure._extrapolate.Lines``): the rise times the distance, then divided by
    the step, so a value the lines put on a whole byte is that byte (a slope first would give
    63.00000000000001 here, and the menus truncate)."""
    from vision_ckpt.measure._extrapolate import Lines, predict_from_timelines

    line = Lines.through_peaks((3, 100), (6, 107))
    assert line.at(33) == 170.0 and line.largest_within(170.0, 1000) == 33
    lines = Lines.through((3, [100, 500]), (6, [107, 520]))
    assert lines is not None and lines.at(33) == 700.0 and lines.at(6) == 520.0
    assert lines.largest_within(700.0, 1000) == 33 and lines.largest_within(699.9, 1000) == 32
    assert Lines.through((2, [1, 2]), (3, [1])) is None  # different operators
    # when the timelines differ, the line through the peaks
    assert predict_from_timelines([(3, [1, 500]), (6, [520])], [(3, 500), (6, 520)], 33) == 700
