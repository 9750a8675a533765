"""Presets at training levels 0-5 against timm's own ``set_grad_checkpointing(True)``.

For each model (``pretrained=False``, synthetic 224 px data, CPU) and batch size, in one
process, the same model and the same starting weights run a training step (forward,
cross-entropy, backward) under each variant:

- ``L0`` .. ``L5``: ``vision_ckpt.apply_preset(model, level)`` (the model's preset, or the
  fallback), nesting ``all``; ``L3o`` .. ``L5o``: the same with nesting ``outermost`` (only the
  outermost checkpointed module of a chain is checkpointed: at most one extra forward);
- ``timm``: timm's ``model.set_grad_checkpointing(True)`` (torch's checkpoint per block).

Measured per variant, with deterministic byte counting from ``vision_ckpt.measure``
(never RSS):

- ``peak``: the peak of live tensor bytes during the step above what was alive before it
  (parameters and buffers): activations, recomputation and the parameter gradients;
- ``kept``: tensor bytes alive at the end of the forward (loss computed) above the start: what
  is kept from forward to backward, checkpoint inputs included;
- ``time``: the median wall time of ``--reps`` untracked steps (run after one warm-up step);
- ``BN``: whether the BatchNorm running statistics after one step equal those of the plain
  step exactly (``-`` for models without BatchNorm).

Targets (issue 4), per model: one level within 5% of timm's peak at no more step time; the top
level keeps at most 0.3x timm's bytes; at batch 32 the top level's peak is never above timm's and
at most 0.8x of it on at least four of the six models; BatchNorm statistics exact.

Usage::

    python benchmarks/bench_presets.py                                  # everything (hours on CPU)
    python benchmarks/bench_presets.py --batch-sizes 8 --reps 2         # batch 8 only
    python benchmarks/bench_presets.py --models resnet50,convnext_tiny --batch-sizes 8 --reps 1

Writes ``results.json``, ``table.md`` and ``memory_vs_time.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import vision_ckpt
from vision_ckpt.config.presets import preset_for_model
from vision_ckpt.measure import track_peak_memory
from vision_ckpt.regions.apply import apply_preset, remove

MODELS = (
    "vit_small_patch16_224",
    "swin_tiny_patch4_window7_224",
    "convnext_tiny",
    "resnet50",
    "densenet121",
    "efficientnet_b0",
)
VARIANTS = ("L0", "L1", "L2", "L3", "L4", "L5", "timm")
ALL_VARIANTS = ("L0", "L1", "L2", "L3", "L4", "L5", "L2o", "L3o", "L4o", "L5o", "timm")
MB = 1e6


@dataclass
class Result:
    model: str
    batch: int
    variant: str
    peak_mb: float
    kept_mb: float
    time_s: float
    times_s: list[float]
    bn_exact: bool | None
    checkpointed: int
    """Modules checkpointed (our variants) or -1 for timm's switch."""


def _bn_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: b.clone()
        for n, b in model.named_buffers()
        if n.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
    }


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    loss = F.cross_entropy(model(x), y)
    loss.backward()


def _tracked_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(peak bytes above start, bytes kept at the end of forward above start)."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    with track_peak_memory(model, x, y) as mem:
        loss = F.cross_entropy(model(x), y)
        kept = mem.end_bytes - mem.start_bytes
        loss.backward()
        del loss
    return mem.peak_bytes - mem.start_bytes, kept


def _configure(model: nn.Module, variant: str) -> int:
    remove(model)
    if hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(False)
    if variant == "timm":
        model.set_grad_checkpointing(True)
        return -1
    nesting = "outermost" if variant.endswith("o") else "all"
    level = int(variant[1:].rstrip("o"))
    plan = apply_preset(model, level, nesting=nesting)
    return len(plan.checkpointed)


