"""Start from a Hugging Face checkpoint, train, save with DCP, resume in new processes, export.

    torchrun --nproc-per-node 2 docs/recipes/resume.py --folder /tmp/run --phase train
    torchrun --nproc-per-node 2 docs/recipes/resume.py --folder /tmp/run --phase resume

``train`` writes a stand-in for a downloaded HF checkpoint (``<folder>/hf``: shard files, an
index and HF names), builds the torchtitan-style Llama (``llama_model.py``) from it with
``FromCheckpoint`` and a ``key_map``, trains, saves the model and the optimizer with
``torch.distributed.checkpoint`` (``<folder>/step<N>``) halfway and trains on to the end.
``resume`` runs in new processes: it builds the model from the DCP folder, loads the optimizer
with PyTorch's own ``set_optimizer_state_dict`` and runs the same remaining steps, with the
same losses as the uninterrupted run; then it exports the model as HF safetensors
(``<folder>/export``) with ``save_hf_checkpoint``, unit by unit.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

# A script's folder is on sys.path: the model sits next to this file.
from llama_model import ModelArgs, Transformer, TransformerBlock
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict

from fsdp_builder import (
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    ShardingBuilder,
    save_hf_checkpoint,
)
from fsdp_builder.tools.launch import end_process_group

MODEL_ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128)
STEPS = 6  # the DCP checkpoint is saved after STEPS // 2

# HF (transformers' Llama) names → this model's names, for FromCheckpoint.
FROM_HF = [
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.([qkvo])_proj\.", r".attention.w\1."),
    (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
    (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
    (r"\.mlp\.up_proj\.", ".feed_forward.w3."),
    (r"\.input_layernorm\.", ".attention_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
]
# The reverse, for save_hf_checkpoint.
TO_HF = [
    (r"^tok_embeddings\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^layers\.", "model.layers."),
    (r"\.attention\.w([qkvo])\.", r".self_attn.\1_proj."),
    (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),
    (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
    (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
    (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
]


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def builder(backend: str, device: torch.device) -> ShardingBuilder:
    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    return kind().device(device).wrap(TransformerBlock)


def meta_model(device: torch.device) -> nn.Module:
    """The model on meta; the rotary table is not in any checkpoint, so it is computed."""
    with torch.device("meta"):
        model = Transformer(MODEL_ARGS)
    model.freqs_cis = model._precompute_freqs_cis(device)
    return model


def write_hf_checkpoint(folder: Path) -> None:
    """A stand-in for a downloaded checkpoint: a seeded model written in HF layout and names
    (every rank builds the same one; rank 0 writes)."""
    torch.manual_seed(0)
    model = Transformer(MODEL_ARGS)
    model.init_weights()
    save_hf_checkpoint(model, folder, key_map=TO_HF, max_shard_bytes=100_000)


def steps(model: nn.Module, optim: torch.optim.Optimizer, first: int, last: int) -> list[float]:
    """Steps ``first`` .. ``last - 1``; each rank's batch depends only on the step and rank,
    so a resumed run sees the batches the uninterrupted one saw."""
    device = next(model.parameters()).device
    losses = []
    for step in range(first, last):
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        tokens = torch.randint(0, MODEL_ARGS.vocab_size, (2, 17), generator=gen).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def train(folder: str, backend: str = "fsdp2") -> list[float]:
    """Build from the HF checkpoint, train STEPS steps, save with DCP halfway."""
    root, device = Path(folder), compute_device()
    write_hf_checkpoint(root / "hf")
    model = (
        builder(backend, device)
        .materialize(FromCheckpoint(root / "hf", key_map=FROM_HF))
        .build(meta_model(device))
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = steps(model, optim, 0, STEPS // 2)
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=root / f"step{STEPS // 2}")
    return losses + steps(model, optim, STEPS // 2, STEPS)


def model_part(key: str) -> str | None:
    """The DCP folder holds {"model": ..., "optim": ...}: the model's entries, unprefixed."""
    return key.removeprefix("model.") if key.startswith("model.") else None


def resume(folder: str, backend: str = "fsdp2") -> list[float]:
    """New processes: build from the DCP folder, load the optimizer, train on, export."""
    root, device = Path(folder), compute_device()
    saved = root / f"step{STEPS // 2}"
    model = (
        builder(backend, device)
        .materialize(FromCheckpoint(saved, key_map=model_part))  # each rank reads its shards
        .build(meta_model(device))
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, optim_state = get_state_dict(model, optim)  # the layout to load into
    dcp.load({"optim": optim_state}, checkpoint_id=saved)
    set_optimizer_state_dict(model, optim, optim_state)
    losses = steps(model, optim, STEPS // 2, STEPS)
    save_hf_checkpoint(model, root / "export", key_map=TO_HF)
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", required=True, help="where the checkpoints go")
    parser.add_argument("--phase", choices=["train", "resume"], required=True)
    parser.add_argument("--backend", choices=["fsdp1", "fsdp2"], default="fsdp2")
    args = parser.parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        run = train if args.phase == "train" else resume
        losses = run(args.folder, args.backend)
        if dist.get_rank() == 0:
            print("losses: " + " ".join(f"{x:.6f}" for x in losses), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process_group()  # see its docstring: a clean exit on CPU ranks
