"""Several machines: hybrid sharding, shards inside a node, replicas across nodes.

Run the same command on every node (here 2 nodes with 2 processes each; use one process per
GPU), pointing the rendezvous at one of them:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id job1 docs/recipes/multinode.py

torchrun sets ``LOCAL_WORLD_SIZE`` (processes per node), from which ``AutoHybridGroups`` makes
the shard groups (the ranks of one node) and the replicate groups (one rank per node), so
parameter all-gathers stay inside a node and only gradient all-reduces cross nodes.
``BroadcastFromRank0`` gives every replica rank 0's initial weights. (With one process per node
each shard group would have one rank, and the builder would replicate over all ranks,
``NO_SHARD``, saying so in a warning.)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from fsdp_builder import (
    AutoHybridGroups,
    BroadcastFromRank0,
    FullyShardBuilder,
    LocalRankDevice,
    ResetParameters,
)
from fsdp_builder.tools.launch import end_process_group


def main(steps: int = 3) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(rank)  # different random init per rank: the broadcast evens it out
        with torch.device("meta"):
            model = nn.Sequential(
                nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
            )
        builder = (
            FullyShardBuilder()
            .device(LocalRankDevice())
            .groups(AutoHybridGroups())  # nodes of LOCAL_WORLD_SIZE ranks
            .sharding("hybrid")
            .wrap(nn.Linear)
            .materialize(ResetParameters())
            .synchronize(BroadcastFromRank0())
        )
        sharded = builder.build(model)
        env = builder.environment
        shard = dist.get_world_size(env.groups.shard_group)
        strategy = env.options.strategy.name  # HYBRID_SHARD (NO_SHARD with one rank per node)
        device = builder.environment.device
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(8, 16, generator=gen).to(device)
        y = torch.randn(8, 4, generator=gen).to(device)
        opt = torch.optim.SGD(sharded.parameters(), lr=0.05)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(sharded(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        node = os.environ.get("GROUP_RANK", "?")
        # One write per line: a node's ranks share its stdout, where print() writes the text
        # and its newline apart, so two ranks' lines can run together.
        sys.stdout.write(
            f"node {node} rank {rank}/{world}: {strategy} over groups of {shard} ranks, "
            "losses: " + " ".join(f"{v:.4f}" for v in losses) + "\n"
        )
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process_group()  # see its docstring: a clean exit on CPU ranks
