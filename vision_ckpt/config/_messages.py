"""What a failed validation of a config model says: one line per offending key, named by its
path in the file (``rules[1].level``), with what was given and what is allowed, a close key
for a misspelt one, and what replaced a key of an earlier version. The schema's models raise
these; nothing here knows their fields.
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import ConfigError

__all__ = ["Renamed", "config_error"]

Renamed = dict[str, tuple[type[BaseModel], str]]
"""Keys of earlier versions, by the model they belonged to, and what replaced them."""


def config_error(
    root: type[BaseModel],
    exc: ValidationError,
    *,
    name: str,
    source: str | None,
    renamed: Renamed,
) -> ConfigError:
    """The error for ``exc``, raised validating ``root`` (called ``name``) from ``source``
    (a file, or ``None``)."""
    lines: list[str] = []
    for err in exc.errors():
        line = _describe(root, err, renamed)
        if line not in lines:
            lines.append(line)
    # A value that fails a union is reported once per branch; when one branch's message
    # already explains the problem in our words, the generic ones add nothing.
    specific = [ln for ln in lines if "allowed:" in ln or "unknown key" in ln]
    kept = [
        ln
        for ln in lines
        if ln in specific or not any(s.split(":", 1)[0] == ln.split(":", 1)[0] for s in specific)
    ]
    where = f" (from {source})" if source else ""
    return ConfigError(f"invalid {name}{where}:\n  " + "\n  ".join(kept))


def _model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The config model class that holds the key at ``loc`` (for listing its allowed keys)."""
    cls: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = cls.model_fields.get(part)
        if field is None:
            return None
        cls = _find_model(field.annotation)
    return cls


def _find_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _find_model(arg)
        if found is not None:
            return found
    return None


def _loc_str(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "config"


def _file_keys(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    # pydantic adds the branch name of a union to the location (e.g. 'literal['auto']',
    # 'function-before[...]'); those are not keys of the file, so drop them.
    return tuple(p for p in loc if isinstance(p, int) or not re.search(r"[\[\]\-(]", str(p)))


def _describe(root: type[BaseModel], err: Any, renamed: Renamed) -> str:
    kind = err["type"]
    given = err.get("input")
    raw = tuple(err["loc"])
    if kind == "extra_forbidden":
        # The last part is the user's unknown key itself, whatever characters it has.
        key, path = raw[-1], _file_keys(raw[:-1])
        owner = _model_at(root, path)
        allowed = list(owner.model_fields) if owner is not None else []
        close = difflib.get_close_matches(str(key), allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        if key in renamed and renamed[key][0] is owner:
            hint = f" {renamed[key][1]}"
        return (
            f"{_loc_str(path + (key,))}: unknown key {key!r}; allowed keys: "
            f"{', '.join(allowed)}.{hint}"
        )
    loc = _file_keys(raw)
    if kind in ("literal_error", "enum"):
        expected = err.get("ctx", {}).get("expected", "")
        allowed = ", ".join(re.findall(r"'[^']*'|\d+", expected)) or expected
        return f"{_loc_str(loc)}: got {given!r}; allowed: {allowed}"
    if kind == "missing":
        return f"{_loc_str(loc)}: required key is missing"
    if kind in ("tuple_type", "list_type"):
        return f"{_loc_str(loc)}: expected a list, got {given!r}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        return f"{_loc_str(loc)}: {msg}"
    return f"{_loc_str(loc)}: {msg} (got {given!r})"
