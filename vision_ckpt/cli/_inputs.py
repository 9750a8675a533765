"""What every ``vision-ckpt`` subcommand shares: its model, input, config and console.

Owns the turning of the arguments that name a model and its input into a model on its device,
an input of the right shape and a config (with ``preset: derived`` resolved for that model),
the levels of ``--levels``, the console the tables print to, and the formats of bytes and
seconds. An argument that cannot be used raises :class:`UsageError`, which ``main`` turns into
exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "UsageError",
    "level_range",
    "create_model",
    "input_shape",
    "input_for",
    "load_config",
    "resolved_config",
    "make_console",
    "shows_progress",
    "working",
    "fmt_bytes",
    "fmt_seconds",
    "config_data",
]


class UsageError(Exception):
    """A command-line argument that cannot be used; becomes exit code 2."""


def level_range(text: str) -> list[int]:
    """``"0-5"``, ``"3"`` or ``"0,2,5"`` -> levels; each must be 0-5."""
    levels: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                levels.update(range(lo, hi + 1))
            else:
                levels.add(int(part))
    except ValueError:
        raise UsageError(
            f"--levels {text!r} is not a level range; write e.g. '0-5', '3' or '0,2,5'"
        ) from None
    bad = sorted(v for v in levels if not 0 <= v <= 5)
    if bad or not levels:
        raise UsageError(f"--levels {text!r} has levels outside 0-5: {bad}; levels are 0-5")
    return sorted(levels)


def create_model(args: argparse.Namespace, device: str) -> Any:
    import torch

    from ..measure.models import build_model, parse_input_shape

    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but torch sees no CUDA device")
    img_size = args.img_size
    if img_size is None and getattr(args, "input_shape", None) is not None:
        shape = parse_input_shape(args.input_shape)
        if len(shape) == 3 and shape[1] == shape[2]:
            img_size = shape[1]  # a timm ViT sizes its position table for it
    return build_model(args.model, img_size=img_size).to(device)


def input_shape(args: argparse.Namespace, model: Any, console: Any = None) -> tuple[int, ...]:
    """``--input-shape``, else ``--img-size`` on the model's channels, else what the model says
    it takes; a model that says nothing gets 3,224,224 with a note (a MONAI network must be
    told: it may be 2D or 3D)."""
    from ..measure.models import default_input_shape, parse_input_shape, parse_spec

    if args.input_shape is not None:
        if args.img_size is not None:
            raise UsageError("give --input-shape or --img-size, not both")
        return parse_input_shape(args.input_shape)
    known = default_input_shape(model)
    if args.img_size is not None:
        channels = known[0] if known else 3
        return (channels, args.img_size, args.img_size)
    if known is not None:
        return known
    if parse_spec(args.model).library == "monai":
        raise UsageError(
            f"--model {args.model!r} does not say what input it takes; give --input-shape "
            "C,D,H,W for a 3D network (e.g. 1,96,96,96) or C,H,W for a 2D one"
        )
    if console is not None:
        console.print(
            f"note: {type(model).__name__} does not say what input it takes; using 3,224,224 "
            "(give --input-shape C,H,W or C,D,H,W)"
        )
    return (3, 224, 224)


def input_for(shape: tuple[int, ...], batch_size: int, device: str) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, *shape, generator=generator).to(device)


def load_config(path: str | None) -> Any:
    if path is None:
        return None
    from ..config.schema import CheckpointConfig

    return CheckpointConfig.from_file(path)


def resolved_config(
    config: Any,
    model: Any,
    shape: tuple[int, ...],
    batch: int,
    args: argparse.Namespace,
    console: Any,
) -> Any:
    """``config`` with ``preset: derived`` resolved for this model at ``batch`` (derived once,
    on two small batches of synthetic input); any other config as it is."""
    if config is None or config.preset != "derived":
        return config
    from ..measure.models import output_loss
    from ..tune.derive import resolve_derived

    with working(console, args, f"deriving levels for the model at batch {batch}"):
        started = time.perf_counter()
        config = resolve_derived(
            model, input_for(shape, 2, args.device), config, batch, loss_fn=output_loss
        )
    console.print(
        f"preset: derived, at batch {batch} ({time.perf_counter() - started:.0f} s; "
        "`vision-ckpt derive --out` writes the preset once)"
    )
    return config


def make_console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:  # pipes and files: do not squeeze the table into 80 columns
        console.width = 160
    return console


def shows_progress(console: Any, args: argparse.Namespace) -> bool:
    """Whether long work shows what it is doing: on a terminal, unless ``--quiet``."""
    return bool(console.is_terminal) and not getattr(args, "quiet", False)


@contextlib.contextmanager
def working(console: Any, args: argparse.Namespace, text: str) -> Iterator[Callable[[str], None]]:
    """A status line saying what a long command does now, updated through the function it
    yields; nothing at all when piped or ``--quiet`` (:func:`shows_progress`)."""
    if not shows_progress(console, args):
        yield lambda _text: None
        return
    with console.status(text) as status:
        yield lambda now: status.update(now)


def fmt_bytes(value: int | None) -> str:
    from ..measure._memory import format_bytes

    return "-" if value is None else format_bytes(value)


def config_data(config: Any) -> dict[str, Any]:
    """A config as plain data that ``CheckpointConfig.from_file`` reads back."""
    return config.model_dump(mode="json", exclude_defaults=True)


def fmt_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"
