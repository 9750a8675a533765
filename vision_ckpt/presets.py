"""Presets: ready-made level rules for model families, and a fallback for any other model.

A preset is a checkpoint config file that holds only ``rules:`` (see :mod:`vision_ckpt.config`),
written for one family of models: ``configs/presets/<name>.yaml``. ``docs/presets.md`` says, per
family, what each level checkpoints. This module

- finds and loads them (:func:`list_presets`, :func:`load_preset`),
- picks the preset of a model (:func:`preset_for_model`),
- turns a preset into the rules for one model (:func:`preset_rules`), which is what
  ``plan()`` calls when a config has ``preset:``,
- derives levels from the structure of a model that has no preset (:func:`fallback_rules`).

# NOTE [ Resolving a model to its preset ]

Every preset is registered with *selectors*: a class (a qualified name such as
``timm.models.resnet.ResNet``, so that timm's and torchvision's classes of the same name stay
apart) and, optionally, an ``fnmatch`` pattern on timm's architecture name
(``model.pretrained_cfg["architecture"]``) for the cases where several families share one class
(the hybrid ViTs are ``VisionTransformer`` with a ResNet inside ``patch_embed``). For a model:

1. the selectors naming the model's exact class are tried; a selector with an architecture
   pattern applies only when the pattern matches the model's architecture name;
2. when none applies, the same is done for each base class along the MRO, nearest first
   (``VisionTransformerDistilled`` of DeiT resolves through ``VisionTransformer``);
3. the most specific applicable selector wins: one with an architecture pattern beats one
   without, and among patterns the one with more literal characters wins. Two presets whose
   best selectors are equally specific are a tie, which is an error, never a guess.

# NOTE [ timm feature wrappers ]

``timm.create_model(name, features_only=True)`` (what smp's ``tu-`` encoders hold) returns a
wrapper that no preset names (``FeatureListNet``, ``EfficientNetFeatures``, ...), marked by a
``feature_info`` that is a ``FeatureInfo`` rather than a list. Its architecture is still in its
``pretrained_cfg``, so the model it came from is built once per architecture on the meta device
(no memory, no weights) and the wrapper resolves to that model's preset. ``FeatureListNet``
lifts the children of a top-level ``Sequential`` ``a`` to its own level as ``a_b``; every
other name is the original one. A rule is evaluated on the wrapper's modules under their
original names (the wrapper itself standing for the original model), so it selects exactly
the modules it would select in the original, minus what the wrapper dropped (the head, the
lifted containers). It is kept as written when it selects the same modules under the wrapper's
own names, rewritten for lifted names (``stages.*.blocks.*`` -> ``stages_*.blocks.*``) when
that selects them, and otherwise replaced by the exact list of names; the origin says
``(timm features)``.

# NOTE [ Preset rules that select nothing ]

A family's preset is written for all its members, and members differ: ResNet-D has a ``conv1``
stem block that plain ResNet lacks, DenseNet-121 has four dense blocks and a shallow test model
one. :func:`preset_rules` therefore drops the rules of a preset that select no module of the
model at hand, instead of letting the strict config check reject them; a preset that selects
nothing at all in a model is still an error. The tests check that every rule of every preset
selects modules in at least one model of its family, so a rule with a typo cannot hide.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import importlib.metadata
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .config import CheckpointConfig, LevelRule, PresetFamily, PresetFile
from .errors import ConfigError, PresetMismatchWarning
from .levels import Level
from .matching import (
    ModuleMatcher,
    compile_type_pattern,
    exact_name_pattern,
    later_siblings,
    qualified_class_name,
)

__all__ = [
    "list_presets",
    "load_preset",
    "preset_family",
    "register_preset",
    "preset_for_model",
    "preset_rules",
    "fallback_rules",
    "presets_dir",
]

FALLBACK_ORIGIN = "fallback"
"""The origin label of every rule that :func:`fallback_rules` derives."""


# --------------------------------------------------------------------------------------------
# Where the shipped presets are, and which models each one is for
# --------------------------------------------------------------------------------------------


def presets_dir() -> Path:
    """The folder of the shipped preset files.

    In a wheel the files live in ``vision_ckpt/configs/presets``; in a source checkout in
    ``configs/presets`` next to the package.

    >>> presets_dir().name
    'presets'
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs" / "presets", here.parent / "configs" / "presets"):
        if candidate.is_dir():
            return candidate
    raise ConfigError(
        f"the preset folder is missing: looked for {here / 'configs' / 'presets'} and "
        f"{here.parent / 'configs' / 'presets'}; reinstall vision_ckpt (the wheel ships it as "
        "vision_ckpt/configs/presets)."
    )


