"""The memory/time frontier: every training level against timm's switch and torch.compile's budget.

For each model (``pretrained=False``, synthetic 224 px data, CPU) at each batch size, in one
process, the same model and starting weights run a training step (forward, cross-entropy,
backward) under each variant:

- ``L0`` .. ``L5``: ``vision_ckpt.apply_preset(model, level)`` in the default nesting (``auto``);
  ``L1``-``L2`` are the selective levels of the conv families;
- ``L3all`` .. ``L5all`` (with ``--variants``): the same levels with nesting ``all``;
- ``timm``: timm's ``model.set_grad_checkpointing(True)``;
- ``compile``, ``compile@0.5``, ``compile@0.2`` (ViT-S, ResNet-50 and ConvNeXt-T only,
  ``--compile``): ``torch.compile(model)`` with ``torch._functorch.config.
  activation_memory_budget`` at 1.0, 0.5 and 0.2 (the budget is read when the backward graph is
  partitioned, at compile time);
- ``cL0`` .. ``cL5`` and ``ctimm`` (with ``--variants``): a level, or timm's switch, then
  ``torch.compile`` (inductor); a compiled level whose plan an earlier compiled one runs is left
  out.

Measured per variant:

- ``peak``: the peak of live tensor bytes during the step above what was alive before it
  (parameters and buffers), counted by ``vision_ckpt``'s storage tracker (deterministic). A
  compiled step runs kernels that tracker cannot see, so every variant is also measured with
  ``torch.profiler``'s memory events (``prof peak``: allocations minus frees in time order, the
  maximum of the running sum): that column compares eager and compiled variants on one meter;
- ``time``: the median over ``--reps`` rounds; the rounds interleave the variants (one step of
  each per round, in an order that rotates from round to round), and ``time/L0`` is the
  median of the per-round ratios to ``L0``, so machine load that changes between rounds
  cancels. ``--clock cpu`` times the process's CPU seconds instead of wall seconds: with
  ``--threads 1`` that is the step's own compute, which other work on a shared machine
  changes far less than it changes wall time (time spent waiting for a core is not counted).
  By default glibc hands every large freed block back to the kernel, so the next allocation
  faults its pages in and the kernel zeroes them; that work is counted in the process's CPU
  time and grows with the bytes a step allocates (on efficientnet_b0 at batch 32 it was over
  half of no checkpointing's step), so it moves the ratios in either direction.
  ``--allocator cached`` comes closer to a GPU's caching allocator: every block comes from
  glibc's heap, which is never trimmed, so freed memory stays in the process and the ratios
  are those of the step's own work (efficientnet_b0's level 0 at batch 32: 3.0 s against
  5.6-7.4 s);
- ``BN``: whether the BatchNorm running statistics after the first step equal ``L0``'s exactly.

The frontier is the set of variants no other variant beats on both peak (``prof peak``) and
time. The script prints the issue's targets, met or not, and writes ``results.json``,
``table.md`` and ``frontier.png`` to ``--out``.

Usage::

    python benchmarks/bench_frontier.py --threads 2 --reps 3                 # six models, batch 32
    python benchmarks/bench_frontier.py --models resnet50 --batch-sizes 8 --reps 2 --no-compile
    python benchmarks/bench_frontier.py --threads 1 --clock cpu --no-compile    # a shared CPU
    python benchmarks/bench_frontier.py --threads 1 --clock cpu --allocator cached --no-compile
    python benchmarks/bench_frontier.py --render out/results.json            # table + plot again
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import vision_ckpt
from vision_ckpt.measure import track_peak_memory

MODELS = (
    "vit_small_patch16_224",
    "swin_tiny_patch4_window7_224",
    "convnext_tiny",
    "resnet50",
    "densenet121",
    "efficientnet_b0",
)
COMPILE_MODELS = ("vit_small_patch16_224", "resnet50", "convnext_tiny")
LEVELS = ("L0", "L1", "L2", "L3", "L4", "L5")
COMPILE_VARIANTS = {"compile": 1.0, "compile@0.5": 0.5, "compile@0.2": 0.2}
MB = 1e6


@dataclass
class Row:
    model: str
    batch: int
    variant: str
    peak_mb: float | None
    """Storage-tracker peak above the start (None for compiled variants: not visible)."""
    prof_peak_mb: float
    """Profiler memory-event peak above the start."""
    time_s: float
    time_ratio: float
    """Median over rounds of this variant's step time / L0's in the same round."""
    times_s: list[float] = field(default_factory=list)
    bn_exact: bool | None = None
    regions: int = 0
    """Modules checkpointed (our variants), -1 for timm's switch, 0 otherwise."""
    same_as: str = ""
    """The lower level whose plan this level runs (the same regions and strategies), if any."""


