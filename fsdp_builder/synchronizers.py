"""StateSynchronizer role: make ranks hold the same values where they must, one unit at a time.

Local checks (a state still on meta) are agreed on before any collective, so one rank's problem
never leaves the others blocked in a broadcast. ``prepare(env)`` returns the build's
:class:`SyncRun`, closed on success and failure alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs
import torch
import torch.distributed as dist
from attrs import define, frozen
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from typing_extensions import override

from fsdp_builder.common.describe import listed
from fsdp_builder.common.hashing import digest63
from fsdp_builder.common.hooks import DeclaredHooks
from fsdp_builder.errors import FSDPBuilderError, StateMismatchError
from fsdp_builder.groups import other_dim_groups
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.agreement import agree
from fsdp_builder.runtime.collectives import (
    DEFAULT_BUCKET_BYTES,
    broadcast_tensors,
    check_bucket_bytes,
    collective_device,
    sync_stages,
)
from fsdp_builder.runtime.environment import Environment


@runtime_checkable
class SyncRun(Protocol):
    """One build's synchronization: called per unit, closed once."""

    def synchronize(self, unit: Unit) -> int:
        """Synchronize the unit's states; return the bytes sent or received on this rank."""

    def close(self) -> None:
        """Release what the build held; called on every rank, after success or failure."""


@runtime_checkable
class StateSynchronizer(Protocol):
    """Makes ranks hold the same values for each unit's states.

    ``communicates``: ``synchronize`` runs collectives, so it must fail on every rank alike or
    only after its last collective.
    """

    @property
    def communicates(self) -> bool: ...

    def prepare(self, env: Environment) -> SyncRun:
        """Start one build on every rank, after the groups exist; may communicate."""


@define
class _PerUnit:
    """The run of a synchronizer that keeps no state between units."""

    sync: BaseSynchronizer
    env: Environment

    def synchronize(self, unit: Unit) -> int:
        return self.sync.synchronize(unit, self.env)

    def close(self) -> None:
        return None


class BaseSynchronizer(DeclaredHooks):
    """Optional base: override ``synchronize(unit, env)`` (or ``prepare`` for per-build state);
    set ``communicates = False`` if it runs no collectives."""

    __slots__ = ()

    communicates: bool = True
    # Every rank ends with rank 0's values, so other ranks' materialized values are never used.
    overwrites: ClassVar[bool] = False

    def prepare(self, env: Environment) -> SyncRun:
        return _PerUnit(self, env)

    def synchronize(self, unit: Unit, env: Environment) -> int:
        raise NotImplementedError


@frozen
class NoSync(BaseSynchronizer):
    """Leaves states as they are (every rank built the same values itself).

    Example:
        ```python
        torch.manual_seed(0)  # every rank builds the same values itself
        FSDPBuilder().materialize(ResetParameters()).synchronize(NoSync()).build(model)
        ```
    """

    communicates: bool = attrs.field(default=False, init=False)

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        return 0


def _to_steps(steps: Iterable[StateSynchronizer]) -> tuple[StateSynchronizer, ...]:
    return tuple(steps)


@define
class _ChainRun:
    runs: list[SyncRun]

    def synchronize(self, unit: Unit) -> int:
        return sum(run.synchronize(unit) for run in self.runs)

    def close(self) -> None:
        for run in self.runs:
            run.close()


@frozen
class Chain(BaseSynchronizer):
    """Runs several synchronizers in order, e.g. broadcast then verify.

    Example:
        ```python
        # What .synchronize(BroadcastFromRank0(), VerifyReplicas()) builds.
        FSDPBuilder().synchronize(Chain((BroadcastFromRank0(), VerifyReplicas()))).build(model)
        ```
    """

    steps: tuple[StateSynchronizer, ...] = attrs.field(converter=_to_steps)

    @property
    def communicates(self) -> bool:  # type: ignore[override]
        return any(step.communicates for step in self.steps)

    @property
    def overwrites(self) -> bool:  # type: ignore[override]
        return any(overwrites(step) for step in self.steps)

    @override
    def prepare(self, env: Environment) -> SyncRun:
        runs: list[SyncRun] = []
        try:
            for step in self.steps:
                runs.append(step.prepare(env))
        except BaseException:
            _ChainRun(runs).close()
            raise
        return _ChainRun(runs)


def overwrites(synchronizer: StateSynchronizer) -> bool:
    """Whether ``synchronizer`` gives every rank global rank 0's values (False if unsaid)."""
    return bool(getattr(synchronizer, "overwrites", False))


Stages = tuple[tuple[dist.ProcessGroup | None, int], ...]


