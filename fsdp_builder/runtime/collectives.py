"""Collective helpers: every broadcast, scatter and small all-gather a build sends.

Callers guarantee that every rank of the group reaches the same call with tensors of the same
sizes and dtypes; these helpers never raise between two ranks' collectives on their own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
from attrs import frozen
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_builder.errors import MaterializationError, config_error
from fsdp_builder.groups import collective_device
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.shards import chunk_size
from fsdp_builder.runtime.tree import allocate_unit

DEFAULT_BUCKET_BYTES = 250 * 1024 * 1024


class GroupTimeouts:
    """Lowers the timeout of the groups a build waits on to its bound until ``restore``, so a
    dead peer fails a collective within it; no-op where a backend cannot change its timeout."""

    def __init__(self, seconds: float | None) -> None:
        self.bound = None if seconds is None else timedelta(seconds=seconds)
        self.saved: dict[int, tuple[Any, timedelta]] = {}

    def add(self, *groups: dist.ProcessGroup | None) -> None:
        if self.bound is None or not dist.is_initialized():
            return
        for group in groups:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            for device_type in getattr(pg, "_device_types", []):
                try:
                    backend = pg._get_backend(torch.device(device_type))
                    self.saved.setdefault(id(backend), (backend, backend.options._timeout))
                    backend._set_default_timeout(self.bound)
                except (AttributeError, RuntimeError):  # this backend cannot change it
                    continue

    def restore(self) -> None:
        for backend, previous in self.saved.values():
            backend._set_default_timeout(previous)
        self.saved.clear()


def check_bucket_bytes(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: a bucket size is a positive number of bytes."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise config_error(
            type(instance).__name__,
            attribute.name,
            f"expected a positive number of bytes, got {value!r}",
            "Pass e.g. bucket_bytes=250 * 1024 * 1024, or leave the default",
        )


def sync_stages(env: Environment) -> list[tuple[dist.ProcessGroup | None, int]]:
    """The (group, global source rank) broadcasts that carry global rank 0's values to every
    rank: the world, or the replicate group then the shard group, each from its first rank."""
    groups = env.groups
    if groups.data_parallel_size == dist.get_world_size():
        return [(None, 0)]
    stages: list[tuple[dist.ProcessGroup | None, int]] = []
    if groups.replicate_group is not None:
        stages.append((groups.replicate_group, dist.get_global_rank(groups.replicate_group, 0)))
    stages.append((groups.shard_group, dist.get_global_rank(groups.shard_group, 0)))
    return stages


# Larger tensors are broadcast in place: staging copies every byte twice, which costs more than
# the broadcast on CPU. Smaller ones are coalesced, where a collective each would cost more.
COALESCE_BELOW_BYTES = 1024 * 1024


def broadcast_tensors(
    tensors: list[torch.Tensor],
    src: int,
    group: dist.ProcessGroup | None,
    bucket_bytes: int,
) -> int:
    """Broadcast ``tensors`` from global rank ``src``; returns the bytes broadcast. Small tensors
    are packed per dtype into buckets of about ``bucket_bytes`` (grouped by sizes and dtypes
    alone, so every rank issues the same collectives), with about one bucket of staging held."""
    alone_from = min(bucket_bytes, COALESCE_BELOW_BYTES)
    sent = 0
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    pipe = _BroadcastQueue(src, group, collective_device(group), bucket_bytes)
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
        self, src: int, group: dist.ProcessGroup | None, device: torch.device, limit: int
    ) -> None:
        self.src, self.group, self.device, self.limit = src, group, device, limit
        self.is_src = dist.get_rank() == src
        # (work, tensors, buffer on the wire, unpack into them?, staged bytes)
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


@frozen
class _Layout:
    """Where one parameter's slices go, computed once per (mesh, placements) of a unit."""

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    dim: int  # the tensor dim that is sharded
    src_replica: int  # the replica (mesh row) holding the source rank
    src_shard: int  # the source rank's index in its shard group
    my_replica: int


