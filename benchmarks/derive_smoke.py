"""Derive levels for many models at a small batch: does every derivation finish, do the
measured peaks fall with the level, and is every level exact?

Not a measurement of time (the batch is small and the peaks are only checked for order): a
sweep for the failures a handful of tuned models cannot show, a region the trace finds that
``plan()`` refuses in combination, a menu with no option left. Each model: ``derive_preset`` at
its batch (default 8) on an input of two, then one step of the plain model and one at each
derived level that runs a plan of its own, from the same seed: the loss, every parameter
gradient and every buffer (BatchNorm statistics) compared bit for bit; and each such level's
preset, as written, measured at the batch as the derivation measured it: the same peak, to the
byte. Exits 1 if any model failed::

    python benchmarks/derive_smoke.py                    # 37 timm models of other families
    python benchmarks/derive_smoke.py --others           # torchvision, Hugging Face, smp, MONAI
    python benchmarks/derive_smoke.py --models ghostnet_100 edgenext_xx_small@224
    python benchmarks/derive_smoke.py --out derived.json \
        --models 'smp:Linknet(encoder_name="resnet18", encoder_weights=None, classes=2)@3,256,256'

An entry is a model spec (a timm name, or ``library:Name(...)`` as ``--model`` takes it), then
``@size`` for a timm model's image side (default 64) or ``@C,H,W`` / ``@C,D,H,W`` for the input,
then ``/batch``. ``--out`` writes each model's derived levels (peak, modelled time against level
0, the level whose plan it runs) as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
import traceback

import timm
import torch

import vision_ckpt
from vision_ckpt.measure._extrapolate import extrapolated_peak, peak_measurer
from vision_ckpt.measure._measure import Workload
from vision_ckpt.measure.models import (
    build_model,
    default_input_shape,
    output_loss,
    parse_input_shape,
)

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


# other libraries' models (a bundled preset, MONAI UNet's, is set aside as derive_preset always
# does), each at a size where its levels differ (a smaller input leaves the parameter gradients
# the whole peak)
OTHERS = (
    "torchvision:mobilenet_v3_small(weights=None)@3,64,64",
    "torchvision:mnasnet0_5(weights=None)@3,64,64",
    "torchvision:shufflenet_v2_x0_5(weights=None)@3,64,64",
    "torchvision:googlenet(weights=None, aux_logits=False, init_weights=True)@3,64,64",
    "torchvision:convnext_tiny(weights=None)@3,64,64",
    "torchvision:lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)"
    "@3,64,64",
    'smp:Linknet(encoder_name="resnet18", encoder_weights=None, classes=2)@3,128,128',
    'smp:PAN(encoder_name="resnet18", encoder_weights=None, classes=2)@3,128,128',
    'smp:UPerNet(encoder_name="resnet18", encoder_weights=None, classes=2)@3,128,128',
    'smp:Unet(encoder_name="efficientnet-b0", encoder_weights=None, classes=2)@3,64,64',
    "hf:SwinForImageClassification(SwinConfig(image_size=64, patch_size=4, embed_dim=32, "
    "depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=4, drop_path_rate=0.1))@3,64,64",
    "hf:BeitForImageClassification(BeitConfig(hidden_size=64, num_hidden_layers=4, "
    "num_attention_heads=4, intermediate_size=128, image_size=64, patch_size=8, "
    "use_relative_position_bias=True))@3,64,64",
    "hf:MobileViTForImageClassification(MobileViTConfig(image_size=64))@3,64,64",
    "hf:Swinv2ForImageClassification(Swinv2Config(image_size=64, patch_size=4, embed_dim=32, "
    "depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=4))@3,64,64",
    "hf:EfficientNetForImageClassification(EfficientNetConfig(image_size=64))@3,64,64",
    "monai:UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32, 64), "
    "strides=(2, 2, 2), num_res_units=2, dropout=0.1)@1,32,32,32",
    "monai:SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=8, "
    "dropout_prob=0.1)@1,32,32,32",
    "monai:AttentionUnet(spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32), "
    "strides=(2, 2))@1,32,32,32",
    "monai:DenseNet121(spatial_dims=3, in_channels=1, out_channels=2)@1,32,32,32",
    "monai:SegResNetDS(spatial_dims=3, in_channels=1, out_channels=2, init_filters=8)@1,32,32,32",
)


def _model_and_input(entry: str) -> tuple[torch.nn.Module, tuple[int, ...], int]:
    """The model of an entry (``spec[@size or @C,H,W][/batch]``), its sample shape and batch."""
    spec, _, batch = entry.partition("/")
    name, _, size = spec.rpartition("@") if "@" in spec else (spec, "", "")
    if ":" not in name:  # a bare timm name: ten classes, the image side alone
        img = int(size or 64)
        model = timm.create_model(name, pretrained=False, num_classes=10)
        return model, (3, img, img), int(batch or 8)
    model = build_model(name)
    shape = parse_input_shape(size) if size else default_input_shape(model)
    if shape is None:
        raise ValueError(f"{entry!r}: give the input shape, as @C,H,W")
    return model, shape, int(batch or 8)


def check(entry: str) -> dict[str, object]:
    """One model's derived levels (peaks in bytes, predicted times), or raises."""
    torch.manual_seed(0)
    model, shape, batch = _model_and_input(entry)
    model.train()
    example = torch.randn(2, *shape)
    found = vision_ckpt.tune.derive_preset(model, example, batch, loss_fn=output_loss, floor=False)
    peaks = [found.plain.peak] + [lv.measurement.peak for lv in found.levels]
    if any(b > a for a, b in zip(peaks, peaks[1:], strict=False)):
        raise AssertionError(f"a level's peak rose above the level below's: {peaks}")
    x = torch.randn(4, *shape)
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
        # the preset as written runs the plan the derivation measured (NOTE [ One rung per way ])
        work = Workload(derived, example, output_loss, None)
        written = extrapolated_peak(peak_measurer(work), batch, None, halfway=False)[0]
        if written != lv.measurement.peak:
            raise AssertionError(
                f"level {lv.level} as written peaks at {written} bytes, derived at "
                f"{lv.measurement.peak}"
            )
    return {
        "batch": batch,
        "input": list(shape),
        "peak0": found.plain.peak,
        "levels": [
            {
                "level": lv.level,
                "peak": lv.measurement.peak,
                # modelled, against level 0
                "time": lv.modelled.seconds / found.plain_modelled.seconds,
                "same_as": lv.same_as,
            }
            for lv in found.levels
        ],
    }


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