def _bn_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    names = ("running_mean", "running_var", "num_batches_tracked")
    model = getattr(model, "_orig_mod", model)  # a compiled module's buffers, by their names
    return {n: b.clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in names}


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y).backward()


def _tracked_peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    for p in model.parameters():
        p.grad = None
    gc.collect()
    with track_peak_memory(model, x, y) as mem:
        F.cross_entropy(model(x), y).backward()
    return mem.peak_bytes - mem.start_bytes


def _profiler_peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    for p in model.parameters():
        p.grad = None
    gc.collect()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        F.cross_entropy(model(x), y).backward()
    _, live = live_bytes(prof.profiler.kineto_results.events())
    return max(live, default=0)


def live_bytes(events: Iterable[Any]) -> tuple[list[int], list[int]]:
    """From a profile's events, the times (ns) of the CPU allocator's allocation (+) and free
    (-) records, in time order, and the bytes live after each: the ``prof peak`` meter."""
    records = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    stamps, live, total = [], [], 0
    for e in records:
        total += e.nbytes()
        stamps.append(e.start_ns())
        live.append(total)
    return stamps, live


class _Variant:
    """One way to run the model's step: a callable module plus what to measure it with."""

    def __init__(
        self, name: str, module: nn.Module, regions: int, budget: float | None, same_as: str = ""
    ) -> None:
        self.name, self.module, self.regions, self.budget = name, module, regions, budget
        self.same_as = same_as

    def run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.budget is None:
            _step(self.module, x, y)
            return
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            _step(self.module, x, y)


def _plan_key(plan: vision_ckpt.CheckpointPlan, level: int, nesting: str) -> tuple:
    """What a level's plan does: its regions with their strategies, and its lean MLPs."""
    return (
        nesting,
        *((n, str(plan[n].rung_at(level))) for n in plan.checkpointed),
        *(e.name for e in plan.entries if e.lean_at(level)),  # lean MLPs, no regions
    )


def _top_row(model: str, by: dict[str, Row]) -> Row | None:
    """The level-5 row, or, where level 5 was not run, the measured level whose plan it is
    (the preset's level 5 is often a lower level's plan: a run may leave it out)."""
    if "L5" in by:
        return by["L5"]
    net = timm.create_model(model, pretrained=False, num_classes=1000)
    cfg = {"preset": "auto", "nesting": "auto"}
    top = _plan_key(vision_ckpt.plan(net, {**cfg, "training_checkpoint_level": 5}), 5, "auto")
    for v in reversed(LEVELS[:-1]):
        if v in by:
            level = int(v[1])
            plan = vision_ckpt.plan(net, {**cfg, "training_checkpoint_level": level})
            if _plan_key(plan, level, "auto") == top:
                return by[v]
    return None


def _make_variants(
    name: str, model: nn.Module, variants: list[str], compile_: bool
) -> list[_Variant]:
    out = []
    plans: dict[tuple, str] = {}  # a level's regions and strategies -> the first level with them
    for v in variants:
        m = copy.deepcopy(model)
        if v == "timm":
            m.set_grad_checkpointing(True)
            out.append(_Variant(v, m, -1, None))
        elif v.startswith("L"):
            level = int(v[1])
            nesting = "all" if v.endswith("all") else "auto"
            plan = vision_ckpt.apply_preset(m, level, nesting=nesting)
            same = plans.setdefault(_plan_key(plan, level, nesting), v)
            out.append(_Variant(v, m, len(plan.checkpointed), None, "" if same == v else same))
        elif v == "ctimm":
            m.set_grad_checkpointing(True)
            out.append(_Variant(v, torch.compile(m), -1, None))
        elif v.startswith("cL"):
            level = int(v[2])
            plan = vision_ckpt.apply_preset(m, level)
            key = ("compiled", *_plan_key(plan, level, "auto"))
            if key in plans:  # a compiled level whose plan an earlier one runs: not twice
                continue
            plans[key] = v
            out.append(_Variant(v, torch.compile(m), len(plan.checkpointed), None))
        else:
            raise SystemExit(
                f"unknown variant {v!r}; allowed: L0-L5, L3all-L5all, timm, cL0-cL5, ctimm"
            )
    if compile_ and name in COMPILE_MODELS:
        for v, budget in COMPILE_VARIANTS.items():
            m = torch.compile(copy.deepcopy(model), backend=_inductor_with_budget(budget))
            out.append(_Variant(v, m, 0, budget))
    return out


