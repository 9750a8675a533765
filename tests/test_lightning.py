"""``vision_ckpt.integrations.lightning.CheckpointingCallback`` in real ``lightning.Trainer`` runs.

- ``fit`` on the CPU for two steps with a tiny timm ViT (dropout and drop-path on): the core
  runs, the loss is finite, and every gradient equals the run without the callback bit for bit.
- Where it applies (NOTE [ When the callback applies ] in the module): in ``setup``, before
  DDP wraps the model (a one-process gloo group); right after a ``configure_model`` that builds
  the network; only for ``fit``; and it is removed at teardown.
- Budgets: a level or a per-block plan measured on ``example_input`` (or the module's
  ``example_input_array``), and the error when nothing fits.
- Clear errors for arguments that do not go together and for a missing submodule.

Skipped as a whole when Lightning is not installed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

L = pytest.importorskip("lightning")

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from vision_ckpt import ConfigError, LevelError, remove  # noqa: E402
from vision_ckpt.integrations.lightning import CheckpointingCallback  # noqa: E402

IMAGES = 32


def _vit() -> nn.Module:
    return timm.create_model(
        "test_vit",
        pretrained=False,
        img_size=IMAGES,
        depth=2,
        num_classes=5,
        drop_rate=0.1,
        drop_path_rate=0.1,
    )


class Classifier(L.LightningModule):
    """A timm network in ``self.net``; records every step's gradients."""

    def __init__(self, build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.build_in_configure_model = build_in_configure_model
        self.net: nn.Module | None = None if build_in_configure_model else _vit()
        self.grads: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []
        self.example_input_array = torch.randn(2, 3, IMAGES, IMAGES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def on_after_backward(self) -> None:
        self.grads.append(
            {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BuiltLate(Classifier):
    """Builds its network in ``configure_model``, as FSDP users do."""

    def __init__(self) -> None:
        super().__init__(build_in_configure_model=True)

    def configure_model(self) -> None:
        if self.net is None:
            self.net = _vit()


def _data() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, IMAGES, IMAGES, generator=gen)
    y = torch.randint(0, 5, (8,), generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _trainer(callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(callbacks=callbacks, **{**options, **kwargs})


def _fit(module: L.LightningModule, callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    trainer = _trainer(callbacks, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_workers, log_every_n_steps, ...
        trainer.fit(module, _data())
    return trainer


def _module(cls: type[Classifier] = Classifier) -> Classifier:
    L.seed_everything(0, verbose=False)
    return cls()


@pytest.fixture(scope="module")
def plain_run() -> Classifier:
    module = _module()
    _fit(module, [])
    return module


def _assert_same_training(got: Classifier, ref: Classifier) -> None:
    assert got.losses == ref.losses and len(got.losses) == 2
    assert len(got.grads) == len(ref.grads) == 2
    for step, (g, r) in enumerate(zip(got.grads, ref.grads, strict=True)):
        assert g.keys() == r.keys()
        for name in r:
            torch.testing.assert_close(
                g[name], r[name], rtol=0, atol=0, msg=lambda m, n=name, s=step: f"{s} {n}: {m}"
            )


# --------------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 3, 5])
def test_fit_checkpoints_and_keeps_the_gradients(
    level: int, core_calls: list[Any], plain_run: Classifier
) -> None:
    module = _module()
    callback = CheckpointingCallback(level=level)
    _fit(module, [callback])
    assert len(core_calls) > 0
    assert all(torch.isfinite(torch.tensor(module.losses)))
    _assert_same_training(module, plain_run)
    # the network was found by its preset, and the callback logged where it applied
    assert callback.module_name == "net" and callback.plan is not None
    assert int(callback.plan.training_level) == level
    assert all(e.origin.startswith("preset vit ") for e in callback.plan)


def test_plan_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vision_ckpt.integrations.lightning"):
        _fit(_module(), [CheckpointingCallback(level=3)])
    text = caplog.text
    assert "Classifier.net" in text and "checkpointed at training level 3" in text
    assert "Checkpoint plan for" in text and "preset vit #" in text


def test_removed_at_teardown_unless_asked_to_keep() -> None:
    module = _module()
    _fit(module, [CheckpointingCallback(level=3)])
    assert remove(module.net) == 0
    kept = _module()
    callback = CheckpointingCallback(level=3, remove_at_teardown=False)
    _fit(kept, [callback])
    # every module whose forward was replaced (a run's members too) gets its own back
    installed = [m for m in kept.net.modules() if "forward" in m.__dict__]
    assert len(installed) >= len([e for e in callback.plan if e.rungs]) > 0
    assert remove(kept.net) == len(installed)
    assert not any("forward" in m.__dict__ for m in kept.net.modules())


def test_only_fit_is_checkpointed(core_calls: list[Any]) -> None:
    callback = CheckpointingCallback(level=3)
    trainer = _trainer([callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(_module(), _data())
    assert callback.plan is None and core_calls == []


def test_module_built_in_configure_model(core_calls: list[Any]) -> None:
    plain = _module(BuiltLate)
    _fit(plain, [])
    assert core_calls == []
    module = _module(BuiltLate)
    callback = CheckpointingCallback(level=3)
    _fit(module, [callback])
    assert callback.module_name == "net" and len(core_calls) > 0
    assert "configure_model" not in module.__dict__  # the callback's wrapper is gone
    _assert_same_training(module, plain)


def test_explicit_module_and_config(core_calls: list[Any]) -> None:
    config = {"training_checkpoint_level": 2, "rules": [{"match": "blocks.*.mlp", "level": 2}]}
    callback = CheckpointingCallback(config=config, module="net")
    module = _module()
    _fit(module, [callback])
    depth = len(module.net.blocks)
    assert callback.plan.checkpointed == tuple(f"blocks.{i}.mlp" for i in range(depth))
    assert len(core_calls) == depth * 2  # every MLP, two steps


def test_config_rules_name_modules_of_the_lightning_module() -> None:
    """A config with rules of its own is not redirected to a child: names are relative to the
    LightningModule."""
    config = {"training_checkpoint_level": 3, "rules": [{"match": "net.blocks.*", "level": 3}]}
    callback = CheckpointingCallback(config=config)
    module = _module()
    _fit(module, [callback])
    assert callback.module_name == ""
    assert callback.plan.checkpointed == tuple(
        f"net.blocks.{i}" for i in range(len(module.net.blocks))
    )


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """Lightning's DDP sets torchrun-like variables and a gloo group: undo both afterwards."""
    env = dict(os.environ)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)


def _fit_ddp(module: Classifier, callbacks: list[Any]) -> None:
    trainer = _trainer(callbacks, strategy="ddp")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, _data())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_applied_before_ddp_wraps_the_model(
    core_calls: list[Any], one_process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-process gloo group: DDP wraps the model in strategy.setup, after the callback;
    the gradients are those of the same DDP run without it."""
    from torch.nn.parallel import DistributedDataParallel

    import vision_ckpt.integrations.lightning as integration

    seen: list[type] = []  # what the strategy holds when the plan is applied, then in training

    class Training(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen.append(type(trainer.strategy.model))

    plain = _module()
    _fit_ddp(plain, [Training()])
    assert seen == [DistributedDataParallel] and core_calls == []

    seen.clear()
    module = _module()
    apply = integration.apply

    def spy(target: nn.Module, config: Any) -> Any:
        seen.append(type(module.trainer.strategy.model))
        return apply(target, config)

    monkeypatch.setattr(integration, "apply", spy)
    _fit_ddp(module, [CheckpointingCallback(level=3), Training()])
    assert seen == [Classifier, DistributedDataParallel]
    assert len(core_calls) > 0
    _assert_same_training(module, plain)


# --------------------------------------------------------------------------------------------
# budgets
# --------------------------------------------------------------------------------------------


def test_budget_chooses_a_level_from_example_input_array(core_calls: list[Any]) -> None:
    """The tiny ViT's predicted step peak at batch 64 is 3.9 MiB at level 0, 2.9 MiB at 3."""
    callback = CheckpointingCallback(memory_budget="3.2MiB", batch_size=64)
    _fit(_module(), [callback])
    assert int(callback.plan.pinned_training_level) >= 1 and len(core_calls) > 0
    roomy = CheckpointingCallback(memory_budget="1GiB")
    _fit(_module(), [roomy])
    assert roomy.plan.pinned_training_level == 0  # it fits without checkpointing


def test_budget_plan_per_block(core_calls: list[Any]) -> None:
    module = _module()
    callback = CheckpointingCallback(
        memory_budget="3.2MiB",
        budget_plan="blocks",
        example_input=torch.randn(2, 3, IMAGES, IMAGES),
        batch_size=64,
    )
    _fit(module, [callback])
    assert callback.plan.checkpointed and len(core_calls) > 0


def test_budget_that_nothing_fits() -> None:
    with pytest.raises(ConfigError, match="memory_budget: no level fits 1.00 KiB"):
        _fit(_module(), [CheckpointingCallback(memory_budget="1KiB")])


def test_preset_derived_is_derived_on_the_example_input(core_calls: list[Any]) -> None:
    callback = CheckpointingCallback(
        config={"preset": "derived", "training_checkpoint_level": 5},
        module="net",
        batch_size=16,
    )
    _fit(_module(), [callback])
    assert callback.plan.checkpointed and len(core_calls) > 0
    module = _module()
    module.example_input_array = None
    derived = CheckpointingCallback(config={"preset": "derived"}, module="net")
    with pytest.raises(ConfigError, match="preset 'derived' needs an input batch"):
        _fit(module, [derived])


def test_budget_without_an_example_input() -> None:
    module = _module()
    module.example_input_array = None
    with pytest.raises(ConfigError, match="needs an input batch of the network"):
        _fit(module, [CheckpointingCallback(memory_budget="1GiB")])


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"level": 3, "config": {"training_checkpoint_level": 2}}, "got level=3 and a config"),
        ({"level": 3, "memory_budget": "1GiB"}, "got level=3 and memory_budget='1GiB'"),
        ({"config": {"preset": "auto"}, "nesting": "all"}, r"options \['nesting'\]"),
        ({"level": 3, "budget_plan": "greedy"}, "budget_plan='greedy'"),
        ({"level": 3, "nesting": "inner"}, "nesting: got 'inner'"),
    ],
)
def test_arguments_that_do_not_go_together(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CheckpointingCallback(**kwargs)


def test_defaults_and_a_config_that_carries_its_budget() -> None:
    assert CheckpointingCallback().config.training_checkpoint_level == 3  # every block
    callback = CheckpointingCallback(
        config={"training_checkpoint_level": "auto", "memory_budget": "2GiB", "nesting": "all"}
    )
    assert callback.memory_budget == "2GiB"
    assert callback.config.training_checkpoint_level is None and callback.config.nesting == "all"


def test_level_outside_0_to_5() -> None:
    with pytest.raises(LevelError, match="training level 9 is not a checkpoint level"):
        CheckpointingCallback(level=9)


def test_missing_submodule_names_the_children() -> None:
    with pytest.raises(ConfigError, match=r"has no such submodule \(its children: net\)"):
        _fit(_module(), [CheckpointingCallback(level=3, module="backbone")])


def test_importing_vision_ckpt_does_not_import_lightning() -> None:
    code = (
        "import sys, vision_ckpt, vision_ckpt.integrations; "
        "print([m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
