"""A torchtitan-style Llama (non-persistent RoPE table, ``init_weights(buffer_device)`` at the
root, tied or untied output) built from meta with the builder, with and without activation
checkpointing applied before the build, against single-process references written here."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)

from fsdp_builder import (
    CPUDevice,
    DeterministicInit,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    InitWeights,
    MaterializationError,
    ShardingBuilder,
)
from fsdp_builder.tools.demo import full_state_dict
from fsdp_builder.tools.launch import run_ranks

RECIPES = Path(__file__).resolve().parents[1] / "docs" / "recipes"
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))

from llama_model import ModelArgs, Transformer, TransformerBlock  # noqa: E402

ARGS = {"untied": ModelArgs(), "tied": ModelArgs(tie_embeddings=True)}
STEPS = 3
SEED = 4


def meta_llama(args: ModelArgs, checkpointed: bool) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    if checkpointed:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    return model


def real_llama(args: ModelArgs, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def clean(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in state.items()}


def batch(args: ModelArgs) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, args.vocab_size, (2, 16), generator=gen)


def train(model: nn.Module, args: ModelArgs) -> list[float]:
    """A few SGD steps on one fixed batch (the same on every rank: FSDP's averaged gradient is
    then the single-process one)."""
    tokens = batch(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def builder_for(backend: str) -> ShardingBuilder:
    builder = FSDPBuilder() if backend == "fsdp1" else FullyShardBuilder()
    return builder.device(CPUDevice()).wrap(TransformerBlock)


def _scenarios() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {}
    for tie, args in ARGS.items():
        for backend in ("fsdp1", "fsdp2"):
            for ckpt in (False, True):
                key = f"{tie}-{backend}-{'ckpt' if ckpt else 'plain'}"

                def det(args: ModelArgs = args, backend: str = backend, ckpt: bool = ckpt) -> Any:
                    b = builder_for(backend).materialize(DeterministicInit(seed=SEED))
                    model = b.build(meta_llama(args, ckpt))
                    return clean(full_state_dict(model)), train(model, args)

                def load(args: ModelArgs = args, backend: str = backend, ckpt: bool = ckpt) -> Any:
                    source = real_llama(args, 9).state_dict() if dist.get_rank() == 0 else None
                    model = (
                        builder_for(backend)
                        .materialize(FromStateDict(source))
                        .build(meta_llama(args, ckpt))
                    )
                    return clean(full_state_dict(model)), train(model, args)

                out[f"det-{key}"] = det
                out[f"load-{key}"] = load
        for ckpt in (False, True):

            def titan(args: ModelArgs = args, ckpt: bool = ckpt) -> Any:
                b = builder_for("fsdp2").materialize(InitWeights(seed=SEED))
                model = b.build(meta_llama(args, ckpt))
                local = {
                    n: cast(Any, p).to_local().detach().clone()
                    for n, p in model.named_parameters()
                    if n.endswith("wq.weight")
                }
                return clean(full_state_dict(model)), train(model, args), local

            out[f"titan-{tie}-fsdp2-{'ckpt' if ckpt else 'plain'}"] = titan
    return out


def run_all() -> dict[str, Any]:
    """Every scenario on this rank; each one's result or its error, on its own."""
    results: dict[str, Any] = {}
    for name, fn in _scenarios().items():
        try:
            results[name] = fn()
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(run_all, 2, timeout=400)


def _ok(results: list[dict[str, Any]], name: str) -> list[Any]:
    got = [r[name] for r in results]
    for value in got:
        assert not isinstance(value, str), value
    return got


def _reference(args: ModelArgs, state: dict[str, torch.Tensor]) -> list[float]:
    model = real_llama(args, 0)
    model.load_state_dict(state)
    return train(model, args)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("tie", sorted(ARGS))
@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_deterministic_init_builds_llama_the_same_with_and_without_checkpointing(
    two_ranks: list[dict[str, Any]], tie: str, backend: str
) -> None:
    args = ARGS[tie]
    plain = _ok(two_ranks, f"det-{tie}-{backend}-plain")
    ckpt = _ok(two_ranks, f"det-{tie}-{backend}-ckpt")
    expected = DeterministicInit(seed=SEED).materialize_model(
        meta_llama(args, False), wrap=TransformerBlock
    )
    reference_state = {k: v.detach() for k, v in expected.state_dict().items()}
    # freqs_cis is computed by the model's init_weights, not left on meta or uninitialized.
    assert torch.equal(expected.get_buffer("freqs_cis"), real_llama(args, 0).freqs_cis)
    ref_losses = _reference(args, reference_state)
    for (state, losses), (ckpt_state, ckpt_losses) in zip(plain, ckpt, strict=True):
        assert _equal(state, reference_state)
        assert _equal(ckpt_state, reference_state)
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert ckpt_losses == pytest.approx(ref_losses, abs=1e-5)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("tie", sorted(ARGS))
@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_loading_a_llama_state_dict_computes_its_rope_table(
    two_ranks: list[dict[str, Any]], tie: str, backend: str
) -> None:
    args = ARGS[tie]
    source = real_llama(args, 9).state_dict()
    assert "freqs_cis" not in source  # non-persistent: no state dict holds it
    ref_losses = _reference(args, source)
    for variant in ("plain", "ckpt"):
        for state, losses in _ok(two_ranks, f"load-{tie}-{backend}-{variant}"):
            assert _equal(state, dict(source)), variant
            assert losses == pytest.approx(ref_losses, abs=1e-5), variant


@pytest.mark.timeout(450)
@pytest.mark.parametrize("tie", sorted(ARGS))
def test_init_weights_convention_on_fsdp2(two_ranks: list[dict[str, Any]], tie: str) -> None:
    args = ARGS[tie]
    plain = _ok(two_ranks, f"titan-{tie}-fsdp2-plain")
    ckpt = _ok(two_ranks, f"titan-{tie}-fsdp2-ckpt")
    state, losses, local0 = plain[0]
    _, _, local1 = plain[1]
    # Checkpointing changes nothing; every rank gathers the same model.
    for other_state, other_losses, _ in [plain[1], *ckpt]:
        assert _equal(other_state, state)
        assert other_losses == pytest.approx(losses, abs=1e-5)
    # Each rank drew its own shard (plain fully_shard + init_weights on a CPU mesh repeats one).
    for name in local0:
        assert not torch.equal(local0[name], local1[name]), name
    # torchtitan's distribution: trunc_normal(std=0.02) for wq; the RoPE table as the model
    # defines it; a single-process model with the same weights trains alike.
    wq = state["layers.0.attention.wq.weight"]
    assert 0.015 < float(wq.std()) < 0.025
    assert _reference(args, state) == pytest.approx(losses, abs=1e-5)


def test_init_weights_needs_the_models_initializer(world1: None) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    builder = FullyShardBuilder().device(CPUDevice()).materialize(InitWeights())
    with pytest.raises(MaterializationError, match=r"Sequential has no method `init_weights`"):
        builder.build(model)
    assert all(p.is_meta for p in model.parameters())
