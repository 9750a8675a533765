"""The per-block planner against uniform levels, at a batch where memory matters.

For each model (``pretrained=False``, synthetic 224 px data, the device given) at ``--batch``:

1. every uniform level 0-5 of the model's preset is measured: the step's peak (bytes of live
   tensor storage during forward + backward, parameters and gradients included: the meter the
   planner budgets with, deterministic on CPU) and its time;
2. budgets are set at 25/50/75% of the way from the lowest peak any level reaches to level 0's;
3. for each budget ``plan_for_budget`` plans from small batches (its wall time is reported,
   also in units of one small-batch step), and the plan is measured the same way;
4. times come from interleaved rounds (one step of every variant per round, ``--reps`` rounds),
   as medians of the per-round ratios to level 0, so load that changes between rounds cancels;
   ``--clock cpu`` times the rounds in the process's CPU seconds (with ``--threads 1``, the
   steps' own compute, which other work on a shared machine changes far less than wall time).

Reported per budget: the plan's measured peak (must fit), its time against the *lowest uniform
level that fits* (the issue's bar: at least 10% faster on two of three budgets), and the
planner's predictions against the measurements (peak within 5%, time within 15%). The time
is compared as a ratio to level 0's (the planner's predicted plan/level-0 time against the
measured one): the planner times its small steps in wall seconds, and a ratio is the same
figure under either ``--clock``.

Usage::

    python benchmarks/bench_planner.py --threads 2 --reps 3   # resnet18, vit_small, convnext_tiny
    python benchmarks/bench_planner.py --models resnet18 --batch 16 --reps 2
    python benchmarks/bench_planner.py --threads 1 --clock cpu --reps 3   # a shared CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import timm
import torch
from rich.console import Console
from torch import nn

import vision_ckpt
from vision_ckpt.measure import track_peak_memory
from vision_ckpt.tune.profiling import default_loss, plan_for_budget

MB = 2**20
SHARES = (0.25, 0.5, 0.75)


@dataclass
class Variant:
    name: str
    module: nn.Module
    peak: int = 0
    times: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)


@dataclass
class PlanRow:
    model: str
    batch: int
    share: float
    budget_mb: float
    fits: bool
    plan_peak_mb: float | None
    predicted_peak_mb: float | None
    peak_error: float | None
    plan_ratio: float | None
    predicted_ratio: float | None
    time_error: float | None
    """Predicted plan/level-0 time ratio over the measured one, minus 1."""
    uniform_level: int | None
    uniform_peak_mb: float | None
    uniform_ratio: float | None
    faster_by: float | None
    strategies: dict[str, int]
    planning_s: float
    measure_small_steps: float
    """Pricing the menus (and level 0's peak), in small-batch steps; the rest is the check."""


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    default_loss(model(x)).backward()


def _peak(model: nn.Module, x: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    with track_peak_memory(model, x) as mem:
        default_loss(model(x)).backward()
    model.zero_grad(set_to_none=True)
    return mem.peak_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _small_step_time(model: nn.Module, x: torch.Tensor) -> float:
    _step(model, x)
    times = []
    for _ in range(3):
        _sync(x.device)
        start = time.perf_counter()
        _step(model, x)
        _sync(x.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_model(
    name: str,
    batch: int,
    reps: int,
    device: torch.device,
    console: Console,
    clock: str = "wall",
) -> list[PlanRow]:
    now = time.process_time if clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).train().to(device)
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(device)
    small = x[: max(2, batch // 8)]
    variants: list[Variant] = []
    for level in range(6):
        m = copy.deepcopy(model)
        vision_ckpt.apply_preset(m, level)
        variants.append(Variant(f"L{level}", m))
    for v in variants:
        _step(v.module, x)  # warm-up
        v.peak = _peak(v.module, x)
        console.print(f"  {name} {v.name}: peak {v.peak / MB:8.1f} MB")
    peaks = {int(v.name[1]): v.peak for v in variants}
    lowest, top = min(peaks.values()), peaks[0]
    small_step = _small_step_time(model, x[: max(3, batch // 4)])

    plans = []
    for share in SHARES:
        budget = int(lowest + share * (top - lowest))
        started = time.perf_counter()
        result = plan_for_budget(model, small, budget, batch_size=batch)
        spent = time.perf_counter() - started
        console.print(
            f"  {name} {share:.0%}: budget {budget / MB:.1f} MB, planned in {spent:.1f} s "
            f"({spent / small_step:.1f} small steps): {result.explain()}"
        )
        variant = None
        if result.config is not None:
            m = copy.deepcopy(model)
            vision_ckpt.apply(m, result.config)
            variant = Variant(f"plan@{share:.0%}", m)
            _step(m, x)
            variant.peak = _peak(m, x)
            variants.append(variant)
        plans.append((share, budget, result, variant, spent))

    for round_ in range(reps):
        times = {}
        # the order rotates each round: on a shared CPU the later steps of a round ran slower
        # (one plan measured 1.2x at the start of a round and 1.8x at its end)
        shift = round_ * len(variants) // max(1, reps)
        for v in variants[shift:] + variants[:shift]:
            _sync(device)
            start = now()
            _step(v.module, x)
            _sync(device)
            times[v.name] = now() - start
            v.times.append(times[v.name])
        for v in variants:
            v.ratios.append(times[v.name] / times["L0"])
        console.print(
            f"  round {round_ + 1}/{reps}: "
            + ", ".join(f"{v.name} {times[v.name]:.2f}s" for v in variants)
        )
    ratio = {v.name: statistics.median(v.ratios) for v in variants}
    base_time = statistics.median(variants[0].times)

    rows = []
    for share, budget, result, variant, spent in plans:
        fitting = [lv for lv in range(6) if peaks[lv] <= budget]
        uniform = min(fitting) if fitting else None
        counts: dict[str, int] = {}
        for s in result.strategies.values():
            counts[s] = counts.get(s, 0) + 1
        plan_ratio = ratio[variant.name] if variant else None
        predicted_ratio = (
            result.predicted_time / result.base_time
            if result.predicted_time and result.base_time
            else None
        )
        rows.append(
            PlanRow(
                model=name,
                batch=batch,
                share=share,
                budget_mb=budget / MB,
                fits=bool(variant and variant.peak <= budget),
                plan_peak_mb=variant.peak / MB if variant else None,
                predicted_peak_mb=result.measurement.peak / MB if variant else None,
                peak_error=(result.measurement.peak - variant.peak) / variant.peak
                if variant
                else None,
                plan_ratio=plan_ratio,
                predicted_ratio=predicted_ratio,
                time_error=_ratio_error(predicted_ratio, plan_ratio),
                uniform_level=uniform,
                uniform_peak_mb=peaks[uniform] / MB if uniform is not None else None,
                uniform_ratio=ratio[f"L{uniform}"] if uniform is not None else None,
                faster_by=(
                    1 - plan_ratio / ratio[f"L{uniform}"]
                    if plan_ratio is not None and uniform is not None
                    else None
                ),
                strategies=counts,
                planning_s=spent,
                measure_small_steps=result.measure_seconds / small_step,
            )
        )
    console.print(f"  {name}: level 0 step {base_time:.2f} s; ratios " + str(ratio))
    return rows


def _ratio_error(predicted: float | None, measured: float | None) -> float | None:
    """The predicted plan/level-0 time ratio over the measured one, minus 1."""
    return None if predicted is None or measured is None else predicted / measured - 1


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0%}"


def table(rows: list[PlanRow]) -> list[str]:
    lines = [
        "| model | budget | plan peak (pred.) | fits | plan time/L0 (pred.) | lowest fitting "
        "level: peak, time/L0 | plan faster by | blocks | planning |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = (
            f"{r.plan_peak_mb:.0f} MB ({_pct(r.peak_error)})" if r.plan_peak_mb is not None else "-"
        )
        time_ = f"{r.plan_ratio:.2f}x ({_pct(r.time_error)})" if r.plan_ratio is not None else "-"
        uniform = (
            f"L{r.uniform_level}: {r.uniform_peak_mb:.0f} MB, {r.uniform_ratio:.2f}x"
            if r.uniform_level is not None
            else "none"
        )
        blocks = ", ".join(f"{n} {s}" for s, n in r.strategies.items())
        lines.append(
            f"| {r.model} b{r.batch} | {r.share:.0%}: {r.budget_mb:.0f} MB | {peak} | "
            f"{'yes' if r.fits else 'NO'} | {time_} | {uniform} | {_pct(r.faster_by)} | "
            f"{blocks} | {r.planning_s:.0f} s; pricing {r.measure_small_steps:.1f} small steps |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,vit_small_patch16_224,convnext_tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/planner_b32")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time the rounds in wall seconds, or the process's CPU seconds (use --threads 1)",
    )
    parser.add_argument(
        "--render",
        default=None,
        help="results.json of an earlier run: tabulate it again (time error from its ratios)",
    )
    args = parser.parse_args(argv)
    console = Console()
    if args.render:
        rows = [PlanRow(**r) for r in json.loads(Path(args.render).read_text())]
        for r in rows:  # runs stored before the error was a ratio's
            r.time_error = _ratio_error(r.predicted_ratio, r.plan_ratio)
        out = Path(args.render).parent
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = []
        for name in args.models.split(","):
            rows += bench_model(
                name, args.batch, args.reps, torch.device(args.device), console, args.clock
            )
        out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    lines = table(rows)
    note: list[str] = []  # a rendered table keeps the lines above the old one (its command)
    if args.render and (out / "table.md").exists():
        old = (out / "table.md").read_text().splitlines()
        note = old[: next((i for i, x in enumerate(old) if x.startswith("| model")), 0)]
    (out / "table.md").write_text("\n".join(note + lines) + "\n")
    console.print("\n".join(lines))
    for name in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == name]
        good = sum(r.fits and (r.faster_by or 0) >= 0.10 for r in mine)
        console.print(f"{name}: {good}/{len(mine)} budgets fit and beat the uniform level by 10%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
