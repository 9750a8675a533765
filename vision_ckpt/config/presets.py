"""Presets: ready-made level rules for model families, and a fallback for any other model.

A preset is a checkpoint config file that holds only ``rules:`` (see :mod:`vision_ckpt.config`),
written for one family of models: ``configs/presets/<name>.yaml``. ``docs/presets.md`` says, per
family, what each level checkpoints. This module

- finds and loads them (:func:`list_presets`, :func:`load_preset`),
- picks the preset of a model (:func:`preset_for_model`),
- turns a preset into the rules for one model (:func:`preset_rules`), which is what
  ``plan()`` calls when a config has ``preset:`` (a timm feature wrapper gets its
  architecture's rules rewritten to its names: NOTE [ timm feature wrappers ] in ``_features``),
- gives a model that has no preset the levels of the structural fallback
  (:func:`fallback_rules`, from ``_fallback``: NOTE [ Fallback levels ]).

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
import importlib.metadata
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PresetMismatchWarning
from ._fallback import fallback_rules
from ._features import selecting, timm_architecture, timm_original, wrapper_rules
from .matching import compile_type_pattern
from .schema import CheckpointConfig, LevelRule, PresetFamily, PresetFile

__all__ = [
    "is_preset_file",
    "list_presets",
    "load_preset",
    "preset_family",
    "register_preset",
    "preset_for_model",
    "preset_rules",
    "fallback_rules",
    "presets_dir",
]


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
    here = Path(__file__).resolve().parent.parent  # the package's folder
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


def is_preset_file(name: str) -> bool:
    """Whether ``preset`` names a preset file (a path ending ``.yaml``, ``.yml`` or ``.json``,
    what ``configs/presets/`` holds and ``vision-ckpt derive --out`` writes) rather than a
    registered preset.

    >>> is_preset_file("resnet"), is_preset_file("my_presets/levit.yaml")
    (False, True)
    """
    return Path(name.strip()).suffix.lower() in (".yaml", ".yml", ".json")


def _load(name: str) -> tuple[CheckpointConfig, PresetFamily]:
    if is_preset_file(name):
        return _load_file(Path(name.strip()))
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
            "vision_ckpt.config.presets.register_preset."
        )
    if isinstance(source, Path):
        loaded = _read_preset_file(key, source)
    else:
        loaded = (source, _registered_families.get(key, PresetFamily()))
    _cache[key] = loaded
    return loaded


def _load_file(path: Path) -> tuple[CheckpointConfig, PresetFamily]:
    """A preset file by its path, read again whenever it changed on disk."""
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        raise ConfigError(
            f"preset file {str(path)!r} does not exist; give the path of a preset file (a "
            "'family:' header and 'rules:', as `vision-ckpt derive --out` writes), or a "
            "preset's name (vision_ckpt.list_presets())."
        ) from None
    key = f"{path.resolve()}@{stamp}"
    if key not in _cache:
        _cache[key] = _read_preset_file(str(path), path)
    return _cache[key]


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
    arch = timm_architecture(model)
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
    original = timm_original(model)
    return preset_for_model(original) if original is not None else None


# --------------------------------------------------------------------------------------------
# Preset -> rules for one model
# --------------------------------------------------------------------------------------------


def _named_modules(model: Any) -> list[tuple[str, Any]]:
    return list(model.named_modules())


def _selects_any(rule: LevelRule, modules: list[tuple[str, Any]]) -> bool:
    return any(True for _ in selecting(rule, modules))


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
        name = preset.strip() if is_preset_file(preset) else _normalise(preset)
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
    original = timm_original(model)
    if original is None:
        own = [(i, rule) for i, rule in enumerate(config.rules) if _selects_any(rule, modules)]
        out += [(rule, f"preset {name} #{i}") for i, rule in own]
    else:
        own = wrapper_rules(config.rules, modules, original)
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
