"""Initializers the library knows for classes of another library, by the class's module and
qualified name, so that library is not imported to register them: diffusers' embedding modules
whose constructor computes a buffer (the sincos positional embeddings of DiT, SD3, PixArt,
CogView and CogVideoX), recomputed by diffusers' own functions from the module's attributes, so
a model built on meta gets ``Model(config)``'s values exactly. One registered for the class with
``register_initializer`` takes precedence (``conventions.initializer_of``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Each runs the computation of the module's constructor again, from what the constructor kept,
# and writes the module's own buffer in place; a module built without the buffer is left alone.


def _write_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    target = module._buffers.get(name)
    if target is None:
        return
    with torch.no_grad():
        target.copy_(value.reshape(target.shape))


def _diffusers_patch_embed(module: nn.Module) -> None:
    """``diffusers.models.embeddings.PatchEmbed`` (DiT, SD3, PixArt): its ``pos_embed``."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    target = module._buffers.get("pos_embed")
    if target is None:
        return
    m: Any = module
    # As __init__: pos_embed_max_size (SD3), else int(num_patches ** 0.5).
    grid = m.pos_embed_max_size or int((m.height * m.width) ** 0.5)
    value = get_2d_sincos_pos_embed(
        target.shape[-1],
        grid,
        base_size=m.base_size,
        interpolation_scale=m.interpolation_scale,
        output_type="pt",
    )
    _write_buffer(module, "pos_embed", value.float().unsqueeze(0))


def _diffusers_cogview3_patch_embed(module: nn.Module) -> None:
    """``CogView3PlusPatchEmbed``: its ``pos_embed`` of ``pos_embed_max_size`` squared."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    m: Any = module
    size = m.pos_embed_max_size
    value = get_2d_sincos_pos_embed(m.hidden_size, size, base_size=size, output_type="pt")
    _write_buffer(module, "pos_embed", value.float())


def _diffusers_cogvideox_patch_embed(module: nn.Module) -> None:
    """``CogVideoXPatchEmbed``: its ``pos_embedding``, from its own method."""
    if module._buffers.get("pos_embedding") is None:
        return
    m: Any = module
    value = m._get_positional_embeddings(m.sample_height, m.sample_width, m.sample_frames)
    _write_buffer(module, "pos_embedding", value)


def _diffusers_sinusoidal(module: nn.Module) -> None:
    """``SinusoidalPositionalEmbedding``: ``pe``, as its constructor computes it."""
    target = module._buffers.get("pe")
    if target is None:
        return
    _, length, dim = target.shape
    position = torch.arange(length).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
    pe = torch.zeros(1, length, dim)
    pe[0, :, 0::2] = torch.sin(position * div_term)
    pe[0, :, 1::2] = torch.cos(position * div_term)
    _write_buffer(module, "pe", pe)


_EMBEDDINGS = "diffusers.models.embeddings"
# "module.qualname" of a class → its initializer.
KNOWN_BY_NAME: dict[str, Callable[[nn.Module], None]] = {
    f"{_EMBEDDINGS}.PatchEmbed": _diffusers_patch_embed,
    f"{_EMBEDDINGS}.CogView3PlusPatchEmbed": _diffusers_cogview3_patch_embed,
    f"{_EMBEDDINGS}.CogVideoXPatchEmbed": _diffusers_cogvideox_patch_embed,
    f"{_EMBEDDINGS}.SinusoidalPositionalEmbedding": _diffusers_sinusoidal,
}


__all__ = ["KNOWN_BY_NAME"]