@dataclasses.dataclass(frozen=True)
class _Selector:
    """One way a model is recognised as a member of a preset's family."""

    preset: str
    cls: str
    """Class name: qualified (``timm.models.resnet.ResNet``) when it contains a dot."""
    architecture: str | None = None
    """``fnmatch`` pattern on timm's architecture name, for classes that families share."""

    def specificity(self) -> tuple[int, int]:
        if self.architecture is None:
            return (0, 0)
        return (1, sum(ch not in "*?[]" for ch in self.architecture))


# Selectors of presets added with register_preset (the shipped presets name their classes in
# their own files' family: header, read on first use).
_selectors: list[_Selector] = []
_registered: dict[str, CheckpointConfig | Path] = {}
_registered_families: dict[str, PresetFamily] = {}
_cache: dict[str, tuple[CheckpointConfig, PresetFamily]] = {}
_shipped: list[_Selector] | None = None


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def _shipped_files() -> dict[str, Path]:
    return {p.stem: p for p in presets_dir().glob("*.yaml")}


def _all_sources() -> dict[str, CheckpointConfig | Path]:
    sources: dict[str, CheckpointConfig | Path] = dict(_shipped_files())
    sources.update(_registered)
    return sources


def _natural_key(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text.lower())]


def register_preset(
    name: str,
    config: CheckpointConfig | PresetFile | str | Path,
    *,
    classes: Iterable[str] = (),
    architectures: Iterable[tuple[str, str]] = (),
) -> None:
    """Add a preset (or replace one of the same name) for this process.

    Args:
        name: the preset's name, as used in ``preset:`` and :func:`load_preset`.
        config: a :class:`CheckpointConfig` holding the rules, a
            :class:`~vision_ckpt.config.PresetFile` (rules and a ``family:`` header: its classes
            and parts), or the path of a preset file (YAML/JSON, with or without the header).
        classes: classes :func:`preset_for_model` resolves to this preset: class names, qualified
            (``mypkg.models.Net``) when they contain a dot.
        architectures: ``(class, pattern)`` pairs: models of ``class`` whose timm architecture
            name matches the ``fnmatch`` pattern resolve to this preset (more specific than a
            plain class; see NOTE [ Resolving a model to its preset ]).

    Raises:
        ConfigError: the name is empty, or the config sets ``preset`` itself.

    >>> register_preset("my_net", CheckpointConfig(rules=[{"match": "body.*", "level": 3}]),
    ...                 classes=["my_pkg.MyNet"])
    >>> load_preset("my_net").rules[0].match
    'body.*'
    """
    key = _normalise(name)
    if not key:
        raise ConfigError(f"preset name {name!r} is empty; give a name such as 'my_net'.")
    family = PresetFamily()
    _registered_families.pop(key, None)
    if isinstance(config, PresetFile):
        family = config.family
        config = CheckpointConfig(rules=config.rules)
        _check_preset_config(key, config, source=None, parts=bool(family.parts))
        _registered_families[key] = family
    elif isinstance(config, CheckpointConfig):
        _check_preset_config(key, config, source=None)
    else:
        config = Path(config)
        _, family = _read_preset_file(key, config)
    classes = [*family.classes, *classes]
    architectures = [*family.architectures, *architectures]
    for cls in classes:
        compile_type_pattern(cls)
        _selectors.append(_Selector(key, cls))
    for cls, pattern in architectures:
        compile_type_pattern(cls)
        _selectors.append(_Selector(key, cls, pattern))
    _registered[key] = config
    _cache.pop(key, None)


def _read_preset_file(name: str, path: Path) -> tuple[CheckpointConfig, PresetFamily]:
    preset = PresetFile.from_file(path)
    config = CheckpointConfig(rules=preset.rules)
    _check_preset_config(name, config, source=str(path), parts=bool(preset.family.parts))
    return config, preset.family


def _shipped_selectors() -> list[_Selector]:
    global _shipped
    if _shipped is None:
        found = []
        for name in sorted(_shipped_files(), key=_natural_key):
            family = _load(name)[1]
            found += [_Selector(name, cls) for cls in family.classes]
            found += [_Selector(name, cls, arch) for cls, arch in family.architectures]
        _shipped = found
    return _shipped


