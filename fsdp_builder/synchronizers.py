"""StateSynchronizer role: make ranks hold the same values where they must, one unit at a time.

A synchronizer runs collectives: every rank calls it for the same unit at the same time, and a
synchronizer that detects a problem must raise the same error on every rank. The checks that can
fail locally (a state still on meta) run first and are agreed on before any collective, so one
rank's problem never leaves the others blocked in a broadcast.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import attrs
import structlog
import torch
import torch.distributed as dist
from attrs import frozen
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from typing_extensions import override

from fsdp_builder.agreement import agree, collective_device
from fsdp_builder.environment import Environment
from fsdp_builder.errors import FSDPBuilderError, StateMismatchError, config_error
from fsdp_builder.materializers import unit_modules
from fsdp_builder.plan import Unit

log = structlog.get_logger(__name__)

DEFAULT_BUCKET_BYTES = 250 * 1024 * 1024


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

    communicates: ClassVar[bool] = False

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        return 0


def _to_steps(steps: Iterable[StateSynchronizer]) -> tuple[StateSynchronizer, ...]:
    return tuple(steps)


@frozen
class Chain(BaseSynchronizer):
    """Runs several synchronizers in order, e.g. broadcast then verify."""

    steps: tuple[StateSynchronizer, ...] = attrs.field(converter=_to_steps)

    @property
    def communicates(self) -> bool:
        return any(bool(getattr(step, "communicates", True)) for step in self.steps)

    def prepare(self, env: Environment) -> None:
        """Pass the once-per-build hook on to the steps that have one."""
        for step in self.steps:
            prepare = getattr(step, "prepare", None)
            if callable(prepare):
                prepare(env)

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        return sum(step.synchronize(unit, env) for step in self.steps)


# -- the unit's states ----------------------------------------------------------------------


Stages = tuple[tuple[dist.ProcessGroup | None, int], ...]


@frozen(eq=False)
class SyncState:
    """One plain tensor to synchronize, and the (group, global source rank) broadcasts that
    carry the first replica's values to every rank that must hold the same ones."""

    name: str
    tensor: torch.Tensor
    stages: Stages


def _replica_stages(tensor: Any) -> Stages:
    """For a DTensor's local shard: the mesh dimensions it is replicated over. Shards along the
    other dimensions differ by design and are never synchronized with each other."""
    mesh = tensor.device_mesh
    stages: list[tuple[dist.ProcessGroup | None, int]] = []
    for dim, placement in enumerate(tensor.placements):
        group = mesh.get_group(dim)
        if placement.is_replicate() and group.size() > 1:
            stages.append((group, dist.get_global_rank(group, 0)))
    return tuple(stages)


def _flatten(name: str, tensor: torch.Tensor, stages: Stages) -> Iterator[SyncState]:
    """Plain tensors for ``tensor``: a DTensor travels as its local shard, among its replicas
    only; other traceable subclasses (float8 wrappers) as their inner tensors."""
    detached = tensor.detach()
    if _is_dtensor(detached):
        yield SyncState(name, cast(Any, detached).to_local(), _replica_stages(detached))
    elif is_traceable_wrapper_subclass(detached):
        attrs_, _ = detached.__tensor_flatten__()
        for attr in attrs_:
            inner = getattr(detached, attr)
            if isinstance(inner, torch.Tensor):
                yield from _flatten(f"{name}.{attr}", inner, stages)
    else:
        yield SyncState(name, detached, stages)


def by_stages(states: list[SyncState]) -> list[tuple[Stages, list[SyncState]]]:
    """States grouped by how they travel, in first-seen order (the same on every rank)."""
    groups: dict[Stages, list[SyncState]] = {}
    for s in states:
        groups.setdefault(s.stages, []).append(s)
    return list(groups.items())


def unit_states(unit: Unit, env: Environment, skip: set[int] | None = None) -> list[SyncState]:
    """The unit's own parameters and buffers as ``(fully-qualified name, plain tensor)``, each
    storage once (tied parameters, buffers registered twice). Buffers whose id is in ``skip``
    (already handled with a nested unit) are left out; the ids of those taken are added to it."""
    modules = unit_modules(unit.module, env.ignored.modules)
    names = {id(m): n for n, m in unit.module.named_modules(remove_duplicate=False)}
    seen: set[int] = set()
    params: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    for m in modules:
        prefix = ".".join(x for x in (unit.fqn, names.get(id(m), "")) if x)
        for pname, p in m.named_parameters(recurse=False):
            if p in env.ignored.params or id(p) in seen:
                continue
            seen.add(id(p))
            params.append((f"{prefix}.{pname}" if prefix else pname, p))
        for bname, b in m.named_buffers(recurse=False):
            if id(b) in seen or (skip is not None and id(b) in skip):
                continue
            seen.add(id(b))
            if skip is not None:
                skip.add(id(b))
            buffers.append((f"{prefix}.{bname}" if prefix else bname, b))
    plain = tuple(sync_stages(env))
    return [flat for name, t in params + buffers for flat in _flatten(name, t, plain)]


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor
        return False
    return isinstance(t, DTensor)


