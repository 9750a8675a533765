"""The largest batch that fits 12 GiB and 24 GiB: every level against the library's own switch.

For each model (random weights, synthetic input, no optimizer) ``vision_ckpt.tune.max_batch`` runs
training steps (forward, the output's loss from
``vision_ckpt.measure.models.output_loss``, backward)
at a few small batches on **CPU**, counts the live tensor bytes after every operator with
vision_ckpt's storage tracker (deterministic: the same figures on every run), and solves for
the largest batch whose step peak is within the budget (NOTE [ The largest batch from a few
small ones ] in ``vision_ckpt/tune/fit.py``). The own switch is measured with the same meter:

- MONAI SwinUNETR (feature_size 48, 1 channel in, 2 out) at 96^3 and 128^3: ``use_checkpoint``;
- smp Unet(resnet34) at 512 px: smp has no switch;
- Hugging Face ViT-B (``ViTConfig()``: 768 wide, 12 layers) at 224: transformers 5's
  ``activation_checkpointing_enable()``;
- timm convnext_tiny and vit_small_patch16_224 at 224: ``set_grad_checkpointing()``.

Bytes are CPU tensor bytes: a CUDA step adds the allocator's rounding and cuDNN/cuBLAS
workspaces, so on a card the batches are somewhat smaller, for every row alike. The per-block
planner is not run here: at these budgets it would price every block at 1/8 and 1/4 of batches
in the hundreds, hours of CPU per model.

Usage::

    python benchmarks/bench_fit.py                       # every model, 1 thread
    python benchmarks/bench_fit.py --models vit_s convnext_t --time-steps 1
    python benchmarks/bench_fit.py --render               # the table from the JSON files again

Writes ``benchmarks/results/fit/<model>.json`` (one per model, as soon as it is measured) and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import vision_ckpt
from vision_ckpt.measure.models import build_model

OUT = Path(__file__).resolve().parent / "results" / "fit"
BUDGETS = {"12GiB": 12 * 2**30, "24GiB": 24 * 2**30}

# name -> (spec, input shape, small batches, timed steps)
MODELS: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], int]] = {
    "vit_s": ("vit_small_patch16_224", (3, 224, 224), (2, 3, 4), 1),
    "convnext_t": ("convnext_tiny", (3, 224, 224), (2, 3, 4), 1),
    "hf_vit_b": ("hf:ViTForImageClassification(ViTConfig())", (3, 224, 224), (2, 3, 4), 1),
    "smp_unet_r34": (
        'smp:Unet(encoder_name="resnet34", encoder_weights=None, classes=2)',
        (3, 512, 512),
        (2, 3, 4),
        0,
    ),
    # A 96^3 step of SwinUNETR takes about a minute per sample on one CPU thread: two batches
    # (the third-batch linearity check is done on the other models), no timing.
    "swinunetr_96": (
        "monai:SwinUNETR(in_channels=1, out_channels=2, feature_size=48)",
        (1, 96, 96, 96),
        (1, 2),
        0,
    ),
    "swinunetr_128": (
        "monai:SwinUNETR(in_channels=1, out_channels=2, feature_size=48)",
        (1, 128, 128, 128),
        (1, 2),
        0,
    ),
}


def run(name: str, levels: list[int], time_steps: int | None) -> dict:
    spec, shape, batches, steps = MODELS[name]
    model = build_model(spec)
    started = time.perf_counter()
    # Measured once; each budget is a solve over the same measurements (FitResult.for_budget).
    fit = vision_ckpt.tune.max_batch(
        model,
        shape,
        BUDGETS["24GiB"],
        levels=levels,
        batches=batches,
        time_steps=steps if time_steps is None else time_steps,
        model_name=spec,
        on_row=lambda r: print(f"  {name}: {r.label}: {r.max_batch} {r.note}", flush=True),
    )
    return {
        "model": name,
        "spec": spec,
        "input_shape": list(shape),
        "batches": list(batches),
        "command": "python " + " ".join(sys.argv),
        "device": "cpu: bytes of live tensors (no CUDA allocator), no optimizer",
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started,
        "budgets": {b: fit.for_budget(v).to_dict() for b, v in BUDGETS.items()},
    }


def _switch(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["label"].startswith("own switch")), None)


def table(results: list[dict]) -> str:
    lines = [
        "| model | input | budget | L0 | L1 | L2 | L3 | L4 | L5 | own switch | best level |"
        " best / switch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for data in results:
        for budget, fit in data["budgets"].items():
            by_level = {r["level"]: r for r in fit["rows"] if r["level"] is not None}
            cells = []
            for level in range(6):
                r = by_level.get(level)
                mark = "" if r is None or r["linear"] else "*"
                cells.append("-" if r is None else f"{r['max_batch']}{mark}")
            switch = _switch(fit["rows"])
            best = max(by_level.values(), key=lambda r: r["max_batch"] or 0, default=None)
            ratio = (
                f"{best['max_batch'] / switch['max_batch']:.2f}x"
                if best and switch and switch["max_batch"]
                else "-"
            )
            shape = "x".join(str(v) for v in data["input_shape"])
            lines.append(
                f"| {data['model']} | {shape} | {budget} | {' | '.join(cells)} | "
                f"{switch['max_batch'] if switch else 'none'} | "
                f"{'-' if best is None else 'L' + str(best['level'])} | {ratio} |"
            )
    lines.append("")
    lines.append(
        "Largest batch whose predicted step peak (CPU tensor bytes, no optimizer) fits the budget;"
        " * marks a row not confirmed linear: its third batch was off the line by more than 2%,"
        " or its runs executed different operators (SwinUNETR at batch 1 and 2), so the line"
        " goes through the two peaks instead of through every operator."
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--levels", default="0,1,2,3,4,5")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-steps", type=int, default=None, help="override per model")
    parser.add_argument("--render", action="store_true", help="only print the saved table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.render:
        levels = [int(v) for v in args.levels.split(",")]
        for name in args.models:
            print(f"{name} ...", flush=True)
            data = run(name, levels, args.time_steps)
            (OUT / f"{name}.json").write_text(json.dumps(data, indent=2))
            print(f"  {name}: {data['seconds']:.0f} s", flush=True)
    results = [
        json.loads((OUT / f"{n}.json").read_text()) for n in MODELS if (OUT / f"{n}.json").exists()
    ]
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
