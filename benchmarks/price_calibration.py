"""The rates behind the modelled price (NOTE [ A modelled price ] in vision_ckpt/_price.py).

Times every operator of one training step (forward and backward) of a few timm models, on one
thread, and prints the FLOPs per second of the operators with FLOPs (convolutions, matrix
products, fused attention: ``_price.op_flops``) and the bytes per second of the rest (views
and ``aten._unsafe_view`` left out: ``_price.moves_nothing``). Their ratio is what the
modelled price's choices depend on.

    python benchmarks/price_calibration.py --batch-size 8 \
        --models resnet50 vit_small_patch16_224 convnext_tiny
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vision_ckpt._price import moves_nothing, op_flops


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_small_patch16_224"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    pooled = [0.0, 0.0, 0.0, 0.0]  # FLOPs, their seconds, bytes, their seconds
    for name in args.models:
        model = timm.create_model(name, pretrained=False)
        x = torch.randn(args.batch_size, 3, 224, 224)
        model(x).square().mean().backward()  # warm-up
        with _Timed() as timed:
            model(x).square().mean().backward()
        heavy = [r for r in timed.rows if r[1] > 0]
        light = [r for r in timed.rows if r[1] == 0]
        flops_rate = sum(r[1] for r in heavy) / sum(r[3] for r in heavy)
        bytes_rate = sum(r[2] for r in light) / sum(r[3] for r in light)
        pooled[0] += sum(r[1] for r in heavy)
        pooled[1] += sum(r[3] for r in heavy)
        pooled[2] += sum(r[2] for r in light)
        pooled[3] += sum(r[3] for r in light)
        print(
            f"{name}: heavy {flops_rate / 1e9:.0f} GFLOP/s over {sum(r[3] for r in heavy):.2f} s, "
            f"light {bytes_rate / 1e9:.2f} GB/s over {sum(r[3] for r in light):.2f} s, "
            f"ratio {flops_rate / bytes_rate:.1f} FLOPs per byte"
        )
        per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for op, _, moved, spent in light:
            per_op[op][0] += moved
            per_op[op][1] += spent
        slowest = sorted(per_op.items(), key=lambda kv: -kv[1][1])[:5]
        print(
            "  slowest light operators: "
            + ", ".join(f"{op} {m / s / 1e9:.1f} GB/s ({s:.2f} s)" for op, (m, s) in slowest)
        )
    flops_rate, bytes_rate = pooled[0] / pooled[1], pooled[2] / pooled[3]
    print(
        f"all models: heavy {flops_rate / 1e9:.0f} GFLOP/s, light {bytes_rate / 1e9:.2f} GB/s, "
        f"ratio {flops_rate / bytes_rate:.1f} FLOPs per byte"
    )


if __name__ == "__main__":
    main()
