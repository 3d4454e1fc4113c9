"""StateSynchronizer role: make ranks hold the same values where they must, one unit at a time.

A synchronizer runs collectives: every rank calls it for the same unit at the same time, and a
synchronizer that detects a problem must raise the same error on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import attrs
from attrs import frozen
from typing_extensions import override

from fsdp_builder.environment import Environment
from fsdp_builder.plan import Unit


@runtime_checkable
class StateSynchronizer(Protocol):
    """Synchronizes a unit's states; returns the bytes it sent or received on this rank."""

    def synchronize(self, unit: Unit, env: Environment) -> int: ...


class BaseSynchronizer:
    """Optional base for custom synchronizers."""

    def synchronize(self, unit: Unit, env: Environment) -> int:
        raise NotImplementedError


@frozen
class NoSync(BaseSynchronizer):
    """Leaves states as they are (every rank built the same values itself)."""

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        return 0


def _to_steps(steps: Iterable[StateSynchronizer]) -> tuple[StateSynchronizer, ...]:
    return tuple(steps)


@frozen
class Chain(BaseSynchronizer):
    """Runs several synchronizers in order, e.g. broadcast then verify."""

    steps: tuple[StateSynchronizer, ...] = attrs.field(converter=_to_steps)

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        return sum(step.synchronize(unit, env) for step in self.steps)
