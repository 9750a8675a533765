"""The checkpoint config: which blocks of a model get which level, and how the run checkpoints.

A config is data: it names modules by qualified-name globs or class names and gives each a level
0-5 (see :class:`vision_ckpt.Level`); :func:`vision_ckpt.plan` turns it into the concrete list of
modules for one model, and :func:`vision_ckpt.apply` installs it. Configs load from YAML or JSON
files with :meth:`CheckpointConfig.from_file`, and :meth:`CheckpointConfig.json_schema` exports a
JSON schema for editors.

.. code-block:: yaml

    training_checkpoint_level: 3
    rules:                       # later rules win
      - match: "blocks.*"        # * is one name component, ** any number
        level: 3
      - match_type: Mlp          # the module's class name
        level: 2
      - match: "blocks"          # a Sequential: consecutive groups of about sqrt(n) layers
        level: 4
        segments: auto
      - match: "stages.*"        # keep conv/matmul outputs, recompute norms and activations
        level: 1
        keep: heavy
    nesting: auto                # auto | all | outermost

Every invalid value raises :class:`vision_ckpt.ConfigError` naming the key (``rules[1].level``),
what was given and what is allowed. This module does not import torch, so tools can validate
config files without it.
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from ..errors import ConfigError, LevelError
from ._messages import config_error
from .levels import Level, parse_level
from .matching import compile_name_pattern, compile_type_pattern

__all__ = [
    "CheckpointConfig",
    "KeepOps",
    "LevelRule",
    "PresetFamily",
    "PresetFile",
    "Region",
    "parse_memory_budget",
]

Nesting = Literal["auto", "all", "outermost"]

_MEMORY_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*")
_OP_RE = re.compile(r"[a-z_][a-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")


def parse_memory_budget(value: str | int) -> int:
    """Bytes in a memory budget such as ``"6GiB"``, ``"512MB"`` or a plain integer of bytes.

    Raises:
        ConfigError: not a positive number followed by one of B, KB, MB, GB, TB, KiB, MiB,
            GiB, TiB.

    >>> parse_memory_budget("6GiB"), parse_memory_budget("1.5 GB"), parse_memory_budget(1024)
    (6442450944, 1500000000, 1024)
    """
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        if value > 0:
            return value
    elif isinstance(value, str):
        m = _MEMORY_RE.fullmatch(value)
        if m is not None and m.group(2).lower() in _MEMORY_UNITS:
            size = float(m.group(1)) * _MEMORY_UNITS[m.group(2).lower()]
            if 0 < size < 2**63:  # also rejects inf from a number too long for a float
                return int(size)
    raise ConfigError(
        f"memory budget {value!r} is not a memory size; write a positive number and a unit, "
        "e.g. '6GiB' or '512MB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
        "or an integer number of bytes."
    )


def _level_value(value: object) -> Level:
    try:
        return parse_level(value, what="value")
    except LevelError as exc:
        raise ValueError(str(exc)) from None


_LEVEL_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 5},
        {"type": "string", "enum": [name.lower() for name in Level.__members__]},
    ],
    "description": "A checkpoint level: 0-5, or a level name such as 'stage'.",
}

LevelValue = Annotated[Level, BeforeValidator(_level_value), WithJsonSchema(_LEVEL_SCHEMA)]
"""A level field: accepts what ``parse_level`` accepts; the JSON schema lists 0-5 and the names."""


class _Schema(BaseModel):
    """Base of the config models: strict keys, field docstrings, and ConfigError on bad input."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        frozen=True,
    )

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error(type(self), exc, source=None) from None

    # Tell pydantic this __init__ only translates errors: nested models are then validated by
    # pydantic itself, so one error lists every bad key of the whole config with its path.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> typing.Self:
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise _config_error(cls, exc, source=None) from None

    @classmethod
    def from_file(cls, path: str | Path) -> typing.Self:
        """Load and validate this model from a ``.yaml``, ``.yml`` or ``.json`` file.

        Raises:
            ConfigError: the file is missing, has another suffix, does not parse, or does not
                validate; the message names the file and the offending keys.
        """
        data = _read_mapping(Path(path), cls)
        try:
            # pydantic's own model_validate, to name the file in the error ourselves.
            return BaseModel.model_validate.__func__(cls, data)  # type: ignore[attr-defined]
        except ValidationError as exc:
            raise _config_error(cls, exc, source=str(path)) from None


