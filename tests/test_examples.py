"""The examples run with tiny arguments, and what they claim holds.

* ``custom_blocks.py``: gradients equal the level-0 run bit for bit at every level, the bytes
  saved for backward fall with the level, and each level starts more checkpointed regions.
* ``train_timm.py``: every ``configs/train/*.yaml`` validates and plans against its model; a run
  trains (finite losses, a peak), and a checkpointed run has the losses of the plain one.
* ``train_ddp.py``: the one-process fallback trains with DDP and with FSDP2; ``torchrun`` with
  two processes is in the slow tests.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from pydantic import BaseModel
from rich.console import Console

import vision_ckpt

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TRAIN_CONFIGS = sorted((ROOT / "configs" / "train").glob("*.yaml"))
sys.path.insert(0, str(EXAMPLES))

import _train_config  # noqa: E402
import custom_blocks  # noqa: E402
import train_ddp  # noqa: E402
import train_timm  # noqa: E402

VIT = str(ROOT / "configs" / "train" / "vit_tiny.yaml")
RESNET = str(ROOT / "configs" / "train" / "resnet_tiny.yaml")


# --------------------------------------------------------------------------------------------
# custom_blocks.py
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def custom_rows() -> dict[str, list[custom_blocks.LevelRow]]:
    torch.set_num_threads(1)
    return custom_blocks.main(["--batch", "2", "--image-size", "16"])


@pytest.mark.parametrize("net", ["swin", "dense"])
def test_custom_blocks_gradients_are_exact_at_every_level(net: str, custom_rows) -> None:
    rows = custom_rows[net]
    assert [r.level for r in rows] == list(range(6))
    assert all(r.exact for r in rows), [(r.level, r.max_grad_diff) for r in rows]
    assert len({r.loss for r in rows}) == 1


@pytest.mark.parametrize("net", ["swin", "dense"])
def test_custom_blocks_memory_falls_with_the_level(net: str, custom_rows) -> None:
    rows = custom_rows[net]
    saved = [r.saved_bytes for r in rows]
    assert all(a > b for a, b in zip(saved, saved[1:], strict=False)), saved
    assert saved[5] < saved[0] / 10, saved
    calls = [r.checkpoint_calls for r in rows]
    assert calls[0] == 0 and all(a < b for a, b in zip(calls, calls[1:], strict=False)), calls
    # The peak of the whole step falls too, but not level by level: in the dense net the
    # backward peak (recomputing a dense block) is what levels >= 3 leave.
    assert rows[1].peak_bytes < rows[0].peak_bytes


def test_custom_blocks_peak_memory_of_the_swin_net(custom_rows) -> None:
    peaks = [r.peak_bytes for r in custom_rows["swin"]]
    assert all(a >= b for a, b in zip(peaks, peaks[1:], strict=False)), peaks
    assert peaks[2] < peaks[0] * 0.6, peaks


def test_custom_blocks_rejects_a_bad_image_size() -> None:
    with pytest.raises(SystemExit):
        custom_blocks.main(["--image-size", "20"])


# --------------------------------------------------------------------------------------------
# The training config and train_timm.py
# --------------------------------------------------------------------------------------------


def test_training_configs_exist() -> None:
    names = {p.stem for p in TRAIN_CONFIGS}
    assert {"vit_tiny", "resnet_tiny", "convnext_tiny"} <= names


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_every_training_config_validates_and_plans(path: Path) -> None:
    cfg = _train_config.load_train_config(path)
    # Built on the meta device: the plan needs module names and classes, not weights.
    with torch.device("meta"):
        model = timm.create_model(
            cfg.model, pretrained=False, num_classes=cfg.num_classes, **cfg.model_kwargs
        )
    the_plan = vision_ckpt.plan(model, cfg.checkpoint)
    assert the_plan.checkpointed, f"{path.name} checkpoints nothing"


@pytest.mark.parametrize("schema", [_train_config.TrainConfig, _train_config.OptimizerConfig])
def test_every_training_config_field_has_a_docstring(schema: type[BaseModel]) -> None:
    for name, field in schema.model_fields.items():
        assert field.description, f"{schema.__name__}.{name}"
        assert not field.is_required(), f"{schema.__name__}.{name} has no default"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"modle": "resnet18"}, "modle: unknown key"),
        ({"optimizer": {"name": "lamb"}}, "optimizer.name"),
        ({"batch_size": 0}, "batch_size"),
        ({"checkpoint": {"rules": [{"match": "x", "level": 9}]}}, r"checkpoint.rules.0.level"),
        (
            {"checkpoint": {"training_checkpoint_level": "auto", "memory_budget": "1GiB"}},
            "'auto' is not supported",
        ),
    ],
)
def test_training_config_errors_name_the_key(data: dict, match: str) -> None:
    with pytest.raises(vision_ckpt.ConfigError, match=match):
        _train_config.load_train_config(data)


def test_training_config_from_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(vision_ckpt.ConfigError, match="cannot be read"):
        _train_config.load_train_config(tmp_path / "missing.yaml")
    with pytest.raises(SystemExit, match="train_timm"):
        train_timm.main(["--config", str(tmp_path / "missing.yaml")])


def test_train_timm_checkpointed_run_has_the_losses_of_the_plain_run() -> None:
    """vit_tiny has drop-path: the recomputation must redraw the same masks."""
    plain = train_timm.main(["--config", VIT, "--steps", "2", "--level", "0"])
    ckpt = train_timm.main(["--config", VIT, "--steps", "2", "--level", "5"])
    assert [s.loss for s in ckpt] == [s.loss for s in plain]
    assert all(math.isfinite(s.loss) and s.peak_bytes for s in ckpt)


def test_train_timm_step_peak_falls_when_activations_dominate() -> None:
    """With the shipped vit_tiny config (batch 8) the step's peak is weights, gradients and
    AdamW state, and checkpointing cannot lower it; at batch 32 with SGD activations dominate.
    The peak is not monotone in the level (level 3 recomputes whole blocks in backward)."""
    data = _train_config.load_train_config(VIT).model_dump()
    data.update(batch_size=32, steps=1, optimizer={"name": "sgd", "lr": 0.01})
    peaks, losses = [], []
    for level in (0, 2, 5):
        data["checkpoint"]["training_checkpoint_level"] = level
        (stats,) = train_timm.train(_train_config.load_train_config(data), Console(quiet=True))
        peaks.append(stats.peak_bytes)
        losses.append(stats.loss)
    assert len(set(losses)) == 1
    assert peaks[1] < peaks[0] * 0.85 and peaks[2] < peaks[0] * 0.85, peaks


def test_train_timm_bf16_channels_last_resnet() -> None:
    history = train_timm.main(["--config", RESNET, "--steps", "1"])
    assert len(history) == 1 and math.isfinite(history[0].loss)


# --------------------------------------------------------------------------------------------
# train_ddp.py
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchrun's variables; the ones train_ddp sets are removed again afterwards."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)


@pytest.mark.parametrize(
    "extra",
    [[], ["--static-graph"], pytest.param(["--fsdp"], marks=pytest.mark.needs_fsdp2_cpu)],
    ids=["ddp", "static", "fsdp"],
)
def test_train_ddp_as_a_group_of_one(extra: list[str], no_torchrun_env) -> None:
    history = train_ddp.main(["--config", VIT, "--steps", "2", *extra])
    reference = train_timm.main(["--config", VIT, "--steps", "2"])
    assert len(history) == 2
    for got, want in zip(history, reference, strict=True):
        assert math.isclose(got.loss, want.loss, rel_tol=1e-5)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_train_ddp_under_torchrun_with_two_processes(extra: list[str]) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(train_ddp._free_port()),
        str(EXAMPLES / "train_ddp.py"), "--config", VIT, "--steps", "2", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish in 120 s:\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "on 2 x cpu" in done.stdout