def _layout(tensor: DTensor, src: int) -> _Layout:
    mesh = tensor.device_mesh
    placements = tensor.placements
    last = placements[-1]
    if mesh.ndim not in (1, 2) or not isinstance(last, Shard):
        raise MaterializationError(
            f"scatter_unit_state expects fully_shard placements (Shard on the last mesh dim, "
            f"Replicate before it), got {placements} on a {mesh.ndim}-D mesh."
        )
    if mesh.ndim == 2 and not isinstance(placements[0], Replicate):
        raise MaterializationError(
            f"scatter_unit_state expects Replicate on mesh dim 0, got {placements}."
        )
    rows = mesh.mesh.tolist() if mesh.ndim == 2 else [mesh.mesh.tolist()]
    where = next(((i, row.index(src)) for i, row in enumerate(rows) if src in row), None)
    if where is None:
        raise MaterializationError(
            f"Rank {src} holds the state dict but is not in the parameter's mesh "
            f"{mesh.mesh.tolist()}; load from a rank of the mesh."
        )
    return _Layout(
        shard=mesh.get_group(mesh.ndim - 1),
        replicate=mesh.get_group(0) if mesh.ndim == 2 else None,
        dim=last.dim,
        src_replica=where[0],
        src_shard=where[1],
        my_replica=mesh.get_local_rank(0) if mesh.ndim == 2 else 0,
    )


