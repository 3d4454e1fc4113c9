"""Shard-first initialization for ``fully_shard`` units: each rank allocates and fills only its
own shards.

With a backend that ``supports_shard_first`` (FSDP2), the pipeline shards a unit while it is still
on the meta device, then calls the materializer. Two materializers work on such a unit:

- :class:`ShardFirstReset` runs each module's own initializer on its (DTensor) parameters, whose
  local tensors are the only storage allocated. The RNG is seeded per shard index and module, so
  the shards of one parameter differ from each other; plain ``reset_parameters`` on a CPU mesh
  draws the same numbers on every rank instead, and the full weight is one shard repeated.
  Trade-off: values depend on the world size (each shard is drawn independently), which is
  statistically the distribution the initializer asks for but not bit-identical across world
  sizes; for world-size-invariant weights use ``DeterministicInit``, which materializes each
  unit in full and lets ``fully_shard`` slice it (one full unit at a time per rank).
- :func:`scatter_unit_state` fills the local shards from full tensors held by one rank, which
  sends each rank only its slices; other ranks never hold a full tensor of a sharded parameter.
  ``FromStateDict`` uses it when the backend shards first.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import structlog
import torch
import torch.distributed as dist
from attrs import frozen
from torch import nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_builder.agreement import collective_device
from fsdp_builder.backends.fsdp2 import mesh_for
from fsdp_builder.environment import Environment
from fsdp_builder.errors import MaterializationError, config_error
from fsdp_builder.ignored import IgnoredStates
from fsdp_builder.materializers import (
    ResetParameters,
    allocate_empty,
    check_seed,
    initializer_of,
    needs_materialization,
    seed_generators,
    unit_modules,
)
from fsdp_builder.plan import Unit, UnitPlan

log = structlog.get_logger(__name__)


def shard_seed(seed: int, shard_index: int, fqn: str) -> int:
    """A 63-bit seed for one module's shard: unrelated across shard indices and modules."""
    digest = hashlib.blake2b(f"{seed}/{shard_index}/{fqn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def shard_index(env: Environment) -> int:
    """Which shard this rank holds: its rank in the shard group; 0 when nothing is sharded, so
    that replicas (hybrid or NO_SHARD) draw the same values."""
    if env.options.strategy == ShardingStrategy.NO_SHARD:
        return 0
    return env.groups.rank


def local_bytes(module: nn.Module) -> int:
    """Bytes of storage held by the parameters and buffers of ``module`` on this rank: the local
    shards of DTensors, counted once per storage."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.is_meta:
            continue
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if key in seen and storage.data_ptr() != 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _owned_bytes(modules: list[nn.Module]) -> int:
    total = 0
    for m in modules:
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def _fork_devices(device: torch.device) -> list[torch.device]:
    return [device] if device.type == "cuda" else []


@frozen
class ShardFirstReset:
    """``reset_parameters()`` on the local shards only (shard-first), under an RNG seeded from
    ``(seed, shard index, module name)`` so shards differ and replicas agree.

    ``seed=None`` takes ``torch.initial_seed()`` of the first rank of each group (shared in
    ``prepare``). Initializers must draw element-wise (uniform, normal, Kaiming, Xavier,
    constants): ones that need the whole tensor at once (``orthogonal_``, ``eye_``) do not work
    on a shard; use ``DeterministicInit`` for those. With a backend that cannot shard first the
    same seeding applies to the full unit, of which each rank keeps its own slice.
    Random buffers would differ across shard indices: add a synchronizer if a module has them.
    """

    seed: int | None = attrs.field(default=None, validator=attrs.validators.optional(check_seed))
    shard_first: ClassVar[bool] = True
    communicates: ClassVar[bool] = False  # only prepare() communicates
    # The seed agreed in prepare(); a frozen config still needs one slot it can fill per build.
    _agreed: dict[str, int] = attrs.field(factory=dict, init=False, repr=False, eq=False)

    def check(self, plan: UnitPlan, ignored: IgnoredStates) -> None:
        try:
            ResetParameters().check(plan, ignored)
        except MaterializationError as exc:
            raise MaterializationError(
                str(exc).replace("`ResetParameters`", "`ShardFirstReset`")
            ) from exc

    def prepare(self, env: Environment) -> None:
        """Share the base seed: over the shard group, then over the replicate group."""
        base = self.seed if self.seed is not None else torch.initial_seed() % 2**63
        value = torch.tensor([base], dtype=torch.int64)
        for group in (env.groups.shard_group, env.groups.replicate_group):
            if group is None or group.size() == 1:
                continue
            buf = value.to(collective_device(group))
            dist.broadcast(buf, group=group, group_src=0)
            value = buf.cpu()
        self._agreed["seed"] = int(value.item())

    def base_seed(self) -> int:
        if "seed" in self._agreed:
            return self._agreed["seed"]
        return self.seed if self.seed is not None else torch.initial_seed() % 2**63

    def materialize(self, unit: Unit, env: Environment) -> int:
        modules = unit_modules(unit.module, env.ignored.modules)
        if not needs_materialization(modules, env.ignored):
            return 0
        # Only modules that were on meta are initialized; real ones keep their values.
        pending = [
            m
            for m in modules
            if any(t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        ]
        names = {id(m): n for n, m in unit.module.named_modules(remove_duplicate=False)}
        allocate_empty(modules, env.device)
        base, index = self.base_seed(), shard_index(env)
        pending_ids = {id(m) for m in pending}
        with torch.no_grad():
            # Children first: a parent's initializer may overwrite its children's values.
            for module in reversed(modules):
                if id(module) not in pending_ids:
                    continue
                init = initializer_of(module)
                if init is None:  # buffers-only module: to_empty gave it storage
                    continue
                fqn = ".".join(x for x in (unit.fqn, names.get(id(module), "")) if x)
                try:
                    with torch.random.fork_rng(devices=_fork_devices(env.device)):
                        seed_generators(shard_seed(base, index, fqn), env.device)
                        init()
                except Exception as exc:
                    raise MaterializationError(
                        f"Initializing the shards of '{fqn or '<root>'}' "
                        f"({type(module).__name__}) with `ShardFirstReset` failed: "
                        f"{type(exc).__name__}: {exc}. Its initializer may need the whole "
                        "tensor; use DeterministicInit(seed) for this model."
                    ) from exc
        return _owned_bytes(modules)


# -- streaming a full state dict into the local shards ----------------------------------------


def _relative(unit: Unit, name: str) -> str:
    return name[len(unit.fqn) + 1 :] if unit.fqn else name


@frozen
class _Layout:
    """Where one parameter's slices go: what the scatter and broadcasts need, computed once per
    (mesh, placements) of a unit."""

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
    """``full`` split as ``fully_shard`` does (torch.chunk: ``ceil(n / parts)`` along ``dim``),
    each chunk zero-padded to that size so that every rank receives an equal-size message.

    Full-size chunks of a contiguous tensor split along dim 0 are views of ``full`` (no copy);
    only a short or missing last chunk gets a padded buffer of its own."""
    rows = full.size(dim)
    size = -(-rows // parts)
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
    """Start scattering ``full`` (given on the source rank only) over the source's shard group.

    The slice lands straight in the local shard when it has the padded size (every rank but
    those holding a short last chunk); the source sends views of ``full``, so its own slice is
    copied once, by the scatter, into its shard."""
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
    """Fill each parameter's local shard from its full tensor (given on the source rank only);
    returns the bytes this rank received.

    The source's shard group scatters every parameter of the unit (all in flight at once, so
    the sends of one overlap the preparation of the next); under hybrid sharding each member
    of that group then broadcasts its slices over its replicate group."""
    received = 0
    incoming: list[_Incoming] = []
    for param, layout, full in params:
        local = param.to_local()
        if layout.my_replica == layout.src_replica:
            padded_shape = list(local.shape)
            padded_shape[layout.dim] = -(-param.shape[layout.dim] // layout.shard.size())
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
    """Buffers are replicated: ``src`` broadcasts over its shard group, whose members then
    broadcast over their replicate groups."""
    groups = env.groups
    shard_ranks = dist.get_process_group_ranks(groups.shard_group)
    if full is not None and env.rank == src:
        buffer.copy_(full.detach().to(device=buffer.device, dtype=buffer.dtype))
    in_src_row = src in shard_ranks
    if in_src_row and groups.shard_group.size() > 1:
        _broadcast_into(buffer, groups.shard_group, shard_ranks.index(src))
    if groups.replicate_group is not None and groups.replicate_group.size() > 1:
        replicate_ranks = dist.get_process_group_ranks(groups.replicate_group)
        sources = [r for r in replicate_ranks if r in _src_row(env, src)]
        if len(sources) != 1:
            raise MaterializationError(
                f"Cannot find the member of replicate group {replicate_ranks} that shares a "
                f"shard group with rank {src}; pass groups that form a (replicate, shard) grid."
            )
        _broadcast_into(buffer, groups.replicate_group, replicate_ranks.index(sources[0]))
    return buffer.numel() * buffer.element_size() if env.rank != src else 0


def _src_row(env: Environment, src: int) -> list[int]:
    """The global ranks of ``src``'s shard group, from the build's mesh."""
    mesh = mesh_for(env)
    layout = mesh.mesh if mesh.ndim == 2 else mesh.mesh.view(1, -1)
    for row in layout.tolist():
        if src in row:
            return [int(r) for r in row]
    raise MaterializationError(f"Rank {src} is not in the build's mesh {layout.tolist()}.")


def scatter_unit_state(
    unit: Unit,
    env: Environment,
    full_state: Mapping[str, torch.Tensor] | None,
    src: int = 0,
) -> int:
    """Fill one ``fully_shard``-ed unit's own parameters and buffers from ``full_state``, which
    global rank ``src`` holds (other ranks pass None). Collective over the unit's mesh.

    Each parameter: ``src`` scatters padded slices over its shard group (every rank receives
    only its slice); under hybrid sharding every member of that first replica then broadcasts
    its slice over its replicate group. Buffers (replicated) are broadcast the same two-stage
    way. Local storage is allocated here if the unit is still on meta. A missing or misshapen
    entry is reported by ``src`` only after it joined every collective (zeros are sent in its
    place), so no rank is left waiting. Returns the bytes received on this rank.
    """
    modules = unit_modules(unit.module, env.ignored.modules)
    allocate_empty(modules, env.device)
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
    received = 0
    layouts: dict[tuple[int, tuple[Any, ...]], _Layout] = {}
    params: list[tuple[DTensor, _Layout, torch.Tensor | None]] = []
    with torch.no_grad():
        for info in unit.params:
            param = unit.module.get_parameter(_relative(unit, info.name))
            if not isinstance(param, DTensor):
                raise MaterializationError(
                    f"'{info.name}' is not a DTensor: scatter_unit_state fills units sharded "
                    "by fully_shard (FullyShardBuilder)."
                )
            key = (id(param.device_mesh), tuple(param.placements))
            layout = layouts.get(key)
            if layout is None:
                layout = layouts[key] = _layout(param, src)
            params.append((param, layout, source(info.name, info.shape, info.dtype)))
        received += _scatter_params(params, is_src)
        for info in unit.buffers:
            rel = _relative(unit, info.name)
            owner_name, _, leaf = rel.rpartition(".")
            owner = unit.module.get_submodule(owner_name) if owner_name else unit.module
            if leaf in owner._non_persistent_buffers_set:
                continue  # not in any state dict; its module's initializer owns it
            buffer = unit.module.get_buffer(rel)
            received += _broadcast_buffer(
                buffer, source(info.name, info.shape, info.dtype), env, src
            )
    if problems:
        raise MaterializationError(
            f"The state dict on rank {src} does not fit unit '{unit.label}': "
            f"{'; '.join(problems)}. Pass the state dict of this model (same names and shapes)."
        )
    log.debug("scatter_unit_state", unit=unit.label, rank=env.rank, received=received)
    return received


__all__ = [
    "ShardFirstReset",
    "local_bytes",
    "scatter_unit_state",
    "shard_index",
    "shard_seed",
]