def results(found: dict[str, dict], command: str, label: str = "") -> dict[str, object]:
    """A results file: one row per model, each level's peak in MiB and modelled time against
    level 0 (or the level whose plan it runs), or why the model failed."""
    rows = []
    for entry, f in found.items():
        spec, _, batch = entry.partition("/")
        row: dict[str, object] = {"model": spec.rpartition("@")[0] or spec}
        if label:
            row["code"] = label
        row |= {"input": spec.rpartition("@")[2] if "@" in spec else "", "batch": int(batch or 8)}
        row["L0_mb"] = round(f["peak0"] / 2**20, 1) if "peak0" in f else None
        for lv in f.get("levels", [{"level": k} for k in range(1, 6)]):
            if "peak" not in lv:
                row[f"L{lv['level']}"] = None
            elif lv["same_as"]:
                row[f"L{lv['level']}"] = f"= L{lv['same_as']}"
            else:
                row[f"L{lv['level']}"] = f"{lv['peak'] / 2**20:.0f} MiB, {lv['time']:.2f}x"
        row["seconds"] = f.get("seconds")  # the derivation and the exactness steps
        row["failed"] = f.get("error", "")
        rows.append(row)
    return {
        "command": command,
        "clock": "none (peaks and modelled times are deterministic)",
        "meter": "storage",
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--others", action="store_true", help="the other libraries' models")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the derived levels here (JSON)")
    parser.add_argument("--label", default="", help="a column naming this run (the commit)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    entries = args.models or list(OTHERS if args.others else MODELS)
    failed, found = [], {}
    for entry in entries:
        started = time.perf_counter()
        try:
            found[entry] = check(entry)
        except Exception as exc:  # report and go on: the sweep is for finding them all
            failed.append(entry)
            found[entry] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            print(f"{entry}: FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=4)
            continue
        seconds = time.perf_counter() - started
        found[entry]["seconds"] = round(seconds, 1)
        peaks = [found[entry]["peak0"]] + [lv["peak"] for lv in found[entry]["levels"]]
        line = " ".join(f"{p / 2**20:.0f}" for p in peaks)
        print(f"{entry}: ok, peaks L0-L5 {line} MiB ({seconds:.0f} s)", flush=True)
    print(f"{len(entries) - len(failed)} of {len(entries)} derived; failed: {failed}")
    if args.out:
        command = "python benchmarks/derive_smoke.py " + shlex.join(argv or sys.argv[1:])
        with open(args.out, "w") as f:
            json.dump(results(found, command, args.label), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
