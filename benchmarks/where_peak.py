"""Where a training step's peak comes: a command line over ``vision_ckpt.measure.peak.where_peak``.

One training step (forward, cross-entropy, backward) of a timm model at a level
(``pretrained=False``, synthetic data, CPU) runs under the library's attributing tracker; printed
are the peak of live tensor storage above the parameters and the input (the same bytes as
``bench_frontier.py``'s ``peak`` column), its phase, the aten operator that brought it and the
module call running it (also inside a recomputation), and what was live at that instant,
grouped by the module call that made it (NOTE [ Peak attribution ] in
``vision_ckpt/measure/peak.py``).
With ``--floor`` also the model's physical floor at the batch (NOTE [ The physical floor ]).
This is how the presets' rules were placed, e.g.::

    python benchmarks/where_peak.py --model resnet50 --level 3
    python benchmarks/where_peak.py --model efficientnet_b0 --level 4 --batch-size 8 --floor
    python benchmarks/where_peak.py --model vit_small_patch16_224 --level timm --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

from vision_ckpt.measure.peak import where_peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="a timm model name")
    parser.add_argument("--level", default="3", help="a training level 0-5, or 'timm'")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--groups", type=int, default=12, help="live groups to print")
    parser.add_argument("--floor", action="store_true", help="also measure the floor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False).train()
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    y = torch.randint(0, model.num_classes, (args.batch_size,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    if args.level == "timm":
        model.set_grad_checkpointing(True)
        report = where_peak(model, x, loss_fn, floor=args.floor)
    else:
        report = where_peak(model, x, loss_fn, level=int(args.level), floor=args.floor)
    print(f"{args.model} level {args.level} batch {args.batch_size} at {args.img_size} px")
    lines = str(report).splitlines()
    shown = [line for line in lines if not line.startswith("  ")]
    print("\n".join(shown))
    for group in [g for g in report.groups if g.kind != "input"][: args.groups]:
        print(f"  {group}")
    if args.json is not None:
        record = {
            "model": args.model,
            "level": args.level,
            "batch": args.batch_size,
            "img_size": args.img_size,
            **dataclasses.asdict(report),
        }
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
