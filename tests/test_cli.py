"""The vision-ckpt command line, through its entry function and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vision_ckpt.cli.main import main

TINY = ["--model", "resnet18", "--img-size", "32", "--batch-size", "2"]


def test_profile_prints_the_table_and_writes_json_and_plot(tmp_path: Path, capsys) -> None:
    out_json, out_png = tmp_path / "p.json", tmp_path / "p.png"
    code = main(
        [
            "profile",
            *TINY,
            "--levels",
            "0,5",
            "--steps",
            "1",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    for column in (
        "level",
        "regions",
        "peak",
        "activations",
        "saving vs 0",
        "step time",
        "slowdown",
        "frontier",
    ):
        assert column in text
    assert "On the memory/time frontier: L" in text
    data = json.loads(out_json.read_text())
    assert set(data["frontier"]) == {"0", "5"}
    assert all(
        v == "" or v.startswith(("dominated by L", "same as L")) for v in data["frontier"].values()
    )
    assert data["model"] == "resnet18" and data["batch_size"] == 2
    assert [e["level"] for e in data["levels"]] == [0, 5]
    for entry in data["levels"]:
        assert set(entry) >= {
            "level",
            "regions",
            "measurement",
            "activation_bytes",
            "saved_bytes",
            "backward_flops",
            "time_ratio",
            "saving",
            "skipped",
        }
        step = entry["measurement"]
        assert set(step) == {"peak", "batch", "meter", "seconds", "predicted"}
        assert isinstance(step["peak"], int) and step["peak"] > 0 and step["seconds"] > 0
        assert (step["batch"], step["meter"], step["predicted"]) == (2, "bytes", False)
    assert out_png.stat().st_size > 1000


def test_plan_lists_modules_with_their_level(capsys) -> None:
    assert main(["plan", "--model", "resnet18", "--level", "3"]) == 0
    text = capsys.readouterr().out
    assert "layer1.0" in text and "BasicBlock" in text


def test_suggest_accepts_both_budget_spellings(capsys) -> None:
    for budget in ("8GiB", "8 GB"):
        assert main(["suggest", *TINY[:4], "--batch-size", "4", "--budget", budget]) == 0
    assert "level 0 fits" in capsys.readouterr().out


def test_suggest_exits_non_zero_when_nothing_fits(capsys) -> None:
    code = main(["suggest", *TINY[:4], "--batch-size", "4", "--budget", "1KiB"])
    assert code == 1
    assert "no level fits" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "--model", "resnet_18"], "unknown timm model 'resnet_18'; did you mean"),
        (["suggest", "--model", "resnet18", "--budget", "lots"], "memory budget 'lots'"),
        (["profile", *TINY, "--levels", "0-9"], "levels outside 0-5"),
        (["profile", *TINY, "--levels", "five"], "is not a level range"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("vision-ckpt: error:")


def test_invalid_config_file_is_reported_with_its_name(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("training_checkpoint_level: 9\n")
    assert main(["plan", "--model", "resnet18", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "training_checkpoint_level" in err


def test_presets_and_schema(capsys) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "training_checkpoint_level" in schema["properties"]
    assert main(["presets"]) == 0
    assert capsys.readouterr().out.strip()


def test_console_script_and_module_entry() -> None:
    for cmd in (["vision-ckpt", "--version"], [sys.executable, "-m", "vision_ckpt", "--version"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "vision-ckpt" in done.stdout


def test_a_failing_measurement_is_one_line_with_exit_code_1(capsys) -> None:
    argv = [
        "profile",
        "--model",
        "convnext_atto",
        "--img-size",
        "2",
        "--batch-size",
        "2",
        "--levels",
        "0",
        "--steps",
        "1",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("vision-ckpt: error: RuntimeError:") and "\n" not in err


def test_a_preset_file_is_a_config(tmp_path: Path, capsys) -> None:
    """What `derive --out` writes and configs/presets/ holds (a `family:` header and rules)
    is taken by --config as it is: its rules at the command's level, the plan of the preset
    of that name."""
    source = Path(__file__).parents[1] / "configs" / "presets" / "resnet.yaml"
    copy = tmp_path / "my_resnet.yaml"
    copy.write_text(source.read_text())
    assert main(["plan", "--model", "resnet18", "--level", "3", "--config", str(copy)]) == 0
    by_file = capsys.readouterr().out
    assert "unknown key" not in by_file
    assert main(["plan", "--model", "resnet18", "--level", "3"]) == 0
    by_name = capsys.readouterr().out
    rows = [line.split()[:3] for line in by_file.splitlines() if line.startswith("layer")]
    assert rows and rows == [
        line.split()[:3] for line in by_name.splitlines() if line.startswith("layer")
    ]
