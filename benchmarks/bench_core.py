"""Benchmark of the bundled checkpoint core against torch's, side by side in one process.

Two measurements, every variant interleaved with the others in each repetition (the order
rotates), medians over repetitions:

(a) per-call overhead: a chain of 200 tiny ``Linear(64, 64) + GELU`` blocks on a 4x64 input,
    forward + backward, with every block checkpointed; the overhead is
    ``(time checkpointed - time plain) / 200`` in microseconds per checkpoint call.
(b) a training step (forward, cross-entropy, backward, SGD step) of timm models built with
    ``pretrained=False`` on synthetic data, every block checkpointed (ViT: each of
    ``model.blocks``; ResNet: each Bottleneck of ``layer1..layer4``). Reported: the median step
    time, its ratio to torch's non-reentrant checkpoint, and memory from
    ``vision_ckpt.measure``: bytes packed for backward during the forward, live bytes kept
    from the end of the forward to backward, and the activation peak of the whole step.

Variants: ``none`` (no checkpointing), ``ours`` (``vision_ckpt.checkpoint``), ``torch``
(``torch.utils.checkpoint.checkpoint(use_reentrant=False)``) and ``torch-reentrant`` (the
reentrant variant, as a reference).

Targets (issue 2): per-call overhead <= 0.6x torch's non-reentrant, step-time ratio
ours/torch <= 1.00, saved bytes equal or lower.

Usage::

    python benchmarks/bench_core.py            # full run, a few minutes on 2 CPU cores
    python benchmarks/bench_core.py --quick    # a short sanity run (smaller batch, fewer reps)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import timm
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_ckpt
from rich.console import Console
from rich.table import Table
from torch import nn

import vision_ckpt
from vision_ckpt.measure import count_saved_bytes, format_bytes, track_peak_memory

CheckpointFn = Callable[..., Any]

VARIANTS: dict[str, CheckpointFn | None] = {
    "none": None,
    "ours": vision_ckpt.checkpoint,
    "torch": functools.partial(torch_ckpt.checkpoint, use_reentrant=False),
    "torch-reentrant": functools.partial(torch_ckpt.checkpoint, use_reentrant=True),
}
CKPT_VARIANTS = [name for name, fn in VARIANTS.items() if fn is not None]

console = Console(width=None if sys.stdout.isatty() else 160)


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """Runs ``inner`` through whichever checkpoint function ``switch`` currently holds."""

    def __init__(self, inner: nn.Module, switch: dict[str, CheckpointFn | None]) -> None:
        super().__init__()
        self.inner = inner
        self.switch = switch

    def forward(self, *args: Any) -> Any:
        fn = self.switch["fn"]
        if fn is None:
            return self.inner(*args)
        return fn(self.inner, *args)


def interleaved_medians(
    runs: dict[str, Callable[[], float]], reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Call every ``runs[name]()`` once per repetition, rotating the order; collect the times."""
    names = list(runs)
    for _ in range(warmup):
        for name in names:
            runs[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            gc.collect()
            times[name].append(runs[name]())
    return times


# --------------------------------------------------------------------------------------------
# (a) per-call overhead
# --------------------------------------------------------------------------------------------


@dataclass
class OverheadResult:
    blocks: int
    reps: int
    inner: int
    chain_ms: dict[str, float] = field(default_factory=dict)
    """Median forward+backward time of the whole chain, per variant, in milliseconds."""
    us_per_call: dict[str, float] = field(default_factory=dict)
    """Median overhead per checkpoint call over the plain chain, in microseconds."""


def bench_overhead(reps: int, inner: int, n_blocks: int = 200) -> OverheadResult:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(n_blocks)]
    x = torch.randn(4, 64, requires_grad=True)

    def make_run(fn: CheckpointFn | None) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(inner):
                h = x
                if fn is None:
                    for b in blocks:
                        h = b(h)
                else:
                    for b in blocks:
                        h = fn(b, h)
                h.sum().backward()
            return (time.perf_counter() - start) / inner

        return run

    times = interleaved_medians({n: make_run(f) for n, f in VARIANTS.items()}, reps, warmup=2)
    result = OverheadResult(blocks=n_blocks, reps=reps, inner=inner)
    for name, ts in times.items():
        result.chain_ms[name] = statistics.median(ts) * 1e3
        if name != "none":
            # median of per-repetition differences: each difference pairs runs that were close
            diffs = [(t - p) / n_blocks * 1e6 for t, p in zip(ts, times["none"], strict=True)]
            result.us_per_call[name] = statistics.median(diffs)
    return result