def list_presets(filter: str | None = None) -> list[str]:
    """Names of the available presets, in natural order, optionally filtered.

    Args:
        filter: an ``fnmatch`` pattern on the name (``"tv_*"``, ``"*vit*"``); ``None`` lists all.

    >>> "resnet" in list_presets()
    True
    >>> list_presets("tv_*")
    ['tv_densenet', 'tv_resnet', 'tv_swin', 'tv_vit']
    """
    names = sorted(_all_sources(), key=_natural_key)
    if filter is not None:
        names = [n for n in names if fnmatch.fnmatchcase(n, _normalise(filter))]
    return names


def load_preset(name: str) -> CheckpointConfig:
    """The validated config of the preset called ``name``.

    Raises:
        ConfigError: no such preset (the message lists the available ones and the closest
            names), or its file does not validate.

    >>> cfg = load_preset("swin")
    >>> cfg.preset is None and len(cfg.rules) > 0
    True
    >>> load_preset("swim")
    Traceback (most recent call last):
    ...
    vision_ckpt.errors.ConfigError: unknown preset 'swim'; did you mean 'swin'? ...
    """
    return _load(name)[0]


def preset_family(name: str) -> PresetFamily:
    """The ``family:`` header of the preset called ``name``: its classes, the library versions
    it was written for, its parts (see :class:`vision_ckpt.config.PresetFamily`).

    >>> preset_family("resnet").classes
    ('timm.models.resnet.ResNet',)
    """
    return _load(name)[1]


def _load(name: str) -> tuple[CheckpointConfig, PresetFamily]:
    key = _normalise(name)
    if key in _cache:
        return _cache[key]
    sources = _all_sources()
    source = sources.get(key)
    if source is None:
        names = sorted(sources, key=_natural_key)
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise ConfigError(
            f"unknown preset {name!r}; {hint}available presets: {', '.join(names)}. "
            "Use 'auto' to pick the preset from the model's class, or register your own with "
            "vision_ckpt.register_preset."
        )
    if isinstance(source, Path):
        loaded = _read_preset_file(key, source)
    else:
        loaded = (source, _registered_families.get(key, PresetFamily()))
    _cache[key] = loaded
    return loaded


def _check_preset_config(
    name: str, config: CheckpointConfig, source: str | None, parts: bool = False
) -> None:
    where = f" ({source})" if source else ""
    if config.preset is not None:
        raise ConfigError(
            f"preset {name!r}{where} sets 'preset: {config.preset}'; a preset holds rules only "
            "and cannot start from another preset. Copy the rules you need instead."
        )
    if not config.rules and not parts:
        raise ConfigError(
            f"preset {name!r}{where} has no rules and no parts; give it at least one rule, or "
            "name the parts (family: parts:) whose presets give its levels."
        )


# --------------------------------------------------------------------------------------------
# Model -> preset
# --------------------------------------------------------------------------------------------


def _architecture(model: Any) -> str | None:
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attr, None)
        if isinstance(cfg, dict) and cfg.get("architecture"):
            return str(cfg["architecture"])
    return None


def preset_for_model(model: Any) -> str | None:
    """The name of the preset for ``model``, or ``None`` when no preset knows its class.

    See NOTE [ Resolving a model to its preset ] for the order: exact class first, then the
    architecture name where a class is shared, then base classes; the most specific wins.

    Raises:
        ConfigError: two presets match equally well (the message names both).

    >>> import timm
    >>> preset_for_model(timm.create_model("resnet18", pretrained=False))
    'resnet'
    >>> import torch
    >>> preset_for_model(torch.nn.Linear(2, 2)) is None
    True
    """
    arch = _architecture(model)
    for cls in type(model).__mro__:
        if cls is object:
            break
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        applicable = [
            s
            for s in (*_shipped_selectors(), *_selectors)
            if compile_type_pattern(s.cls)(cls.__name__, qualified)
            and (
                s.architecture is None
                or (arch is not None and fnmatch.fnmatchcase(arch, s.architecture))
            )
        ]
        if not applicable:
            continue
        best = max(s.specificity() for s in applicable)
        winners = sorted({s.preset for s in applicable if s.specificity() == best})
        if len(winners) > 1:
            raise ConfigError(
                f"model {type(model).__name__} (architecture {arch!r}) matches presets "
                f"{', '.join(repr(w) for w in winners)} equally well; name the preset in the "
                "config (preset: <name>) instead of 'auto', or register a more specific "
                "architecture pattern."
            )
        return winners[0]
    original = _timm_original(model)
    return preset_for_model(original) if original is not None else None


