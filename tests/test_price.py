"""The modelled price of operators (``vision_ckpt.measure._price``, NOTE [ A modelled
price ]): FLOPs from shapes, bytes from the tensors read and written, and a whole step priced the
same on every
run, its recomputation included."""

from __future__ import annotations

import torch
from torch import nn

import vision_ckpt
from vision_ckpt.measure._measure import Workload, default_loss
from vision_ckpt.measure._price import (
    ModelledClock,
    cheap_product_flops,
    modelled_step_seconds,
    op_flops,
    op_seconds,
)

aten = torch.ops.aten


def test_a_convolution_costs_its_multiply_adds_forward_and_per_gradient_backward() -> None:
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    out = aten.convolution.default(*args)
    forward = op_flops(aten.convolution.default, args, out)
    assert forward == 2 * 3 * 3 * 3 * out.numel()
    grad = torch.ones_like(out)
    back = (grad, x, w, [8], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    assert op_flops(aten.convolution_backward.default, back, None) == 2 * forward
    only_weight = (*back[:10], [False, True, False])
    assert op_flops(aten.convolution_backward.default, only_weight, None) == forward


def test_fused_attention_costs_its_two_products_and_more_backward() -> None:
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    forward = op_flops(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v), None)
    assert forward == 2 * 2 * 4 * 10 * 10 * (8 + 8)
    grad = torch.ones_like(q)
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert op_flops(backward, (grad, q, k, v), None) == 2.5 * forward


def test_light_operators_cost_the_bytes_they_move_and_a_view_nothing() -> None:
    small, large = torch.randn(64, 64), torch.randn(128, 64)
    relu = aten.relu.default
    one = op_seconds(relu, (small,), {}, relu(small), "cpu")
    two = op_seconds(relu, (large,), {}, relu(large), "cpu")
    assert one > 0 and two == 2 * one
    assert op_seconds(aten.view.default, (small, [-1]), {}, small.view(-1), "cpu") == 0.0
    assert op_flops(relu, (small,), relu(small)) == 0
    # a GPU moves bytes faster than this CPU: the same operator costs less there
    assert op_seconds(relu, (small,), {}, relu(small), "cuda") < one


def test_a_product_on_tokens_costs_what_it_costs_on_their_rows() -> None:
    """A linear layer without a bias on (batch, tokens, channels) returns through
    aten._unsafe_view, which shares its argument's storage: it moves nothing."""
    w = torch.randn(96, 64)
    tokens = torch.randn(4, 49, 64)
    with ModelledClock("cpu") as on_tokens:
        torch.nn.functional.linear(tokens, w)
    with ModelledClock("cpu") as on_rows:
        torch.nn.functional.linear(tokens.reshape(-1, 64), w)
    assert on_tokens.seconds == on_rows.seconds > 0


def test_a_step_is_priced_alike_every_time_with_its_recomputation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])
    x = torch.randn(16, 32)
    work = Workload(model, x, default_loss, None)
    plain = modelled_step_seconds(work, x)
    assert plain == modelled_step_seconds(work, x)
    config = {"rules": [{"match": r"re:^\d$", "level": 3}], "training_checkpoint_level": 3}
    vision_ckpt.apply(model, config)
    checkpointed = modelled_step_seconds(work, x)
    assert checkpointed == modelled_step_seconds(work, x)
    vision_ckpt.remove(model)
    with torch.no_grad(), ModelledClock("cpu") as clock:
        model(x)
    # the recomputation is priced: more than the plain step, at most one forward more (the
    # core stops a recomputation once it has what the backward needs)
    assert plain < checkpointed <= plain + clock.seconds


def test_a_product_under_the_break_even_costs_less_than_an_activation_of_its_output() -> None:
    """NOTE [ Products cheap to redo ]: a product of fewer FLOPs per output element than
    ``cheap_product_flops`` is priced under a ReLU of its output, one of more over it."""
    relu, mm = aten.relu.default, aten.mm.default
    for device, dtype in (
        ("cpu", torch.float32),
        ("cuda", torch.float32),
        ("cuda", torch.bfloat16),
    ):
        out = torch.randn(512, 512, dtype=dtype)
        streamed = op_seconds(relu, (out,), {}, relu(out), device)
        length = cheap_product_flops(device, out.element_size()) // 2  # 2 FLOPs a multiply-add
        for reduction, cheaper in ((length - 8, True), (length + 8, False)):
            a, b = (
                torch.randn(512, reduction, dtype=dtype),
                torch.randn(reduction, 512, dtype=dtype),
            )
            product = op_seconds(mm, (a, b), {}, a @ b, device)
            assert product < streamed if cheaper else product > streamed, (device, reduction)
