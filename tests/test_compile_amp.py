"""Checkpointing under torch.compile, bfloat16 autocast, channels-last, gradient accumulation,
inference and meta-device initialisation.

Every comparison is bit-exact (``assert_exact``) unless its test says otherwise: checkpointing
recomputes the same operators on the same inputs with the same RNG and autocast state, so
nothing may differ.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from _models import LEVEL_RULES, TinyViT, make
from torch import nn

import vision_ckpt

MODELS = list(LEVEL_RULES)
LEVELS = range(6)


def applied(name: str, level: int, seed: int = 0) -> nn.Module:
    """``_models.make(name)`` with its level rules applied at training level ``level``."""
    model = make(name, seed)
    cfg = {"training_checkpoint_level": level, "rules": LEVEL_RULES[name]}
    vision_ckpt.apply(model, cfg)
    return model


def batch(seed: int = 1, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, call=None) -> dict:
    """Forward and backward with a fixed dropout seed; outputs, gradients and buffers."""
    torch.manual_seed(123)
    out = (model if call is None else call)(x)
    F.cross_entropy(out, y).backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


def _vit_without_dropout(level: int) -> nn.Module:
    torch.manual_seed(0)
    model = TinyViT(depth=1).train()
    for module in model.modules():
        if hasattr(module, "p"):
            module.p = 0.0
    vision_ckpt.apply(model, {"training_checkpoint_level": level, "rules": LEVEL_RULES["vit"]})
    return model


@pytest.mark.parametrize("level", [0, 3, 5])
def test_compiled_gradients_equal_eager(level: int, assert_exact) -> None:
    """aot_eager compiles forward and backward graphs (AOTAutograd) around torch's checkpoint
    higher-order op, which vision_ckpt hands the region to while dynamo traces; it runs the
    same aten kernels as eager, so gradients are compared exactly. Dropout is off: compiled
    and eager code do not draw random numbers in the same order. Two steps are compiled,
    since the second call is where recompilation (and its guards) come in."""
    x, y = batch()
    eager = _vit_without_dropout(level)
    # The eager run also puts the wrapper's thread-local level in place: without it the second
    # compiled call fails (see test_compile_on_a_thread_that_never_ran_a_checkpoint below).
    expected = [step(eager, x, y)]
    eager.zero_grad(set_to_none=True)
    expected.append(step(eager, x, y))

    torch._dynamo.reset()
    model = _vit_without_dropout(level)
    compiled = torch.compile(model, backend="aot_eager")
    got = [step(model, x, y, compiled)]
    model.zero_grad(set_to_none=True)
    got.append(step(model, x, y, compiled))
    assert_exact(got, expected)


def test_compile_on_a_thread_that_never_ran_a_checkpoint() -> None:
    """A fresh thread has fresh thread-local state, as a fresh process does: compiling there
    must not trip dynamo's guards on that state (two calls: the second checks the guards)."""
    torch._dynamo.reset()
    model = _vit_without_dropout(3)
    compiled = torch.compile(model, backend="eager")
    x, y = batch()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            torch.set_num_threads(1)
            for _ in range(2):
                F.cross_entropy(compiled(x), y).backward()
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=300)
    assert not worker.is_alive(), "compiled steps did not finish in 300 s"
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------------------------
# Autocast, channels-last, gradient accumulation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast_gradients_equal_the_plain_autocast_run(
    name: str, level: int, assert_exact
) -> None:
    """The recomputation runs under the autocast state of the forward (bf16 on CPU), so the
    recomputed activations are the bf16 ones the plain run saved."""
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = step(make(name), x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = step(applied(name, level), x, y)
    assert got["out"].dtype == torch.bfloat16
    assert_exact(got, expected)


def test_backward_outside_autocast_still_recomputes_in_bf16(assert_exact) -> None:
    x, y = batch()
    model, plain = applied("swin", 5), make("swin")
    for net in (model, plain):
        torch.manual_seed(123)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()  # outside the autocast block, as training loops do
    assert_exact(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in plain.named_parameters()},
    )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["densenet", "swin"])
def test_channels_last_inputs(name: str, level: int, assert_exact) -> None:
    x, y = batch()
    x = x.contiguous(memory_format=torch.channels_last)
    plain = make(name).to(memory_format=torch.channels_last)
    model = applied(name, level).to(memory_format=torch.channels_last)
    expected, got = step(plain, x, y), step(model, x, y)
    assert_exact(got, expected)
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.grad.is_contiguous(memory_format=torch.channels_last) == (
        next(m for m in plain.modules() if isinstance(m, nn.Conv2d)).weight.grad.is_contiguous(
            memory_format=torch.channels_last
        )
    )


@pytest.mark.parametrize("level", [2, 3, 5])
@pytest.mark.parametrize("name", MODELS)
def test_gradient_accumulation_over_two_micro_batches(name: str, level: int, assert_exact) -> None:
    x, y = batch(n=8)
    results = []
    for model in (make(name), applied(name, level)):
        torch.manual_seed(123)
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            (F.cross_entropy(model(xs), ys) / 2).backward()
        results.append(
            {
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "buffers": {n: b.clone() for n, b in model.named_buffers()},
            }
        )
    assert_exact(results[1], results[0])


# --------------------------------------------------------------------------------------------
# Inference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_eval_no_grad_inference_runs_no_checkpoint(name: str, core_calls, assert_exact) -> None:
    x, _ = batch()
    plain, model = make(name).eval(), applied(name, 5).eval()
    core_calls.clear()
    with torch.no_grad():
        expected, got = plain(x), model(x)
    assert core_calls == []
    assert_exact(got, expected)
    with vision_ckpt.training_level(5), torch.no_grad():
        model.train()(x)  # training mode, but no grad: still nothing to checkpoint
    assert core_calls == []
    model.train()(x).sum().backward()  # sanity: the spy does see checkpoints
    assert core_calls


# --------------------------------------------------------------------------------------------
# Meta-device initialisation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_meta_model_planned_and_applied_then_materialised(name: str, assert_exact) -> None:
    cfg = {"training_checkpoint_level": 3, "rules": LEVEL_RULES[name]}
    with torch.device("meta"):
        meta = type(make(name))().train()
    assert all(p.is_meta for p in meta.parameters())
    meta_plan = vision_ckpt.apply(meta, cfg)

    # A forward and backward on the meta device runs (shapes only).
    out = meta(torch.empty(2, 3, 16, 16, device="meta"))
    out.sum().backward()
    assert out.shape == (2, 10) and out.is_meta
    meta.zero_grad(set_to_none=True)

    twin = applied(name, 3)  # the same model built on the CPU, same seed
    assert meta_plan == vision_ckpt.plan(twin, cfg)
    model = meta.to_empty(device="cpu")
    model.load_state_dict(twin.state_dict())
    x, y = batch()
    assert_exact(step(model, x, y), step(twin, x, y))


def test_meta_model_initialised_by_an_init_function(assert_exact) -> None:
    def init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    cfg = {"training_checkpoint_level": 5, "rules": LEVEL_RULES["vit"]}
    with torch.device("meta"):
        meta = TinyViT().train()
    vision_ckpt.apply(meta, cfg)
    model = meta.to_empty(device="cpu")
    cpu = copy.deepcopy(TinyViT()).train()
    for net in (model, cpu):
        torch.manual_seed(7)
        net.apply(init)
        nn.init.trunc_normal_(net.pos_embed, std=0.02)
    x, y = batch()
    assert_exact(step(model, x, y), step(cpu, x, y))