def _timm_original(model: Any) -> nn.Module | None:
    """For a timm feature wrapper, the model it was built from (on the meta device); else
    ``None``. See NOTE [ timm feature wrappers ]."""
    if type(getattr(model, "feature_info", None)).__name__ != "FeatureInfo":
        return None
    arch = _architecture(model)
    return _meta_model(arch) if arch is not None else None


@functools.lru_cache(maxsize=32)
def _meta_model(architecture: str) -> nn.Module | None:
    import timm

    try:
        with torch.device("meta"):
            return timm.create_model(architecture, pretrained=False)
    except Exception:  # an architecture timm cannot build bare: the wrapper takes the fallback
        return None


# --------------------------------------------------------------------------------------------
# Preset -> rules for one model
# --------------------------------------------------------------------------------------------


def _named_modules(model: Any) -> list[tuple[str, Any]]:
    return list(model.named_modules())


def _selecting(rule: LevelRule, modules: list[tuple[str, Any]]) -> Iterator[str]:
    """The names of the modules ``rule`` selects, lazily."""
    matcher = ModuleMatcher(rule.match, rule.match_type)
    root = modules[0][1]  # named_modules() starts with ("", the model)
    for name, module in modules:
        if matcher.matches(name, type(module).__name__, qualified_class_name(module)) and (
            # A run that this model lacks: see NOTE [ A preset's runs ] in apply.py.
            rule.through is None or rule.through in later_siblings(root, name)
        ):
            yield name


def _selects_any(rule: LevelRule, modules: list[tuple[str, Any]]) -> bool:
    return any(True for _ in _selecting(rule, modules))


def preset_rules(model: Any, preset: str) -> list[tuple[LevelRule, str]]:
    """The rules a preset gives ``model``, each with the label of where it came from.

    Args:
        model: the model the rules are for.
        preset: a preset name, or ``"auto"``: the preset of the model's class
            (:func:`preset_for_model`), or, when there is none, :func:`fallback_rules`.

    Returns:
        ``(rule, origin)`` pairs in order (later rules win). ``origin`` is
        ``"preset <name> #<i>"``, ``i`` being the rule's index in the preset's ``rules`` (from 0,
        as in ``rules[i]``), or ``"fallback"``. Rules of the preset that select no module of
        this model are left out (see NOTE [ Preset rules that select nothing ]).

    Raises:
        ConfigError: unknown preset; or the preset selects no module of this model.

    >>> import timm
    >>> m = timm.create_model("resnet18", pretrained=False)
    >>> rule, origin = preset_rules(m, "auto")[0]
    >>> origin
    'preset resnet #0'
    """
    if _normalise(preset) == "auto":
        name = preset_for_model(model)
        if name is None:
            return fallback_rules(model)
    else:
        name = _normalise(preset)
    config, family = _load(name)
    out: list[tuple[LevelRule, str]] = []
    for part, part_preset in family.parts.items():
        try:
            submodule = model.get_submodule(part)
        except AttributeError:
            continue  # this member of the family has no such part
        if part_preset != "auto":
            part_modules = _named_modules(submodule)
            if not any(_selects_any(r, part_modules) for r in _load(part_preset)[0].rules):
                continue  # this member's part is of another family (a MobileNet backbone)
        out += [
            (_under(part, rule), f"preset {name} {part}: {origin}")
            for rule, origin in preset_rules(submodule, part_preset)
        ]
    modules = _named_modules(model)
    original = _timm_original(model)
    if original is None:
        own = [(i, rule) for i, rule in enumerate(config.rules) if _selects_any(rule, modules)]
        out += [(rule, f"preset {name} #{i}") for i, rule in own]
    else:
        own = _wrapper_rules(config.rules, modules, original)
        out += [(rule, f"preset {name} #{i} (timm features)") for i, rule in own]
    if not out:
        children = ", ".join(n for n, _ in model.named_children()) or "(none)"
        suggestion = preset_for_model(model)
        hint = (
            f"the preset for this model is {suggestion!r}"
            if suggestion
            else "no preset knows this model; use 'auto' for the structural fallback"
        )
        raise ConfigError(
            f"preset {name!r} selects no module of {type(model).__name__} (top-level children: "
            f"{children}){_written_for(family)}; {hint}."
        )
    _warn_lost_levels(name, config, {i for i, _ in own}, family, type(model).__name__)
    return out


