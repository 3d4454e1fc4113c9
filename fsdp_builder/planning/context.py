"""What the configure stage knows, handed to every role's check before the first collective.

The configure stage runs on every rank with the same model and configuration, before any
process group is used and before the model changes. A check that sees this context can refuse
anything a later stage would refuse, so the refusal is the same on every rank and leaves the
model untouched.
"""

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
    """What a role may ask about the backend: its name (``"fsdp1"``), the builder that uses it
    (named in errors), whether it can shard a unit still on meta, and whether sharding
    communicates."""

    name: str
    builder: str
    supports_shard_first: bool
    shard_communicates: bool


@frozen(eq=False)
class ConfigureContext:
    """The configure stage's view of one build. Checks must stay local and pure: read it, never
    change the model, never communicate.

    ``world_size`` is the default group's (1 without a process group); the shard group, which
    the group factory creates later, spans it or a divisor of it.
    """

    model: nn.Module
    plan: UnitPlan
    ignored: IgnoredStates
    options: ShardingOptions
    backend: BackendCapabilities
    device: torch.device
    world_size: int = 1


@runtime_checkable
class ChecksContext(Protocol):
    """A role that checks the whole configuration in the configure stage. Optional for every
    role: ``BaseMaterializer`` implements it by calling ``check(plan, ignored)``; a group
    factory, device resolver or synchronizer that defines it is called too."""

    def check_context(self, context: ConfigureContext) -> None:
        """Raise (a ``ConfigurationError`` naming the argument and the fix) to refuse."""
        ...


__all__ = ["BackendCapabilities", "ChecksContext", "ConfigureContext"]
