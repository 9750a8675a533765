"""Hugging Face's ``activation_checkpointing_enable`` next to vision_ckpt's helper, one CPU step.

A ViT-S-shaped ``ViTForImageClassification`` (hidden 384, 12 layers, 6 heads, MLP 1536, patch
16, 224 px, random weights, dropout 0.1) trains one step (forward, cross-entropy, backward; no
optimizer) at batch 8 on one CPU thread, once per variant, each on a fresh copy of the same
model. For each variant, with the library's byte meters (``vision_ckpt.measure``):

- ``saved_mib``: bytes autograd keeps for backward during the forward (``count_saved_bytes``;
  what a checkpointed region keeps is its inputs);
- ``peak_mib``: the step's peak of live tensor bytes above the parameters
  (``track_peak_memory(model, x).activation_bytes``: activations, recomputation and the
  parameters' gradients);
- ``regions``: the layers checkpointed (HF: the ``GradientCheckpointingLayer`` modules whose
  flag its switch set; ours: the plan), i.e. the layers whose forward runs twice;
- ``grads_exact``: every parameter gradient equal (rtol=0, atol=0) to the plain model's.

Variants: ``none``; HF's switch with ``every_n_layers`` 1, 2, 3 and ``offload=True``; ours at
levels 1-5 and with ``every_n_layers`` 2, 3 and ``offload=True`` (on CPU a no-op, reported by
the plan). HF's ``offload`` wraps each checkpoint in ``save_on_cpu(pin_memory=True)``; without a
GPU it may fail to pin, which is recorded as the variant's ``error``.

With ``--time``, also the step time (forward + backward, no meters) of a few variants, each
relative to ``none``: interleaved in one process, the order rotating, median of 5 repetitions
after one warm-up round.

Usage::

    python benchmarks/bench_hf_switch.py           # about a minute: results/hf_switch/results.json
    python benchmarks/bench_hf_switch.py --time    # also step-time ratios (about two more)
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from vision_ckpt.integrations.hf import enable_checkpointing
from vision_ckpt.measure import count_saved_bytes, track_peak_memory

OUT = Path(__file__).parent / "results" / "hf_switch" / "results.json"
BATCH, SIZE, LAYERS = 8, 224, 12
MIB = 2**20


def _model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=384,
        num_hidden_layers=LAYERS,
        num_attention_heads=6,
        intermediate_size=1536,
        image_size=SIZE,
        patch_size=16,
        num_labels=1000,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    return transformers.ViTForImageClassification(config).train()


def _hf(every_n_layers: int, offload: bool = False) -> Any:
    def setup(model: nn.Module) -> list[str]:
        model.activation_checkpointing_enable(every_n_layers=every_n_layers, offload=offload)
        return [
            n
            for n, m in model.named_modules()
            if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
        ]

    return setup


def _ours(**kwargs: Any) -> Any:
    def setup(model: nn.Module) -> list[str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # offload on CPU: reported, a no-op
            return list(enable_checkpointing(model, **kwargs).checkpointed)

    return setup


VARIANTS = {
    "none": lambda model: [],
    "hf every_n_layers=1": _hf(1),
    "hf every_n_layers=2": _hf(2),
    "hf every_n_layers=3": _hf(3),
    "hf every_n_layers=1 offload": _hf(1, offload=True),
    **{f"ours level {lv}": _ours(level=lv) for lv in (1, 2, 3, 4, 5)},
    "ours every_n_layers=2": _ours(every_n_layers=2),
    "ours every_n_layers=3": _ours(every_n_layers=3),
    "ours offload (cpu: no-op)": _ours(offload=True),
}


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    with track_peak_memory(model, x, y, device="cpu") as peak:
        with count_saved_bytes(model, x, y) as saved:
            loss = F.cross_entropy(model(x).logits, y)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"saved": saved.nbytes, "peak": peak.activation_bytes, "grads": grads}


TIMED = (
    "none",
    "hf every_n_layers=1",
    "hf every_n_layers=2",
    "ours level 1",
    "ours level 3",
    "ours every_n_layers=2",
)


def _time_ratios(base: nn.Module, x: torch.Tensor, y: torch.Tensor, reps: int = 5) -> dict:
    models = {}
    for name in TIMED:
        models[name] = copy.deepcopy(base)
        VARIANTS[name](models[name])
    times: dict[str, list[float]] = {name: [] for name in TIMED}
    for rep in range(reps + 1):
        order = TIMED[rep % len(TIMED) :] + TIMED[: rep % len(TIMED)]
        for name in order:
            model = models[name]
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            F.cross_entropy(model(x).logits, y).backward()
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        name: {"median_s": round(m, 3), "vs_none": round(m / medians["none"], 3)}
        for name, m in medians.items()
    }


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    base = _model()
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 1000, (BATCH,), generator=torch.Generator().manual_seed(3))
    rows: dict[str, dict[str, Any]] = {}
    reference: dict[str, torch.Tensor] | None = None
    for name, setup in VARIANTS.items():
        model = copy.deepcopy(base)
        row: dict[str, Any] = {}
        try:
            row["regions"] = setup(model)
            result = _step(model, x, y)
        except Exception as exc:  # recorded, not hidden: e.g. pinning without a GPU
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        if reference is None:
            reference = result["grads"]
        row["grads_exact"] = all(torch.equal(result["grads"][n], g) for n, g in reference.items())
        row["saved_mib"] = round(result["saved"] / MIB, 1)
        row["peak_mib"] = round(result["peak"] / MIB, 1)
        row["num_regions"] = len(row["regions"])
        rows[name] = row
    out = {
        "model": "ViTForImageClassification(hidden 384, 12 layers, 6 heads, MLP 1536, patch 16)",
        "batch": BATCH,
        "image": SIZE,
        "meter": "cpu: count_saved_bytes (forward) and track_peak_memory activation_bytes "
        "(step peak above the parameters, gradients included); no optimizer",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "seconds": round(time.perf_counter() - started, 1),
        "variants": rows,
    }
    if "--time" in sys.argv[1:]:
        out["step_time"] = _time_ratios(base, x, y)
        out["seconds"] = round(time.perf_counter() - started, 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    for name, row in rows.items():
        shown = {k: v for k, v in row.items() if k != "regions"}
        print(f"{name:30s} {shown}")  # noqa: T201 (a benchmark script reports)
    for name, row in out.get("step_time", {}).items():
        print(f"time {name:25s} {row}")  # noqa: T201


if __name__ == "__main__":
    main()
