"""A parameter of one row leaves every rank past the first an empty local shard (ViT's
``cls_token`` [1, 1, D] at world size 2): those ranks have nothing to write, and the build goes
on. The reference is ``ViTModel(config)``'s own initialization."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from isolated import Results, Spawns, run_each, values

import fsdp_builder as fb


def config() -> Any:
    from transformers import ViTConfig

    return ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )


def _vit(materializer: str) -> dict[str, Any]:
    from transformers import ViTModel

    with torch.device("meta"):
        model = ViTModel(config())
    builder = fb.FullyShardBuilder().device(fb.CPUDevice()).timeout(60)
    if materializer == "StreamInit":  # every unit shard by shard, not whole when small
        builder = builder.materialize(fb.StreamInit(whole_below=0))
    elif materializer != "default":
        builder = builder.materialize(getattr(fb, materializer)())
    sharded = builder.build(model)
    emb: Any = sharded.embeddings
    return {
        "local": emb.cls_token.to_local().numel(),
        "cls_token": emb.cls_token.full_tensor(),
        "position_embeddings": emb.position_embeddings.full_tensor(),
    }


MATERIALIZERS = ("default", "StreamInit", "ResetParameters")


def scenarios() -> Results:
    return run_each((m, partial(_vit, m)) for m in MATERIALIZERS)


SPAWNS = Spawns(scenarios, timeout=300)


@pytest.mark.parametrize("materializer", MATERIALIZERS)
def test_an_empty_local_shard_is_not_a_missing_initializer(materializer: str) -> None:
    from transformers import ViTModel

    torch.manual_seed(0)
    eager = ViTModel(config()).embeddings
    ranks = values(SPAWNS(2), materializer)
    assert [r["local"] for r in ranks] == [64, 0]  # rank 1's shard of the one row is empty
    for name in ("cls_token", "position_embeddings"):
        want = getattr(eager, name).detach()
        got = ranks[0][name]
        assert torch.equal(got, ranks[1][name])
        assert got.shape == want.shape and torch.isfinite(got).all()
        # Drawn as ViTModel(config) draws it: trunc_normal_(std=initializer_range).
        assert abs(float(got.std()) - float(want.std())) < 0.3 * float(want.std()), name
        assert abs(float(got.mean())) < 0.01, name
