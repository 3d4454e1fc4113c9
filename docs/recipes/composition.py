"""Tensor parallelism, activation checkpointing, compile and FSDP2 together, in torchtitan's
order: TP, then activation checkpointing, then compile, then ``fully_shard`` per block, root last.

    torchrun --nproc-per-node 4 --standalone docs/recipes/composition.py

A 2-D ``(dp, tp)`` mesh: the blocks are split over ``tp`` by ``parallelize_module`` (yours,
before the build), and the builder shards over ``dp`` (``.groups(mesh["dp"])``). Each rank
prints its losses; the ranks of one TP group train on the same batch and print the same losses.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import ModelArgs, Transformer, TransformerBlock

from fsdp_builder import FullyShardBuilder, KeepAsIs
from fsdp_builder.tools.launch import end_process_group

TP = 2
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32)


def apply_tensor_parallel(model: Transformer, tp: DeviceMesh) -> None:
    """torchtitan's plan: q/k/v and w1/w3 split by columns, wo and w2 by rows."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        assert isinstance(block, TransformerBlock)
        parallelize_module(block, tp, plan)
        # Each rank of the TP group now computes its share of the heads.
        block.attention.n_heads //= tp.size()
        block.attention.n_kv_heads //= tp.size()


def build(mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    apply_tensor_parallel(model, mesh["tp"])  # 1. tensor parallelism, before the build
    # On CPU, Dynamo alone ("eager"): no C compiler is needed. On GPUs, leave the backend out.
    backend = "inductor" if torch.cuda.is_available() else "eager"
    builder = (
        FullyShardBuilder()
        .wrap(TransformerBlock)
        .materialize(KeepAsIs())  # already initialized (and placed on tp)
        .groups(mesh["dp"])  # FSDP shards over the data-parallel dim only
        .activation_checkpointing(TransformerBlock)  # 2. each block checkpointed
        .compile(backend=backend)  # 3. each block compiled, in place
        .mixed_precision(  # 4. fully_shard per block, root last, with this policy
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        )
    )
    return builder.build(model)


def train(model: nn.Module, mesh: DeviceMesh, steps: int = 3) -> list[float]:
    """SGD on batches chosen by the data-parallel rank: one batch per TP group."""
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + mesh["dp"].get_local_rank())
        tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=gen).to(device)
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(
        "cuda" if cuda else "cpu", (world // TP, TP), mesh_dim_names=("dp", "tp")
    )
    model = build(mesh)
    losses = train(model, mesh)
    # One write per line: ranks share stdout, where print() writes the text and its newline
    # apart, so two ranks' lines can run together.
    sys.stdout.write(f"rank {rank}/{world} losses: " + " ".join(f"{x:.4f}" for x in losses) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process_group()  # see its docstring: a clean exit on CPU ranks
