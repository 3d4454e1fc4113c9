"""Backends: the PyTorch engine that shards one unit."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from fsdp_builder.config import ShardingOptions
from fsdp_builder.groups import ProcessGroups
from fsdp_builder.planning.plan import Unit, UnitPlan
from fsdp_builder.runtime.environment import Environment


@runtime_checkable
class Backend(Protocol):
    """Shards one unit (children first, root last) with PyTorch's own engine.

    ``supports_shard_first``: a unit may be sharded while still on meta (a shard-first
    materializer then fills only the local shards). ``shard_communicates``: whether ``shard``
    runs collectives (the pipeline then agrees on the local steps before it).
    """

    @property
    def name(self) -> str: ...

    @property
    def supports_shard_first(self) -> bool: ...

    @property
    def shard_communicates(self) -> bool: ...

    def check(self, options: ShardingOptions) -> None:
        """Refuse options this backend cannot honour; local, before any collective."""
        ...

    def prepare_groups(
        self, groups: ProcessGroups, options: ShardingOptions, device: torch.device
    ) -> ProcessGroups:
        """The backend's view of the build's groups (FSDP2: with its mesh). Called once, on
        every rank, before the first unit; may communicate."""
        ...

    def check_plan(self, plan: UnitPlan, options: ShardingOptions) -> None:
        """Refuse a model this backend would refuse at shard time, from the unit plan (local,
        pure, in the configure stage: the model is untouched)."""
        ...

    def shard(self, unit: Unit, env: Environment) -> nn.Module:
        """Shard ``unit.module``; return the module that takes its place in the parent."""
        ...


def check_model(backend: Backend, plan: UnitPlan, options: ShardingOptions) -> None:
    """Refuse, in the configure stage, a model the backend would refuse at shard time (local,
    pure: nothing changes, no collective). Always: a model already sharded at its root. Then
    the backend's own ``check_plan(plan, options)``: FSDP1 refuses non-floating parameters,
    several dtypes in one unit and mixed ``requires_grad`` in one unit without
    ``use_orig_params``; FSDP2 refuses scalar and non-contiguous parameters. Raises
    ``ConfigurationError`` naming the parameter or module and the fix."""
    from fsdp_builder.backends.checks import check_root_not_wrapped

    check_root_not_wrapped(plan, _builder_name(backend))
    backend.check_plan(plan, options)


def _builder_name(backend: Backend) -> str:
    return {"fsdp1": "FSDPBuilder", "fsdp2": "FullyShardBuilder"}.get(
        backend.name, "ShardingBuilder"
    )


__all__ = ["Backend", "check_model"]
