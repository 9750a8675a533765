"""The plan record: :class:`CheckpointPlan` and its :class:`PlanEntry` rows.

Owns what ``plan()`` returns and ``apply()`` installs: per selected module its rungs, its lean
level and the rules that decided them, and, at a training level, which modules are checkpointed
under the nesting mode (``decide``, by the rule the installed forwards follow at call time).
Printable and comparable; it runs no forward.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from ..config.levels import Level, is_checkpointed, parse_level
from ..runtime.wrapper import Rung, nests, rung_within

__all__ = ["PlanEntry", "CheckpointPlan", "decide", "run_label", "is_ancestor"]


@dataclass(frozen=True)
class PlanEntry:
    """One module selected by a config, and what the config decided for it."""

    name: str
    """Qualified name in ``model.named_modules()`` (``""`` is the model itself)."""
    class_name: str
    """``type(module).__name__``."""
    level: Level
    """The lowest level at which the module is checkpointed in any way (0: never)."""
    checkpointed: bool
    """Whether it is checkpointed at the plan's training level (in training mode, with grad)."""
    rule: str
    """The rules that decided its rungs, e.g. ``match='blocks.*' level=3``."""
    origin: str
    """Where those rules come from: ``rules[2]`` of the config, ``preset vit #3``, ``fallback``."""
    rungs: tuple[Rung, ...] = ()
    """Every way it is checkpointed, by increasing level (one per level)."""
    holds_several: frozenset[int] = frozenset()
    """Training levels at which it directly holds two or more fully checkpointed modules, and
    is therefore recomputed like a group (see ``CheckpointConfig.nesting``)."""
    lean: Level | None = None
    """The training level from which the module (an MLP, ``_lean``) runs with the lean backward
    (``LevelRule.lean``), or ``None``. Not a region: ``rungs`` and ``checkpointed`` leave it
    out."""
    nests_full: frozenset[int] = frozenset()
    """Training levels at which it is a full region holding a fully checkpointed region inside
    it: under torch.compile it runs between graphs there (NOTE [ Nested regions under
    torch.compile ] in the wrapper)."""

    def lean_at(self, level: int) -> bool:
        """Whether the module runs with the lean backward at training ``level``."""
        return self.lean is not None and is_checkpointed(self.lean, level)

    def rung_at(self, level: int) -> Rung | None:
        """The rung that applies at training ``level``: the highest one within it."""
        return rung_within(self.rungs, level)

    @property
    def through(self) -> str | None:
        """The last module of the run of siblings this module starts (a rule's ``through``;
        a module starts at most one), or ``None``."""
        return next((r.through for r in self.rungs if r.through is not None), None)


