"""Checkpoints whose names transformers converts on load (vision-language models, DINOv2): a
``save_pretrained`` folder loads through ``FromCheckpoint(folder)`` with no ``key_map``, bit-equal
to ``from_pretrained``, the renames of transformers' conversion mapping applied even where the
mapping also holds a transform the loader cannot apply. Tiny configs; no hub access."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers", reason="transformers is part of the test extra")
import transformers
from helpers import full_state_dict

from fsdp_builder import (
    ConfigurationError,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    ShardingBuilder,
)
from fsdp_builder.tools.launch import run_ranks

pytestmark = pytest.mark.timeout(300)

TEXT = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
MROPE = {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
TOKENS = {"image_token_id": 95, "video_token_id": 94, "vision_start_token_id": 93}
VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
VISION_IMAGE = {"num_attention_heads": 2, "image_size": 16, "patch_size": 8}
BACKENDS: dict[str, Callable[[], ShardingBuilder]] = {
    "fsdp1": FSDPBuilder,
    "fsdp2": FullyShardBuilder,
}


def _configs() -> dict[str, tuple[Any, type[nn.Module]]]:
    t: Any = transformers  # its configs' keyword types are stricter than tiny test configs
    return {
        "llava": (
            t.LlavaConfig(
                text_config={"model_type": "llama", **TEXT},
                vision_config={
                    "model_type": "clip_vision_model",
                    **VISION,
                    **VISION_IMAGE,
                    "projection_dim": 16,
                },
                image_token_id=95,
            ),
            t.LlavaForConditionalGeneration,
        ),
        "paligemma": (
            t.PaliGemmaConfig(
                text_config={"model_type": "gemma", **TEXT, "head_dim": 16},
                vision_config={
                    "model_type": "siglip_vision_model",
                    **VISION,
                    **VISION_IMAGE,
                    "projection_dim": 32,
                },
                image_token_id=95,
                projection_dim=32,
            ),
            t.PaliGemmaForConditionalGeneration,
        ),
        "qwen2_vl": (
            t.Qwen2VLConfig(
                text_config={**TEXT, **MROPE},
                vision_config={
                    "depth": 1,
                    "embed_dim": 32,
                    "hidden_size": 32,
                    "num_heads": 2,
                    "patch_size": 2,
                    "temporal_patch_size": 2,
                    "spatial_merge_size": 1,
                    "mlp_ratio": 2,
                },
                **TOKENS,
            ),
            t.Qwen2VLForConditionalGeneration,
        ),
        "qwen2_5_vl": (
            t.Qwen2_5_VLConfig(
                text_config={**TEXT, **MROPE},
                vision_config={
                    "depth": 1,
                    "hidden_size": 32,
                    "out_hidden_size": 32,
                    "intermediate_size": 48,
                    "num_heads": 2,
                    "patch_size": 2,
                    "temporal_patch_size": 2,
                    "spatial_merge_size": 1,
                    "fullatt_block_indexes": [0],
                    "window_size": 4,
                },
                **TOKENS,
            ),
            t.Qwen2_5_VLForConditionalGeneration,
        ),
        "dinov2": (
            t.Dinov2Config(**VISION, **VISION_IMAGE),
            t.Dinov2Model,
        ),
        "qwen3_vl_moe": (
            t.Qwen3VLMoeConfig(
                text_config={
                    **TEXT,
                    "head_dim": 16,
                    "moe_intermediate_size": 16,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]},
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 32,
                    "intermediate_size": 48,
                    "num_heads": 2,
                    "patch_size": 2,
                    "temporal_patch_size": 2,
                    "spatial_merge_size": 1,
                    "out_hidden_size": 32,
                    "num_position_embeddings": 16,
                    "deepstack_visual_indexes": [0],
                },
                **TOKENS,
            ),
            t.Qwen3VLMoeForConditionalGeneration,
        ),
    }


FAMILIES = list(_configs())
# save_pretrained writes this one under the model's own names (its fused experts too): its
# mapping's converters (a Transpose) are for other checkpoints and must not be asked for.
NATIVE = {"qwen3_vl_moe"}


def make(family: str, meta: bool = True, **changes: Any) -> nn.Module:
    config, cls = _configs()[family]
    for name, value in changes.items():
        setattr(config, name, value)
    if meta:
        with torch.device("meta"):
            return cls(config)
    torch.manual_seed(3)
    return cls(config)


def saved(family: str, folder: Path, shard: str = "2000MB", **changes: Any) -> tuple[Path, Any]:
    """A ``save_pretrained`` folder of a fresh eager model, and the class that reads it."""
    model: Any = make(family, meta=False, **changes)
    model.save_pretrained(folder, max_shard_size=shard)
    return folder, type(model)


def saved_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:6]}"
    for name, value in want.items():
        assert got[name].dtype == value.dtype, f"{what} {name}: dtype"
        assert torch.equal(got[name], value), f"{what} {name}: values differ"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_save_pretrained_folder_loads_with_no_key_map_like_from_pretrained(
    world1: None, tmp_path: Path, family: str
) -> None:
    folder, cls = saved(family, tmp_path / family)
    want: Any = cls.from_pretrained(folder)
    # The folder holds transformers' original names, not the model's: it needs converting.
    assert (saved_names(folder) == set(want.state_dict())) == (family in NATIVE)
    model = make(family)
    got = full_state_dict(FullyShardBuilder().materialize(FromCheckpoint(folder)).build(model))
    check_equal(got, want.state_dict(), family)


def test_a_converter_the_loader_cannot_apply_is_refused_naming_it_and_the_key(
    world1: None, tmp_path: Path
) -> None:
    """A SwiGLU DINOv2 saves ``mlp.weights_in``, which transformers splits in two (a Chunk)."""
    folder, _ = saved("dinov2", tmp_path / "swiglu", use_swiglu_ffn=True)
    assert "encoder.layer.0.mlp.weights_in.weight" in saved_names(folder)
    model = make("dinov2", use_swiglu_ffn=True)
    with pytest.raises(ConfigurationError) as caught:
        FullyShardBuilder().materialize(FromCheckpoint(folder)).build(model)
    message = str(caught.value)
    assert "encoder.layer.0.mlp.weights_in." in message
    assert "Chunk(dim=0)" in message and "mlp.gate_proj." in message and "mlp.up_proj." in message
    assert "from_pretrained" in message
    assert "key_map" not in message, "the renames were dropped: the generic mismatch came"
    assert all(p.is_meta for p in model.parameters()), "the model was changed"


def _load_on_ranks(family: str, folder: str) -> dict[str, dict[str, torch.Tensor]] | None:
    out = {}
    for backend, builder in BACKENDS.items():
        sharded = builder().materialize(FromCheckpoint(folder)).build(make(family))
        out[backend] = full_state_dict(sharded)
    return out if dist.get_rank() == 0 else None


@pytest.mark.parametrize("family", ["llava"])
def test_two_ranks_load_a_vlm_folder_like_from_pretrained_on_both_backends(
    tmp_path: Path, family: str
) -> None:
    folder, cls = saved(family, tmp_path / family, shard="40KB")
    assert (folder / "model.safetensors.index.json").exists()  # several files
    want = cls.from_pretrained(folder).state_dict()
    got = run_ranks(_load_on_ranks, 2, family, str(folder), timeout=240)[0]
    for backend in BACKENDS:
        check_equal(got[backend], want, f"{family} {backend}")
