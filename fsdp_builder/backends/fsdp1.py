"""FSDP1 backend: each unit becomes a ``FullyShardedDataParallel`` instance."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from attrs import frozen
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_builder.config import ShardingOptions
from fsdp_builder.environment import Environment
from fsdp_builder.groups import ProcessGroups
from fsdp_builder.plan import Unit


def fsdp1_kwargs(env: Environment) -> dict[str, Any]:
    """The FullyShardedDataParallel arguments for one unit of this environment.

    States are already materialized, moved and synchronized, so FSDP's own init steps for those
    (``param_init_fn``, ``sync_module_states``) stay off.
    """
    opts = env.options
    kwargs: dict[str, Any] = {
        "sharding_strategy": opts.strategy,
        "cpu_offload": opts.cpu_offload,
        "backward_prefetch": opts.backward_prefetch,
        "mixed_precision": opts.mixed_precision,
        "device_id": env.device,
        "sync_module_states": False,
        "forward_prefetch": opts.forward_prefetch,
        "limit_all_gathers": opts.limit_all_gathers,
        "use_orig_params": opts.use_orig_params,
    }
    groups = env.groups
    if groups.mesh is not None and (groups.mesh.ndim == 2) == opts.is_hybrid:
        kwargs["device_mesh"] = groups.mesh
    elif opts.is_hybrid and groups.replicate_group is not None:
        kwargs["process_group"] = (groups.shard_group, groups.replicate_group)
    else:
        kwargs["process_group"] = groups.shard_group
    if env.ignored.modules:
        kwargs["ignored_modules"] = list(env.ignored.modules)
    elif env.ignored.params:
        kwargs["ignored_states"] = list(env.ignored.params)
    return kwargs


@frozen
class FSDP1Backend:
    """Wraps each unit with torch's FullyShardedDataParallel."""

    name: str = attrs.field(default="fsdp1", init=False)
    # FullyShardedDataParallel flattens a whole unit: it cannot shard a unit still on meta.
    supports_shard_first: ClassVar[bool] = False
    # FullyShardedDataParallel's constructor runs no collectives once states are in place.
    shard_communicates: ClassVar[bool] = False

    def check(self, options: ShardingOptions) -> None:
        return None

    def prepare_groups(
        self, groups: ProcessGroups, options: ShardingOptions, device: torch.device
    ) -> ProcessGroups:
        return groups

    def shard(self, unit: Unit, env: Environment) -> nn.Module:
        return FullyShardedDataParallel(unit.module, **fsdp1_kwargs(env))
