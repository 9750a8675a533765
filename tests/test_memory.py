"""Memory accounting in bytes: deterministic, exact on known allocations, aware of views,
backward and checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from vision_ckpt.measure._memory import count_saved_bytes, format_bytes, track_peak_memory

MiB = 2**20


def _chain(x: torch.Tensor, n: int = 6) -> torch.Tensor:
    # Each op saves its input (or output) for backward: n activations of x's size.
    for _ in range(n):
        x = x.sin() * 1.5
    return x


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536 * 1024, "1.50 MiB"),
        (3 * 2**30, "3.00 GiB"),
        (-2 * MiB, "-2.00 MiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_known_allocation_is_exact() -> None:
    with track_peak_memory() as mem:
        a = torch.empty(1024, 1024)  # float32: exactly 4 MiB
        assert mem.end_bytes == 4 * MiB  # live figures while the block runs
    assert (mem.start_bytes, mem.peak_bytes, mem.end_bytes) == (0, 4 * MiB, 4 * MiB)
    assert mem.activation_bytes == 4 * MiB
    assert mem.num_allocations == 1
    del a


def test_release_is_seen_and_peak_kept() -> None:
    with track_peak_memory() as mem:
        a = torch.ones(1024, 1024)
        b = a * 2  # 8 MiB live together
        del a, b
        c = torch.zeros(256)
    assert mem.peak_bytes == 8 * MiB
    assert mem.end_bytes == c.untyped_storage().nbytes() == 1024


def test_views_and_inplace_count_once() -> None:
    with track_peak_memory() as mem:
        a = torch.zeros(512, 512)  # 1 MiB
        views = [a.view(-1), a.t(), a[::2], a.transpose(0, 1).contiguous().view(512, 512)]
        a.add_(1).mul_(2)
        a.detach().unsqueeze(0).squeeze(0)
    # the only new storages: a, and one contiguous copy of its transpose
    assert mem.num_allocations == 2
    assert mem.peak_bytes == 2 * MiB
    del views


def test_views_of_storage_from_before_entry_are_not_allocations() -> None:
    outside = torch.zeros(1024, 1024)
    with track_peak_memory() as mem:
        outside.view(-1)[:10].add_(1)
        outside.t()
    assert (mem.start_bytes, mem.peak_bytes, mem.num_allocations) == (0, 0, 0)


def test_roots_count_as_live_at_entry() -> None:
    model = nn.Linear(256, 256)  # 256 KiB weight + 1 KiB bias
    x = torch.zeros(4, 256)
    model(x).sum().backward()  # .grad exists now: counted too
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.step()  # momentum buffers
    with track_peak_memory(model, opt, [x, x.view(-1)]) as mem:
        pass
    params = sum(p.numel() * 4 for p in model.parameters())
    assert mem.start_bytes == 3 * params + x.numel() * 4  # params, grads, momentum, x once


def test_deterministic_across_runs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())
    x = torch.randn(2, 3, 16, 16)

    def measure() -> tuple[int, ...]:
        model.zero_grad(set_to_none=True)
        with count_saved_bytes() as saved, track_peak_memory(model) as mem:
            model(x).square().mean().backward()
        return (mem.start_bytes, mem.peak_bytes, mem.end_bytes, mem.num_allocations, saved.nbytes)

    first = measure()
    assert first[1] > first[0] > 0
    assert measure() == first


def test_backward_allocations_are_seen() -> None:
    x = torch.randn(1024, 256, requires_grad=True)  # 1 MiB
    w = torch.randn(256, 256, requires_grad=True)
    y = (x @ w).relu().sum()
    with track_peak_memory() as mem:
        y.backward()
    # grad of the matmul output (1 MiB), the relu mask's gradient and x.grad (1 MiB) at least
    assert mem.num_allocations >= 3
    assert mem.peak_bytes >= 2 * MiB
    # x.grad and w.grad remain alive: they are part of the end figure
    assert mem.end_bytes >= x.grad.untyped_storage().nbytes() + w.grad.untyped_storage().nbytes()


def test_param_grads_are_counted_and_freed() -> None:
    model = nn.Linear(512, 512)
    params = sum(p.numel() * 4 for p in model.parameters())
    x = torch.randn(8, 512)
    with track_peak_memory(model) as mem:
        model(x).sum().backward()
        with_grads = mem.end_bytes
        model.zero_grad(set_to_none=True)
    assert mem.start_bytes == params
    assert with_grads == 2 * params  # the activations are freed, the gradients stay
    assert mem.end_bytes == params


def test_saved_bytes_count_each_storage_once() -> None:
    x = torch.randn(1024, requires_grad=True)
    with count_saved_bytes() as saved:
        y = x.sin()  # saves x
        z = x.cos()  # saves x again: same storage
        (y + z).sum()
    assert saved.num_packed == 2
    assert saved.num_storages == 1
    assert saved.nbytes == 4096


def test_saved_bytes_ignore_meta() -> None:
    x = torch.empty(1024, 1024, device="meta", requires_grad=True)
    with count_saved_bytes() as saved:
        x.sin().sum()
    assert saved.num_packed == 1
    assert saved.nbytes == 0


def test_saved_bytes_count_what_a_selective_region_keeps() -> None:
    """The planner's and the derivation's menus rest on this count (the torch floor's reason)."""
    import vision_ckpt

    def mlps() -> torch.nn.Module:
        torch.manual_seed(0)

        def mlp() -> torch.nn.Module:
            return torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
            )

        return torch.nn.Sequential(mlp(), mlp())

    x = torch.randn(32, 64)
    saved = {}
    for way, extra in (("full", {}), ("selective", {"keep": "heavy"})):
        model = mlps()
        rules = [{"match": name, "level": 1, **extra} for name in ("0", "1")]
        vision_ckpt.apply(model, {"preset": None, "rules": rules, "training_checkpoint_level": 1})
        with count_saved_bytes(model) as counted:
            model(x)
        saved[way] = counted.nbytes
    f32 = 4
    # full: each region keeps its input; selective: the first input and every linear's output
    # (the first region's last output is the second's input, counted once)
    assert saved["full"] == 2 * 32 * 64 * f32
    assert saved["selective"] == 32 * 64 * f32 + 2 * (32 * 256 + 32 * 64) * f32


