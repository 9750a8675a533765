"""Issue 5's benchmark: budget predictions against measurement, and the per-block planner
against uniform levels.

1. Prediction: for each model, ``suggest_level`` extrapolates every level's step peak at the
   target batch from small batches; the same levels are then measured at the target batch.
2. Planner: budget = halfway between level 0's step peak and the smallest peak of any level.
   The lowest uniform level that fits it is compared with ``plan_for_budget``'s block set:
   measured peak (must fit) and median step time, side by side in one process, interleaved.

Memory is counted in bytes of live tensor storage (deterministic); times are medians.

    python benchmarks/bench_profile.py                      # resnet18, vit_small, convnext_tiny
    python benchmarks/bench_profile.py --quick              # tiny inputs, a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import timm
import torch
from rich.console import Console
from rich.table import Table

import vision_ckpt
from vision_ckpt.measure import format_bytes
from vision_ckpt.measure._measure import Workload, batch_of, default_loss, measure_memory


def measured_peak(model: torch.nn.Module, x: torch.Tensor, config, level: int) -> int:
    vision_ckpt.apply(model, config.model_copy(update={"training_checkpoint_level": None}))
    try:
        with vision_ckpt.training_level(level):
            return measure_memory(Workload(model, x), x)[0]
    finally:
        vision_ckpt.remove(model)


def step_time(model: torch.nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    default_loss(model(x)).backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,vit_small_patch16_224,convnext_tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--levels", default="0,1,2,3,4,5")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--quick", action="store_true", help="64 px, batch 8, 1 rep")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.img_size, args.batch_size, args.reps = 64, 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(v) for v in args.levels.split(",")]
    console = Console(width=160)
    console.print(f"command: python benchmarks/bench_profile.py {' '.join(sys.argv[1:])}")
    config = vision_ckpt.CheckpointConfig(preset="auto")

    prediction = Table(title=f"predicted vs measured step peak at batch {args.batch_size}")
    for col in ("model", "level", "points (batch: peak)", "predicted", "measured", "error"):
        prediction.add_column(col, justify="right")
    planner = Table(title="per-block plan vs the lowest uniform level fitting a midpoint budget")
    for col in (
        "model",
        "budget",
        "uniform level",
        "its peak",
        "its step",
        "plan blocks",
        "plan peak",
        "plan step",
        "plan/uniform time",
    ):
        planner.add_column(col, justify="right")

    for name in args.models.split(","):
        torch.manual_seed(0)
        kwargs = {"img_size": args.img_size} if "vit" in name or "swin" in name else {}
        model = timm.create_model(name, pretrained=False, **kwargs)
        example = torch.randn(2, 3, args.img_size, args.img_size)
        target = batch_of(example, args.batch_size)

        suggestion = vision_ckpt.tune.suggest_level(
            model, example, "1TiB", batch_size=args.batch_size, levels=levels
        )
        measured = {lv: measured_peak(model, target, config, lv) for lv in levels}
        for lv in levels:
            predicted = suggestion.predicted[lv].peak
            steps = suggestion.measured[lv]
            points = ", ".join(f"{m.batch}: {format_bytes(m.peak)}" for m in steps)
            prediction.add_row(
                name,
                str(lv),
                points,
                format_bytes(predicted),
                format_bytes(measured[lv]),
                f"{(predicted - measured[lv]) / measured[lv]:+.1%}",
            )

        budget = (measured[0] + min(measured.values())) // 2
        uniform = min(lv for lv in levels if measured[lv] <= budget)
        plan = vision_ckpt.tune.plan_for_budget(
            model, example, budget, batch_size=args.batch_size, margin=0.0
        )
        if plan.config is None:
            planner.add_row(name, format_bytes(budget), str(uniform), "", "", "no plan fits")
            continue
        plan_peak = None
        times: dict[str, list[float]] = {"uniform": [], "plan": []}
        uniform_cfg = config.model_copy(update={"training_checkpoint_level": uniform})
        for rep in range(args.reps + 1):  # first round is a warm-up
            for variant in ("uniform", "plan") if rep % 2 == 0 else ("plan", "uniform"):
                cfg = uniform_cfg if variant == "uniform" else plan.config
                vision_ckpt.apply(model, cfg)
                try:
                    if variant == "plan" and plan_peak is None:
                        plan_peak = measure_memory(Workload(model, target), target)[0]
                    elapsed = step_time(model, target)
                finally:
                    vision_ckpt.remove(model)
                if rep:
                    times[variant].append(elapsed)
        t_uniform, t_plan = statistics.median(times["uniform"]), statistics.median(times["plan"])
        planner.add_row(
            name,
            format_bytes(budget),
            str(uniform),
            format_bytes(measured[uniform]),
            f"{t_uniform:.2f} s",
            f"{len(plan.blocks)}/{len(plan.candidates)}",
            format_bytes(plan_peak),
            f"{t_plan:.2f} s",
            f"{t_plan / t_uniform:.2f}x",
        )
        console.print(f"{name}: plan checkpoints {', '.join(plan.blocks)}")

    console.print(prediction)
    console.print(planner)
    return 0


if __name__ == "__main__":
    sys.exit(main())
