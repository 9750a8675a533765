"""What a compiled step keeps for backward: compile's memory budget beside our levels.

``torch.compile`` decides what a training step keeps for backward by a min-cut over the traced
graph (``torch._functorch.config.activation_memory_budget``); a checkpointed region forces its
operators' outputs to be recomputed instead, except those a selective region keeps
(``keep: heavy``). This script compiles one training step per variant the way inductor does
(inductor's decompositions, the min-cut partition) and reads the forward graph's outputs: the
tensors saved for backward, grouped by the operator that made them (parameters left out):

- ``compile@B``: the plain model under budget ``B``;
- ``cLk``: ``vision_ckpt.apply_preset(model, k)``, then compiled (budget 1.0).

A level whose plan runs a region between graphs (a region holding nested regions, see
``docs/compile.md``) is summed over its graphs and its eager part is not seen: compare the
levels that compile to one graph. Bytes scale with the batch; read the operators, not the
totals, against ``bench_frontier.py``'s peaks.

    python benchmarks/compile_saves.py --out benchmarks/results/compile_saves
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

import vision_ckpt

sys.path.insert(0, str(Path(__file__).parent))
from compile_recompute import saved_tensors, write_results  # noqa: E402  (a script beside this one)


def _saves(model: nn.Module, x: torch.Tensor, budget: float) -> collections.Counter[str]:
    """Bytes the partition saves for backward, by the saving operator, over the step's graphs."""
    import torch._inductor.compile_fx  # noqa: F401  (registers inductor's decompositions)
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    saved: collections.Counter[str] = collections.Counter()

    def partition(joint: Any, inputs: Any, **kw: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        for node, value in saved_tensors(fw, kw["num_fwd_outputs"]):
            if node.op == "placeholder":
                continue  # a graph input (a parameter or the batch), alive anyway
            target = node.target
            if isinstance(target, torch._ops.OpOverload):  # aten.convolution.default
                name = str(target).removeprefix("aten.").split(".")[0]
            else:  # operator.getitem: one output of an operator with several
                name = getattr(target, "__name__", str(target))
            saved[name] += value.numel() * value.element_size()
        return fw, bw

    backend = aot_autograd(
        fw_compiler=lambda g, _: make_boxed_func(g),
        bw_compiler=lambda g, _: make_boxed_func(g),
        partition_fn=partition,
        decompositions=select_decomp_table(),
    )
    torch._dynamo.reset()
    with torch._functorch.config.patch(
        activation_memory_budget=budget, enable_autograd_cache=False
    ):
        compiled = torch.compile(model, backend=backend, dynamic=False)
        compiled(x).float().square().mean().backward()
    return saved


def _row(model_name: str, variant: str, batch: int, saved: collections.Counter[str]) -> dict:
    total = sum(saved.values())
    top = ", ".join(f"{op} {b / 1e6:.1f}" for op, b in saved.most_common(4))
    return {
        "model": model_name,
        "batch": batch,
        "variant": variant,
        "saved_mb": round(total / 1e6, 1),
        "by_operator_mb": top,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50")
    p.add_argument("--variants", default="compile@1.0,compile@0.5,compile@0.2,cL1,cL2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", default="compile_saves_out")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for model_name in args.models.split(","):
        for variant in args.variants.split(","):
            torch.manual_seed(0)
            model = timm.create_model(model_name, pretrained=False, drop_path_rate=0.0).train()
            x = torch.randn(args.batch_size, 3, 224, 224)
            if variant.startswith("compile@"):
                saved = _saves(model, x, float(variant.removeprefix("compile@")))
            elif variant.startswith("cL"):
                vision_ckpt.apply_preset(model, int(variant.removeprefix("cL")))
                saved = _saves(model, x, 1.0)
            else:
                raise SystemExit(f"unknown variant {variant!r}; allowed: compile@B, cL0-cL5")
            rows.append(_row(model_name, variant, args.batch_size, saved))
            print(rows[-1], flush=True)
    write_results("compile_saves.py", args, rows)


if __name__ == "__main__":
    main()
