"""The measuring subcommands: ``profile``, ``plan`` and ``suggest``, with their tables and plots.

Owns what each prints and writes: the profile of every level (and, on request, the planner's
frontier and the physical floor), the plan a level makes, and the lowest level and fastest
per-block plan for a budget, as rich tables, JSON, a YAML config or a PNG plot. The model,
input and config come from ``_inputs``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from ._inputs import (
    config_data,
    create_model,
    fmt_bytes,
    fmt_seconds,
    input_for,
    input_shape,
    level_range,
    load_config,
    make_console,
    resolved_config,
    shows_progress,
    working,
)

__all__ = ["cmd_profile", "cmd_plan", "cmd_suggest"]


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
        step = e.measurement
        if e.skipped is not None or step is None:
            row = [str(e.level), str(e.regions), e.skipped or "", "", "", "", "", ""]
        else:
            row = [
                str(e.level),
                str(e.regions),
                fmt_bytes(step.peak),
                fmt_bytes(e.activation_bytes),
                fmt_bytes(e.saved_bytes),
                "-" if e.saving is None else f"{e.saving:.1%}",
                "-" if step.seconds is None else f"{step.seconds * 1000:.0f} ms",
                "-" if e.time_ratio is None else f"{e.time_ratio:.2f}x",
            ]
        if has_cuda:
            row += [fmt_bytes(e.cuda_peak_bytes), fmt_bytes(e.cuda_reserved_bytes)]
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
        f"L{e.level} {e.measurement.peak / floor.floor_bytes:.2f}x"
        for e in result.levels
        if e.skipped is None and e.measurement is not None and e.measurement.peak
    )
    return (
        f"physical floor {fmt_bytes(floor.floor_bytes)} (no region plan peaks lower: "
        f"{floor.operator} in {floor.phase} beside the parameter gradients); peaks over it: "
        f"{above}"
    )


def _plot(result: Any, path: str, planned: list[dict[str, Any]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [e for e in result.levels if e.skipped is None and e.measurement is not None]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    xs = [e.time_ratio or 1.0 for e in points]
    ys = [e.measurement.peak / 2**20 for e in points]
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


def cmd_profile(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from ..tune.profiling import profile

    levels = level_range(args.levels)
    config = load_config(args.config)
    from ..measure.models import output_loss

    model = create_model(args, args.device)
    console = make_console()
    shape = input_shape(args, model, console)
    config = resolved_config(config, model, shape, args.batch_size, args, console)
    x = input_for(shape, args.batch_size, args.device)
    quiet = not shows_progress(console, args)
    with Progress(console=console, transient=True, disable=quiet) as progress:
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

        with working(console, args, f"measuring the physical floor of {args.model}"):
            floor = physical_floor(model, x, output_loss)
        console.print(_floor_line(floor, result))
    planned: list[dict[str, Any]] = []
    if args.frontier:
        from ..tune.profiling import planner_frontier

        with working(console, args, f"pricing the blocks of {args.model} for the planner"):
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
            fmt_bytes(point["budget"]),
            fmt_bytes(point["peak"]),
            "-" if ratio is None else f"{ratio:.2f}x",
            ", ".join(f"{n} {s}" for s, n in point["strategies"].items()),
        )
    table.caption = (
        "The planner's choice at each budget, predicted from one measurement of every block's "
        "strategies (not measured); time relative to no checkpointing."
    )
    return table


def cmd_plan(args: argparse.Namespace) -> int:
    from ..config.schema import CheckpointConfig
    from ..regions.apply import plan as make_plan
    from ..runtime.wrapper import training_level

    config = load_config(args.config) or CheckpointConfig(preset="auto")
    model = create_model(args, "cpu")
    with training_level(args.level):
        plan = make_plan(model, config.model_copy(update={"training_checkpoint_level": None}))
        make_console().print(str(plan))
    return 0


def cmd_suggest(args: argparse.Namespace) -> int:
    from ..measure.models import output_loss
    from ..tune.profiling import plan_for_budget, suggest_level

    config = load_config(args.config)
    model = create_model(args, args.device)
    console = make_console()
    small = max(2, args.batch_size // 4)
    shape = input_shape(args, model, console)
    config = resolved_config(config, model, shape, args.batch_size, args, console)
    x = input_for(shape, small, args.device)
    # suggest_level and plan_for_budget answer the same question: one set of arguments
    question: dict[str, Any] = {
        "batch_size": args.batch_size,
        "config": config,
        "margin": args.margin,
        "loss_fn": output_loss,
    }
    with working(console, args, f"measuring {args.model} at each level"):
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
    for level, predicted in suggestion.predicted.items():
        fits = predicted.peak * (1 + suggestion.margin) <= suggestion.budget_bytes
        table.add_row(str(level), fmt_bytes(predicted.peak), "yes" if fits else "no")
    console.print(table)
    console.print(suggestion.explain())
    report: dict[str, Any] = {"uniform": {"level": suggestion.level, "meter": suggestion.meter}}
    if suggestion.check is not None:  # on CUDA: the real step that confirmed the level
        report["uniform"]["check"] = dataclasses.asdict(suggestion.check)
    if args.uniform_only:
        return 0 if suggestion.fits else 1

    with working(console, args, f"planning {args.model} block by block"):
        result = plan_for_budget(model, x, args.budget, **question)
    console.print(_plan_table(result, args.batch_size))
    console.print(result.explain())
    planned = _plan_report(result)
    report["uniform"].update(planned.pop("uniform"))
    report.update(planned)
    if args.out and result.config is not None:
        import yaml

        Path(args.out).write_text(yaml.safe_dump(config_data(result.config), sort_keys=False))
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
    plan_table = Table(title=f"fastest for {fmt_bytes(result.budget_bytes)} at batch {batch_size}")
    for column in ("", "predicted peak", "step time", "checkpointed", "answer"):
        plan_table.add_column(column, justify="right")
    if fastest is not None:
        level = result.uniform[fastest]
        plan_table.add_row(
            f"level {fastest} (fastest uniform level that fits)",
            fmt_bytes(level.peak),
            fmt_seconds(level.seconds),
            "every block of the level",
            "yes" if result.uniform_level == fastest else "",
        )
    if per_block is not None and per_block.config is not None:
        counts: dict[str, int] = {}
        for strategy in per_block.strategies.values():
            counts[strategy] = counts.get(strategy, 0) + 1
        plan_table.add_row(
            "per-block plan",
            fmt_bytes(per_block.measurement.peak),
            fmt_seconds(per_block.measurement.seconds),
            ", ".join(f"{n} {s}" for s, n in counts.items()),
            "yes" if result.uniform_level is None else "",
        )
    plan_table.add_row("no checkpointing", "", fmt_seconds(result.base_time), "", "")
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
            "levels": {
                str(k): {**dataclasses.asdict(v), "fits": v.seconds is not None}
                for k, v in result.uniform.items()
            },
        },
        "plan": {
            "fits": result.config is not None,
            "uniform_level": result.uniform_level,
            "measurement": dataclasses.asdict(result.measurement),
            "predicted_time_s": result.predicted_time,
            "base_time_s": result.base_time,
            "strategies": result.strategies,
            "seconds": result.seconds,
            "config": None if result.config is None else config_data(result.config),
        },
    }
    if per_block is not None and per_block is not result:
        report["plan"]["per_block"] = {
            "measurement": dataclasses.asdict(per_block.measurement),
            "strategies": per_block.strategies,
        }
    return report