def _read_mapping(path: Path, cls: type[BaseModel]) -> dict[str, Any]:
    """The mapping a config file holds (``ConfigError`` naming the file when it has none)."""
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(
            f"config file {str(path)!r} has suffix {path.suffix!r}; allowed: .yaml, .yml, "
            ".json. Rename it, or load it yourself and pass the dict to "
            "CheckpointConfig.model_validate."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist.") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "save it as UTF-8."
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"config file {str(path)!r} cannot be read: {exc.strerror or exc}."
        ) from None
    try:
        if suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except (ValueError, ImportError) as exc:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"config file {str(path)!r} does not parse: {exc}") from None
    except Exception as exc:  # yaml.YAMLError has no common base with the above
        raise ConfigError(f"config file {str(path)!r} does not parse as YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} holds a {type(data).__name__}, expected a mapping "
            f"of config keys ({', '.join(cls.model_fields)})."
        )
    return data


class KeepOps(_Schema):
    """What a region keeps besides its inputs: the outputs of some operators (a rule's ``keep``).

    Every other operator inside the region is recomputed in backward. ``keep: heavy`` is
    ``KeepOps()``: the outputs of convolutions, matrix products and fused attention.

    >>> KeepOps(ops=["aten.mm", "aten.convolution"], below=40).ops
    ('aten.mm', 'aten.convolution')
    >>> str(KeepOps()), str(KeepOps(below=40))
    ('heavy', 'heavy<40')
    """

    ops: Literal["heavy"] | tuple[str, ...] = "heavy"
    """The operators whose outputs are kept: ``heavy`` (convolutions, matrix products and fused
    attention, as autograd dispatches them), or names written ``namespace.op`` as in
    ``torch.ops`` (``aten.mm``, ``aten.convolution``), optionally with an overload
    (``aten.mm.default``). Names are resolved against torch when the config is planned; an
    unknown name is an error then. The output of an operator that draws random numbers is never
    kept (it is recomputed with the same random state)."""

    below: Annotated[int, Field(ge=1)] | None = None
    """Also recompute the convolutions and matrix products among ``ops`` that cost fewer than
    this many FLOPs per output element (a 1x1 convolution from c channels costs 2c, a 3x3
    depthwise one 18): their outputs are large and quick to redo. ``null``: keep every one."""

    @field_validator("ops")
    @classmethod
    def _check_ops(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        if isinstance(value, str):
            return value
        bad = [op for op in value if not _OP_RE.fullmatch(op)]
        if bad:
            raise ValueError(
                f"operator names {bad} are not written 'namespace.op'; write them as in "
                "torch.ops, e.g. 'aten.mm', 'aten.convolution' or 'aten.mm.default'"
            )
        if not value:
            raise ValueError(
                "an empty list keeps nothing; write keep: nothing for a region that recomputes "
                "everything, or list the operators to keep"
            )
        return value

    def __str__(self) -> str:
        text = "heavy" if self.ops == "heavy" else "+".join(self.ops)
        return text if self.below is None else f"{text}<{self.below}"

    def keeps_less_than(self, other: KeepOps) -> bool:
        """Whether this keeps a strict part of what ``other`` keeps: the same operators, but
        more of them recomputed (a higher ``below``).

        >>> KeepOps(below=600).keeps_less_than(KeepOps()), KeepOps().keeps_less_than(KeepOps())
        (True, False)
        """
        return self.ops == other.ops and (self.below or 0) > (other.below or 0)


def _keep_value(value: object) -> object:
    if isinstance(value, str):
        if value not in ("nothing", "heavy"):
            raise ValueError(
                f"keep {value!r} is not a keep policy; allowed: 'nothing' (recompute the whole "
                "span), 'heavy' (keep convolution, matmul and attention outputs), or a mapping "
                "{ops: [...], below: N}"
            )
        return KeepOps() if value == "heavy" else None
    return value


def _write_keep(keep: KeepOps) -> Any:
    """A keep policy as a config file writes it: ``heavy``, or the mapping of its keys."""
    return "heavy" if keep == KeepOps() else keep.model_dump(exclude_defaults=True)


_KEEP_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "enum": ["nothing", "heavy"]},
        {k: v for k, v in KeepOps.model_json_schema().items() if k != "title"},
    ],
    "description": "What a region keeps: nothing, heavy, or {ops: [...], below: N}.",
}

