"""``plan()``: a config resolved against one model, pure.

Owns the resolution of rules into a :class:`~vision_ckpt.regions._plan_record.CheckpointPlan`:
a config from what ``plan``/``apply`` accept (``as_config``), the preset's rules then the
config's matched against ``model.named_modules()`` (later rules win, one rung per way), the
spans of runs and of a ``ModuleList``'s groups (NOTE [ Groups of a ModuleList ], NOTE [ Runs
take over ], NOTE [ A preset's runs ]), and the checks that refuse a config before anything
runs, each naming the rule at fault.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from torch import nn

from ..config.levels import Level
from ..config.matching import ModuleMatcher, later_siblings, qualified_class_name
from ..config.schema import CheckpointConfig, LevelRule, Region
from ..errors import ConfigError
from ..runtime._lean import lean_mlp_problem
from ..runtime._selective import SaveOps
from ..runtime.wrapper import Rung, get_training_level, segment_size
from ._plan_record import CheckpointPlan, PlanEntry, decide, is_ancestor

__all__ = ["ConfigLike", "as_config", "plan", "run_members"]

ConfigLike = CheckpointConfig | Mapping[str, Any] | str | Path


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
                tuple(
                    _segments_inside(m, _entry(n, class_names[n][0], decided[n]))
                    for n, m in modules
                    if n in decided
                )
            ),
        )
    )
    entries = _nests_full(model, entries, cfg.nesting)
    return CheckpointPlan(
        model_class=_model_label(model),
        entries=decide(entries, level, cfg.nesting),
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
    """One way a rule makes of a module: the rule (its level, flags and the plan's text), where
    it came from, and its region: the rule's own, or one group of a ModuleList's layers run
    from its first through its last (NOTE [ Groups of a ModuleList ]), which no rule of a file
    can spell; ``None`` for level 0 and lean."""

    rule: LevelRule
    origin: str
    region: Region | None

    @classmethod
    def of(cls, rule: LevelRule, origin: str) -> _Way:
        return cls(rule, origin, rule.region)

    @property
    def through(self) -> str | None:
        return None if self.region is None else self.region.through

    @property
    def segments(self) -> int | Literal["auto"] | None:
        return None if self.region is None else self.region.segments

    @property
    def key(self) -> Region | str:
        """What the way makes of the module (``LevelRule.way``), with the group's span in place
        of the rule's for a ModuleList's group."""
        return self.rule.way if self.region is None else self.region


_Ways = dict[str, dict[Region | str, _Way]]
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
        ways.pop("none", None)
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
    size = segment_size(Rung(rule.level, Region(segments=rule.segments)), len(children))
    out = []
    for start in range(0, len(children), size):
        group = children[start : start + size]
        first = f"{name}.{group[0]}" if name else group[0]
        region = rule.region
        if region is not None:  # a level-0 rule clears the group's first layer either way
            alone = len(group) == 1
            through, segments = (None, None) if alone else (group[-1], region.segments)
            region = replace(region, through=through, segments=segments)
        out.append((first, _Way(rule, origin, region)))
    return out


def _entry(name: str, class_name: str, ways: dict[Region | str, _Way]) -> PlanEntry:
    """The plan entry of one module from the ways that decided its rungs."""
    used = sorted(ways.values(), key=lambda w: int(w.rule.level))
    rungs = tuple(Rung(w.rule.level, w.region) for w in used if w.region is not None)
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


def _segments_inside(module: nn.Module, entry: PlanEntry) -> PlanEntry:
    """``entry`` (of ``module``) with every segments rung above a plain full one (other segments
    inside it between them) marked ``inside``: the stack stays that region, its segments nested
    in it (NOTE [ Segments inside their stack's region ] in wrapper.py). Segments that make one
    group of the whole stack would be that region again, so their rung is dropped and the one
    below goes on."""
    rungs: list[Rung] = []
    for rung in entry.rungs:
        below = next((r for r in reversed(rungs) if not r.inside), None)
        stack_segments = rung.segments is not None and rung.through is None  # not a group run
        if not stack_segments or below is None or below.region != Region():
            rungs.append(rung)
        elif segment_size(rung, len(module)) < len(module):
            rungs.append(replace(rung, inside=True))
    return replace(entry, rungs=tuple(rungs))


def _step_aside(entries: tuple[PlanEntry, ...]) -> tuple[PlanEntry, ...]:
    """Give every selective rung its ``until``: the lowest rung inside its module that keeps
    less (see NOTE [ Selective regions step aside ] in wrapper.py)."""
    out = []
    for e in entries:
        if any(r.selective for r in e.rungs):
            inner = [r for o in entries if is_ancestor(e.name, o.name) for r in o.rungs]
            e = replace(e, rungs=tuple(_until_less_is_kept(r, inner) for r in e.rungs))
        out.append(e)
    return tuple(out)


def _until_less_is_kept(rung: Rung, inner: list[Rung]) -> Rung:
    """``rung`` ending where one of the ``inner`` rungs keeps less than it: keeps nothing, or
    redoes more of the same operators."""
    if rung.keep is None:
        return rung
    outer = rung.keep
    less = [r.level for r in inner if r.keep is None or r.keep.keeps_less_than(outer)]
    return rung if not less else replace(rung, until=Level(min(less)))


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
    """Give every entry the training levels at which its span holds several fully checkpointed
    entries: two or more directly inside it (no eligible entry between them), or one that is a
    group itself (segments, or holding several) (NOTE [ Nesting ])."""
    holds: dict[str, set[int]] = {}
    for level in range(1, 6):
        rungs = {e.name: r for e in entries if (r := e.rung_at(level)) is not None}
        inside: dict[str, list[str]] = {}
        for name, rung in rungs.items():
            if rung.selective:
                continue
            parent = _nearest(name, rungs)
            if parent is not None:
                inside.setdefault(parent, []).append(name)
        # Deepest first, so that a region holding one region knows whether that one is a group.
        for parent in sorted(inside, key=lambda n: -n.count(".") - (n != "")):
            held = inside[parent]
            if len(held) >= 2 or rungs[held[0]].group or level in holds.get(held[0], ()):
                holds.setdefault(parent, set()).add(level)
    return tuple(
        replace(e, holds_several=frozenset(holds[e.name])) if e.name in holds else e
        for e in entries
    )


def _nests_full(
    model: nn.Module, entries: tuple[PlanEntry, ...], nesting: str
) -> tuple[PlanEntry, ...]:
    """Give every entry the training levels at which it is a full region with a fully
    checkpointed region inside it (inside its module, or inside a member of its run, or one of
    its own segments), as :func:`decide` decides at each level."""
    nests: dict[str, set[int]] = {}
    for level in range(1, 6):
        on = {
            e.name: rung
            for e in decide(entries, Level(level), nesting)
            if e.checkpointed and (rung := e.rung_at(level)) is not None and not rung.selective
        }
        for name, rung in on.items():
            spans = [name]
            if rung.through is not None:
                spans = run_members(model, name, rung.through, f"the run {name!r}")
            if rung.inside or any(
                other != name and any(other == s or is_ancestor(s, other) for s in spans)
                for other in on
            ):
                nests.setdefault(name, set()).add(level)
    return tuple(
        replace(e, nests_full=frozenset(nests[e.name])) if e.name in nests else e for e in entries
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
                lean = decided.get(member, {}).get("lean")
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
    lean = {n: ways for n, ways in decided.items() if "lean" in ways}
    for name, ways in lean.items():
        inner = [n for n in decided if is_ancestor(name, n) and "none" not in decided[n]]
        if inner:
            rule, origin = ways["lean"].rule, ways["lean"].origin
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
