"""From a config to a checkpointed model: ``plan`` (pure), ``apply`` and ``remove``.

:func:`plan` resolves a :class:`~vision_ckpt.CheckpointConfig` against one model: the preset's
rules (if any) and then the config's rules are matched against ``model.named_modules()``, the last
matching rule deciding each module's level. It runs no forward and changes nothing, so a plan can
be printed, compared and tested without running the model.

:func:`apply` installs a plan in place. It does not insert wrapper modules into the tree: each
selected module gets an instance-level ``forward`` (a small picklable object) that decides at
every call whether to run the class's forward through the checkpoint core. So the state dict,
``named_modules()``, parameters and hooks of the model are exactly those of the plain model, a
state dict moves freely between the two, ``copy.deepcopy`` and ``pickle`` work, and
:func:`remove` restores the model by deleting those attributes.
"""

from __future__ import annotations

import difflib
import io
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from torch import nn

from ..config.levels import Level, is_checkpointed, parse_level
from ..config.matching import ModuleMatcher, later_siblings, qualified_class_name
from ..config.schema import CheckpointConfig, KeepOps, LevelRule
from ..errors import ConfigError
from ..runtime._lean import lean_mlp_problem
from ..runtime._selective import SaveOps
from ..runtime.wrapper import (
    Policy,
    Rung,
    get_training_level,
    nests,
    rung_within,
    segment_size,
)
from ._install import install, install_chain, uninstall

__all__ = [
    "PlanEntry",
    "CheckpointPlan",
    "plan",
    "apply",
    "remove",
    "apply_preset",
    "as_config",
    "self_checkpointing",
]

ConfigLike = CheckpointConfig | Mapping[str, Any] | str | Path


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
        return tuple((e, _run_label(e)) for e in self.entries if e.through is not None)

    @property
    def not_compiled(self) -> tuple[str, ...]:
        """What applies at the plan's training level but not under torch.compile, where the
        first compiled call warns once about each: the runs of sibling calls (their labels;
        there the run's first module is checkpointed alone with the run's rung, the others as
        their own rules say) and the offloaded modules (``'name (offload)'``;
        plain full regions there). Everything else applies under compile as in eager
        (docs/compile.md).

        >>> CheckpointPlan("M", (), Level.NONE, None, "all", True).not_compiled
        ()
        """
        offload = [f"{e.name} (offload)" for e in self.offloaded]
        return (*self._runs_not_compiled(), *offload)

    def _runs_not_compiled(self) -> list[str]:
        """The labels of the runs of sibling calls that apply at the plan's training level."""
        level = self.training_level
        return [
            label
            for e, label in self.runs
            if any(r.through is not None and is_checkpointed(r.level, level) for r in e.rungs)
        ]

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
        entries = _decide(self.entries, lv, self.nesting)
        return replace(self, entries=entries, training_level=lv)

    def _nested_by_fallback(self) -> list[str]:
        """With ``outermost``: the modules checkpointed inside another checkpointed one."""
        if self.nesting != "outermost":
            return []
        on = self.checkpointed
        return [n for n in on if any(_is_ancestor(o, n) for o in on)]

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
        runs = self._runs_not_compiled()
        if runs:
            shown = ", ".join(runs[:4]) + (f" and {len(runs) - 4} more" if len(runs) > 4 else "")
            text += (
                f"\nUnder torch.compile {len(runs)} run(s) of sibling calls are not applied "
                f"({shown}): each run's first module is checkpointed alone, the others as "
                "their own rules say; gradients stay exact, memory differs."
            )
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


def _decide(entries: tuple[PlanEntry, ...], level: Level, nesting: str) -> tuple[PlanEntry, ...]:
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
            outer = [name for name in on if _is_ancestor(name, e.name)]
            if outer:
                nearest = max(outer, key=len)
                group = on[nearest].group or int(level) in holds[nearest]
                decided = nests(nesting, rung, group)  # type: ignore[arg-type]
        if decided:
            on[e.name] = rung  # type: ignore[assignment]
        out.append(replace(e, checkpointed=decided) if decided != e.checkpointed else e)
    return tuple(out)


def _run_label(entry: PlanEntry) -> str:
    """The label of the run ``entry`` starts, as errors and warnings quote it."""
    return f"{entry.name}..{entry.through}"


def _is_ancestor(name: str, of: str) -> bool:
    return name != of and (name == "" or of.startswith(name + "."))


