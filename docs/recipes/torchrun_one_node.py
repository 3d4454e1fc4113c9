"""Launch a sharded training job on one machine with torchrun.

    torchrun --nproc-per-node 2 docs/recipes/torchrun_one_node.py
    # the same: python -m torch.distributed.run --nproc-per-node 2 docs/recipes/torchrun_one_node.py

torchrun starts one process per rank and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; ``init_process_group`` reads them. With CUDA each rank uses
GPU ``LOCAL_RANK`` over NCCL, without it the CPU over gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_builder import DeterministicInit, FSDPBuilder, LocalRankDevice
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, batch, loss_fn
from fsdp_builder.tools.launch import end_process_group


def main(steps: int = 3) -> None:
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = DemoConfig()
        with torch.device("meta"):
            model = DemoTransformer(cfg)  # no memory yet
        builder = (
            FSDPBuilder()
            .device(LocalRankDevice())  # cuda:$LOCAL_RANK, or the CPU without CUDA
            .wrap(Block)
            .materialize(DeterministicInit(seed=0))  # same weights at any world size
        )
        sharded = builder.build(model)
        device = builder.environment.device
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        tokens = batch(cfg, step=rank, size=4).to(device)  # each rank its own (fixed) batch
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_fn(sharded, tokens, cfg.vocab)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        every_rank: list[list[float] | None] = [None] * world
        dist.all_gather_object(every_rank, losses)
        if rank == 0:  # one printer: lines of several ranks would interleave
            for r, rank_losses in enumerate(every_rank):
                assert rank_losses is not None
                text = " ".join(f"{x:.4f}" for x in rank_losses)
                print(f"rank {r}/{world} device={device} losses: {text}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process_group()  # see its docstring: a clean exit on CPU ranks
