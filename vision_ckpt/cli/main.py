"""The ``vision-ckpt`` command line: the only code in vision_ckpt that prints or exits.

Subcommands: ``profile`` (memory and time per level), ``plan`` (which modules a level
checkpoints), ``suggest`` (a level for a memory budget), ``fit`` (the largest batch per level
for a memory budget), ``presets`` and ``schema``. ``--model`` takes a timm name or a factory
spec (``vision_ckpt.measure.models``), ``--input-shape`` one sample's C,H,W or C,D,H,W.
Every error is one line on stderr and a non-zero exit code: 2 for bad arguments or configs,
1 when the measurement itself fails (and for ``suggest`` when no level fits).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import ConfigError, LevelError

__all__ = ["main"]


class _UsageError(Exception):
    """A command-line argument that cannot be used; becomes exit code 2."""


def _level_range(text: str) -> list[int]:
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
        raise _UsageError(
            f"--levels {text!r} is not a level range; write e.g. '0-5', '3' or '0,2,5'"
        ) from None
    bad = sorted(v for v in levels if not 0 <= v <= 5)
    if bad or not levels:
        raise _UsageError(f"--levels {text!r} has levels outside 0-5: {bad}; levels are 0-5")
    return sorted(levels)


def _create_model(args: argparse.Namespace, device: str) -> Any:
    import torch

    from ..measure.models import build_model, parse_input_shape

    if device == "cuda" and not torch.cuda.is_available():
        raise _UsageError("--device cuda was given but torch sees no CUDA device")
    img_size = args.img_size
    if img_size is None and getattr(args, "input_shape", None) is not None:
        shape = parse_input_shape(args.input_shape)
        if len(shape) == 3 and shape[1] == shape[2]:
            img_size = shape[1]  # a timm ViT sizes its position table for it
    return build_model(args.model, img_size=img_size).to(device)


def _input_shape(args: argparse.Namespace, model: Any, console: Any = None) -> tuple[int, ...]:
    """``--input-shape``, else ``--img-size`` on the model's channels, else what the model says
    it takes; a model that says nothing gets 3,224,224 with a note (a MONAI network must be
    told: it may be 2D or 3D)."""
    from ..measure.models import default_input_shape, parse_input_shape, parse_spec

    if args.input_shape is not None:
        if args.img_size is not None:
            raise _UsageError("give --input-shape or --img-size, not both")
        return parse_input_shape(args.input_shape)
    known = default_input_shape(model)
    if args.img_size is not None:
        channels = known[0] if known else 3
        return (channels, args.img_size, args.img_size)
    if known is not None:
        return known
    if parse_spec(args.model).library == "monai":
        raise _UsageError(
            f"--model {args.model!r} does not say what input it takes; give --input-shape "
            "C,D,H,W for a 3D network (e.g. 1,96,96,96) or C,H,W for a 2D one"
        )
    if console is not None:
        console.print(
            f"note: {type(model).__name__} does not say what input it takes; using 3,224,224 "
            "(give --input-shape C,H,W or C,D,H,W)"
        )
    return (3, 224, 224)


def _input_for(shape: tuple[int, ...], batch_size: int, device: str) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, *shape, generator=generator).to(device)


def _load_config(path: str | None) -> Any:
    if path is None:
        return None
    from ..config.schema import CheckpointConfig

    return CheckpointConfig.from_file(path)


def _resolved(
    config: Any, model: Any, shape: tuple[int, ...], batch: int, device: str, console: Any
) -> Any:
    """``config`` with ``preset: derived`` resolved for this model at ``batch`` (derived once,
    on two small batches of synthetic input); any other config as it is."""
    if config is None or config.preset != "derived":
        return config
    from ..measure.models import output_loss
    from ..tune.derive import resolve_derived

    with console.status(f"deriving levels for the model at batch {batch}"):
        started = time.perf_counter()
        config = resolve_derived(
            model, _input_for(shape, 2, device), config, batch, loss_fn=output_loss
        )
    console.print(
        f"preset: derived, at batch {batch} ({time.perf_counter() - started:.0f} s; "
        "`vision-ckpt derive --out` writes the preset once)"
    )
    return config


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:  # pipes and files: do not squeeze the table into 80 columns
        console.width = 160
    return console


def _fmt_bytes(value: int | None) -> str:
    from ..measure._memory import format_bytes

    return "-" if value is None else format_bytes(value)


def _profile_table(result: Any) -> Any:
    from rich.table import Table

    table = Table(
        title=(
            f"{result.model}: batch {result.batch_size}, input {tuple(result.input_shape)}, "
            f"{result.device}, median of {result.steps} steps"
        )
    )
    for column in ("level", "regions", "peak", "activations", "saved for bwd", "saving vs 0"):
        table.add_column(column, justify="right")
    table.add_column("step time", justify="right")
    table.add_column("slowdown", justify="right")
    has_cuda = any(e.cuda_peak_bytes is not None for e in result.levels)
    if has_cuda:  # the allocator's figures (NOTE [ Two meters ] in vision_ckpt.measure._measure)
        table.add_column("cuda allocated", justify="right")
        table.add_column("cuda reserved", justify="right")
    table.add_column("frontier")
    frontier = result.frontier()
    for e in result.levels:
        if e.skipped is not None:
            row = [str(e.level), str(e.regions), e.skipped, "", "", "", "", ""]
        else:
            row = [
                str(e.level),
                str(e.regions),
                _fmt_bytes(e.peak_bytes),
                _fmt_bytes(e.activation_bytes),
                _fmt_bytes(e.saved_bytes),
                "-" if e.saving is None else f"{e.saving:.1%}",
                "-" if e.step_time_s is None else f"{e.step_time_s * 1000:.0f} ms",
                "-" if e.time_ratio is None else f"{e.time_ratio:.2f}x",
            ]
        if has_cuda:
            row += [_fmt_bytes(e.cuda_peak_bytes), _fmt_bytes(e.cuda_reserved_bytes)]
        mark = frontier.get(e.level)
        row.append("" if mark is None else (mark or "yes"))
        table.add_row(*row)
    on = [f"L{level}" for level, mark in frontier.items() if mark == ""]
    table.caption = (
        f"On the memory/time frontier: {', '.join(on) or 'none'}; a dominated level has a "
        "level with no higher peak and no longer step time (times are medians, noisy on a "
        "busy machine)."
    )
    return table


def _floor_line(floor: Any, result: Any) -> str:
    """The floor, and each measured level's peak as a multiple of it."""
    above = ", ".join(
        f"L{e.level} {e.peak_bytes / floor.floor_bytes:.2f}x"
        for e in result.levels
        if e.skipped is None and e.peak_bytes
    )
    return (
        f"physical floor {_fmt_bytes(floor.floor_bytes)} (no region plan peaks lower: "
        f"{floor.operator} in {floor.phase} beside the parameter gradients); peaks over it: "
        f"{above}"
    )