# --------------------------------------------------------------------------------------------
# (b) training step of timm models
# --------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    model: str
    batch_size: int
    img_size: int
    regions: int
    reps: int
    step_s: dict[str, float] = field(default_factory=dict)
    """Median step time per variant, in seconds."""
    saved_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes packed for backward during the forward (count_saved_bytes)."""
    kept_bytes: dict[str, int] = field(default_factory=dict)
    """Live bytes created by the forward and still alive when backward starts."""
    activation_bytes: dict[str, int] = field(default_factory=dict)
    """Peak of the step minus the bytes live before it (params, grads)."""
    losses_equal: bool = True
    """Whether the first-step loss of every variant equals the un-checkpointed one exactly."""


def wrap_blocks(model: nn.Module, name: str, switch: dict[str, CheckpointFn | None]) -> int:
    """Wrap every block of ``model`` in :class:`Checkpointed`; return how many were wrapped."""
    if hasattr(model, "blocks"):  # ViT family
        containers = [model.blocks]
    elif hasattr(model, "layer1"):  # ResNet family
        containers = [getattr(model, f"layer{i}") for i in range(1, 5)]
    else:
        raise SystemExit(f"bench_core: do not know the blocks of {name!r} (no .blocks, .layer1)")
    count = 0
    for container in containers:
        for i in range(len(container)):
            container[i] = Checkpointed(container[i], switch)
            count += 1
    return count


def bench_model(name: str, batch_size: int, img_size: int, reps: int) -> StepResult:
    torch.manual_seed(0)
    kwargs = {"img_size": img_size} if "vit" in name else {}
    model = timm.create_model(name, pretrained=False, num_classes=100, **kwargs)
    model.train()
    switch: dict[str, CheckpointFn | None] = {"fn": None}
    regions = wrap_blocks(model, name, switch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch_size, 3, img_size, img_size)
    y = torch.randint(0, 100, (batch_size,))
    result = StepResult(name, batch_size, img_size, regions, reps)

    # Memory and exactness first: every variant from the same weights and BN statistics.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    first_loss: dict[str, float] = {}
    for variant, fn in VARIANTS.items():
        model.load_state_dict(state)
        switch["fn"] = fn
        model.zero_grad(set_to_none=True)
        with track_peak_memory(model) as mem:
            with count_saved_bytes() as saved:
                loss = F.cross_entropy(model(x), y)
            result.kept_bytes[variant] = mem.end_bytes - mem.start_bytes
            loss.backward()
        result.saved_bytes[variant] = saved.nbytes
        result.activation_bytes[variant] = mem.activation_bytes
        first_loss[variant] = loss.item()
    result.losses_equal = len(set(first_loss.values())) == 1
    model.load_state_dict(state)

    def make_run(fn: CheckpointFn | None) -> Callable[[], float]:
        def run() -> float:
            switch["fn"] = fn
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            return time.perf_counter() - start

        return run

    times = interleaved_medians({n: make_run(f) for n, f in VARIANTS.items()}, reps, warmup=1)
    result.step_s = {n: statistics.median(ts) for n, ts in times.items()}
    return result


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "[green]met[/green]" if ok else "[red]missed[/red]"


def report(overhead: OverheadResult | None, steps: list[StepResult]) -> None:
    if overhead is not None:
        table = Table(
            title=f"(a) per-call overhead: {overhead.blocks} x (Linear(64,64)+GELU), 4x64 input, "
            f"fwd+bwd, median of {overhead.reps} reps x {overhead.inner}"
        )
        table.add_column("variant")
        table.add_column("chain fwd+bwd", justify="right")
        table.add_column("overhead / call", justify="right")
        table.add_column("vs torch", justify="right")
        torch_us = overhead.us_per_call["torch"]
        for name, ms in overhead.chain_ms.items():
            us = overhead.us_per_call.get(name)
            table.add_row(
                name,
                f"{ms:.2f} ms",
                "-" if us is None else f"{us:.1f} us",
                "-" if us is None else f"{us / torch_us:.2f}x",
            )
        console.print(table)

    if steps:
        table = Table(title="(b) training step, every block checkpointed (median step time)")
        for col in ("model", "variant", "step", "ours/torch", "vs none", "saved (hooks)"):
            table.add_column(col, justify="left" if col in ("model", "variant") else "right")
        table.add_column("kept fwd->bwd", justify="right")
        table.add_column("step activations", justify="right")
        for r in steps:
            label = f"{r.model}\nbatch {r.batch_size}, {r.img_size}px\n{r.regions} regions"
            for i, variant in enumerate(VARIANTS):
                t = r.step_s[variant]
                table.add_row(
                    label if i == 0 else "",
                    variant,
                    f"{t:.3f} s",
                    f"{t / r.step_s['torch']:.3f}" if variant == "ours" else "",
                    f"{t / r.step_s['none']:.2f}x",
                    format_bytes(r.saved_bytes[variant]),
                    format_bytes(r.kept_bytes[variant]),
                    format_bytes(r.activation_bytes[variant]),
                )
            table.add_section()
        console.print(table)

    lines = []
    if overhead is not None:
        ratio = overhead.us_per_call["ours"] / overhead.us_per_call["torch"]
        lines.append(
            f"per-call overhead ours/torch = {ratio:.2f} (target <= 0.60): {verdict(ratio <= 0.6)}"
        )
    for r in steps:
        ratio = r.step_s["ours"] / r.step_s["torch"]
        lines.append(
            f"{r.model}: step ratio ours/torch = {ratio:.3f} (target <= 1.00): "
            f"{verdict(ratio <= 1.0)}"
        )
        saved_ok = r.saved_bytes["ours"] <= r.saved_bytes["torch"]
        kept_ok = r.kept_bytes["ours"] <= r.kept_bytes["torch"]
        lines.append(
            f"{r.model}: saved bytes ours {format_bytes(r.saved_bytes['ours'])} vs torch "
            f"{format_bytes(r.saved_bytes['torch'])}: {verdict(saved_ok)}; kept fwd->bwd "
            f"{format_bytes(r.kept_bytes['ours'])} vs {format_bytes(r.kept_bytes['torch'])}: "
            f"{verdict(kept_ok)}; first-step losses equal: {r.losses_equal}"
        )
        # Not one of the targets, but what users feel: a core that keeps recomputed
        # tensors longer than needed shows it here and nowhere else.
        peak_ok = r.activation_bytes["ours"] <= r.activation_bytes["torch"]
        lines.append(
            f"{r.model}: step activation peak ours {format_bytes(r.activation_bytes['ours'])} "
            f"vs torch {format_bytes(r.activation_bytes['torch'])}: {verdict(peak_ok)}"
        )
    for line in lines:
        console.print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run: batch 2, fewer reps")
    parser.add_argument("--models", default="vit_small_patch16_224,resnet50")
    parser.add_argument("--batch-size", type=int, default=None, help="default 8 (quick: 2)")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--reps", type=int, default=None, help="step reps (default 7, quick 2)")
    parser.add_argument("--overhead-reps", type=int, default=None, help="default 21 (quick 5)")
    parser.add_argument("--only", choices=("overhead", "steps"), default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batch = args.batch_size or (2 if args.quick else 8)
    reps = args.reps or (2 if args.quick else 7)
    overhead_reps = args.overhead_reps or (5 if args.quick else 21)
    inner = 2 if args.quick else 5

    command = "python benchmarks/bench_core.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    console.print(f"reproduce: [bold]{command.strip()}[/bold]")
    console.print(
        f"torch {torch.__version__}, timm {timm.__version__}, vision_ckpt "
        f"{vision_ckpt.__version__}, python {platform.python_version()}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} cpus, {platform.machine()}"
    )

    overhead = None
    if args.only != "steps":
        overhead = bench_overhead(overhead_reps, inner)
    steps = []
    if args.only != "overhead":
        for name in filter(None, args.models.split(",")):
            with console.status(f"timing {name} ..."):
                steps.append(bench_model(name, batch, args.img_size, reps))
    report(overhead, steps)
    if args.json:
        payload = {
            "command": command.strip(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "overhead": asdict(overhead) if overhead else None,
            "steps": [asdict(s) for s in steps],
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