def as_config(config: ConfigLike) -> CheckpointConfig:
    """A :class:`CheckpointConfig` from what ``plan``/``apply`` accept: a config, a dict of its
    keys, or the path of a .yaml/.json file.

    >>> as_config({"training_checkpoint_level": 2}).training_checkpoint_level
    <Level.SMALL_BLOCK: 2>
    """
    if isinstance(config, CheckpointConfig):
        return config
    if isinstance(config, (str, Path)):
        return CheckpointConfig.from_file(config)
    if isinstance(config, Mapping):
        return CheckpointConfig.model_validate(dict(config))
    raise ConfigError(
        f"config of type {type(config).__name__} is not a checkpoint config; pass a "
        "CheckpointConfig, a dict of its keys, or the path of a .yaml/.json file."
    )


def _model_label(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None)
    arch = cfg.get("architecture") if isinstance(cfg, Mapping) else None
    return f"{arch} ({type(model).__name__})" if arch else type(model).__name__


def _children_summary(model: nn.Module) -> str:
    names = [f"{n} ({type(m).__name__})" for n, m in model.named_children()]
    return ", ".join(names) if names else "none (the model has no submodules)"


def _has_forward(module: nn.Module) -> bool:
    # ModuleList, ModuleDict and friends have no forward: nobody calls them, so checkpointing
    # them would do nothing.
    return type(module).forward is not nn.Module.forward


def _preset_rules(model: nn.Module, preset: str) -> list[tuple[LevelRule, str]]:
    # Imported on first use: plans that name no preset never load the YAML registry.
    from ..config import presets

    return list(presets.preset_rules(model, preset))


def plan(model: nn.Module, config: ConfigLike) -> CheckpointPlan:
    """Resolve ``config`` against ``model``: which modules get which level. Pure.

    Rules are applied in order (the preset's first, then the config's); when several select a
    module, the last one wins, and the plan records which. Runs no forward and does not modify
    the model.

    Args:
        model: any ``nn.Module``.
        config: a :class:`CheckpointConfig`, a dict of its keys, or a .yaml/.json path.

    Returns:
        The :class:`CheckpointPlan`; ``str(plan)`` is a readable table.

    Raises:
        ConfigError: the config is invalid, a config rule selects no module (a warning instead
            with ``strict: false``), the training level is ``auto``, a preset is unavailable,
            or a ``keep`` names an operator torch does not have.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> p = plan(net, {"training_checkpoint_level": 1, "rules": [{"match": "*", "level": 1}]})
    >>> p.checkpointed
    ('0', '1', '2')
    >>> plan(net, {"rules": [{"match": "blocks.*", "level": 3}]})
    Traceback (most recent call last):
    ...
    vision_ckpt.errors.ConfigError: rules[0] (match='blocks.*' level=3) selects no module of ...
    """
    cfg = as_config(config)
    _check_plannable(cfg)
    modules = [(n, m) for n, m in model.named_modules()]
    class_names = {n: (type(m).__name__, qualified_class_name(m)) for n, m in modules}
    decided = _ways(model, cfg, modules, class_names)
    _check_runs(model, decided)
    _check_lean(decided)
    pinned = cfg.training_checkpoint_level
    level = pinned if pinned is not None else get_training_level()
    entries = _holds_several(
        _runs_take_over(
            model,
            _step_aside(
                tuple(_entry(n, class_names[n][0], decided[n]) for n, _ in modules if n in decided)
            ),
        )
    )
    return CheckpointPlan(
        model_class=_model_label(model),
        entries=_decide(entries, level, cfg.nesting),
        training_level=level,
        pinned_training_level=pinned,
        nesting=cfg.nesting,
        preserve_rng_state=cfg.preserve_rng_state,
        device=next((p.device.type for p in model.parameters()), None),
    )


def _check_plannable(cfg: CheckpointConfig) -> None:
    """Checked before anything is planned: a training level and a preset that can be planned
    without an input."""
    if cfg.training_checkpoint_level == "auto":
        raise ConfigError(
            f"training_checkpoint_level 'auto' (memory_budget {cfg.memory_budget!r}) cannot be "
            "applied directly: plan it first with vision_ckpt.tune.resolve_auto(model, "
            "example_input, config), which returns the fastest per-block config that fits, "
            "and apply that; or give a level 0-5."
        )
    if cfg.preset == "derived":
        raise ConfigError(
            "preset 'derived' is measured on an input, so it cannot be planned from the model "
            "alone: resolve it first with vision_ckpt.tune.derive.resolve_derived(model, "
            "example_input, config) (cached per model class and input shape) and apply what "
            "it returns; or write the derived preset once with `vision-ckpt derive --out` and "
            "register it."
        )


