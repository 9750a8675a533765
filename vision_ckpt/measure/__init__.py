"""Measurement: what a training step costs, counted and modelled.

Owns the byte meters (``_memory``: saved bytes, live-storage peaks), the one record of what a
step costs (``_record``: :class:`Measurement`, which every tool reports its peaks and times in),
one measured training step (``_measure``), the prediction of a larger batch's peak, the one
extrapolator (``_extrapolate``), the modelled price of operators (``_price``), where a step
peaks and its physical floor (``peak``), and the models, inputs and losses a step runs on
(``models``). It imports the runtime and the regions, never the tuning layer above it. Its
public names are the meters, the record and the model specs.
"""

from ._measure import StepMemory as StepMemory, step_memory as step_memory
from ._memory import (
    PeakMemory as PeakMemory,
    SavedBytes as SavedBytes,
    count_saved_bytes as count_saved_bytes,
    format_bytes as format_bytes,
    track_peak_memory as track_peak_memory,
)
from ._record import Measurement as Measurement
from .models import ModelSpecError as ModelSpecError, build_model as build_model
from .peak import (
    PeakReport as PeakReport,
    physical_floor as physical_floor,
    where_peak as where_peak,
)

__all__ = [
    "count_saved_bytes",
    "track_peak_memory",
    "format_bytes",
    "SavedBytes",
    "PeakMemory",
    "Measurement",
    "step_memory",
    "StepMemory",
    "where_peak",
    "physical_floor",
    "PeakReport",
    "build_model",
    "ModelSpecError",
]