@frozen(eq=False)
class SyncState:
    """One plain tensor and the (group, global source rank) stages that reach its replicas."""

    name: str
    tensor: torch.Tensor
    stages: Stages


def _replica_stages(tensor: Any) -> Stages:
    """A DTensor's replicated mesh dimensions; shards along the others differ by design."""
    mesh = tensor.device_mesh
    groups = [mesh.get_group(dim) for dim, p in enumerate(tensor.placements) if p.is_replicate()]
    return tuple((group, dist.get_global_rank(group, 0)) for group in groups if group.size() > 1)


def _flatten(
    name: str, tensor: torch.Tensor, stages: Stages, placed: Stages = ()
) -> Iterator[SyncState]:
    """Plain tensors for ``tensor``: a DTensor's local shard (among its replicas: ``placed``,
    then its mesh's replicated dims), a traceable subclass's (float8) inner tensors."""
    detached = tensor.detach()
    if isinstance(detached, DTensor):
        yield SyncState(name, detached.to_local(), placed + _replica_stages(detached))
    elif is_traceable_wrapper_subclass(detached):
        for attr in detached.__tensor_flatten__()[0]:
            inner = getattr(detached, attr)
            if isinstance(inner, torch.Tensor):
                yield from _flatten(f"{name}.{attr}", inner, stages)
    else:
        yield SyncState(name, detached, stages)


def by_stages(states: list[SyncState]) -> list[tuple[Stages, list[SyncState]]]:
    """States grouped by stages, in first-seen order (the same on every rank)."""
    groups: dict[Stages, list[SyncState]] = {}
    for s in states:
        groups.setdefault(s.stages, []).append(s)
    return list(groups.items())


def unit_states(unit: Unit, env: Environment, skip: set[int] | None = None) -> list[SyncState]:
    """The unit's own states, each tensor once. Buffers whose id is in ``skip`` (sent with a
    nested unit) are left out; the ids taken are added to it."""
    skip = set() if skip is None else skip
    seen: set[int] = set()
    params: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    for state in unit.states:
        if state.ignored or id(t := state.tensor) in seen:
            continue
        if state.is_param:
            seen.add(id(t))
            params.append((state.name, t))
        elif id(t) not in skip:
            seen.add(id(t))
            skip.add(id(t))
            buffers.append((state.name, t))
    data_parallel = tuple(sync_stages(env))
    # A plain state is whole on every rank, also along the mesh's other dims (tensor
    # parallelism leaves it as it is); before the backend shards the unit, a DTensor is the
    # user's, placed on those dims, and its local shard is replicated over the data-parallel
    # ranks.
    others = other_dim_groups(env.groups.mesh)
    plain = data_parallel + tuple((g, dist.get_global_rank(g, 0)) for g in others if g.size() > 1)
    placed = () if env.shard_first_for(unit) else data_parallel
    return [flat for name, t in params + buffers for flat in _flatten(name, t, plain, placed)]


def checked_states(
    unit: Unit, env: Environment, who: str, skip: set[int] | None = None
) -> list[SyncState]:
    """``unit_states`` once every rank agreed none is on meta (else all raise, before any
    collective)."""
    error: BaseException | None = None
    states: list[SyncState] = []
    try:
        states = unit_states(unit, env, skip)
        meta = [s.name for s in states if s.tensor.is_meta]
        if meta:
            raise FSDPBuilderError(
                f"`{who}` cannot synchronize unit '{unit.label}': {listed(meta)} are "
                "still on the meta device on this rank. "
                "Pass a materializer that gives them values (e.g. ResetParameters())."
            )
    except Exception as exc:
        error = exc
    agree("synchronize (check)", error, unit=unit.label, group=env.agreement_group)
    return states


@define
class _BroadcastRun:
    """One build's broadcasts; remembers the buffers already sent with a nested unit."""

    bucket_bytes: int
    env: Environment
    sent: set[int] = attrs.field(factory=set)

    def synchronize(self, unit: Unit) -> int:
        skip = set(self.sent)
        states = checked_states(unit, self.env, "BroadcastFromRank0", skip)
        self.sent |= skip
        total = 0
        for stages, members in by_stages(states):
            tensors = [s.tensor for s in members]
            for group, src in stages:
                total += broadcast_tensors(tensors, src, group, self.bucket_bytes)
        self.env.logger.debug(
            "broadcast_from_rank0", unit=unit.label, tensors=len(states), bytes=total
        )
        return total

    def close(self) -> None:
        self.sent.clear()


