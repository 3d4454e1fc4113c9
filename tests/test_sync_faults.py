"""Faults around synchronizers and materializers: a replica differing under tensor parallelism,
a rank late in a tensor-parallel collective, and a materializer that skips modules. Each ends
the same way on every rank, within the build's bound."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from isolated import START_METHOD
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_builder import (
    BroadcastFromRank0,
    CPUDevice,
    FSDPBuilder,
    FullyShardBuilder,
    KeepAsIs,
    MaterializationError,
    VerifyReplicas,
)
from fsdp_builder.materializers.initializers import BaseMaterializer
from fsdp_builder.tools.launch import run_ranks

DIM = 8
# Seconds any wait of the build may last, and how long the late rank stays away: well past the
# bound, well inside the spawn's limit.
BOUND = 8.0
LATE = 5 * BOUND
SPAWN_LIMIT = 150.0


class Mlp(nn.Module):
    """A norm that tensor parallelism leaves whole on every rank, then a column- and a
    row-parallel Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def tp_model(mesh: Any) -> nn.Module:
    torch.manual_seed(0)  # every rank alike
    model = nn.Sequential(Mlp(), Mlp())
    for block in model:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def outcome(build: Any, model: nn.Module) -> tuple[str, str]:
    try:
        build(model)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "built", ""


def verify_tp_replicas() -> list[tuple[str, str]]:
    """On a (dp 2, tp 2) mesh: replicas built alike, then rank 3's whole norm changed."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    found = []
    for plant in (False, True):
        model = tp_model(mesh)
        if plant and dist.get_rank() == 3:
            with torch.no_grad():
                model.get_parameter("1.norm.weight").add_(1.0)
        builder = FullyShardBuilder().device(CPUDevice()).wrap(Mlp).groups(mesh["dp"])
        builder.materialize(KeepAsIs()).synchronize(VerifyReplicas())
        found.append(outcome(builder.build, model))
    return found


@pytest.mark.timeout(SPAWN_LIMIT + 60)
def test_verify_replicas_under_tensor_parallelism_raises_the_same_error_on_every_rank() -> None:
    # Before: ranks 1 and 3 (whose data-parallel group differs) raised, ranks 0 and 2 waited
    # for them in the tensor-parallel comparison until the group's timeout.
    results = run_ranks(verify_tp_replicas, 4, timeout=SPAWN_LIMIT, start_method=START_METHOD)
    assert [r[0] for r in results] == [("built", "")] * 4
    planted = [r[1] for r in results]
    assert {kind for kind, _ in planted} == {"StateMismatchError"}, planted
    assert len({text for _, text in planted}) == 1, planted
    assert (
        "in unit '1': the first differing state is '1.norm.weight', where rank(s) 3 differ"
        in planted[0][1]
    ), planted[0][1]


def stall_in_broadcasts_over(group: dist.ProcessGroup, seconds: float) -> None:
    """Make this rank stall once, in its first broadcast over ``group`` (the fault itself)."""
    real = dist.broadcast
    stalled: list[bool] = []

    def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is group and not stalled:
            stalled.append(True)
            time.sleep(seconds)
        return real(tensor, *args, **kwargs)

    dist.broadcast = broadcast  # this rank's process only, which ends with the test


def late_in_tp_broadcast() -> tuple[str, str]:
    """Rank 1 stalls in its first tensor-parallel broadcast: rank 0 broadcast over its
    data-parallel group (with rank 2) and waits for rank 1 in the tensor-parallel stage."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_model(mesh)
    if dist.get_rank() == 1:
        stall_in_broadcasts_over(mesh["tp"].get_group(), LATE)
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Mlp).groups(mesh["dp"]).timeout(BOUND)
    builder.materialize(KeepAsIs()).synchronize(BroadcastFromRank0())
    dist.barrier()  # start the build together: a late start is not what this tests
    return outcome(builder.build, model)


@pytest.mark.timeout(SPAWN_LIMIT + 60)
def test_the_build_timeout_bounds_waits_on_tensor_parallel_groups() -> None:
    # Before: the tensor-parallel groups kept their own timeout, so rank 0 waited in their
    # broadcast until rank 1 came back, long after ranks 2 and 3 had given up and left.
    results = run_ranks(late_in_tp_broadcast, 4, timeout=SPAWN_LIMIT, start_method=START_METHOD)
    for rank, (kind, text) in enumerate(results):
        assert kind == "CommunicationError", (rank, kind, text)
    # Rank 0 stopped waiting at the bound and met ranks 2 and 3 in the next agreement: only
    # rank 1 was missing there.
    assert "rank(s) 1 did not arrive" in results[0][1], results[0][1]


# -- a materializer that skips modules ------------------------------------------------------


@pytest.fixture
def meta_stack() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(Mlp(), Mlp())


class LinearsOnly(BaseMaterializer):
    """Initializes the Linear layers alone: the norms are skipped."""

    communicates: ClassVar[bool] = False

    def wants(self, module: nn.Module, owned: list[nn.Module]) -> bool:
        return isinstance(module, nn.Linear)

    def init_module(self, module: nn.Module, fqn: str) -> None:
        assert isinstance(module, nn.Linear)
        module.reset_parameters()


class BlocksWriteAll(BaseMaterializer):
    """Visits each block alone, which writes its children's states itself."""

    communicates: ClassVar[bool] = False

    def wants(self, module: nn.Module, owned: list[nn.Module]) -> bool:
        return isinstance(module, Mlp)

    def init_module(self, module: nn.Module, fqn: str) -> None:
        for p in module.parameters():
            p.data.fill_(0.5)  # through .data, as many initializers do


@pytest.mark.parametrize("builder", [FSDPBuilder, FullyShardBuilder])
def test_states_a_materializer_skipped_are_refused_at_their_unit(
    world1: None, meta_stack: nn.Module, builder: Any
) -> None:
    # Before: the build returned the norms' uninitialized memory.
    b = builder().device(CPUDevice()).wrap(Mlp).materialize(LinearsOnly())
    with pytest.raises(MaterializationError) as caught:
        b.build(meta_stack)
    text = str(caught.value)
    assert "`LinearsOnly` left states of unit '0'" in text, text
    assert "on rank 0: 0.norm.weight, 0.norm.bias." in text, text
    assert "its `wants` skipped their modules" in text, text


@pytest.mark.parametrize("builder", [FSDPBuilder, FullyShardBuilder])
def test_a_module_a_materializer_skips_may_be_written_by_its_parent(
    world1: None, meta_stack: nn.Module, builder: Any
) -> None:
    b = builder().device(CPUDevice()).wrap(Mlp).materialize(BlocksWriteAll())
    model = b.build(meta_stack)
    fsdp1 = builder is FSDPBuilder
    with FullyShardedDataParallel.summon_full_params(model) if fsdp1 else nullcontext():
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            assert torch.equal(full, torch.full_like(full, 0.5)), name
