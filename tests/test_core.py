"""Semantics of the bundled non-reentrant checkpoint core, through the public API.

Almost every test runs one computation twice from identical seeds: once calling the region
directly (``plain``) and once through ``vision_ckpt.checkpoint``; outputs and every gradient
(inputs and parameters, plus module buffers) must then be bit-identical. Errors live in
``test_core_errors.py`` and the real timm models in ``test_core_timm.py``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import vision_ckpt
from vision_ckpt import CheckpointError, VisionCkptError, _compat, checkpoint
from vision_ckpt.runtime import checkpoint_sequential, is_recomputing

# Keyword options that belong to checkpoint itself, never to the checkpointed function.
_CHECKPOINT_OPTIONS = frozenset(
    {
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
        "use_reentrant",
    }
)


def plain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Same call signature as ``checkpoint``, but just runs ``fn``: the reference computation."""
    return fn(*args, **{k: v for k, v in kwargs.items() if k not in _CHECKPOINT_OPTIONS})


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensor_leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensor_leaves(v)]
    return []


def loss_of(out: Any) -> torch.Tensor:
    """A scalar that weights every element of every differentiable output differently."""
    total = torch.zeros(())
    for t in tensor_leaves(out):
        if t.requires_grad:
            weights = torch.linspace(-1.0, 2.0, t.numel()).reshape(t.shape)
            total = total + (t.float() * weights).sum()
    return total


def grads_and_buffers(state: dict[str, Any]) -> dict[str, Any]:
    """Gradients of every tensor and module parameter in ``state``, plus module buffers."""
    found: dict[str, Any] = {}
    for name, obj in state.items():
        if isinstance(obj, nn.Module):
            for pname, p in obj.named_parameters():
                found[f"{name}.{pname}.grad"] = p.grad
            for bname, b in obj.named_buffers():
                found[f"{name}.{bname}"] = b
        else:
            for i, t in enumerate(tensor_leaves(obj)):
                found[f"{name}[{i}].grad"] = t.grad
    return found


def run_twice(make: Callable[[], dict[str, Any]], step: Callable[..., Any], seed: int = 0):
    """Run ``step(call, **make())`` with ``call=plain`` then ``call=checkpoint``.

    ``make`` builds fresh leaves and modules; ``step`` runs forward *and* backward and returns
    whatever should be compared. Both runs start from the same seeds. Returns the pair
    ``(plain_result, checkpoint_result)``, each ``(step's return, grads_and_buffers(state))``.
    """
    results = []
    for call in (plain, checkpoint):
        torch.manual_seed(seed)
        state = make()
        torch.manual_seed(seed + 1)
        out = step(call, **state)
        results.append((out, grads_and_buffers(state)))
    return results[0], results[1]


def forward_backward(region: Callable[..., Any], **call_kwargs: Any) -> Callable[..., Any]:
    """A ``step`` for :func:`run_twice`: ``call(region, *state.values())``, then backward."""

    def step(call, **state):
        out = call(region, *state.values(), **call_kwargs)
        loss_of(out).backward()
        return out

    return step


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def assert_no_saved_tensors_hooks() -> None:
    assert _compat.top_pack_hook() is None


# ---------------------------------------------------------------------------------------------
# Arguments and outputs
# ---------------------------------------------------------------------------------------------


def test_chain_of_ops_matches_plain_exactly(assert_exact):
    def region(x, w, b):
        h = F.linear(x, w, b).tanh()
        h = h * x.sin() + h.cos()
        return torch.sigmoid(h @ w.t()).exp()

    def make():
        return {"x": leaf(4, 6), "w": nn.Parameter(torch.randn(6, 6)), "b": leaf(6)}

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, forward_backward(region))
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert all(g is not None for g in p_grads.values())


def test_module_with_active_dropout_matches_plain_exactly(assert_exact):
    def make():
        net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8))
        return {"net": net.train(), "x": leaf(5, 8)}

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, forward_backward(lambda n, x: n(x)))
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_module_called_directly_with_input_that_needs_no_grad(assert_exact):
    """Only the parameters require grad: they must still get exact gradients."""

    def make():
        return {"net": nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))}

    def step(call, net):
        x = torch.randn(4, 6)
        out = call(net, x)
        assert out.requires_grad
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert all(g is not None for g in p_grads.values())


def test_keyword_arguments_including_tensors(assert_exact):
    def region(x, *, scale, shift=None, activation=torch.tanh):
        h = activation(x * scale)
        return h if shift is None else h * shift.sin()

    def make():
        return {"x": leaf(3, 5), "shift": leaf(5)}

    def step(call, x, shift):
        out = call(region, x, scale=1.5, shift=shift, activation=torch.sigmoid)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert c_grads["shift[0].grad"] is not None


def test_non_tensor_positional_arguments(assert_exact):
    def region(x, repeats, mode, nothing, w):
        assert nothing is None
        for _ in range(repeats):
            x = torch.tanh(x @ w) if mode == "tanh" else x @ w
        return x

    def make():
        return {"x": leaf(2, 4), "w": leaf(4, 4)}

    def step(call, x, w):
        out = call(region, x, 3, "tanh", None, w)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_tensors_inside_nested_lists_and_dicts(assert_exact):
    def region(feats, extra):
        h = torch.cat(feats, dim=1).tanh()
        h = h * extra["gate"].sigmoid() + extra["more"][0].sin() * extra["more"][1]
        return h.relu()

    def make():
        return {
            "feats": [leaf(3, 2), leaf(3, 4)],
            "extra": {"gate": leaf(6), "more": [leaf(3, 6), 0.5]},
        }

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, forward_backward(region))
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert all(g is not None for g in c_grads.values())