@frozen
class BroadcastFromRank0(BaseSynchronizer):
    """Every rank ends with global rank 0's parameters and buffers (every replica too, under
    hybrid sharding; with tensor parallelism on other mesh dims, each TP shard from the
    data-parallel ranks holding rank 0's). Small states travel packed into buckets of
    ``bucket_bytes``.

    Raises:
        ConfigurationError: ``bucket_bytes`` is not a positive int.
        FSDPBuilderError: on every rank, before any broadcast, when a rank still has a state on
            meta (pass a materializer).

    Example:
        ```python
        # Rank 0 loaded real weights, the others built on meta: ResetParameters gives the
        # others storage, the broadcast gives them rank 0's values.
        FSDPBuilder().wrap(Block).synchronize(BroadcastFromRank0()).build(model)
        ```
    """

    overwrites: ClassVar[bool] = True

    bucket_bytes: int = attrs.field(default=DEFAULT_BUCKET_BYTES, validator=check_bucket_bytes)

    @override
    def prepare(self, env: Environment) -> SyncRun:
        return _BroadcastRun(self.bucket_bytes, env)

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        """One unit on its own (outside a build's run)."""
        return _BroadcastRun(self.bucket_bytes, env).synchronize(unit)


def checksum(tensor: torch.Tensor) -> int:
    """A 63-bit digest of the tensor's bytes (-0.0 and 0.0 differ, NaNs compare)."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return digest63(data.numpy().tobytes(), f"{tuple(tensor.shape)}{tensor.dtype}")


@frozen
class VerifyReplicas(BaseSynchronizer):
    """Checks that every rank holds the same values for the unit's states (a checksum per
    tensor, gathered across ranks). Chain it after another synchronizer.

    Raises:
        StateMismatchError: on every rank, naming the first differing state and the ranks.
        FSDPBuilderError: a rank still has a state on meta.

    Example:
        ```python
        FSDPBuilder().synchronize(BroadcastFromRank0(), VerifyReplicas()).build(model)
        ```
    """

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        states = checked_states(unit, env, "VerifyReplicas")
        entries = by_stages(states)
        # One row per rank: each stage's source rank (which names the rank's group along that
        # stage), then a checksum per state. Gathered once over the build's ranks, every rank
        # judges every group alike: comparing per group instead, ranks whose group differs
        # would raise while the others wait for them in the next group's comparison.
        row: list[int] = []
        for stages, members in entries:
            row += [src for _, src in stages]
            row += [checksum(s.tensor) for s in members]
        group = env.agreement_group
        mine = torch.tensor(row, dtype=torch.int64, device=collective_device(group))
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered).cpu()
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        found = _first_mismatch(entries, table, ranks)
        if found is not None:
            raise found.error(unit)
        return int(table.numel() * table.element_size())


@frozen
class _Mismatch:
    """The first state whose replicas differ, by global rank, and how many states differ."""

    name: str
    odd: list[int]
    agreeing: list[int]
    count: int

    def error(self, unit: Unit) -> StateMismatchError:
        return StateMismatchError(
            f"`VerifyReplicas` found different values across ranks in unit '{unit.label}': "
            f"the first differing state is '{self.name}', where rank(s) "
            f"{', '.join(map(str, self.odd))} differ from rank(s) "
            f"{', '.join(map(str, self.agreeing))} ({self.count} state(s) of this unit differ). "
            "Synchronize before verifying, e.g. .synchronize(BroadcastFromRank0(), "
            "VerifyReplicas()), or seed every rank alike before building."
        )


def _first_mismatch(
    entries: list[tuple[Stages, list[SyncState]]], table: torch.Tensor, ranks: list[int] | None
) -> _Mismatch | None:
    """The first difference in ``table`` (a row per rank: each stage's source rank, then each
    state's checksum), in stage order, then group order (by source rank); the same on every
    rank, which all hold the whole table."""
    first: _Mismatch | None = None
    differing: set[tuple[int, int]] = set()
    offset = 0
    for e, (stages, members) in enumerate(entries):
        sums = table[:, offset + len(stages) : offset + len(stages) + len(members)]
        for j in range(len(stages)):
            sources = table[:, offset + j]
            for src in sorted({int(v) for v in sources}):
                rows = (sources == src).nonzero().flatten()
                block = sums[rows]
                differs = (block != block[0]).any(dim=0)
                differing |= {(e, int(i)) for i in differs.nonzero().flatten()}
                if first is None and bool(differs.any()):
                    index = int(differs.nonzero()[0])
                    named = [int(r) if ranks is None else ranks[int(r)] for r in rows]
                    values = [int(v) for v in block[:, index]]
                    agreeing = [r for r, v in zip(named, values, strict=True) if v == values[0]]
                    odd = [r for r in named if r not in agreeing]
                    first = _Mismatch(members[index].name, odd, agreeing, 0)
        offset += len(stages) + len(members)
    return None if first is None else attrs.evolve(first, count=len(differing))
