"""Backends: the PyTorch engine that shards one unit, and everything the library knows about it.
Code outside this package asks the backend object; it never compares backend names."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from fsdp_builder.config import ShardingOptions
from fsdp_builder.groups import ProcessGroups
from fsdp_builder.materializers.initializers import Materializer
from fsdp_builder.planning.context import BackendCapabilities, ConfigureContext
from fsdp_builder.planning.plan import Unit, UnitPlan
from fsdp_builder.runtime.environment import Environment


@runtime_checkable
class Backend(Protocol):
    """Shards one unit (children first, root last) with PyTorch's own engine.

    ``builder`` is named in errors; ``supports_shard_first``: a unit may be sharded on meta;
    ``shard_communicates``: the pipeline must agree on the local steps before ``shard``.
    """

    @property
    def name(self) -> str: ...

    @property
    def builder(self) -> str: ...

    @property
    def supports_shard_first(self) -> bool: ...

    @property
    def shard_communicates(self) -> bool: ...

    def default_materializer(self) -> Materializer:
        """The materializer of a build that sets none."""

    def check(self, options: ShardingOptions) -> None:
        """Refuse options this backend cannot honour; local, pure."""

    def check_context(self, context: ConfigureContext) -> None:
        """Refuse now what this backend would refuse later for this model; local, pure."""

    def keyword_mixed_precision(
        self, given: dict[str, Any]
    ) -> MixedPrecision | MixedPrecisionPolicy:
        """The backend's mixed-precision object for ``mixed_precision(**keywords)``."""

    def kept_bytes(self, unit: Unit, shards: int) -> int:
        """Parameter bytes of ``unit`` that one rank keeps when split over ``shards`` ranks."""

    def prepare_groups(
        self, groups: ProcessGroups, options: ShardingOptions, device: torch.device, plan: UnitPlan
    ) -> ProcessGroups:
        """The backend's view of the build's groups, and what it refuses of ``plan`` only once
        they exist; called once on every rank before any unit changes, may communicate."""

    def shard(self, unit: Unit, env: Environment) -> nn.Module:
        """Shard ``unit.module``; return the module that takes its place in the parent."""


def capabilities(backend: Backend) -> BackendCapabilities:
    """What the configure context tells roles about ``backend``."""
    return BackendCapabilities(
        name=backend.name,
        builder=backend.builder,
        supports_shard_first=backend.supports_shard_first,
        shard_communicates=backend.shard_communicates,
    )


def resolved_settings(
    backend: Backend, plan: UnitPlan, options: ShardingOptions, device: torch.device
) -> list[tuple[str, str]]:
    """What user code answered in configure that ranks must share, as ``(setting, text)`` pairs
    for the configure agreement: the settings describe a resolver or a function, not what it
    returned on this rank. A backend may add its own (``resolved_settings(plan, options)``)."""
    own = getattr(backend, "resolved_settings", None)
    extra: list[tuple[str, str]] = own(plan, options) if callable(own) else []
    return [("resolved device type", repr(device.type)), *extra]


__all__ = ["Backend", "capabilities", "resolved_settings"]