Keep = Annotated[
    KeepOps | None,
    BeforeValidator(_keep_value),
    PlainSerializer(_write_keep, when_used="unless-none"),
    WithJsonSchema(_KEEP_SCHEMA),
]
"""A ``keep`` field: ``nothing`` (``None``), ``heavy`` (``KeepOps()``) or a mapping of
:class:`KeepOps` keys."""


@dataclass(frozen=True)
class Region:
    """A region: a span and what it keeps. The one type from rule to runtime: a rule makes one
    of each module it selects (:attr:`LevelRule.region`), the plan gives it a level
    (``Rung.region``), and the installed forward runs it.

    >>> print(Region(), Region(keep=KeepOps(below=40)), Region(through="maxpool"))
    full keep heavy<40 full through maxpool
    """

    keep: KeepOps | None = None
    """What the region keeps besides its inputs (a rule's ``keep``): ``None``, nothing (the
    span is recomputed whole); else the outputs of some operators."""
    segments: int | Literal["auto"] | None = None
    """Span: for a stack of layers, consecutive groups of this many layers (``auto``: about
    sqrt(n)) instead of the whole stack, or nested inside it where the stack is a full region
    at a lower level (``Rung.inside``)."""
    through: str | None = None
    """Span: the last of a run of sibling modules recomputed with this one as one region;
    ``None``: the module alone."""
    offload: bool = False
    """The region's CUDA inputs wait in pinned host memory (a rule's ``offload``)."""

    @property
    def selective(self) -> bool:
        """Whether the region keeps some operators' outputs (else it keeps nothing)."""
        return self.keep is not None

    @property
    def group(self) -> bool:
        """Whether the span is a group of a stack's layers (segments of a Sequential, or a
        group of a ModuleList's layers): a group whatever it holds (NOTE [ Nesting ] in
        ``vision_ckpt.runtime.wrapper``)."""
        return self.segments is not None

    def __str__(self) -> str:
        text = "segments" if self.segments is not None else "full"
        if self.keep is not None:
            text = f"keep {self.keep}"
        if self.offload:
            text = "offload"
        if self.through is not None:
            text += f" through {self.through}"
        if self.segments not in (None, "auto"):
            text += f"/{self.segments}"
        return text


