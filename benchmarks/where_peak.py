"""Where a training step's peak comes: the module calls around it, forward or backward.

One training step (forward, cross-entropy, backward) of a timm model at a level
(``pretrained=False``, synthetic 224 px data, CPU) runs under ``torch.profiler`` with its memory
events; every module call down to ``--depth`` name components is labelled with a
``record_function`` range (``F`` in forward, ``B`` when backward recomputes it). The running sum
of allocations minus frees gives the peak, as in ``bench_frontier.py``'s ``prof peak`` column;
printed are the peak, the aten operators that were running at that instant, and the last
labelled calls before it (a peak in backward comes after the recomputation of the block whose
backward is running). This is how the preset changes of the frontier work found their places,
e.g.::

    python benchmarks/where_peak.py --model resnet50 --level 3 --depth 2
    python benchmarks/where_peak.py --model efficientnet_b0 --level 4 --depth 4

A level's recomputation calls the checkpointed module's own forward directly, so that module
itself has no label in backward; its children do.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
from typing import Any

import timm
import torch
import torch.nn.functional as F
from bench_frontier import live_bytes  # a sibling script: run from this folder's path
from torch import nn

import vision_ckpt


def _labelled(model: nn.Module, depth: int) -> contextlib.ExitStack:
    """Global module hooks that open a ``record_function`` range per call of a module of
    ``model`` whose name has at most ``depth`` components."""
    names = {id(m): n for n, m in model.named_modules() if n and n.count(".") < depth}
    open_ranges: list[tuple[nn.Module, Any]] = []

    def pre(module: nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is not None:
            phase = "B" if torch._C._current_graph_task_id() != -1 else "F"
            rf = torch.autograd.profiler.record_function(f"{phase} {name}")
            rf.__enter__()
            open_ranges.append((module, rf))

    def post(module: nn.Module, args: Any, out: Any) -> None:
        if open_ranges and open_ranges[-1][0] is module:
            open_ranges.pop()[1].__exit__(None, None, None)

    stack = contextlib.ExitStack()
    stack.callback(torch.nn.modules.module.register_module_forward_pre_hook(pre).remove)
    stack.callback(torch.nn.modules.module.register_module_forward_hook(post).remove)
    return stack


def where_peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor, depth: int) -> dict[str, Any]:
    """The step's profiler peak in bytes, the operators running at it and the labelled calls
    before it (name, live MB when the call began, most live MB during it)."""
    F.cross_entropy(model(x), y).backward()  # a first step: gradients and caches exist
    for p in model.parameters():
        p.grad = None
    gc.collect()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with (
        _labelled(model, depth),
        torch.profiler.profile(
            activities=activities, profile_memory=True, record_shapes=True
        ) as prof,
    ):
        F.cross_entropy(model(x), y).backward()
    events = list(prof.profiler.kineto_results.events())
    stamps, live = live_bytes(events)  # the meter of bench_frontier.py's prof peak
    peak = max(live)
    at = stamps[live.index(peak)]

    def running(e: Any) -> bool:
        return e.start_ns() <= at <= e.start_ns() + e.duration_ns()

    ops = [e for e in events if e.name().startswith("aten::") and running(e)]
    ops.sort(key=lambda e: e.duration_ns(), reverse=True)
    calls = []
    for e in sorted(
        (e for e in events if e.name()[:2] in ("F ", "B ")), key=lambda e: e.start_ns()
    ):
        if e.start_ns() > at:
            break
        i = bisect.bisect_left(stamps, e.start_ns())
        j = bisect.bisect_right(stamps, e.start_ns() + e.duration_ns())
        begin = live[i - 1] if i else 0
        calls.append((e.name(), begin / 1e6, max(live[max(i - 1, 0) : j] or [0]) / 1e6))
    return {
        "peak_mb": peak / 1e6,
        "ops": [(e.name(), [list(s) for s in e.shapes()[:3]]) for e in ops[:4]],
        "calls": calls,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="a timm model name")
    parser.add_argument("--level", default="3", help="a training level 0-5, or 'timm'")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2, help="name components to label")
    parser.add_argument("--last", type=int, default=8, help="labelled calls to print")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False).train()
    if args.level == "timm":
        model.set_grad_checkpointing(True)
    else:
        vision_ckpt.apply_preset(model, int(args.level))
    x = torch.randn(args.batch_size, 3, 224, 224)
    y = torch.randint(0, model.num_classes, (args.batch_size,))
    found = where_peak(model, x, y, args.depth)
    print(
        f"{args.model} level {args.level} batch {args.batch_size}: peak {found['peak_mb']:.0f} MB"
    )
    for name, shapes in found["ops"]:
        print(f"  running: {name} {shapes}")
    print("  last calls before the peak (live MB at their start, most live MB during them):")
    for name, begin, most in found["calls"][-args.last :]:
        print(f"    {name:48s} {begin:8.0f} {most:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
