"""Builds on CUDA with NCCL, one rank per visible GPU, against a CPU single-process reference.

Both backends, each ready-made materializer, the synchronizers, and bf16 mixed precision. One
spawn runs every scenario, each on its own (see ``isolated``). Weights that are made on the CPU
(DeterministicInit, a loaded state dict) must arrive bit-equal; weights drawn on the GPU are
taken as gathered and the CPU reference starts from them. Losses and trained weights may differ
from the CPU's by the GPU's order of fp32 arithmetic (TF32 is off): within ``ATOL``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict, reference
from isolated import Results, Spawns, run_each, values
from torch import nn

from fsdp_builder import (
    BroadcastFromRank0,
    DeterministicInit,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    LocalRankDevice,
    ResetParameters,
    ShardFirstReset,
    ShardingBuilder,
    VerifyReplicas,
)
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, batch, loss_fn

pytestmark = pytest.mark.gpu

CFG = DemoConfig(vocab=64, dim=32, heads=2, layers=2, seq=8)
STEPS = 3
SEED = 7
SOURCE_SEED = 123
ATOL = 1e-4
BACKENDS = ["fsdp1", "fsdp2"]
# Materializers per backend: ShardFirstReset needs FSDP2's shard-on-meta.
MATERIALIZERS = {
    "fsdp1": ["reset", "deterministic", "load"],
    "fsdp2": ["reset", "deterministic", "shard_first", "load"],
}
# Where the initial weights come from: made on the CPU (bit-equal to the CPU's) or drawn on
# the GPU (compared with themselves across ranks, and the reference starts from them).
ON_CPU = {"deterministic", "load"}


def world_size() -> int:
    return max(1, torch.cuda.device_count())


def meta_model(cls: type[DemoTransformer] = DemoTransformer) -> DemoTransformer:
    with torch.device("meta"):
        return cls(CFG)


def source_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(SOURCE_SEED)
    return {k: v.detach().clone() for k, v in DemoTransformer(CFG).state_dict().items()}


def builder(backend: str) -> ShardingBuilder:
    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    return kind().device(LocalRankDevice()).wrap(Block).sharding("full")


def materializer(name: str) -> Any:
    if name == "reset":
        return ResetParameters()
    if name == "deterministic":
        return DeterministicInit(SEED)
    if name == "shard_first":
        return ShardFirstReset(seed=SEED)
    return FromStateDict(source_state() if dist.get_rank() == 0 else None)


def train_on_gpu(model: nn.Module, steps: int, fixed_batch: bool = False) -> list[float]:
    """``fsdp_builder.tools.demo.train`` with the tokens on the model's device: rank ``r`` trains on
    slice ``r`` of each global batch (SGD, lr 0.1, 2 sequences per rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        tokens = batch(CFG, 0 if fixed_batch else step, 2 * world)[2 * rank : 2 * rank + 2]
        opt.zero_grad()
        loss = loss_fn(model, tokens.to(device), CFG.vocab)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def on_cuda(model: nn.Module) -> bool:
    """Every parameter (a DTensor's local shard, FSDP1's flat parameter) is on this GPU."""
    index = torch.cuda.current_device()
    return all(p.device == torch.device("cuda", index) for p in model.parameters())


def build_case(backend: str, name: str) -> dict[str, Any]:
    """Build from meta with one materializer on the GPU, gather, train, gather again."""
    torch.manual_seed(0)  # RNG-based materializers draw the same numbers on every rank
    sharded = builder(backend).materialize(materializer(name)).build(meta_model())
    placed = on_cuda(sharded)
    initial = full_state_dict(sharded)
    losses = train_on_gpu(sharded, STEPS)
    return {
        "on_cuda": placed,
        "initial": initial,
        "losses": losses,
        "final": full_state_dict(sharded),
    }


def sync_case(backend: str) -> dict[str, Any]:
    """DeterministicInit, then BroadcastFromRank0 and VerifyReplicas over NCCL."""
    b = builder(backend).materialize(DeterministicInit(SEED))
    b.synchronize(BroadcastFromRank0(), VerifyReplicas())
    return {"initial": full_state_dict(b.build(meta_model()))}


def mixed_case(backend: str) -> dict[str, Any]:
    """Rank 0 holds real weights on its GPU, the others are on meta (pytorch issue 105840):
    the broadcast fills them in."""
    if dist.get_rank() == 0:
        torch.manual_seed(5)
        with torch.device("cuda", torch.cuda.current_device()):
            model = DemoTransformer(CFG)
        want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    else:
        model, want = meta_model(), None
    b = builder(backend).materialize(ResetParameters())
    b.synchronize(BroadcastFromRank0(), VerifyReplicas())
    return {"want": want, "initial": full_state_dict(b.build(model))}


def bf16_case(backend: str) -> dict[str, Any]:
    """bf16 parameters, fp32 gradient reduction: trains on a fixed batch, so the loss falls."""
    b = builder(backend).materialize(DeterministicInit(SEED))
    b.mixed_precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sharded = b.build(meta_model())
    return {"losses": train_on_gpu(sharded, 8, fixed_batch=True)}


def cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for backend in BACKENDS:
        for name in MATERIALIZERS[backend]:
            yield ("build", backend, name), partial(build_case, backend, name)
        yield ("sync", backend), partial(sync_case, backend)
        yield ("mixed", backend), partial(mixed_case, backend)
        yield ("bf16", backend), partial(bf16_case, backend)


def rank_main() -> Results:
    # Full fp32 matrix products: TF32 would put the losses about 1e-3 off the CPU's.
    torch.set_float32_matmul_precision("highest")
    return run_each(cases())


SPAWNS = Spawns(rank_main, timeout=240, backend="nccl")


def scenario(key: Hashable) -> list[Any]:
    """Scenario ``key``'s result on every rank; one spawn, whichever test asks first."""
    return values(SPAWNS(world_size()), key)


# -- CPU references ------------------------------------------------------------------------------


@functools.cache
def deterministic_state() -> dict[str, torch.Tensor]:
    model = meta_model()
    DeterministicInit(SEED).materialize_model(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def cpu_reference(initial: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = DemoTransformer(CFG)
    model.load_state_dict(initial)
    return reference(model, CFG, STEPS, world_size())


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: Any) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert torch.equal(got[k], want[k]), (what, k)


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: Any) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert torch.allclose(got[k], want[k], atol=ATOL, rtol=ATOL), (what, k)


# -- tests ---------------------------------------------------------------------------------------

BUILDS = [(b, m) for b in BACKENDS for m in MATERIALIZERS[b]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "name"), BUILDS)
def test_gpu_build_matches_cpu_reference(backend: str, name: str) -> None:
    ranks = scenario(("build", backend, name))
    world = len(ranks)
    assert all(r["on_cuda"] for r in ranks), "parameters are not on the rank's GPU"
    initial = ranks[0]["initial"]
    if name == "deterministic":
        assert_equal(initial, deterministic_state(), (backend, name))
    elif name == "load":
        assert_equal(initial, source_state(), (backend, name))
    else:
        # Drawn on the GPU: finite, not one shard repeated, the same on every rank.
        for k, v in initial.items():
            assert torch.isfinite(v).all(), (backend, name, k)
            if world > 1 and v.dim() == 2 and float(v.std()) > 0:
                chunks = v.reshape(-1).chunk(world)
                assert not all(torch.equal(chunks[0], c) for c in chunks[1:]), k
    for rank in range(1, world):
        assert_equal(ranks[rank]["initial"], initial, (backend, name, rank))
    ref = cpu_reference(initial)
    for rank in range(world):
        got, want = torch.tensor(ranks[rank]["losses"]), torch.tensor(ref["losses"][rank])
        assert torch.allclose(got, want, atol=ATOL, rtol=ATOL), (backend, name, rank, got, want)
    assert_close(ranks[0]["final"], ref["state_dict"], (backend, name, "final"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_and_verify_over_nccl_keep_deterministic_weights(backend: str) -> None:
    for rank, r in enumerate(scenario(("sync", backend))):
        assert_equal(r["initial"], deterministic_state(), (backend, rank))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0_real_on_gpu_others_meta_is_filled_by_broadcast(backend: str) -> None:
    ranks = scenario(("mixed", backend))
    want = ranks[0]["want"]
    for rank, r in enumerate(ranks):
        assert_equal(r["initial"], want, (backend, rank))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_mixed_precision_trains(backend: str) -> None:
    for rank, r in enumerate(scenario(("bf16", backend))):
        losses = r["losses"]
        assert all(math.isfinite(x) for x in losses), (backend, rank, losses)
        assert losses[-1] < losses[0], (backend, rank, losses)
