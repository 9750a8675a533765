"""Any model on the command line (issue 27): ``--model`` specs read without eval, with clear
errors; ``--input-shape`` for 2D and 3D; a loss that fits the output; ``profile`` and ``fit`` as
a new user types them on an smp U-Net, a MONAI SwinUNETR (3D), a Hugging Face ViT from a config
and a timm name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from vision_ckpt.cli.main import main
from vision_ckpt.measure import ModelSpecError, build_model
from vision_ckpt.measure.models import (
    default_input_shape,
    output_loss,
    own_switch,
    parse_input_shape,
    parse_spec,
)

UNET = (
    'smp:Unet(encoder_name="resnet18", encoder_weights=None, classes=2, encoder_depth=3, '
    "decoder_channels=(16, 8, 4))"
)
SWIN3D = (
    "monai:SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1), "
    'num_heads=(1, 1, 1, 1), norm_name="batch")'
)
HF_VIT = (
    "hf:ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, "
    "num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8, num_labels=3))"
)


# --- reading specs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("foo:Bar()", r"cannot import module 'foo' .*known libraries: timm, smp, monai, torch"),
        ("smp:Unet(classes=2", r"not a Python call .*expected 'timm_name', 'library:Name\("),
        ("smp:", r"nothing after the library"),
        ("smp:Unet(encoder_name=os.getcwd())", r"'os.getcwd' is not a plain name"),
        ("smp:Unet(classes=1 + 1)", r"argument '1 \+ 1' is not a literal"),
        ("smp:Unet(**{'classes': 2})", r"\*\*kwargs is not allowed"),
        ("smp:Unet(*[2])", r"\*args is not allowed"),
        ("smp:Unet(x=__import__('os'))", r"'__import__' is private"),
        ("smp:nets.Unet()", r"must be a public plain name"),
        ("smp:Unet(encoder_name=resnet34)", r"argument 'resnet34' is not a literal"),
        ("1-2:Unet()", r"'1-2' is neither a known library nor a module path"),
    ],
)
def test_malformed_specs_quote_the_spec_and_the_expected_form(spec: str, message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        parse_spec(spec) if "import module" not in message else build_model(spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("smp:Unett()", r"segmentation_models_pytorch has no 'Unett'; did you mean: Unet"),
        ("hf:vitconfig()", r"transformers has no 'vitconfig'; did you mean: ViTConfig"),
        ("monai:SwinUnetr()", r"monai.networks.nets has no 'SwinUnetr'; did you mean: SwinUNETR"),
        ("torchvision:deeplab_resnet50()", r"did you mean: deeplabv3_resnet50"),
        ("resnet_18", r"unknown timm model 'resnet_18'; did you mean: resnet18"),
        ("os:getcwd()", r"'os' is part of Python's standard library, not a model library"),
        (
            "vision_ckpt.measure.models:Any()",
            r"'Any' in vision_ckpt.measure.models comes from 'typing'",
        ),
        ("timm:resnet18(pretrained=True)", r"pretrained=True would download weights"),
        (
            "monai:SwinUNETR(in_channels=1)",
            r"SwinUNETR\(\.\.\.\) rejected its arguments: .*out_channels.*; it takes SwinUNETR\(",
        ),
        ("timm:resnet18(num_classes=2, bogus=1)", r"resnet18\(\.\.\.\) rejected its arguments"),
    ],
)
def test_unknown_names_suggest_close_matches(spec: str, message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        build_model(spec)


def test_a_missing_library_names_the_extra_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "segmentation_models_pytorch", None)  # import fails
    with pytest.raises(
        ModelSpecError,
        match=r"needs 'segmentation_models_pytorch'.*pip install \"vision_ckpt\[smp\]\"",
    ):
        build_model("smp:Unet()")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelSpecError, match=r'pip install "vision_ckpt\[hf\]"'):
        build_model("hf:ViTModel(ViTConfig())")


def test_specs_build_each_library_with_nested_calls_and_no_download() -> None:
    hf = build_model(HF_VIT)
    assert type(hf).__name__ == "ViTForImageClassification" and hf.config.hidden_size == 32
    unet = build_model(
        'smp:Unet(encoder_name="resnet18", classes=2, encoder_depth=3, decoder_channels=(16, 8, 4))'
    )  # no encoder_weights: None, not imagenet
    assert type(unet).__name__ == "Unet"
    swin = build_model(SWIN3D)
    assert type(swin).__name__ == "SwinUNETR"
    tv = build_model("torchvision:fcn_resnet50(weights=None, weights_backbone=None, num_classes=3)")
    assert type(tv).__name__ == "FCN"
    own = build_model('tests._models:make("vit")')  # package.module:function(...)
    assert type(own).__name__ == "TinyViT"
    vit = build_model("vit_tiny_patch16_224", img_size=32)
    assert vit.patch_embed.img_size == (32, 32)
    assert all(m.training for m in (hf, unet, swin, tv, own, vit))


def test_input_shapes() -> None:
    assert parse_input_shape("3,224,224") == (3, 224, 224)
    assert parse_input_shape("1x96x96x96") == (1, 96, 96, 96)
    for bad, message in [
        ("3,224", "has 2 sizes"),
        ("a,b,c", "not a list of positive sizes"),
        ("3,0,4", "not a list of positive sizes"),
    ]:
        with pytest.raises(ModelSpecError, match=message):
            parse_input_shape(bad)
    assert default_input_shape(build_model(HF_VIT)) == (3, 32, 32)
    assert default_input_shape(build_model(SWIN3D)) is None


# --- the loss that fits the output -----------------------------------------------------------


def test_output_loss_fits_logits_maps_hf_outputs_and_collections() -> None:
    import torch.nn.functional as F
    from transformers.modeling_outputs import BaseModelOutput, ImageClassifierOutput

    logits = torch.randn(4, 5, requires_grad=True)
    expected = F.cross_entropy(logits, torch.arange(4) % 5)
    assert torch.equal(output_loss(logits), expected)
    maps = torch.randn(2, 3, 4, 4, 4, requires_grad=True)  # 3D segmentation
    target = torch.arange(2 * 64).reshape(2, 4, 4, 4) % 3
    assert torch.equal(output_loss(maps), F.cross_entropy(maps, target))
    binary = torch.randn(2, 1, 4, 4)
    assert output_loss(binary).shape == () and output_loss(binary) > 0
    hf = ImageClassifierOutput(logits=logits)
    assert torch.equal(output_loss(hf), expected)
    feats = torch.randn(2, 7, 8)
    assert torch.equal(output_loss(BaseModelOutput(last_hidden_state=feats)), feats.square().mean())
    deep = (maps, maps[:, :, ::2, ::2, ::2])  # deep supervision: every head is trained
    loss = output_loss(deep)
    loss.backward()
    assert maps.grad is not None and maps.grad.abs().sum() > 0
    both = output_loss({"out": logits, "aux": logits})
    assert torch.allclose(both, 2 * expected)
    with pytest.raises(ModelSpecError, match="no floating-point tensor to build a loss from"):
        output_loss((torch.arange(3),))


def test_own_switches() -> None:
    assert own_switch(build_model(HF_VIT)).name == "activation_checkpointing_enable()"
    swin = build_model(SWIN3D)
    switch = own_switch(swin)
    assert switch.name == "use_checkpoint=True"
    switch.enable()
    assert all(m.use_checkpoint for m in swin.modules() if hasattr(m, "use_checkpoint"))
    switch.disable()
    assert not any(m.use_checkpoint for m in swin.modules() if hasattr(m, "use_checkpoint"))
    assert own_switch(build_model(UNET)) is None


# --- the command line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fit", "--model", "smp:Unett()", "--budget", "1GiB"], "did you mean: Unet"),
        (["profile", "--model", "zzz:Net()"], "known libraries: timm, smp"),
        (["fit", "--model", SWIN3D, "--budget", "1GiB"], "give --input-shape C,D,H,W"),
        (
            ["fit", "--model", "resnet18", "--budget", "1GiB", "--input-shape", "3,32"],
            "has 2 sizes",
        ),
        (
            ["fit", "--model", "resnet18", "--budget", "1GiB", "--batches", "2,x"],
            "--batches '2,x' is not a list",
        ),
        (
            ["fit", "--model", "resnet18", "--budget", "1GiB", "--batches", "3,2"],
            "expected two or three increasing",
        ),
        (
            [
                "fit",
                "--model",
                "resnet18",
                "--img-size",
                "32",
                "--input-shape",
                "3,32,32",
                "--budget",
                "1GiB",
            ],
            "not both",
        ),
    ],
)
def test_cli_errors_are_one_line_with_exit_code_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("vision-ckpt: error:"), err


def test_fit_and_profile_on_an_smp_unet(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "fit.json", tmp_path / "fit.png"
    argv = [
        "fit",
        "--model",
        UNET,
        "--input-shape",
        "3,32,32",
        "--budget",
        "512MiB",
        "--levels",
        "0,5",
        "--steps",
        "0",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "largest batch in 512.00 MiB" in text and "level 5 fits the largest batch" in text
    data = json.loads(out.read_text())
    rows = {r["label"]: r for r in data["rows"]}
    assert set(rows) == {"level 0", "level 5"}  # smp has no switch of its own
    assert rows["level 5"]["max_batch"] > rows["level 0"]["max_batch"] > 0
    assert rows["level 0"]["linear"] and rows["level 0"]["linear_error"] < 1e-6
    assert data["best_level"] == 5 and data["input_shape"] == [3, 32, 32]
    assert png.stat().st_size > 1000
    argv = [
        "profile",
        "--model",
        UNET,
        "--input-shape",
        "3,32,32",
        "--batch-size",
        "2",
        "--levels",
        "0,3",
        "--steps",
        "1",
    ]
    assert main(argv) == 0
    assert "Unet" in capsys.readouterr().out


def test_fit_and_profile_on_a_3d_monai_swinunetr(capsys) -> None:
    argv = [
        "fit",
        "--model",
        SWIN3D,
        "--input-shape",
        "1,32,32,32",
        "--budget",
        "1GiB",
        "--levels",
        "5",
        "--batches",
        "2,3",
        "--steps",
        "0",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "input (1, 32, 32, 32)" in text and "own switch (use_checkpoint=True)" in text
    argv = [
        "profile",
        "--model",
        SWIN3D,
        "--input-shape",
        "1,32,32,32",
        "--batch-size",
        "2",
        "--levels",
        "5",
        "--steps",
        "1",
    ]
    assert main(argv) == 0
    assert "(2, 1, 32, 32, 32)" in capsys.readouterr().out


def test_fit_and_profile_on_a_hugging_face_vit_from_a_config(tmp_path: Path, capsys) -> None:
    out = tmp_path / "hf.json"
    argv = ["fit", "--model", HF_VIT, "--budget", "256MiB", "--levels", "0,3", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["input_shape"] == [3, 32, 32]  # from the config's image_size and num_channels
    labels = [r["label"] for r in data["rows"]]
    assert labels == ["level 0", "level 3", "own switch (activation_checkpointing_enable())"]
    assert all(r["measurement"]["seconds"] > 0 for r in data["rows"])
    assert (
        main(["profile", "--model", HF_VIT, "--batch-size", "2", "--levels", "0,3", "--steps", "1"])
        == 0
    )
    capsys.readouterr()


def test_fit_on_a_timm_name_as_before(capsys) -> None:
    argv = [
        "fit",
        "--model",
        "resnet18",
        "--img-size",
        "32",
        "--budget",
        "256MiB",
        "--levels",
        "0,5",
        "--steps",
        "0",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "input (3, 32, 32)" in text and "own switch (set_grad_checkpointing())" in text
    assert "the own switch (set_grad_checkpointing())'s" in text


def test_fit_says_which_clock_its_times_are_on(capsys) -> None:
    argv = ["fit", "--model", "resnet18", "--img-size", "32", "--budget", "256MiB"]
    assert main([*argv, "--levels", "0,3", "--no-own-switch"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "modelled" in text and "priced from each operator's FLOPs" in text
    assert main([*argv, "--levels", "0", "--time", "measured", "--steps", "1", "-q"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "measured" in text and "medians of real steps" in text


def test_a_status_line_only_on_a_terminal_and_not_with_quiet(monkeypatch) -> None:
    import argparse

    from vision_ckpt.cli._inputs import make_console, working

    console = make_console()
    said: list[str] = []
    monkeypatch.setattr(type(console), "is_terminal", property(lambda self: True))
    monkeypatch.setattr(
        type(console), "status", lambda self, text: _Status(said, text), raising=True
    )
    with working(console, argparse.Namespace(quiet=False), "counting") as say:
        say("level 3: batch 2 (1 of 3)")
    assert said == ["counting", "level 3: batch 2 (1 of 3)"]
    with working(console, argparse.Namespace(quiet=True), "counting") as say:
        say("level 3")
    assert said == ["counting", "level 3: batch 2 (1 of 3)"]  # --quiet: nothing shown


class _Status:
    def __init__(self, said: list[str], text: str) -> None:
        self.said = said
        said.append(text)

    def __enter__(self) -> _Status:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, text: str) -> None:
        self.said.append(text)


def test_a_model_that_says_nothing_gets_224_with_a_note(capsys) -> None:
    argv = [
        "fit",
        "--model",
        'tests._models:make("densenet")',
        "--budget",
        "64MiB",
        "--levels",
        "0",
        "--steps",
        "0",
        "--no-own-switch",
    ]
    code = main(argv)
    text = capsys.readouterr().out
    assert "does not say what input it takes; using 3,224,224" in text
    assert code == 0, text


def test_fit_and_profile_resolve_a_derived_preset_for_any_model(tmp_path: Path, capsys) -> None:
    # the user's question for a model no preset knows, from the command line: `preset:
    # derived` in the config is derived for the model on synthetic input, then measured
    config = tmp_path / "derived.yaml"
    config.write_text("preset: derived\n")
    model = "torchvision:mnasnet0_5(weights=None, num_classes=10)"
    common = ["--model", model, "--input-shape", "3,32,32", "--config", str(config)]
    out = tmp_path / "fit.json"
    argv = ["fit", *common, "--budget", "256MiB", "--levels", "0,2", "--steps", "0"]
    assert main([*argv, "--no-own-switch", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "preset: derived, at batch 32" in text
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["level 2"]["max_batch"] > rows["level 0"]["max_batch"] > 0
    argv = ["profile", *common, "--batch-size", "4", "--levels", "0,2", "--steps", "1"]
    assert main(argv) == 0
    assert "preset: derived, at batch 4" in capsys.readouterr().out
