"""One command for the day a GPU is lent: what CPU runs and fake CUDA cannot verify.

Never run in CI. On a machine with a CUDA device::

    python benchmarks/gpu_check.py                       # every section, six models (~10 min)
    python benchmarks/gpu_check.py --sections exact,replay --models vit_small_patch16_224
    python benchmarks/gpu_check.py --render benchmarks/results/gpu_check/results.json

and, to exercise the same code path on CPU with tiny models (what CI-less dry runs do)::

    python benchmarks/gpu_check.py --dry-run             # = --device cpu --tiny, out in /tmp

Sections (``--sections``, all by default), each on the models of ``--models``:

``exact``
    Levels 0-5, fp32, deterministic algorithms (``torch.use_deterministic_algorithms``, cuDNN
    deterministic, ``CUBLAS_WORKSPACE_CONFIG``), dropout and drop-path active: the output and
    every gradient of one training step against the same model without checkpointing, with
    ``rtol=0, atol=0``. The plain model is run twice first: if those two differ, the device is
    not reproducible for that model and the row says so instead of blaming checkpointing.
``replay``
    Dropout in fused attention (SDPA ``flash`` and ``efficient`` backends forced with
    ``sdpa_kernel``), drop-path and projection dropout, under fp16 and bf16 autocast, in a
    selective and a full region (ViT and Swin): gradients against the plain model's. A replayed
    mask gives the plain model's gradients up to the backward's own run-to-run noise (measured
    by running the plain model twice); a mask drawn again differs at order one. Scope ``step``
    holds the backend selection over forward and backward, scope ``forward`` over the forward
    only (recomputation must restore it: issue 24 item 3).
``first``
    The first training step of a process: plain, twice, and at the selective and full levels
    of ``replay``, each alone in a fresh Python process (bf16 autocast where the device has
    it, attention dropout and drop-path on), gradients against the first plain process's.
    Lazy first-call work in torch (on a Hopper GPU it reordered the SDPA backends' priority
    during the first attention call) happens inside the first region there, which a step
    after a plain one never shows.
``memory``
    Per level at ``--batch``: the peak predicted from two small batches (what ``suggest_level``
    decides on) against the measured one, on the device's meter (``max_memory_allocated`` of
    a warmed-up step on CUDA, NOTE [ Two meters ] in ``vision_ckpt.measure._measure``), with
    ``max_memory_reserved`` and the byte tracker's peak beside them. AdamW state included.
``suggest``
    ``suggest_level`` and ``plan_for_budget`` for ``--budget`` (default: halfway between the
    measured peaks of levels 5 and 0 at ``--batch``, at least 10% over level 5's), then the
    chosen plan run for real at ``--batch``: its allocated and reserved peaks against the
    budget.
``inductor``
    ``torch.compile`` (``--compile-backend``, inductor by default) at every level of
    ``--compile-models``: one training step's gradients against eager within ``--compile-rtol``
    (relative to each tensor's largest magnitude), dropout off.
``frontier``
    At the batch that matters (``--frontier-batch auto``: the batch at which eager level 0
    allocates at least ``--share``, 40%, of the device), in ``--amp`` autocast (bf16): eager
    levels 0-5 and timm's ``set_grad_checkpointing`` for every model, then for the models of
    ``--frontier-compile`` the same under ``torch.compile`` (``--compile-backend``): level 0,
    the levels of ``--frontier-levels``, compile's own ``activation_memory_budget`` at each of
    ``--budgets`` and the switch. Each variant's allocated peak alone on the device (absolute:
    what must fit), and step time as the median over ``--reps`` interleaved rounds of the
    ratio to eager L0 (a compiled variant: to compiled L0).
``derive``
    ``derive_preset`` run on the device for each of ``--derive-models`` (models no preset
    knows, and ResNet-50) at ``--batch``, dropout on; then level 0, every derived level with a
    plan of its own and the model's own switch, each measured as in ``frontier`` (the
    allocator's peak above the step's start, alone on the device; time over interleaved
    rounds) and checked exact at batch 2 as in ``exact``. The derivation decides on the
    device's meter (on CUDA the allocator's peak, parameters included, extrapolated from small
    batches): its prediction stands beside the measured peak, the peak above the step's start
    (what ``alloc/L0`` divides) and the byte tracker's (the CPU tables' meter).

Writes ``results.json`` and ``table.md`` (the tables for docs/benchmarks.md) to ``--out``
(default ``benchmarks/results/gpu_check``) and exits 1 when a check failed. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SECTIONS = ("exact", "replay", "first", "memory", "suggest", "inductor", "frontier", "derive")
LEVELS = (0, 1, 2, 3, 4, 5)

# The six models of the frontier, at 224 px.
FULL_MODELS: dict[str, dict[str, Any]] = {
    "vit_small_patch16_224": {},
    "swin_tiny_patch4_window7_224": {},
    "convnext_tiny": {},
    "resnet50": {},
    "densenet121": {},
    "efficientnet_b0": {},
}
# One small model per family at 64 px (Swin with window 2), for --tiny.
TINY_MODELS: dict[str, dict[str, Any]] = {
    "vit_tiny_patch16_224": {"img_size": 64, "depth": 4},
    "swin_tiny_patch4_window7_224": {"img_size": 64, "window_size": 2},
    "convnext_atto": {},
    "resnet18": {},
    "densenet121": {},
    "efficientnet_b0": {},
}
# The models with fused attention, and the levels at which a layer is a selective / full region.
REPLAY_LEVELS = {"vit": {"selective": 1, "full": 3}, "swin": {"selective": 1, "full": 2}}
# timm families whose constructor takes no drop_path_rate
NO_DROP_PATH = ("densenet", "efficientvit_b")
# The derive section: models no preset knows, and ResNet-50, whose preset is the reference.
DERIVE_MODELS = ("resnet50", "efficientvit_b0", "levit_128", "fastvit_t8")
TINY_DERIVE_MODELS = ("efficientvit_b0",)  # at 64 px its activations outweigh its weights
# The frontier's autocast dtypes (``--amp``).
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults of ``--tiny`` / ``--dry-run`` filled in.

    >>> a = parse_args(["--dry-run"])
    >>> a.device, a.tiny, a.batch, a.reps, a.compile_models
    ('cpu', True, 8, 1, ['resnet18'])
    >>> parse_args([]).sections == list(SECTIONS)
    True
    """
    p = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="Checks that need a CUDA device: exactness, RNG replay with fused attention, "
        "allocator peaks against predictions, suggest's plan at its batch, inductor, frontier.",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    p.add_argument("--tiny", action="store_true", help="tiny models at 64 px (for a dry run)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="--device cpu --tiny --reps 1, results to a temporary folder: the same code path",
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated sections")
    p.add_argument("--models", default=None, help="comma-separated timm names")
    p.add_argument("--batch", type=int, default=None, help="memory/suggest/frontier batch (32)")
    p.add_argument("--image", type=int, default=None, help="image size (224; tiny: 64)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds of the frontier (5)")
    p.add_argument("--budget", default=None, help="suggest's budget, e.g. 6GiB (default: auto)")
    p.add_argument("--compile-models", default=None, help="models for the inductor section")
    p.add_argument("--derive-models", default=None, help="models for the derive section")
    p.add_argument("--compile-levels", default="0,1,2,3,4,5", help="levels to compile")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--compile-rtol", type=float, default=1e-5)
    p.add_argument(
        "--frontier-batch",
        default=None,
        help="the frontier's batch: a number, or 'auto', the batch at which eager level 0 "
        "allocates --share of the device (default auto; tiny: --batch)",
    )
    p.add_argument("--share", type=float, default=0.4, help="device share for 'auto' (0.4)")
    p.add_argument("--amp", default=None, choices=sorted(AMP), help="frontier autocast (bf16)")
    p.add_argument(
        "--frontier-compile",
        default=None,
        help="models whose compiled variants the frontier measures (default resnet50, "
        "vit_small_patch16_224, convnext_tiny; tiny: resnet18); 'none' for none",
    )
    p.add_argument("--frontier-levels", default="2,3,5", help="levels compiled in the frontier")
    p.add_argument("--budgets", default="0.5", help="compile's activation_memory_budget values")
    p.add_argument("--out", default=None, help="folder for results.json and table.md")
    p.add_argument("--render", default=None, metavar="JSON", help="print the tables of a run")
    p.add_argument(
        "--first-step",
        nargs=3,
        metavar=("MODEL", "LEVEL", "OUT"),
        default=None,
        help="(internal) the first section's worker: one step in this fresh process",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.tiny = "cpu", True
        args.reps = 1 if args.reps is None else args.reps
    models = TINY_MODELS if args.tiny else FULL_MODELS
    args.models = _split(args.models) or list(models)
    args.sections = _split(args.sections)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; allowed: {', '.join(SECTIONS)}")
    args.batch = args.batch or (8 if args.tiny else 32)
    args.image = args.image or (64 if args.tiny else 224)
    args.reps = args.reps or (2 if args.tiny else 5)
    default_compiled = ["resnet18"] if args.tiny else ["vit_small_patch16_224", "resnet50"]
    args.compile_models = _split(args.compile_models) or default_compiled
    args.compile_levels = [int(v) for v in _split(args.compile_levels)]
    args.frontier_batch = args.frontier_batch or (str(args.batch) if args.tiny else "auto")
    if args.frontier_batch != "auto" and not args.frontier_batch.isdigit():
        p.error(f"--frontier-batch {args.frontier_batch!r}: a positive number or 'auto'")
    args.amp = args.amp or ("fp32" if args.tiny else "bf16")
    default_frontier = ["resnet18"] if args.tiny else ["resnet50", "vit_small_patch16_224"]
    default_frontier += [] if args.tiny else ["convnext_tiny"]
    args.frontier_compile = (
        [] if args.frontier_compile == "none" else _split(args.frontier_compile) or default_frontier
    )
    args.frontier_levels = [int(v) for v in _split(args.frontier_levels)]
    args.budgets = [float(v) for v in _split(args.budgets)]
    args.derive_models = _split(args.derive_models) or list(
        TINY_DERIVE_MODELS if args.tiny else DERIVE_MODELS
    )
    if args.out is None:
        args.out = (
            tempfile.mkdtemp(prefix="gpu_check_")
            if args.dry_run
            else str(
                Path(__file__).parent / "results" / ("gpu_check_tiny" if args.tiny else "gpu_check")
            )
        )
    return args


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


# --------------------------------------------------------------------------------------------
# Rendering (pure: from the JSON a run wrote)
# --------------------------------------------------------------------------------------------


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f}"


def _num(v: float | None, fmt: str = ".2e") -> str:
    return "-" if v is None else format(v, fmt)


def _yes(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "**no**")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def render(results: dict[str, Any]) -> str:
    """The markdown tables of a run's ``results.json``.

    >>> print(render({"meta": {"device": "cpu"}, "sections": {"exact": [
    ...     {"model": "m", "level": 1, "exact": True, "max_abs": 0.0,
    ...      "plain_reproducible": True}]}}))  # doctest: +NORMALIZE_WHITESPACE
    # gpu_check on cpu
    <BLANKLINE>
    ## exact: levels 0-5 against no checkpointing (fp32, deterministic)
    <BLANKLINE>
    | model | level | exact | max abs diff | plain reproducible | error |
    |---|---|---|---|---|---|
    | m | 1 | yes | 0.00e+00 | yes |  |
    <BLANKLINE>
    All checks passed.
    """
    meta = results.get("meta", {})
    out = [f"# gpu_check on {meta.get('device', '?')}"]
    if meta.get("command"):
        out += ["", f"`{meta['command']}` ({meta.get('torch', '?')}, {meta.get('date', '')})"]
    if meta.get("note"):
        out += ["", meta["note"]]
    sections = results.get("sections", {})
    for name, rows in sections.items():
        out += ["", f"## {name}: {_TITLES.get(name, '')}".rstrip(": "), ""]
        out += _RENDERERS[name](rows)
    failed = failures(results)
    out += ["", f"**{len(failed)} failed check(s)**" if failed else "All checks passed."]
    out += [f"- {f}" for f in failed]
    return "\n".join(out) + "\n"


_TITLES = {
    "exact": "levels 0-5 against no checkpointing (fp32, deterministic)",
    "replay": "dropout/drop-path replay with fused attention",
    "first": "the first step of a fresh process, against a plain one's",
    "memory": "predicted peak against the measured one, per level",
    "suggest": "suggest_level / plan_for_budget, their plan run at the batch",
    "inductor": "torch.compile against eager, per level",
    "frontier": "memory and time per level against timm's switch",
    "derive": "levels derived on the device (derive_preset), each measured there",
}


def _render_exact(rows: list[dict[str, Any]]) -> list[str]:
    return _table(
        ["model", "level", "exact", "max abs diff", "plain reproducible", "error"],
        [
            [
                r["model"],
                str(r["level"]),
                _yes(r.get("exact")),
                _num(r.get("max_abs")),
                _yes(r.get("plain_reproducible")),
                r.get("error") or "",
            ]
            for r in rows
        ],
    )


def _render_first(rows: list[dict[str, Any]]) -> list[str]:
    return _table(
        ["model", "dtype", "variant", "max rel diff", "ok", "error"],
        [
            [
                r["model"],
                r.get("dtype", ""),
                r["variant"],
                _num(r.get("max_rel")),
                _yes(r.get("ok")),
                r.get("error") or "",
            ]
            for r in rows
        ],
    )


def _render_replay(rows: list[dict[str, Any]]) -> list[str]:
    return _table(
        [
            "model",
            "dtype",
            "backend",
            "region",
            "scope",
            "max rel diff",
            "plain vs plain",
            "ok",
            "error",
        ],
        [
            [
                r["model"],
                r["dtype"],
                r["backend"],
                f"{r['region']} (L{r['level']})",
                r["scope"],
                _num(r.get("max_rel")),
                _num(r.get("baseline_rel")),
                _yes(r.get("ok")),
                r.get("error") or "",
            ]
            for r in rows
        ],
    )


def _render_memory(rows: list[dict[str, Any]]) -> list[str]:
    return _table(
        [
            "model",
            "batch",
            "level",
            "meter",
            "predicted MB",
            "measured MB",
            "pred/meas",
            "reserved MB",
            "tracker MB",
            "error",
        ],
        [
            [
                r["model"],
                str(r.get("batch", "")),
                str(r["level"]),
                r.get("meter", ""),
                _mb(r.get("predicted")),
                _mb(r.get("measured")),
                _num(r.get("ratio"), ".3f"),
                _mb(r.get("reserved")),
                _mb(r.get("tracked")),
                r.get("error") or "",
            ]
            for r in rows
        ],
    )


def _render_suggest(rows: list[dict[str, Any]]) -> list[str]:
    return _table(
        [
            "model",
            "kind",
            "batch",
            "budget MB",
            "chose",
            "predicted MB",
            "allocated MB",
            "reserved MB",
            "allocated fits",
            "reserved fits",
            "error",
        ],
        [
            [
                r["model"],
                r["kind"],
                str(r.get("batch", "")),
                _mb(r.get("budget")),
                str(r.get("chose", "-")),
                _mb(r.get("predicted")),
                _mb(r.get("allocated")),
                _mb(r.get("reserved")),
                _yes(r.get("fits_allocated")),
                _yes(r.get("fits_reserved")),
                r.get("error") or "",
            ]
            for r in rows
        ],
    )


def _render_inductor(rows: list[dict[str, Any]]) -> list[str]:
    return _table(
        ["model", "level", "backend", "max rel diff", "vs compiled L0", "ok", "compile s", "error"],
        [
            [
                r["model"],
                str(r["level"]),
                r.get("backend", ""),
                _num(r.get("max_rel")),
                _num(r.get("max_rel_l0")),
                _yes(r.get("ok")),
                _num(r.get("compile_s"), ".1f"),
                r.get("error") or "",
            ]
            for r in rows
        ],
    )


def _render_frontier(rows: list[dict[str, Any]]) -> list[str]:
    """One row per variant; ``alloc/L0`` against the same model's eager level 0 (compiled
    variants also against compiled level 0); ``time/ref`` against eager ``L0``, or ``c:L0``
    for a compiled variant."""
    l0 = {r["model"]: r.get("allocated") for r in rows if r.get("variant") == "L0"}
    c0 = {r["model"]: r.get("allocated") for r in rows if r.get("variant") == "c:L0"}

    def ratio(r: dict[str, Any], ref: dict[str, Any]) -> str:
        if r.get("alloc_ratio") is not None:  # rows of older runs carry their own
            return _num(r["alloc_ratio"], ".2f")
        a, b = r.get("allocated"), ref.get(r["model"])
        return _num(a / b, ".2f") if a and b else "-"

    return _table(
        [
            "model",
            "batch",
            "amp",
            "variant",
            "regions",
            "not compiled",
            "allocated MB",
            "device share",
            "alloc/L0",
            "alloc/c:L0",
            "time s",
            "time/ref",
            "error",
        ],
        [
            [
                r["model"],
                str(r.get("batch", "")),
                r.get("amp", "fp32"),
                r["variant"] + (f" (= {r['same_as']})" if r.get("same_as") else ""),
                str(r.get("regions", "")),
                str(r.get("not_compiled", "")) if r["variant"].startswith("c:L") else "",
                _mb(r.get("allocated")),
                _num(r.get("share"), ".0%"),
                ratio(r, l0),
                ratio(r, c0) if r["variant"].startswith("c:") else "",
                _num(r.get("time_s"), ".3f"),
                _num(r.get("time_ratio"), ".2f") + ("x" if r.get("time_ratio") else ""),
                r.get("error") or "",
            ]
            for r in rows
        ],
    )


def _render_derive(rows: list[dict[str, Any]]) -> list[str]:
    out = _table(
        [
            "model",
            "variant",
            "predicted MB",
            "measured MB",
            "above start MB",
            "tracked MB",
            "reserved MB",
            "alloc/L0",
            "time/L0",
            "exact",
            "error",
        ],
        [
            [
                r["model"],
                r["variant"]
                + (
                    f" (= {', '.join(f'D{k}' for k in r['same_as_above'])})"
                    if r.get("same_as_above")
                    else ""
                ),
                _mb(r.get("predicted")),
                _mb(r.get("allocated")),
                _mb(r.get("allocated_step")),
                _mb(r.get("tracked")),
                _mb(r.get("reserved")),
                _num(r.get("alloc_ratio"), ".2f"),
                _num(r.get("time_ratio"), ".2f") + ("x" if r.get("time_ratio") else ""),
                _yes(r.get("exact")),
                r.get("error") or "",
            ]
            for r in rows
        ],
    )
    out += ["", *_derive_summary(rows)]
    return out


def _derive_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per model: derivation time, the first derived level at or under half of level 0's
    allocated peak and its time, the top against the model's own switch.

    >>> rows = [{"model": "m", "variant": "L0", "derive_s": 9.0, "alloc_ratio": 1.0},
    ...         {"model": "m", "variant": "D1", "alloc_ratio": 0.7, "time_ratio": 1.05},
    ...         {"model": "m", "variant": "D2", "alloc_ratio": 0.4, "time_ratio": 1.2},
    ...         {"model": "m", "variant": "own", "alloc_ratio": 0.8, "time_ratio": 1.3}]
    >>> _derive_summary(rows)
    ['- m: derived in 9 s; first level <= 0.5x L0: D2 (0.40x, 1.20x time); top D2 0.50x own switch']
    """
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("alloc_ratio") is not None]
        levels = [r for r in mine if r["variant"].startswith("D")]
        head = f"- {model}: " + ", ".join(
            f"derived in {r['derive_s']:.0f} s" for r in mine if r.get("derive_s") is not None
        )
        half = next((r for r in levels if r["alloc_ratio"] <= 0.5), None)
        head += "; first level <= 0.5x L0: " + (
            f"{half['variant']} ({half['alloc_ratio']:.2f}x, {half['time_ratio']:.2f}x time)"
            if half
            else "none"
        )
        own = next((r for r in mine if r["variant"] == "own"), None)
        if levels and own:
            top = levels[-1]
            head += (
                f"; top {top['variant']} {top['alloc_ratio'] / own['alloc_ratio']:.2f}x own switch"
            )
        out.append(head)
    return out


_RENDERERS: dict[str, Callable[[list[dict[str, Any]]], list[str]]] = {
    "exact": _render_exact,
    "replay": _render_replay,
    "first": _render_first,
    "memory": _render_memory,
    "suggest": _render_suggest,
    "inductor": _render_inductor,
    "frontier": _render_frontier,
    "derive": _render_derive,
}


def failures(results: dict[str, Any]) -> list[str]:
    """One line per failed check of a run (errors included).

    >>> failures({"sections": {"memory": [{"model": "m", "level": 2, "ratio": 0.9}]}})
    ['memory m L2: predicted 0.900x of the measured peak (an underestimate over 5%)']
    """
    out = []
    for section, rows in results.get("sections", {}).items():
        for r in rows:
            where = f"{section} {r.get('model', '?')}" + (f" L{r['level']}" if "level" in r else "")
            if r.get("error"):
                out.append(f"{where}: {r['error']}")
            elif (
                section in ("exact", "derive")
                and r.get("plain_reproducible")
                and r.get("exact") is False
                and r.get("variant") != "own"  # the model's own switch is reported, not ours
            ):
                out.append(f"{where}: not exact (max abs diff {r.get('max_abs')})")
            elif section in ("replay", "inductor", "first") and r.get("ok") is False:
                detail = ", ".join(
                    f"{k} {r[k]}" for k in ("dtype", "backend", "region", "scope") if k in r
                )
                out.append(
                    f"{where}: max rel diff {r.get('max_rel')}" + (f" ({detail})" if detail else "")
                )
            elif section == "memory" and r.get("ratio") is not None and r["ratio"] < 0.95:
                out.append(
                    f"{where}: predicted {r['ratio']:.3f}x of the measured peak (an "
                    "underestimate over 5%)"
                )
            elif section == "suggest" and r.get("fits_allocated") is False:
                out.append(f"{where} ({r['kind']}): its real step allocated over the budget")
            elif (
                section == "suggest"
                and r.get("chose", "-") is None
                and r.get("level5")
                and r["budget"] >= 1.1 * r["level5"]
            ):
                out.append(
                    f"{where} ({r['kind']}): nothing chosen, though level 5 measured "
                    f"{r['level5'] / 1e6:.0f} MB against a {r['budget'] / 1e6:.0f} MB budget"
                )
    return out


# --------------------------------------------------------------------------------------------
# Building models and running steps
# --------------------------------------------------------------------------------------------


def build(name: str, options: dict[str, Any], *, drop: float = 0.0, **extra: Any) -> nn.Module:
    """A timm model (``pretrained=False``, 10 classes) in training mode, seed 0."""
    import timm

    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"num_classes": 10, "drop_rate": drop, **options, **extra}
    if not name.startswith(NO_DROP_PATH):
        kwargs["drop_path_rate"] = drop
    return timm.create_model(name, pretrained=False, **kwargs).train()


def _data(batch: int, image: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, image, image, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return x.to(device), y.to(device)


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def train_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    seed: int = 1,
    autocast: torch.dtype | None = None,
    forward_ctx: Callable[[], Any] = contextlib.nullcontext,
    step_ctx: Callable[[], Any] = contextlib.nullcontext,
) -> dict[str, torch.Tensor]:
    """One training step from ``seed``; the output and every gradient, detached."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    device = x.device.type
    with step_ctx():
        with forward_ctx(), torch.autocast(device, autocast, enabled=autocast is not None):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
    got = {"<output>": out.detach().float().clone()}
    plain = getattr(model, "_orig_mod", model)  # a compiled module's parameters, by their names
    for n, p in plain.named_parameters():
        if p.grad is not None:
            got[n] = p.grad.detach().float().clone()
    return got


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(largest absolute difference, largest difference relative to the tensor's magnitude)
    over the output and every gradient; ``inf`` when a gradient is missing on one side.

    >>> a = {"w": torch.tensor([1.0, -4.0])}
    >>> compare(a, {"w": torch.tensor([1.0, -3.0])})
    (1.0, 0.3333333333333333)
    """
    if got.keys() != ref.keys():
        return float("inf"), float("inf")
    worst_abs = worst_rel = 0.0
    for k, r in ref.items():
        d = (got[k] - r).abs().max().item() if r.numel() else 0.0
        scale = r.abs().max().item() if r.numel() else 0.0
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / scale if scale else (0.0 if d == 0 else float("inf")))
    return worst_abs, worst_rel


@contextlib.contextmanager
def deterministic(device: str) -> Iterator[None]:
    """Deterministic algorithms (warn-only: a model that needs a non-deterministic kernel is
    still run, and its plain model's two runs tell whether it reproduces)."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:]


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text[:300]


def _applied(base: nn.Module, level: int, device: str) -> nn.Module:
    import vision_ckpt

    model = copy.deepcopy(base).to(device)
    vision_ckpt.apply_preset(model, level)
    return model


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def check_exact(args: argparse.Namespace, models: dict[str, dict[str, Any]]) -> list[dict]:
    rows = []
    x, y = _data(2, args.image, args.device)
    for name in args.models:
        with deterministic(args.device):
            base = build(name, models[name], drop=0.1).to(args.device)
            ref = train_step(copy.deepcopy(base), x, y)
            again = train_step(copy.deepcopy(base), x, y)
            reproducible = compare(again, ref)[0] == 0.0
            for level in LEVELS:
                row: dict[str, Any] = {"model": name, "level": level}
                row["plain_reproducible"] = reproducible
                try:
                    got = train_step(_applied(base, level, args.device), x, y)
                    row["max_abs"] = compare(got, ref)[0]
                    row["exact"] = row["max_abs"] == 0.0
                except Exception as exc:  # noqa: BLE001 - one failure is a row, not the run
                    row["error"] = _error(exc)
                rows.append(row)
                _progress("exact", row)
        _free(args.device)
    return rows


def first_step(name: str, level: int, args: argparse.Namespace, out: str) -> None:
    """One training step, the first of this process (``--first-step`` runs it): the model of
    ``name`` at ``level`` (0: plain), bf16 autocast where the device has it, dropout on; its
    output and gradients saved to ``out``."""
    import vision_ckpt

    device = args.device
    options = (TINY_MODELS if args.tiny else FULL_MODELS).get(name, {})
    model = build(name, options, drop=0.1, attn_drop_rate=0.1).to(device)
    if level:
        vision_ckpt.apply_preset(model, level)
    x, y = _data(2, args.image, device)
    bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
    torch.save(train_step(model, x, y, autocast=torch.bfloat16 if bf16 else None), out)


def check_first(args: argparse.Namespace, models: dict[str, dict[str, Any]]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_first_") as tmp:
        for name in args.models:
            family = next((f for f in REPLAY_LEVELS if name.startswith(f)), None)
            if family is None:
                continue
            variants = {"plain": 0, "plain again": 0}
            variants.update({f"{k} (L{v})": v for k, v in REPLAY_LEVELS[family].items()})
            grads: dict[str, Any] = {}
            errors: dict[str, str] = {}
            for variant, level in variants.items():
                out = str(Path(tmp) / f"{len(grads) + len(errors)}.pt")
                argv = [sys.executable, __file__, "--first-step", name, str(level), out]
                argv += ["--image", str(args.image), "--device", args.device]
                argv += ["--tiny"] if args.tiny else []
                done = subprocess.run(argv, capture_output=True, text=True, check=False)
                if done.returncode == 0:
                    grads[variant] = torch.load(out)
                else:
                    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    errors[variant] = last.replace("|", "/")[:300]
            bf16 = args.device.startswith("cuda") and torch.cuda.is_bf16_supported()
            # the device's own run-to-run difference: two plain first steps
            noise = (
                compare(grads["plain again"], grads["plain"])[1]
                if {"plain", "plain again"} <= grads.keys()
                else 0.0
            )
            for variant in variants:
                row: dict[str, Any] = {"model": name, "variant": variant}
                row["dtype"] = "bf16" if bf16 else "fp32"
                if variant in errors:
                    row["error"], row["ok"] = errors[variant], False
                elif variant != "plain" and "plain" in grads:
                    row["max_rel"] = compare(grads[variant], grads["plain"])[1]
                    if not variant.startswith("plain"):
                        row["ok"] = row["max_rel"] <= noise
                rows.append(row)
                _progress("first", row)
    return rows


def _sdpa_backends(device: str) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    if device.startswith("cuda"):
        return {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
        }
    return {"math": SDPBackend.MATH}  # a CPU dry run: SDPA with dropout has no fused kernel


def check_replay(args: argparse.Namespace, models: dict[str, dict[str, Any]]) -> list[dict]:
    from torch.nn.attention import sdpa_kernel

    rows = []
    x, y = _data(2, args.image, args.device)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for name in args.models:
        family = next((f for f in REPLAY_LEVELS if name.startswith(f)), None)
        if family is None:
            continue
        base = build(name, models[name], drop=0.1, attn_drop_rate=0.1).to(args.device)
        for dname, dtype in dtypes.items():
            for bname, backend in _sdpa_backends(args.device).items():

                def kernel(backend: Any = backend) -> Any:
                    return sdpa_kernel([backend])

                for scope in ("step", "forward"):
                    ctx = {"forward_ctx": kernel} if scope == "forward" else {"step_ctx": kernel}
                    try:
                        ref = train_step(copy.deepcopy(base), x, y, autocast=dtype, **ctx)
                        again = train_step(copy.deepcopy(base), x, y, autocast=dtype, **ctx)
                        baseline = compare(again, ref)[1]
                    except Exception as exc:  # noqa: BLE001
                        rows.append(
                            {
                                "model": name,
                                "dtype": dname,
                                "backend": bname,
                                "region": "-",
                                "level": 0,
                                "scope": scope,
                                "error": "plain: " + _error(exc),
                            }
                        )
                        continue
                    for region, level in REPLAY_LEVELS[family].items():
                        row: dict[str, Any] = {
                            "model": name,
                            "dtype": dname,
                            "backend": bname,
                            "region": region,
                            "level": level,
                            "scope": scope,
                            "baseline_rel": baseline,
                        }
                        try:
                            model = _applied(base, level, args.device)
                            got = train_step(model, x, y, autocast=dtype, **ctx)
                            row["max_rel"] = compare(got, ref)[1]
                            row["ok"] = row["max_rel"] <= 4 * baseline
                        except Exception as exc:  # noqa: BLE001
                            row["error"] = _error(exc)
                        rows.append(row)
                        _progress("replay", row)
        _free(args.device)
    return rows


def _workload(model: nn.Module, x: torch.Tensor, optimizer: Any) -> Any:
    from vision_ckpt.measure._measure import Workload, default_loss

    return Workload(model, x, default_loss, optimizer)


def check_memory(args: argparse.Namespace, models: dict[str, dict[str, Any]]) -> list[dict]:
    from vision_ckpt.measure._extrapolate import extrapolated_peak, peak_measurer
    from vision_ckpt.measure._measure import measure_memory, meter_for, run_step

    rows = []
    x, _ = _data(2, args.image, args.device)
    meter = meter_for(args.device).name
    for name in args.models:
        base = build(name, models[name])
        for level in LEVELS:
            row: dict[str, Any] = {"model": name, "level": level, "batch": args.batch}
            row["meter"] = meter
            try:
                model = _applied(base, level, args.device)
                work = _workload(model, x, torch.optim.AdamW(model.parameters(), lr=1e-4))
                run_step(work, x)  # the optimizer's state, as in training
                row["predicted"] = extrapolated_peak(peak_measurer(work), args.batch)[0]
                step = measure_memory(work, work.batch(args.batch))
                row["measured"], row["reserved"], row["tracked"] = (
                    step.deciding,
                    step.reserved,
                    step.peak,
                )
                row["ratio"] = row["predicted"] / row["measured"]
                del model, work
            except Exception as exc:  # noqa: BLE001
                row["error"] = _error(exc)
            rows.append(row)
            _progress("memory", row)
            _free(args.device)
    return rows


def _real_peak(model: nn.Module, x: torch.Tensor) -> tuple[int, int | None]:
    """(deciding, reserved) peak of a warmed-up step at ``x``'s batch, AdamW included."""
    from vision_ckpt.measure._measure import measure_memory, run_step

    work = _workload(model, x, torch.optim.AdamW(model.parameters(), lr=1e-4))
    run_step(work, x)
    step = measure_memory(work, x)
    return step.deciding, step.reserved


def check_suggest(
    args: argparse.Namespace, models: dict[str, dict[str, Any]], memory: list[dict]
) -> list[dict]:
    import vision_ckpt
    from vision_ckpt.config import parse_memory_budget
    from vision_ckpt.tune.profiling import plan_for_budget, suggest_level

    rows = []
    x, _ = _data(2, args.image, args.device)
    big = _data(args.batch, args.image, args.device)[0]
    for name in args.models:
        base = build(name, models[name])
        try:
            peaks = {
                r["level"]: r["measured"]
                for r in memory
                if r["model"] == name and r["level"] in (0, 5) and r.get("measured")
            }
            for level in (0, 5):
                if level not in peaks:
                    peaks[level] = _real_peak(_applied(base, level, args.device), big)[0]
            # default: halfway between level 5's peak and level 0's, and 10% over level 5's
            budget = (
                parse_memory_budget(args.budget)
                if args.budget is not None
                else int(max((peaks[0] + peaks[5]) / 2, 1.1 * peaks[5]))
            )
        except Exception as exc:  # noqa: BLE001
            rows.append({"model": name, "kind": "suggest", "error": "budget: " + _error(exc)})
            continue
        for kind in ("suggest", "planner"):
            row: dict[str, Any] = {"model": name, "kind": kind, "batch": args.batch}
            row["budget"], row["level5"] = budget, peaks[5]
            try:
                model = copy.deepcopy(base).to(args.device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                if kind == "suggest":
                    s = suggest_level(model, x, budget, batch_size=args.batch, optimizer=opt)
                    row["explain"] = s.explain()
                    row["chose"] = s.level
                    if s.level is not None:
                        row["predicted"] = s.predicted[s.level].peak
                        vision_ckpt.apply_preset(model, s.level)
                else:
                    p = plan_for_budget(model, x, budget, batch_size=args.batch, optimizer=opt)
                    row["explain"] = p.explain()
                    row["chose"] = f"{len(p.blocks)} blocks" if p.config is not None else None
                    row["predicted"] = p.measurement.peak
                    if p.config is not None:
                        vision_ckpt.apply(model, p.config)
                if row["chose"] is not None:
                    row["allocated"], row["reserved"] = _real_peak(model, big)
                    row["fits_allocated"] = row["allocated"] <= budget
                    if row["reserved"] is not None:
                        row["fits_reserved"] = row["reserved"] <= budget
                del model, opt
            except Exception as exc:  # noqa: BLE001
                row["error"] = _error(exc)
            rows.append(row)
            _progress("suggest", row)
            _free(args.device)
    return rows


def check_inductor(args: argparse.Namespace, models: dict[str, dict[str, Any]]) -> list[dict]:
    rows = []
    x, y = _data(2, args.image, args.device)
    for name in args.compile_models:
        options = {**FULL_MODELS, **TINY_MODELS}.get(name, {})
        base = build(name, options).to(args.device)
        compiled_plain: Any = None  # the compiled step without checkpointing (level 0)
        for level in sorted(args.compile_levels):
            row: dict[str, Any] = {"model": name, "level": level}
            row["backend"] = args.compile_backend
            try:
                torch._dynamo.reset()
                ref = train_step(_applied(base, level, args.device), x, y)
                compiled = torch.compile(
                    _applied(base, level, args.device), backend=args.compile_backend
                )
                started = time.perf_counter()
                got = train_step(compiled, x, y)
                row["compile_s"] = time.perf_counter() - started
                row["max_rel"] = compare(got, ref)[1]
                if level == 0:
                    compiled_plain = got
                # The compiler's own rounding (level 0 against eager) is not checkpointing's:
                # a level passes when it matches eager, or the compiled step at level 0.
                if compiled_plain is not None:
                    row["max_rel_l0"] = compare(got, compiled_plain)[1]
                row["ok"] = min(row["max_rel"], row.get("max_rel_l0", math.inf)) <= (
                    args.compile_rtol
                )
            except Exception as exc:  # noqa: BLE001
                row["error"] = _error(exc)
            rows.append(row)
            _progress("inductor", row)
        _free(args.device)
    return rows


def _alone_peaks(
    variants: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor, device: str
) -> tuple[dict[str, dict[str, int | None]], dict[str, str]]:
    """Each variant alone on the device (the allocator's peak counts every tensor there): a
    warmed-up step's peaks, above the allocation the step started from on CUDA. Returns the
    peaks by variant and the errors by variant."""
    from vision_ckpt.measure._measure import Workload, measure_memory

    peaks: dict[str, dict[str, int | None]] = {}
    errors: dict[str, str] = {}
    for v, model in variants.items():
        try:
            model.to(device)
            train_step(model, x, y)  # warm-up (cuDNN autotuning, workspaces)
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
            step = measure_memory(Workload(model, x, functools.partial(_ce, y=y)), x)
            peaks[v] = {
                "allocated": step.deciding,
                "reserved": step.reserved,
                "tracked": step.activation,
                "allocated_step": step.deciding - start if step.allocated else step.activation,
            }
        except Exception as exc:  # noqa: BLE001
            errors[v] = _error(exc)
        finally:
            model.zero_grad(set_to_none=True)
            model.to("cpu")
            _free(device)
    return peaks, errors


# What a CPU dry run sizes ``--frontier-batch auto`` against, in place of a device's memory.
CPU_STAND_IN_BYTES = 2**30


def _device_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return CPU_STAND_IN_BYTES


def _frontier_data(batch: int, image: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch drawn on the device itself (a batch that fills a card takes seconds
    to draw on the host)."""
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch, 3, image, image, generator=gen, device=device)
    y = torch.randint(0, 10, (batch,), generator=gen, device=device)
    return x, y


def _frontier_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: Any) -> None:
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, amp, enabled=amp is not None):
        out = model(x)
    F.cross_entropy(out.float(), y).backward()


def _frontier_peak(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: Any
) -> dict[str, int | None]:
    """A warmed-up step's peaks (the warm-up compiles a compiled variant). On CUDA the
    allocator's: absolute (``allocated``: parameters, gradients and everything else on the
    device) and above the step's start, and the reserved peak. On CPU the CPU allocator's
    records of a profiled step: compiled kernels allocate there too, where the byte tracker's
    dispatch mode sees none of their intermediates."""
    device = x.device.type
    _frontier_step(model, x, y, amp)
    model.zero_grad(set_to_none=True)
    _free(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        _frontier_step(model, x, y, amp)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        model.zero_grad(set_to_none=True)
        return {"allocated": peak, "allocated_step": peak - start, "reserved": reserved}
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        _frontier_step(model, x, y, amp)
    model.zero_grad(set_to_none=True)
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = best = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        best = max(best, live)
    return {"allocated": best, "allocated_step": best, "reserved": None}


def batch_that_matters(
    base: nn.Module, args: argparse.Namespace, amp: Any
) -> tuple[int, dict[str, Any]]:
    """The batch at which eager level 0 allocates at least ``args.share`` of the device, a
    multiple of 8. Level 0's absolute peak at two small batches gives a line (activations grow
    with the batch, parameters and gradients do not); the batch it names is measured, and while
    that peak falls outside ``share`` to 1.25 ``share`` of the device the line through the last
    two measurements names the next one (three tries at most). Returns the batch and the
    figures it came from."""
    model = copy.deepcopy(base).to(args.device)
    target = args.share * _device_bytes(args.device)

    def peak(b: int) -> int:
        x, y = _frontier_data(b, args.image, args.device)
        try:
            return _frontier_peak(model, x, y, amp)["allocated"] or 0
        finally:
            del x, y
            _free(args.device)

    seen = [(b, peak(b)) for b in ((8, 16) if args.tiny else (16, 32))]
    batch = seen[-1][0]
    for _ in range(3):
        (b0, p0), (b1, p1) = sorted(seen[-2:])
        per_sample = max(1.0, (p1 - p0) / (b1 - b0))
        batch = max(8, 8 * math.ceil((b1 + (target - p1) / per_sample) / 8))
        if batch in dict(seen):
            break
        seen.append((batch, peak(batch)))
        if target <= seen[-1][1] <= 1.25 * target:
            break
    model.to("cpu")
    _free(args.device)
    return batch, {"tried": seen, "target": target}


def _budget_backend(backend: str, budget: float) -> Callable[..., Any]:
    """``backend`` with torch.compile's activation-memory solver at ``budget``. The budget is
    read when the backward graph is partitioned, which happens inside the backend call; the
    AOT autograd cache is off there so that no partition made under another budget is reused.
    One callable per budget: dynamo guards on the backend, so copies of one model class
    compiled for different budgets do not share a graph."""
    inner = torch._dynamo.lookup_backend(backend)

    def compile_under_budget(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        with torch._functorch.config.patch(
            activation_memory_budget=budget, enable_autograd_cache=False
        ):
            return inner(gm, example_inputs)

    return compile_under_budget


def _plan_signature(plan: Any, level: int) -> tuple[str, ...]:
    """What a level's plan runs: its regions with their rungs, and its lean MLPs."""
    return (
        *(f"{n}: {plan[n].rung_at(level)}" for n in plan.checkpointed),
        *(f"lean {e.name}" for e in plan.entries if e.lean_at(level)),
    )


def _frontier_variants(
    base: nn.Module, name: str, args: argparse.Namespace, compiled: bool
) -> tuple[dict[str, nn.Module], dict[str, dict[str, Any]]]:
    """The frontier's variants of one model and what each is: eager levels 0-5 and the
    model's own switch, or (``compiled``) level 0, the levels of ``--frontier-levels``,
    compile's budget at each of ``--budgets`` and the switch, each under ``torch.compile``;
    a level whose plan is an earlier level's is left out of the compiled set."""
    import vision_ckpt

    variants: dict[str, nn.Module] = {}
    info: dict[str, dict[str, Any]] = {}
    prefix = "c:" if compiled else ""
    seen: dict[tuple[str, ...], str] = {}
    levels = [0, *args.frontier_levels] if compiled else list(LEVELS)
    for level in levels:
        model = copy.deepcopy(base)
        plan = vision_ckpt.apply_preset(model, level)
        key = _plan_signature(plan, level)
        v = f"{prefix}L{level}"
        info[v] = {"regions": len(plan.checkpointed), "not_compiled": len(plan.not_compiled)}
        if key in seen and level:
            info[v]["same_as"] = seen[key]
            if compiled:
                continue
        seen.setdefault(key, v)
        variants[v] = model
    if compiled:
        for budget in args.budgets:
            v = f"c:budget{budget:g}"
            variants[v] = torch.compile(
                copy.deepcopy(base), backend=_budget_backend(args.compile_backend, budget)
            )
            info[v] = {"regions": 0, "budget": budget}
        for v in [v for v in variants if v.startswith("c:L")]:
            variants[v] = torch.compile(variants[v], backend=args.compile_backend)
    switch = copy.deepcopy(base)
    switch.set_grad_checkpointing(True)
    v = f"{prefix}timm"
    variants[v] = torch.compile(switch, backend=args.compile_backend) if compiled else switch
    info[v] = {"regions": -1}
    return variants, info


def _frontier_rows(
    name: str,
    batch: int,
    args: argparse.Namespace,
    variants: dict[str, nn.Module],
    info: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """Each variant's peaks alone on the device, then every live variant's step time over
    interleaved rounds (ratios to eager ``L0`` and, for compiled variants, to ``c:L0``)."""
    amp = AMP[args.amp]
    x, y = _frontier_data(batch, args.image, args.device)
    peaks: dict[str, dict[str, int | None]] = {}
    errors: dict[str, str] = {}
    warm_s: dict[str, float] = {}
    for v, model in variants.items():
        try:
            model.to(args.device)
            started = time.perf_counter()
            peaks[v] = _frontier_peak(model, x, y, amp)
            warm_s[v] = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a row, not a stop
            errors[v] = _error(exc)
        finally:
            model.zero_grad(set_to_none=True)
            model.to("cpu")
            _free(args.device)
    live = {v: m for v, m in variants.items() if v not in errors}
    step = functools.partial(_frontier_step, y=y, amp=amp)
    times, ratios = _interleaved_steps(live, x, args.device, args.reps, step)
    rows = []
    for v in info:
        row: dict[str, Any] = {"model": name, "batch": batch, "amp": args.amp, "variant": v}
        row.update(info[v])
        if v in errors:
            row["error"] = errors[v]
        elif v in peaks:
            row.update(peaks[v])
            row["share"] = (peaks[v]["allocated"] or 0) / _device_bytes(args.device)
            row["time_s"] = statistics.median(times[v]) if times.get(v) else None
            row["time_ratio"] = statistics.median(ratios[v]) if ratios.get(v) else None
            if v.startswith("c:"):
                row["warm_s"] = warm_s[v]  # the first step: compilation
        rows.append(row)
    return rows


def _interleaved_steps(
    variants: dict[str, nn.Module],
    x: torch.Tensor,
    device: str,
    reps: int,
    step: Callable[..., None],
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step seconds of every variant over ``reps`` rounds, the order rotating from round to
    round, and each round's ratio to ``L0``'s (or, for a compiled variant, to ``c:L0``'s)."""
    live = list(variants)
    for model in variants.values():
        model.to(device)
    times: dict[str, list[float]] = {v: [] for v in live}
    ratios: dict[str, list[float]] = {v: [] for v in live}
    try:
        for round_ in range(reps):
            shift = round_ * len(live) // max(1, reps)
            this: dict[str, float] = {}
            for v in live[shift:] + live[:shift]:
                _sync(device)
                start = time.perf_counter()
                step(variants[v], x)
                _sync(device)
                this[v] = time.perf_counter() - start
                times[v].append(this[v])
            for v in live:
                ref = "c:L0" if v.startswith("c:") and "c:L0" in this else "L0"
                if ref in this:
                    ratios[v].append(this[v] / this[ref])
    finally:
        for model in variants.values():
            model.zero_grad(set_to_none=True)
            model.to("cpu")
        _free(device)
    return times, ratios


def check_frontier(args: argparse.Namespace, models: dict[str, dict[str, Any]]) -> list[dict]:
    """Eager first for every model (levels 0-5 and the switch at the batch that matters), then
    the compiled variants of ``--frontier-compile``'s models at the same batch, with eager
    ``L0`` beside them for the ratio. Rows are written as each model finishes."""
    rows: list[dict[str, Any]] = []
    batches: dict[str, int] = {}
    for name in args.models:
        base = build(name, models[name])
        try:
            if args.frontier_batch == "auto":
                batches[name], how = batch_that_matters(base, args, AMP[args.amp])
            else:
                batches[name], how = int(args.frontier_batch), {}
            variants, info = _frontier_variants(base, name, args, compiled=False)
            model_rows = _frontier_rows(name, batches[name], args, variants, info)
            for r in model_rows:
                r.update({f"auto_{k}": v for k, v in how.items()} if r["variant"] == "L0" else {})
        except Exception as exc:  # noqa: BLE001
            model_rows = [{"model": name, "variant": "*", "error": _error(exc)}]
        for r in model_rows:
            rows.append(r)
            _progress("frontier", r)
        _free(args.device)
    for name in args.frontier_compile:
        if name not in batches:
            continue
        base = build(name, models.get(name, {}))
        torch._dynamo.reset()
        try:
            variants, info = _frontier_variants(base, name, args, compiled=True)
            variants, info = {"L0": copy.deepcopy(base), **variants}, {"L0": {}, **info}
            model_rows = _frontier_rows(name, batches[name], args, variants, info)[1:]
        except Exception as exc:  # noqa: BLE001
            model_rows = [{"model": name, "variant": "c:*", "error": _error(exc)}]
        for r in model_rows:
            rows.append(r)
            _progress("frontier", r)
        torch._dynamo.reset()
        _free(args.device)
    return rows


def _derived_variants(base: nn.Module, found: Any) -> dict[str, nn.Module]:
    """Level 0, every derived level that runs a plan of its own, and the model's own switch."""
    import vision_ckpt

    variants = {"L0": copy.deepcopy(base)}
    for lv in found.levels:
        if lv.same_as is None:
            variants[f"D{lv.level}"] = copy.deepcopy(base)
            vision_ckpt.apply(variants[f"D{lv.level}"], found.config(lv.level))
    if hasattr(base, "set_grad_checkpointing"):
        variants["own"] = copy.deepcopy(base)
        variants["own"].set_grad_checkpointing(True)
    return variants


def _derived_exact(
    base: nn.Module, variants: dict[str, nn.Module], device: str, image: int
) -> dict[str, dict[str, Any]]:
    """Each variant's step at batch 2 against the plain model's, deterministic, dropout on."""
    x, y = _data(2, image, device)
    out: dict[str, dict[str, Any]] = {}
    with deterministic(device):
        plain = copy.deepcopy(base).to(device)
        ref = train_step(plain, x, y)
        reproducible = compare(train_step(plain, x, y), ref)[0] == 0.0
        del plain
        for v, model in variants.items():
            try:
                got = train_step(copy.deepcopy(model).to(device), x, y)
                max_abs = compare(got, ref)[0]
                out[v] = {"max_abs": max_abs, "exact": max_abs == 0.0}
            except Exception as exc:  # noqa: BLE001
                out[v] = {"error": _error(exc)}
            out[v]["plain_reproducible"] = reproducible
            _free(device)
    return out


def check_derive(args: argparse.Namespace, models: dict[str, dict[str, Any]]) -> list[dict]:
    from vision_ckpt.tune import derive_preset

    rows = []
    for name in args.derive_models:
        x, y = _data(args.batch, args.image, args.device)
        base = build(name, models.get(name, {}), drop=0.1)
        try:
            model = copy.deepcopy(base).to(args.device)
            found = derive_preset(model, x[:2].clone(), args.batch)
            del model
        except Exception as exc:  # noqa: BLE001
            rows.append({"model": name, "variant": "*", "error": _error(exc)})
            _progress("derive", rows[-1])
            continue
        finally:
            _free(args.device)
        variants = _derived_variants(base, found)
        exact = _derived_exact(base, variants, args.device, args.image)
        memory, errors = _alone_peaks(variants, x, y, args.device)
        live = {v: m for v, m in variants.items() if v not in errors}
        step = functools.partial(train_step, y=y)
        times, ratios = _interleaved_steps(live, x, args.device, args.reps, step)
        derived = {f"D{lv.level}": lv for lv in found.levels}
        for v in variants:
            row: dict[str, Any] = {"model": name, "batch": args.batch, "variant": v}
            row.update(exact[v])
            if v == "L0":
                row["derive_s"] = round(found.seconds, 1)
                row["predicted"] = found.plain.peak
            if v in derived:
                row["predicted"] = derived[v].measurement.peak
                row["same_as_above"] = [
                    lv.level for lv in found.levels if lv.same_as == derived[v].level
                ]
            if v in errors:
                row["error"] = errors[v]
            elif v in memory:
                row.update(memory[v])
                row["time_ratio"] = statistics.median(ratios[v]) if ratios[v] else None
                if "L0" in memory:
                    row["alloc_ratio"] = (
                        memory[v]["allocated_step"] / memory["L0"]["allocated_step"]
                    )
            rows.append(row)
            _progress("derive", row)
        del variants, live, base
        _free(args.device)
    return rows


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


# The run in progress and where it is written: every row is on disk as soon as it is measured,
# so a run stopped at a time limit keeps what it measured (a lent GPU's minutes are few).
_LIVE: dict[str, Any] = {}


def _write(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "table.md").write_text(render(results))


def _progress(section: str, row: dict[str, Any]) -> None:
    shown = {k: v for k, v in row.items() if k not in ("explain",)}
    print(f"[{section}] {shown}", flush=True)
    if _LIVE:
        _LIVE["results"]["sections"].setdefault(section, []).append(row)
        _write(_LIVE["results"], _LIVE["out"])


def _meta(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    import timm

    import vision_ckpt

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    device = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    )
    return {
        "device": f"{args.device} ({device or platform.machine()})",
        "torch": torch.__version__,
        "timm": timm.__version__,
        "vision_ckpt": vision_ckpt.__version__,
        "commit": commit,
        "command": "python benchmarks/gpu_check.py " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tiny": args.tiny,
        "batch": args.batch,
        "image": args.image,
    }


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Run the chosen sections; the results as written to ``results.json``."""
    models = TINY_MODELS if args.tiny else FULL_MODELS
    unknown = [m for m in args.models if m not in models]
    extra = {m: {} for m in unknown}  # any other timm name runs with its defaults
    models = {**models, **extra}
    results: dict[str, Any] = {"meta": _meta(args, argv), "sections": {}, "seconds": {}}
    checks: dict[str, Callable[[], list[dict]]] = {
        "exact": lambda: check_exact(args, models),
        "replay": lambda: check_replay(args, models),
        "first": lambda: check_first(args, models),
        "memory": lambda: check_memory(args, models),
        "suggest": lambda: check_suggest(args, models, results["sections"].get("memory", [])),
        "inductor": lambda: check_inductor(args, models),
        "frontier": lambda: check_frontier(args, models),
        "derive": lambda: check_derive(args, models),
    }
    _LIVE.update(results=results, out=Path(args.out))
    try:
        for section in args.sections:  # in the order given: the first ones matter most
            started = time.perf_counter()
            try:
                rows = checks[section]()
            except Exception as exc:  # noqa: BLE001 - a broken section must not lose the others
                traceback.print_exc()
                rows = [{"model": "*", "error": _error(exc)}]
            results["sections"][section] = rows
            results["seconds"][section] = round(time.perf_counter() - started, 1)
            _write(results, Path(args.out))
    finally:
        _LIVE.clear()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render is not None:
        print(render(json.loads(Path(args.render).read_text())), end="")
        return 0
    if args.first_step is not None:
        name, level, out = args.first_step
        first_step(name, int(level), args, out)
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); this script "
            "is for a machine with a GPU. To run the same code path on CPU with tiny models: "
            "python benchmarks/gpu_check.py --dry-run",
            file=sys.stderr,
        )
        return 2
    # cuBLAS reads this when it is first used: the exact section's deterministic matmuls
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # The frontier compiles several copies of one model class: each is a recompilation of
    # the same code, which dynamo stops compiling after its default limit.
    limits = {"recompile_limit": 64, "accumulated_recompile_limit": 1024}
    limits |= {"cache_size_limit": 64, "accumulated_cache_size_limit": 1024}  # older names
    for knob, value in limits.items():
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, value)
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    results = run(args, argv)
    out = Path(args.out)
    _write(results, out)
    print(render(results))
    print(f"wrote {out / 'results.json'} and {out / 'table.md'}")
    return 1 if failures(results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
