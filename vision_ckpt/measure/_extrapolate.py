"""Predicting the step peak of a batch from measurements of smaller ones.

See NOTE [ Predicting the peak of a larger batch ] below and NOTE [ Measuring without the memory
of the largest level ] in ``vision_ckpt.tune.profile`` for why the target batch is never run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ._measure import StepMemory, Workload, measure_memory

__all__ = [
    "MEASURED_UP_TO",
    "Lines",
    "small_batches",
    "extrapolated_peak",
    "predict_peak",
    "peak_measurer",
    "predict_from_timelines",
]


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


@dataclass(frozen=True)
class Lines:
    """Bytes as lines in the batch: one per operator of a step (or one, through its peaks),
    drawn through two measured batches; the step's peak at a batch is the largest of them (NOTE
    [ Predicting the peak of a larger batch ]). The package's one extrapolator of bytes: the
    level search, the planner, the derivation and :func:`vision_ckpt.tune.max_batch` all read
    it.

    >>> lines = Lines.through((2, [10, 30]), (4, [20, 32]))
    >>> lines.at(8), lines.largest_within(50.0, 100)
    (40.0, 10)
    """

    batch: int
    """The later of the two batches the lines go through."""
    values: np.ndarray
    """Each line's value at ``batch`` (float64)."""
    rises: np.ndarray
    """Each line's rise from the earlier batch to ``batch`` (float64)."""
    step: int
    """``batch`` minus the earlier batch."""

    @classmethod
    def through(
        cls, first: tuple[int, Sequence[float]], second: tuple[int, Sequence[float]]
    ) -> Lines | None:
        """The lines through two ``(batch, values)``, value by value; ``None`` when the two hold
        different numbers of values (the runs did not execute the same operators) or none."""
        (b1, v1), (b2, v2) = first, second
        if not len(v1) or len(v1) != len(v2):
            return None
        y1, y2 = np.asarray(v1, dtype=np.float64), np.asarray(v2, dtype=np.float64)
        return cls(b2, y2, y2 - y1, b2 - b1)

    @classmethod
    def through_peaks(cls, first: tuple[int, float], second: tuple[int, float]) -> Lines:
        """The one line through two ``(batch, peak)``."""
        (b1, p1), (b2, p2) = first, second
        y1, y2 = np.array([p1], dtype=np.float64), np.array([p2], dtype=np.float64)
        return cls(b2, y2, y2 - y1, b2 - b1)

    def at(self, batch: int) -> float:
        """The largest line's value at ``batch``."""
        # The rise is multiplied by the distance before it is divided by the step: for whole
        # bytes the product is exact, so a value the lines put on a whole byte is that byte
        # (the menus truncate it). With a step of 1 (max_batch's default batches) or any
        # power of two, every order of these operations gives the same float.
        return float(np.max(self.values + self.rises * (batch - self.batch) / self.step))

    def largest_within(self, goal: float, cap: int) -> int:
        """The largest batch in ``[0, cap]`` whose value is within ``goal``: the closed form
        ``min over rising lines of (goal - value) / slope`` (NOTE [ The largest batch from a few
        small ones ] in ``vision_ckpt.tune.fit``), then stepped down past float slack or a
        falling line over the goal."""
        slope = self.rises / self.step
        rising = slope > 0
        top = cap
        if rising.any():
            bound = self.batch + (goal - self.values[rising]) / slope[rising]
            top = min(cap, int(math.floor(float(bound.min()) + 1e-9)))
        while top >= 1 and self.at(top) > goal:
            top = top - 1 if self.at(top - 1) <= goal else 0
        return max(0, top)


def predict_from_timelines(
    lines: Sequence[tuple[int, Sequence[int]]], points: Sequence[tuple[int, int]], batch: int
) -> int:
    """The largest of the per-operator lines through the last two ``(batch, timeline)`` of
    ``lines`` at ``batch``, to the nearest byte; the line through the last two ``(batch,
    peak)`` of ``points`` when the two timelines differ in length (NOTE [ Predicting the peak
    of a larger batch ]).

    >>> predict_from_timelines([(2, [10, 30]), (4, [20, 32])], [(2, 30), (4, 32)], 8)
    40
    """
    found = Lines.through(lines[-2], lines[-1]) or Lines.through_peaks(points[-2], points[-1])
    return int(round(found.at(batch)))


MEASURED_UP_TO = 4
"""A target batch up to this one is measured itself, not extrapolated
(:func:`extrapolated_peak`)."""


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
    unless ``target`` itself is tiny (up to :data:`MEASURED_UP_TO`), when it is simply measured.

    Returns:
        The predicted peak, and the (batch, measured peak) points it was predicted from.
    """
    if target <= MEASURED_UP_TO:
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
