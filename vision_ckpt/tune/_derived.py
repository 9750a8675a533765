"""The derivation's answer: :class:`DerivedPreset` and its :class:`DerivedLevel` rows.

Owns the record :func:`~vision_ckpt.tune.derive_preset` returns and how it is written out: the
preset's rules as a config at a level (``config``), as a preset file (``to_yaml``), and as a
table of each level's measured peak and modelled time (``table``, ``str``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from ..config.levels import Level
from ..config.schema import CheckpointConfig, LevelRule
from ..measure._memory import format_bytes
from ..measure._record import Measurement

__all__ = ["DerivedLevel", "DerivedPreset"]


@dataclass
class DerivedLevel:
    """One derived level: what it runs and what it was measured to cost."""

    level: int
    strategies: dict[str, str]
    """Unit -> ``keep``, ``selective``, ``selective_below`` (selective, and its products cheap
    to redo redone: NOTE [ Products cheap to redo ] in ``_price``), ``full``, ``nested``,
    ``inner`` (its inner regions alone, NOTE [ Inner regions alone ] in ``_level_search``),
    ``stage`` (its stage one selective region), ``stage_below`` (that, redoing its cheap products),
    ``held`` (its stage one region recomputed whole) or ``held_nested`` (that, and the unit
    recomputed whole again inside it): NOTE [ A stage recomputed whole ] in ``_level_search``."""
    measurement: Measurement
    """The step at the target batch as the preset writes this level: its peak extrapolated
    from measured small batches, by the device's meter; untimed (the derivation prices, it
    does not time)."""
    modelled: Measurement
    """The same step in the program's terms (meter ``modelled``): the peak its menus sum to and
    its modelled seconds per step (the menus' prices, NOTE [ A modelled price ] in
    ``_price``)."""
    lean: tuple[str, ...] = ()
    """MLPs run with the lean backward at this level."""
    runs: tuple[str, ...] = ()
    """Runs of units recomputed as one region at this level (NOTE [ Runs of units ] in
    ``_derived_rules``)."""
    whole: tuple[str, ...] = ()
    """Stages recomputed whole at this level, their blocks checkpointed again inside."""
    fallback: bool = False
    """Whether the structural fallback's regions are added at this level (all nested)."""
    same_as: int | None = None
    """The level below whose plan this level runs, when its own lowered the peak too little."""

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for strategy in self.strategies.values():
            out[strategy] = out.get(strategy, 0) + 1
        ways = (
            "selective",
            "selective_below",
            "stage",
            "stage_below",
            "held",
            "full",
            "inner",
            "nested",
            "held_nested",
        )
        return {k: out[k] for k in ways if k in out}


