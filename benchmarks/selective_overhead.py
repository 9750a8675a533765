"""What a region costs per layer, by tensor size: full against selective (``keep: heavy``).

A chain of ``--layers`` conv 1x1 + BatchNorm + Hardswish layers (EfficientViT's and LeViT's
conv-norm-act, at their late stages' sizes by default) runs one training step plain, as one
full region and as one selective region, at each ``--spatial`` size. Time: the median of
``--reps`` steps' process CPU seconds (after warm-up steps), the three ways interleaved; per
layer: the region's extra time over the plain step divided by the layers. The modelled price
(NOTE [ A modelled price ] in ``vision_ckpt.measure._price``) charges a selective region only the
operators it runs again; what its policy costs per operator in the forward and the
recomputation (a dispatch mode in Python) is not in it, and shows here where the tensors are
small.

    python benchmarks/selective_overhead.py --threads 1 --out benchmarks/results/selective_overhead
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vision_ckpt
from vision_ckpt.measure._measure import Workload
from vision_ckpt.measure._price import modelled_step_seconds

WAYS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "full": {"match": "0", "level": 1},
    "selective": {"match": "0", "level": 1, "keep": "heavy"},
}


def chain(layers: int, width: int) -> nn.Module:
    """One module (``0``) holding ``layers`` conv 1x1 + BatchNorm + Hardswish layers."""
    torch.manual_seed(0)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Conv2d(width, width, 1), nn.BatchNorm2d(width), nn.Hardswish()]
    return nn.Sequential(nn.Sequential(*body))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _step(model: nn.Module, x: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    _loss(model(x)).backward()
    return time.process_time() - start


def measure(layers: int, width: int, spatial: int, batch: int, reps: int) -> list[dict[str, Any]]:
    """One row per way at this size: median step seconds, per-layer extra, modelled ratio."""
    x = torch.randn(batch, width, spatial, spatial)
    models = {}
    for way, rule in WAYS.items():
        models[way] = chain(layers, width).train()
        if rule is not None:
            config = {"preset": None, "rules": [rule], "training_checkpoint_level": 1}
            vision_ckpt.apply(models[way], config)
    for model in models.values():
        for _ in range(3):
            _step(model, x)
    times: dict[str, list[float]] = {way: [] for way in models}
    for round_ in range(reps):
        order = list(models)[round_ % len(models) :] + list(models)[: round_ % len(models)]
        for way in order:
            times[way].append(_step(models[way], x))
    plain = statistics.median(times["plain"])
    base = modelled_step_seconds(Workload(models["plain"], x, _loss), x)
    rows = []
    for way, model in models.items():
        seconds = statistics.median(times[way])
        modelled = modelled_step_seconds(Workload(model, x, _loss), x)
        rows.append(
            {
                "spatial": spatial,
                "width": width,
                "batch": batch,
                "layers": layers,
                "way": way,
                "step_ms": round(seconds * 1e3, 2),
                "time_ratio": round(seconds / plain, 3),
                "extra_us_per_layer": round((seconds - plain) / layers * 1e6, 1),
                "modelled_ratio": round(modelled / base, 3),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--spatial", default="7,14,28,56", help="comma-separated sizes")
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for results.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for spatial in (int(s) for s in args.spatial.split(",")):
        for row in measure(args.layers, args.width, spatial, args.batch, args.reps):
            rows.append(row)
            print(
                f"{spatial:3d} px {row['way']:>9}: {row['step_ms']:8.2f} ms, "
                f"{row['time_ratio']:.3f}x clock ({row['extra_us_per_layer']:7.1f} us a layer), "
                f"{row['modelled_ratio']:.3f}x modelled",
                flush=True,
            )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/selective_overhead.py " + shlex.join(
            sys.argv[1:] if argv is None else argv
        )
        data = {
            "command": command.replace(f"--out {args.out}", "--out <dir>"),
            "clock": "process CPU seconds, median over interleaved steps",
            "threads": args.threads,
            "rows": rows,
        }
        (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
