"""The one record of what a training step costs: :class:`Measurement`.

Every tool that measures or predicts a step reports its peak and its time in this record, with
the batch they are for, the meter that counted the peak, and whether a step at that batch ran:
the profile of a level, the predictions of ``suggest_level``, the rows of ``max_batch``, the
per-block planner's answer and its uniform levels, a derived level and the real step that
confirms a plan on CUDA. A meter's reading of one step becomes one with
``StepMemory.measurement``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._memory import format_bytes

__all__ = ["Measurement", "METERS"]

METERS: tuple[str, ...] = ("bytes", "cuda allocator", "modelled")
"""The meters a :class:`Measurement` may name: the byte tracker, the CUDA caching allocator
(NOTE [ Two meters ] in ``_measure``) and a program's model (NOTE [ A modelled price ] in
``_price``)."""


@dataclass(frozen=True)
class Measurement:
    """What one training step costs at one batch: its peak memory and its time, and where the
    figures come from.

    >>> m = Measurement(peak=3 * 2**30, batch=64, meter="cuda allocator", seconds=0.25,
    ...                 predicted=True)
    >>> m.seconds_per_sample
    0.00390625
    >>> str(m)
    'peak 3.00 GiB, 250 ms at batch 64 (cuda allocator, predicted)'
    >>> str(Measurement(peak=1536 * 1024, batch=2, meter="bytes"))
    'peak 1.50 MiB at batch 2 (bytes, measured)'
    """

    peak: int
    """The step's peak memory in bytes, as ``meter`` counts it."""
    batch: int
    """The batch size the figures are for."""
    meter: str
    """What counted ``peak``, one of :data:`METERS`: ``"bytes"`` (the byte tracker: live tensor
    storage, the same on every run), ``"cuda allocator"`` (``torch.cuda.max_memory_allocated``
    of a warmed-up step, NOTE [ Two meters ] in ``vision_ckpt.measure._measure``) or
    ``"modelled"`` (a program's own figures: the bytes its menus sum to and their modelled
    seconds, NOTE [ A modelled price ] in ``vision_ckpt.measure._price``)."""
    seconds: float | None = None
    """Seconds per training step at ``batch``: wall-clock time where ``meter`` measures, the
    model's where it is ``"modelled"``; ``None`` when not timed."""
    predicted: bool = False
    """``False`` when a step at ``batch`` ran and these are its figures; ``True`` when they are
    read off lines through steps at other batches (NOTE [ Predicting the peak of a larger
    batch ] in ``vision_ckpt.measure._extrapolate``) or come from a model."""

    def __post_init__(self) -> None:
        if self.meter not in METERS:
            raise ValueError(f"meter={self.meter!r} is not one of {', '.join(METERS)}")

    @property
    def seconds_per_sample(self) -> float | None:
        """``seconds`` divided by ``batch`` (``None`` when not timed)."""
        if self.seconds is None or self.batch < 1:
            return None
        return self.seconds / self.batch

    def __str__(self) -> str:
        time = "" if self.seconds is None else f", {self.seconds * 1000:.3g} ms"
        how = "predicted" if self.predicted else "measured"
        return f"peak {format_bytes(self.peak)}{time} at batch {self.batch} ({self.meter}, {how})"