@dataclass
class DerivedPreset:
    """The answer of :func:`derive_preset`: five levels as one preset, and how they were found."""

    model_class: str
    """The qualified class the preset was derived on."""
    batch_size: int
    input_shape: tuple[int, ...]
    """One sample's shape."""
    rules: list[LevelRule]
    """The preset's rules, in the bundled presets' vocabulary."""
    levels: list[DerivedLevel]
    """Levels 1-5."""
    plain: Measurement
    """Level 0 (nothing checkpointed) at the batch: its step peak extrapolated from the small
    batches, by the device's meter; untimed."""
    plain_modelled: Measurement
    """Level 0 in the program's terms: the same peak, and the modelled seconds per step with no
    checkpointing (extrapolated from the small batches), which the levels' times are read
    against."""
    floor: int | None = None
    """The physical floor at the batch (``vision_ckpt.measure.peak``), extrapolated from the small
    batches; ``None`` if not measured."""
    seconds: float = 0.0
    """Wall time of the derivation."""
    units: list[str] = field(default_factory=list)
    """The units the program chose for, in forward order."""
    compared: dict[int, int] | None = None
    """The bundled preset's step peak per level at the batch, when the model has one and it
    was asked for."""
    bundled: str | None = None
    """The bundled preset's name, if the model has one."""

    def config(self, level: int | None = None) -> CheckpointConfig:
        """The derived preset as a config (``preset`` off, its rules), at ``level`` if given.

        >>> import torch
        >>> from torch import nn
        >>> from vision_ckpt.tune import derive_preset
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
        ...                     *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        ...                       for _ in range(3)])
        >>> found = derive_preset(net, torch.randn(2, 3, 16, 16), batch_size=16, floor=False)
        >>> cfg = found.config(5)
        >>> cfg.training_checkpoint_level, cfg.preset is None
        (<Level.VERY_LARGE_MODULE: 5>, True)
        """
        update: dict[str, Any] = {}
        if level is not None:
            update["training_checkpoint_level"] = Level(level)
        return CheckpointConfig(preset=None, rules=self.rules, **update)

    def to_yaml(self) -> str:
        """The preset file: a ``family:`` header naming the class, and the rules.

        ``vision_ckpt.config.presets.register_preset(name, path)`` loads it; bundled preset files
        have the same form (``configs/presets/*.yaml``)."""
        rules = [r.model_dump(exclude_defaults=True) for r in self.rules]
        for rule in rules:
            if isinstance(rule.get("level"), int):
                rule["level"] = int(rule["level"])
        head = (
            f"# Derived by vision_ckpt.tune.derive_preset for {self.model_class} at batch "
            f"{self.batch_size}, input {list(self.input_shape)}.\n"
            + "".join(
                f"# level {lv.level}: "
                + (
                    f"= level {lv.same_as}"
                    if lv.same_as is not None
                    else f"peak {format_bytes(lv.measurement.peak)}, predicted "
                    f"{_time_ratio(lv, self.plain_modelled) or 0.0:.2f}x time (modelled)"
                )
                + "\n"
                for lv in self.levels
            )
        )
        body = {"family": {"classes": [self.model_class]}, "rules": rules}
        return head + yaml.safe_dump(body, sort_keys=False)

    def table(self) -> list[dict[str, Any]]:
        """One row per level (0-5): peak, predicted time, distance to the floor, the bundled
        preset's peak where compared."""
        rows = [{"level": 0, "peak": self.plain.peak, "time": 1.0, "plan": "nothing checkpointed"}]
        for lv in self.levels:
            plan = (
                f"= level {lv.same_as}"
                if lv.same_as is not None
                else ", ".join(f"{n} {s}" for s, n in lv.counts().items())
                + (f", {len(lv.lean)} lean" if lv.lean else "")
                + (f", {len(lv.runs)} run(s) of units as one" if lv.runs else "")
                + (f", {len(lv.whole)} stage(s) whole" if lv.whole else "")
                + (", the fallback's regions nested" if lv.fallback else "")
            )
            rows.append(
                {
                    "level": lv.level,
                    "peak": lv.measurement.peak,
                    "time": _time_ratio(lv, self.plain_modelled),
                    "plan": plan,
                }
            )
        for row in rows:
            if self.floor:
                row["x_floor"] = row["peak"] / self.floor
            if self.compared is not None:
                row["bundled"] = self.compared.get(row["level"])
        return rows

    def __str__(self) -> str:
        lines = [
            f"derived levels for {self.model_class} at batch {self.batch_size} "
            f"(input {list(self.input_shape)}), in {self.seconds:.0f} s"
        ]
        if self.floor:
            lines.append(f"physical floor {format_bytes(self.floor)}")
        for row in self.table():
            text = f"  level {row['level']}: peak {format_bytes(row['peak']):>11}"
            if row.get("time") is not None:
                text += f", {row['time']:.2f}x time (modelled)"
            if "x_floor" in row:
                text += f", {row['x_floor']:.2f}x floor"
            if row.get("bundled") is not None:
                text += f", bundled {self.bundled}: {format_bytes(row['bundled'])}"
            lines.append(text + f"; {row['plan']}")
        return "\n".join(lines)


def _time_ratio(level: DerivedLevel, plain: Measurement) -> float | None:
    """A level's modelled step time over level 0's (``None`` when level 0's is zero)."""
    if not plain.seconds or level.modelled.seconds is None:
        return None
    return level.modelled.seconds / plain.seconds