def _padded_chunks(full: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    """``full`` chunked as ``fully_shard`` does, zero-padded so every rank receives an equal
    message; full-size dim-0 chunks of a contiguous tensor are views (no copy)."""
    rows = full.size(dim)
    size = chunk_size(rows, parts)
    shape = list(full.shape)
    shape[dim] = size
    views = dim == 0 and full.is_contiguous()
    out = []
    for i in range(parts):
        start = i * size
        length = max(0, min(size, rows - start))
        if length == size:
            chunk = full.narrow(dim, start, size)
            out.append(chunk if views else chunk.contiguous())
            continue
        buf = full.new_zeros(shape)
        if length > 0:
            buf.narrow(dim, 0, length).copy_(full.narrow(dim, start, length))
        out.append(buf)
    return out


def _broadcast_into(target: torch.Tensor, group: dist.ProcessGroup, group_src: int) -> None:
    buf = target if target.is_contiguous() else target.contiguous()
    dist.broadcast(buf, group=group, group_src=group_src)
    if buf is not target:
        target.copy_(buf)


@attrs.define
class _Incoming:
    """A parameter's scatter in flight: where its slice lands and where it belongs."""

    work: dist.Work | None
    recv: torch.Tensor
    local: torch.Tensor
    dim: int

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.recv is not self.local and self.local.numel() > 0:
            self.local.copy_(self.recv.narrow(self.dim, 0, self.local.size(self.dim)))


def _start_scatter(
    local: torch.Tensor, padded_shape: list[int], layout: _Layout, full: torch.Tensor | None
) -> _Incoming:
    """Start scattering ``full`` (source rank only) over the source's shard group; the slice
    lands straight in the local shard when that has the padded size."""
    dim = layout.dim
    direct = list(local.shape) == padded_shape and local.is_contiguous()
    recv = local if direct else local.new_empty(padded_shape)
    scatter_list = None
    if full is not None:
        source = full.detach().to(device=local.device, dtype=local.dtype)
        scatter_list = _padded_chunks(source, layout.shard.size(), dim)
    if layout.shard.size() == 1:
        assert scatter_list is not None
        recv.copy_(scatter_list[0])
        return _Incoming(None, recv, local, dim)
    work = dist.scatter(
        recv, scatter_list, group=layout.shard, group_src=layout.src_shard, async_op=True
    )
    return _Incoming(work, recv, local, dim)


def _scatter_params(
    params: list[tuple[DTensor, _Layout, torch.Tensor | None]], is_src: bool
) -> int:
    """Fill each local shard from its full tensor (source rank only); returns bytes received.
    All scatters are in flight at once; under hybrid sharding, replicate broadcasts follow."""
    received = 0
    incoming: list[_Incoming] = []
    for param, layout, full in params:
        local = param.to_local()
        if layout.my_replica == layout.src_replica:
            padded_shape = list(local.shape)
            padded_shape[layout.dim] = chunk_size(param.shape[layout.dim], layout.shard.size())
            incoming.append(_start_scatter(local, padded_shape, layout, full))
            if not is_src:
                received += math.prod(padded_shape) * local.element_size()
        elif layout.replicate is not None:
            received += local.numel() * local.element_size()
    for pending in incoming:
        pending.finish()
    works: list[dist.Work] = []
    for param, layout, _ in params:
        if layout.replicate is None or layout.replicate.size() == 1:
            continue
        local = param.to_local()
        if local.is_contiguous():
            work = dist.broadcast(
                local, group=layout.replicate, group_src=layout.src_replica, async_op=True
            )
            assert work is not None
            works.append(work)
        else:
            _broadcast_into(local, layout.replicate, layout.src_replica)
    for work in works:
        work.wait()
    return received


def _broadcast_buffer(
    buffer: torch.Tensor, full: torch.Tensor | None, env: Environment, src: int
) -> int:
    """``src`` broadcasts over its shard group, whose members then over their replicate groups."""
    groups = env.groups
    shard_ranks = dist.get_process_group_ranks(groups.shard_group)
    if full is not None and env.rank == src:
        buffer.copy_(full.detach().to(device=buffer.device, dtype=buffer.dtype))
    if src in shard_ranks and groups.shard_group.size() > 1:
        _broadcast_into(buffer, groups.shard_group, shard_ranks.index(src))
    if groups.replicate_group is not None and groups.replicate_group.size() > 1:
        mesh = groups.mesh
        if mesh is None:
            raise MaterializationError(
                "scatter_unit_state needs the build's device mesh (FullyShardBuilder sets it)."
            )
        layout = mesh.mesh if mesh.ndim == 2 else mesh.mesh.view(1, -1)
        row = next((r for r in layout.tolist() if src in r), None)
        if row is None:
            raise MaterializationError(f"Rank {src} is not in the build's mesh {layout.tolist()}.")
        replicate_ranks = dist.get_process_group_ranks(groups.replicate_group)
        sources = [r for r in replicate_ranks if r in row]
        if len(sources) != 1:
            raise MaterializationError(
                f"Cannot find the member of replicate group {replicate_ranks} that shares a "
                f"shard group with rank {src}; pass groups that form a (replicate, shard) grid."
            )
        _broadcast_into(buffer, groups.replicate_group, replicate_ranks.index(sources[0]))
    return buffer.numel() * buffer.element_size() if env.rank != src else 0


def scatter_unit_state(
    unit: Unit,
    env: Environment,
    full_state: Mapping[str, torch.Tensor] | None,
    src: int = 0,
) -> int:
    """Fill one ``fully_shard``-ed unit's own states from ``full_state``, held by global rank
    ``src`` (None elsewhere); collective over the unit's mesh, each rank receiving only its
    slices. A bad entry is reported after every collective (zeros sent), so no rank is left
    waiting. Returns the bytes received on this rank.
    """
    allocate_unit(env.sharded_root(unit), list(unit.modules), env.device, env.shard_specs)
    is_src = env.rank == src
    problems: list[str] = []

    def source(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        if not is_src:
            return None
        assert full_state is not None
        tensor = full_state.get(name)
        if tensor is None:
            problems.append(f"'{name}' is missing")
        elif tuple(tensor.shape) != shape:
            problems.append(f"'{name}' has shape {list(tensor.shape)}, expected {list(shape)}")
        else:
            return tensor
        return torch.zeros(shape, dtype=dtype)

    if is_src and full_state is None:
        raise config_error(
            "scatter_unit_state",
            "full_state",
            f"rank {src} is the source but got no state dict",
            "Pass the full state dict on the source rank and None elsewhere.",
        )
    layouts: dict[tuple[int, tuple[Any, ...]], _Layout] = {}
    params: list[tuple[DTensor, _Layout, torch.Tensor | None]] = []
    with torch.no_grad():
        for info, state in zip(unit.params, unit.owned[: len(unit.params)], strict=True):
            param = state.tensor
            if not isinstance(param, DTensor):
                raise MaterializationError(
                    f"'{info.name}' is not a DTensor: scatter_unit_state fills units sharded "
                    "by fully_shard (FullyShardBuilder)."
                )
            key = (id(param.device_mesh), tuple(param.placements))
            if key not in layouts:
                layouts[key] = _layout(param, src)
            params.append((param, layouts[key], source(info.name, info.shape, info.dtype)))
        received = _scatter_params(params, is_src)
        for info, state in zip(unit.buffers, unit.owned[len(unit.params) :], strict=True):
            if not state.persistent:
                continue  # not in any state dict; its module's initializer owns it
            received += _broadcast_buffer(
                state.tensor, source(info.name, info.shape, info.dtype), env, src
            )
    if problems:
        raise MaterializationError(
            f"The state dict on rank {src} does not fit unit '{unit.label}': "
            f"{'; '.join(problems)}. Pass the state dict of this model (same names and shapes)."
        )
    env.logger.debug("scatter_unit_state", unit=unit.label, received=received)
    return received
