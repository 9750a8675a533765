"""Predicting the step peak of a batch from measurements of smaller ones.

See NOTE [ Predicting the peak of a larger batch ] below and NOTE [ Measuring without the memory
of the largest level ] in ``vision_ckpt.tune.profile`` for why the target batch is never run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._measure import StepMemory, Workload, measure_memory

__all__ = [
    "small_batches",
    "extrapolated_peak",
    "predict_peak",
    "peak_measurer",
    "predict_from_timelines",
]


def _affine(points: Sequence[tuple[int, int]], batch: int) -> int:
    """Extrapolate peak(batch) along the line through the last two (batch, peak) points."""
    (b1, p1), (b2, p2) = points[-2], points[-1]
    slope = (p2 - p1) / (b2 - b1)
    return int(round(p2 + slope * (batch - b2)))


# NOTE [ Predicting the peak of a larger batch ]
#
# A training step runs the same operators in the same order whatever the batch size, and the
# bytes live after each operator are, to a very good approximation, affine in the batch
# (weights, gradients and optimizer state fixed; activations per sample). The *peak* is the
# largest of these affine functions, so it is convex in the batch: a line through the peaks of
# two small batches underestimates a larger one whenever the moment of the peak moves (at small
# batches the end of backward, with every gradient allocated, can be the peak; at large ones the
# start of backward, with every activation alive). So the prediction fits a line per operator
# through two measured timelines and takes the largest value at the target batch. If the two
# runs did not execute the same number of operators, it falls back to the line through peaks.
# On CUDA the timelines come moved up by the allocator's excess over the tracked bytes, so the
# same rule predicts the allocator's peak (NOTE [ Two meters ] in ``_measure``).


def predict_from_timelines(
    lines: Sequence[tuple[int, Sequence[int]]], points: Sequence[tuple[int, int]], batch: int
) -> int:
    """The largest of the per-operator lines through the last two ``(batch, timeline)`` of
    ``lines`` at ``batch``; the line through the last two ``(batch, peak)`` of ``points`` when
    the two timelines differ in length (NOTE [ Predicting the peak of a larger batch ]).

    >>> predict_from_timelines([(2, [10, 30]), (4, [20, 32])], [(2, 30), (4, 32)], 8)
    40
    """
    (b1, t1), (b2, t2) = lines[-2], lines[-1]
    if not t1 or len(t1) != len(t2):
        return _affine(points, batch)
    scale = (batch - b2) / (b2 - b1)
    return int(round(max(y2 + (y2 - y1) * scale for y1, y2 in zip(t1, t2, strict=True))))


def small_batches(target: int) -> tuple[int, int]:
    """The two batch sizes measured to predict ``target``: about ``target/8`` and ``target/4``."""
    # Never batch 1: BatchNorm refuses a single value per channel (e.g. after global pooling).
    b1 = max(2, target // 8)
    return b1, max(b1 + 1, target // 4)


def extrapolated_peak(
    measure: Callable[[int, list[int]], int],
    target: int,
    limit: int | None = None,
    halfway: bool = True,
) -> tuple[int, list[tuple[int, int]]]:
    """Step peak at ``target`` from small batches: ``target/8`` and ``target/4``, then, with
    ``halfway``, ``target/2`` if the first two predict that it stays under ``limit`` (a step as
    costly as the first two together, for a prediction from points nearer the target). See NOTE
    [ Predicting the peak of a larger batch ].

    ``measure(batch, timeline)`` runs one step at that batch, appends the live bytes after each
    operator to ``timeline`` and returns the peak. Batches at or above ``target`` are never run
    unless ``target`` itself is tiny (<= 4), when it is simply measured.

    Returns:
        The predicted peak, and the (batch, measured peak) points it was predicted from.
    """
    if target <= 4:
        peak = measure(target, [])
        return peak, [(target, peak)]
    lines: list[tuple[int, list[int]]] = []
    points: list[tuple[int, int]] = []
    for batch in small_batches(target):
        timeline: list[int] = []
        points.append((batch, measure(batch, timeline)))
        lines.append((batch, timeline))
    b3 = target // 2
    if (
        halfway
        and b3 > points[-1][0]
        and (limit is None or predict_from_timelines(lines, points, b3) <= limit)
    ):
        timeline = []
        points.append((b3, measure(b3, timeline)))
        lines.append((b3, timeline))
    return predict_from_timelines(lines, points, target), points


def peak_measurer(
    work: Workload, readings: list[tuple[int, StepMemory]] | None = None
) -> Callable[[int, list[int]], int]:
    """``measure(batch, timeline)`` for :func:`extrapolated_peak`: one step of ``work`` at that
    batch, at the training level in force when it is called, returning the peak that decides a
    budget on its device (the CUDA allocator's on CUDA, NOTE [ Two meters ] in ``_measure``).
    With ``readings``, each step's (batch, :class:`StepMemory`) is appended to it."""

    def measure(batch: int, timeline: list[int]) -> int:
        step = measure_memory(work, work.batch(batch), timeline)
        if readings is not None:
            readings.append((batch, step))
        return step.deciding

    return measure


def predict_peak(work: Workload, limit: int | None = None) -> int:
    """Step peak at the example's batch size, extrapolated from smaller batches, at the
    training level currently in force, in the terms of the device's meter."""
    return extrapolated_peak(peak_measurer(work), work.batch_size, limit)[0]
