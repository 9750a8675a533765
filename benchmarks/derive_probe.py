"""How far plans assembled from traced spans get, against the bundled presets' levels (issue 26).

Not the derivation (docs/derive.md says what that will be): a probe for it. For each model
(``pretrained=False``, synthetic data, CPU, one thread), one training step (forward,
cross-entropy, backward) is measured at each level of the bundled preset and under plans made
only of what ``vision_ckpt.tune._spans.trace_spans`` finds, with no model knowledge:

- ``blocks``: every block of a repeated sequence (level 3);
- ``runs+blocks``: also the maximal runs of sibling calls that do not overlap (level 1), nested
  with ``auto`` and with ``all``;
- ``pairs+blocks``: runs of two calls (a conv and its norm, a norm and its attention) instead;
- ``groups``: every stack as sqrt(n) groups (level 4) over its blocks (level 3);
- ``stages``: every stage (level 4) over its blocks;
- ``all``: groups, blocks, maximal runs and lean MLPs together, nesting ``all``.

Measured per plan: ``peak`` (``vision_ckpt.measure.peak.where_peak``: live tensor storage above the
parameters and the input, deterministic, the bytes of ``bench_frontier.py``'s ``peak``),
where it came, and the step's FLOPs (forward + backward, recomputation included) relative to
level 0's, a deterministic stand-in for time. The model's physical floor at the batch is
measured once (NOTE [ The physical floor ] in ``vision_ckpt/measure/peak.py``). Writes
``results.json`` to ``--out``: ``models`` (span counts and the floor per model), ``rows`` (one
per plan), ``plans`` (each plan's rules) and ``top_groups`` (the largest live groups at each
peak).

Usage::

    python benchmarks/derive_probe.py              # resnet50 and vit_small at batch 8, 224 px
    python benchmarks/derive_probe.py --models resnet18 --batch-size 2 --img-size 64   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import vision_ckpt
from vision_ckpt.config import LevelRule
from vision_ckpt.errors import ConfigError
from vision_ckpt.measure._measure import applied
from vision_ckpt.measure.peak import physical_floor, where_peak
from vision_ckpt.regions.apply import as_config
from vision_ckpt.tune._spans import Span, trace_spans

MODELS = ("resnet50", "vit_small_patch16_224")
MIB = 2**20
SPAN_KINDS = ("module", "run", "block", "groups", "stage", "lean")


def _non_overlapping(runs: list[Span], length: int | None) -> list[Span]:
    """Runs in forward order, the longest first at each start (or only those of ``length``
    calls), none sharing a member with one taken before."""
    taken: list[Span] = []
    used: set[str] = set()
    pool = [r for r in runs if length is None or len(r.members) == length]
    pool.sort(key=lambda r: (r.order, -len(r.members)))
    for run in pool:
        if used.isdisjoint(run.members):
            taken.append(run)
            used.update(run.members)
    return taken


def _plans(spans: list[Span]) -> dict[str, dict[str, Any]]:
    """The probe's plans, as configs (training level 5, every rule within it)."""
    kind = {k: [s for s in spans if s.kind == k] for k in ("run", "block", "groups", "stage")}
    lean = [s for s in spans if s.kind == "lean"]
    lean_names = {s.name for s in lean}
    longest = _non_overlapping(kind["run"], None)
    pairs = _non_overlapping(kind["run"], 2)
    blocks = [s.rule(3) for s in kind["block"]]

    def cfg(rules: list[dict[str, Any]], nesting: str = "auto") -> dict[str, Any]:
        return {"training_checkpoint_level": 5, "nesting": nesting, "rules": rules}

    plans = {
        "blocks": cfg(blocks),
        "runs+blocks": cfg([r.rule(1) for r in longest] + blocks),
        "runs+blocks all": cfg([r.rule(1) for r in longest] + blocks, "all"),
        "pairs+blocks all": cfg([r.rule(1) for r in pairs] + blocks, "all"),
        "groups": cfg(blocks + [s.rule(4) for s in kind["groups"]]),
        "stages": cfg(blocks + [s.rule(4) for s in kind["stage"]]),
    }
    free = [  # a run neither holds a lean MLP nor lies inside one
        r
        for r in longest
        if not any(m == n or m.startswith(n + ".") for m in r.members for n in lean_names)
    ]
    plans["all"] = cfg(
        [r.rule(1) for r in free]
        + blocks
        + [s.rule(4) for s in kind["groups"]]
        + [s.rule(5) for s in lean],
        "all",
    )
    return plans


