"""What the configure stage knows, handed to every role's check before the first collective."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from attrs import frozen
from torch import nn

from fsdp_builder.config import ShardingOptions
from fsdp_builder.planning.ignored import IgnoredStates
from fsdp_builder.planning.plan import UnitPlan


@frozen
class BackendCapabilities:
    """What a role may ask about the backend (see ``Backend``)."""

    name: str
    builder: str
    supports_shard_first: bool
    shard_communicates: bool


@frozen(eq=False)
class ConfigureContext:
    """The configure stage's view of one build; checks read it, never change the model or
    communicate. ``world_size`` is the default group's (1 without one)."""

    model: nn.Module
    plan: UnitPlan
    ignored: IgnoredStates
    options: ShardingOptions
    backend: BackendCapabilities
    device: torch.device
    world_size: int = 1


@runtime_checkable
class ChecksContext(Protocol):
    """A role that checks the whole configuration in the configure stage (optional)."""

    def check_context(self, context: ConfigureContext) -> None:
        """Raise (a ``ConfigurationError`` naming the argument and the fix) to refuse."""


__all__ = ["BackendCapabilities", "ChecksContext", "ConfigureContext"]