class LevelRule(_Schema):
    """One rule: the modules it selects, the level they get, and the region each becomes.

    A rule selects modules by qualified name (``match``), by class (``match_type``), or by both
    (then a module must satisfy both). Later rules win over earlier ones. From its level on, a
    selected module is one *region*, checkpointed as a whole: its *span* is the module, or a
    run of calls starting at it (``through``, ``segments``), and ``keep`` says what the region
    keeps for backward besides its inputs. ``lean`` and ``offload`` are the two exceptions to
    a plain region (a lean MLP is no region; an offloaded one keeps its inputs in host memory).

    >>> LevelRule(match="blocks.*", level=3)  # doctest: +NORMALIZE_WHITESPACE
    LevelRule(match='blocks.*', match_type=None, level=<Level.MEDIUM_MODULE: 3>, keep=None,
              segments=None, through=None, lean=False, offload=False)
    >>> str(LevelRule(match_type="Mlp", level="block", keep="heavy"))
    "match_type='Mlp' level=2 keep=heavy"
    """

    match: str | None = None
    """Glob on the module's qualified name from ``named_modules()``: ``*`` is exactly one name
    component, ``**`` any number of components (zero included), ``*``/``?`` inside a component
    match characters; a ``re:`` prefix makes it a full-match regular expression."""

    match_type: str | None = None
    """The module's class name (``Block``), or its qualified name (``timm.layers.mlp.Mlp``) when
    it contains a dot; ``*`` and ``?`` are wildcards. Subclasses do not match."""

    level: LevelValue
    """The level 0-5 (or its name, such as ``stage``) from which the selected modules are this
    rule's region. 0 means never checkpoint them in any way, which is how a later rule excludes
    a module an earlier rule selected (with ``lean: true``, 0 takes away only the lean level).
    A module can be the region of several rules, one per level (a region that keeps the heavy
    outputs from 1, one that keeps nothing from 3): at a training level the highest of its
    levels within it decides. (This is the one field without a default: a rule without a level
    says nothing.)"""

    keep: Keep = None
    """What the region keeps for backward besides its inputs. ``nothing`` (the default):
    backward runs the whole span again. ``heavy``: the outputs of its convolutions, matrix
    products and attention are kept, and only the cheap operators (norms, activations, dropout,
    pooling, additions) are recomputed: a smaller saving for much less time. A mapping
    ``{ops: [...], below: N}`` (see ``KeepOps``) names the operators, or recomputes the cheap
    ones among them too."""

    segments: Literal["auto"] | Annotated[int, Field(ge=1)] | None = None
    """Span: for an ``nn.Sequential`` (a stack of layers), consecutive groups of its layers,
    each one region, instead of the whole stack; where a lower level makes the stack a full
    region, it stays one and the groups run nested inside it. ``auto`` makes groups of about
    sqrt(n) of its n layers; an integer k makes groups of k (one group of the whole stack adds
    nothing to a full region below it and is dropped). The module tree is unchanged. On an
    ``nn.ModuleList`` whose layers the parent calls one after another (BEiT, EVA), each group
    is a run of those calls (as ``through`` makes one), with its layers' own levels still
    applying inside it."""

    through: str | None = None
    """Span: the name of a later sibling of the selected module. The module and its siblings up
    to and including that one, which their parent calls one after another on one tensor (a stem
    of conv, norm, activation and pool that is not one module, such as ResNet's ``conv1`` ...
    ``maxpool``), are one region; further arguments after that tensor, positional or keyword
    (``attn_mask=None``, a rotary embedding tensor), are passed again when it is recomputed.
    The run is checked at every call; where the parent does anything else, the region ends
    there, exactly. A sibling registered inside the range that the parent calls elsewhere, not
    on that tensor (a dropout on a skip connection, called before the run), is skipped. A
    selected module without that later sibling is an error, except in a preset, whose rule
    then leaves that module out (one model class can hold blocks of several layouts). A later
    member may have a level of its own below the rule's: from the rule's level on, the run
    takes its place."""

    lean: bool = False
    """Not a region: from ``level`` on, the selected MLP (two linear or 1x1-conv layers around a
    GELU, SiLU, ReLU, Hardswish or StarReLU: a timm ``Mlp``, or a module whose forward chains
    them) runs an exact backward that keeps the first layer's output and not the
    activation's, and holds one hidden-size tensor fewer at once, for one activation
    recomputed. It combines with the
    module's regions from other rules (checkpointed and lean, from both levels on)."""

    offload: bool = False
    """The region (keeping nothing) keeps its inputs in pinned host memory instead of on the
    GPU, copied back when it is recomputed (torch's ``CPU_OFFLOAD`` policies, Hugging Face's
    ``offload=True``): the inputs leave the device for two copies per step. Exact; on CPU it
    does nothing (the plan says so), and under torch.compile the region is a plain one."""

    @field_validator("through")
    @classmethod
    def _check_through(cls, value: str | None) -> str | None:
        if value is not None and (not value or "." in value or "*" in value):
            raise ValueError(
                f"through {value!r} is not a sibling's name: give the plain name of a later "
                "child of the same parent, such as 'maxpool' (no dots, no wildcards)"
            )
        return value

    @field_validator("match")
    @classmethod
    def _check_match(cls, value: str | None) -> str | None:
        if value is not None:
            _as_value_error(compile_name_pattern, value)
        return value

    @field_validator("match_type")
    @classmethod
    def _check_match_type(cls, value: str | None) -> str | None:
        if value is not None:
            _as_value_error(compile_type_pattern, value)
        return value

    @model_validator(mode="after")
    def _needs_a_selector(self) -> LevelRule:
        if self.match is None and self.match_type is None:
            raise ValueError(
                f"rule with level {int(self.level)} selects no module: give 'match' (a "
                "qualified-name glob such as 'blocks.*') or 'match_type' (a class name such as "
                "'Block'), or both"
            )
        if self.lean:
            extra = self._region_keys()
            if extra:
                raise ValueError(
                    f"rule {self} is lean and gives {', '.join(extra)}; a lean MLP is not a "
                    "region, so it has no span or keep: write the region as a rule of its own "
                    "(same match, without lean), or drop lean"
                )
            return self
        if self.keep is not None and (self.segments is not None or self.through is not None):
            span = "segments" if self.segments is not None else "through"
            raise ValueError(
                f"rule {self} keeps {self.keep} in a region spanned by {span}; a run of calls "
                "or a group of layers is recomputed whole: drop keep (keep: nothing), or "
                f"drop {span}"
            )
        if self.offload and (self.keep is not None or self.through or self.segments):
            raise ValueError(
                f"rule {self} offloads and gives {', '.join(self._region_keys())}; an "
                "offloaded region is one module that keeps nothing but its inputs, in host "
                "memory: drop offload, or the other keys"
            )
        if self.through is not None and self.segments is not None:
            raise ValueError(
                f"rule {self} gives both through and segments; a region spans one module, a "
                "run through a later sibling, or groups of a stack's layers: keep one"
            )
        return self

    @property
    def region(self) -> Region | None:
        """The region the rule makes of each module it selects; ``None`` for a rule of level 0
        or a ``lean`` one, which make none.

        >>> print(LevelRule(match="blocks.*", level=2, keep="heavy").region)
        keep heavy
        """
        if self.level == 0 or self.lean:
            return None
        return Region(self.keep, self.segments, self.through, self.offload)

    @property
    def way(self) -> Region | str:
        """What the rule makes of a module it selects: ``"none"`` (level 0), ``"lean"``, or its
        region. A module keeps one rung per way: a later rule of the same way replaces an
        earlier one at any level (``apply.plan``)."""
        if self.level == 0:
            return "none"
        return "lean" if self.lean else Region(self.keep, self.segments, self.through, self.offload)

    def _region_keys(self) -> list[str]:
        keys = [f"keep={self.keep}"] if self.keep is not None else []
        keys += [f"{k}={getattr(self, k)}" for k in ("segments", "through") if getattr(self, k)]
        return keys + (["offload"] if self.offload and self.lean else [])

    def __str__(self) -> str:
        parts = []
        if self.match is not None:
            parts.append(f"match={self.match!r}")
        if self.match_type is not None:
            parts.append(f"match_type={self.match_type!r}")
        parts.append(f"level={int(self.level)}")
        if self.keep is not None:
            parts.append(f"keep={self.keep}")
        if self.segments is not None:
            parts.append(f"segments={self.segments}")
        if self.through is not None:
            parts.append(f"through={self.through}")
        if self.lean:
            parts.append("lean")
        if self.offload:
            parts.append("offload")
        return " ".join(parts)