def _wrapper_rules(
    rules: Iterable[LevelRule], modules: list[tuple[str, Any]], original: nn.Module
) -> list[tuple[int, LevelRule]]:
    """The rules of the original model's preset, made to select in a timm feature wrapper what
    they select in the original (NOTE [ timm feature wrappers ]), with their indices."""
    wrapper = modules[0][1]
    lifted = {
        f"{name}_{child}": f"{name}.{child}"
        for name, container in original.named_children()
        if isinstance(container, nn.Sequential)
        for child, _ in container.named_children()
        if f"{name}_{child}" in wrapper._modules and f"{name}_{child}" not in original._modules
    }

    def original_name(name: str) -> str:
        head, dot, rest = name.partition(".")
        return lifted[head] + dot + rest if head in lifted else name

    out = []
    for i, rule in enumerate(rules):
        matcher = ModuleMatcher(rule.match, rule.match_type)
        wanted = [
            name
            for name, module in modules
            if matcher.matches(
                original_name(name),
                type(original if not name else module).__name__,
                qualified_class_name(original if not name else module),
            )
            # a run the original model lacks (NOTE [ A preset's runs ] in apply.py)
            and (
                rule.through is None
                or rule.through in later_siblings(original, original_name(name))
            )
        ]
        if not wanted:
            continue
        if rule.through is not None and len(wanted) == 1:
            rule = _run_in_wrapper(rule, wanted[0], original_name(wanted[0]), original, wrapper)
        for candidate in (rule, _lifted_rule(rule, {n.partition(".")[0] for n in lifted.values()})):
            if candidate is not None and list(_selecting(candidate, modules)) == wanted:
                out.append((i, candidate))
                break
        else:
            exact = [exact_name_pattern(n) for n in wanted]
            match = exact[0] if len(exact) == 1 else "re:" + "|".join(map(re.escape, wanted))
            out.append((i, rule.model_copy(update={"match": match, "match_type": None})))
    return out


def _run_in_wrapper(
    rule: LevelRule, name: str, original_name: str, original: nn.Module, wrapper: nn.Module
) -> LevelRule:
    """``rule``, a run from ``original_name`` through ``rule.through`` in the original model,
    ending at its last member the wrapper kept, under the wrapper's names (a lifted run's last
    member was lifted with it: ``features_pool0``); a run cut to its first module is that
    module alone. A wrapper truncated by ``out_indices`` may drop the end of a stem."""
    parent, _, own = original_name.rpartition(".")
    siblings = list(original.get_submodule(parent)._modules)
    start = siblings.index(own)
    if rule.through not in siblings[start + 1 :]:
        return rule  # not a run of this model: plan() says so
    run = siblings[start : siblings.index(rule.through) + 1]
    wrapper_parent, _, wrapper_own = name.rpartition(".")
    prefix = wrapper_own[: len(wrapper_own) - len(own)]  # "features_" when lifted
    present = set(wrapper.get_submodule(wrapper_parent)._modules)
    kept = []
    for member in run:
        if prefix + member not in present:
            break
        kept.append(prefix + member)
    return rule.model_copy(update={"through": kept[-1] if len(kept) > 1 else None})


def _lifted_rule(rule: LevelRule, containers: set[str]) -> LevelRule | None:
    """``rule`` with its first two name components joined when the first is a lifted
    container (``stages.*.blocks.*`` -> ``stages_*.blocks.*``), else ``None``."""
    if rule.match is None or rule.match.startswith("re:"):
        return None
    head, _, rest = rule.match.partition(".")
    if head not in containers or not rest or rest.startswith("**"):
        return None
    second, dot, tail = rest.partition(".")
    return rule.model_copy(update={"match": f"{head}_{second}{dot}{tail}"})


def _under(part: str, rule: LevelRule) -> LevelRule:
    """``rule`` of a part's preset, made to select the same modules under ``part``."""
    prefix = re.escape(part)
    if rule.match is None:  # a class rule: the part itself or anything below it
        match = rf"re:{prefix}(?:\..+)?"
    elif rule.match.startswith("re:"):
        body = rule.match[3:]
        if re.fullmatch(body, ""):  # the rule also selects the part's root itself
            match = rf"re:{prefix}(?:\.(?:{body}))?"
        else:
            match = rf"re:{prefix}\.(?:{body})"
    elif all(re.fullmatch(r"[A-Za-z0-9_\-]+", p) for p in part.split(".")):
        match = f"{part}.{rule.match}"
    else:  # a part name a glob component cannot hold: translate the glob instead
        match = rf"re:{prefix}\.(?:{_glob_regex(rule.match)})"
    return rule.model_copy(update={"match": match})


