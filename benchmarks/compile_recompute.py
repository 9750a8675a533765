"""Does a compiled backward recompute checkpointed regions one at a time, as eager does?

A model's first stage (its first few blocks, the memory-dense ones), each block checkpointed
with torch's own ``torch.utils.checkpoint`` (what vision_ckpt hands torch under
``torch.compile``), runs one training step (forward, sum, backward) per variant:

- ``eager plain`` / ``eager``: no checkpointing, and per-block checkpointing, uncompiled;
- ``aot_eager``: compiled, AOTAutograd's partition run by eager kernels;
- ``inductor``: compiled with inductor, as users compile;
- ``inductor, no peak reorder``: inductor with ``reorder_for_peak_memory`` off;
- ``aot_eager, own subgraphs`` / ``inductor, own subgraphs``: each block's checkpoint called
  inside a subgraph of its own (``torch.compiler.nested_compile_region``), as vision_ckpt
  compiles an outermost region (NOTE [ A region is its own subgraph ] in
  ``vision_ckpt/runtime/_traced.py``).

Measured: the step's peak by the profiler's allocator events (the meter that sees inside
compiled kernels), and the activation bytes the partitioner saves for backward (from
AOTAutograd's forward graph, the same partition inductor compiles; parameters left out).
Eager holds the saved inputs plus one block's recomputation; a compiled backward that holds
more schedules the recomputation of several blocks together. Compare within one model only
(the rows share one process).

    python benchmarks/compile_recompute.py --out benchmarks/results/compile_recompute
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from bench_frontier import live_bytes  # noqa: E402  (a script beside this one: the same meter)

STAGES: dict[str, tuple[Callable[[nn.Module], nn.Module], tuple[int, ...]]] = {
    # model: (its first stage's blocks, the stage's input shape without the batch). No
    # BatchNorm: torch's compiled checkpoint would update its statistics in recomputation too.
    "convnext_tiny": (lambda m: m.stages[0].blocks, (96, 56, 56)),
    "vit_small_patch16_224": (lambda m: m.blocks[:3], (197, 384)),
    "swin_tiny_patch4_window7_224": (lambda m: m.layers[0].blocks, (56, 56, 96)),
}


def _checkpointed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, use_reentrant=False)


def _in_subgraph(run: Callable[..., torch.Tensor], block: nn.Module, x: torch.Tensor) -> Any:
    return run(block, x)


_SUBGRAPH = torch.compiler.nested_compile_region(_in_subgraph)


def _own_subgraph(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's checkpoint called through one shared subgraph, with torch's checkpoint as
    an argument, as vision_ckpt calls an outermost region (dynamo then traces every call and
    shares one body between identical blocks)."""
    run = functools.partial(checkpoint, use_reentrant=False)
    return _SUBGRAPH(run, block, x)


class _PerBlock(nn.Module):
    """The blocks in order, each checkpointed by torch (or not, with ``ckpt=False``), each
    through a subgraph with ``subgraphs=True``."""

    def __init__(self, blocks: nn.Module, ckpt: bool, subgraphs: bool = False) -> None:
        super().__init__()
        self.blocks, self.ckpt = blocks, ckpt
        self.call = _own_subgraph if subgraphs else _checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.call(block, x) if self.ckpt else block(x)
        return x


def _peak(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """The step's peak by the profiler's allocator events, above what was alive before it."""
    gc.collect()
    cpu = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
        fn(x).sum().backward()
    _, live = live_bytes(prof.profiler.kineto_results.events())
    return max([0, *live])


def saved_tensors(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> Iterator[tuple[Any, Any]]:
    """The nodes and fake values of the tensors a partitioned forward graph saves for backward:
    its outputs after the step's own (``num_fwd_outputs``, as the partitioner is told)."""
    for node in list(fw.graph.nodes)[-1].args[0][num_fwd_outputs:]:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            yield node, value


def write_results(script: str, args: argparse.Namespace, rows: list[dict]) -> None:
    """``results.json`` in ``args.out``: the command that reproduces it, the environment, rows."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = f"torch {torch.__version__}, timm {timm.__version__}, {platform.machine()}, 1 thread"
    command = f"python benchmarks/{script} " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    (out / "results.json").write_text(
        json.dumps({"command": command, "env": meta, "rows": rows}, indent=1) + "\n"
    )


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """The bytes of activations AOTAutograd's min-cut partition saves for backward: the
    forward graph's outputs after the first, less the parameters it hands on (graph inputs
    of another shape than ``x``)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    saved = [0]

    def partition(joint: Any, inputs: Any, **kw: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        for node, value in saved_tensors(fw, kw["num_fwd_outputs"]):
            if node.op == "placeholder" and value.shape != x.shape:
                continue  # a parameter, alive anyway
            saved[0] += value.numel() * value.element_size()
        return fw, bw

    def backend(gm: Any, inputs: Any) -> Any:
        def boxed(g: Any, _: Any) -> Any:
            return make_boxed_func(g)

        return aot_module_simplified(
            gm, inputs, fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition
        )

    torch._dynamo.reset()
    torch.compile(module, backend=backend, dynamic=False)(x).sum().backward()
    return saved[0]


def _variant(name: str, blocks: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    module = _PerBlock(blocks, ckpt=name != "eager plain", subgraphs="own subgraphs" in name)
    fn: Callable[[torch.Tensor], torch.Tensor] = module
    reorder = inductor_config.reorder_for_peak_memory
    try:
        if name.startswith("inductor"):
            inductor_config.reorder_for_peak_memory = "no peak reorder" not in name
            fn = torch.compile(module, dynamic=False)
        elif name.startswith("aot_eager"):
            fn = torch.compile(module, backend="aot_eager", dynamic=False)
        fn(x).sum().backward()  # compile and warm up
        return {"variant": name, "peak_mb": round(_peak(fn, x) / 1e6, 1)}
    finally:
        inductor_config.reorder_for_peak_memory = reorder


VARIANTS = (
    "eager plain",
    "eager",
    "aot_eager",
    "inductor",
    "inductor, no peak reorder",
    "aot_eager, own subgraphs",
    "inductor, own subgraphs",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(STAGES))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", default="compile_recompute_out")
    args = p.parse_args()
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False  # each variant compiles under its own settings
    rows = []
    for model_name in args.models.split(","):
        stage_of, shape = STAGES[model_name]
        torch.manual_seed(0)
        # drop-path off: a random operator's state is saved with a size the trace leaves open
        blocks = stage_of(timm.create_model(model_name, pretrained=False, drop_path_rate=0.0))
        x = torch.randn(args.batch_size, *shape, requires_grad=True)
        saved = _saved_bytes(_PerBlock(blocks, ckpt=True), x)
        for name in VARIANTS:
            row = {"model": model_name, "batch": args.batch_size, **_variant(name, blocks, x)}
            row["saved_mb"] = round(saved / 1e6, 1) if name != "eager plain" else None
            rows.append(row)
            print(row, flush=True)
    write_results("compile_recompute.py", args, rows)


if __name__ == "__main__":
    main()