@dataclass(frozen=True)
class _Way:
    """One way a rule makes of a module: the rule (its level, keep and flags, and the plan's
    text), where it came from, and the span of its region: the rule's own, or one group of a
    ModuleList's layers run from its first through its last (NOTE [ Groups of a ModuleList ]),
    which no rule of a file can spell."""

    rule: LevelRule
    origin: str
    through: str | None
    segments: int | Literal["auto"] | None

    @classmethod
    def of(cls, rule: LevelRule, origin: str) -> _Way:
        return cls(rule, origin, rule.through, rule.segments)

    @property
    def key(self) -> tuple[Any, ...]:
        """What the way makes of the module (``LevelRule.way``), with the group's span in place
        of the rule's for a ModuleList's group."""
        way = self.rule.way
        return way if way[0] != "region" else (*way[:3], self.segments, self.through)


_Ways = dict[str, dict[tuple[Any, ...], _Way]]
"""Per module, per way of checkpointing it (a region's span and keep, or lean): the last rule
that set it."""


def _ways(
    model: nn.Module,
    cfg: CheckpointConfig,
    modules: list[tuple[str, nn.Module]],
    class_names: dict[str, tuple[str, str]],
) -> _Ways:
    """The ways the rules (the preset's, then the config's) checkpoint each module. A later rule
    at the same level replaces any other; a rule of level 0 clears them all."""
    ordered: list[tuple[LevelRule, str, bool]] = []  # rule, origin, must match something
    if cfg.preset is not None:
        ordered += [(rule, origin, False) for rule, origin in _preset_rules(model, cfg.preset)]
    ordered += [(rule, f"rules[{i}]", True) for i, rule in enumerate(cfg.rules)]

    decided: _Ways = {}
    for rule, origin, required in ordered:
        if rule.keep is not None and rule.keep.ops != "heavy":
            try:  # unknown op names fail here, a preset's too, before anything runs
                SaveOps.for_keep(rule.keep).resolve()
            except ConfigError as exc:
                raise ConfigError(f"{origin} ({rule}): {exc}") from None
        matcher = ModuleMatcher(rule.match, rule.match_type)
        hits = [n for n, m in modules if matcher.matches(n, *class_names[n])]
        callable_hits = [n for n in hits if _has_forward(model.get_submodule(n))]
        stacks = [
            n
            for n in hits
            if rule.segments is not None and isinstance(model.get_submodule(n), nn.ModuleList)
        ]
        if required and not callable_hits and not stacks:
            _no_match(model, modules, rule, origin, hits, strict=cfg.strict)
        if rule.segments is not None:
            _check_segments(model, rule, origin, callable_hits)
        for name in stacks:  # NOTE [ Groups of a ModuleList ]
            _add_groups(decided, model, name, rule, origin)
        if rule.lean:
            callable_hits = _lean_hits(model, rule, origin, callable_hits, required)
        if rule.through is not None:
            if not required:  # see NOTE [ A preset's runs ]
                callable_hits = [
                    n for n in callable_hits if rule.through in later_siblings(model, n)
                ]
            for name in callable_hits:
                run_members(model, name, rule.through, f"{origin} ({rule})")
        for name in callable_hits:
            _add_way(decided, name, _Way.of(rule, origin))
    return decided


def _add_groups(decided: _Ways, model: nn.Module, name: str, rule: LevelRule, origin: str) -> None:
    """Record the runs ``rule`` (``segments``) makes of the ``ModuleList`` ``name``
    (NOTE [ Groups of a ModuleList ])."""
    for first, way in _group_runs(model, name, rule, origin):
        alone = way.through is None  # a group of one layer ...
        if alone and any(  # ... that is a region at a lower level already
            _plain(w.rule) and w.through is None and 0 < w.rule.level < rule.level
            for w in decided.get(first, {}).values()
        ):
            continue
        _add_way(decided, first, way)