def _glob_regex(pattern: str) -> str:
    parts = []
    for component in pattern.split("."):
        if component == "**":
            parts.append(r"(?:[^.]+(?:\.[^.]+)*)")
        else:
            parts.append(fnmatch.translate(component).removeprefix("(?s:").removesuffix(r")\Z"))
    return r"\.".join(parts)


def _written_for(family: PresetFamily) -> str:
    """`` (written for transformers 5.23; installed: 4.40)``, or nothing without a header."""
    if not family.written_for:
        return ""
    wanted = ", ".join(f"{lib} {version}" for lib, version in family.written_for.items())
    installed = ", ".join(f"{lib} {_installed_version(lib)}" for lib in family.written_for)
    return f" (the preset was written for {wanted}; installed: {installed})"


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _same_release(wanted: str, installed: str) -> bool:
    """Whether ``installed`` is the release ``wanted`` names: ``5.23`` covers ``5.23.1``."""
    given = wanted.split(".")
    return installed.split("+")[0].split(".")[: len(given)] == given


def _warn_lost_levels(
    name: str, config: CheckpointConfig, used: set[int], family: PresetFamily, model: str
) -> None:
    """Warn when every rule of one of the preset's levels selects nothing in this model while a
    library the preset was written for is installed at another version: its module names have
    probably changed. (At the version it was written for, a level can be empty by design: a
    RegNetX has no SE modules; the tests check every rule against the family's models.)"""
    if all(
        _same_release(version, _installed_version(lib))
        for lib, version in family.written_for.items()
    ):
        return
    by_level: dict[int, list[int]] = {}
    for i, rule in enumerate(config.rules):
        by_level.setdefault(int(rule.level), []).append(i)
    lost = {lv: rules for lv, rules in by_level.items() if not used.intersection(rules)}
    if not lost:
        return
    described = "; ".join(
        f"level {lv}: " + ", ".join(f"rules[{i}] ({config.rules[i]})" for i in rules)
        for lv, rules in sorted(lost.items())
    )
    warnings.warn(
        f"preset {name!r} leaves levels {sorted(lost)} empty on {model}: no module matches "
        f"{described}{_written_for(family)}. Those levels checkpoint nothing beyond the levels "
        "below them; if the library renamed its modules, write rules for the new names in your "
        "config (rules: ...) or register a fixed preset.",
        PresetMismatchWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------------------------
# Fallback: levels from structure
# --------------------------------------------------------------------------------------------

# NOTE [ Fallback levels ]
#
# Blocks and stages come from timm's group_matcher where the model has one, else from the
# structure: composite modules held in Sequential/ModuleList containers whose class occurs at
# least twice in the model (repeated blocks; counted over the whole model so that a stage of
# depth 1 still counts). The innermost such modules are blocks (3); a module holding blocks
# that is itself one of a repeated set, or the callable parent of a block container, is a stage
# (4); the nearest callable common ancestor of all blocks, below the root, is the trunk (5);
# when there is none (blocks iterated from a ModuleList by the model's own forward, stages that
# are direct children of the model), the model itself is level 5.
# Inside blocks, composite children with two or more weight layers are sub-blocks (2: attention,
# MLP, conv branches). Anywhere in the model, a composite module made only of leaf layers with
# at most one weight layer and at least one norm or activation is a unit (1: conv+norm+act,
# norm+act): a lone Linear or Conv is never one, since its input is kept anyway. A unit whose
# first layer is an in-place activation is skipped (it would overwrite the input the
# checkpoint needs to recompute from).

_NORM_OR_ACT = re.compile(
    r"(Norm|ReLU|GELU|SiLU|Swish|Mish|Hardswish|Hardsigmoid|Sigmoid|Tanh|ELU|Softplus|Act)"
)
_WEIGHT_LAYER = re.compile(r"(Conv|Linear)")
_INERT = ("Identity", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "DropPath")


def _is_container(module: Any) -> bool:
    return isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))


