"""``train_timm.py`` on several processes: DistributedDataParallel, or FSDP2 with ``--fsdp``.

Run::

    torchrun --nproc-per-node 2 examples/train_ddp.py --config configs/train/vit_tiny.yaml
    torchrun --nproc-per-node 2 examples/train_ddp.py --config configs/train/vit_tiny.yaml --fsdp
    torchrun --nproc-per-node 2 examples/train_ddp.py --config configs/train/resnet_tiny.yaml \\
        --static-graph

The backend is ``nccl`` when the config's device is CUDA (one GPU per process, by
``LOCAL_RANK``) and ``gloo`` on CPU. Started without ``torchrun`` the script runs as a group of
one process, which is handy for a quick check. Each process trains on its slice of the global
batch of ``batch_size`` images (which must divide evenly), so the run computes the same
gradients as one process on the whole batch, up to the order of the reduction.

# NOTE [ Order: checkpointing, then DDP or fully_shard ]

Apply checkpointing to the plain model first, then wrap it:

* DDP: ``vision_ckpt.apply(model, cfg)`` then ``DistributedDataParallel(model)``. The checkpoint
  core is non-reentrant, so every parameter's gradient is produced once per backward, during the
  one backward pass: the reducer's hooks fire once (no "marked ready twice"), with or without
  ``static_graph=True``, and no parameter looks unused.
* FSDP2: ``vision_ckpt.apply(model, cfg)``, then ``fully_shard(block)`` for each block, then
  ``fully_shard(model)``. ``apply`` gives each selected module an instance-level ``forward``;
  ``fully_shard`` swaps the module's class for an ``FSDP<Name>`` subclass and adds hooks around
  ``__call__``, and keeps that instance attribute. So the all-gather runs in the hooks, outside
  the checkpointed forward, and in backward FSDP's pre-backward hook all-gathers a block's
  parameters before its recomputation needs them.

  The other order does not work as such: ``plan`` and ``apply`` after ``fully_shard`` see the
  renamed classes (``FSDPBlock``), so ``match_type`` rules and class names in a plan made before
  sharding no longer match (``apply`` raises "the plan does not fit this model").
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from _train_config import TrainConfig, load_train_config
from rich.console import Console
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from train_timm import (
    StepStats,
    build_model,
    make_optimizer,
    parse_args,
    progress_bar,
    resolve_device,
    step_info,
    synthetic_batch,
    train_step,
    with_overrides,
)

import vision_ckpt

__all__ = ["init_distributed", "wrap_model", "shard_units", "train", "main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join (or, without ``torchrun``, create a one-process) group; returns (rank, world size)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    return dist.get_rank(), dist.get_world_size()


def shard_units(model: nn.Module, the_plan: vision_ckpt.CheckpointPlan) -> list[nn.Module]:
    """The blocks to shard one by one: the planned level-3 modules (transformer layers,
    residual blocks), outermost first; none when the plan has none."""
    names = [e.name for e in the_plan.entries if e.level == vision_ckpt.Level.MEDIUM_MODULE]
    return [model.get_submodule(n) for n in names if n]


def wrap_model(
    model: nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    fsdp: bool = False,
    static_graph: bool = False,
) -> tuple[nn.Module, vision_ckpt.CheckpointPlan]:
    """Apply checkpointing, then DDP or FSDP2 (see NOTE [ Order: checkpointing, then DDP or
    fully_shard ]). Returns the model to train and the installed plan."""
    the_plan = vision_ckpt.apply(model, cfg.checkpoint)
    if fsdp:
        for block in shard_units(model, the_plan):
            fully_shard(block)
        fully_shard(model)
        return model, the_plan
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, static_graph=static_graph), the_plan


def train(
    cfg: TrainConfig, fsdp: bool = False, static_graph: bool = False, console: Console | None = None
) -> list[StepStats]:
    """Train on this process's slice of every batch; call inside an initialised group.

    Returns:
        Every step's figures, with the loss averaged over the processes.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.batch_size % world:
        raise vision_ckpt.ConfigError(
            f"batch_size {cfg.batch_size} does not split over {world} processes; use a multiple"
        )
    device = resolve_device(cfg)
    console = console or Console(quiet=rank != 0)
    if fsdp and device.type == "cpu" and cfg.track_memory:
        # track_peak_memory follows plain tensor storages; FSDP2's parameters, gradients and
        # optimizer state are DTensors, whose storage it cannot read (a vision_ckpt bug).
        console.print("note: no CPU peak memory with --fsdp (DTensor storages are not tracked)")
        cfg = cfg.model_copy(update={"track_memory": False})
    model, the_plan = wrap_model(build_model(cfg, device), cfg, device, fsdp, static_graph)
    kind = "FSDP2 fully_shard" if fsdp else f"DDP (static_graph={static_graph})"
    console.print(
        f"{cfg.model} on {world} x {device.type} with {kind}: "
        f"{len(the_plan.checkpointed)} of {len(the_plan)} planned modules checkpointed at "
        f"training level {int(the_plan.training_level)}"
    )
    optimizer = make_optimizer(cfg, model.parameters())
    share = cfg.batch_size // world
    history: list[StepStats] = []
    with progress_bar(console) as bar:
        task = bar.add_task("train", total=cfg.steps, info="")
        for step in range(cfg.steps):
            x, y = synthetic_batch(cfg, step)
            x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
            loss, seconds, peak = train_step(
                cfg, model, optimizer, x.to(device), y.to(device), device
            )
            mean_loss = torch.tensor([loss / world], device=device)
            dist.all_reduce(mean_loss)
            history.append(StepStats(step, mean_loss.item(), seconds, peak))
            bar.update(task, advance=1, info=step_info(history[-1]))
    console.print(f"last step (rank 0): {step_info(history[-1])}")
    return history


def main(argv: Sequence[str] | None = None) -> list[StepStats]:
    """Parse the command line, join the process group, train and leave the group.

    Raises:
        SystemExit: the config is invalid (the message names the key).
    """
    args = parse_args(argv, __doc__.split("\n\n")[0], distributed=True)
    try:
        cfg = with_overrides(load_train_config(args.config), args.level, args.steps)
        device = resolve_device(cfg)
    except vision_ckpt.ConfigError as exc:
        raise SystemExit(f"train_ddp: {exc}") from None
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    init_distributed(device)
    try:
        return train(cfg, fsdp=args.fsdp, static_graph=args.static_graph)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
