"""How synchronizers compose with the shard-first default (FSDP2's ``StreamInit``): rank 0's
values reach every rank's shards, on every group layout, and the model trains afterwards.

References are plain PyTorch: rank 0's eagerly built model, and one SGD step of it in a single
process. One spawn of 4 ranks runs every scenario."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_builder as fb

SEED = 11


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x)))).square().mean()


def rank0_model() -> Net:
    """Rank 0's model: seeded weights and BatchNorm statistics of its own."""
    torch.manual_seed(SEED)
    model = Net()
    bn: Any = model.bn
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(1, 2)
        bn.num_batches_tracked.fill_(7)
    return model


def batch() -> torch.Tensor:
    return torch.linspace(-1, 1, 32).view(4, 8)


def reference(steps: int) -> dict[str, torch.Tensor]:
    """Rank 0's model after ``steps`` SGD steps on the batch, in one process (every rank sees
    the same batch, so the averaged gradient is this one)."""
    model = rank0_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(batch()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _build(state: str, layout: str, materializer: str) -> dict[str, Any]:
    rank = dist.get_rank()
    if state == "differ":  # every rank real, each from its own seed
        torch.manual_seed(SEED + 100 * rank)
        model = rank0_model() if rank == 0 else Net()
    elif rank == 0:  # rank 0 real, the others on meta
        model = rank0_model()
    else:
        with torch.device("meta"):
            model = Net()
    builder = fb.FullyShardBuilder().wrap(nn.Linear).synchronize(fb.BroadcastFromRank0())
    builder = builder.device(fb.CPUDevice()).timeout(60)
    if materializer == "StreamInit":
        # Shard by shard; the default fills these small units whole.
        builder = builder.materialize(fb.StreamInit(whole_below=0))
    if layout == "mesh2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        builder = builder.sharding("hybrid").groups(fb.MeshGroups(mesh))
    elif layout == "auto":
        builder = builder.sharding("hybrid").groups(fb.AutoHybridGroups(devices_per_node=2))
    sharded = builder.build(model)

    def full() -> dict[str, torch.Tensor]:
        out = {}
        for k, v in sharded.state_dict().items():
            out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        return out

    built = full()
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    sharded(batch()).backward()
    optimizer.step()
    return {"built": built, "stepped": full()}


SCENARIOS = [
    (state, layout, materializer)
    for state, layout in [
        ("differ", "default"),
        ("differ", "mesh2d"),
        ("meta", "default"),
        ("meta", "mesh2d"),
        ("meta", "auto"),
    ]
    for materializer in ("default", "StreamInit")
]


def _verify(state: str) -> str:
    """``VerifyReplicas`` with the default materializer; the error text, or "" if none."""
    rank = dist.get_rank()
    torch.manual_seed(SEED + (100 * rank if state == "differ" else 0))
    model = Net()
    builder = fb.FullyShardBuilder().wrap(nn.Linear).device(fb.CPUDevice()).timeout(60)
    try:
        builder.synchronize(fb.VerifyReplicas()).build(model)
    except fb.StateMismatchError as exc:
        return str(exc)
    return ""


VERIFY = ("differ", "equal")


def scenarios() -> Results:
    cases: list[tuple[Hashable, Callable[[], object]]] = [
        (key, partial(_build, *key)) for key in SCENARIOS
    ]
    cases += [(("verify", s), partial(_verify, s)) for s in VERIFY]
    return run_each(cases)


SPAWNS = Spawns(scenarios, timeout=300)


@pytest.mark.parametrize("key", SCENARIOS, ids=["-".join(k) for k in SCENARIOS])
def test_rank0_values_reach_every_shard_and_train(key: tuple[str, str, str]) -> None:
    ranks = values(SPAWNS(4), key)
    want = reference(0)
    stepped = reference(1)
    for rank, got in enumerate(ranks):
        # BatchNorm statistics included: they are rank 0's, not each rank's own.
        assert set(got["built"]) == set(want)
        for name, value in want.items():
            assert torch.equal(got["built"][name], value), (rank, name)
        # The training step completes on every rank (no rank waits for a collective its
        # replicas never join) and gives what one process gives.
        for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
            torch.testing.assert_close(got["stepped"][name], stepped[name], rtol=1e-5, atol=1e-6)


def test_verify_replicas_finds_ranks_that_hold_different_full_values() -> None:
    """Shard-first, each rank's shard would be its own rows and no two ranks would share a
    shard to compare; the full values are compared before sharding instead."""
    differ = values(SPAWNS(4), ("verify", "differ"))
    assert all("found different values across ranks" in text for text in differ), differ
    assert len(set(differ)) == 1  # the same error on every rank
    assert values(SPAWNS(4), ("verify", "equal")) == ["", "", "", ""]