def test_dict_tuple_and_non_tensor_outputs(assert_exact):
    def region(x, w):
        h = (x @ w).tanh()
        return {
            "main": h.sin(),
            "pair": (h.cos(), "label", 3),
            "detached": h.detach() * 2,
            "index": h.argmax(dim=1),
            "none": None,
        }

    def make():
        return {"x": leaf(4, 5), "w": leaf(5, 5)}

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, forward_backward(region))
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert not c_out["detached"].requires_grad and not c_out["index"].requires_grad


def test_outputs_that_are_views_of_intermediates_and_inputs(assert_exact):
    def region(x, w):
        h = (x @ w).sigmoid()
        return h[:, :2], h.t(), h.view(-1), x.view(2, -1), x[1:]

    def make():
        return {"x": leaf(4, 6), "w": leaf(6, 6)}

    def step(call, x, w):
        outs = call(region, x, w)
        # Use the views further: two output views of one intermediate meet again.
        loss = loss_of(outs) + (outs[2] * outs[1].reshape(-1)).sum()
        loss.backward()
        return outs

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_input_returned_as_is(assert_exact):
    def region(x, w):
        return x, (x @ w).tanh()

    def make():
        return {"x": leaf(3, 4), "w": leaf(4, 4)}

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, forward_backward(region))
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_in_place_ops_inside_region(assert_exact):
    """ResNet-style ``ReLU(inplace=True)`` and in-place adds on intermediates."""

    def region(x, w):
        h = (x @ w).sin()
        h.mul_(1.5).add_(x)
        h.relu_()
        return torch.sigmoid(h * x)

    def make():
        return {"x": leaf(4, 4), "w": leaf(4, 4)}

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, forward_backward(region))
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_hooks_inside_the_region_fire_once_with_plain_grads(assert_exact):
    """Tensor hooks, retain_grad and module full-backward hooks registered inside the region."""

    def make():
        return {"net": nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), "x": leaf(2, 4)}

    def step(call, net, x):
        seen = {"tensor_hook": [], "module_hook": [], "kept": []}
        net[1].register_full_backward_hook(
            lambda m, grad_in, grad_out: seen["module_hook"].append((grad_in, grad_out))
        )

        def region(t):
            h = net(t)
            h.register_hook(lambda g: seen["tensor_hook"].append(g))
            h.retain_grad()
            seen["kept"].append(h)
            return h.sin()

        loss_of(call(region, x)).backward()
        return seen["tensor_hook"], seen["module_hook"], seen["kept"][0].grad

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert len(p_out[0]) == len(p_out[1]) == 1 and p_out[2] is not None
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
def test_ambient_no_grad_just_calls_fn(assert_exact, grad_off):
    calls = []

    def region(x):
        calls.append(_compat.top_pack_hook())
        return x.sin() * 2

    x = leaf(3, 3)
    with grad_off():
        expected = region(x)
        calls.clear()
        out = checkpoint(region, x)
    assert calls == [None], "fn must run exactly once, with no saved-tensor hooks installed"
    assert not out.requires_grad and out.grad_fn is None
    assert_exact(out, expected)


def test_region_without_tensor_arguments_closing_over_leaves(assert_exact):
    def make():
        return {"x": leaf(3, 4), "w": leaf(4, 4)}

    def step(call, x, w):
        out = call(lambda: torch.tanh(x @ w).sin())
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_no_hooks_left_after_forward_and_backward():
    out = checkpoint(lambda t: checkpoint(torch.sin, t.cos()).exp(), leaf(4))
    assert_no_saved_tensors_hooks()
    out.sum().backward()
    assert_no_saved_tensors_hooks()
    assert not is_recomputing()


def test_saved_tensor_inspected_outside_backward(assert_exact):
    """Reading ``grad_fn._saved_*`` outside backward recomputes; backward still works."""
    x = leaf(5)
    out = checkpoint(lambda t: t.sin().exp(), x)
    assert_exact(out.grad_fn._saved_result, out)
    out.sum().backward()
    assert_exact(x.grad, (x.detach().sin().exp() * x.detach().cos()))


def test_backward_on_another_thread(assert_exact):
    import threading

    def make():
        return {"block": _conv_bn_relu(), "x": leaf(2, 3, 6, 6)}

    def step(call, block, x):
        conv, bn, relu = block
        out = call(lambda t: relu(call(lambda u: bn(conv(u)), t)), x)
        seen = []

        def worker():
            loss_of(out).backward()
            seen.append(is_recomputing())

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert seen == [False]
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


# ---------------------------------------------------------------------------------------------
# Nesting and autograd entry points
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [2, 3])
def test_nested_checkpoints(assert_exact, depth):
    def make():
        return {"x": leaf(4, 6), "ws": [leaf(6, 6) for _ in range(depth)]}

    def step(call, x, ws):
        def level(d, h):
            h = F.dropout(torch.tanh(h @ ws[d]), p=0.3, training=True)
            if d + 1 < depth:
                h = call(level, d + 1, h)
            return h.sin()

        out = call(level, 0, x)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def _tanh_region(x, w1, w2):
    h = torch.tanh(x @ w1)
    return torch.sin(h @ w2) * h


