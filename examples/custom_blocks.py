"""Checkpointing your own blocks: a Swin-style window-attention net and a DenseNet-style net.

Each block below asks an :class:`vision_ckpt.ActivationCheckpointing` wrapper to run its parts,
and each wrapper carries the level of the level table that fits what it runs:

====== ==================================== ============================================
level  Swin-style net                       DenseNet-style net
====== ==================================== ============================================
1      ``fc1`` + GELU inside the MLP        norm + ReLU + 1x1 conv (the bottleneck)
2      window attention, MLP                one dense layer
3      one Swin block                       the transition (norm, conv, pool)
4      a stage (its blocks + merging)       a dense block
5      the trunk (every stage)              the trunk (stem, blocks, transitions)
====== ==================================== ============================================

The script trains one step of each net at every training level 0-5 from the same weights and
the same batch, and prints, per level:

* saved: bytes autograd kept for backward during the forward
  (:func:`vision_ckpt.measure.count_saved_bytes`);
* peak: peak of live tensor bytes over forward + backward, minus what was alive before
  (:func:`vision_ckpt.measure.track_peak_memory`);
* calls: how many checkpointed regions the forward started;
* grads: whether every gradient equals the level-0 run bit for bit (the nets have dropout,
  drop-path and BatchNorm, so this also checks RNG and running-statistics handling).

Run::

    python examples/custom_blocks.py                  # both nets, batch 8, 32 px
    python examples/custom_blocks.py --net dense --batch 4 --image-size 16
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from _blocks import DropPath, PatchMerging, Transition, record_core_calls
from einops import rearrange
from rich.console import Console
from rich.table import Table
from torch import nn

from vision_ckpt import ActivationCheckpointing, training_level
from vision_ckpt.measure import count_saved_bytes, format_bytes, track_peak_memory

__all__ = ["SwinNet", "DenseNet", "LevelRow", "measure", "main"]

NUM_CLASSES = 10


# --------------------------------------------------------------------------------------------
# Swin-style net
# --------------------------------------------------------------------------------------------


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """``(b, h, w, c)`` to ``(b * windows, window * window, c)`` token groups."""
    return rearrange(x, "b (nh p) (nw q) c -> (b nh nw) (p q) c", p=window, q=window)


def window_merge(x: torch.Tensor, window: int, batch: int, height: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`."""
    return rearrange(
        x, "(b nh nw) (p q) c -> b (nh p) (nw q) c", b=batch, nh=height // window, p=window
    )


class WindowAttention(nn.Module):
    """Multi-head self-attention inside non-overlapping windows, with an optional cyclic shift."""

    def __init__(self, dim: int, heads: int, window: int, shift: int, drop: float) -> None:
        super().__init__()
        self.heads, self.window, self.shift = heads, window, shift
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_drop = nn.Dropout(drop)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, h, w, c)
        b, h, _, _ = x.shape
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), dims=(1, 2))
        tokens = window_partition(x, self.window)
        q, k, v = rearrange(
            self.qkv(tokens), "n t (three h d) -> three n h t d", three=3, h=self.heads
        )
        attn = self.attn_drop(((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1))
        out = self.proj(rearrange(attn @ v, "n h t d -> n t (h d)"))
        out = window_merge(out, self.window, b, h)
        if self.shift:
            out = torch.roll(out, (self.shift, self.shift), dims=(1, 2))
        return out


class Mlp(nn.Module):
    """``fc1`` + GELU (checkpointed as one layer, level 1), dropout, ``fc2``."""

    def __init__(self, dim: int, hidden: int, drop: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.drop = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)
        self.ckpt_fc1 = ActivationCheckpointing(1)

    def _fc1_act(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.ckpt_fc1(self._fc1_act, x)))


class SwinBlock(nn.Module):
    """Pre-norm window attention and MLP, each a residual branch with drop-path."""

    def __init__(self, dim: int, heads: int, window: int, shift: int, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window, shift, drop=0.1)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim, drop=0.1)
        self.drop_path = DropPath(drop_path)
        self.ckpt_attn = ActivationCheckpointing(2)
        self.ckpt_mlp = ActivationCheckpointing(2)

    def _attn_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.norm1(x))

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.ckpt_attn(self._attn_branch, x))
        return x + self.drop_path(self.ckpt_mlp(self._mlp_branch, x))


