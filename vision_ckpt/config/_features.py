"""timm feature wrappers: a preset's rules, rewritten for what ``features_only=True`` returns.

:func:`timm_original` tells a feature wrapper from other models and builds the model it came
from; :func:`wrapper_rules` rewrites that model's preset rules to the wrapper's module names.
``presets.preset_rules`` uses both; :func:`selecting` is the one rule-selection both modules
share.

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

>>> import timm
>>> features = timm.create_model("resnet18", pretrained=False, features_only=True)
>>> type(timm_original(features)).__name__, timm_architecture(features)
('ResNet', 'resnet18')
>>> timm_original(timm.create_model("resnet18", pretrained=False)) is None
True
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from .matching import ModuleMatcher, exact_name_pattern, later_siblings, qualified_class_name
from .schema import LevelRule

__all__ = ["selecting", "timm_architecture", "timm_original", "wrapper_rules"]


def timm_architecture(model: Any) -> str | None:
    """timm's architecture name of ``model`` (``pretrained_cfg["architecture"]``), or ``None``."""
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attr, None)
        if isinstance(cfg, dict) and cfg.get("architecture"):
            return str(cfg["architecture"])
    return None


def timm_original(model: Any) -> nn.Module | None:
    """For a timm feature wrapper, the model it was built from (on the meta device); else
    ``None``. See NOTE [ timm feature wrappers ]."""
    if type(getattr(model, "feature_info", None)).__name__ != "FeatureInfo":
        return None
    arch = timm_architecture(model)
    return _meta_model(arch) if arch is not None else None


@functools.lru_cache(maxsize=32)
def _meta_model(architecture: str) -> nn.Module | None:
    import timm

    try:
        with torch.device("meta"):
            return timm.create_model(architecture, pretrained=False)
    except Exception:  # an architecture timm cannot build bare: the wrapper takes the fallback
        return None


def selecting(rule: LevelRule, modules: list[tuple[str, Any]]) -> Iterator[str]:
    """The names of the modules ``rule`` selects among ``modules`` (``named_modules()`` of a
    model, the model first), lazily; a run the model lacks selects nothing."""
    matcher = ModuleMatcher(rule.match, rule.match_type)
    root = modules[0][1]  # named_modules() starts with ("", the model)
    for name, module in modules:
        if matcher.matches(name, type(module).__name__, qualified_class_name(module)) and (
            # A run that this model lacks: see NOTE [ A preset's runs ] in _planning.py.
            rule.through is None or rule.through in later_siblings(root, name)
        ):
            yield name


def wrapper_rules(
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
            # a run the original model lacks (NOTE [ A preset's runs ] in _planning.py)
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
            if candidate is not None and list(selecting(candidate, modules)) == wanted:
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
