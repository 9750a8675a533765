"""Which modules of a model a rule refers to: qualified-name globs and class names.

Names are the qualified names of ``model.named_modules()`` (``"blocks.3.attn"``; the root module
is ``""``). A name pattern is matched component by component, where components are the parts
between dots:

- ``*`` alone is exactly one component (``blocks.*`` matches ``blocks.0``, not ``blocks.0.attn``);
- ``**`` alone is any number of components, zero included (``**.attn`` matches ``attn`` and
  ``blocks.0.attn``; ``blocks.**`` matches ``blocks`` and everything under it);
- inside a component, ``*`` is any run of characters and ``?`` one character (``layer?``,
  ``stage_*``), never crossing a dot;
- a pattern that starts with ``re:`` is a Python regular expression that must match the whole
  name (``re:blocks\\.(0|1)\\.mlp``), the form timm's ``group_matcher`` uses.

A class pattern compares with ``type(module).__name__`` (``Block``), or with the qualified
``module.Class`` (``timm.models.vision_transformer.Block``) when it contains a dot; ``*`` and ``?``
work as in :mod:`fnmatch`. Subclasses do not match: a rule names the exact class.

Patterns are compiled once and cached. This module imports neither torch nor pydantic.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

__all__ = [
    "compile_name_pattern",
    "compile_type_pattern",
    "ModuleMatcher",
    "qualified_class_name",
    "later_siblings",
]

_COMPONENT_CHARS = re.compile(r"[A-Za-z0-9_\-*?]+")


@functools.lru_cache(maxsize=1024)
def compile_name_pattern(pattern: str) -> Callable[[str], bool]:
    """Compile a qualified-name glob (or ``re:`` regex) into ``f(qualified_name) -> bool``.

    Raises:
        ConfigError: the pattern is empty, has an empty component, mixes ``**`` with other text,
            or is an invalid regex.

    >>> compile_name_pattern("blocks.*")("blocks.3"), compile_name_pattern("blocks.*")("blocks")
    (True, False)
    >>> compile_name_pattern("**.attn")("stages.0.blocks.1.attn")
    True
    >>> compile_name_pattern("blocks..attn")
    Traceback (most recent call last):
    ...
    vision_ckpt.errors.ConfigError: name pattern 'blocks..attn' has an empty component ...
    """
    if pattern.startswith("re:"):
        body = pattern[3:]
        try:
            if not body:
                raise re.error("empty expression")
            regex = re.compile(body)
        except re.error as exc:
            raise ConfigError(
                f"name pattern {pattern!r} is not a valid regular expression ({exc}); "
                "after 're:' write a Python regex that matches the whole qualified name, "
                r"e.g. 're:blocks\.\d+'."
            ) from None
        return lambda name: regex.fullmatch(name) is not None
    if not pattern:
        raise ConfigError(
            "name pattern '' is empty; give a qualified name glob such as 'blocks.*' "
            "(use match_type to select modules by class, '**' for every module)."
        )
    parts: list[str] = []
    for comp in pattern.split("."):
        if comp == "":
            raise ConfigError(
                f"name pattern {pattern!r} has an empty component (two dots, or a leading or "
                "trailing dot); components are separated by single dots, e.g. 'blocks.*.attn'."
            )
        if comp == "**":
            parts.append(r"(?:\.[^.]+)*")
            continue
        if "**" in comp or not _COMPONENT_CHARS.fullmatch(comp):
            raise ConfigError(
                f"name pattern {pattern!r} has an invalid component {comp!r}; a component is "
                "a module name made of letters, digits, '_' or '-', where '*' is any run of "
                "characters and '?' one character, or exactly '*' / '**' alone. For anything "
                "else write a regex with the 're:' prefix."
            )
        text = "".join(
            "[^.]*" if ch == "*" else "[^.]" if ch == "?" else re.escape(ch) for ch in comp
        )
        if comp == "*":
            text = "[^.]+"
        parts.append(r"\." + text)
    # Every component regex starts with its own dot and the name is matched with a leading dot,
    # so '**' can stand for zero components without leaving a dangling separator behind.
    glob = re.compile("".join(parts))
    return lambda name: glob.fullmatch("." + name if name else "") is not None


@functools.lru_cache(maxsize=1024)
def compile_type_pattern(pattern: str) -> Callable[[str, str], bool]:
    """Compile a class-name pattern into ``f(class_name, qualified_class_name) -> bool``.

    Raises:
        ConfigError: the pattern is empty or contains whitespace.

    >>> f = compile_type_pattern("*Block")
    >>> f("Block", "timm.models.vision_transformer.Block"), f("Mlp", "timm.layers.mlp.Mlp")
    (True, False)
    """
    if not pattern or any(ch.isspace() for ch in pattern):
        raise ConfigError(
            f"class pattern {pattern!r} is not a class name; give a class name such as 'Block' "
            "or a qualified one such as 'timm.models.vision_transformer.Block'."
        )
    regex = re.compile(fnmatch.translate(pattern))
    if "." in pattern:
        return lambda _name, qualified: regex.match(qualified) is not None
    return lambda name, _qualified: regex.match(name) is not None


def exact_name_pattern(name: str) -> str:
    r"""A ``match`` pattern that selects exactly the module called ``name``.

    Plain dotted names are their own pattern; names with characters a glob component cannot
    hold (a ModuleDict key such as ``"stage 1"``) become an escaped ``re:`` pattern, and the
    model itself (qualified name ``""``) becomes ``"re:^$"``.

    >>> exact_name_pattern("blocks.3"), exact_name_pattern("stages.stage 1"), exact_name_pattern("")
    ('blocks.3', 're:stages\\.stage\\ 1', 're:^$')
    """
    if not name:
        return "re:^$"
    if all(re.fullmatch(r"[A-Za-z0-9_\-]+", part) for part in name.split(".")):
        return name
    return "re:" + re.escape(name)


def qualified_class_name(obj: Any) -> str:
    """``module.QualName`` of ``type(obj)``.

    >>> qualified_class_name(ConfigError("x"))
    'vision_ckpt.errors.ConfigError'
    """
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class ModuleMatcher:
    """A compiled rule selector: a name glob, a class pattern, or both (a module must match both).

    >>> m = ModuleMatcher(match="blocks.*", match_type="Block")
    >>> m.matches("blocks.0", "Block", "mymodel.Block"), m.matches("blocks.0.mlp", "Mlp", "x.Mlp")
    (True, False)
    """

    __slots__ = ("match", "match_type", "_name_fn", "_type_fn")

    def __init__(self, match: str | None = None, match_type: str | None = None) -> None:
        if match is None and match_type is None:
            raise ConfigError(
                "a rule selects no module: give 'match' (a qualified-name glob such as "
                "'blocks.*') or 'match_type' (a class name such as 'Block'), or both."
            )
        self.match = match
        self.match_type = match_type
        self._name_fn = compile_name_pattern(match) if match is not None else None
        self._type_fn = compile_type_pattern(match_type) if match_type is not None else None

    def matches(self, name: str, class_name: str, qualified_name: str) -> bool:
        """Whether the module called ``name`` (of class ``class_name``) is selected."""
        if self._name_fn is not None and not self._name_fn(name):
            return False
        return self._type_fn is None or self._type_fn(class_name, qualified_name)

    def __repr__(self) -> str:
        fields = []
        if self.match is not None:
            fields.append(f"match={self.match!r}")
        if self.match_type is not None:
            fields.append(f"match_type={self.match_type!r}")
        return f"ModuleMatcher({', '.join(fields)})"


def later_siblings(root: Any, name: str) -> list[str]:
    """The names of the children that the parent of module ``name`` (under ``root``, a
    ``torch.nn.Module``) registered after it, in order: where a rule's ``through`` may end.
    The model itself has none.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
    ...                           torch.nn.ReLU())
    >>> later_siblings(net, "1"), later_siblings(net, "")
    (['2'], [])
    """
    if not name:
        return []
    parent, _, own = name.rpartition(".")
    children = list(root.get_submodule(parent)._modules)
    return children[children.index(own) + 1 :]
