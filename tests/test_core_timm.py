"""Real (tiny) timm models with every block run through ``vision_ckpt.checkpoint``.

Training mode with drop-path (and dropout for the ViT) active: outputs, every parameter
gradient and every buffer must equal the un-checkpointed model's bit for bit.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import vision_ckpt

timm = pytest.importorskip("timm")


def _checkpoint_each(blocks: list[nn.Module]) -> None:
    """Route each block's forward through the checkpoint, keeping parameter names unchanged."""
    for block in blocks:
        block.forward = functools.partial(vision_ckpt.checkpoint, block.forward)


def _vit_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)


def _resnet_blocks(model: nn.Module) -> list[nn.Module]:
    return [
        block
        for stage in (model.layer1, model.layer2, model.layer3, model.layer4)
        for block in stage
    ]


MODELS = {
    "vit_tiny": (
        lambda: timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=32,
            patch_size=8,
            depth=2,
            drop_path_rate=0.1,
            proj_drop_rate=0.1,
            attn_drop_rate=0.1,
        ),
        _vit_blocks,
        2,
    ),
    "resnet18": (
        lambda: timm.create_model("resnet18", pretrained=False, drop_path_rate=0.1),
        _resnet_blocks,
        8,
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_timm_model_with_checkpointed_blocks_matches_plain(assert_exact, exact_step, name):
    build, blocks_of, n_blocks = MODELS[name]
    torch.manual_seed(0)
    plain_model = build().train()
    ckpt_model = copy.deepcopy(plain_model)
    blocks = blocks_of(ckpt_model)
    assert len(blocks) == n_blocks
    _checkpoint_each(blocks)

    seen = []
    inside_last_block = next(blocks[-1].children())  # its hooks run inside the region
    inside_last_block.register_forward_hook(
        lambda m, a, o: seen.append(vision_ckpt.runtime.is_recomputing())
    )
    x = torch.randn(2, 3, 32, 32)

    plain = exact_step(plain_model, x)
    ckpt = exact_step(ckpt_model, x)
    assert seen == [False, True], "the last block was not checkpointed (or not recomputed)"

    assert all(g is not None for g in plain["grads"].values())
    assert_exact(ckpt, plain)  # output, input and parameter gradients, BatchNorm statistics
