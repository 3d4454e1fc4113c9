"""A small transformer-like model, its data and training.

Shared by ``fsdp-builder demo``, the benchmarks and the tests, so all of them exercise one model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import frozen
from torch import nn


@frozen
class DemoConfig:
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 3
    seq: int = 16
    mlp_ratio: int = 4


class Block(nn.Module):
    """Pre-norm attention + MLP."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=True)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class DemoTransformer(nn.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(
    cfg: DemoConfig | None = None, seed: int = 0, device: str = "cpu"
) -> DemoTransformer:
    """The demo model, seeded so every rank (and the reference) builds the same weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        return DemoTransformer(cfg or DemoConfig())


def demo_model() -> DemoTransformer:
    """The default demo model on the ambient device (for ``fsdp-builder plan``)."""
    return DemoTransformer(DemoConfig())


def batch(cfg: DemoConfig, step: int, size: int, seed: int = 1234) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + step)
    return torch.randint(0, cfg.vocab, (size, cfg.seq + 1), generator=gen)


def loss_fn(model: nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    # Tokens go where the model computes (FSDP moves its inputs, not the loss targets).
    device = next((p.device for p in model.parameters() if not p.is_meta), tokens.device)
    tokens = tokens.to(device)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def train(
    model: nn.Module,
    cfg: DemoConfig,
    steps: int,
    rank: int,
    world_size: int,
    per_rank: int = 2,
    lr: float = 0.1,
    fixed_batch: bool = False,
) -> list[float]:
    """SGD steps where rank ``r`` trains on slice ``r`` of each global batch; returns its losses.
    With ``fixed_batch`` every step sees the first batch again, so the losses fall."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens = batch(cfg, 0 if fixed_batch else step, per_rank * world_size).split(per_rank)[rank]
        opt.zero_grad()
        loss = loss_fn(model, tokens, cfg.vocab)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


__all__ = ["Block", "DemoConfig", "DemoTransformer", "make_model"]