def _check_real(states: list[SyncState], who: str, unit: Unit) -> None:
    meta = [s.name for s in states if s.tensor.is_meta]
    if meta:
        raise FSDPBuilderError(
            f"`{who}` cannot synchronize unit '{unit.label}': {', '.join(meta[:8])}"
            f"{' ...' if len(meta) > 8 else ''} are still on the meta device on this rank. "
            "Pass a materializer that gives them values (e.g. ResetParameters())."
        )


def sync_stages(env: Environment) -> list[tuple[dist.ProcessGroup | None, int]]:
    """The (group, global source rank) broadcasts that carry global rank 0's values to every
    rank of the build.

    When the build spans the whole world, one broadcast over the world does it. Otherwise the
    replicate group goes first, then the shard group, each from its first rank: the replicate
    group of the first rank spreads its values to the first rank of every shard group, which then
    spreads them inside its shard group, so every replica, not only the shard group, is covered.
    """
    groups = env.groups
    if groups.data_parallel_size == dist.get_world_size():
        return [(None, 0)]
    stages: list[tuple[dist.ProcessGroup | None, int]] = []
    if groups.replicate_group is not None:
        stages.append((groups.replicate_group, dist.get_global_rank(groups.replicate_group, 0)))
    stages.append((groups.shard_group, dist.get_global_rank(groups.shard_group, 0)))
    return stages


# Tensors at least this large (or at least a bucket) are broadcast in place, one collective each:
# staging them in a flat buffer would copy every byte twice (pack on the source, unpack on the
# others), which costs more than the broadcast itself on CPU. Smaller ones are coalesced, where
# one collective per tensor would cost more than the copy.
COALESCE_BELOW_BYTES = 1024 * 1024


def broadcast_tensors(
    tensors: list[torch.Tensor],
    src: int,
    group: dist.ProcessGroup | None,
    bucket_bytes: int,
) -> int:
    """Broadcast ``tensors`` from global rank ``src``; returns the bytes broadcast.

    A tensor of at least ``min(bucket_bytes, COALESCE_BELOW_BYTES)`` travels alone, in place when
    it is contiguous on the group's collective device. Smaller ones are packed, per dtype, into
    flat buffers of about ``bucket_bytes`` on that device. Which tensors travel alone or together
    depends only on their sizes and dtypes, so every rank issues the same collectives whatever its
    tensors' layout. The broadcasts are issued asynchronously and waited for in order, so
    unpacking one bucket overlaps the next transfer; at most about one bucket of staging memory
    is held beyond the one being filled."""
    device = collective_device(group)
    alone_from = min(bucket_bytes, COALESCE_BELOW_BYTES)
    is_src = dist.get_rank() == src
    sent = 0
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    pipe = _BroadcastQueue(src, group, device, is_src, bucket_bytes)
    with torch.no_grad():
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if not nbytes:
                continue
            sent += nbytes
            if nbytes >= alone_from:
                pipe.send([t], nbytes)
            else:
                small.setdefault(t.dtype, []).append(t)
        for dtype in sorted(small, key=str):
            bucket: list[torch.Tensor] = []
            size = 0
            for t in small[dtype]:
                nbytes = t.numel() * t.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    pipe.send(bucket, size)
                    bucket, size = [], 0
                bucket.append(t)
                size += nbytes
            if bucket:
                pipe.send(bucket, size)
        pipe.finish()
    return sent


