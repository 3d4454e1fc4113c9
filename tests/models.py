"""Small models and training loops that several test modules use.

Spawned ranks import this module by name, as they import the test module that started them
(``tests`` is on the path of every rank).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)

from fsdp_builder.tools.demo import DemoConfig, DemoTransformer

RECIPES = Path(__file__).resolve().parents[1] / "docs" / "recipes"


def recipe_module(name: str) -> Any:
    """A module of docs/recipes/ imported by name; the folder goes on sys.path, as when a recipe
    runs as a script (spawned ranks inherit that path)."""
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    return importlib.import_module(name)


# -- the docs' torchtitan-style Llama ------------------------------------------------------------

llama: Any = recipe_module("llama_model")


def meta_llama(args: Any, checkpointed: bool = False) -> nn.Module:
    """The Llama on the meta device (``freqs_cis`` too: no checkpoint holds it, a build computes
    it); ``checkpointed``: each block under activation checkpointing, applied before the build."""
    with torch.device("meta"):
        model = llama.Transformer(args)
    if checkpointed:
        apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, llama.TransformerBlock)
        )
    return model


def real_llama(args: Any, seed: int) -> nn.Module:
    """The Llama as torchtitan makes it: built eagerly, then ``init_weights()`` under ``seed``."""
    torch.manual_seed(seed)
    model = llama.Transformer(args)
    model.init_weights()
    return model


def without_checkpoint_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's keys as the model without activation checkpointing names them."""
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in state.items()}


# -- the library's demo transformer --------------------------------------------------------------


class TiedDemo(DemoTransformer):
    """The demo model with its output projection tied to the embedding."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__(cfg)
        self.head.weight = self.embed.weight


def meta_demo(cfg: DemoConfig, cls: type[DemoTransformer] = DemoTransformer) -> DemoTransformer:
    with torch.device("meta"):
        return cls(cfg)


def seeded_demo(cfg: DemoConfig, seed: int) -> DemoTransformer:
    """The demo model as eager PyTorch initializes it under ``seed``."""
    torch.manual_seed(seed)
    return DemoTransformer(cfg)


# -- a residual net of tiny blocks, trained on regression batches --------------------------------

DIM = 8
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class GainBlock(Block):
    """A Block whose float32 buffer turns its output back to float32: the next unit then gets
    float32 inputs, which only fully_shard's default input casting makes work in bf16."""

    gain: torch.Tensor
    calls = 0  # forward calls, recomputations under activation checkpointing included

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        GainBlock.calls += 1
        return super().forward(x) * self.gain


class Net(nn.Module):
    """A projection, then ``blocks`` residual blocks, then a mean: one output per row."""

    def __init__(self, blocks: int = 2, block: type[Block] = Block) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(*(block() for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.proj(x)).mean(-1, keepdim=True)


def new_net(blocks: int = 2, block: type[Block] = Block) -> Net:
    """The same weights on every call (and every rank)."""
    torch.manual_seed(0)
    return Net(blocks, block)


def train(model: nn.Module, rank: int = 0, steps: int = STEPS) -> list[float]:
    """SGD steps on regression batches fixed by the step; rank ``r`` trains on its own ones."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, DIM, generator=gen), torch.randn(4, 1, generator=gen)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