def _callable(module: Any) -> bool:
    """Whether the module has a forward of its own (ModuleList/ModuleDict do not)."""
    return type(module).forward is not nn.Module.forward


def _is_composite(module: Any) -> bool:
    return any(True for _ in module.children())


def _has_params(module: Any) -> bool:
    return any(True for _ in module.parameters())


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _weight_layers(module: Any) -> int:
    return sum(
        1
        for m in module.modules()
        if _WEIGHT_LAYER.search(type(m).__name__) and any(True for _ in m.parameters(recurse=False))
    )


def _is_unit(module: Any) -> bool:
    """A layer with its norm/activation: one weight layer at most, two meaningful parts at least.

    ``Sequential(conv, bn, act)``, timm's ``ConvNormAct`` and ``BatchNormAct2d`` (a norm with an
    activation child), a patch-merging ``norm`` + ``reduction``. Not a lone layer, not an MLP
    (two weight layers), and not a unit whose first operation is an in-place activation.
    """
    if not _is_composite(module) or not _callable(module) or not _has_params(module):
        return False
    if _weight_layers(module) > 1:
        return False
    parts = [
        m
        for m in module.modules()
        if type(m).__name__ not in _INERT
        and (
            any(True for _ in m.parameters(recurse=False))
            or (not _is_composite(m) and _NORM_OR_ACT.search(type(m).__name__))
        )
    ]
    if len(parts) < 2 or not any(_NORM_OR_ACT.search(type(m).__name__) for m in parts):
        return False
    if any(True for _ in module.parameters(recurse=False)):
        return True  # the module's own op (a norm) runs first
    first = next((m for m in module.modules() if not _is_composite(m)), None)
    return not getattr(first, "inplace", False)


def _is_sub_block(module: Any) -> bool:
    """An attention/MLP/conv branch of a block: callable, two weight layers or more."""
    return _callable(module) and _is_composite(module) and _weight_layers(module) >= 2


def _matcher_roots(
    modules: list[tuple[str, Any]], specs: list[tuple[re.Pattern[str], bool]]
) -> list[str]:
    """Outermost modules with parameters whose name an (unmerged) group regex matches."""
    keys: dict[str, tuple[int, tuple[str | None, ...]] | None] = {}
    roots: list[str] = []
    for name, module in modules:
        key = None
        for index, (regex, merged) in enumerate(specs):
            m = regex.match(name)
            if m is not None:
                key = None if merged else (index, m.groups())
                break
        keys[name] = key
        if key is None or not name or not _has_params(module) or not _callable(module):
            continue
        if keys.get(_parent(name)) != key or not _parent(name):
            if not any(name.startswith(r + ".") for r in roots):
                roots.append(name)
    return roots


def _group_specs(matcher: Any) -> list[tuple[re.Pattern[str], bool]] | None:
    """The block regexes of a timm group_matcher dict; ``None`` when it cannot be read."""
    if not isinstance(matcher, dict):
        return None
    specs: list[tuple[re.Pattern[str], bool]] = []
    for key, spec in matcher.items():
        if key == "stem" or spec is None:
            continue
        entries = spec if isinstance(spec, (list, tuple)) else [(spec, None)]
        for entry in entries:
            if not isinstance(entry, (list, tuple)) or not entry or not isinstance(entry[0], str):
                return None
            # timm's MATCH_PREV_GROUP suffix (99999,) merges a match into the group before it
            # (the final norm after the last block): not a group of its own.
            suffix = entry[1] if len(entry) > 1 else None
            merged = isinstance(suffix, (tuple, list)) and tuple(suffix) == (99999,)
            try:
                specs.append((re.compile(entry[0]), merged))
            except re.error:
                return None
    return specs or None


def _timm_groups(model: Any, modules: list[tuple[str, Any]]) -> tuple[list[str], list[str]] | None:
    """Blocks (fine groups) and stages (coarse groups) from timm's ``group_matcher``."""
    group_matcher = getattr(model, "group_matcher", None)
    if not callable(group_matcher):
        return None
    try:
        fine = _group_specs(group_matcher(coarse=False))
        coarse = _group_specs(group_matcher(coarse=True))
    except Exception:  # a third-party group_matcher may fail in any way; use the structure
        return None
    if fine is None:
        return None
    blocks = _matcher_roots(modules, fine)
    stages = [s for s in _matcher_roots(modules, coarse or []) if s not in blocks]
    # A coarse group is a stage only if it holds blocks.
    stages = [s for s in stages if any(b.startswith(s + ".") for b in blocks)]
    if not blocks:
        return None
    return blocks, stages


