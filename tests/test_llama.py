"""A torchtitan-style Llama (non-persistent RoPE table, ``init_weights(buffer_device)`` at the
root, tied or untied output) built from meta with the builder, with and without activation
checkpointing applied before the build, against single-process references in plain PyTorch.

One spawn of 2 ranks runs every scenario, each on its own (see ``isolated``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from models import llama, meta_llama, real_llama, without_checkpoint_prefix
from torch import nn

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
from fsdp_builder.materializers.initializers import derived_seed

ARGS = {"untied": llama.ModelArgs(), "tied": llama.ModelArgs(tie_embeddings=True)}
STEPS = 3
SEED = 4
BACKENDS = ("fsdp1", "fsdp2")
VARIANTS = {"plain": False, "ckpt": True}


def batch(args: Any) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, args.vocab_size, (2, 16), generator=gen)


def train(model: nn.Module, args: Any) -> list[float]:
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
        losses.append(float(loss.detach()))
    return losses


def builder_for(backend: str) -> ShardingBuilder:
    builder = FSDPBuilder() if backend == "fsdp1" else FullyShardBuilder()
    return builder.device(CPUDevice()).wrap(llama.TransformerBlock)


def rope_table(model: nn.Module) -> torch.Tensor:
    """The built model's ``freqs_cis`` (a non-persistent buffer: no state dict holds it)."""
    (table,) = [b for n, b in model.named_buffers() if n.endswith("freqs_cis")]
    return table.detach().clone()


def built(model: nn.Module, args: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[float]]:
    state = without_checkpoint_prefix(full_state_dict(model))
    return state, rope_table(model), train(model, args)


# -- inside the ranks ----------------------------------------------------------------------------


def deterministic(args: Any, backend: str, ckpt: bool) -> Any:
    b = builder_for(backend).materialize(DeterministicInit(seed=SEED))
    return built(b.build(meta_llama(args, ckpt)), args)


def loaded(args: Any, backend: str, ckpt: bool) -> Any:
    source = real_llama(args, 9).state_dict() if dist.get_rank() == 0 else None
    b = builder_for(backend).materialize(FromStateDict(source))
    return built(b.build(meta_llama(args, ckpt)), args)


def titan(args: Any, ckpt: bool) -> Any:
    model = builder_for("fsdp2").materialize(InitWeights(seed=SEED)).build(meta_llama(args, ckpt))
    local = {
        n: cast(Any, p).to_local().detach().clone()
        for n, p in model.named_parameters()
        if n.endswith("wq.weight")
    }
    return (*built(model, args), local)


def cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for tie, args in ARGS.items():
        for variant, ckpt in VARIANTS.items():
            for backend in BACKENDS:
                yield ("det", tie, backend, variant), partial(deterministic, args, backend, ckpt)
                yield ("load", tie, backend, variant), partial(loaded, args, backend, ckpt)
            yield ("titan", tie, variant), partial(titan, args, ckpt)


def scenarios() -> Results:
    return run_each(cases())


SPAWNS = Spawns(scenarios, timeout=400)


# -- single-process references: plain PyTorch ----------------------------------------------------


def per_module_seeded(args: Any, seed: int) -> nn.Module:
    """What ``DeterministicInit(seed)`` promises, written in plain PyTorch: the eager model
    (its constructor computes ``freqs_cis``), then the ``reset_parameters()`` of each module
    that owns a parameter, under a seed derived from ``seed`` and the module's qualified name.
    A tied weight belongs to the first module that holds it (the embedding), as in
    ``named_parameters()``."""
    model = llama.Transformer(args)
    owners = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
    for fqn, module in model.named_modules():
        if fqn in owners:
            torch.manual_seed(derived_seed(seed, fqn))
            module.reset_parameters()
    return model


def trained_from(args: Any, state: dict[str, torch.Tensor]) -> list[float]:
    model = real_llama(args, 0)
    model.load_state_dict(state)
    return train(model, args)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("tie", sorted(ARGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_init_builds_llama_the_same_with_and_without_checkpointing(
    tie: str, backend: str
) -> None:
    args = ARGS[tie]
    reference = per_module_seeded(args, SEED)
    reference_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    reference_table = reference.get_buffer("freqs_cis").clone()
    ref_losses = train(reference, args)
    for variant in VARIANTS:
        for state, table, losses in values(SPAWNS(2), ("det", tie, backend, variant)):
            assert _equal(state, reference_state), variant
            # freqs_cis is computed by the model's init_weights, not left on meta or empty.
            assert torch.equal(table, reference_table), variant
            assert losses == pytest.approx(ref_losses, abs=1e-5), variant


@pytest.mark.timeout(450)
@pytest.mark.parametrize("tie", sorted(ARGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_loading_a_llama_state_dict_computes_its_rope_table(tie: str, backend: str) -> None:
    args = ARGS[tie]
    model = real_llama(args, 9)
    source = model.state_dict()
    assert "freqs_cis" not in source  # non-persistent: no state dict holds it
    ref_losses = trained_from(args, source)
    for variant in VARIANTS:
        for state, table, losses in values(SPAWNS(2), ("load", tie, backend, variant)):
            assert _equal(state, dict(source)), variant
            assert torch.equal(table, model.get_buffer("freqs_cis")), variant
            assert losses == pytest.approx(ref_losses, abs=1e-5), variant


@pytest.mark.timeout(450)
@pytest.mark.parametrize("tie", sorted(ARGS))
def test_init_weights_convention_on_fsdp2(tie: str) -> None:
    args = ARGS[tie]
    plain = values(SPAWNS(2), ("titan", tie, "plain"))
    ckpt = values(SPAWNS(2), ("titan", tie, "ckpt"))
    state, table, losses, local0 = plain[0]
    _, _, _, local1 = plain[1]
    # Checkpointing changes nothing; every rank gathers the same model.
    for other_state, other_table, other_losses, _ in [plain[1], *ckpt]:
        assert _equal(other_state, state)
        assert torch.equal(other_table, table)
        assert other_losses == pytest.approx(losses, abs=1e-5)
    # Each rank drew its own shard (plain fully_shard + init_weights on a CPU mesh repeats one).
    for name in local0:
        assert not torch.equal(local0[name], local1[name]), name
    # torchtitan's distribution: trunc_normal(std=0.02) for wq; the RoPE table as the model
    # defines it; a single-process model with the same weights trains alike.
    wq = state["layers.0.attention.wq.weight"]
    assert 0.015 < float(wq.std()) < 0.025
    assert torch.equal(table, real_llama(args, 0).get_buffer("freqs_cis"))
    assert trained_from(args, state) == pytest.approx(losses, abs=1e-5)


def test_init_weights_needs_the_models_initializer(world1: None) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    builder = FullyShardBuilder().device(CPUDevice()).materialize(InitWeights())
    with pytest.raises(MaterializationError, match=r"Sequential has no method `init_weights`"):
        builder.build(model)
    assert all(p.is_meta for p in model.parameters())
