"""Small vision models written for the tests: ViT-like, Swin-like (einops windows), DenseNet-like.

Each has dropout and drop-path (or feature dropout), runs on a few-pixel image in milliseconds,
and comes with ``LEVEL_RULES``: a config that gives its modules levels 1 to 5 following the level
table (1 a layer with its norm, 2 attention/MLP/dense layer, 3 a transformer layer or transition,
4 a stage or dense block, 5 the trunk). Blocks the examples use too come from
``examples/_blocks.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

# DropPath, PatchMerging and Transition are shared with the examples and benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _blocks import DropPath, PatchMerging, Transition  # noqa: E402

__all__ = ["TinyViT", "TinySwin", "TinyDenseNet", "MODELS", "LEVEL_RULES", "make"]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, drop: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(drop)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        attn = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        attn = self.attn_drop(attn.softmax(dim=-1))
        return self.proj(rearrange(attn @ v, "b h n d -> b n (h d)"))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, drop: float, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, drop)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * 4, drop)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class TinyViT(nn.Module):
    def __init__(self, img: int = 16, patch: int = 4, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2, dim) * 0.02)
        self.pos_drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*[Block(dim, 2, 0.1, 0.2) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rearrange(self.patch_embed(x), "b c h w -> b (h w) c")
        x = self.blocks(self.pos_drop(x + self.pos_embed))
        return self.head(self.norm(x).mean(dim=1))


class WindowAttention(nn.Module):
    """Attention inside non-overlapping windows (Swin), with an optional cyclic shift."""

    def __init__(self, dim: int, heads: int, window: int, shift: int, drop: float) -> None:
        super().__init__()
        self.window, self.shift = window, shift
        self.attn = Attention(dim, heads, drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (b, h, w, c)
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), dims=(1, 2))
        b, h, w, _ = x.shape
        win = rearrange(x, "b (nh p) (nw q) c -> (b nh nw) (p q) c", p=self.window, q=self.window)
        win = self.attn(win)
        x = rearrange(
            win, "(b nh nw) (p q) c -> b (nh p) (nw q) c", b=b, nh=h // self.window, p=self.window
        )
        if self.shift:
            x = torch.roll(x, (self.shift, self.shift), dims=(1, 2))
        return x


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, shift: int, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window, shift, 0.1)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * 2, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class SwinStage(nn.Module):
    def __init__(self, dim: int, depth: int, window: int, downsample: bool) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[SwinBlock(dim, 2, window, (window // 2) * (i % 2), 0.1) for i in range(depth)]
        )
        self.downsample = PatchMerging(dim) if downsample else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.blocks(x))


class TinySwin(nn.Module):
    def __init__(self, img: int = 16, patch: int = 2, dim: int = 16) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.stages = nn.Sequential(
            SwinStage(dim, 2, 4, downsample=True), SwinStage(dim * 2, 2, 2, downsample=False)
        )
        self.norm = nn.LayerNorm(dim * 2)
        self.head = nn.Linear(dim * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rearrange(self.patch_embed(x), "b c h w -> b h w c")
        x = self.norm(self.stages(x))
        return self.head(x.mean(dim=(1, 2)))


class DenseLayer(nn.Module):
    """Takes the list of all previous feature maps, like timm's and torchvision's DenseNet."""

    def __init__(self, cin: int, growth: int, drop: float) -> None:
        super().__init__()
        self.bottleneck = nn.Sequential(
            nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, 2 * growth, 1, bias=False)
        )
        self.conv = nn.Sequential(
            nn.BatchNorm2d(2 * growth), nn.ReLU(), nn.Conv2d(2 * growth, growth, 3, padding=1)
        )
        self.drop = drop

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        out = self.conv(self.bottleneck(torch.cat(features, dim=1)))
        return F.dropout(out, p=self.drop, training=self.training)


class DenseBlock(nn.Module):
    def __init__(self, cin: int, growth: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth, 0.1) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))  # the list keeps growing after each call
        return torch.cat(features, dim=1)


class TinyDenseNet(nn.Module):
    def __init__(self, growth: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()),
            DenseBlock(8, growth, 3),
            Transition(8 + 3 * growth, 10),
            DenseBlock(10, growth, 3),
        )
        self.head = nn.Linear(10 + 3 * growth, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class UpTransition(nn.Module):
    """MONAI VNet's up-transition's shape: the skip's dropout is registered between the
    upsampling's norm and its activation, and called before them; the run up..drop skips it."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.up = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.skip_drop = nn.Dropout(0.5)
        self.act = nn.ELU(inplace=True)
        self.drop = nn.Dropout(0.3)
        self.conv = nn.Conv2d(2 * c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.skip_drop(x)
        out = self.drop(self.act(self.bn(self.up(x))))
        return self.conv(torch.cat((out, skip), 1)) + x


MODELS = {"vit": TinyViT, "swin": TinySwin, "densenet": TinyDenseNet}

LEVEL_RULES: dict[str, list[dict]] = {
    "vit": [
        {"match": "blocks.*.norm?", "level": 1},
        {"match": "blocks.*.attn", "level": 2},
        {"match_type": "Mlp", "level": 2},
        {"match": "blocks.*", "level": 3},
        {"match": "blocks", "level": 4},
        {"match_type": "TinyViT", "level": 5},
    ],
    "swin": [
        {"match": "**.mlp.fc1", "level": 1},
        {"match": "stages.*.blocks.*.attn", "level": 2},
        {"match": "**.mlp", "level": 2},
        {"match": "stages.*.downsample", "level": 2},
        {"match": "stages.*.blocks.*", "level": 3},
        {"match": "stages.*", "level": 4},
        {"match": "stages", "level": 5},
    ],
    "densenet": [
        {"match": "**.layers.*.bottleneck", "level": 1},
        {"match_type": "DenseLayer", "level": 2},
        {"match_type": "Transition", "level": 3},
        {"match": "features.0", "level": 3},
        {"match_type": "DenseBlock", "level": 4},
        {"match": "features", "level": 5},
    ],
}


def make(name: str, seed: int = 0) -> nn.Module:
    """A fresh model with deterministic weights, in training mode."""
    torch.manual_seed(seed)
    return MODELS[name]().train()