def _add_way(decided: _Ways, name: str, way: _Way) -> None:
    """Record that ``way`` checkpoints module ``name``."""
    rule = way.rule
    if rule.level == 0 and rule.lean:  # takes the lean level away only
        ways = decided.get(name, {})
        for other in [k for k, w in ways.items() if w.rule.lean]:
            del ways[other]
        if not ways:
            decided[name] = {way.key: way}
    elif rule.level == 0:
        decided[name] = {way.key: way}
    else:
        ways = decided.setdefault(name, {})
        ways.pop(("none",), None)
        # a lean rule replaces the module's other lean rule; a region's rule replaces the
        # regions' rules of its level (a lean level is not a region's)
        lean = rule.lean
        for other in [
            k
            for k, w in ways.items()
            if w.rule.lean == lean and (lean or w.rule.level == rule.level)
        ]:
            del ways[other]
        ways[way.key] = way


def _plain(rule: LevelRule) -> bool:
    """Whether ``rule`` makes a region that keeps nothing, in device memory."""
    return not rule.lean and rule.keep is None and not rule.offload


# NOTE [ Groups of a ModuleList ]
# BEiT, EVA and many others keep their layers in an nn.ModuleList and call them from their own
# forward, one after another, passing each the previous one's output and the same keyword
# arguments (a relative position bias, a rotary embedding). Nobody calls the list, so 'segments'
# on it cannot split one forward as it splits an nn.Sequential's. Instead every group of about
# sqrt(n) consecutive layers becomes a run from its first layer through its last (the regions
# of consecutive calls of NOTE [ Runs of sibling calls ]): a span with both 'through' and
# 'segments' (Rung.layer_group_run), which the plan builds (_Way) and no rule spells. Unlike
# other runs it is a group: its layers keep their own rungs inside it, so the
# run's recomputation holds the inputs of its layers, each recomputed again on its own, as an
# nn.Sequential's segments do (NOTE [ Nesting ]). A group of one layer is a plain region of it,
# unless that layer is a region at a lower level already (a ladder of two equal regions).
# No module is inserted, so names and the state dict stay the model's.


def _group_runs(
    model: nn.Module, name: str, rule: LevelRule, origin: str
) -> list[tuple[str, _Way]]:
    """The first layer of every group a ``segments`` rule makes of the ModuleList ``name``,
    with the way it starts: a run through the group's last layer, marked by the rule's
    ``segments``, or the layer alone in a group of one (NOTE [ Groups of a ModuleList ])."""
    children = list(model.get_submodule(name)._modules)
    size = segment_size(Rung(rule.level, segments=rule.segments), len(children))
    out = []
    for start in range(0, len(children), size):
        group = children[start : start + size]
        first = f"{name}.{group[0]}" if name else group[0]
        if len(group) == 1:
            out.append((first, _Way(rule, origin, None, None)))
        else:
            out.append((first, _Way(rule, origin, group[-1], rule.segments)))
    return out


def _entry(name: str, class_name: str, ways: dict[tuple[Any, ...], _Way]) -> PlanEntry:
    """The plan entry of one module from the ways that decided its rungs."""
    used = sorted(ways.values(), key=lambda w: int(w.rule.level))
    rungs = tuple(
        Rung(
            w.rule.level,
            keep=w.rule.keep,
            segments=w.segments,
            through=w.through,
            offload=w.rule.offload,
        )
        for w in used
        if w.rule.level > 0 and not w.rule.lean
    )
    lean = next((w.rule.level for w in used if w.rule.level > 0 and w.rule.lean), None)
    levels = [r.level for r in rungs] + ([lean] if lean is not None else [])
    return PlanEntry(
        name=name,
        class_name=class_name,
        level=min(levels, default=Level.NONE),
        lean=lean,
        checkpointed=False,
        rule="; ".join(str(w.rule) for w in used),
        origin="; ".join(dict.fromkeys(w.origin for w in used)),
        rungs=rungs,
    )


def _step_aside(entries: tuple[PlanEntry, ...]) -> tuple[PlanEntry, ...]:
    """Give every selective rung its ``until``: the lowest full rung inside its module (see
    NOTE [ Selective regions step aside ] in wrapper.py)."""
    out = []
    for e in entries:
        if any(r.selective for r in e.rungs):
            inner = [
                r.level
                for o in entries
                if _is_ancestor(e.name, o.name)
                for r in o.rungs
                if not r.selective
            ]
            until = min(inner, default=None)
            if until is not None:
                rungs = tuple(replace(r, until=Level(until)) if r.selective else r for r in e.rungs)
                e = replace(e, rungs=rungs)
        out.append(e)
    return tuple(out)


