"""A transformers checkpoint with tensors of several MiB, loaded into FSDP2 shards given storage
directly (``allocate_unit``): every value equal to ``from_pretrained``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

from fsdp_builder import CPUDevice, FromCheckpoint, FullyShardBuilder

# Several MiB, as a real model's smaller tensors are.
EMBEDDING_BYTES = 2 << 20


def _gpt2(vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=256, n_layer=2, n_head=4, tie_word_embeddings=True
    )
    return cast(nn.Module, GPT2LMHeadModel(config))


def test_checkpoint_load_of_a_save_pretrained_folder_reads_every_value(
    world1: None, tmp_path: Path
) -> None:
    """A GPT-2 ``save_pretrained`` folder whose embedding is several MiB loads through the
    directly made shards with every value equal to the folder's (as ``from_pretrained``)."""
    pytest.importorskip("transformers")
    from helpers import full_state_dict
    from transformers import GPT2LMHeadModel

    vocab = EMBEDDING_BYTES // 4 // 256
    torch.manual_seed(5)
    cast(Any, _gpt2(vocab)).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = _gpt2(vocab)
    block = type(cast(Any, model).transformer.h[0])
    built = (
        FullyShardBuilder()
        .device(CPUDevice())
        .wrap(block)
        .materialize(FromCheckpoint(tmp_path))
        .build(model)
    )
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()
    got = full_state_dict(built)
    assert set(got) <= set(theirs)
    assert got["transformer.wte.weight"].numel() * 4 >= EMBEDDING_BYTES
    for name, value in got.items():
        assert torch.equal(value, theirs[name]), name