def _inductor_with_budget(budget: float):
    """An inductor backend that partitions the backward under ``budget``. One backend object
    per budget: dynamo guards on the backend, so copies of the same model class compiled for
    different budgets do not share a compiled graph (with parameters as graph inputs they
    would), and the AOT autograd cache is off so no earlier partition is reused."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        with torch._functorch.config.patch(
            activation_memory_budget=budget, enable_autograd_cache=False
        ):
            return compile_fx(gm, example_inputs)

    backend.__name__ = f"inductor_budget_{budget}"
    return backend


def bench_model(
    name: str,
    batch: int,
    reps: int,
    variants: list[str],
    compile_: bool,
    console: Console,
    clock: str = "wall",
) -> list[Row]:
    now = time.process_time if clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=1000).train()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, generator=gen)
    y = torch.randint(0, 1000, (batch,), generator=gen)
    runs = _make_variants(name, model, variants, compile_)
    console.print(f"[bold]{name}[/bold] batch {batch}: {', '.join(r.name for r in runs)}")
    reference: dict[str, torch.Tensor] | None = None
    rows: dict[str, Row] = {}
    for run in runs:  # first step (warm-up, compilation) from the same weights
        started = time.perf_counter()
        torch.manual_seed(1)
        run.run(x, y)
        bn = _bn_buffers(run.module)
        if reference is None:
            reference = bn
        exact = all(torch.equal(bn[k], reference[k]) for k in reference) if reference else None
        if run.budget is None:
            tracked: float | None = _tracked_peak(run.module, x, y) / MB
            profiled = _profiler_peak(run.module, x, y) / MB
        else:
            tracked = None
            with torch._functorch.config.patch(activation_memory_budget=run.budget):
                profiled = _profiler_peak(run.module, x, y) / MB
        rows[run.name] = Row(
            name, batch, run.name, tracked, profiled, 0.0, 0.0, [], exact, run.regions, run.same_as
        )
        console.print(
            f"  {run.name:>11}: peak {'-' if tracked is None else f'{tracked:8.1f}'} MB, "
            f"profiler {profiled:8.1f} MB, first step {time.perf_counter() - started:6.1f} s"
        )
    ratios: dict[str, list[float]] = {r.name: [] for r in runs}
    for round_ in range(reps):
        times = {}
        # the order rotates each round: on a shared CPU the later steps of a round ran slower
        shift = round_ * len(runs) // max(1, reps)
        for run in runs[shift:] + runs[:shift]:
            start = now()
            run.run(x, y)
            times[run.name] = now() - start
            rows[run.name].times_s.append(times[run.name])
        for run in runs:
            ratios[run.name].append(times[run.name] / times["L0"])
        console.print(
            f"  round {round_ + 1}/{reps}: "
            + ", ".join(f"{r.name} {times[r.name]:.2f}s" for r in runs)
        )
    for run in runs:
        row = rows[run.name]
        row.time_s = statistics.median(row.times_s)
        row.time_ratio = statistics.median(ratios[run.name])
    return list(rows.values())


def frontier(rows: list[Row]) -> set[str]:
    """Variants no other variant beats on both profiler peak and time (ties kept)."""
    on = set()
    for r in rows:
        beaten = any(
            o is not r
            and o.prof_peak_mb <= r.prof_peak_mb
            and o.time_ratio <= r.time_ratio
            and (o.prof_peak_mb < r.prof_peak_mb or o.time_ratio < r.time_ratio)
            for o in rows
        )
        if not beaten:
            on.add(r.variant)
    return on


def _by_model(rows: list[Row]) -> dict[tuple[str, int], dict[str, Row]]:
    out: dict[tuple[str, int], dict[str, Row]] = {}
    for r in rows:
        out.setdefault((r.model, r.batch), {})[r.variant] = r
    return out


def table(rows: list[Row]) -> list[str]:
    header = [
        "model",
        "batch",
        "variant",
        "peak MB",
        "prof peak MB",
        "peak/L0",
        "time/L0",
        "peak/timm",
        "BN exact",
        "frontier",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (model, batch), by in _by_model(rows).items():
        plain, t = by.get("L0"), by.get("timm")
        on = frontier(list(by.values()))
        for v, r in by.items():
            lines.append(
                "| "
                + " | ".join(
                    [
                        model,
                        str(batch),
                        v + (f" (= {r.same_as}" + ("" if r.times_s else ", not re-run") + ")")
                        if r.same_as
                        else v,
                        "-" if r.peak_mb is None else f"{r.peak_mb:.0f}",
                        f"{r.prof_peak_mb:.0f}",
                        f"{r.prof_peak_mb / plain.prof_peak_mb:.2f}" if plain else "",
                        f"{r.time_ratio:.2f}x",
                        f"{r.prof_peak_mb / t.prof_peak_mb:.2f}" if t else "",
                        "-" if r.bn_exact is None else ("yes" if r.bn_exact else "no"),
                        "yes" if v in on else "",
                    ]
                )
                + " |"
            )
    return lines


def targets(rows: list[Row]) -> list[str]:
    """The frontier issue's targets, per model (profiler peaks, time ratios to L0)."""
    out = []
    counts = {"cheap": 0, "beat_timm": 0, "top": 0, "monotone": 0}
    models = _by_model(rows)
    for (model, batch), by in models.items():
        plain, t = by["L0"], by.get("timm")
        ours = [by[v] for v in LEVELS if v in by]
        cheap = [
            r.variant
            for r in ours
            if r.prof_peak_mb <= 0.4 * plain.prof_peak_mb and r.time_ratio <= 1.12
        ]
        beat = (
            []
            if t is None
            else [
                r.variant
                for r in ours
                if r.time_ratio <= t.time_ratio * 1.03 and r.prof_peak_mb <= 0.85 * t.prof_peak_mb
            ]
        )
        top = _top_row(model, by)
        top_ok = (
            t is not None
            and top is not None
            and top.prof_peak_mb <= 0.7 * t.prof_peak_mb
            and top.time_ratio <= 1.7
        )
        steps = []
        for lo, hi in zip(ours, ours[1:], strict=False):
            lower = hi.prof_peak_mb <= 0.95 * lo.prof_peak_mb
            # a level that runs a lower level's plan costs what that plan costs (its measured
            # ratio differs by the machine's noise only)
            cheap_step = hi.time_ratio <= lo.time_ratio * 1.03 or bool(hi.same_as)
            never_higher = hi.prof_peak_mb <= lo.prof_peak_mb * 1.001
            steps.append((hi.variant, (lower or cheap_step) and never_higher))
        monotone = all(ok for _, ok in steps)
        counts["cheap"] += bool(cheap)
        counts["beat_timm"] += bool(beat)
        counts["top"] += top_ok
        counts["monotone"] += monotone
        top_text = (
            f"{top.prof_peak_mb / t.prof_peak_mb:.2f}x timm at {top.time_ratio:.2f}x"
            + ("" if top.variant == "L5" else f" (L5 = {top.variant}'s plan)")
            if t and top
            else "-"
        )
        out.append(
            f"{model} b{batch}: <=0.4x peak at <=1.12x time: {cheap or 'none'}; <=0.85x timm's "
            f"peak at <= its time: {beat or 'none'}; top {top_text} (<=0.7x, <=1.7x): "
            f"{'met' if top_ok else 'missed'}; levels each buy memory or cost <=3%: "
            f"{'met' if monotone else [v for v, ok in steps if not ok]}"
        )
    n = len(models)
    out.append(
        f"models with a <=0.4x/<=1.12x level: {counts['cheap']}/{n} (target 4 of 6); beating timm "
        f"by 15% at its time: {counts['beat_timm']}/{n} (4 of 6); top level target: "
        f"{counts['top']}/{n} (4 of 6); level steps: {counts['monotone']}/{n} (all)"
    )
    return out


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _by_model(rows)
    cols = min(3, len(models))
    fig_rows = (len(models) + cols - 1) // cols
    fig, axes = plt.subplots(fig_rows, cols, figsize=(5 * cols, 4 * fig_rows), squeeze=False)
    for ax, ((model, batch), by) in zip(axes.flat, models.items(), strict=False):
        on = frontier(list(by.values()))
        for v, r in by.items():
            kind = "o" if v.startswith("L") else ("s" if v == "timm" else "^")
            ax.scatter(
                r.time_ratio,
                r.prof_peak_mb,
                marker=kind,
                color="C0" if v in on else "0.6",
                zorder=3,
            )
            ax.annotate(
                v,
                (r.time_ratio, r.prof_peak_mb),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        front = sorted((by[v] for v in on), key=lambda r: r.time_ratio)
        ax.step(
            [r.time_ratio for r in front],
            [r.prof_peak_mb for r in front],
            where="post",
            color="C0",
            lw=1,
        )
        ax.set_title(f"{model}, batch {batch}", fontsize=9)
        ax.set_xlabel("step time / no checkpointing")
        ax.set_ylabel("peak MB (profiler)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# glibc's malloc settings that keep freed memory in the process: no block is mapped on its own
# (MALLOC_MMAP_MAX_=0; without it blocks over the largest mmap threshold, 32 MB, are mapped and
# zeroed afresh each time), the heap is never trimmed, and torch's CPU allocator asks for 2 MB
# pages. Read at process start, hence the re-execution.
_CACHED_ALLOCATOR = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_TOP_PAD_": str(1 << 30),
    "THP_MEM_ALLOC_ENABLE": "1",
}


def _with_allocator(allocator: str, argv: list[str] | None) -> str:
    """Run this script again under the ``cached`` allocator settings unless they are set; the
    settings in effect, for the results' environment line."""
    if allocator == "cached" and any(os.environ.get(k) != v for k, v in _CACHED_ALLOCATOR.items()):
        if argv is not None:
            raise SystemExit(
                "--allocator cached restarts the script with its settings, which a caller of "
                "main(argv) cannot; set them in the environment first: "
                + " ".join(f"{k}={v}" for k, v in _CACHED_ALLOCATOR.items())
            )
        os.execve(sys.executable, sys.orig_argv, {**os.environ, **_CACHED_ALLOCATOR})
    found = " ".join(f"{k}={os.environ[k]}" for k in _CACHED_ALLOCATOR if k in os.environ)
    return f"{allocator} allocator" + (f" ({found})" if found else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch-sizes", default="32")
    p.add_argument("--variants", default=",".join((*LEVELS, "timm")))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time wall seconds, or the process's CPU seconds (use with --threads 1)",
    )
    p.add_argument(
        "--allocator",
        choices=("system", "cached"),
        default="system",
        help="system: glibc's defaults; cached: keep freed memory in the process, as a GPU's "
        "caching allocator does (see the module docstring)",
    )
    p.add_argument("--out", default="frontier_out")
    p.add_argument("--render", help="results.json of an earlier run: print and plot it again")
    args = p.parse_args(argv)
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    allocator = "" if args.render else _with_allocator(args.allocator, argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        rows = [Row(**r) for r in data["rows"]]
        command = data["command"]
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        # every compiled variant is a recompilation of the same model class's code
        torch._dynamo.config.cache_size_limit = 64
        torch._dynamo.config.accumulated_cache_size_limit = 1024
        variants = args.variants.split(",")
        if "L0" not in variants:
            variants.insert(0, "L0")
        rows = []
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            for name in args.models.split(","):
                rows += bench_model(
                    name, batch, args.reps, variants, args.compile, console, args.clock
                )
                Path(out / "results.json").write_text(
                    json.dumps(
                        {
                            "command": "python " + shlex.join(sys.argv),
                            "environment": f"torch {torch.__version__}, timm {timm.__version__}, "
                            f"{platform.processor() or platform.machine()}, "
                            f"{torch.get_num_threads()} threads, {allocator}",
                            "rows": [asdict(r) for r in rows],
                        },
                        indent=1,
                    )
                )
        command = "python " + shlex.join(sys.argv)
    lines = table(rows)
    (out / "table.md").write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")
    plot(rows, out / "frontier.png")
    console.print("\n".join(lines))
    for line in targets(rows):
        console.print(line)
    console.print(f"wrote {out}/results.json, table.md, frontier.png; reproduce with: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