# NOTE [ Runs take over ]
# A later member of a run (bn1 of conv_pw..bn1) may have rungs of its own below the run's level:
# a ladder where the finer region comes first. Its rungs stop applying (``until``) at the run's
# level, from which its forward belongs to the run; below it the run is not open and the member
# is checkpointed alone (``_install.ChainedForward`` carries the member's own policy for that).
# At no level are both active, so a call is never recomputed twice for one region. A member
# may not start a run of its own or be split into segments (``_check_runs``). Where the run's
# first module is, at some level, checkpointed by another rung of its own instead of the run,
# the run is not open there and the later members run plainly. The runs of a ModuleList's
# groups are the exception: there every member keeps its rungs, inside the run as outside
# (NOTE [ Groups of a ModuleList ]).


def _runs_take_over(model: nn.Module, entries: tuple[PlanEntry, ...]) -> tuple[PlanEntry, ...]:
    """End every run member's own rungs at the level of the run it belongs to (NOTE [ Runs
    take over ])."""
    ends: dict[str, Level] = {}
    for e in entries:
        run = next((r for r in e.rungs if r.through is not None), None)
        if run is not None and not run.layer_group_run:  # a group's layers keep their rungs
            for member in run_members(model, e.name, run.through, f"the run {e.name!r}")[1:]:
                ends[member] = min(ends.get(member, run.level), run.level)
    out = []
    for e in entries:
        end = ends.get(e.name)
        if end is not None and e.rungs:
            rungs = tuple(
                replace(r, until=end if r.until is None else min(r.until, end)) for r in e.rungs
            )
            e = replace(e, rungs=rungs)
        out.append(e)
    return tuple(out)


def _holds_several(entries: tuple[PlanEntry, ...]) -> tuple[PlanEntry, ...]:
    """Give every entry the training levels at which two or more fully checkpointed entries
    sit directly inside it (no eligible entry between them)."""
    holds: dict[str, set[int]] = {}
    for level in range(1, 6):
        rungs = {e.name: r for e in entries if (r := e.rung_at(level)) is not None}
        count: dict[str, int] = {}
        for name, rung in rungs.items():
            if rung.selective:
                continue
            parent = _nearest(name, rungs)
            if parent is not None:
                count[parent] = count.get(parent, 0) + 1
        for parent, n in count.items():
            if n >= 2:
                holds.setdefault(parent, set()).add(level)
    return tuple(
        replace(e, holds_several=frozenset(holds[e.name])) if e.name in holds else e
        for e in entries
    )


def _nearest(name: str, among: Mapping[str, Any]) -> str | None:
    """The deepest proper ancestor of module ``name`` that is a key of ``among`` (``""``, the
    model, included)."""
    parts = name.split(".") if name else []
    for depth in range(len(parts) - 1, -1, -1):
        candidate = ".".join(parts[:depth])
        if candidate in among:
            return candidate
    return None


def _check_segments(model: nn.Module, rule: LevelRule, origin: str, names: list[str]) -> None:
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, nn.Sequential) or type(module).forward is not (
            nn.Sequential.forward
        ):
            raise ConfigError(
                f"{origin} ({rule}) gives segments to {name or '(model)'!r}, a "
                f"{type(module).__name__}; segments split an nn.Sequential (a stack of layers "
                "called one after the other) into groups, and this module has its own forward. "
                "Select the nn.Sequential that holds the layers, or drop segments."
            )


# NOTE [ A preset's runs ]
# A preset's rule with 'through' selects only the modules that have that later sibling: one
# family can hold blocks whose children come in different orders (timm's EfficientNet class
# builds an inverted residual, conv_pw before bn1, and a depthwise-separable block, bn1 before
# conv_pw, and MobileNet-V1 uses the second in every stage), and the rule is written for one
# of them. A user's rule stays strict: a run that does not exist is an error (run_members).


