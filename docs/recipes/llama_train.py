"""Train a torchtitan-style Llama (``llama_model.py``) with FSDP2 through the builder.

    torchrun --nproc-per-node 2 docs/recipes/llama_train.py --steps 3

The model is created on the meta device and initialized the torchtitan way, through its
``init_weights`` methods, one unit at a time: each ``TransformerBlock`` is a unit (its
``init_weights()`` initializes the whole block with the depth-scaled std), then the root unit
(embeddings, final norm, output projection and the ``freqs_cis`` buffer). Mixed precision,
activation checkpointing or ``torch.compile`` are one line each where marked.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

# A script's folder is on sys.path: the model sits next to this file.
from llama_model import ModelArgs, Transformer, TransformerBlock
from torch import nn

from fsdp_builder import FullyShardBuilder, InitFn
from fsdp_builder.tools.launch import end_process_group


def torchtitan_init(device: torch.device) -> Callable[[nn.Module], None]:
    """An FSDP1-style ``param_init_fn`` for ``InitFn``: called for each module of a unit while
    its states are on meta, it gives the blocks and the root storage on ``device`` and
    initializes them with their ``init_weights`` methods (the modules inside them have nothing
    left to do)."""

    def init(module: nn.Module) -> None:
        if isinstance(module, TransformerBlock):
            module.to_empty(device=device)
            module.init_weights()
        elif isinstance(module, Transformer):
            # Only what the root owns: the blocks are units of their own, already sharded.
            for owned in (module, module.tok_embeddings, module.norm, module.output):
                owned.to_empty(device=device, recurse=False)
            module.init_root_weights(buffer_device=device)

    return init


def train(steps: int, seed: int = 0) -> list[float]:
    """Build and train on the ranks of the current process group; returns this rank's losses."""
    rank = dist.get_rank()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    model_args = ModelArgs()  # dim 64, 2 layers: a toy; the real 7B is ModelArgs(dim=4096, ...)
    with torch.device("meta"):
        model = Transformer(model_args)
    builder = (
        FullyShardBuilder()
        .device(device)
        .wrap(TransformerBlock)  # each block a unit, the root last
        .materialize(InitFn(torchtitan_init(device)))
        # on GPUs: .mixed_precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    # Every rank draws the same full weights of each unit, then keeps its own shards.
    torch.manual_seed(seed)
    sharded = builder.build(model)

    opt = torch.optim.AdamW(sharded.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own (fixed) batch
    tokens = torch.randint(
        0, model_args.vocab_size, (4, model_args.max_seq_len + 1), generator=gen
    ).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = sharded(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), max_norm=1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    args = parser.parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        losses = train(args.steps, args.seed)
        if dist.get_rank() == 0:
            print("losses: " + " ".join(f"{x:.4f}" for x in losses), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process_group()  # see its docstring: a clean exit on CPU ranks
