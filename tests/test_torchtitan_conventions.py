"""torchtitan's init conventions, written out (torchtitan itself imports triton, which a CPU-only
machine lacks): a root ``init_weights(buffer_device=None)`` or ``init_weights(**kwargs)`` that
recomputes the RoPE table, blocks with ``init_weights(init_std)``. ``InitWeights``,
``DeterministicInit`` and ``FromCheckpoint`` must give the buffers eager construction gives and,
for the load, eager's logits; 2 gloo ranks, compared with the eager model in the test process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from torch import nn

from fsdp_builder import (
    DeterministicInit,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    InitWeights,
    Materializer,
    ShardingBuilder,
)

RECIPES = Path(__file__).resolve().parents[1] / "docs" / "recipes"
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))

from llama_model import ModelArgs, Transformer, TransformerBlock  # noqa: E402

from fsdp_builder.planning.ignored import clean_name  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


class KwargsTransformer(Transformer):
    """torchtitan 0.3's signature: the buffer device arrives through ``**kwargs``."""

    def init_weights(self, **kwargs: Any) -> None:
        super().init_weights(kwargs.get("buffer_device"))


MODELS: dict[str, type[Transformer]] = {
    "buffer_device": Transformer,
    "kwargs": KwargsTransformer,
}
BACKENDS: dict[str, Callable[[], ShardingBuilder]] = {
    "fsdp1": FSDPBuilder,
    "fsdp2": FullyShardBuilder,
}
TOKENS = torch.arange(12).reshape(2, 6) % ARGS.vocab_size


def materializers(path: str) -> dict[str, Materializer]:
    return {
        "init_weights": InitWeights(seed=0),
        "deterministic": DeterministicInit(seed=0),
        "load": FromCheckpoint(path),
    }


def case(variant: str, backend: str, how: str, path: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = MODELS[variant](ARGS)
    builder = BACKENDS[backend]().wrap(TransformerBlock).materialize(materializers(path)[how])
    sharded = builder.build(model)
    found = {clean_name(n): b for n, b in sharded.named_buffers()}
    out: dict[str, Any] = {"freqs_cis": found["freqs_cis"].detach().clone()}
    if how == "load":
        with torch.no_grad():
            out["logits"] = sharded(TOKENS).detach()
    out["rank"] = dist.get_rank()
    return out


def cases(path: str) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for variant in MODELS:
        for backend in BACKENDS:
            for how in materializers(path):
                if how == "init_weights" and backend == "fsdp1":
                    continue  # refused in configure: FSDP1 cannot shard before initializing
                yield (variant, backend, how), partial(case, variant, backend, how, path)


def scenarios(path: str) -> Results:
    return run_each(cases(path))


SPAWNS = Spawns(scenarios, timeout=240)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, nn.Module]:
    from safetensors.torch import save_file

    torch.manual_seed(5)
    eager = Transformer(ARGS)
    path = tmp_path_factory.mktemp("titan") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in eager.state_dict().items()}, str(path))
    return str(path), eager


@pytest.mark.parametrize("key", [k for k, _ in cases("")], ids=lambda k: "-".join(k))
def test_torchtitans_conventions_give_eagers_buffers_and_logits(
    checkpoint: tuple[str, nn.Module], key: tuple[str, str, str]
) -> None:
    path, eager = checkpoint
    want = eager.get_buffer("freqs_cis")
    with torch.no_grad():
        want_logits = eager(TOKENS)
    for got in values(SPAWNS(2, path), key):
        assert torch.equal(got["freqs_cis"], want), f"rank {got['rank']}: freqs_cis differs"
        if key[2] == "load":
            assert torch.equal(got["logits"], want_logits), f"rank {got['rank']}: logits differ"
