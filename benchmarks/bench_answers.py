"""How long the planning answers take on this machine, and whether they are the same answers.

Runs the commands a new user runs, each as its own process (so imports and model building are
in the time), and compares what they answer with the answers recorded from real training
steps before the steps were counted on fake tensors:

- ``fit`` on MONAI SwinUNETR (feature size 48) at 96^3 in 24 GiB, batches 1 and 2, against
  ``benchmarks/results/fit/swinunetr_96.json`` (real steps);
- ``derive`` on ResNet-50 at batch 32, against the same derivation run here on real steps
  (the plan of every level);
- the README's main job (``profile`` on ViT-S at batch 8, two timed steps per level).

Usage::

    python benchmarks/bench_answers.py            # all three, writes results/answers/
    python benchmarks/bench_answers.py --only fit

Writes ``benchmarks/results/answers/results.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SWIN = "monai:SwinUNETR(in_channels=1, out_channels=2, feature_size=48)"


def _run(argv: list[str]) -> float:
    """Wall seconds of ``vision-ckpt argv`` in a process of its own (it must succeed)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vision_ckpt", *argv], check=True, cwd=ROOT)
    return time.perf_counter() - started


def fit(tmp: Path) -> dict[str, Any]:
    out = tmp / "fit.json"
    argv = ["fit", "--model", SWIN, "--input-shape", "1,96,96,96", "--budget", "24GiB"]
    argv += ["--batches", "1,2", "--json", str(out), "-q"]
    seconds = _run(argv)
    rows = {r["label"]: r["max_batch"] for r in json.loads(out.read_text())["rows"]}
    before = json.loads((RESULTS / "fit" / "swinunetr_96.json").read_text())
    real = {r["label"]: r["max_batch"] for r in before["budgets"]["24GiB"]["rows"]}
    return {
        "command": "vision-ckpt " + " ".join(argv[:-3]),
        "seconds": seconds,
        "answer": rows,
        "real_steps_answer": real,
        "real_steps_seconds": before["seconds"],
        "same": rows == real,
    }


def derive(tmp: Path) -> dict[str, Any]:
    out = tmp / "derive.json"
    argv = ["derive", "--model", "resnet50", "--batch-size", "32", "--json", str(out), "-q"]
    seconds = _run(argv)
    counted = {row["level"]: row["plan"] for row in json.loads(out.read_text())["levels"]}
    started = time.perf_counter()
    real = _real_steps_derivation()
    return {
        "command": "vision-ckpt " + " ".join(argv[:-3]),
        "seconds": seconds,
        "answer": counted,
        "real_steps_answer": real,
        "real_steps_seconds": time.perf_counter() - started,
        "same": counted == real,
    }


def _real_steps_derivation() -> dict[int, str]:
    """The same derivation with every byte counted on real steps (the meter before fake
    tensors), in this process: the plan it derives per level."""
    import timm

    import vision_ckpt.measure._measure as measuring
    from vision_ckpt.measure.models import output_loss
    from vision_ckpt.tune.derive import derive_preset

    model = timm.create_model("resnet50", pretrained=False)
    example = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    counted_on_fakes = measuring.meter_for
    measuring.meter_for = lambda device, fake=False: counted_on_fakes(device, fake=False)
    try:
        found = derive_preset(model, example, 32, loss_fn=output_loss)
    finally:
        measuring.meter_for = counted_on_fakes
    return {row["level"]: row["plan"] for row in found.table()}


def main_job(tmp: Path) -> dict[str, Any]:
    argv = ["profile", "--model", "vit_small_patch16_224", "--batch-size", "8", "--steps", "2"]
    return {"command": "vision-ckpt " + " ".join(argv), "seconds": _run([*argv, "-q"])}


JOBS = {"fit": fit, "derive": derive, "main_job": main_job}


def table(results: dict[str, Any]) -> str:
    lines = ["| answer | seconds | same as real steps |", "|---|---:|---|"]
    for r in results["jobs"].values():
        same = "-" if "same" not in r else ("yes" if r["same"] else "no")
        lines.append(f"| `{r['command']}` | {r['seconds']:.0f} | {same} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(JOBS), default=None)
    args = parser.parse_args()
    chosen = args.only or list(JOBS)
    out_dir = RESULTS / "answers"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"jobs": {}}
    results.update(
        torch=torch.__version__,
        platform=platform.platform(),
        threads=torch.get_num_threads(),
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            results["jobs"][name] = JOBS[name](Path(tmp))
            print(name, json.dumps(results["jobs"][name]), flush=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