def test_checkpoint_reduces_saved_bytes() -> None:
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB
    with count_saved_bytes() as plain:
        y_plain = _chain(x)
    with count_saved_bytes() as ckpt:
        y_ckpt = torch_checkpoint(_chain, x, use_reentrant=False)
    assert plain.nbytes >= 6 * x.numel() * 4
    assert ckpt.nbytes <= plain.nbytes // 4

    # And gradients are unaffected by the counting hooks.
    (g_plain,) = torch.autograd.grad(y_plain.sum(), x)
    (g_ckpt,) = torch.autograd.grad(y_ckpt.sum(), x)
    torch.testing.assert_close(g_plain, g_ckpt, rtol=0, atol=0)


def test_checkpoint_lowers_memory_kept_between_forward_and_backward() -> None:
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        for _ in range(8)
    )
    x = torch.randn(512, 128, requires_grad=True)  # 256 KiB per activation

    def step(ckpt: bool) -> tuple[int, int, int]:
        blocks.zero_grad(set_to_none=True)
        with track_peak_memory(blocks, x) as mem:
            h = x
            for b in blocks:
                h = torch_checkpoint(b, h, use_reentrant=False) if ckpt else b(h)
            loss = h.square().mean()
            kept = mem.end_bytes - mem.start_bytes
            loss.backward()
        return kept, mem.activation_bytes, mem.num_allocations

    kept_plain, act_plain, allocs_plain = step(False)
    kept_ckpt, act_ckpt, allocs_ckpt = step(True)
    assert kept_ckpt * 2 < kept_plain
    assert act_ckpt < act_plain
    # recomputation in backward runs through the dispatcher: more allocations are seen
    assert allocs_ckpt > allocs_plain
    assert step(True) == (kept_ckpt, act_ckpt, allocs_ckpt)


def test_tracking_stops_at_exit() -> None:
    with track_peak_memory() as mem:
        a = torch.ones(1024)
    torch.ones(1024, 1024)
    del a
    assert (mem.peak_bytes, mem.end_bytes) == (4096, 4096)


def test_device_filter() -> None:
    with track_peak_memory(device="cuda") as mem:
        torch.ones(1024)
    assert mem.peak_bytes == 0 and mem.device is not None and mem.device.startswith("cuda")
    with track_peak_memory(device="cpu") as mem:
        torch.ones(1024)
    assert mem.peak_bytes == 4096
    assert mem.cuda_peak_bytes is None and mem.cuda_activation_bytes is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_figures() -> None:
    with track_peak_memory(device="cuda") as mem:
        a = torch.empty(1024, 1024, device="cuda")
    assert mem.peak_bytes == 4 * MiB
    assert mem.cuda_activation_bytes is not None and mem.cuda_activation_bytes >= 4 * MiB
    del a


def test_count_saved_bytes_can_leave_out_parameters() -> None:
    """Linear saves its weight for backward; excluding the module counts activations only."""
    layer = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256, requires_grad=True)
    with count_saved_bytes() as everything:
        layer(x).sum()
    with count_saved_bytes(layer) as activations:
        layer(x).sum()
    assert everything.nbytes == activations.nbytes + 256 * 256 * 4
    assert activations.nbytes == 8 * 256 * 4


def test_timeline_records_live_bytes_after_every_operation() -> None:
    with track_peak_memory(timeline=True) as mem:
        a = torch.ones(256)  # 1 KiB
        b = a * 2  # +1 KiB
        del a
        c = b + 1  # a freed before this op: 2 KiB live after it
        del b, c
    assert mem.timeline == [1024, 2048, 2048]
    assert mem.peak_bytes == max(mem.timeline)
    with track_peak_memory() as plain:
        torch.ones(4)
    assert plain.timeline is None


def test_counting_a_forward_never_followed_by_backward_keeps_nothing_alive() -> None:
    """ReLU and exp save their own outputs; a pack hook that handed the tensor back would make
    a C++ cycle (node -> saved output -> node) that outlives the forward, parameters included."""
    import gc
    import weakref

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    weight = weakref.ref(net[0].weight)
    with count_saved_bytes(net) as saved:
        out = net(torch.randn(4, 8)).exp()
    assert saved.nbytes > 0
    del out, net
    gc.collect()
    assert weight() is None, "the counted forward's graph kept the model's parameters alive"
