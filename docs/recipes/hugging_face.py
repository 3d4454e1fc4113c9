"""Fine-tune a Hugging Face transformers model with FSDP2 and export it for ``from_pretrained``.

    torchrun --nproc-per-node 2 docs/recipes/hugging_face.py --folder /tmp/hf --phase train
    python docs/recipes/hugging_face.py --folder /tmp/hf --phase check

``train`` starts from a ``save_pretrained`` folder with several shard files (``<folder>/base``;
the script writes a small random Llama there as a stand-in for a downloaded model), builds the
model on the meta device from its ``config.json``, loads the weights with ``FromCheckpoint``
(each rank reads only its own shards), fine-tunes a few steps and writes the result with
``save_hf_checkpoint`` (``<folder>/export``, weights and ``config.json``); rank 0 also saves
the fine-tuned model's logits on a fixed batch (``<folder>/logits.pt``). ``check`` runs in a
new process without any process group: plain ``from_pretrained`` of the export gives the same
logits.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fsdp_builder import FromCheckpoint, FullyShardBuilder, save_hf_checkpoint
from fsdp_builder.tools.launch import end_process_group

STEPS = 3
VOCAB = 96


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def write_base_checkpoint(folder: Path) -> None:
    """A stand-in for a downloaded model: a small random Llama written by ``save_pretrained``
    in several shard files (``model.safetensors.index.json`` and its shards)."""
    if dist.get_rank() == 0 and not (folder / "config.json").exists():
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="40KB")
    dist.barrier()


def meta_model(folder: Path) -> nn.Module:
    """The model of the folder's ``config.json``, on the meta device: no memory, no weights."""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def batch(step: int, rank: int) -> torch.Tensor:
    """Token ids of one step on one rank; ``step=-1`` is the evaluation batch (every rank's)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 16), generator=gen)


def eval_logits(model: nn.Module, device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch(-1, 0).to(device)).logits.float().cpu()


def train(folder: str, steps: int = STEPS) -> tuple[list[float], torch.Tensor]:
    """Load, fine-tune and export on the ranks of the current process group; returns this
    rank's losses and the fine-tuned model's logits on the evaluation batch."""
    root, device = Path(folder), compute_device()
    write_base_checkpoint(root / "base")
    model = (
        FullyShardBuilder()  # wraps each decoder layer: the model's _no_split_modules
        .device(device)
        .materialize(FromCheckpoint(root / "base"))  # HF names, no key_map needed
        .build(meta_model(root / "base"))
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        ids = batch(step, dist.get_rank()).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    # Collective: one tensor gathered at a time, rank 0 writes the files and config.json.
    save_hf_checkpoint(model, root / "export", max_shard_bytes=100_000)
    logits = eval_logits(model, device)
    if dist.get_rank() == 0:
        torch.save(logits, root / "logits.pt")
    return losses, logits


def check(folder: str) -> bool:
    """In a new process: ``from_pretrained`` of the export gives the fine-tuned logits."""
    root = Path(folder)
    model = AutoModelForCausalLM.from_pretrained(root / "export")
    logits = eval_logits(model, torch.device("cpu"))
    torch.save(logits, root / "reloaded.pt")
    return torch.equal(logits, torch.load(root / "logits.pt"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", required=True, help="where the checkpoints go")
    parser.add_argument("--phase", choices=["train", "check"], required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    if args.phase == "check":
        same = check(args.folder)
        print("from_pretrained gives the fine-tuned logits" if same else "logits differ")
        return 0 if same else 1
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        losses, _ = train(args.folder, args.steps)
        shown = " ".join(f"{x:.6f}" for x in losses)
        # One write per line: ranks share stdout, where print() writes the text and its newline
        # apart, so two ranks' lines can run together.
        sys.stdout.write(f"rank {dist.get_rank()}/{dist.get_world_size()} losses: {shown}\n")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    end_process_group()  # see its docstring: a clean exit on CPU ranks
    sys.exit(code)