def _three_leaves():
    return {"x": leaf(4, 5), "w1": leaf(5, 5), "w2": leaf(5, 5)}


def test_autograd_grad_with_explicit_inputs(assert_exact):
    def step(call, x, w1, w2):
        out = call(_tanh_region, x, w1, w2)
        grads = torch.autograd.grad(loss_of(out), inputs=[w1, x])
        return out, grads

    (p_out, p_grads), (c_out, c_grads) = run_twice(_three_leaves, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert all(g is None for g in c_grads.values()), "autograd.grad must not accumulate .grad"


def test_backward_with_inputs_subset(assert_exact):
    def step(call, x, w1, w2):
        out = call(_tanh_region, x, w1, w2)
        loss_of(out).backward(inputs=[w2])
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(_three_leaves, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert c_grads["w2[0].grad"] is not None and c_grads["x[0].grad"] is None


def test_two_partial_backwards_over_one_graph(assert_exact):
    """First backward reaches only ``x``, the second only the weights: both recompute."""

    def step(call, x, w1, w2):
        out = call(_tanh_region, x, w1, w2)
        loss = loss_of(out)
        loss.backward(inputs=[x], retain_graph=True)
        loss.backward(inputs=[w1, w2])
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(_three_leaves, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_retain_graph_backward_twice_doubles_grads(assert_exact):
    def step_once(call, x, w1, w2):
        loss_of(call(_tanh_region, x, w1, w2)).backward()

    def step_twice(call, x, w1, w2):
        loss = loss_of(call(_tanh_region, x, w1, w2))
        loss.backward(retain_graph=True)
        loss.backward()

    (_, once), _ = run_twice(_three_leaves, step_once)
    (_, p_twice), (_, c_twice) = run_twice(_three_leaves, step_twice)
    assert_exact(c_twice, p_twice)
    assert_exact(c_twice, {k: 2 * g for k, g in once.items()})


def test_double_backward_gradient_penalty(assert_exact):
    def step(call, x, w1, w2):
        out = call(_tanh_region, x, w1, w2)
        (gx,) = torch.autograd.grad(loss_of(out), x, create_graph=True)
        penalty = gx.pow(2).sum()
        penalty.backward()
        return out, gx

    (p_out, p_grads), (c_out, c_grads) = run_twice(_three_leaves, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert c_grads["w1[0].grad"].abs().sum() > 0


@pytest.mark.parametrize("early_stop", [True, False])
def test_autograd_grad_inside_the_region(assert_exact, early_stop):
    """A region that differentiates inside its own forward (input-gradient features)."""

    def region(x, w):
        y = (x @ w).tanh()
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return (gx * y).sin()

    def step(call, x, w):
        out = call(region, x, w, early_stop=early_stop)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(lambda: {"x": leaf(3, 4), "w": leaf(4, 4)}, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_only_part_of_the_outputs_used(assert_exact):
    def region(x, w1, w2):
        h = torch.tanh(x @ w1)
        return h.sin(), (h @ w2).cos()

    def step(call, x, w1, w2):
        used, _unused = call(region, x, w1, w2)
        loss_of(used).backward()
        return used

    (p_out, p_grads), (c_out, c_grads) = run_twice(_three_leaves, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    assert c_grads["w2[0].grad"] is None


# ---------------------------------------------------------------------------------------------
# Global state: RNG, autocast, context_fn
# ---------------------------------------------------------------------------------------------


def _random_region(x):
    return F.dropout(x.tanh(), p=0.5, training=True) * torch.rand_like(x)


def test_dropout_replays_rng_and_leaves_caller_rng_alone(assert_exact):
    def step(call, x):
        out = call(_random_region, x)
        loss_of(out).backward()
        # The recomputation must neither consume nor reset the caller's generator.
        return out, torch.rand(8)

    (p_out, p_grads), (c_out, c_grads) = run_twice(lambda: {"x": leaf(16, 16)}, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_preserve_rng_state_false_recomputes_with_fresh_randomness(assert_exact):
    """Proves the flag is honoured: without the stash, backward draws another mask."""

    def step(call, x):
        out = call(_random_region, x, preserve_rng_state=False)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(lambda: {"x": leaf(16, 16)}, step)
    assert_exact(c_out, p_out)  # the forward itself is untouched
    assert not torch.equal(c_grads["x[0].grad"], p_grads["x[0].grad"])


def test_cpu_autocast_bfloat16_is_reentered_on_recompute(assert_exact):
    def region(x, w1, w2):
        h = torch.relu(x @ w1)
        return torch.mm(h, w2).sigmoid()

    def step(call, x, w1, w2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = call(region, x, w1, w2)
        assert out.dtype == torch.bfloat16
        loss_of(out).backward()  # outside autocast on purpose
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(_three_leaves, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_context_fn_contexts_wrap_forward_and_recompute():
    import contextlib

    active = []
    log = []

    @contextlib.contextmanager
    def tag(name):
        active.append(name)
        try:
            yield
        finally:
            active.pop()

    def region(x):
        log.append((tuple(active), is_recomputing()))
        return x.sin().cos()

    out = checkpoint(region, leaf(3), context_fn=lambda: (tag("forward"), tag("recompute")))
    assert not active
    out.sum().backward()
    assert log == [(("forward",), False), (("recompute",), True)]
    assert not active


def test_selective_checkpoint_context_fn_saves_matmuls(assert_exact, op_counter):
    save_mm = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    mm_in_backward = {}

    def step_with(context_fn):
        def step(call, x, w1, w2):
            kwargs = {} if context_fn is None else {"context_fn": context_fn}
            out = call(_tanh_region, x, w1, w2, **kwargs)
            loss = loss_of(out)
            with op_counter() as ops:
                loss.backward()
            mm_in_backward[(call is checkpoint, context_fn is not None)] = ops.counts["mm"]
            return out

        return step

    (p_out, p_grads), (c_out, c_grads) = run_twice(_three_leaves, step_with(save_mm))
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)
    run_twice(_three_leaves, step_with(None))

    plain_mm = mm_in_backward[(False, False)]
    assert plain_mm > 0
    assert mm_in_backward[(True, False)] == plain_mm + 2  # both matmuls recomputed
    assert mm_in_backward[(True, True)] == plain_mm  # none: their outputs were saved


# ---------------------------------------------------------------------------------------------
# is_recomputing and early stop
# ---------------------------------------------------------------------------------------------


def test_is_recomputing_false_in_forward_true_in_recompute():
    seen = []

    def region(x):
        seen.append(is_recomputing())
        return x.sin().cos()

    x = leaf(3)
    assert not is_recomputing()
    out = checkpoint(region, x)
    assert seen == [False]
    out.sum().backward()
    assert seen == [False, True]
    assert not is_recomputing()


def test_is_recomputing_lets_forward_hooks_skip_the_second_run():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid())
    counted, seen = [], []

    def hook(module, args, output):
        seen.append(is_recomputing())
        if not is_recomputing():
            counted.append(module)

    net[2].register_forward_hook(hook)
    out = checkpoint(net, torch.randn(2, 4))
    out.sum().backward()
    assert seen == [False, True]
    assert counted == [net[2]]


def test_is_recomputing_inside_nested_regions():
    seen = {"outer": [], "inner": []}

    def inner(x):
        seen["inner"].append(is_recomputing())
        return x.sin()

    def outer(x):
        seen["outer"].append(is_recomputing())
        return checkpoint(inner, x.cos()).tanh()

    out = checkpoint(outer, leaf(3))
    assert seen == {"outer": [False], "inner": [False]}
    out.sum().backward()
    assert seen["outer"] == [False, True]
    assert seen["inner"][0] is False and all(seen["inner"][1:]) and len(seen["inner"]) >= 2


@pytest.mark.parametrize("early_stop, expected_runs", [(True, 1), (False, 2)])
def test_early_stop_skips_work_after_last_saved_tensor(assert_exact, early_stop, expected_runs):
    runs = {"tail": 0}

    def region(x, w):
        h = torch.sin(x @ w)  # the last op that saves a tensor for backward
        runs["tail"] += 1
        return -h.view(-1)  # neg and view save nothing

    def step(call, x, w):
        runs["tail"] = 0
        out = call(region, x, w, early_stop=early_stop)
        loss_of(out).backward()
        return out, runs["tail"]

    (p_out, p_grads), (c_out, c_grads) = run_twice(lambda: {"x": leaf(3, 4), "w": leaf(4, 4)}, step)
    assert_exact(c_out[0], p_out[0])
    assert_exact(c_grads, p_grads)
    assert c_out[1] == expected_runs


# ---------------------------------------------------------------------------------------------
# checkpoint_sequential
# ---------------------------------------------------------------------------------------------


def _sequential():
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)
    ).train()


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("as_list", [False, True], ids=["sequential", "list"])
def test_checkpoint_sequential_matches_plain(assert_exact, segments, as_list):
    def make():
        return {"net": _sequential(), "x": leaf(5, 6)}

    def step(call, net, x):
        functions = list(net) if as_list else net
        out = net(x) if call is plain else checkpoint_sequential(functions, segments, x)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_checkpoint_sequential_forwards_checkpoint_options(assert_exact):
    def step(call, net, x):
        if call is plain:
            out = net(x)
        else:
            out = checkpoint_sequential(net, 2, x, preserve_rng_state=True, early_stop=False)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(
        lambda: {"net": _sequential(), "x": leaf(5, 6)}, step
    )
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


@pytest.mark.parametrize("segments", [0, -1, 7])
def test_checkpoint_sequential_rejects_bad_segment_counts(segments):
    with pytest.raises((ValueError, VisionCkptError), match="segments") as info:
        checkpoint_sequential(_sequential(), segments, leaf(5, 6))
    message = str(info.value)
    assert str(segments) in message, "the message should quote the value it got"
    assert re.search(r"\b6\b", message), "the message should say how many functions there are"


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def test_use_reentrant_true_is_rejected():
    with pytest.raises((ValueError, VisionCkptError), match="reentrant"):
        checkpoint(torch.sin, leaf(3), use_reentrant=True)


@pytest.mark.parametrize("use_reentrant", ["omitted", None, False])
def test_use_reentrant_false_or_none_accepted_without_warning(assert_exact, use_reentrant):
    x = leaf(3)
    kwargs = {} if use_reentrant == "omitted" else {"use_reentrant": use_reentrant}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = checkpoint(torch.sin, x, **kwargs)
        out.sum().backward()
    assert_exact(x.grad, x.detach().cos())


def test_unknown_determinism_check_names_allowed_values():
    with pytest.raises(ValueError, match=r"(?s)determinism_check.*(default.*none|none.*default)"):
        checkpoint(torch.sin, leaf(3), determinism_check="strict")


def test_checkpoint_error_hierarchy():
    assert issubclass(CheckpointError, VisionCkptError)
    assert issubclass(CheckpointError, RuntimeError)


# ---------------------------------------------------------------------------------------------
# Memory: activations are not kept
# ---------------------------------------------------------------------------------------------


def _ten_op_chain(x):
    for i in range(10):
        x = torch.sin(x) if i % 2 == 0 else torch.cos(x)  # each saves its own (new) input
    return x


def test_checkpoint_packs_a_small_fraction_of_the_activations(assert_exact, saved_bytes):
    def step(call, x):
        with saved_bytes() as counter:
            out = call(_ten_op_chain, x)
        loss_of(out).backward()
        return out, counter.nbytes

    (p_out, p_grads), (c_out, c_grads) = run_twice(lambda: {"x": leaf(64, 64)}, step)
    assert_exact(c_out[0], p_out[0])
    assert_exact(c_grads, p_grads)
    plain_bytes, ckpt_bytes = p_out[1], c_out[1]
    assert plain_bytes >= 10 * 64 * 64 * 4
    assert ckpt_bytes < 0.25 * plain_bytes


def test_intermediates_are_freed_after_forward_and_after_use_in_backward():
    """Storage liveness: nothing inside the region outlives the forward, and recomputed
    tensors are released once backward used them, even with ``retain_graph=True``."""
    from torch.multiprocessing.reductions import StorageWeakRef

    refs = {False: [], True: []}

    def region(x):
        h = x
        for _ in range(4):
            h = h.sin()
            refs[is_recomputing()].append(StorageWeakRef(h.untyped_storage()))
        return h.sum()

    plain_out = region(leaf(100))
    assert not any(r.expired() for r in refs[False][:3]), "sanity: plain autograd keeps them"
    del plain_out
    refs[False].clear()

    out = checkpoint(region, leaf(100))
    assert len(refs[False]) == 4 and all(r.expired() for r in refs[False])
    out.backward(retain_graph=True)
    assert refs[True] and all(r.expired() for r in refs[True])


def test_under_save_on_cpu_hooks(assert_exact):
    def step(call, x, w1, w2):
        with torch.autograd.graph.save_on_cpu():
            out = call(_tanh_region, x, w1, w2)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(_three_leaves, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


# ---------------------------------------------------------------------------------------------
# Better than torch's checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preserve_rng_state", [True, False])
@pytest.mark.parametrize("how", ["to_meta", "device_context"])
def test_meta_device_module_forward_and_backward(preserve_rng_state, how):
    def build():
        net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 4))
        return net, torch.randn(3, 8, requires_grad=True)

    if how == "to_meta":
        net, x = build()
        net = net.to("meta")
        x = x.detach().to("meta").requires_grad_()
        context = torch.device("cpu")
    else:
        with torch.device("meta"):
            net, x = build()
        context = torch.device("meta")

    with context:
        out = checkpoint(net, x, preserve_rng_state=preserve_rng_state)
        out.sum().backward()
    assert out.device.type == "meta" and out.shape == (3, 4)
    assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "meta"
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in net.parameters())


def _conv_bn_relu():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).train()


class _CheckpointsItsNorm(nn.Module):
    """A module region whose forward checkpoints its BatchNorm again (module inside module)."""

    def __init__(self, call):
        super().__init__()
        self.conv, self.bn, self.call = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), call

    def forward(self, x):
        return torch.relu(self.call(self.bn, self.conv(x)))


@pytest.mark.parametrize(
    "variant", ["flat", "nested", "nested_modules", "early_stop_off", "no_momentum"]
)
def test_batchnorm_running_stats_updated_once(assert_exact, variant):
    """torch's checkpoint runs BatchNorm's forward twice in training and updates stats twice."""

    def make():
        block = _conv_bn_relu()
        if variant == "no_momentum":
            block[1].momentum = None  # cumulative moving average: depends on the batch count
        return {"block": block, "x": leaf(2, 3, 6, 6)}

    def step(call, block, x):
        conv, bn, relu = block
        if variant == "nested":
            out = call(lambda t: relu(call(lambda u: bn(conv(u)), t)), x)
        elif variant == "nested_modules":
            region = _CheckpointsItsNorm(call)
            region.conv, region.bn = conv, bn
            out = call(region, x)
        else:
            out = call(block, x, early_stop=(variant != "early_stop_off"))
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert c_grads["block.1.num_batches_tracked"].item() == 1
    assert_exact(c_grads, p_grads)  # includes running_mean, running_var, num_batches_tracked


def test_batchnorm_running_stats_over_several_training_steps(assert_exact):
    def make():
        return {"block": _conv_bn_relu(), "x": leaf(2, 3, 6, 6)}

    def step(call, block, x):
        outs = []
        for i in range(3):
            out = call(block, x * (i + 1))
            loss_of(out).backward()
            outs.append(out)
        return outs

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert c_grads["block.1.num_batches_tracked"].item() == 3
    assert_exact(c_grads, p_grads)


def test_instance_norm_running_stats_updated_once(assert_exact):
    """InstanceNorm with ``track_running_stats=True`` keeps running stats like BatchNorm."""

    def make():
        norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        return {
            "block": nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.ReLU()).train(),
            "x": leaf(2, 3, 6, 6),
        }

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, forward_backward(lambda b, x: b(x)))
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