def run_members(model: nn.Module, name: str, through: str, origin: str) -> list[str]:
    """Qualified names of the run from module ``name`` through its later sibling ``through``,
    in the parent's order of children (a rule's ``through``).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
    ...                           torch.nn.ReLU(), torch.nn.Flatten())
    >>> run_members(net, "0", "2", "a rule")
    ['0', '1', '2']
    """
    parent_name, _, own = name.rpartition(".")
    if not name:
        raise ConfigError(
            f"{origin} runs the model itself through {through!r}; 'through' names a later "
            "sibling of the selected module, and the model has none. Select the first module "
            "of the run instead."
        )
    later = later_siblings(model, name)
    if through not in later:
        where = f"{parent_name!r}" if parent_name else "the model"
        raise ConfigError(
            f"{origin} runs {name!r} through {through!r}, which is not a later child of "
            f"{where}; its children after {own!r} are: {', '.join(later) or '(none)'}. Name "
            "the last module of the run."
        )
    prefix = f"{parent_name}." if parent_name else ""
    return [prefix + c for c in [own, *later[: later.index(through) + 1]]]


def _check_runs(model: nn.Module, decided: _Ways) -> None:
    """A module is the first of at most one run, no member of a run is lean (a run calls its
    members' own forwards), and a later member of a run has no level of its own from the run's
    level on (its forward belongs to the run there) and neither a run nor segments below it
    (NOTE [ Runs take over ])."""
    for name, ways in decided.items():
        runs = {
            w.through: (w.rule, w.origin)
            for w in ways.values()
            if w.through is not None and w.rule.level > 0
        }
        if len(runs) > 1:
            texts = "; ".join(f"{o} ({r})" for r, o in runs.values())
            raise ConfigError(
                f"{name!r} starts runs through {', '.join(map(repr, runs))} ({texts}); a module "
                "starts at most one run. Keep one of these rules, or give them one 'through'."
            )
        for through, (rule, origin) in runs.items():
            members = run_members(model, name, through, f"{origin} ({rule})")
            for member in members:
                lean = decided.get(member, {}).get(("lean",))
                if lean is not None:
                    r, o = lean.rule, lean.origin
                    raise ConfigError(
                        f"{o} ({r}) makes {member!r} lean, and {origin} ({rule}) runs it with "
                        "its siblings as one region; a run calls its members' own forwards. "
                        "Drop the lean rule for it (a level-0 rule with lean: true), or "
                        "the run."
                    )
            for member in members[1:]:
                own = decided.get(member, {})
                # below the run's level a member may be a region alone (NOTE [ Runs take
                # over ]), but neither another run nor a stack of segments
                clash = [
                    w
                    for w in own.values()
                    if w.rule.level >= rule.level or w.through is not None or w.segments is not None
                ]
                if clash:
                    r, o = clash[0].rule, clash[0].origin
                    what = (
                        "starts a run of its own"
                        if clash[0].through is not None
                        else "is split into segments"
                        if clash[0].segments is not None and r.level < rule.level
                        else f"has a level of its own, not below the run's {int(rule.level)}"
                    )
                    raise ConfigError(
                        f"{member!r} is inside the run {name!r} through {through!r} of {origin} "
                        f"({rule}) and {what}, from {o} ({r}); from the run's level on, a "
                        "module of a run is checkpointed with the run, and below it only alone "
                        "(no 'through', no 'segments'). Drop one of the two rules, give the "
                        "module a lower level than the run, or end the run before it."
                    )


def _lean_hits(
    model: nn.Module, rule: LevelRule, origin: str, names: list[str], required: bool
) -> list[str]:
    """The modules a ``lean`` rule selects that can run lean: a preset's rule leaves out the
    others (a family can hold MLPs of other layouts, ``use_conv`` ones say); a user's rule
    selecting one is an error."""
    kept = []
    for name in names:
        problem = lean_mlp_problem(model.get_submodule(name))
        if problem is None:
            kept.append(name)
        elif required:
            raise ConfigError(
                f"{origin} ({rule}) makes {name or '(the model)'!r} lean, but {problem}. "
                "lean: true is for an MLP: two nn.Linear or pointwise (1x1) nn.Conv2d "
                "layers around a GELU, SiLU, ReLU, Hardswish or StarReLU with no dropout "
                "between, a timm Mlp or a module whose forward calls them one after another. "
                "Select the MLP modules "
                "themselves (such as 'blocks.*.mlp'), or make them a region (drop lean)."
            )
    return kept


