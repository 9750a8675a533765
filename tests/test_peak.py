"""where_peak and physical_floor (vision_ckpt/measure/peak.py): exact bytes on hand-built
models whose every tensor size is known, the owner of what is live at the peak, and agreement with
the
library's own meter on a timm model."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import timm
import torch
from torch import nn

from vision_ckpt.config import CheckpointConfig
from vision_ckpt.errors import ConfigError
from vision_ckpt.measure._measure import Workload, applied, measure_memory
from vision_ckpt.measure.peak import physical_floor, where_peak

B, H = 256, 4096
N = B * H * 4  # one float32 tensor of the hidden width


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(up=nn.Linear(16, H), act=nn.ReLU(), down=nn.Linear(H, 16))
    ).train()


def test_mlp_peak_is_relu_backward_with_known_tensors() -> None:
    # Backward reaches ReLU holding its saved output (made by act in forward), the gradient
    # of down's input (made by down's backward) and writes the gradient of up's output: three
    # hidden-size tensors, beside down's parameter gradients and the loss with its gradient.
    net = _mlp()
    report = where_peak(net, torch.randn(B, 16))
    down_grads = H * 16 * 4 + 16 * 4
    assert report.peak_bytes == 3 * N + down_grads + 4 + 4
    assert report.phase == "backward"
    assert report.operator == "aten.threshold_backward.default"
    assert report.module == "act"
    assert not report.recomputing
    assert report.group("act", "activation") == N
    assert report.group("act", "gradient") == N
    assert report.group("down", "gradient") == N
    assert report.group("(parameter gradients)") == down_grads
    assert report.group("up") == 0  # up's output is not saved by ReLU: freed in forward
    assert report.param_grad_bytes == down_grads + H * 16 * 4 + H * 4
    assert {g.owner for g in report.groups if g.kind == "input"} == {"(before the step)"}
    assert report.start_bytes == sum(p.numel() * 4 for p in net.parameters()) + B * 16 * 4
    assert all(p.grad is None for p in net.parameters()), "gradients are put back"


class _Wide(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, H // 16)


class _Narrow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True)


def test_forward_peak_owner_is_the_widening_module() -> None:
    net = nn.Sequential(OrderedDict(lin=nn.Linear(16, 16), wide=_Wide(), narrow=_Narrow()))
    report = where_peak(net, torch.randn(B, 16))
    # repeat's output beside its input (lin's output); nothing of backward comes close
    assert report.peak_bytes == N + B * 16 * 4
    assert (report.phase, report.module, report.operator) == (
        "forward",
        "wide",
        "aten.repeat.default",
    )
    biggest = report.groups[0]
    assert (biggest.owner, biggest.kind, biggest.nbytes, biggest.count) == (
        "wide",
        "activation",
        N,
        1,
    )


def _blocks() -> nn.Module:
    torch.manual_seed(0)

    def block() -> nn.Module:
        layers = OrderedDict(
            fc1=nn.Linear(64, 1024), act=nn.GELU(), drop=nn.Dropout(0.1), fc2=nn.Linear(1024, 64)
        )
        return nn.Sequential(layers)

    return nn.Sequential(OrderedDict(b0=block(), b1=block(), head=nn.Linear(64, 8))).train()


def test_peak_after_a_recomputation_holds_the_recomputed_tensors() -> None:
    net = _blocks()
    x = torch.randn(512, 64)
    cfg = {"training_checkpoint_level": 3, "rules": [{"match": "b*", "level": 3}]}
    report = where_peak(net, x, config=cfg)
    with applied(net, CheckpointConfig.model_validate(cfg)):
        meter = measure_memory(Workload(net, x), x)
    assert report.peak_bytes == meter.activation
    # b0, recomputed in backward, holds fc1's output again (saved by GELU) when fc2's weight
    # gradient is taken
    assert report.phase == "backward"
    assert report.module == "b0.fc2" and report.operator == "aten.mm.default"
    assert report.group("b0.fc1", "recomputed") == 512 * 1024 * 4
    assert report.group("b0.fc1", "activation") == 0
    assert report.group("b1.fc1", "recomputed") == 0  # b1's recomputed tensors are gone
    plain = where_peak(net, x)
    assert all(g.kind != "recomputed" for g in plain.groups)
    assert plain.group("b0.fc1", "activation") == plain.group("b1.fc1", "activation") > 0
    assert plain.peak_bytes > report.peak_bytes


def test_floor_of_the_mlp_is_relu_backward_working_set() -> None:
    net = _mlp()
    floor = physical_floor(net, torch.randn(B, 16))
    down_grads = H * 16 * 4 + 16 * 4
    # ReLU's backward: its saved output, the gradient of its output and of its input
    assert floor.operator == "aten.threshold_backward.default"
    assert (floor.phase, floor.module) == ("backward", "act")
    assert floor.working_set_bytes == 3 * N
    assert floor.param_grad_bytes_then == down_grads
    assert floor.floor_bytes == 3 * N + down_grads
    assert floor.max_working_set_bytes == 3 * N
    assert floor.param_grad_bytes == down_grads + H * 16 * 4 + H * 4
    report = where_peak(net, torch.randn(B, 16), floor=True)
    assert report.floor == floor
    assert f"floor {report.floor.floor_bytes / 2**20:.2f} MiB" in str(report)
    # no region plan goes below it: the whole MLP as one region, or each layer
    for rules in ([{"match_type": "Sequential", "level": 1}], [{"match": "*", "level": 1}]):
        cfg = {"training_checkpoint_level": 1, "rules": rules}
        assert where_peak(net, torch.randn(B, 16), config=cfg).peak_bytes >= floor.floor_bytes


def test_timm_resnet_matches_the_library_meter_and_stays_above_the_floor() -> None:
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).train()
    x = torch.randn(2, 3, 48, 48)
    floor = physical_floor(model, x)
    for level in (0, 3):
        report = where_peak(model, x, level=level)
        with applied(model, CheckpointConfig(preset="auto", training_checkpoint_level=level)):
            meter = measure_memory(Workload(model, x), x)
        # the same rules of counting, the same roots: the same bytes (NOTE [ Peak attribution ])
        assert report.peak_bytes == meter.activation
        assert report.start_bytes == meter.peak - meter.activation
        assert report.peak_bytes >= floor.floor_bytes
        assert sum(g.nbytes for g in report.groups) == report.peak_bytes + report.start_bytes
    # level 3's peak is in the backward of the recomputed stem, beside its recomputed tensors
    assert report.group("(recomputation)", "recomputed") > 0


def test_config_and_level_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"both level=3 and a config; give one"):
        where_peak(_mlp(), torch.randn(2, 16), config={"rules": []}, level=3)