@pytest.mark.parametrize("region_kind", ["module", "lambda"])
def test_failed_recompute_leaves_batchnorm_buffers_untouched(region_kind):
    class NarrowsOnRecompute(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.narrow = False

        def forward(self, x):
            h = self.bn(x)
            return (h[:, :2] if self.narrow else h).sin()

    block = NarrowsOnRecompute().train()
    x = leaf(5, 4)
    out = checkpoint(block if region_kind == "module" else (lambda t: block(t)), x)
    buffers = dict(block.bn.named_buffers())
    values = {k: v.clone() for k, v in buffers.items()}
    block.narrow = True
    with pytest.raises(CheckpointError, match="shape"):
        out.sum().backward()
    for name, tensor in block.bn.named_buffers():
        assert tensor is buffers[name], f"{name} was not put back"
        assert torch.equal(tensor, values[name]), f"{name} changed"
    assert not is_recomputing()
    block.narrow = False
    block(x).sum().backward()  # a plain step afterwards updates the statistics normally
    assert block.bn.num_batches_tracked.item() == 2


def test_densenet_feature_list_grown_after_the_call(assert_exact):
    """DenseNet passes its growing feature list to every layer, then appends to the same list.

    The recomputation must see the list as it was at call time, not as it is at backward.
    """

    def make():
        layers = nn.ModuleList(nn.Conv2d(3 + 2 * i, 2, 3, padding=1) for i in range(3))
        return {"layers": layers, "x": leaf(2, 3, 5, 5)}

    def step(call, layers, x):
        features = [x]
        for layer in layers:

            def dense_layer(feats, layer=layer):
                return torch.relu(layer(torch.cat(feats, dim=1))).sin()

            features.append(call(dense_layer, features))
        out = torch.cat(features, dim=1)
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_dict_and_nested_list_changed_after_the_call(assert_exact):
    """Same shapes after the change, so a by-reference recompute would be silently wrong."""

    def region(inputs):
        return (inputs["x"].sin() * inputs["skip"][0]).tanh() + inputs["skip"][1].cos()

    def make():
        return {"x": leaf(4, 4), "a": leaf(4, 4), "b": leaf(4, 4)}

    def step(call, x, a, b):
        inputs = {"x": x, "skip": [a, b]}
        out = call(region, inputs)
        inputs["x"] = torch.zeros(4, 4)
        inputs["skip"][0] = torch.ones(4, 4)
        inputs["skip"].append(torch.ones(4, 4))
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(make, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_non_tensor_values_in_containers_are_captured_at_call_time(assert_exact):
    """A flag dict changed after the call must not change what is recomputed."""

    def region(x, w, flags):
        h = x @ w
        h = h[:, :3] if flags["narrow"] else h * 2
        return h.sin()

    def step(call, x, w):
        flags = {"narrow": False}
        out = call(region, x, w, flags)
        flags["narrow"] = True
        loss_of(out).backward()
        return out

    (p_out, p_grads), (c_out, c_grads) = run_twice(lambda: {"x": leaf(5, 6), "w": leaf(6, 7)}, step)
    assert_exact(c_out, p_out)
    assert_exact(c_grads, p_grads)


def test_batchnorm_guard_is_invisible_to_selective_checkpointing_in_an_opaque_region() -> None:
    """A lambda region hides its modules, so the guard works from global hooks; its buffer
    copies must not reach the selective-checkpoint mode active during recomputation."""
    import copy
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3)
    )
    twin = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8)
    net(x).sum().backward()
    policy = functools.partial(
        create_selective_checkpoint_contexts, [torch.ops.aten.convolution.default]
    )
    checkpoint(lambda t: twin(t), x.clone().requires_grad_(), context_fn=policy).sum().backward()
    for (name, a), b in zip(net.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("early_stop", [True, False])
def test_recomputation_leaves_nothing_alive_after_backward(early_stop: bool) -> None:
    """Ops that save their own output (exp) must not leak recomputed tensors step after step."""
    import gc

    from vision_ckpt.measure._memory import track_peak_memory

    h = torch.randn(64, 64, requires_grad=True)

    def region(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y.exp() * y

    ends = []
    for _ in range(3):
        with track_peak_memory(h) as mem:
            checkpoint(region, h, early_stop=early_stop).sum().backward()
            gc.collect()
        ends.append(mem.end_bytes)
        h.grad = None
    assert ends[0] == ends[1] == ends[2]
    assert ends[0] == h.numel() * 4 * 2  # h and its gradient, nothing else


@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "GraphExecGroup"), reason="torch has no GraphExecGroup"
)
def test_each_graph_exec_group_recomputes_even_when_an_old_group_id_is_reused() -> None:
    """Groups are told apart by identity; a freed group's id() may come back for a new one."""
    from torch.utils.checkpoint import GraphExecGroup

    x = torch.randn(8, requires_grad=True)
    y = checkpoint(lambda t: t.sin().exp(), x)
    grads = []
    for _ in range(4):
        with GraphExecGroup():
            (g,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
        grads.append(g)
    expected = torch.autograd.grad(x.sin().exp().sum(), x)[0]
    for g in grads:
        torch.testing.assert_close(g, expected, rtol=0, atol=0)


def test_a_tensor_passed_in_several_places_is_one_object_when_recomputed() -> None:
    """MultiheadAttention(x, x, x) checks `query is key` to pick its self-attention path; the
    recomputation must see one object in all three places, or it runs other ops."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mha(q, k, v, need_weights=False)[0]

    def outer(t: torch.Tensor) -> torch.Tensor:
        h = t * 2  # an intermediate, saved through the enclosing region's hooks
        return checkpoint(attend, h, h, h)

    h = x * 2
    expected = attend(h, h, h)
    expected.sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in mha.parameters()]
    x.grad = None
    mha.zero_grad(set_to_none=True)
    out = checkpoint(outer, x)  # nested: the inner inputs come back through unpack hooks
    out.sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    got = [x.grad] + [p.grad for p in mha.parameters()]
    for a, b in zip(got, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.fixture
def without_make_saved_tensor(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The path for torch builds that lack torch._C._autograd._make_saved_tensor; the list
    counts the calls of the fallback that saves inputs through an autograd Function."""
    import vision_ckpt.runtime._saved_inputs as saved

    calls: list[int] = []
    real = saved._save_with_function

    def counting(tensors: list[torch.Tensor]) -> list[Any]:
        calls.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(saved, "_make_saved_tensor", None)
    monkeypatch.setattr(saved, "_save_with_function", counting)
    return calls


@pytest.mark.parametrize(
    "case",
    ["plain", "nested", "nested_two", "nested_twice", "retain_twice", "double_backward", "list"],
)
def test_inputs_saved_through_an_autograd_function_on_older_torch(
    case: str, without_make_saved_tensor: list[int]
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    lin = torch.nn.Linear(8, 8)

    def f(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(lin(t).tanh(), 0.3).exp()

    def run(ckpt: bool) -> list[torch.Tensor]:
        x.grad = None
        lin.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        if case == "nested":
            y = checkpoint(lambda t: checkpoint(f, t) * 2, x) if ckpt else f(x) * 2
        elif case in ("nested_two", "nested_twice"):  # an inner region of two inputs

            def inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return f(a + b)

            y = (
                checkpoint(lambda t: checkpoint(inner, t, t * 2) * 2, x)
                if ckpt
                else f(x + x * 2) * 2
            )
        elif case == "list":
            y = checkpoint(lambda ts: f(ts[0] + ts[1]), [x, x * 2]) if ckpt else f(x + x * 2)
        else:
            y = checkpoint(f, x) if ckpt else f(x)
        if case in ("retain_twice", "nested_twice"):
            y.sum().backward(retain_graph=True)
            y.sum().backward()
        elif case == "double_backward":
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            g.square().sum().backward()
        else:
            y.sum().backward()
        return [y.detach(), x.grad, lin.weight.grad, lin.bias.grad]

    expected = run(False)
    got = run(True)
    assert without_make_saved_tensor, "the fallback was not used"
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# NOTE [ Settings that choose kernels ]: the recomputation runs under the forward's settings
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _switch(get: Callable[[], Any], put: Callable[[Any], None], value: Any) -> Iterator[None]:
    """Set a global switch to ``value`` inside the block, and restore it after."""
    previous = get()
    put(value)
    try:
        yield
    finally:
        put(previous)


_cuda = torch.backends.cuda
_cudnn = torch.backends.cudnn


def _sdpa_flags() -> tuple[bool, ...]:
    return (
        _cuda.flash_sdp_enabled(),
        _cuda.mem_efficient_sdp_enabled(),
        _cuda.math_sdp_enabled(),
        _cuda.cudnn_sdp_enabled(),
    )


def _determinism() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _cudnn_flags() -> tuple[bool, ...]:
    return (_cudnn.enabled, _cudnn.benchmark, _cudnn.deterministic, _cudnn.allow_tf32)


def _cublas_flags() -> tuple[Any, ...]:
    m = _cuda.matmul
    return (
        m.allow_tf32,
        m.allow_fp16_reduced_precision_reduction,
        m.allow_bf16_reduced_precision_reduction,
    )


def _set_cublas(flags: tuple[Any, ...]) -> None:
    m = _cuda.matmul
    m.allow_tf32 = flags[0]
    m.allow_fp16_reduced_precision_reduction = flags[1]
    m.allow_bf16_reduced_precision_reduction = flags[2]


# name -> (a context manager factory that changes the setting, a reader of the setting)
KERNEL_SETTINGS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "sdpa_kernel": (
        lambda: torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]),
        _sdpa_flags,
    ),
    "deterministic_algorithms": (
        lambda: _switch(
            _determinism,
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
            (True, True),
        ),
        _determinism,
    ),
    "float32_matmul_precision": (
        lambda: _switch(
            torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, "medium"
        ),
        torch.get_float32_matmul_precision,
    ),
    "cudnn_flags": (
        lambda: _cudnn.flags(enabled=False, benchmark=True, deterministic=True, allow_tf32=False),
        _cudnn_flags,
    ),
    "cublas_flags": (
        lambda: _switch(_cublas_flags, _set_cublas, (True, False, False)),
        _cublas_flags,
    ),
}