@dataclass(frozen=True)
class CheckpointPlan:
    """The modules a config selects in one model, with their levels; printable and comparable.

    Two plans are equal when they select the same modules with the same levels and decisions,
    from the same rules, with the same options.
    """

    model_class: str
    """Class name of the planned model (or its timm architecture name)."""
    entries: tuple[PlanEntry, ...]
    """Every selected module, in ``named_modules()`` order."""
    training_level: Level
    """The training level the ``checkpointed`` column was computed at."""
    pinned_training_level: Level | None
    """The config's training level, or ``None`` when the model follows the global level (then
    ``training_level`` is the global level at planning time, and the decisions follow it)."""
    nesting: str
    """``all`` or ``outermost``, as in the config."""
    preserve_rng_state: bool
    """As in the config."""
    device: str | None = field(default=None, compare=False)
    """The device type of the model's first parameter when planned (``cuda``, ``cpu``), or
    ``None``: where ``offload`` does something (on CUDA) or nothing. Not compared:
    a plan made on the meta device equals the one made after materialising."""

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[PlanEntry]:
        return iter(self.entries)

    def __getitem__(self, name: str) -> PlanEntry:
        """The entry of the module called ``name``."""
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(f"module {name!r} is not in the plan")

    @property
    def runs(self) -> tuple[tuple[PlanEntry, str], ...]:
        """Every entry that starts a run of sibling calls (a rule's ``through``), with the
        run's label (``'blocks.0.norm1..drop_path1'``)."""
        return tuple((e, run_label(e)) for e in self.entries if e.through is not None)

    @property
    def not_compiled(self) -> tuple[str, ...]:
        """What applies at the plan's training level but not under torch.compile, where the
        first compiled call warns once about each: the offloaded modules (``'name
        (offload)'``; plain full regions there). Everything else, runs of sibling calls and
        groups of layers included, applies under compile as in eager (docs/compile.md).

        >>> CheckpointPlan("M", (), Level.NONE, None, "all", True).not_compiled
        ()
        """
        return tuple(f"{e.name} (offload)" for e in self.offloaded)

    @property
    def offloaded(self) -> tuple[PlanEntry, ...]:
        """The entries whose region at the plan's training level is offloaded."""
        out = []
        for e in self.entries:
            rung = e.rung_at(self.training_level) if e.checkpointed else None
            if rung is not None and rung.offload:
                out.append(e)
        return tuple(out)

    @property
    def levels(self) -> dict[str, Level]:
        """``{qualified name: level}`` of every selected module."""
        return {e.name: e.level for e in self.entries}

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """Names of the modules checkpointed at the plan's training level."""
        return tuple(e.name for e in self.entries if e.checkpointed)

    def at_level(self, level: int | str | Level) -> CheckpointPlan:
        """The same plan with the ``checkpointed`` column computed at another training level.

        Only the display and :attr:`checkpointed` change; applying it still follows
        :attr:`pinned_training_level` (or the global level).

        >>> CheckpointPlan("M", (), Level.NONE, None, "all", True).at_level(3).training_level
        <Level.MEDIUM_MODULE: 3>
        """
        lv = parse_level(level, what="training level")
        entries = decide(self.entries, lv, self.nesting)
        return replace(self, entries=entries, training_level=lv)

    def _nested_by_fallback(self) -> list[str]:
        """With ``outermost``: the modules checkpointed inside another checkpointed one."""
        if self.nesting != "outermost":
            return []
        on = self.checkpointed
        return [n for n in on if any(is_ancestor(o, n) for o in on)]

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        source = "config" if self.pinned_training_level is not None else "global"
        title = (
            f"Checkpoint plan for {self.model_class}: training level {int(self.training_level)} "
            f"({source}), nesting {self.nesting}, {len(self.checkpointed)} of {len(self)} "
            "selected modules checkpointed"
        )
        nested = self._nested_by_fallback()
        if nested:
            title += (
                f"; {len(nested)} checkpointed inside a checkpointed group or a module holding "
                "several (recomputing those in one piece would raise the peak)"
            )
        table = Table(title=title, title_justify="left", box=None, pad_edge=False)
        for column in ("module", "class", "levels", "checkpointed", "rule", "origin"):
            table.add_column(column, overflow="fold")
        for e in self.entries:
            rung = e.rung_at(self.training_level) if e.checkpointed else None
            now = "-" if rung is None else rung.what
            if e.lean_at(self.training_level):
                now = "lean" if rung is None else f"{now}, lean"
            levels = [str(r) for r in e.rungs] + ([] if e.lean is None else [f"lean {e.lean:d}"])
            table.add_row(
                e.name or "(model)",
                e.class_name,
                ", ".join(levels) or "0",
                now,
                e.rule,
                e.origin,
            )
        buffer = io.StringIO()
        Console(file=buffer, width=140, color_system=None, force_terminal=False).print(table)
        text = "\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines())
        offloaded = [e.name for e in self.offloaded]
        if offloaded:
            where = (
                "on CUDA"
                if self.device == "cuda"
                else f"on CUDA only: on {self.device or 'this device'} this does nothing"
            )
            text += (
                f"\noffload: {len(offloaded)} region(s) ({', '.join(offloaded[:4])}"
                f"{' ...' if len(offloaded) > 4 else ''}) keep their inputs in pinned host "
                f"memory {where} (and under torch.compile they are plain full regions)."
            )
        return text + "\n"


def decide(entries: tuple[PlanEntry, ...], level: Level, nesting: str) -> tuple[PlanEntry, ...]:
    """Recompute ``checkpointed`` for every entry at ``level`` under ``nesting``, as the installed
    forwards decide at call time (``wrapper.choose_rung``), with the same rule
    (``wrapper.nests``). Entries come parents first (``named_modules()`` order)."""
    on: dict[str, Rung] = {}  # checkpointed entries and their rung
    holds = {e.name: e.holds_several for e in entries}
    out = []
    for e in entries:
        rung = e.rung_at(level)
        decided = rung is not None
        if decided:
            outer = [name for name in on if is_ancestor(name, e.name)]
            if outer:
                nearest = max(outer, key=len)
                group = on[nearest].group or int(level) in holds[nearest]
                decided = nests(nesting, rung, group)  # type: ignore[arg-type]
        if decided:
            on[e.name] = rung  # type: ignore[assignment]
        out.append(replace(e, checkpointed=decided) if decided != e.checkpointed else e)
    return tuple(out)


def run_label(entry: PlanEntry) -> str:
    """The label of the run ``entry`` starts, as errors and warnings quote it."""
    return f"{entry.name}..{entry.through}"


def is_ancestor(name: str, of: str) -> bool:
    return name != of and (name == "" or of.startswith(name + "."))
