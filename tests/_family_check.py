"""One family's preset on a real model, checked the way every preset is: exact, monotone,
really recomputing (``check_case``). Shared by the timm zoo and the other libraries' tests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vision_ckpt.config import CheckpointConfig
from vision_ckpt.config.presets import preset_for_model
from vision_ckpt.measure._memory import count_saved_bytes
from vision_ckpt.regions.apply import apply, remove

LEVELS = range(6)


def first_tensor(out: Any) -> torch.Tensor:
    """The first tensor of a model's output: a tensor, a tuple/list, a dict or a Hugging Face
    ``ModelOutput`` (``logits`` / ``last_hidden_state`` first)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):  # ModelOutput is an OrderedDict of its non-None fields
        out = list(out.values())
    if isinstance(out, (tuple, list)) and out:
        return first_tensor(out[0])
    raise TypeError(f"no tensor in the model's output of type {type(out).__name__}")


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[], nn.Module]
    size: int
    """Side of the square input image (``make_input`` overrides the whole input)."""
    preset: str | None
    """The preset the model must resolve to; ``None``: it takes the fallback."""
    slow: bool = False
    make_input: Callable[[], torch.Tensor] | None = None
    """The input, for models that do not take a ``(2, 3, size, size)`` image (3D volumes)."""


def step(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """One training step from a fixed seed: output, gradients, buffers, saved bytes, FLOPs."""
    torch.manual_seed(1234)
    with count_saved_bytes() as saved:
        out = model(x)
    out = first_tensor(out)
    loss = out.float().square().mean()
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "saved": saved.nbytes,
        "flops": flops.get_total_flops(),
    }


def assert_same(got: dict[str, Any], ref: dict[str, Any], level: int) -> None:
    where = f"level {level}"
    torch.testing.assert_close(got["out"], ref["out"], rtol=0, atol=0, msg=f"{where}: output")
    assert got["grads"].keys() == ref["grads"].keys(), f"{where}: gradients of other parameters"
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(
            got["grads"][name], grad, rtol=0, atol=0, msg=lambda m, n=name: f"{where}: {n}: {m}"
        )
    for name, buf in ref["buffers"].items():
        torch.testing.assert_close(
            got["buffers"][name], buf, rtol=0, atol=0, msg=lambda m, n=name: f"{where}: {n}: {m}"
        )


def check_case(case: Case, core_calls: list[Any]) -> None:
    torch.manual_seed(0)
    base = case.make().train()
    assert preset_for_model(base) == case.preset
    x = (
        case.make_input()
        if case.make_input is not None
        else torch.randn(2, 3, case.size, case.size)
    )
    ref = step(copy.deepcopy(base), x)
    keys = list(base.state_dict())

    saved, flops, counts, selective = [], [], [], []
    for level in LEVELS:
        model = copy.deepcopy(base)
        applied = apply(model, CheckpointConfig(training_checkpoint_level=level, preset="auto"))
        if case.preset is None:
            assert {e.origin for e in applied} == {"fallback"}
        else:
            # "preset <name> #i", or "preset <name> <part>: preset <other> #i" for a part's rules
            assert all(e.origin.startswith(f"preset {case.preset} ") for e in applied)
        assert list(model.state_dict()) == keys
        selective.append(any(e.rung_at(level).selective for e in applied if e.checkpointed))
        del core_calls[:]
        got = step(model, x)
        counts.append(len(core_calls))
        assert_same(got, ref, level)
        saved.append(got["saved"])
        flops.append(got["flops"])
        if level == max(LEVELS):
            model.eval()
            del core_calls[:]
            with torch.no_grad():
                model(x)
            model(x)
            assert core_calls == [], "eval mode must not checkpoint"
            assert remove(model) > 0
    assert counts[0] == 0, "training level 0 must not checkpoint"
    assert counts[-1] > 0
    # Within each kind of level (selective ones; level 0 and the full ones) a higher level keeps
    # no more and recomputes no less. Across kinds the order is the model's: a stage-wide
    # selective level can keep less than per-block full checkpoints (their inputs) on a tiny
    # config, for far less recomputation (at real sizes the full levels go lower:
    # benchmarks/bench_frontier.py measures the peaks). Every level keeps at most level 0's bytes;
    # the top level keeps less than level 0 and the least of its kind, and recomputes the most.
    for kind in (True, False):
        levels = [lv for lv in LEVELS if selective[lv] == kind]
        kept = [saved[lv] for lv in levels]
        work = [flops[lv] for lv in levels]
        assert all(a >= b for a, b in zip(kept, kept[1:], strict=False)), (
            f"saved bytes by level: {saved} (selective: {selective})"
        )
        # 1%: with nesting auto a level-3 region recomputes its body once, which can be a hair
        # less than what the level-2 regions inside it redid (0.02% on efficientvit_b0).
        assert all(a <= b * 1.01 for a, b in zip(work, work[1:], strict=False)), (
            f"backward FLOPs by level: {flops} (selective: {selective})"
        )
    assert all(s <= saved[0] for s in saved), f"saved bytes by level: {saved}"
    assert saved[-1] < saved[0], f"saved bytes by level: {saved}"
    assert all(f >= flops[0] for f in flops), f"backward FLOPs by level: {flops}"
    assert flops[-1] > flops[0] and flops[-1] == max(flops), f"backward FLOPs by level: {flops}"
