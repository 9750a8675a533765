"""The physical floor at the target batch, measured there and predicted from small batches.

``derive_preset`` reports each level's distance to the model's physical floor at the target
batch (NOTE [ The physical floor ] in ``vision_ckpt/measure/peak.py``), predicted from the two small
batches it measures. This script measures the floor at the target itself (one plain traced step)
and compares two predictions from the small batches: the line through the two floors (what
the derivation did before), and the largest of the per-operator lines (``Floor.operator_bytes``,
what it does now). Writes ``results.json`` to ``--out``, one row per model, MiB.

    python benchmarks/floor_check.py --batch-size 32 --out benchmarks/results/floor_b32 \\
        --models resnet50 vit_small_patch16_224
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vision_ckpt.measure import physical_floor
from vision_ckpt.measure._extrapolate import predict_from_timelines, small_batches
from vision_ckpt.measure.models import output_loss

sys.path.insert(0, str(Path(__file__).parent))
from bench_derive import _model_and_input  # noqa: E402  (a script beside this one)

MIB = 2**20


def check(name: str, batch: int, img: int) -> dict[str, Any]:
    model, x = _model_and_input(name, batch, img)
    started = time.perf_counter()
    at = physical_floor(model, x, output_loss)
    seconds = time.perf_counter() - started
    small = [(b, physical_floor(model, x[:b].clone(), output_loss)) for b in small_batches(batch)]
    (b1, f1), (b2, f2) = small
    floors = [(b, f.floor_bytes) for b, f in small]
    through_floors = predict_from_timelines([(b1, ()), (b2, ())], floors, batch)
    lines = [(b, f.operator_bytes) for b, f in small]
    per_operator = max(predict_from_timelines(lines, floors, batch), f2.param_grad_bytes)
    row = {
        "model": name,
        "batch": batch,
        "floor_mb": round(at.floor_bytes / MIB, 1),
        "operator": at.operator,
        "module": at.module,
        "small_batches": f"{b1} {b2}",
        "small_operators": f"{f1.module} | {f2.module}",
        "through_floors_mb": round(through_floors / MIB, 1),
        "per_operator_mb": round(per_operator / MIB, 1),
        "step_s": round(seconds, 1),
    }
    print(
        f"{name}: floor {row['floor_mb']} MiB ({at.operator} in {at.module or '(model)'}); "
        f"from batches {b1}, {b2}: {row['through_floors_mb']} through the floors, "
        f"{row['per_operator_mb']} per operator",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="specs, or spec@C,H,W")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [check(name, args.batch_size, args.img_size) for name in args.models]
    args.out.mkdir(parents=True, exist_ok=True)
    words = ["<dir>" if a == str(args.out) else shlex.quote(a) for a in sys.argv[1:]]
    command = "python benchmarks/floor_check.py " + " ".join(words)
    results = {"rows": rows, "command": command, "threads": torch.get_num_threads()}
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
