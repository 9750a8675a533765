"""Errors of the checkpoint core: the determinism check, debug traces, and clean-up after errors.

Every ``CheckpointError`` must say what happened, name the region (the function's name or the
module's class name) and say how to fix it.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from vision_ckpt import CheckpointError, _compat, checkpoint
from vision_ckpt.runtime import is_recomputing, set_checkpoint_debug_enabled

FIX_HINT = re.compile(r"determinism_check|debug")


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def _wobble(x, w, change):
    """The body of every region below: forward saves x, w, h and tanh's result (4 tensors).

    ``change`` says how the recomputation differs from the forward:
    "shape" slices h to 5x3, "dtype" casts it to float64, "fewer" skips the two last saving ops,
    "more" adds a saving op, "none" changes nothing.
    """
    h = x @ w  # 5x7; mm saves x and w
    if change == "shape":
        h = h[:, :3]
    elif change == "dtype":
        h = h.double()
    elif change == "fewer":
        return h
    elif change == "more":
        h = h.cos()
    return h.sin().tanh()  # sin saves its input, tanh its result


def make_wobbly_function():
    """A plain function region and the switch that changes it between forward and backward."""
    switch = {"change": "none"}

    def wobbly_region(x, w):
        return _wobble(x, w, switch["change"])

    return wobbly_region, switch


class WobblyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 7))
        self.change = "none"

    def forward(self, x):
        return _wobble(x, self.w, self.change)


def run_and_change(kind: str, change: str, **ckpt_kwargs):
    """Checkpoint a wobbly region, switch its behaviour, return the loss to call backward on.

    ``kind`` is how the region is given: "function", "partial" (functools.partial of the
    function), "module" (the module itself) or "method" (its bound forward).
    """
    x = leaf(5, 6)
    if kind in ("function", "partial"):
        region, switch = make_wobbly_function()
        w = torch.randn(6, 7, requires_grad=True)
        if kind == "partial":
            out = checkpoint(functools.partial(region, w=w), x, **ckpt_kwargs)
        else:
            out = checkpoint(region, x, w, **ckpt_kwargs)
        switch["change"] = change
    else:
        block = WobblyBlock()
        out = checkpoint(block if kind == "module" else block.forward, x, **ckpt_kwargs)
        block.change = change
    return out.sum()


KINDS = ["function", "partial", "module", "method"]
REGION_NAME = {
    "function": "wobbly_region",
    "partial": "wobbly_region",
    "module": "WobblyBlock",
    "method": "WobblyBlock",
}


@pytest.mark.parametrize("kind", KINDS)
def test_shape_mismatch_says_which_tensor_how_and_where(kind):
    loss = run_and_change(kind, "shape")
    with pytest.raises(CheckpointError, match=r"(?i)shape") as info:
        loss.backward()
    message = str(info.value)
    assert re.search(r"5(,\s*|x)7", message), "the forward shape is missing"
    assert re.search(r"5(,\s*|x)3", message), "the recomputed shape is missing"
    assert re.search(r"(?i)tensor", message)
    assert REGION_NAME[kind] in message
    assert FIX_HINT.search(message)


@pytest.mark.parametrize("kind", KINDS)
def test_dtype_mismatch_says_which_tensor_how_and_where(kind):
    loss = run_and_change(kind, "dtype")
    with pytest.raises(CheckpointError, match=r"(?i)dtype") as info:
        loss.backward()
    message = str(info.value)
    assert "float32" in message and "float64" in message
    assert REGION_NAME[kind] in message
    assert FIX_HINT.search(message)


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_fewer_saved_tensors_in_recompute_raises_with_counts(kind, early_stop):
    loss = run_and_change(kind, "fewer", early_stop=early_stop)
    with pytest.raises(CheckpointError, match=r"(?i)saved") as info:
        loss.backward()
    message = str(info.value)
    assert re.search(r"\b4\b", message) and re.search(r"\b2\b", message), "counts are missing"
    assert REGION_NAME[kind] in message
    assert FIX_HINT.search(message)


@pytest.mark.parametrize("kind", KINDS)
def test_more_saved_tensors_in_recompute_without_early_stop_raises(kind):
    loss = run_and_change(kind, "more", early_stop=False)
    with pytest.raises(CheckpointError, match=r"(?i)more|number|count") as info:
        loss.backward()
    message = str(info.value)
    assert REGION_NAME[kind] in message
    assert FIX_HINT.search(message)


def test_determinism_check_none_skips_the_metadata_check():
    """The float64 recompute is wrong in metadata only: with the check off, backward runs."""
    x = leaf(5, 6)
    w = leaf(6, 7)
    region, switch = make_wobbly_function()
    reference_x_grad = torch.autograd.grad(region(x, w).sum(), x)[0]

    out = checkpoint(region, x, w, determinism_check="none")
    switch["change"] = "dtype"
    out.sum().backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, reference_x_grad)  # float64 recompute: close, not equal

    switch["change"] = "none"
    out = checkpoint(region, x, w)  # default check: the same change is caught
    switch["change"] = "dtype"
    with pytest.raises(CheckpointError, match="dtype"):
        out.sum().backward()


def make_trace_region():
    """A region that runs ``mul`` only in the forward and ``slice`` only when recomputed.

    The switch is a closure, not an argument: arguments are captured at call time.
    """
    switch = {"recomputing": False}

    def trace_region(x, w):
        h = x @ w
        h = h[:, :3] if switch["recomputing"] else h.mul(2)
        return h.sin()

    return trace_region, switch


@pytest.mark.parametrize("how", ["argument", "global_context"])
def test_debug_adds_op_traces_of_both_runs(how):
    region, switch = make_trace_region()
    x, w = leaf(5, 6), leaf(6, 7)
    if how == "argument":
        out = checkpoint(region, x, w, debug=True)
    else:
        with set_checkpoint_debug_enabled(True):
            out = checkpoint(region, x, w)
    switch["recomputing"] = True
    with pytest.raises(CheckpointError, match=r"aten\W+mm") as info:
        out.sum().backward()
    message = str(info.value)
    assert re.search(r"aten\W+mul", message), "the forward's operators are missing"
    assert re.search(r"aten\W+slice", message), "the recomputation's operators are missing"
    assert "trace_region" in message


def test_global_debug_context_overrides_the_argument_and_is_restored():
    region, switch = make_trace_region()
    x, w = leaf(5, 6), leaf(6, 7)
    with set_checkpoint_debug_enabled(False):
        quiet = checkpoint(region, x, w, debug=True)
    loud = checkpoint(region, x, w)  # the context is gone: debug is off again
    switch["recomputing"] = True
    for out in (quiet, loud):
        with pytest.raises(CheckpointError, match="trace_region") as info:
            out.sum().backward()
        assert not re.search(r"aten\W+slice", str(info.value))


def _hooks_now():
    return _compat.top_pack_hook()


def _reference_step():
    torch.manual_seed(3)
    x, w = leaf(4, 4), leaf(4, 4)
    (x.sin() @ w).tanh().sum().backward()
    return x.grad, w.grad


def test_exception_in_forward_leaves_no_hook_installed():
    expected = _reference_step()

    def exploding_region(x):
        x.sin().cos()  # saves tensors before failing
        raise ValueError("boom inside the region")

    with pytest.raises(ValueError, match="boom inside the region"):
        checkpoint(exploding_region, leaf(3))
    assert _hooks_now() is None
    assert not is_recomputing()
    got = _reference_step()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_exception_in_forward_restores_the_users_own_hooks():
    def pack(t):
        return t

    def unpack(t):
        return t

    def exploding_region(x):
        x.sin().cos()
        raise KeyError("boom")

    # pushed so that the core can see them on every torch (NOTE [ Saved-tensor hooks seen on
    # older torch ] in _compat)
    with _compat.saved_tensors_hooks(pack, unpack):
        with pytest.raises(KeyError, match="boom"):
            checkpoint(exploding_region, leaf(3))
        assert _hooks_now() is pack
    assert _hooks_now() is None


def test_exception_during_recompute_leaves_no_hook_installed():
    expected = _reference_step()
    armed = {"on": False}

    def region_failing_on_recompute(x):
        h = x.sin()
        if armed["on"]:
            raise ValueError("boom during recompute")
        return h.cos()

    out = checkpoint(region_failing_on_recompute, leaf(3))
    armed["on"] = True
    with pytest.raises(ValueError, match="boom during recompute"):
        out.sum().backward()
    assert _hooks_now() is None
    assert not is_recomputing()
    got = _reference_step()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_input_modified_in_place_after_the_call_is_detected():
    """Recomputing from a changed input would give silently wrong gradients."""
    x = leaf(4)
    a = x * 1  # a non-leaf the caller can modify in place
    out = checkpoint(lambda t: t.sin().cos(), a)
    with torch.no_grad():
        a.add_(1.0)
    with pytest.raises(RuntimeError, match=r"(?i)in-?place|modified"):
        out.sum().backward()


class _ReadsSavedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (first,) = ctx.saved_tensors
        (second,) = ctx.saved_tensors  # the second read finds the slot already used
        return grad * 2


def test_reading_saved_tensors_twice_names_the_region():
    def twice_reading_region(x):
        return _ReadsSavedTwice.apply(x.sin())

    x = leaf(4)
    twice_reading_region(x).sum().backward()  # fine without checkpoint
    out = checkpoint(twice_reading_region, x)
    with pytest.raises(CheckpointError, match="twice_reading_region") as info:
        out.sum().backward()
    assert "saved_tensors" in str(info.value)


def test_forward_context_that_swallows_the_exception_names_the_region():
    import contextlib

    @contextlib.contextmanager
    def swallowing():
        try:
            yield
        except ValueError:
            pass

    def failing_region(x):
        raise ValueError("boom")

    with pytest.raises(CheckpointError, match="failing_region") as info:
        checkpoint(failing_region, leaf(3), context_fn=lambda: (swallowing(), swallowing()))
    assert "context_fn" in str(info.value)
    assert _hooks_now() is None


def test_a_region_that_writes_its_input_in_place_is_refused_in_forward():
    # torchvision's MNASNet classifier: an in-place dropout before the linear layer; its
    # recomputation would start from the dropped values, and autograd's refusal in backward
    # named no region
    torch.manual_seed(0)
    classifier = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(8, 2))
    x = leaf(4, 8)
    with pytest.raises(
        CheckpointError, match=r"region 'Sequential' \(module\) wrote its input 0"
    ) as info:
        checkpoint(classifier, x * 1)
    assert "inplace=False" in str(info.value) and "level 0" in str(info.value)
    assert _hooks_now() is None
    # a region that writes only its own intermediate tensors in place is fine
    body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Dropout(0.2, inplace=True))
    checkpoint(body, x * 1).sum().backward()
