"""ActivationCheckpointing and the training level: when the core is called, and exactness."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

from vision_ckpt import (
    ActivationCheckpointing,
    ConfigError,
    Level,
    LevelError,
    get_training_level,
    set_training_level,
    training_level,
)
from vision_ckpt.runtime import wrapper as wrapper_module


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 8))


class Block(nn.Module):
    """The example of issue 3: x + ckpt(mlp, x), wrapper at block level ``level``."""

    def __init__(self, level: int, **kwargs) -> None:
        super().__init__()
        self.mlp = _mlp()
        self.ckpt = ActivationCheckpointing(level, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ckpt(self.mlp, x)


@pytest.mark.parametrize("block_level", range(6))
@pytest.mark.parametrize("train_level", range(6))
def test_checkpointed_exactly_when_level_within_training_level(
    block_level, train_level, core_calls, assert_exact, exact_step
):
    block = Block(block_level)
    x = torch.randn(4, 8)
    set_training_level(train_level)
    got = exact_step(block, x)
    expected_calls = 1 if 1 <= block_level <= train_level else 0
    assert len(core_calls) == expected_calls
    set_training_level(0)
    assert_exact(got, exact_step(block, x))


def test_eval_no_grad_and_level_zero_call_the_core_zero_times(core_calls):
    x = torch.randn(4, 8)
    block = Block(2)
    with training_level(5):
        block.eval()
        block(x)
        block.train()
        with torch.no_grad():
            block(x)
        Block(0)(x)
    with training_level(0):
        block(x)
    assert core_calls == []
    with training_level(2):
        block(x)
    assert len(core_calls) == 1


def test_pinned_training_level_ignores_the_global_one(core_calls):
    x = torch.randn(4, 8)
    pinned = Block(3, training_checkpoint_level=3)
    with training_level(0):
        pinned(x)
    assert len(core_calls) == 1
    with training_level(5):
        Block(4, training_checkpoint_level=3)(x)
    assert len(core_calls) == 1


def test_global_level_changes_between_steps(core_calls, exact_step):
    block, x = Block(2), torch.randn(4, 8)
    for level, total in [(1, 0), (2, 1), (5, 2), (0, 2), (3, 3)]:
        set_training_level(level)
        exact_step(block, x)
        assert len(core_calls) == total, level


def test_training_level_context_manager_restores_on_exit_and_error():
    set_training_level("block")
    assert get_training_level() is Level.SMALL_BLOCK
    with training_level(4) as level:
        assert level is Level.STAGE and get_training_level() == 4
        with training_level("1"):
            assert get_training_level() == 1
        assert get_training_level() == 4
    assert get_training_level() == 2
    with pytest.raises(ZeroDivisionError), training_level(5):
        1 / 0  # noqa: B018
    assert get_training_level() == 2


def test_backward_outside_the_level_block_recomputes_at_the_forward_level(assert_exact):
    # Forward at level 3 (outer and inner checkpointed, nested), backward at level 0: the
    # recomputation must take the forward's decisions again or the saved tensors differ.
    inner = ActivationCheckpointing(2)
    outer = ActivationCheckpointing(3)
    mlp = _mlp()

    def region(x):
        return x + inner(mlp, x)

    x = torch.randn(4, 8)
    torch.manual_seed(0)
    xr = x.clone().requires_grad_()
    ref = region(xr)
    ref.sum().backward()
    mlp.zero_grad()
    torch.manual_seed(0)
    xc = x.clone().requires_grad_()
    with training_level(3):
        out = outer(region, xc)
    out.sum().backward()  # global level is 0 here
    assert_exact(out, ref)
    assert_exact(xc.grad, xr.grad)


def test_nested_wrappers_nesting_all_and_outermost(core_calls, assert_exact, exact_step):
    x = torch.randn(4, 8)

    class Nested(nn.Module):
        def __init__(self, nesting):
            super().__init__()
            self.block = Block(2, nesting=nesting)
            self.ckpt = ActivationCheckpointing(3, nesting=nesting)

        def forward(self, x):
            return self.ckpt(self.block, x)

    results = {}
    for nesting in ("all", "outermost"):
        core_calls.clear()
        with training_level(3):
            results[nesting] = exact_step(Nested(nesting), x)
        results[nesting + "_calls"] = len(core_calls)
    # all: outer once, inner in forward and once more in the outer's recomputation.
    assert results["all_calls"] == 3
    assert results["outermost_calls"] == 1
    with training_level(0):
        ref = exact_step(Nested("all"), x)
    assert_exact(results["all"], ref)
    assert_exact(results["outermost"], ref)
    # At level 2 only the inner block is eligible: outermost checkpoints it.
    core_calls.clear()
    with training_level(2):
        exact_step(Nested("outermost"), x)
    assert len(core_calls) == 1


def test_kwargs_and_non_tensor_args_pass_through(assert_exact):
    ckpt = ActivationCheckpointing(1)
    lin = nn.Linear(4, 4)

    def fn(x, *, scale, shift=None):
        return lin(x) * scale + (0 if shift is None else shift)

    x = torch.randn(2, 4, requires_grad=True)
    with training_level(1):
        out = ckpt(fn, x, scale=2.0, shift=torch.ones(4))
    assert_exact(out, lin(x) * 2.0 + torch.ones(4))


def test_use_reentrant_true_goes_to_torch_with_a_one_time_warning(
    core_calls, assert_exact, exact_step
):
    wrapper_module._reentrant_warned = False
    block, x = Block(2), torch.randn(4, 8)

    class Reentrant(Block):
        def forward(self, x):
            return x + self.ckpt(self.mlp, x, use_reentrant=True)

    reentrant = Reentrant(2)
    with training_level(2):
        with pytest.warns(FutureWarning, match=r"use_reentrant=True\) runs torch's reentrant"):
            got = exact_step(reentrant, x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exact_step(reentrant, x)  # no second warning
    assert core_calls == []
    assert_exact(got, exact_step(block, x))


def test_repr_shows_levels():
    assert repr(ActivationCheckpointing(2)) == (
        "ActivationCheckpointing(level=2 (SMALL_BLOCK), training_level=global)"
    )
    assert repr(ActivationCheckpointing("stage", 3, nesting="outermost")) == (
        "ActivationCheckpointing(level=4 (LARGE_MODULE), training_level=3, nesting='outermost')"
    )


def test_wrapper_has_no_state_and_pickles():
    ckpt = ActivationCheckpointing(3, 2, preserve_rng_state=False)
    assert list(ckpt.parameters()) == [] and ckpt.state_dict() == {}
    copy = pickle.loads(pickle.dumps(ckpt))
    assert copy.fn_checkpoint_level == 3 and copy.training_checkpoint_level == 2
    assert copy.preserve_rng_state is False


def test_region_name_and_module_reach_the_core(core_calls):
    block = Block(1)
    with training_level(1):
        block(torch.randn(2, 8))
    assert len(core_calls) == 1
    assert core_calls.modules == [block.mlp]
    assert core_calls.labels == ["Sequential"]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ActivationCheckpointing(7), r"fn_checkpoint_level 7 is not a checkpoint level; "),
        (lambda: ActivationCheckpointing(-1), r"fn_checkpoint_level -1 is not"),
        (lambda: ActivationCheckpointing(2.5), r"fn_checkpoint_level 2\.5 is not"),
        (lambda: ActivationCheckpointing("high"), r"fn_checkpoint_level 'high' is not"),
        (lambda: ActivationCheckpointing(True), r"fn_checkpoint_level True is not"),
        (lambda: ActivationCheckpointing(2, 6), r"training_checkpoint_level 6 is not"),
        (lambda: set_training_level(9), r"training level 9 is not a checkpoint level"),
        (lambda: set_training_level(None), r"training level None is not"),
        (lambda: training_level("max").__enter__(), r"training level 'max' is not"),
    ],
)
def test_level_errors_list_the_allowed_values(make, match):
    with pytest.raises(LevelError, match=match + r".*allowed: 0 \(NONE\), 1 \(SINGLE_LAYER\)"):
        make()
    assert get_training_level() == 0


def test_nesting_error_lists_the_modes():
    with pytest.raises(
        ConfigError,
        match=r"nesting 'inner' is not a nesting mode; allowed: 'auto' .*'all' .*'outermost'",
    ):
        ActivationCheckpointing(2, nesting="inner")


def test_reentrant_with_a_context_fn_is_an_error_not_a_silent_drop():
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    wrapper = ActivationCheckpointing(1, 3, context_fn=policy)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ConfigError, match="use_reentrant=True cannot honour context_fn"):
        wrapper(torch.nn.Linear(4, 4), x, use_reentrant=True)