def _check_lean(decided: _Ways) -> None:
    """A lean module's forward calls none of its children's: none may have a rule (a lean
    member of a run: ``_check_runs``)."""
    lean = {n: ways for n, ways in decided.items() if ("lean",) in ways}
    for name, ways in lean.items():
        inner = [n for n in decided if _is_ancestor(name, n) and ("none",) not in decided[n]]
        if inner:
            rule, origin = ways[("lean",)].rule, ways[("lean",)].origin
            other = next(iter(decided[inner[0]].values()))
            r, o = other.rule, other.origin
            raise ConfigError(
                f"{origin} ({rule}) makes {name!r} lean, and {o} ({r}) selects "
                f"{inner[0]!r} inside it; a lean MLP computes its layers itself and never "
                "calls their forwards. Checkpoint the MLP as a whole (a full or selective "
                "rule on the MLP), or drop one of the rules."
            )


def _no_match(
    model: nn.Module,
    modules: list[tuple[str, nn.Module]],
    rule: LevelRule,
    origin: str,
    hits: list[str],
    strict: bool,
) -> None:
    where = f"{origin} ({rule}) selects no module of {_model_label(model)}"
    if hits:
        kinds = sorted({type(model.get_submodule(n)).__name__ for n in hits})
        example = f"{hits[0]}.*" if hits[0] else "*"
        message = (
            f"{where} that runs a forward: it selects only {', '.join(map(repr, hits[:5]))} "
            f"({', '.join(kinds)}), containers that are never called. Select their children "
            f"instead, e.g. {example!r}."
        )
    else:
        hint = ""
        if rule.match is not None:
            close = _close(rule.match, [n for n, _ in modules if n])
            if close:
                hint = f" Close names: {', '.join(close)}."
        if rule.match_type is not None:
            close = _close(rule.match_type.split(".")[-1], [type(m).__name__ for _, m in modules])
            if close:
                hint += f" Close classes: {', '.join(close)}."
        message = (
            f"{where}; top-level children: {_children_summary(model)}.{hint} In 'match', '*' is "
            "one name component and '**' any number; list the names with "
            "[n for n, _ in model.named_modules()]. Fix or remove the rule, or set strict: false "
            "to only warn."
        )
    if strict:
        raise ConfigError(message)
    warnings.warn(message, UserWarning, stacklevel=4)


def _close(word: str, candidates: list[str]) -> list[str]:
    """Up to three candidates that look like ``word``, ignoring case."""
    by_lower: dict[str, str] = {}
    for c in candidates:
        by_lower.setdefault(c.lower(), c)
    return [by_lower[c] for c in difflib.get_close_matches(word.lower(), list(by_lower), n=3)]


def apply(model: nn.Module, config: ConfigLike | CheckpointPlan) -> CheckpointPlan:
    """Install checkpointing on the modules a config (or a plan) selects, in place.

    Each selected module with a level of at least 1 gets an instance-level ``forward`` that
    checkpoints the module's own forward when its level is within the training level (the
    config's, or the global one: changing it takes effect at the next forward), the module is
    in training mode and grad is enabled. Applying again first removes what a previous
    :func:`apply` installed, so applying twice equals applying once. The state dict, parameters,
    ``named_modules()`` and numerics of the model are unchanged.

    Args:
        model: the model to modify in place.
        config: a :class:`CheckpointConfig`, a dict of its keys, a .yaml/.json path, or a
            :class:`CheckpointPlan` made by :func:`plan` for this model.

    Returns:
        The plan that was installed.

    Raises:
        ConfigError: as :func:`plan`; or the plan names a module this model does not have; or
            the model's own gradient checkpointing (Hugging Face's) is on.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    >>> p = apply(net, {"training_checkpoint_level": 2, "rules": [{"match": "*", "level": 2}]})
    >>> net(torch.randn(3, 4, requires_grad=True)).sum().backward()
    >>> remove(net)
    3
    """
    the_plan = config if isinstance(config, CheckpointPlan) else plan(model, config)
    installs = []
    for entry in the_plan.entries:
        try:
            module = model.get_submodule(entry.name)
        except AttributeError:
            module = None
        if module is None or type(module).__name__ != entry.class_name:
            found = "not found" if module is None else f"a {type(module).__name__}"
            raise ConfigError(
                f"the plan does not fit this model: it has module {entry.name!r} as a "
                f"{entry.class_name}, the model has {found}. Make the plan with "
                "vision_ckpt.plan(model, config) for this very model."
            )
        installs.append((entry, module))
    _refuse_a_second_checkpointer(model)
    remove(model)
    shared: dict[KeepOps, SaveOps] = {}  # one per keep policy: it tracks the ops met
    runs = {
        entry.name: run_members(model, entry.name, entry.through, f"the plan's {entry.name!r}")
        for entry, _ in installs
        if entry.through is not None
    }
    in_runs = {n for names in runs.values() for n in names}
    install(
        (module, entry.name, _policy(the_plan, entry, shared))
        for entry, module in installs
        # never checkpointed or lean: leave it untouched
        if (entry.rungs or entry.lean is not None) and entry.name not in in_runs
    )
    own = {  # a later member's own rungs, for its calls outside the run (NOTE [ Runs take over ])
        e.name: _policy(the_plan, e, shared)
        for e, _ in installs
        if e.name in in_runs and e.name not in runs
    }
    for entry, _ in installs:
        if entry.name in runs:
            names = runs[entry.name]
            # a group's first layer keeps its rungs below the run inside it too (NOTE [ Groups
            # of a ModuleList ]); the rungs of another run's first module never nest in it
            group = any(r.layer_group_run for r in entry.rungs)
            if group:
                alone = replace(entry, rungs=tuple(r for r in entry.rungs if r.through is None))
                own[entry.name] = _policy(the_plan, alone, shared)
            install_chain(
                [(model.get_submodule(n), n, own.get(n)) for n in names],
                _policy(the_plan, entry, shared),
                _run_label(entry),
                nested=group,
            )
    return the_plan


