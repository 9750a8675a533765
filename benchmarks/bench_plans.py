"""Plans written by hand against level 0, measured side by side: is there a cheaper point than
the derived levels?

A plan is a config file (``benchmarks/plans/*.yaml``: rules and a training level), optionally
on top of the model's derived preset up to one of its levels (``--derived K``, derived at the
batch first, as ``vision_ckpt.tune.derive_preset`` does). Each plan runs real steps at the batch
beside level 0 in one process:

- peak: live tensor storage above the step's start (``track_peak_memory``, deterministic);
- time: process CPU seconds of a step against level 0's in the same round, the median over
  interleaved rounds (``--reps``), each round's ratio kept in ``time_rounds``;
- modelled: the step's modelled seconds against level 0's (NOTE [ A modelled price ] in
  ``vision_ckpt.measure._price``), the price a derivation chooses by.

    python benchmarks/bench_plans.py --model levit_128 --plans benchmarks/plans/levit_blocks.yaml \
        --threads 1 --reps 5 --out benchmarks/results/hand_plans_b32
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

import vision_ckpt
from vision_ckpt.measure._measure import Workload
from vision_ckpt.measure._price import modelled_step_seconds
from vision_ckpt.measure.models import build_model, default_input_shape, parse_input_shape
from vision_ckpt.tune.derive import derive_preset

sys.path.insert(0, str(Path(__file__).parent))
from bench_derive import (  # noqa: E402  (a script beside this one)
    MB,
    interleaved_ratios,
    step_peak,
    steps_per_sample,
    train_step,
)


def _seconds(model: torch.nn.Module, x: torch.Tensor, config: Any) -> float:
    """One step's process CPU seconds with ``config`` applied (``None``: level 0)."""
    if config is not None:
        vision_ckpt.apply(model, config)
    start = time.process_time()
    train_step(model, x)
    spent = time.process_time() - start
    if config is not None:
        vision_ckpt.remove(model)
    return spent


def _configs(model: torch.nn.Module, x: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Plan name -> config (``None``: level 0)."""
    base: list[Any] = []
    configs: dict[str, Any] = {"L0": None}
    if args.derived is not None:
        found = derive_preset(model, x[:2], x.shape[0], floor=False)
        base = [r for r in found.rules if int(r.level) <= args.derived]
        configs[f"D{args.derived}"] = {"training_checkpoint_level": args.derived, "rules": base}
    for path in args.plans:
        plan = yaml.safe_load(Path(path).read_text())
        rules = [*base, *plan["rules"]]
        configs[Path(path).stem] = {**plan, "rules": rules}
    return configs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a timm name or a spec, as vision-ckpt takes")
    p.add_argument("--plans", nargs="+", required=True, help="config files (rules, level)")
    p.add_argument("--derived", type=int, default=None, help="on top of the derived levels 1..K")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--input-shape", default=None, help="one sample, C,H,W or C,D,H,W")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--sample-seconds",
        type=float,
        default=0.0,
        help="time each sample over as many steps as make this many of L0's seconds",
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="plans_out")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.model).train()
    shape = parse_input_shape(args.input_shape) if args.input_shape else None
    shape = shape or default_input_shape(model) or (3, 224, 224)
    x = torch.randn(args.batch_size, *shape)
    configs = _configs(model, x, args)
    rows: dict[str, dict[str, Any]] = {}
    work = Workload(model, x)
    for name, config in configs.items():
        if config is not None:
            vision_ckpt.apply(model, config)
        rows[name] = {
            "model": args.model,
            "batch": args.batch_size,
            "plan": name,
            "peak_mb": round(step_peak(model, x) / MB, 1),
            "modelled": modelled_step_seconds(work, x),
        }
        train_step(model, x)  # warm
        if config is not None:
            vision_ckpt.remove(model)
        print(f"{name:>24}: peak {rows[name]['peak_mb']:8.1f} MiB", flush=True)
    steps = {name: functools.partial(_seconds, model, x, c) for name, c in configs.items()}
    per_sample = steps_per_sample(steps["L0"], args.sample_seconds)
    rounds = interleaved_ratios(steps, args.reps, per_sample)
    names = list(configs)
    l0_modelled = rows["L0"]["modelled"]
    for name in names:
        row = rows[name]
        row["peak_ratio"] = round(row["peak_mb"] / rows["L0"]["peak_mb"], 3)
        row["time_ratio"] = round(statistics.median(rounds[name]), 3)
        row["modelled_ratio"] = round(row.pop("modelled") / l0_modelled, 3)
        row["time_rounds"] = " ".join(f"{v:.3f}" for v in rounds[name])
        row["steps_per_sample"] = per_sample
        print(
            f"{name:>24}: {row['peak_ratio']:.2f}x peak, {row['time_ratio']:.3f}x clock, "
            f"{row['modelled_ratio']:.3f}x modelled"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "rows": list(rows.values()),
        "command": "python benchmarks/bench_plans.py " + shlex.join(sys.argv[1:]),
        "clock": "process CPU seconds, median over interleaved rounds of the ratio to L0",
        "meter": "live tensor storage (track_peak_memory), MiB above the step's start",
        "threads": args.threads or torch.get_num_threads(),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