@pytest.mark.parametrize("name", list(KERNEL_SETTINGS))
def test_recomputation_runs_under_the_forwards_kernel_settings(name: str, assert_exact) -> None:
    """Each setting is changed around the forward only; backward runs outside it. The region
    records the setting each time it runs: the recomputation must see the forward's value, and
    the gradients must equal the plain run's (whose backward uses what the forward saved). For
    the SDPA backends this is also what keeps the saved tensors the same: the math backend saves
    other tensors than the fused CPU kernel the default flags pick."""
    change, read = KERNEL_SETTINGS[name]
    torch.manual_seed(0)
    qkv, proj = nn.Linear(16, 48), nn.Linear(16, 16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    seen: list[Any] = []

    def region(t: torch.Tensor) -> torch.Tensor:
        seen.append(read())
        q, k, v = qkv(t).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        return proj(F.gelu(attn.transpose(1, 2).reshape(2, 5, 16)))

    outside = read()
    results = []
    for run in (region, functools.partial(checkpoint, region)):
        for p in (*qkv.parameters(), *proj.parameters(), x):
            p.grad = None
        seen.clear()
        with change():
            out = run(x)
            inside = read()
        assert inside != outside, "the test must change the setting"
        assert read() == outside
        out.square().sum().backward()
        results.append((out, x.grad, [p.grad for p in (*qkv.parameters(), *proj.parameters())]))
    assert seen == [inside, inside]  # the forward, then the recomputation
    assert read() == outside  # and the recomputation put the backward's setting back
    assert_exact(results[1], results[0])


class _SwitchesOnFirstCall(nn.Module):
    """Attention whose first call turns the fused CPU kernel off for good, before attending: on
    a Hopper GPU torch reordered the SDPA backends' priority for good during a process's first
    attention call (torch 2.11, an H200), so a region entered before it ran its forward with
    one kernel and, replaying the settings it was entered under, recomputed with another."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)
        self.switched = False

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if not self.switched:
            self.switched = True
            _cuda.enable_flash_sdp(False)
        q, k, v = self.qkv(t).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 16))


@contextlib.contextmanager
def _sdpa_flags_restored() -> Iterator[None]:
    before = _sdpa_flags()
    try:
        yield
    finally:
        for enable, on in zip(
            (
                _cuda.enable_flash_sdp,
                _cuda.enable_mem_efficient_sdp,
                _cuda.enable_math_sdp,
                _cuda.enable_cudnn_sdp,
            ),
            before,
            strict=True,
        ):
            enable(on)


def test_a_setting_changed_for_good_inside_the_forward_is_recomputed_as_the_forward_left_it(
    assert_exact,
) -> None:
    """NOTE [ Settings that choose kernels ]: the recomputation runs under the settings the
    forward ended under. Replaying those it was entered under, the recomputation took the fused
    kernel, which saves other tensors (the GPU raised CheckpointError the same way)."""
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        attention = _SwitchesOnFirstCall()
        x = torch.randn(2, 5, 16, requires_grad=True)
        with _sdpa_flags_restored():
            out = checkpoint(attention, x) if checkpointed else attention(x)
            out.square().sum().backward()
        results.append((out, x.grad, [p.grad for p in attention.parameters()]))
    assert_exact(results[1], results[0])


def test_a_run_goes_on_past_a_setting_its_first_member_changed_for_good(assert_exact) -> None:
    """A run's next member is called under the settings the member before it left (a change
    for good, as above), so the run does not end there; it is recomputed under them."""
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(_SwitchesOnFirstCall(), nn.GELU(), nn.Linear(16, 16))
        if checkpointed:
            rules = [{"match": "0", "level": 1, "through": "2"}]
            vision_ckpt.apply(
                model, {"preset": None, "rules": rules, "training_checkpoint_level": 1}
            )
        x = torch.randn(2, 5, 16, requires_grad=True)
        with _sdpa_flags_restored(), warnings.catch_warnings():
            warnings.simplefilter("error")  # a run that ends early warns
            out = model(x)
            out.square().sum().backward()
        results.append((out, x.grad, [p.grad for p in model.parameters()]))
    assert_exact(results[1], results[0])


def test_an_offloaded_input_comes_back_as_it_was() -> None:
    """NOTE [ Offloaded inputs ]: the host copy keeps shape, strides (channels-last here),
    dtype and requires_grad, and the values bit for bit. (On CPU the copy is not pinned: the
    device path, pinned and non-blocking, needs a GPU.)"""
    from vision_ckpt.runtime._saved_inputs import HostCopy, _offloadable, offload_inputs

    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    copy = HostCopy(x, pin=False)
    back = copy.unpack()
    assert back.stride() == x.stride() and back.dtype == x.dtype and back.requires_grad
    assert torch.equal(back, x) and back.data_ptr() != x.data_ptr()
    # on CPU nothing is offloaded: the inputs stay SavedVariables
    assert not _offloadable(x)
    assert not any(isinstance(s, HostCopy) for s in offload_inputs([x, x.detach()]))