def bench_model(
    name: str, batch: int, reps: int, variants: list[str], console: Console
) -> list[Result]:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).train()
    initial = copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, generator=gen)
    y = torch.randint(0, 1000, (batch,), generator=gen)
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    console.print(
        f"[bold]{name}[/bold] batch {batch}: preset {preset_for_model(model) or 'fallback'}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters"
    )
    reference_bn: dict[str, torch.Tensor] | None = None
    results = []
    for variant in variants:
        model.load_state_dict(initial)
        checkpointed = _configure(model, variant)
        # First step from the initial weights: warm-up, and the BatchNorm statistics check.
        torch.manual_seed(1)
        _step(model, x, y)
        bn = _bn_buffers(model)
        if reference_bn is None:
            reference_bn = bn  # the first variant (L0 by default) is the reference
        bn_exact = None
        if has_bn and reference_bn is not None:
            bn_exact = all(torch.equal(bn[k], reference_bn[k]) for k in reference_bn)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            _step(model, x, y)
            times.append(time.perf_counter() - start)
        peak, kept = _tracked_step(model, x, y)
        r = Result(
            model=name,
            batch=batch,
            variant=variant,
            peak_mb=peak / MB,
            kept_mb=kept / MB,
            time_s=statistics.median(times),
            times_s=times,
            bn_exact=bn_exact,
            checkpointed=checkpointed,
        )
        console.print(
            f"  {variant:>4}: peak {r.peak_mb:8.1f} MB  kept {r.kept_mb:8.1f} MB  "
            f"time {r.time_s:7.2f} s  BN {'-' if bn_exact is None else bn_exact}"
        )
        results.append(r)
    _configure(model, "L0")
    return results


def _table(results: list[Result], batch: int) -> tuple[Table, list[str]]:
    table = Table(title=f"batch {batch}, 224 px, CPU", title_justify="left")
    header = [
        "model",
        "variant",
        "peak MB",
        "kept MB",
        "step s",
        "time/L0",
        "peak/timm",
        "kept/timm",
        "BN exact",
    ]
    for column in header:
        table.add_column(column, justify="left" if column in ("model", "variant") else "right")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_model: dict[str, dict[str, Result]] = {}
    for r in results:
        if r.batch == batch:
            by_model.setdefault(r.model, {})[r.variant] = r
    for model, rows in by_model.items():
        plain, timm_row = rows.get("L0"), rows.get("timm")
        for variant, r in rows.items():
            cells = [
                model,
                variant,
                f"{r.peak_mb:.0f}",
                f"{r.kept_mb:.0f}",
                f"{r.time_s:.2f}",
                f"{r.time_s / plain.time_s:.2f}x" if plain else "",
                f"{r.peak_mb / timm_row.peak_mb:.2f}x" if timm_row else "",
                f"{r.kept_mb / timm_row.kept_mb:.2f}x" if timm_row and timm_row.kept_mb else "",
                "-" if r.bn_exact is None else ("yes" if r.bn_exact else "no"),
            ]
            table.add_row(*cells)
            lines.append("| " + " | ".join(cells) + " |")
        table.add_section()
    return table, lines


def _targets(results: list[Result]) -> list[str]:
    """The issue's targets, checked per model on the measured rows."""
    out = []
    by_key: dict[tuple[str, int], dict[str, Result]] = {}
    for r in results:
        by_key.setdefault((r.model, r.batch), {})[r.variant] = r
    top_below_08 = 0
    batch32 = 0
    for (model, batch), rows in sorted(by_key.items()):
        t = rows.get("timm")
        ours = [rows[v] for v in ALL_VARIANTS if v in rows and v != "timm"]
        if t is None or not ours:
            continue
        top = next((rows[v] for v in ("L5", "L5o") if v in rows), ours[-1])
        # "Within 5% of timm's peak": at most 5% above it (lower is better still).
        match = [
            f"{r.variant} ({r.peak_mb / t.peak_mb:.2f}x peak, {r.time_s / t.time_s:.2f}x time)"
            for r in ours
            if r.peak_mb <= 1.05 * t.peak_mb and r.time_s <= t.time_s
        ]
        close = [
            f"{r.variant} ({r.peak_mb / t.peak_mb:.2f}x peak, {r.time_s / t.time_s:.2f}x time)"
            for r in ours
            if r.peak_mb <= 1.05 * t.peak_mb and t.time_s < r.time_s <= 1.05 * t.time_s
        ]
        bn = [r.bn_exact for r in ours if r.bn_exact is not None]
        line = (
            f"{model} b{batch}: peak <= 1.05x timm's at <= its time: {match or 'none'}"
            f" (at <= 1.05x its time: {close or 'none'}); top level kept "
            f"{top.kept_mb / t.kept_mb:.2f}x timm (target <= 0.3); BN exact: "
            f"{all(bn) if bn else '-'} (timm's: {t.bn_exact if t.bn_exact is not None else '-'})"
        )
        if batch == 32:
            batch32 += 1
            ratio = top.peak_mb / t.peak_mb
            top_below_08 += ratio <= 0.8
            line += f"; top peak {ratio:.2f}x timm (target <= 1, <= 0.8 on 4 of 6)"
        out.append(line)
    if batch32:
        out.append(f"batch 32: top level <= 0.8x timm's peak on {top_below_08} of {batch32} models")
    return out


