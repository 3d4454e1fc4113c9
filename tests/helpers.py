"""Scaffolding several test modules share that the library itself never calls: a sharded
model's full state dict, the demo's single-process reference run, and direct entry points to
one check or one open of the library.

Spawned ranks import this module by name, as they import ``models`` (``tests`` is on the path
of every rank).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from fsdp_builder.backends import Backend, capabilities
from fsdp_builder.config import ShardingOptions
from fsdp_builder.materializers.checkpoints import CHECKPOINT_SPEC
from fsdp_builder.materializers.initializers import DeterministicInit
from fsdp_builder.materializers.loading import open_as
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.ignored import IgnoredStates
from fsdp_builder.planning.plan import UnitPlan
from fsdp_builder.sources import CheckpointSource
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, batch, loss_fn


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a sharded model (collective: every rank calls it)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def deterministic_model(cfg: DemoConfig | None = None, seed: int = 0) -> DemoTransformer:
    """The model ``fsdp-builder demo`` builds, on one process: from meta, each Block unit
    initialized by ``DeterministicInit(seed)`` (the same weights at any world size)."""
    with torch.device("meta"):
        model = DemoTransformer(cfg or DemoConfig())
    DeterministicInit(seed=seed).materialize_model(model, wrap=Block)
    return model


def reference(
    model: nn.Module,
    cfg: DemoConfig,
    steps: int,
    world_size: int,
    per_rank: int = 2,
    lr: float = 0.1,
    fixed_batch: bool = False,
) -> dict[str, Any]:
    """Single-process run of the demo's training over the whole global batch: per-slice losses
    before each step (what rank ``r`` must see) and the final state dict. ``fixed_batch``: every
    step sees the first batch again, as ``tools.demo.train`` does with it."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    per_slice: list[list[float]] = [[] for _ in range(world_size)]
    for step in range(steps):
        tokens = batch(cfg, 0 if fixed_batch else step, per_rank * world_size)
        with torch.no_grad():
            for r, part in enumerate(tokens.split(per_rank)):
                per_slice[r].append(float(loss_fn(model, part, cfg.vocab)))
        opt.zero_grad()
        loss_fn(model, tokens, cfg.vocab).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": per_slice, "state_dict": state}


def local_bytes(module: nn.Module) -> int:
    """Bytes of this rank's storage under ``module`` (DTensors' local shards), once per storage."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.is_meta:
            continue
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        # Address 0 is no storage to share: an empty one, or a fake tensor's (which has a size).
        if key in seen and storage.data_ptr() != 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def open_checkpoint(path: str | os.PathLike[str]) -> CheckpointSource:
    """Open the checkpoint at ``path`` as ``FromCheckpoint`` does; errors in its words."""
    return open_as(path, CHECKPOINT_SPEC)


def check_model(
    backend: Backend,
    plan: UnitPlan,
    options: ShardingOptions,
    ignored: IgnoredStates | None = None,
) -> None:
    """``backend.check_context`` for ``plan`` alone (no process group, CPU device): what the
    configure stage refuses of a model, without a build."""
    backend.check_context(
        ConfigureContext(
            model=plan.root.module,
            plan=plan,
            ignored=ignored or IgnoredStates(),
            options=options,
            backend=capabilities(backend),
            device=torch.device("cpu"),
        )
    )


def assert_reads(source: Any, key: str, full: torch.Tensor, indexes: list[Any]) -> None:
    """``source``'s ``read`` and ``read_into`` (same dtype, and float64 for a float tensor) of
    ``key[index]`` for each index equal ``full[index]`` (``full``: the tensor as saved)."""
    for index in indexes:
        expected = full[index] if index else full
        got = source.read(key, index)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (key, index)
        into = torch.full_like(expected, 1)
        source.read_into(key, index, into)
        assert torch.equal(into, expected), (key, index)
        if full.is_floating_point():
            wide = torch.empty(expected.shape, dtype=torch.float64)
            source.read_into(key, index, wide)
            assert torch.equal(wide, expected.double()), (key, index)