def _plot(result: Any, path: str, planned: list[dict[str, Any]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [e for e in result.levels if e.skipped is None]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    xs = [e.time_ratio or 1.0 for e in points]
    ys = [(e.peak_bytes or 0) / 2**20 for e in points]
    ax.plot(xs, ys, marker="o")
    for i, (e, x, y) in enumerate(zip(points, xs, ys, strict=True)):
        # Alternate above/below: levels with the same peak would otherwise print over each other.
        offset = (5, 6) if i % 2 == 0 else (5, -14)
        ax.annotate(f"level {e.level}", (x, y), textcoords="offset points", xytext=offset)
    if planned:
        ax.plot(
            [p["time"] / p["base_time"] for p in planned],
            [p["peak"] / 2**20 for p in planned],
            marker="s",
            linestyle="--",
            label="per-block plans (predicted)",
        )
        ax.legend()
    ax.set_xlabel("step time relative to level 0")
    ax.set_ylabel("step peak memory (MiB)")
    ax.set_title(f"{result.model}, batch {result.batch_size}: memory vs time by level")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _cmd_profile(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from ..tune.profiling import profile

    levels = _level_range(args.levels)
    config = _load_config(args.config)
    from ..measure.models import output_loss

    model = _create_model(args, args.device)
    console = _console()
    shape = _input_shape(args, model, console)
    config = _resolved(config, model, shape, args.batch_size, args.device, console)
    x = _input_for(shape, args.batch_size, args.device)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"profiling {args.model}", total=len(levels))

        def advance(entry: Any) -> None:
            progress.advance(task)
            progress.update(task, description=f"profiling {args.model}: level {entry.level} done")

        result = profile(
            model,
            x,
            levels=levels,
            config=config,
            steps=args.steps,
            memory_limit=args.memory_limit,
            on_level=advance,
            model_name=args.model,
            loss_fn=output_loss,
        )
    console.print(_profile_table(result))
    floor = None
    if args.floor:
        from ..measure.peak import physical_floor

        with console.status(f"measuring the physical floor of {args.model}"):
            floor = physical_floor(model, x, output_loss)
        console.print(_floor_line(floor, result))
    planned: list[dict[str, Any]] = []
    if args.frontier:
        from ..tune.profiling import planner_frontier

        with console.status(f"pricing the blocks of {args.model} for the per-block planner"):
            planned = planner_frontier(model, x, config=config, loss_fn=output_loss)
        console.print(_frontier_table(result, planned))
    if args.json:
        data = result.to_dict()
        if args.frontier:
            data["planner_frontier"] = planned
        if floor is not None:
            data["floor_bytes"] = floor.floor_bytes
        Path(args.json).write_text(json.dumps(data, indent=2))
        console.print(f"wrote {args.json}")
    if args.plot:
        _plot(result, args.plot, planned)
        console.print(f"wrote {args.plot}")
    return 0


def _frontier_table(result: Any, planned: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=f"per-block plans (predicted) at batch {result.batch_size}")
    for column in ("budget", "predicted peak", "predicted time", "blocks"):
        table.add_column(column, justify="right")
    for point in planned:
        ratio = point["time"] / point["base_time"] if point["base_time"] else None
        table.add_row(
            _fmt_bytes(point["budget"]),
            _fmt_bytes(point["peak"]),
            "-" if ratio is None else f"{ratio:.2f}x",
            ", ".join(f"{n} {s}" for s, n in point["strategies"].items()),
        )
    table.caption = (
        "The planner's choice at each budget, predicted from one measurement of every block's "
        "strategies (not measured); time relative to no checkpointing."
    )
    return table


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..config.schema import CheckpointConfig
    from ..regions.apply import plan as make_plan
    from ..runtime.wrapper import training_level

    config = _load_config(args.config) or CheckpointConfig(preset="auto")
    model = _create_model(args, "cpu")
    with training_level(args.level):
        plan = make_plan(model, config.model_copy(update={"training_checkpoint_level": None}))
        _console().print(str(plan))
    return 0


def _cmd_suggest(args: argparse.Namespace) -> int:
    from ..measure.models import output_loss
    from ..tune.profiling import plan_for_budget, suggest_level

    config = _load_config(args.config)
    model = _create_model(args, args.device)
    console = _console()
    small = max(2, args.batch_size // 4)
    shape = _input_shape(args, model, console)
    config = _resolved(config, model, shape, args.batch_size, args.device, console)
    x = _input_for(shape, small, args.device)
    # suggest_level and plan_for_budget answer the same question: one set of arguments
    question: dict[str, Any] = {
        "batch_size": args.batch_size,
        "config": config,
        "margin": args.margin,
        "loss_fn": output_loss,
    }
    suggestion = suggest_level(model, x, args.budget, **question)
    from rich.table import Table

    table = Table(
        title=(
            f"{args.model}: predicted step peak at batch {args.batch_size} "
            f"(meter: {suggestion.meter})"
        )
    )
    table.add_column("level", justify="right")
    table.add_column("predicted peak", justify="right")
    table.add_column("fits", justify="center")
    for level, peak in suggestion.predicted_peak.items():
        fits = peak * (1 + suggestion.margin) <= suggestion.budget_bytes
        table.add_row(str(level), _fmt_bytes(peak), "yes" if fits else "no")
    console.print(table)
    console.print(suggestion.explain())
    report: dict[str, Any] = {"uniform": {"level": suggestion.level, "meter": suggestion.meter}}
    if suggestion.check is not None:  # on CUDA: the real step that confirmed the level
        report["uniform"]["check"] = dataclasses.asdict(suggestion.check)
    if args.uniform_only:
        return 0 if suggestion.fits else 1

    result = plan_for_budget(model, x, args.budget, **question)
    console.print(_plan_table(result, args.batch_size))
    console.print(result.explain())
    planned = _plan_report(result)
    report["uniform"].update(planned.pop("uniform"))
    report.update(planned)
    if args.out and result.config is not None:
        import yaml

        Path(args.out).write_text(yaml.safe_dump(_config_data(result.config), sort_keys=False))
        console.print(f"wrote {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.json}")
    return 0 if (result.config is not None or suggestion.fits) else 1


def _plan_table(result: Any, batch_size: int) -> Any:
    """suggest's second table: the fastest uniform level that fits, the per-block plan, and
    which of the two is the answer."""
    from rich.table import Table

    fastest = result.fastest_uniform()
    per_block = result if result.uniform_level is None else result.per_block
    plan_table = Table(title=f"fastest for {_fmt_bytes(result.budget_bytes)} at batch {batch_size}")
    for column in ("", "predicted peak", "step time", "checkpointed", "answer"):
        plan_table.add_column(column, justify="right")
    if fastest is not None:
        level = result.uniform[fastest]
        plan_table.add_row(
            f"level {fastest} (fastest uniform level that fits)",
            _fmt_bytes(level["peak"]),
            _fmt_seconds(level["time"]),
            "every block of the level",
            "yes" if result.uniform_level == fastest else "",
        )
    if per_block is not None and per_block.config is not None:
        counts: dict[str, int] = {}
        for strategy in per_block.strategies.values():
            counts[strategy] = counts.get(strategy, 0) + 1
        plan_table.add_row(
            "per-block plan",
            _fmt_bytes(per_block.predicted_peak),
            _fmt_seconds(per_block.step_time),
            ", ".join(f"{n} {s}" for s, n in counts.items()),
            "yes" if result.uniform_level is None else "",
        )
    plan_table.add_row("no checkpointing", "", _fmt_seconds(result.base_time), "", "")
    plan_table.caption = (
        f"planned in {result.seconds:.0f} s ({result.rounds} plan(s) measured); step times are "
        "measured at small batches and extrapolated, the same way for every row; the answer is "
        "never slower than the fastest uniform level that fits"
    )
    return plan_table


def _plan_report(result: Any) -> dict[str, Any]:
    """suggest's JSON about the per-block plan and the uniform levels it was compared with."""
    per_block = result if result.uniform_level is None else result.per_block
    report: dict[str, Any] = {
        "uniform": {
            "fastest_level": result.fastest_uniform(),
            "levels": {str(k): v for k, v in result.uniform.items()},
        },
        "plan": {
            "fits": result.config is not None,
            "uniform_level": result.uniform_level,
            "predicted_peak": result.predicted_peak,
            "predicted_time_s": result.predicted_time,
            "step_time_s": result.step_time,
            "base_time_s": result.base_time,
            "strategies": result.strategies,
            "seconds": result.seconds,
            "config": None if result.config is None else _config_data(result.config),
        },
    }
    if per_block is not None and per_block is not result:
        report["plan"]["per_block"] = {
            "predicted_peak": per_block.predicted_peak,
            "step_time_s": per_block.step_time,
            "strategies": per_block.strategies,
        }
    return report


def _cmd_fit(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..tune.fit import max_batch

    levels = _level_range(args.levels)
    config = _load_config(args.config)
    try:
        batches = tuple(int(v) for v in args.batches.split(","))
    except ValueError:
        raise _UsageError(
            f"--batches {args.batches!r} is not a list of batch sizes; write e.g. '2,3,4'"
        ) from None
    model = _create_model(args, args.device)
    console = _console()
    shape = _input_shape(args, model, console)
    # derived for eight times the largest batch measured: its two small batches are then
    # a quarter and an eighth of it, as for any derivation
    config = _resolved(config, model, shape, 8 * max(batches), args.device, console)
    with console.status(f"measuring {args.model} at batches {args.batches}") as status:

        def progress(row: Any) -> None:
            status.update(f"measuring {args.model}: {row.label} done")

        result = max_batch(
            model,
            shape,
            args.budget,
            levels=levels,
            include_own_switch=not args.no_own_switch,
            planner=args.planner,
            config=config,
            batches=batches,
            margin=args.margin,
            time_steps=args.steps,
            model_name=args.model,
            on_row=progress,
        )
    table = Table(
        title=(
            f"{args.model}: largest batch in {_fmt_bytes(result.budget_bytes)}, input "
            f"{tuple(result.input_shape)}, {result.device}"
        )
    )
    for column in ("", "largest batch", "predicted peak", "time / sample", "linear"):
        table.add_column(column, justify="right")
    table.add_column("note")
    best = result.best_level()
    for row in result.rows:
        error = "-" if row.linear_error is None else f"{row.linear_error:.2%} off"
        table.add_row(
            row.label + (" (best)" if row is best else ""),
            "-" if row.max_batch is None else str(row.max_batch),
            _fmt_bytes(row.predicted_peak),
            "-" if row.time_per_sample_s is None else f"{row.time_per_sample_s * 1000:.1f} ms",
            ("yes, " if row.linear else "NO, ") + error,
            row.note,
        )
    table.caption = (
        f"Predicted from steps at batches {', '.join(map(str, result.batches))} (bytes per "
        "operator are lines in the batch; 'linear' is how far the third batch's peak fell from "
        "the first two's line); times are medians of small batches."
    )
    console.print(table)
    console.print(result.explain())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
        console.print(f"wrote {args.json}")
    if args.plot:
        _plot_fit(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if best is not None else 1


def _cmd_derive(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..measure.models import output_loss
    from ..tune.derive import derive_preset

    model = _create_model(args, args.device)
    console = _console()
    shape = _input_shape(args, model, console)
    example = _input_for(shape, 2, args.device)
    with console.status(f"deriving levels for {args.model} at batch {args.batch_size}"):
        found = derive_preset(
            model,
            example,
            args.batch_size,
            loss_fn=output_loss,
            floor=not args.no_floor,
            compare=not args.no_compare,
        )
    table = Table(
        title=(
            f"{args.model}: derived levels at batch {found.batch_size}, input "
            f"{tuple(found.input_shape)}, {args.device}"
        )
    )
    rows = found.table()
    columns = ["level", "peak", "time (predicted)"]
    if found.floor:
        columns.append("x floor")
    if found.compared is not None:
        columns.append(f"bundled '{found.bundled}'")
    for column in columns:
        table.add_column(column, justify="right")
    table.add_column("plan")
    for row in rows:
        cells = [
            str(row["level"]),
            _fmt_bytes(row["peak"]),
            "-" if row["time"] is None else f"{row['time']:.2f}x",
        ]
        if found.floor:
            cells.append(f"{row['x_floor']:.2f}")
        if found.compared is not None:
            cells.append(_fmt_bytes(row.get("bundled")) if row["level"] else "-")
        table.add_row(*cells, row["plan"])
    table.caption = (
        "Peaks: live tensor bytes above the parameters, predicted for the batch from two small "
        "batches measured; times: the planner's prices of the same measurements."
        + (f" Physical floor: {_fmt_bytes(found.floor)}." if found.floor else "")
        + f" Derived in {found.seconds:.0f} s."
    )
    console.print(table)
    if args.out:
        Path(args.out).write_text(found.to_yaml())
        console.print(
            f"wrote {args.out}: use it with vision_ckpt.register_preset(name, {args.out!r}) and "
            "preset: name, or copy its rules into a config"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "levels": rows,
                    "floor": found.floor,
                    "seconds": found.seconds,
                    "batch_size": found.batch_size,
                },
                indent=2,
            )
        )
        console.print(f"wrote {args.json}")
    return 0


def _plot_fit(result: Any, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if r.max_batch is not None]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    labels = [r.label.replace("own switch ", "own switch\n") for r in rows]
    colors = ["tab:blue" if r.level is not None else "tab:orange" for r in rows]
    bars = ax.bar(range(len(rows)), [r.max_batch for r in rows], color=colors)
    ax.bar_label(bars, [str(r.max_batch) for r in rows], fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("largest batch that fits")
    ax.set_title(f"{result.model}: largest batch in {_fmt_bytes(result.budget_bytes)}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _config_data(config: Any) -> dict[str, Any]:
    """A config as plain data that ``CheckpointConfig.from_file`` reads back."""
    return config.model_dump(mode="json", exclude_defaults=True)


def _fmt_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


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
    p.set_defaults(run=_cmd_profile)

    p = sub.add_parser("plan", help="the modules a level checkpoints, as plan() reports them")
    _model_args(p, None)
    p.add_argument("--level", type=int, choices=range(6), default=3, help="training level")
    p.set_defaults(run=_cmd_plan)

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
    p.set_defaults(run=_cmd_suggest)


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
    p.add_argument("--steps", type=int, default=1, help="timed steps per batch (0: no timing)")
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
    p.set_defaults(run=_cmd_fit)

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
    p.set_defaults(run=_cmd_derive)


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
    except _UsageError as exc:
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
