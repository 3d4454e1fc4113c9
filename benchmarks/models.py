"""The benchmark model, in plain PyTorch so the baselines never import the library.

A transformer-like stack of pre-norm attention + MLP blocks from ``torch.nn`` with a size knob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BenchConfig:
    vocab: int = 4096
    dim: int = 256
    heads: int = 4
    layers: int = 8
    mlp_ratio: int = 4

    @classmethod
    def for_params(cls, target: int, layers: int = 8, vocab: int = 4096) -> BenchConfig:
        """The config closest to ``target`` parameters, with ``dim`` a multiple of 64."""
        best = cls(vocab=vocab, dim=64, heads=1, layers=layers)
        for dim in range(64, 16384, 64):
            cfg = cls(vocab=vocab, dim=dim, heads=max(1, dim // 64), layers=layers)
            if abs(cfg.params - target) < abs(best.params - target):
                best = cfg
            if cfg.params > target:
                break
        return best

    @property
    def block_params(self) -> int:
        d, h = self.dim, self.mlp_ratio * self.dim
        attn = 3 * d * d + 3 * d + d * d + d
        mlp = d * h + h + h * d + d
        return attn + mlp + 4 * d  # + two LayerNorms

    @property
    def params(self) -> int:
        return (
            self.layers * self.block_params
            + self.vocab * self.dim
            + 2 * self.dim
            + (self.dim * self.vocab + self.vocab)
        )


class Block(nn.Module):
    """Pre-norm attention + MLP."""

    def __init__(self, cfg: BenchConfig) -> None:
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


class BenchTransformer(nn.Module):
    def __init__(self, cfg: BenchConfig) -> None:
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


def make_model(cfg: BenchConfig, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """The model on ``device``; seeded, so every rank that builds it on a real device agrees."""
    torch.manual_seed(seed)
    with torch.device(device):
        return BenchTransformer(cfg)


def bench_model() -> BenchTransformer:
    """The ~200M-parameter benchmark model, for ``fsdp-builder plan benchmarks.models:bench_model
    --wrap Block``."""
    return BenchTransformer(BenchConfig.for_params(200_000_000))


def reset_module(module: nn.Module) -> None:
    """Initialize one module's own parameters the way its constructor does.

    ``nn.MultiheadAttention`` keeps its initializer private, which is what users special-case.
    """
    if isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()  # type: ignore[operator]


def model_bytes(cfg: BenchConfig) -> int:
    return cfg.params * 4


def largest_unit_bytes(cfg: BenchConfig) -> int:
    """The largest wrap unit when every Block is wrapped: a block, or the root's leftovers."""
    root = cfg.vocab * cfg.dim + 2 * cfg.dim + cfg.dim * cfg.vocab + cfg.vocab
    return max(cfg.block_params, root) * 4
