"""The ``vision-ckpt`` command line: the only code in vision_ckpt that prints or exits.

Subcommands: ``profile`` (memory and time per level), ``plan`` (which modules a level
checkpoints), ``suggest`` (a level for a memory budget), ``fit`` (the largest batch per level
for a memory budget), ``derive`` (levels for any model), ``presets`` and ``schema``.
``--model`` takes a timm name or a factory spec (``vision_ckpt.measure.models``),
``--input-shape`` one sample's C,H,W or C,D,H,W. Every error is one line on stderr and a
non-zero exit code: 2 for bad arguments or configs, 1 when the measurement itself fails (and
for ``suggest`` when no level fits).

This module owns the parser and the exit codes; the subcommands live in ``_measuring``
(profile, plan, suggest) and ``_budget`` (fit, derive), what they share in ``_inputs``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._version import __version__
from ..errors import ConfigError, LevelError
from ._budget import cmd_derive, cmd_fit
from ._inputs import UsageError
from ._measuring import cmd_plan, cmd_profile, cmd_suggest

__all__ = ["main"]


def _cmd_presets(args: argparse.Namespace) -> int:
    from ..config import presets

    for name in presets.list_presets(args.filter):
        print(name)
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from ..config.schema import CheckpointConfig

    print(json.dumps(CheckpointConfig.json_schema(), indent=2))
    return 0


def _model_args(p: argparse.ArgumentParser, batch: int | None) -> None:
    """The arguments that name a model and its input."""
    p.add_argument(
        "--model",
        required=True,
        help="a timm name (convnext_tiny) or a factory spec such as "
        "'smp:Unet(encoder_name=\"resnet34\", classes=2)', "
        "'monai:SwinUNETR(in_channels=1, out_channels=2)', "
        "'hf:ViTForImageClassification(ViTConfig(num_hidden_layers=4))', "
        "'torchvision:deeplabv3_resnet50(num_classes=21)' or 'package.module:function(...)' "
        "(see docs/cli.md)",
    )
    if batch is not None:
        p.add_argument("--batch-size", type=int, default=batch, help="batch size")
    p.add_argument(
        "--input-shape",
        default=None,
        help="one sample, C,H,W or C,D,H,W (default: the model's own, e.g. timm's "
        "input_size; 3,224,224 with a note when it has none)",
    )
    p.add_argument("--img-size", type=int, default=None, help="input height and width")
    p.add_argument("--config", default=None, help="a checkpoint config (.yaml/.yml/.json)")
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress display (none when piped either)"
    )


def _measuring_commands(sub: Any) -> None:
    """profile, plan and suggest."""
    p = sub.add_parser("profile", help="memory and time of a training step at each level")
    _model_args(p, 16)
    p.add_argument("--levels", default="0-5", help="levels to profile, e.g. 0-5 or 0,3,5")
    p.add_argument("--steps", type=int, default=3, help="timed steps per level (median)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--memory-limit", default=None, help="skip levels predicted above this")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="write a memory-vs-time plot (PNG)")
    p.add_argument(
        "--frontier",
        action="store_true",
        help="also the per-block planner's predicted trade at a range of budgets",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also the physical floor: the least any region plan could peak at (one more step)",
    )
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser("plan", help="the modules a level checkpoints, as plan() reports them")
    _model_args(p, None)
    p.add_argument("--level", type=int, choices=range(6), default=3, help="training level")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser(
        "suggest", help="the lowest level, and the fastest per-block plan, that fit a budget"
    )
    _model_args(p, 64)
    p.add_argument("--budget", required=True, help="memory budget, e.g. 8GiB or '8 GB'")
    p.add_argument("--margin", type=float, default=0.05, help="share of the budget kept free")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=None, help="write the per-block plan's config (YAML)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument(
        "--uniform-only", action="store_true", help="only the uniform levels, no per-block plan"
    )
    p.set_defaults(run=cmd_suggest)


def _budget_commands(sub: Any) -> None:
    """fit and derive."""
    p = sub.add_parser(
        "fit", help="the largest batch that fits a memory budget, at each level and own switch"
    )
    _model_args(p, None)
    p.add_argument("--budget", required=True, help="memory budget, e.g. 24GiB or '24 GB'")
    p.add_argument("--levels", default="0-5", help="levels to measure, e.g. 0-5 or 0,3,5")
    p.add_argument(
        "--batches", default="2,3,4", help="small batches measured (the third checks linearity)"
    )
    p.add_argument(
        "--time",
        choices=["modelled", "measured"],
        default="modelled",
        help="step times priced from the operators' shapes (no kernel runs), or timed real steps",
    )
    p.add_argument(
        "--steps", type=int, default=1, help="timed steps per batch with --time measured (0: none)"
    )
    p.add_argument("--margin", type=float, default=0.0, help="share of the budget kept free")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--no-own-switch", action="store_true", help="skip the model library's own switch"
    )
    p.add_argument(
        "--planner",
        action="store_true",
        help="also the per-block planner at the best level's batch (measures 1/8 and 1/4 of it)",
    )
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="write a bar chart of batch per level (PNG)")
    p.set_defaults(run=cmd_fit)

    p = sub.add_parser(
        "derive", help="levels 1-5 derived by measurement, written as a preset (any model)"
    )
    _model_args(p, 32)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=None, help="write the derived preset here (YAML)")
    p.add_argument("--json", default=None, help="write the per-level figures to this JSON file")
    p.add_argument("--no-floor", action="store_true", help="skip the physical floor")
    p.add_argument(
        "--no-compare", action="store_true", help="skip measuring the bundled preset's levels"
    )
    p.set_defaults(run=cmd_derive)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vision-ckpt",
        description="Activation checkpointing for vision models: levels 0-5, one training level.",
    )
    parser.add_argument("--version", action="version", version=f"vision-ckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    _measuring_commands(sub)
    _budget_commands(sub)

    p = sub.add_parser("presets", help="list the bundled presets")
    p.add_argument("filter", nargs="?", default=None, help="a glob on preset names")
    p.set_defaults(run=_cmd_presets)

    p = sub.add_parser("schema", help="print the config's JSON schema")
    p.set_defaults(run=_cmd_schema)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vision-ckpt`` console script; returns the exit code.

    >>> main(["--version"])  # doctest: +SKIP
    vision-ckpt 0.1.0
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"vision-ckpt: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    except (ConfigError, LevelError, ValueError, OSError) as exc:  # what the user gave
        print(f"vision-ckpt: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # the measurement itself failed (a model that cannot run, ...)
        print(
            f"vision-ckpt: error: {type(exc).__name__}: {_one_line(exc)}",
            file=sys.stderr,
        )
        return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
