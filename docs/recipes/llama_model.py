"""A small Llama in the style of torchtitan's ``Transformer``, in plain PyTorch.

The layout and the initialization follow torchtitan's Llama 3 model:

- the transformer blocks live in ``layers``, an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ...,
  so their fully-qualified names stay stable when blocks are wrapped or removed;
- the rotary embedding table ``freqs_cis`` is a non-persistent buffer: it is not in the state
  dict and is recomputed by ``init_weights``;
- weights are initialized by ``init_weights`` methods, not ``reset_parameters``: the root's
  ``init_weights(buffer_device=None)`` recomputes the buffer, initializes what the root owns
  (``init_root_weights``) and calls each block's ``init_weights()``, which initializes its
  attention and feed-forward with a depth-scaled standard deviation
  (``0.02 / sqrt(2 * (layer_id + 1))``).

Only ``nn.Linear``, ``nn.Embedding`` and ``nn.RMSNorm`` have ``reset_parameters``, so a model
built on the meta device must be materialized with ``InitFn`` (calling ``init_weights``) or from
a checkpoint; see ``docs/recipes/llama_train.py``.

The rotary table is stored real-valued, ``(max_seq_len, head_dim // 2, 2)`` holding cosines and
sines, so every collective backend (gloo included) can carry it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many key/value heads as query heads
    vocab_size: int = 128
    multiple_of: int = 32  # the feed-forward hidden size is rounded up to a multiple of this
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32
    tie_embeddings: bool = False


def precompute_freqs_cis(
    head_dim: int, end: int, theta: float = 10000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Rotary embedding table for positions ``0 .. end - 1``: ``(end, head_dim // 2, 2)``
    holding ``cos`` and ``sin`` of each position times each frequency."""
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    freqs = 1.0 / (theta**exponents)
    t = torch.arange(end, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, seq, heads, head_dim)`` by the table's first ``seq``
    positions (pairs of adjacent features form one complex number, as in torchtitan)."""
    seq = x.shape[1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos = freqs_cis[:seq, :, 0].view(1, seq, 1, -1)
    sin = freqs_cis[:seq, :, 1].view(1, seq, 1, -1)
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack((real, imag), dim=-1).flatten(-2).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each key/value head ``n_rep`` times (grouped-query attention)."""
    if n_rep == 1:
        return x
    bs, seq, n_kv, head_dim = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, seq, n_kv, n_rep, head_dim)
        .reshape(bs, seq, n_kv * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        # (batch, heads, seq, head_dim) for scaled_dot_product_attention
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # torchtitan's depth init: deeper blocks start with smaller output projections.
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self, init_std: float | None = None) -> None:
        std = self.weight_init_std if init_std is None else init_std
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(std)
        self.feed_forward.init_weights(std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)

    def _precompute_freqs_cis(self, device: torch.device | str | None = None) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(
            args.dim // args.n_heads, args.max_seq_len, args.rope_theta, device=device
        )

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialize every weight and recompute ``freqs_cis`` on ``buffer_device`` (default:
        where the buffer is now, which must not be meta when the model is used)."""
        self.init_root_weights(buffer_device)
        for layer in self.layers.values():
            # A wrapper (activation checkpointing) forwards the call to the block it wraps.
            layer.init_weights()  # type: ignore[operator]

    def init_root_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """What the root owns besides the blocks: ``freqs_cis``, the embeddings, the final norm
        and the output projection (for a build where each block is a unit of its own)."""
        buffer = self.get_buffer("freqs_cis")
        device = buffer_device if buffer_device is not None else buffer.device
        self.freqs_cis = self._precompute_freqs_cis(device)
        nn.init.normal_(self.tok_embeddings.weight)
        self.norm.reset_parameters()
        if not self.model_args.tie_embeddings:
            std = self.model_args.dim**-0.5
            cutoff = 3
            nn.init.trunc_normal_(
                self.output.weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std
            )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.get_buffer("freqs_cis")
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


__all__ = [
    "Attention",
    "FeedForward",
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "precompute_freqs_cis",
    "repeat_kv",
]