class SwinStage(nn.Module):
    """Blocks alternating plain and shifted windows, then an optional patch merging."""

    def __init__(self, dim: int, depth: int, heads: int, window: int, merge: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            SwinBlock(dim, heads, window, shift=(window // 2) * (i % 2), drop_path=0.1)
            for i in range(depth)
        )
        self.downsample = PatchMerging(dim) if merge else nn.Identity()
        self.ckpt_blocks = nn.ModuleList(ActivationCheckpointing(3) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, ckpt in zip(self.blocks, self.ckpt_blocks, strict=True):
            x = ckpt(block, x)
        return self.downsample(x)


class SwinNet(nn.Module):
    """Patch embedding, two Swin stages (the trunk), norm and a linear head."""

    def __init__(self, dim: int = 16, window: int = 4) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=2, stride=2)
        self.stages = nn.ModuleList(
            [
                SwinStage(dim, depth=2, heads=2, window=window, merge=True),
                SwinStage(2 * dim, depth=2, heads=4, window=window // 2, merge=False),
            ]
        )
        self.norm = nn.LayerNorm(2 * dim)
        self.head = nn.Linear(2 * dim, NUM_CLASSES)
        self.ckpt_stages = nn.ModuleList(ActivationCheckpointing(4) for _ in self.stages)
        self.ckpt_trunk = ActivationCheckpointing(5)

    def _trunk(self, x: torch.Tensor) -> torch.Tensor:
        for stage, ckpt in zip(self.stages, self.ckpt_stages, strict=True):
            x = ckpt(stage, x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rearrange(self.patch_embed(x), "b c h w -> b h w c")
        x = self.norm(self.ckpt_trunk(self._trunk, x))
        return self.head(x.mean(dim=(1, 2)))


# --------------------------------------------------------------------------------------------
# DenseNet-style net
# --------------------------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv bottleneck (level 1), then BN-ReLU-3x3 conv; reads every earlier map."""

    def __init__(self, cin: int, growth: int, drop: float) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 2 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(2 * growth)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)
        self.drop = drop
        self.ckpt_bottleneck = ActivationCheckpointing(1)

    def _bottleneck(self, features: list[torch.Tensor]) -> torch.Tensor:
        # Concatenating inside the checkpoint keeps the (large) concatenation out of memory:
        # the reason torchvision's DenseNet has its memory_efficient mode.
        return self.conv1(F.relu(self.norm1(torch.cat(features, dim=1))))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        out = self.conv2(F.relu(self.norm2(self.ckpt_bottleneck(self._bottleneck, features))))
        return F.dropout(out, p=self.drop, training=self.training)


class DenseBlock(nn.Module):
    """Dense layers, each fed the list of all maps before it; outputs their concatenation."""

    def __init__(self, cin: int, growth: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth, 0.1) for i in range(depth))
        self.ckpt_layers = nn.ModuleList(ActivationCheckpointing(2) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer, ckpt in zip(self.layers, self.ckpt_layers, strict=True):
            # The list keeps growing after the call: the core captures it as it is now.
            features.append(ckpt(layer, features))
        return torch.cat(features, dim=1)


class DenseNet(nn.Module):
    """Stem, dense block, transition, dense block (the trunk), then pooling and a linear head."""

    def __init__(self, growth: int = 8, depth: int = 3) -> None:
        super().__init__()
        c1 = 2 * growth
        c2 = c1 + depth * growth
        c3 = c2 // 2
        self.stem = nn.Sequential(nn.Conv2d(3, c1, 3, padding=1, bias=False), nn.BatchNorm2d(c1))
        self.block1 = DenseBlock(c1, growth, depth)
        self.transition = Transition(c2, c3)
        self.block2 = DenseBlock(c3, growth, depth)
        self.head = nn.Linear(c3 + depth * growth, NUM_CLASSES)
        self.ckpt_block1 = ActivationCheckpointing(4)
        self.ckpt_transition = ActivationCheckpointing(3)
        self.ckpt_block2 = ActivationCheckpointing(4)
        self.ckpt_trunk = ActivationCheckpointing(5)

    def _trunk(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = self.ckpt_block1(self.block1, x)
        x = self.ckpt_transition(self.transition, x)
        return self.ckpt_block2(self.block2, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ckpt_trunk(self._trunk, x).mean(dim=(2, 3)))


NETS: dict[str, type[nn.Module]] = {"swin": SwinNet, "dense": DenseNet}


# --------------------------------------------------------------------------------------------
# Measuring one training step per level
# --------------------------------------------------------------------------------------------


@dataclass
class LevelRow:
    """What one training step at one training level did."""

    level: int
    """The training level (0-5)."""
    saved_bytes: int
    """Bytes autograd kept for backward during the forward."""
    peak_bytes: int
    """Peak of live tensor bytes over forward + backward, minus what was alive before."""
    checkpoint_calls: int
    """Checkpointed regions started by the forward (recomputations not counted)."""
    loss: float
    """The step's loss (the same at every level)."""
    max_grad_diff: float
    """Largest absolute difference of any gradient from the level-0 run."""

    @property
    def exact(self) -> bool:
        """Whether every gradient equals the level-0 run bit for bit."""
        return self.max_grad_diff == 0.0


def measure(
    net: nn.Module, batch: int, image_size: int, levels: Sequence[int] = range(6), seed: int = 0
) -> list[LevelRow]:
    """One forward + backward of a copy of ``net`` at each training level, on the same batch.

    Every run starts from the same weights, buffers, batch and RNG seed, so the losses and
    gradients of all levels must be equal bit for bit.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, image_size, image_size, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
    rows: list[LevelRow] = []
    reference: dict[str, torch.Tensor] | None = None
    for level in levels:
        model = copy.deepcopy(net).train()
        torch.manual_seed(seed + 1)  # the dropout and drop-path masks
        with training_level(level), track_peak_memory(model) as peak:
            with record_core_calls() as calls, count_saved_bytes() as saved:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if reference is None:
            reference = grads
        diff = max((grads[n] - reference[n]).abs().max().item() for n in grads)
        rows.append(
            LevelRow(
                level=int(level),
                saved_bytes=saved.nbytes,
                peak_bytes=peak.activation_bytes,
                checkpoint_calls=calls.count(False),
                loss=loss.item(),
                max_grad_diff=diff,
            )
        )
    return rows


def _table(name: str, rows: list[LevelRow]) -> Table:
    table = Table(title=f"{name}: one training step per training level", title_justify="left")
    for column in ("level", "saved for bwd", "peak (fwd+bwd)", "ckpt calls", "loss", "grads"):
        table.add_column(column, justify="right")
    base = rows[0]
    for r in rows:
        table.add_row(
            str(r.level),
            f"{format_bytes(r.saved_bytes)} ({r.saved_bytes / max(base.saved_bytes, 1):.0%})",
            f"{format_bytes(r.peak_bytes)} ({r.peak_bytes / max(base.peak_bytes, 1):.0%})",
            str(r.checkpoint_calls),
            f"{r.loss:.6f}",
            "exact" if r.exact else f"DIFFER by {r.max_grad_diff:.3g}",
        )
    return table


def main(argv: Sequence[str] | None = None) -> dict[str, list[LevelRow]]:
    """Measure both nets (or the one named by ``--net``) at every level and print the tables.

    Returns:
        The rows per net name.

    Raises:
        SystemExit: a level's gradients differ from the level-0 run (status 1).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", choices=["swin", "dense", "both"], default="both")
    parser.add_argument("--batch", type=int, default=8, help="images per step (default 8)")
    parser.add_argument("--image-size", type=int, default=32, help="a multiple of 16 (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.image_size % 16:
        parser.error(f"--image-size {args.image_size} is not a multiple of 16 (windows of 4 px)")

    console = Console()
    results: dict[str, list[LevelRow]] = {}
    for name in ("swin", "dense") if args.net == "both" else (args.net,):
        torch.manual_seed(args.seed)
        net = NETS[name]()
        rows = measure(net, args.batch, args.image_size, seed=args.seed)
        console.print(_table(name, rows))
        results[name] = rows
    bad = [(n, r.level) for n, rows in results.items() for r in rows if not r.exact]
    if bad:
        raise SystemExit(f"custom_blocks: gradients differ from level 0 at {bad}")
    return results


if __name__ == "__main__":
    main()
