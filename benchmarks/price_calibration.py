"""The rates behind the modelled price (NOTE [ A modelled price ] in vision_ckpt/measure/_price.py).

Times every operator of training steps (forward and backward) of a few models, on one thread,
and reports the FLOPs per second of the operators with FLOPs (convolutions, matrix products,
fused attention: ``_price.op_flops``) and the bytes per second of the rest (views and
``aten._unsafe_view`` left out: ``_price.moves_nothing``). Their ratio is what the modelled
price's choices depend on. Each model runs one warm-up step, then ``--reps`` timed steps; a
model's rates are the medians over its steps, the pooled rates are all models' FLOPs (bytes)
over all their seconds, per step, the median over steps.

    python benchmarks/price_calibration.py --batch-size 32 --reps 3 \
        --models resnet50 vit_small_patch16_224 convnext_tiny levit_128 efficientvit_b0 \
        --out benchmarks/results/price_calibration
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vision_ckpt.measure._price import moves_nothing, op_flops

sys.path.insert(0, str(Path(__file__).parent))
from bench_derive import _model_and_input, train_step  # noqa: E402  (a script beside this one)


class _Timed(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, int, int, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        spent = time.perf_counter() - start
        if not moves_nothing(func):
            moved = sum(
                t.numel() * t.element_size()
                for t in tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor)
            )
            self.rows.append(
                (func.overloadpacket.__name__, op_flops(func, args, out), moved, spent)
            )
        return out


def _sums(rows: list[tuple[str, int, int, float]]) -> tuple[float, float, float, float]:
    """FLOPs, their seconds, bytes of the operators without FLOPs, their seconds."""
    heavy = [r for r in rows if r[1] > 0]
    light = [r for r in rows if r[1] == 0]
    return (
        sum(r[1] for r in heavy),
        sum(r[3] for r in heavy),
        sum(r[2] for r in light),
        sum(r[3] for r in light),
    )


def _row(model: str, batch: int, steps: list[tuple[float, ...]], slowest: str) -> dict:
    """The rates of ``steps`` (each step's ``_sums``), medians over the steps."""
    flops_rate = statistics.median(s[0] / s[1] for s in steps)
    bytes_rate = statistics.median(s[2] / s[3] for s in steps)
    return {
        "model": model,
        "batch": batch,
        "gflop_per_s": round(flops_rate / 1e9, 1),
        "gb_per_s": round(bytes_rate / 1e9, 2),
        "flops_per_byte": round(flops_rate / bytes_rate, 1),
        "heavy_share": round(statistics.median(s[1] / (s[1] + s[3]) for s in steps), 3),
        "slowest_light": slowest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--reps", type=int, default=1, help="timed steps per model")
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_small_patch16_224"])
    parser.add_argument("--out", type=Path, help="a folder to write results.json in")
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_step: list[list[tuple[float, float, float, float]]] = [[] for _ in range(args.reps)]
    rows = []
    for name in args.models:
        model, x = _model_and_input(name, args.batch_size, args.img_size)
        model.train()
        train_step(model, x)  # warm-up
        steps = []
        light_ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for rep in range(args.reps):
            with _Timed() as timed:
                train_step(model, x)
            sums = _sums(timed.rows)
            steps.append(sums)
            per_step[rep].append(sums)
            for op, flops, moved, spent in timed.rows:
                if flops == 0:
                    light_ops[op][0] += moved
                    light_ops[op][1] += spent
        slowest = sorted(light_ops.items(), key=lambda kv: -kv[1][1])[:3]
        text = ", ".join(f"{op} {m / s / 1e9:.1f} GB/s" for op, (m, s) in slowest)
        row = _row(name, args.batch_size, steps, text)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model, x
    pooled = [tuple(sum(col) for col in zip(*step, strict=True)) for step in per_step]
    row = _row("all (pooled)", args.batch_size, pooled, "")
    rows.append(row)
    print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        words = ["<dir>" if a == str(args.out) else shlex.quote(a) for a in sys.argv[1:]]
        command = "python benchmarks/price_calibration.py " + " ".join(words)
        result = {"command": command, "threads": 1, "rows": rows}
        (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