def _model_rank(name: str) -> int:
    return MODELS.index(name) if name in MODELS else len(MODELS)


def _plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r.model, r.batch) for r in results}, key=lambda k: (k[1], _model_rank(k[0])))
    cols = min(3, len(keys))
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, (model, batch) in zip(axes.flat, keys, strict=False):
        rows = [r for r in results if (r.model, r.batch) == (model, batch)]
        ours = [r for r in rows if r.variant != "timm" and not r.variant.endswith("o")]
        outer = [r for r in rows if r.variant.endswith("o")]
        theirs = [
            r for r in results if (r.model, r.batch) == (model, batch) and r.variant == "timm"
        ]
        ax.plot([r.time_s for r in ours], [r.peak_mb for r in ours], "o-", label="vision_ckpt")
        for r in ours:
            ax.annotate(r.variant, (r.time_s, r.peak_mb), textcoords="offset points", xytext=(4, 4))
        if outer:
            ax.plot([r.time_s for r in outer], [r.peak_mb for r in outer], "^", label="outermost")
            for r in outer:
                ax.annotate(
                    r.variant, (r.time_s, r.peak_mb), textcoords="offset points", xytext=(4, -10)
                )
        if theirs:
            ax.plot([theirs[0].time_s], [theirs[0].peak_mb], "s", color="C3", label="timm switch")
        ax.set_title(f"{model} (batch {batch})", fontsize=9)
        ax.set_xlabel("median step time (s)")
        ax.set_ylabel("step peak (MB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated timm names")
    parser.add_argument("--batch-sizes", default="8,32", help="comma-separated, e.g. 8,32")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per variant (median)")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, first is the BN reference; any of {','.join(ALL_VARIANTS)}",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(tempfile.gettempdir()) / "vision_ckpt_bench_presets",
        help="folder for results.json, table.md and memory_vs_time.png",
    )
    parser.add_argument(
        "--render",
        default=None,
        help="comma-separated results.json files to merge and render instead of measuring",
    )
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; allowed: {', '.join(ALL_VARIANTS)}")
    torch.set_num_threads(args.threads)
    vision_ckpt.set_training_level(0)
    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/bench_presets.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    env = (
        f"torch {torch.__version__}, timm {timm.__version__}, {platform.processor() or 'cpu'}, "
        f"{args.threads} thread(s), reps {args.reps}"
    )
    console.print(f"{command}\n{env}")

    results: list[Result] = []
    if args.render:
        for path in args.render.split(","):
            data = json.loads(Path(path).read_text())
            results += [Result(**r) for r in data["results"]]
            console.print(f"from {path}: {data['command']} ({data['env']})")
            command, env = data["command"], data["env"]  # the measuring run's, not this one's
        batches = sorted({r.batch for r in results})
        # Later files win for the same model, batch and variant.
        merged = {(r.model, r.batch, r.variant): r for r in results}
        order = {v: i for i, v in enumerate(ALL_VARIANTS)}
        results = sorted(
            merged.values(), key=lambda r: (r.batch, _model_rank(r.model), order[r.variant])
        )
    else:
        for batch in batches:
            for name in models:
                results.extend(bench_model(name, batch, args.reps, variants, console))
                (args.out / "results.json").write_text(
                    json.dumps(
                        {"command": command, "env": env, "results": [asdict(r) for r in results]},
                        indent=1,
                    )
                )
    md = [f"`{command}` ({env})", ""]
    for batch in batches:
        table, lines = _table(results, batch)
        console.print(table)
        md += [f"batch {batch}:", ""] + lines + [""]
    targets = _targets(results)
    for line in targets:
        console.print(line)
    md += ["Targets:", ""] + [f"- {t}" for t in targets]
    (args.out / "table.md").write_text("\n".join(md) + "\n")
    if args.render:
        (args.out / "results.json").write_text(
            json.dumps(
                {"command": command, "env": env, "results": [asdict(r) for r in results]},
                indent=1,
            )
        )
    _plot(results, args.out / "memory_vs_time.png")
    console.print(f"wrote {args.out / 'table.md'}, results.json and memory_vs_time.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
