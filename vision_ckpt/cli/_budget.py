"""The budget subcommands: ``fit`` (the largest batch per level) and ``derive`` (levels for
any model), with their tables and plots.

Owns what each prints and writes: the largest batch that fits a budget at each level and own
switch, as a table, JSON and a bar chart; and the derived levels as a table, JSON and the
preset file. The model, input and config come from ``_inputs``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ._inputs import (
    UsageError,
    create_model,
    fmt_bytes,
    input_for,
    input_shape,
    level_range,
    load_config,
    make_console,
    resolved_config,
    working,
)

__all__ = ["cmd_fit", "cmd_derive"]


def cmd_fit(args: argparse.Namespace) -> int:
    from ..tune.fit import max_batch

    levels = level_range(args.levels)
    config = load_config(args.config)
    try:
        batches = tuple(int(v) for v in args.batches.split(","))
    except ValueError:
        raise UsageError(
            f"--batches {args.batches!r} is not a list of batch sizes; write e.g. '2,3,4'"
        ) from None
    model = create_model(args, args.device)
    console = make_console()
    shape = input_shape(args, model, console)
    # derived for eight times the largest batch measured: its two small batches are then
    # a quarter and an eighth of it, as for any derivation
    config = resolved_config(config, model, shape, 8 * max(batches), args, console)
    with working(console, args, f"measuring {args.model} at batches {args.batches}") as say:
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
            time_steps=args.steps if args.time == "measured" else int(args.steps > 0),
            clock=args.time,
            model_name=args.model,
            on_progress=lambda now: say(f"{args.model}: {now}"),
        )
    console.print(_fit_table(result, args.model))
    console.print(result.explain())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
        console.print(f"wrote {args.json}")
    if args.plot:
        _plot_fit(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if result.best_level() is not None else 1


def _fit_table(result: Any, model: str) -> Any:
    """The rows of a :class:`~vision_ckpt.tune.fit.FitResult` as a rich table."""
    from rich.table import Table

    table = Table(
        title=(
            f"{model}: largest batch in {fmt_bytes(result.budget_bytes)}, input "
            f"{tuple(result.input_shape)}, {result.device}"
        )
    )
    for column in (
        "",
        "largest batch",
        "predicted peak",
        f"{result.clock} time / sample",
        "linear",
    ):
        table.add_column(column, justify="right")
    table.add_column("note")
    best = result.best_level()
    for row in result.rows:
        error = "-" if row.linear_error is None else f"{row.linear_error:.2%} off"
        step = row.measurement
        per_sample = step.seconds_per_sample if step is not None else None
        table.add_row(
            row.label + (" (best)" if row is best else ""),
            "-" if row.max_batch is None else str(row.max_batch),
            fmt_bytes(step.peak if step is not None else None),
            "-" if per_sample is None else f"{per_sample * 1000:.1f} ms",
            ("yes, " if row.linear else "NO, ") + error,
            row.note,
        )
    table.caption = (
        f"Predicted from steps at batches {', '.join(map(str, result.batches))} (bytes per "
        "operator are lines in the batch; 'linear' is how far the third batch's peak fell from "
        "the first two's line); "
        + (
            "times are priced from each operator's FLOPs and bytes at fixed rates, not timed: "
            "they rank the levels, their scale is approximate."
            if result.clock == "modelled"
            else "times are medians of real steps at the small batches, which a busy machine "
            "can reorder."
        )
    )
    return table


def cmd_derive(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..measure.models import output_loss
    from ..tune.derive import derive_preset

    model = create_model(args, args.device)
    console = make_console()
    shape = input_shape(args, model, console)
    example = input_for(shape, 2, args.device)
    with working(console, args, f"deriving levels for {args.model} at batch {args.batch_size}"):
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
            fmt_bytes(row["peak"]),
            "-" if row["time"] is None else f"{row['time']:.2f}x",
        ]
        if found.floor:
            cells.append(f"{row['x_floor']:.2f}")
        if found.compared is not None:
            cells.append(fmt_bytes(row.get("bundled")) if row["level"] else "-")
        table.add_row(*cells, row["plan"])
    table.caption = (
        "Peaks: live tensor bytes above the parameters, predicted for the batch from two small "
        "batches measured; times: the planner's prices of the same measurements."
        + (f" Physical floor: {fmt_bytes(found.floor)}." if found.floor else "")
        + f" Derived in {found.seconds:.0f} s."
    )
    console.print(table)
    if args.out:
        Path(args.out).write_text(found.to_yaml())
        console.print(
            f"wrote {args.out}: use it with vision_ckpt.config.presets.register_preset(name, "
            f"{args.out!r}) and preset: name, or copy its rules into a config"
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
    ax.set_title(f"{result.model}: largest batch in {fmt_bytes(result.budget_bytes)}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
