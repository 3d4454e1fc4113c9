"""Backends: the PyTorch engine that shards one unit."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from fsdp_builder.config import ShardingOptions
from fsdp_builder.environment import Environment
from fsdp_builder.plan import Unit


@runtime_checkable
class Backend(Protocol):
    """Shards one unit (children first, root last) with PyTorch's own engine."""

    @property
    def name(self) -> str: ...

    def check(self, options: ShardingOptions) -> None:
        """Refuse options this backend cannot honour; local, before any collective."""
        ...

    def shard(self, unit: Unit, env: Environment) -> nn.Module:
        """Shard ``unit.module``; return the module that takes its place in the parent.

        A backend may also define ``prepare_groups(groups, options, device) -> ProcessGroups``
        (called once, on every rank, before the first unit; may communicate) and
        ``supports_shard_first``.
        """
        ...


__all__ = ["Backend"]