class CheckpointConfig(_Schema):
    """A checkpoint config: level rules for a model's modules and how to run the checkpoints.

    >>> cfg = CheckpointConfig(
    ...     training_checkpoint_level=3, rules=[{"match": "blocks.*", "level": 3}]
    ... )
    >>> cfg.rules[0].level, cfg.nesting
    (<Level.MEDIUM_MODULE: 3>, 'auto')
    >>> CheckpointConfig(nesting="inner")
    Traceback (most recent call last):
    ...
    vision_ckpt.errors.ConfigError: invalid checkpoint config:
      nesting: got 'inner'; allowed: 'auto', 'all', 'outermost'
    """

    training_checkpoint_level: (
        Annotated[Level, WithJsonSchema(_LEVEL_SCHEMA)] | Literal["auto"] | None
    ) = None
    """The training level 0-5 of this run: modules whose level is between 1 and it are
    checkpointed. ``null`` follows the global level (``vision_ckpt.set_training_level`` /
    ``vision_ckpt.training_level``), which can change between steps. ``auto`` picks the level
    that fits ``memory_budget``, per block (needs the profiler: see
    ``vision_ckpt.tune.resolve_auto``, and ``suggest_level`` for one uniform level)."""

    memory_budget: str | int | None = None
    """Activation memory allowed to the run, for ``training_checkpoint_level: auto`` only:
    a size such as ``6GiB`` or ``512MB``, or an integer number of bytes."""

    preset: str | None = None
    """Start from a preset's rules: a model family name (see ``vision_ckpt.list_presets``) or
    ``auto`` to pick the preset from the model's class; ``rules`` below then override it."""

    rules: tuple[LevelRule, ...] = ()
    """Level rules, applied in order after the preset's: when several rules select a module, the
    last one wins. Each rule must select at least one module of the model (see ``strict``)."""

    nesting: Nesting = "auto"
    """What happens to checkpointed modules inside a checkpointed module while backward runs
    the outer one again. ``auto``: they are checkpointed again only where that lowers the peak
    for little time: inside a group (a segment of a stack, or a region whose span holds several
    fully checkpointed regions at the training level), and when they are selective; a residual
    block with one checkpointed shortcut is recomputed as one piece. ``all``: always (the
    lowest peak, inner blocks run once more per enclosing level). ``outermost``: never, except
    inside groups, whose recomputation would otherwise hold all their layers at once: at most
    one extra forward per block. The level numbers do not enter: a group is what its span
    holds (NOTE [ Nesting ] in ``vision_ckpt.runtime.wrapper``)."""

    preserve_rng_state: bool = True
    """Stash and restore the RNG state around each checkpointed module, so that dropout and
    drop-path draw the same masks when recomputed and gradients are exact. ``false`` saves a
    little time when no checkpointed module uses randomness."""

    strict: bool = True
    """When a rule selects no module of the model: ``true`` raises an error, ``false`` warns."""

    @field_validator("training_checkpoint_level", mode="before")
    @classmethod
    def _parse_training_level(cls, value: object) -> object:
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None if value is None else "auto"
        try:
            return _level_value(value)
        except ValueError as exc:
            raise ValueError(f"{exc} Or 'auto' together with memory_budget.") from None

    @field_validator("memory_budget")
    @classmethod
    def _check_budget(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            _as_value_error(parse_memory_budget, value)
        return value

    @classmethod
    def from_file(cls, path: str | Path) -> typing.Self:
        """Load a config file, or a preset file: a file with a ``family:`` header (what
        ``configs/presets/`` holds and ``vision-ckpt derive --out`` writes) loads as
        ``preset: <path>``, its rules at the training level the caller sets.

        >>> import vision_ckpt.config.presets as presets
        >>> cfg = CheckpointConfig.from_file(presets.presets_dir() / "resnet.yaml")
        >>> cfg.preset.endswith("resnet.yaml") and not cfg.rules
        True
        """
        path = Path(path)
        data = _read_mapping(path, cls)
        if "family" in data:
            return cls(preset=str(path))
        return super().from_file(path)

    @field_validator("preset")
    @classmethod
    def _check_preset(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(
                f"preset {value!r} is empty; give a family name such as 'vit', or 'auto'"
            )
        return value

    @model_validator(mode="after")
    def _budget_goes_with_auto(self) -> CheckpointConfig:
        auto = self.training_checkpoint_level == "auto"
        if auto and self.memory_budget is None:
            raise ValueError(
                "training_checkpoint_level 'auto' needs memory_budget (e.g. memory_budget: "
                "6GiB) to choose a level; set both, or give a level 0-5 instead"
            )
        if not auto and self.memory_budget is not None:
            raise ValueError(
                f"memory_budget {self.memory_budget!r} is only used with "
                f"training_checkpoint_level: auto, but the level is "
                f"{_show_level(self.training_checkpoint_level)}; set the level to auto or "
                "remove memory_budget"
            )
        return self

    @property
    def memory_budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes, or ``None``.

        >>> cfg = CheckpointConfig(training_checkpoint_level="auto", memory_budget="2KiB")
        >>> cfg.memory_budget_bytes
        2048
        """
        return None if self.memory_budget is None else parse_memory_budget(self.memory_budget)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON schema of config files, for editors and validators.

        >>> schema = CheckpointConfig.json_schema()
        >>> schema["properties"]["nesting"]["enum"]
        ['auto', 'all', 'outermost']
        """
        schema = cls.model_json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        return schema


def _show_level(value: object) -> str:
    if value is None:
        return "null (follow the global training level)"
    return f"{int(value)}" if isinstance(value, Level) else repr(value)


def _as_value_error(check: typing.Callable[[Any], Any], value: Any) -> None:
    """Run a check that raises ConfigError, turning that into the ValueError pydantic expects."""
    try:
        check(value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


_RENAMED: dict[str, tuple[type[BaseModel], str]] = {
    "strategy": (
        LevelRule,
        "A region is a span and what it keeps: 'strategy: selective' is now 'keep: heavy', "
        "'strategy: lean' is 'lean: true', 'strategy: offload' is 'offload: true', and "
        "'strategy: full' is the default.",
    ),
    "recompute_below": (
        LevelRule,
        "'recompute_below: N' is now part of what the region keeps: 'keep: {ops: heavy, "
        "below: N}'.",
    ),
    "selective": (
        CheckpointConfig,
        "What a region keeps is given per rule: 'keep: {ops: [aten.mm, ...]}' on the rules "
        "whose regions should keep those outputs.",
    ),
}
"""Keys of earlier versions, and what replaced them (for the unknown-key error)."""


class PresetFamily(_Schema):
    """The models a preset is written for: the ``family:`` header of a preset file.

    >>> fam = PresetFamily(classes=["timm.models.resnet.ResNet"], written_for={"timm": "1.0"})
    >>> fam.classes, fam.parts
    (('timm.models.resnet.ResNet',), {})
    """

    classes: tuple[str, ...] = ()
    """Classes whose models resolve to this preset: qualified names
    (``timm.models.resnet.ResNet``) keep two libraries' classes of one name apart. Subclasses
    resolve to it too, unless a preset names them."""

    architectures: tuple[tuple[str, str], ...] = ()
    """``[class, pattern]`` pairs for classes that several families share: a model of ``class``
    whose timm architecture name matches the ``fnmatch`` pattern (``vit_*_r50_*``) resolves to
    this preset, ahead of a preset that names the class alone."""

    written_for: dict[str, str] = {}
    """Library distribution name -> the version whose module names the rules were read from
    (``{transformers: "5.23"}``). Quoted when a preset no longer fits a model."""

    parts: dict[str, str] = {}
    """Submodule name -> preset applied under it (``encoder: auto``, ``backbone: tv_resnet``).
    ``auto`` is the preset of the submodule's own class, or the structural fallback. The part's
    rules are prefixed with its name and come before the preset's own rules; a part the model
    lacks is skipped."""

    @field_validator("classes")
    @classmethod
    def _check_classes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            compile_type_pattern(name)
        return value


class PresetFile(_Schema):
    """A preset file: the family it is for, and its level rules (``configs/presets/*.yaml``).

    >>> PresetFile(rules=[{"match": "blocks.*", "level": 3}]).family.classes
    ()
    """

    family: PresetFamily = PresetFamily()
    """Which models the preset is for, and what it was written against."""

    rules: tuple[LevelRule, ...]
    """The level rules, in the order they apply (later rules win)."""


def _config_error(root: type[BaseModel], exc: ValidationError, source: str | None) -> ConfigError:
    name = "checkpoint config" if root is CheckpointConfig else root.__name__
    return config_error(root, exc, name=name, source=source, renamed=_RENAMED)
