"""Derived levels against the hand-tuned presets, the structural fallback and timm's switch.

For each model: ``vision_ckpt.tune.derive_preset`` at the batch (its own measurements: small
batches), then every variant runs real steps at the batch, side by side in one process:

- ``L0``: no checkpointing;
- ``D1``..``D5``: the derived levels (a level marked as the level below's plan is skipped);
- ``P<k>``: the bundled preset's levels 2, 3 and its top distinct level, where one exists;
- ``F<k>``: the structural fallback's top distinct level (``fallback_rules``), for models with
  no preset;
- ``own``: the model library's own switch (timm's ``set_grad_checkpointing``, Hugging Face's
  ``activation_checkpointing_enable``, MONAI's ``use_checkpoint``), where it has one.

A model is a timm name or a spec as ``vision-ckpt`` takes it (``smp:MAnet(...)``,
``monai:VNet(...)@1,64,64,64`` with one sample's shape after ``@``); the loss fits its output
(``vision_ckpt.measure.models.output_loss``).

Peak: live tensor storage above what was live before the step (``track_peak_memory``,
deterministic). Time: process CPU seconds of a step, the median over interleaved rounds of the
ratio to L0 in the same round (``--reps``; a sample is one step, or with ``--sample-seconds`` as
many steps as make that many of L0's seconds); and, deterministic, the matmul and convolution FLOPs
of a step (recomputation included) relative to L0's, counted at batch 2 (FLOPs are linear in
the batch), and the modelled step time relative to L0's (``modelled_ratio``: every operator's
FLOPs and bytes moved at the batch, NOTE [ A modelled price ] in ``vision_ckpt.measure._price``, the
price ``derive_preset`` chooses by). BatchNorm statistics after the first step are
compared with L0's (``bn_exact``).

    python benchmarks/bench_derive.py --threads 1 --reps 5 --out benchmarks/results/derive_b32
    python benchmarks/bench_derive.py --models efficientvit_b0 levit_128 fastvit_t8 caformer_s18 \
        --threads 1 --reps 5 --out benchmarks/results/derive_nopreset_b32

(A published file merges runs over subsets of models; its ``command`` lists them.)
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import vision_ckpt
from vision_ckpt.config.presets import fallback_rules, preset_for_model
from vision_ckpt.measure import track_peak_memory
from vision_ckpt.measure._measure import Workload
from vision_ckpt.measure._price import modelled_step_seconds
from vision_ckpt.measure.models import (
    build_model,
    default_input_shape,
    output_loss,
    own_switch,
    parse_input_shape,
)
from vision_ckpt.tune._planner import level_signature
from vision_ckpt.tune.derive import derive_preset

MODELS = (
    "resnet50",
    "convnext_tiny",
    "vit_small_patch16_224",
    "efficientnet_b0",
    "swin_tiny_patch4_window7_224",
    "densenet121",
)
MB = 2**20


def train_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    output_loss(model(x)).backward()


def step_peak(model: torch.nn.Module, x: torch.Tensor) -> int:
    for p in model.parameters():
        p.grad = None
    gc.collect()
    with track_peak_memory(model, x) as mem:
        output_loss(model(x)).backward()
    return mem.peak_bytes - mem.start_bytes


def interleaved_ratios(
    steps: dict[str, Callable[[], float]], reps: int, per_sample: int = 1
) -> dict[str, list[float]]:
    """Each step's seconds over ``L0``'s in the same round, for ``reps`` rounds, the order of
    the steps turned each round so that none always runs first; ``steps`` maps a label to a
    call that runs one step and returns its seconds, and a sample is ``per_sample`` such
    steps run back to back."""
    labels = list(steps)
    ratios: dict[str, list[float]] = {label: [] for label in labels}
    for round_ in range(reps):
        shift = round_ * len(labels) // max(1, reps)
        times = {
            label: sum(steps[label]() for _ in range(per_sample))
            for label in labels[shift:] + labels[:shift]
        }
        for label in times:
            ratios[label].append(times[label] / times["L0"])
        print(
            f"  round {round_ + 1}: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()),
            flush=True,
        )
    return ratios


def _seconds(model: torch.nn.Module, x: torch.Tensor) -> float:
    start = time.process_time()
    train_step(model, x)
    return time.process_time() - start


def _flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Matmul and convolution FLOPs of one step, recomputation included (deterministic)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = None
    with FlopCounterMode(display=False) as counter:
        output_loss(model(x)).backward()
    return counter.get_total_flops()


def _model_and_input(text: str, batch: int, img: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """``spec`` or ``spec@C,H,W`` (``C,D,H,W``): a model spec as ``vision-ckpt`` takes it."""
    spec, _, shape_text = text.partition("@")
    model = build_model(spec, img_size=img if not shape_text else None)
    shape = (
        parse_input_shape(shape_text)
        if shape_text
        else (default_input_shape(model) or (3, img, img))
    )
    if not shape_text and len(shape) == 3:
        shape = (shape[0], img, img)
    gen = torch.Generator().manual_seed(0)
    return model, torch.randn(batch, *shape, generator=gen)


def _bn(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = ("running_mean", "running_var", "num_batches_tracked")
    return {n: b.clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in names}


def _distinct_top(model: torch.nn.Module, config: dict[str, Any]) -> int:
    """The lowest level that runs the same regions as level 5."""
    plan = vision_ckpt.plan(model, config)
    top = 5
    while top > 1 and level_signature(plan, top - 1) == level_signature(plan, 5):
        top -= 1
    return top


def _variants(name: str, model: torch.nn.Module, found: Any) -> list[tuple[str, Any, str]]:
    out: list[tuple[str, Any, str]] = [("L0", copy.deepcopy(model), "")]
    for lv in found.levels:
        if lv.same_as is None:
            m = copy.deepcopy(model)
            vision_ckpt.apply(m, found.config(lv.level))
            out.append((f"D{lv.level}", m, ""))
    preset = preset_for_model(model)
    if preset is not None:
        top = _distinct_top(model, {"preset": preset})
        for level in sorted({2, 3, top}):
            m = copy.deepcopy(model)
            vision_ckpt.apply(m, {"preset": preset, "training_checkpoint_level": level})
            out.append((f"P{level}", m, preset))
    else:
        rules = [r.model_dump(exclude_defaults=True) for r, _ in fallback_rules(model)]
        config = {"preset": None, "rules": rules}
        top = _distinct_top(model, config)
        m = copy.deepcopy(model)
        vision_ckpt.apply(m, {**config, "training_checkpoint_level": top})
        out.append((f"F{top}", m, "fallback"))
    m = copy.deepcopy(model)
    switch = own_switch(m)
    if switch is not None:
        try:
            switch.enable()
            out.append(("own", m, switch.name))
        except Exception as exc:  # some timm models do not implement it
            print(f"  {name}: {switch.name} failed ({type(exc).__name__}: {exc})")
    return out


def steps_per_sample(step: Callable[[], float], seconds: float) -> int:
    """How many steps make a timed sample of at least ``seconds`` (one step timed to know;
    at least one): a step of under a second spreads too much on a shared CPU to be one
    sample."""
    return max(1, math.ceil(seconds / max(step(), 1e-6))) if seconds > 0 else 1


def bench_model(
    name: str, batch: int, reps: int, img: int, sample_seconds: float = 0.0
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, x = _model_and_input(name, batch, img)
    started = time.perf_counter()
    found = derive_preset(copy.deepcopy(model), x[:2].clone(), batch, loss_fn=output_loss)
    derive_s = time.perf_counter() - started
    print(found, flush=True)
    predicted = {f"D{lv.level}": lv.measurement.peak for lv in found.levels}
    runs = _variants(name, model, found)
    rows: dict[str, dict[str, Any]] = {}
    reference = None
    flops0 = 0
    modelled0 = 0.0
    for label, m, source in runs:
        torch.manual_seed(1)
        train_step(m, x)
        bn = _bn(m)
        reference = reference or bn
        exact = all(torch.equal(bn[k], reference[k]) for k in reference)
        peak = step_peak(m, x)
        flops = _flops(m, x[:2])
        flops0 = flops0 or flops
        torch.manual_seed(1)
        modelled = modelled_step_seconds(Workload(m, x, output_loss, None), x)
        modelled0 = modelled0 or modelled
        rows[label] = {
            "model": name,
            "batch": batch,
            "variant": label,
            "source": source,
            "peak_mb": round(peak / MB, 1),
            "predicted_mb": round(predicted[label] / MB, 1) if label in predicted else None,
            "bn_exact": exact,
            "time_ratio": None,
            "flops_ratio": round(flops / flops0, 3),
            "modelled_ratio": round(modelled / modelled0, 3),
            "x_floor": round(peak / found.floor, 2) if found.floor else None,
            "derive_s": round(derive_s, 1) if label == "L0" else None,
        }
        print(f"  {label:>5}: peak {peak / MB:8.1f} MiB, bn exact {exact}", flush=True)
    steps = {label: functools.partial(_seconds, m, x) for label, m, _ in runs}
    per_sample = steps_per_sample(steps["L0"], sample_seconds)
    for label, r in interleaved_ratios(steps, reps, per_sample).items():
        rows[label]["steps_per_sample"] = per_sample
        rows[label]["time_ratio"] = round(statistics.median(r), 3)
        rows[label]["time_rounds"] = " ".join(f"{v:.3f}" for v in r)  # the spread, as rendered
    return list(rows.values())


def _level_of(by: dict[str, dict[str, Any]], prefix: str, k: int) -> dict[str, Any] | None:
    """Variant ``prefix + k``, or the highest distinct level below it that runs its plan."""
    found = [int(v[1:]) for v in by if v.startswith(prefix) and v[1:].isdigit()]
    below = [j for j in found if j <= k]
    return by[f"{prefix}{max(below)}"] if below else None


def _cell(row: dict[str, Any] | None, versus: dict[str, Any] | None = None) -> str:
    """``peak MiB (time x, FLOPs x)`` and, against ``versus``, the peak ratio."""
    if row is None:
        return "-"
    flops = f", FLOPs {row['flops_ratio']:.2f}x" if row.get("flops_ratio") else ""
    if row.get("modelled_ratio"):
        flops += f", modelled {row['modelled_ratio']:.2f}x"
    text = f"{row['peak_mb']:.0f} ({row['time_ratio']:.2f}x time{flops})"
    if versus is not None:
        text += f", {row['peak_mb'] / versus['peak_mb']:.2f}x"
    return text


def _clock_change(a: dict[str, Any], b: dict[str, Any]) -> float:
    """``a``'s step time over ``b``'s, minus one: the median over rounds of the two measured in
    the same round (a round's level 0 moves every ratio of that round alike), or the medians'
    ratio where a row keeps no rounds."""
    if a.get("time_rounds") and b.get("time_rounds"):
        pairs = zip(a["time_rounds"].split(), b["time_rounds"].split(), strict=True)
        return statistics.median(float(x) / float(y) for x, y in pairs) - 1
    return a["time_ratio"] / b["time_ratio"] - 1


def _reaching(by: dict[str, dict[str, Any]], preset: dict[str, Any]) -> str:
    """The lowest derived level whose peak is within 10% of ``preset``'s: its peak over the
    preset's, and its clock and modelled time over the preset's (the preset's point read as a
    point of the curve, whatever level number the derivation gave it)."""
    for v in sorted(v for v in by if v.startswith("D")):
        d = by[v]
        if d["peak_mb"] <= 1.10 * preset["peak_mb"]:
            clock = _clock_change(d, preset)
            modelled = d["modelled_ratio"] / preset["modelled_ratio"] - 1
            return (
                f"{v}: {d['peak_mb'] / preset['peak_mb']:.2f}x, {clock:+.0%} clock, "
                f"{modelled:+.0%} modelled"
            )
    return "none"


def summary(rows: list[dict[str, Any]]) -> str:
    """Three markdown tables: derived levels 2, 3 and top against the bundled preset's (peak
    MiB, time and FLOPs against level 0, and the derived peak over the preset's); each of
    those preset levels against the lowest derived level within 10% of its peak; and, for
    models with no preset, the derived top against the library's switch and the structural
    fallback's top, with the cheapest derived level at or under half of level 0's peak."""
    models: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        models.setdefault(r["model"], {})[r["variant"]] = r
    out = [
        "| model | L0 | derived L2 / preset L2 | derived L3 / preset L3 | "
        "derived top / preset top |",
        "|---|---|---|---|---|",
    ]
    points = [
        "| model | preset L2 | preset L3 | preset top |",
        "|---|---|---|---|",
    ]
    bare = [
        "| model | L0 | derived top | own switch | fallback top | derived top / own | "
        "first derived level <= 0.5x L0 |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, by in models.items():
        derived_top = _level_of(by, "D", 5)
        if any(v.startswith("P") for v in by):
            cells, reached = [model, f"{by['L0']['peak_mb']:.0f}"], [model]
            for k in (2, 3, 5):
                d, p = _level_of(by, "D", k), _level_of(by, "P", k)
                cells.append(f"{_cell(d, p)} / {_cell(p)}")
                reached.append(_reaching(by, p) if p else "-")
            out.append("| " + " | ".join(cells) + " |")
            points.append("| " + " | ".join(reached) + " |")
            continue
        own = by.get("own") or by.get("timm")
        fallback = next((r for v, r in by.items() if v.startswith("F")), None)
        half = next(
            (
                by[v]
                for v in sorted(by)
                if v.startswith("D") and by[v]["peak_mb"] <= 0.5 * by["L0"]["peak_mb"]
            ),
            None,
        )
        ratio = f"{derived_top['peak_mb'] / own['peak_mb']:.2f}x" if own and derived_top else "-"
        bare.append(
            f"| {model} | {by['L0']['peak_mb']:.0f} | {_cell(derived_top)} | {_cell(own)} | "
            f"{_cell(fallback)} | {ratio} | "
            + (f"{half['variant']}: {_cell(half)}" if half else "none")
            + " |"
        )
    tables = []
    if len(out) > 2:
        tables.append("\n".join(out))
        tables.append("\n".join(points))
    if len(bare) > 2:
        tables.append("\n".join(bare))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help="names or specs")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--sample-seconds",
        type=float,
        default=0.0,
        help="time each sample over as many steps as make this many of L0's seconds "
        "(default: one step)",
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="derive_out")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {"rows": []}
    data.update(
        command="python benchmarks/bench_derive.py " + " ".join(argv or sys.argv[1:]),
        clock="process CPU seconds, median over rounds of the ratio to L0",
        meter="live tensor storage (track_peak_memory), MiB above the step's start",
        threads=torch.get_num_threads(),
    )
    for name in args.models:
        rows = bench_model(name, args.batch_size, args.reps, args.img_size, args.sample_seconds)
        data["rows"] = [r for r in data["rows"] if r["model"] != name] + rows
        path.write_text(json.dumps(data, indent=1))
    print(summary(data["rows"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
