"""The resolved environment of one build: everything FSDP's init stores before touching params."""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import torch
import torch.distributed as dist
from attrs import frozen
from torch import nn
from torch.distributed.fsdp import ShardingStrategy

from fsdp_builder.common.logs import build_logger, warn_user
from fsdp_builder.config import ShardingOptions
from fsdp_builder.groups import ProcessGroups
from fsdp_builder.planning.ignored import IgnoredStates
from fsdp_builder.planning.plan import Unit, UnitPlan


@frozen(eq=False)
class Environment:
    """Immutable after resolution; handed to every strategy and to the backend.
    ``rank``/``world_size`` are global; ``groups`` holds the shard/replicate view."""

    rank: int
    world_size: int
    groups: ProcessGroups
    device: torch.device
    options: ShardingOptions
    ignored: IgnoredStates
    plan: UnitPlan
    # None: the default group.
    agreement_group: dist.ProcessGroup | None = None
    # Units are sharded on meta before their materializer fills the local shards, but those
    # with fewer parameter bytes than ``whole_below`` (see ``shard_first_for``).
    shard_first: bool = False
    whole_below: int = 0
    # Every rank gets rank 0's values after each unit (BroadcastFromRank0): others' are unused.
    values_from_rank0: bool = False
    # One DTensor sharding spec per distinct FSDP2 shard layout, not per parameter, as DTensor's
    # cached propagation gives to_empty's tensors.
    shard_specs: dict[Any, Any] = attrs.field(factory=dict)
    logger: Any = attrs.field(default=None)
    # Values every unit of the build shares (a backend's build-wide arguments), worked out at
    # the first unit instead of once per unit.
    memo: dict[Any, Any] = attrs.field(factory=dict, repr=False)
    # The module the backend sharded for a unit whose own module it wrapped first (activation
    # checkpointing), by the unit module's id: FSDP2's records of the unit are on the wrapper.
    sharded_roots: dict[int, nn.Module] = attrs.field(factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.logger is None:
            bound = build_logger(
                "fsdp_builder.pipeline", rank=self.rank, world_size=self.world_size
            )
            object.__setattr__(self, "logger", bound)

    @property
    def strategy(self) -> ShardingStrategy:
        return self.options.strategy

    def sharded_root(self, unit: Unit) -> nn.Module:
        """The module holding ``unit``'s FSDP2 records: its wrapper, or the unit's module."""
        return self.sharded_roots.get(id(unit.module), unit.module)

    def shard_first_for(self, unit: Unit) -> bool:
        """Whether ``unit`` is sharded on meta before its materializer runs."""
        return self.shard_first and unit.param_bytes >= self.whole_below

    @property
    def shards_first(self) -> bool:
        """Deprecated: ``shard_first``."""
        _renamed("shards_first", "shard_first")
        return self.shard_first

    def sharded_first(self, unit: Unit) -> bool:
        """Deprecated: ``shard_first_for(unit)``."""
        _renamed("sharded_first(unit)", "shard_first_for(unit)")
        return self.shard_first_for(unit)


def _renamed(old: str, new: str) -> None:
    warnings.warn(
        f"`Environment.{old}` is deprecated: use `Environment.{new}` (one name, shard_first, "
        "for every shard-first setting).",
        DeprecationWarning,
        stacklevel=3,
    )


def effective_strategy(
    options: ShardingOptions, groups: ProcessGroups
) -> tuple[ShardingOptions, ProcessGroups]:
    """FSDP's clamping rules: no sharding over one rank (with a warning); NO_SHARD across ranks
    warns as deprecated. Hybrid with one rank per shard group replicates over the replicate group
    (FSDP would silently stop averaging gradients across replicas there)."""
    strategy = options.strategy
    no_shard = attrs.evolve(options, strategy=ShardingStrategy.NO_SHARD)
    if groups.data_parallel_size == 1:
        if strategy != ShardingStrategy.NO_SHARD:
            warn_user(f"Using NO_SHARD instead of {strategy.name} since the world size is 1.")
        if groups.mesh is not None and groups.mesh.ndim > 1:
            # One rank: a hybrid mesh has nothing left to describe.
            groups = ProcessGroups(shard_group=groups.shard_group)
        return no_shard, groups
    if options.is_hybrid and groups.world_size == 1 and groups.replicate_group is not None:
        warn_user(
            f"Using NO_SHARD over the replicate group instead of {strategy.name} since each "
            "shard group has one rank.",
            UserWarning,
        )
        return no_shard, ProcessGroups(shard_group=groups.replicate_group)
    if strategy == ShardingStrategy.NO_SHARD:
        warn_user(
            "The NO_SHARD sharding strategy is deprecated by PyTorch; prefer "
            "DistributedDataParallel if you hit issues with it.",
            FutureWarning,
        )
    return options, groups