class _BroadcastQueue:
    """Asynchronous broadcasts from ``src``, completed in the order they were issued."""

    def __init__(
        self,
        src: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        is_src: bool,
        bucket_bytes: int,
    ) -> None:
        self.src, self.group, self.device, self.is_src = src, group, device, is_src
        self.limit = bucket_bytes
        # (work, the tensors, the buffer on the wire, whether to unpack it into them, staged bytes)
        self.pending: deque[tuple[Any, list[torch.Tensor], torch.Tensor, bool, int]] = deque()
        self.staged = 0

    def send(self, tensors: list[torch.Tensor], nbytes: int) -> None:
        first = tensors[0]
        unpack = False
        if len(tensors) == 1 and first.device == self.device and first.is_contiguous():
            buffer = first
        elif self.is_src:
            if len(tensors) == 1:
                buffer = first.reshape(-1).to(self.device)
            else:
                buffer = torch.cat([t.reshape(-1).to(self.device) for t in tensors])
        else:
            numel = sum(t.numel() for t in tensors)
            buffer = torch.empty(numel, dtype=first.dtype, device=self.device)
            unpack = True
        work = dist.broadcast(buffer, src=self.src, group=self.group, async_op=True)
        staged = 0 if buffer is first else nbytes
        self.pending.append((work, tensors, buffer, unpack, staged))
        self.staged += staged
        while self.staged > self.limit and len(self.pending) > 1:
            self._complete()

    def _complete(self) -> None:
        work, tensors, buffer, unpack, staged = self.pending.popleft()
        work.wait()
        if unpack:
            offset = 0
            for t in tensors:
                t.copy_(buffer[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        self.staged -= staged

    def finish(self) -> None:
        while self.pending:
            self._complete()


def _check_bucket_bytes(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise config_error(
            type(instance).__name__,
            attribute.name,
            f"expected a positive number of bytes, got {value!r}",
            "Pass e.g. bucket_bytes=250 * 1024 * 1024, or leave the default",
        )


@frozen
class BroadcastFromRank0(BaseSynchronizer):
    """Every rank ends with global rank 0's parameters and buffers (every replica too, under
    hybrid sharding). Works on CPU/gloo as on GPU/NCCL.

    Large states are broadcast in place, small ones packed into buckets of ``bucket_bytes`` (see
    ``broadcast_tensors``); tensor subclasses travel as their inner tensors; a buffer shared with
    a nested unit was sent with that unit and is not sent again.
    """

    bucket_bytes: int = attrs.field(default=DEFAULT_BUCKET_BYTES, validator=_check_bucket_bytes)
    # Buffers already sent in the current build, by build; cleared after the root unit.
    # Keyed by the build's environment itself (weakly), so a failed build's entry goes with it
    # and can never be mistaken for a later build's.
    _sent: weakref.WeakKeyDictionary[Environment, set[int]] = attrs.field(
        factory=weakref.WeakKeyDictionary, init=False, eq=False, repr=False
    )

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        sent_before = self._sent.setdefault(env, set())
        skip = set(sent_before)
        error: BaseException | None = None
        states: list[SyncState] = []
        try:
            states = unit_states(unit, env, skip)
            _check_real(states, "BroadcastFromRank0", unit)
        except Exception as exc:  # reported on every rank before any broadcast starts
            error = exc
        agree("synchronize (check)", error, unit=unit.label, group=env.agreement_group)
        sent_before |= skip
        total = 0
        for stages, members in by_stages(states):
            tensors = [s.tensor for s in members]
            for group, src in stages:
                total += broadcast_tensors(tensors, src, group, self.bucket_bytes)
        if unit.is_root:
            self._sent.pop(env, None)
        log.debug(
            "broadcast_from_rank0",
            unit=unit.label,
            tensors=len(states),
            bytes=total,
            rank=env.rank,
        )
        return total


def checksum(tensor: torch.Tensor) -> int:
    """A 63-bit digest of the tensor's bytes (bit-exact: -0.0 and 0.0 differ, NaNs compare)."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    digest = hashlib.blake2b(data.numpy().tobytes(), digest_size=8)
    digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
    return int.from_bytes(digest.digest(), "little") >> 1


@frozen
class VerifyReplicas(BaseSynchronizer):
    """Checks that every rank holds the same values for the unit's states (a checksum per
    tensor, gathered across ranks); on a divergence raises StateMismatchError naming the first
    differing state and the ranks involved, the same on every rank. Chain it after another
    synchronizer: ``.synchronize(BroadcastFromRank0(), VerifyReplicas())``."""

    @override
    def synchronize(self, unit: Unit, env: Environment) -> int:
        error: BaseException | None = None
        states: list[SyncState] = []
        try:
            states = unit_states(unit, env)
            _check_real(states, "VerifyReplicas", unit)
        except Exception as exc:
            error = exc
        agree("synchronize (check)", error, unit=unit.label, group=env.agreement_group)
        total = 0
        # Each state is compared among the ranks that must hold it alike: all ranks for plain
        # tensors, a shard's replicas for sharded ones.
        for stages, members in by_stages(states):
            sums = [checksum(s.tensor) for s in members]
            for group, _ in stages:
                total += self._compare(unit, members, sums, group)
        return total

    def _compare(
        self,
        unit: Unit,
        states: list[SyncState],
        sums: list[int],
        group: dist.ProcessGroup | None,
    ) -> int:
        world = dist.get_world_size(group)
        device = collective_device(group)
        mine = torch.tensor(sums, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered).cpu()
        differs = (table != table[0]).any(dim=0)
        if bool(differs.any()):
            index = int(differs.nonzero()[0])
            values = [int(v) for v in table[:, index]]
            ranks = [
                dist.get_global_rank(group, r) if group is not None else r for r in range(world)
            ]
            classes: dict[int, list[int]] = {}
            for r, v in zip(ranks, values, strict=True):
                classes.setdefault(v, []).append(r)
            agreeing = classes[values[0]]
            odd = [r for r in ranks if r not in agreeing]
            count = int(differs.sum())
            raise StateMismatchError(
                f"`VerifyReplicas` found different values across ranks in unit '{unit.label}': "
                f"the first differing state is '{states[index].name}', where rank(s) "
                f"{', '.join(map(str, odd))} differ from rank(s) "
                f"{', '.join(map(str, agreeing))} ({count} state(s) of this unit differ). "
                "Synchronize before verifying, e.g. .synchronize(BroadcastFromRank0(), "
                "VerifyReplicas()), or seed every rank alike before building."
            )
        return int(table.numel() * table.element_size())
