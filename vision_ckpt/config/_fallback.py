"""The structural fallback: levels for a model that no preset knows, from its structure.

:func:`fallback_rules` finds the model's blocks and stages (timm's ``group_matcher`` where the
model has one, else repeated modules in ``Sequential``/``ModuleList`` containers) and gives
them the levels of the size table: units 1, sub-blocks 2, blocks 3, stages 4, the trunk 5
(NOTE [ Fallback levels ]). ``presets.preset_rules(model, "auto")`` returns these rules when
no preset knows the model.
"""

from __future__ import annotations

import re
from typing import Any

import torch.nn as nn

from ..errors import ConfigError
from .levels import Level
from .matching import exact_name_pattern
from .schema import LevelRule

__all__ = ["FALLBACK_ORIGIN", "fallback_rules"]

FALLBACK_ORIGIN = "fallback"
"""The origin label of every rule that :func:`fallback_rules` derives."""

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
    modules = list(model.named_modules())
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
