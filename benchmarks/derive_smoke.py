"""Derive levels for many timm models at a small batch: does every derivation finish, do the
measured peaks fall with the level, and is every level exact?

Not a measurement (the batch is small and the peaks are only checked for order): a sweep for the
failures a handful of tuned models cannot show, a region the trace finds that ``plan()``
refuses in combination, a menu with no option left. Each model: ``derive_preset`` at batch 8 on
an input of two, then one step of the plain model and one at each derived level that runs a
plan of its own, from the same seed: the loss, every parameter gradient and every buffer
(BatchNorm statistics) compared bit for bit. Exits 1 if any model failed::

    python benchmarks/derive_smoke.py
    python benchmarks/derive_smoke.py --models ghostnet_100 edgenext_xx_small@224

A model is a timm name, with ``@size`` for the image side (default 64; some models need
theirs).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback

import timm
import torch

import vision_ckpt
from vision_ckpt.models import output_loss

MODELS = (
    "mobilenetv3_small_100 regnetx_002 resnet18 deit_tiny_patch16_224@224 ghostnet_100 dla34 "
    "pvt_v2_b0 efficientformer_l1@224 coat_lite_tiny@224 mixer_s16_224@224 repvgg_a0 "
    "hrnet_w18_small tf_efficientnetv2_b0 maxvit_nano_rw_256@256 inception_v3@96 xception41@96 "
    "cspdarknet53 nfnet_l0 rexnet_100 convmixer_768_32 edgenext_xx_small@224 mobilevit_xxs@256 "
    "poolformer_s12@224 twins_svt_small@224 crossvit_tiny_240@240 levit_128s@224 "
    "mobilenetv4_conv_small efficientvit_m0@224 tiny_vit_5m_224@224 convnextv2_atto hgnetv2_b0 "
    "mambaout_femto gcvit_xxtiny@224 fastvit_sa12 resnest14d sequencer2d_s@224 "
    "inception_next_tiny"
).split()


def check(spec: str) -> str:
    """One model's line: the peaks in MiB from level 0 to 5, or raises."""
    name, _, size = spec.partition("@")
    img = int(size or 64)
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10).train()
    found = vision_ckpt.derive_preset(
        model, torch.randn(2, 3, img, img), 8, loss_fn=output_loss, floor=False
    )
    peaks = [found.peak0] + [lv.peak for lv in found.levels]
    if any(b > a for a, b in zip(peaks, peaks[1:], strict=False)):
        raise AssertionError(f"a level's peak rose above the level below's: {peaks}")
    x = torch.randn(4, 3, img, img)
    plain = _step(copy.deepcopy(model), x)
    for lv in found.levels:
        if lv.same_as is not None:  # runs the plan of a level already compared
            continue
        derived = copy.deepcopy(model)
        vision_ckpt.apply(derived, found.config(lv.level))
        if not _same(plain, _step(derived, x)):
            raise AssertionError(
                f"level {lv.level}'s loss, a gradient or a buffer differs from the plain model's"
            )
    return " ".join(f"{p / 2**20:.0f}" for p in peaks)


def _step(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One training step from a fixed seed: the loss, every parameter gradient and buffer."""
    torch.manual_seed(1)
    loss = output_loss(model(x))
    loss.backward()
    out = {"(loss)": loss.detach()}
    out.update((f"grad {n}", p.grad) for n, p in model.named_parameters() if p.grad is not None)
    out.update((f"buffer {n}", b) for n, b in model.named_buffers())
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    failed = []
    for spec in args.models:
        started = time.perf_counter()
        try:
            line = check(spec)
        except Exception as exc:  # report and go on: the sweep is for finding them all
            failed.append(spec)
            print(f"{spec}: FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=4)
            continue
        print(f"{spec}: ok, peaks L0-L5 {line} MiB ({time.perf_counter() - started:.0f} s)")
    print(f"{len(args.models) - len(failed)} of {len(args.models)} derived; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