def self_checkpointing(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that checkpoint themselves: Hugging Face's own
    switch sets ``gradient_checkpointing = True`` on each layer it checkpoints.

    >>> import torch
    >>> self_checkpointing(torch.nn.Linear(2, 2))
    []
    """
    return [
        n or "(the model)"
        for n, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
    ]


def _refuse_a_second_checkpointer(model: nn.Module) -> None:
    """Hugging Face models checkpoint their layers themselves when ``gradient_checkpointing`` is
    on; our regions inside and around theirs would be recomputed in one of torch's runs of a
    layer and not in the other (torch then fails at backward). One checkpointer at a time."""
    on = self_checkpointing(model)
    if on:
        raise ConfigError(
            f"{type(model).__name__} checkpoints itself: gradient_checkpointing is on in "
            f"{', '.join(on[:3])}{' ...' if len(on) > 3 else ''}. Turn it off first "
            "(model.gradient_checkpointing_disable()), or use "
            "vision_ckpt.integrations.hf.enable_checkpointing(model, level), which does."
        )


def _policy(the_plan: CheckpointPlan, entry: PlanEntry, shared: dict[KeepOps, SaveOps]) -> Policy:
    rungs = []
    for r in entry.rungs:
        context_fn = None
        if r.keep is not None:
            if r.keep not in shared:
                shared[r.keep] = SaveOps.for_keep(r.keep)
            context_fn = shared[r.keep]
        rungs.append(replace(r, context_fn=context_fn))
    return Policy(
        tuple(rungs),
        the_plan.pinned_training_level,
        the_plan.nesting,  # type: ignore[arg-type]
        the_plan.preserve_rng_state,
        entry.holds_several,
        entry.lean,
    )


def remove(model: nn.Module) -> int:
    """Undo :func:`apply`: give every module back the forward it had. Returns how many.

    >>> import torch
    >>> remove(torch.nn.Linear(2, 2))
    0
    """
    return uninstall(model)


def apply_preset(
    model: nn.Module, level: int | str | Level, preset: str = "auto", **options: Any
) -> CheckpointPlan:
    """Apply a preset's levels at training level ``level``: ``apply_preset(model, 3)``.

    Args:
        model: the model to modify in place.
        level: the training level 0-5 for this model.
        preset: a family name (see ``vision_ckpt.list_presets()``) or ``"auto"`` to choose it
            from the model's class.
        **options: other :class:`CheckpointConfig` keys (``nesting``, ``rules``...).

    Returns:
        The installed plan.

    Raises:
        LevelError: ``level`` is not 0-5.
        ConfigError: no preset fits, or an option is invalid.
    """
    lv = parse_level(level, what="training level")
    cfg = CheckpointConfig(training_checkpoint_level=lv, preset=preset, **options)
    return apply(model, cfg)