def _structural_groups(modules: list[tuple[str, Any]]) -> tuple[list[str], list[str]]:
    """Blocks and stages from repeated composite children of Sequential/ModuleList containers."""
    by_name = dict(modules)
    counts: dict[type, int] = {}
    for _, module in modules:
        counts[type(module)] = counts.get(type(module), 0) + 1
    candidates = [
        name
        for name, module in modules
        if name
        and _is_container(by_name[_parent(name)])
        and _callable(module)
        and _is_composite(module)
        and _has_params(module)
        and counts[type(module)] >= 2
        and not _is_unit(module)
    ]
    # The innermost repeated modules are the blocks; repeated modules holding blocks (a
    # Sequential of stages) and the callable holders of block containers are stages.
    blocks = [c for c in candidates if not any(o.startswith(c + ".") for o in candidates)]
    stages = [c for c in candidates if c not in blocks]
    for block in blocks:
        container = _parent(block)
        holder = container if _callable(by_name[container]) else _parent(container)
        if holder and holder not in stages:
            stages.append(holder)
    return blocks, stages


def _trunk(blocks: list[str], by_name: dict[str, Any]) -> str | None:
    """The nearest callable common ancestor of all blocks, below the root."""
    if not blocks:
        return None
    common = blocks[0].split(".")
    for b in blocks[1:]:
        parts = b.split(".")
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    name = ".".join(common)
    if name in blocks:
        name = _parent(name)
    while name and not _callable(by_name[name]):
        name = _parent(name)
    return name or None


def fallback_rules(model: Any) -> list[tuple[LevelRule, str]]:
    """Levels for a model without a preset, derived from its structure.

    Stages and blocks come from timm's ``group_matcher`` where the model has one, else from
    repeated sibling blocks in ``Sequential``/``ModuleList`` containers; see NOTE [ Fallback
    levels ] in the source. Every rule names one module exactly (a ``re:`` rule where the name
    has characters a glob cannot hold), and every rule's origin is ``"fallback"``.

    Returns:
        ``(rule, "fallback")`` pairs, one per module given a level, in ``named_modules()`` order.

    Raises:
        ConfigError: nothing in the model has a structure the fallback recognises (no repeated
            blocks, no layer with a norm or activation); write rules for it.

    >>> import torch.nn as nn
    >>> block = lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(block(), block()))
    >>> [(r.match, int(r.level)) for r, _ in fallback_rules(net)]
    [('1', 5), ('1.0', 3), ('1.1', 3)]
    """
    modules = _named_modules(model)
    by_name = dict(modules)
    groups = _timm_groups(model, modules)
    blocks, stages = groups if groups is not None else _structural_groups(modules)
    levels: dict[str, int] = {}
    units: list[str] = []
    for name, module in modules:
        if name and not any(name.startswith(u + ".") for u in units) and _is_unit(module):
            units.append(name)
            levels[name] = int(Level.SINGLE_LAYER)
    for block in blocks:
        for name, module in modules:
            if _parent(name) == block and _is_sub_block(module):
                levels[name] = int(Level.SMALL_BLOCK)
    trunk = _trunk(blocks, by_name)
    for block in blocks:
        if block not in units:  # timm groups a patch-merging layer as a block of its own
            levels[block] = int(Level.MEDIUM_MODULE)
    for stage in stages:
        if stage != trunk and _callable(by_name[stage]):
            levels[stage] = int(Level.LARGE_MODULE)
    if trunk is not None and trunk not in blocks:
        levels[trunk] = int(Level.VERY_LARGE_MODULE)
    elif blocks:
        levels[""] = int(Level.VERY_LARGE_MODULE)  # no trunk module: the whole model
    if not levels:
        children = ", ".join(n for n, _ in model.named_children()) or "(none)"
        raise ConfigError(
            f"the fallback found nothing to checkpoint in {type(model).__name__} (top-level "
            f"children: {children}): no repeated blocks in Sequential/ModuleList containers, "
            "no timm group_matcher and no layer with a norm or activation. Write rules for it "
            "(rules: - match: '<module name>' level: 3)."
        )
    return [
        (LevelRule(match=exact_name_pattern(name), level=levels[name]), FALLBACK_ORIGIN)
        for name, _ in modules
        if name in levels
    ]