def _flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def probe(name: str, batch: int, size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    try:  # a transformer's position embedding is made for one image size
        model = timm.create_model(name, pretrained=False, img_size=size).train()
    except TypeError:
        model = timm.create_model(name, pretrained=False).train()
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, model.num_classes, (batch,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    began = time.process_time()
    spans = trace_spans(model, x[:1])
    trace_s = time.process_time() - began
    counts: dict[str, int] = {}
    for s in spans:
        counts[s.kind] = counts.get(s.kind, 0) + 1
    floor = physical_floor(model, x, loss_fn)
    configs: dict[str, dict[str, Any]] = {
        f"preset L{level}": {"preset": "auto", "training_checkpoint_level": level}
        for level in range(6)
    }
    configs.update(_plans(spans))
    rows: list[dict[str, Any]] = []
    groups: dict[str, list[Any]] = {}
    base_flops = None
    for label, cfg in configs.items():
        began = time.process_time()
        try:
            report = where_peak(model, x, loss_fn, config=cfg)
            with applied(model, as_config(cfg)) as the_plan:
                flops = _flops(model, x, y)
        except ConfigError as exc:
            rows.append({"model": name, "plan": label, "rejected": str(exc)})
            print(f"  {label}: rejected: {str(exc)[:120]}", file=sys.stderr)
            continue
        base_flops = base_flops or flops
        row = {
            "model": name,
            "plan": label,
            "regions": len(the_plan.checkpointed),
            "peak_mib": round(report.peak_bytes / MIB, 1),
            "above_floor": round(report.peak_bytes / floor.floor_bytes, 3),
            "flops_ratio": round(flops / base_flops, 3),
            "phase": report.phase,
            "operator": report.operator,
            "module": report.module,
            "peak_bytes": report.peak_bytes,
            "cpu_s": round(time.process_time() - began, 1),
        }
        rows.append(row)
        groups[label] = [[g.owner, g.kind, round(g.nbytes / MIB, 1)] for g in report.groups[:6]]
        print(
            f"  {label:18s} peak {row['peak_mib']:8.1f} MiB ({row['above_floor']:.2f}x floor) "
            f"flops {row['flops_ratio']:.3f} at {report.operator} in {report.module}",
            file=sys.stderr,
        )
    summary = {
        "model": name,
        "trace_cpu_s": round(trace_s, 2),
        **{f"{kind}_spans": counts.get(kind, 0) for kind in SPAN_KINDS},
        "floor_mib": round(floor.floor_bytes / MIB, 1),
        "floor_operator": floor.operator,
        "floor_module": floor.module,
        "floor_working_set_mib": round(floor.working_set_bytes / MIB, 1),
        "floor_param_grads_then_mib": round(floor.param_grad_bytes_then / MIB, 1),
        "max_working_set_mib": round(floor.max_working_set_bytes / MIB, 1),
        "param_grads_mib": round(floor.param_grad_bytes / MIB, 1),
    }
    plans = {  # rules as their one-line text: the configs, not a table for the docs
        label: {"nesting": cfg["nesting"], "rules": [str(LevelRule(**r)) for r in cfg["rules"]]}
        for label, cfg in _plans(spans).items()
    }
    return {"summary": summary, "rows": rows, "plans": plans, "top_groups": groups}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/derive_probe"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    found = []
    for name in args.models:
        print(f"{name} batch {args.batch_size} at {args.img_size} px", file=sys.stderr)
        found.append(probe(name, args.batch_size, args.img_size))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join(["python", *sys.argv]),
        "meter": "storage: where_peak's peak, live tensor storage above parameters and input",
        "clock": "none: flops_ratio is the step's matmul and convolution FLOPs over level 0's",
        "batch": args.batch_size,
        "img_size": args.img_size,
        "torch": torch.__version__,
        "timm": timm.__version__,
        "vision_ckpt": vision_ckpt.__version__,
        "machine": platform.machine(),
        "threads": args.threads,
        "models": [f["summary"] for f in found],
        "rows": [row for f in found for row in f["rows"]],
        "plans": {f["summary"]["model"]: f["plans"] for f in found},
        "top_groups": {f["summary"]["model"]: f["top_groups"] for f in found},
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
