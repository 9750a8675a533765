"""Compile parity: one tiny timm model per preset family x levels 0-5 under torch.compile.

For each (model, level): ``vision_ckpt.apply_preset(model, level=L)``, one training step eagerly
and one under ``torch.compile(backend=..., dynamic=False)`` (see docs/compile.md) on a copy with
the same weights, dropout and drop-path off (compiled and eager code draw random numbers in a
different order), 64 px input.
A case passes when the compiled step runs and every gradient is within ``--rtol`` of eager's
(relative to the largest gradient element of that parameter) and the BatchNorm running stats
agree. Prints a table level x model and writes ``benchmarks/results/compile_matrix.json``.

    python benchmarks/compile_matrix.py [--backend aot_eager] [--models resnet18,...] [--levels 0,1]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback
import warnings
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

import vision_ckpt

MODELS: dict[str, dict] = {
    "resnet18": {},
    "vit_tiny_patch16_224": {"img_size": 64},
    "convnext_atto": {},
    "efficientnet_b0": {},
    "swin_tiny_patch4_window7_224": {"img_size": 64, "window_size": 2},
    "densenet121": {},
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    options = {"drop_rate": 0.0, **MODELS[name]}
    if name != "densenet121":  # DenseNet has no drop-path
        options["drop_path_rate"] = 0.0
    return timm.create_model(name, pretrained=False, num_classes=10, **options).train()


def step(model: torch.nn.Module, call, x: torch.Tensor, y: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(call(x), y).backward()
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def compare(got: dict, expected: dict, rtol: float) -> str | None:
    if got["grads"].keys() != expected["grads"].keys():
        return "different parameters got gradients"
    worst, where = 0.0, ""
    for n, g in expected["grads"].items():
        scale = g.abs().max().item() or 1.0
        err = (got["grads"][n] - g).abs().max().item() / scale
        if err > worst:
            worst, where = err, n
    if worst > rtol:
        return f"gradient of {where} off by {worst:.2e} (relative)"
    for n, b in expected["buffers"].items():
        if b.is_floating_point():
            err = (got["buffers"][n] - b).abs().max().item() / (b.abs().max().item() or 1.0)
            if err > rtol:
                return f"buffer {n} off by {err:.2e}"
        elif not torch.equal(got["buffers"][n], b):
            return f"buffer {n} differs"
    return None


def run_case(name: str, level: int, backend: str, rtol: float) -> dict:
    base = build(name)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([1, 2])
    eager = copy.deepcopy(base)
    vision_ckpt.apply_preset(eager, level=level)
    compiled_model = copy.deepcopy(base)
    vision_ckpt.apply_preset(compiled_model, level=level)
    expected = step(eager, eager, x, y)
    torch._dynamo.reset()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call = torch.compile(compiled_model, backend=backend, dynamic=False)
            got = step(compiled_model, call, x, y)
        except Exception as exc:  # noqa: BLE001 - the table reports it
            tb = traceback.format_exc().strip().splitlines()
            return {
                "ok": False,
                "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "where": tb[-6:],
                "seconds": time.perf_counter() - start,
            }
    problem = compare(got, expected, rtol)
    ours = sorted(
        {
            str(w.message)[:200]
            for w in caught
            if "vision_ckpt" in str(w.filename) or "checkpoint" in str(w.message)
        }
    )
    return {
        "ok": problem is None,
        "error": problem,
        "warnings": ours,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--levels", default="0,1,2,3,4,5")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/compile_matrix.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = args.models.split(",")
    levels = [int(v) for v in args.levels.split(",")]
    results: dict[str, dict[str, dict]] = {}
    for name in models:
        for level in levels:
            r = run_case(name, level, args.backend, args.rtol)
            results.setdefault(name, {})[str(level)] = r
            status = "ok" if r["ok"] else "FAIL " + (r["error"] or "")[:150]
            print(f"{name} L{level}: {status} ({r['seconds']:.1f}s)", flush=True)
    print("\nlevel | " + " | ".join(m.split("_")[0][:12].ljust(12) for m in models))
    for level in levels:
        cells = ["pass" if results[m][str(level)]["ok"] else "FAIL" for m in models]
        print(f"  {level}   | " + " | ".join(c.ljust(12) for c in cells))
    failed = sum(not results[m][str(lv)]["ok"] for m in models for lv in levels)
    total = len(models) * len(levels)
    print(f"\n{failed} of {total} cases fail ({args.backend}, rtol {args.rtol})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "backend": args.backend,
                "rtol": args.rtol,
                "torch": torch.__version__,
                "timm": timm.__version__,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
