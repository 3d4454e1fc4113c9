"""GroupFactory role: the process groups (or device mesh) that shard and replicate.

Hybrid layouts follow FSDP: shard inside a node (mesh dim 1), replicate across nodes (dim 0).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
import torch.distributed as dist
from attrs import frozen
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.tensor import DTensor
from typing_extensions import override

from fsdp_builder.common.hooks import DeclaredHooks, former_hook
from fsdp_builder.config import HYBRID_STRATEGIES
from fsdp_builder.errors import ConfigurationError, config_error
from fsdp_builder.planning.context import ConfigureContext


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor must live to travel on ``group``'s backend."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@frozen(eq=False)
class ProcessGroups:
    """The resolved groups of one build. ``rank``/``world_size`` are within the shard group."""

    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None = None
    mesh: DeviceMesh | None = None

    @property
    def rank(self) -> int:
        return self.shard_group.rank()

    @property
    def world_size(self) -> int:
        return self.shard_group.size()

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else self.replicate_group.size()

    @property
    def data_parallel_size(self) -> int:
        return self.world_size * self.replicate_size


def hybrid_layout(
    shard: dist.ProcessGroup, replicate: dist.ProcessGroup, where: str
) -> torch.Tensor:
    """The global ranks as a (replicate, shard) grid; refused unless the i-th ranks of every
    shard group form one replicate group. Collective over the replicate group."""
    rows: list[list[int] | None] = [None] * replicate.size()
    dist.all_gather_object(rows, dist.get_process_group_ranks(shard), group=replicate)
    layout = torch.tensor(rows, dtype=torch.int)
    column = layout[:, shard.rank()].tolist()
    if column != dist.get_process_group_ranks(replicate):
        raise config_error(
            where,
            "groups",
            f"the shard groups {layout.tolist()} and the replicate group "
            f"{dist.get_process_group_ranks(replicate)} do not form a grid",
            "Pass groups where the i-th ranks of every shard group form one replicate group.",
        )
    return layout


def _returned(value: object) -> str:
    """``value`` for a message: a container by its items' types (a group's repr is an address)."""
    if isinstance(value, tuple | list):
        items = ", ".join("None" if v is None else type(v).__name__ for v in value)
        return f"{type(value).__name__} ({items})"
    if value is None or isinstance(value, bool | int | float | str):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def checked_groups(factory: GroupFactory, returned: object) -> ProcessGroups:
    """What a factory's ``create`` returned, refused unless it is ProcessGroups of groups (and a
    mesh) whose data-parallel ranks are exactly the ranks that build together: fewer would
    leave replicas that never exchange gradients, more would count a rank twice. Local; the
    same on every rank for a factory that answers alike."""
    where = f"{type(factory).__name__}.create"
    if not isinstance(returned, ProcessGroups):
        raise ConfigurationError(
            f"`{where}` returned {_returned(returned)}, not ProcessGroups. Return "
            "ProcessGroups(shard_group=...) (and replicate_group=... for hybrid sharding, or "
            "mesh=... for a device mesh) from fsdp_builder.groups."
        )
    for name, expected in (
        ("shard_group", (dist.ProcessGroup,)),
        ("replicate_group", (dist.ProcessGroup, type(None))),
        ("mesh", (DeviceMesh, type(None))),
    ):
        value = getattr(returned, name)
        if not isinstance(value, expected):
            kinds = " or ".join("None" if k is type(None) else k.__name__ for k in expected)
            raise ConfigurationError(
                f"`{where}` returned ProcessGroups with {name}={_returned(value)}, not {kinds}. "
                "Create groups with torch.distributed.new_group(...) and meshes with "
                "init_device_mesh(...)."
            )
    mesh = returned.mesh
    if not dist.is_initialized() or (mesh is not None and _root_mesh(mesh) is not mesh):
        # A data-parallel slice next to other dims: check_placed_on_other_dims decides.
        return returned
    building = dist.get_world_size(factory.agreement_group())
    # With a mesh, the mesh is what FSDP shards over (its dims are the backend's to check).
    spanned = returned.data_parallel_size if mesh is None else mesh.size()
    if spanned != building:
        replicate = (
            ""
            if returned.replicate_group is None
            else f" and a replicate group of {returned.replicate_size} rank(s)"
        )
        what = (
            f"a shard group of {returned.world_size} rank(s){replicate}, which span"
            if mesh is None
            else f"a mesh ({describe_mesh(mesh)}) of"
        )
        effect = (
            "the replicas on the other ranks would never exchange gradients"
            if spanned < building
            else "they do not form a (replicate, shard) grid of those ranks, so a rank would "
            "take more than one place in it"
        )
        raise ConfigurationError(
            f"`{where}` returned {what} {spanned} data-parallel rank(s), but {building} ranks "
            f"build together (its agreement group): {effect}. Return groups whose shard size "
            "times replicate "
            "size is the number of ranks that build (for hybrid sharding, a grid: shard groups "
            "of one node each and replicate groups across them), or return the smaller group "
            "from agreement_group() too, so only its ranks build together."
        )
    return returned


@runtime_checkable
class GroupFactory(Protocol):
    """Creates the groups for a strategy; ``create`` may communicate. A factory may also define
    the check hook every role has, ``check_context(context)``: local, before any collective,
    raising a ConfigurationError if it cannot serve ``context.options.strategy`` (or the model).
    A ``validate(strategy)`` of an earlier release is still called after it, with a
    DeprecationWarning."""

    def agreement_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks build together (None: the default group)."""

    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        """Return the groups; every rank of the agreement group calls this together."""


class BaseGroupFactory(DeclaredHooks):
    """Optional base for custom factories: accepts every strategy, agrees on the default group.
    The ready-made factories refuse a strategy they cannot serve in ``_serves``, which
    ``check_context`` runs."""

    __slots__ = ()

    def check_context(self, context: ConfigureContext) -> None:
        self._serves(context.options.strategy)

    def _serves(self, strategy: ShardingStrategy) -> None:
        return None

    @former_hook
    def validate(self, strategy: ShardingStrategy) -> None:
        """Deprecated: the builder calls ``check_context(context)``; this runs its strategy
        check alone."""
        warnings.warn(
            f"`{type(self).__name__}.validate(strategy)` is deprecated: the builder calls "
            "`check_context(context)` (the strategy is `context.options.strategy`).",
            DeprecationWarning,
            stacklevel=2,
        )
        self._serves(strategy)

    def agreement_group(self) -> dist.ProcessGroup | None:
        return None

    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        raise NotImplementedError


def _require_initialized(where: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigurationError(
            f"`{where}` needs an initialized default process group. Call "
            "torch.distributed.init_process_group(...) (or launch with torchrun) before build()."
        )


def _check_group(where: str, argument: str, value: object) -> None:
    if not isinstance(value, dist.ProcessGroup):
        raise config_error(
            where,
            argument,
            f"expected a torch.distributed.ProcessGroup, got {type(value).__name__}",
            "Create it with torch.distributed.new_group(...).",
        )


@frozen
class AutoHybridGroups(BaseGroupFactory):
    """Hybrid groups: shard within a node, replicate across nodes. ``devices_per_node``
    defaults to the CUDA device count, else ``LOCAL_WORLD_SIZE``.

    Raises:
        ConfigurationError: a node size that is not positive, does not divide the world or
            differs between ranks; a strategy that is not hybrid.

    Example:
        ```python
        FSDPBuilder().sharding("hybrid").groups(AutoHybridGroups(devices_per_node=8))
        ```
    """

    devices_per_node: int | None = attrs.field(default=None)

    @devices_per_node.validator
    def _check(self, _attr: object, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise config_error(
                "AutoHybridGroups",
                "devices_per_node",
                f"expected a positive int, got {value!r}",
                "Pass the number of ranks per node, e.g. 8.",
            )

    def resolved_devices_per_node(self) -> int:
        if self.devices_per_node is not None:
            return self.devices_per_node
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
        raw = os.environ.get("LOCAL_WORLD_SIZE", "")
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
        raise config_error(
            "AutoHybridGroups",
            "devices_per_node",
            "it was not given and neither CUDA nor LOCAL_WORLD_SIZE tells it",
            "Pass AutoHybridGroups(devices_per_node=N).",
        )

    @override
    def _serves(self, strategy: ShardingStrategy) -> None:
        if strategy not in HYBRID_STRATEGIES:
            raise config_error(
                "AutoHybridGroups",
                "strategy",
                f"{strategy.name} does not replicate, so hybrid groups do not apply",
                "Use HYBRID_SHARD, or DefaultGroups() for other strategies.",
            )
        _require_initialized("AutoHybridGroups")
        per_node = self.resolved_devices_per_node()
        world = dist.get_world_size()
        if world % per_node != 0:
            raise config_error(
                "AutoHybridGroups",
                "devices_per_node",
                f"world size {world} is not a multiple of {per_node} devices per node",
                "Pass a devices_per_node that divides the world size.",
            )

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        per_node = self.resolved_devices_per_node()
        world = dist.get_world_size()
        # Ranks that see different node sizes would create different groups and hang: compare
        # first, and refuse on every rank alike.
        mine = torch.tensor([per_node], dtype=torch.int64, device=collective_device(None))
        seen = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(seen, mine)
        sizes = sorted({int(t) for t in seen})
        if len(sizes) > 1:
            raise config_error(
                "AutoHybridGroups",
                "devices_per_node",
                f"ranks resolved different devices per node {sizes}",
                "Pass AutoHybridGroups(devices_per_node=N) explicitly on every rank.",
            )
        # Every rank must create every group, in the same order, even the ones it is not in.
        shards = [
            dist.new_group(ranks=list(range(n * per_node, (n + 1) * per_node)))
            for n in range(world // per_node)
        ]
        replicas = [dist.new_group(ranks=list(range(i, world, per_node))) for i in range(per_node)]
        rank = dist.get_rank()
        return ProcessGroups(shards[rank // per_node], replicas[rank % per_node])


@frozen
class DefaultGroups(BaseGroupFactory):
    """Shard over the default (world) group; hybrid strategies get automatic node groups.

    Example:
        ```python
        FSDPBuilder().groups(DefaultGroups())  # the default when .groups() is not called
        ```
    """

    @override
    def _serves(self, strategy: ShardingStrategy) -> None:
        _require_initialized("DefaultGroups")
        if strategy in HYBRID_STRATEGIES:
            AutoHybridGroups()._serves(strategy)

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        if strategy in HYBRID_STRATEGIES:
            return AutoHybridGroups().create(strategy, device)
        return ProcessGroups(shard_group=dist.group.WORLD)  # type: ignore[arg-type]


@frozen(eq=False)
class GivenGroup(BaseGroupFactory):
    """Shard over one given process group (not for hybrid strategies).

    Raises:
        ConfigurationError: not a ProcessGroup; a hybrid strategy.

    Example:
        ```python
        group = dist.new_group(ranks=[0, 1, 2, 3])
        FSDPBuilder().groups(group)  # the same as .groups(GivenGroup(group))
        ```
    """

    group: dist.ProcessGroup

    def __attrs_post_init__(self) -> None:
        _check_group("GivenGroup", "group", self.group)

    @override
    def _serves(self, strategy: ShardingStrategy) -> None:
        if strategy in HYBRID_STRATEGIES:
            raise config_error(
                "GivenGroup",
                "group",
                f"{strategy.name} needs a shard group and a replicate group, not one group",
                "Use HybridGroups(shard_group=..., replicate_group=...) or MeshGroups(2-D mesh).",
            )

    @override
    def agreement_group(self) -> dist.ProcessGroup | None:
        return self.group

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        return ProcessGroups(shard_group=self.group)


@frozen(eq=False)
class HybridGroups(BaseGroupFactory):
    """A (shard group, replicate group) pair for hybrid strategies, together covering the world.

    Example:
        ```python
        FSDPBuilder().sharding("hybrid").groups((shard_group, replicate_group))
        ```
    """

    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup

    def __attrs_post_init__(self) -> None:
        _check_group("HybridGroups", "shard_group", self.shard_group)
        _check_group("HybridGroups", "replicate_group", self.replicate_group)

    @override
    def _serves(self, strategy: ShardingStrategy) -> None:
        if strategy not in HYBRID_STRATEGIES:
            raise config_error(
                "HybridGroups",
                "strategy",
                f"{strategy.name} shards over one group, but a (shard, replicate) pair was given",
                "Use .sharding('hybrid'), or GivenGroup(group) for other strategies.",
            )
        _require_initialized("HybridGroups")
        covered = self.shard_group.size() * self.replicate_group.size()
        if covered != dist.get_world_size():
            raise config_error(
                "HybridGroups",
                "shard_group",
                f"the groups span {self.shard_group.size()} x {self.replicate_group.size()} = "
                f"{covered} ranks but the world has {dist.get_world_size()}",
                "Pass a shard group and a replicate group that together cover every rank that "
                "builds the model.",
            )

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        return ProcessGroups(shard_group=self.shard_group, replicate_group=self.replicate_group)


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from, else ``mesh``; the one reader of torch's private name."""
    return mesh._get_root_mesh()


def describe_mesh(mesh: DeviceMesh) -> str:
    """Which dims a mesh uses, and of what, for messages (``dims ('dp',) (2,) of ...``)."""
    names = mesh.mesh_dim_names
    shape = tuple(mesh.shape)
    root = _root_mesh(mesh)
    own = f"dims {names} {shape}" if names else f"a {mesh.ndim}-D mesh {shape}"
    if root is mesh:
        return own
    return f"{own} of the {root.mesh_dim_names} mesh {tuple(root.shape)}"


def other_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The root mesh's dims that ``mesh`` does not use (e.g. ``('tp',)``)."""
    root = _root_mesh(mesh)
    if root is mesh or not root.mesh_dim_names:
        return ()
    mine = set(mesh.mesh_dim_names or ())
    return tuple(name for name in root.mesh_dim_names if name not in mine)


def other_dim_groups(mesh: DeviceMesh | None) -> list[dist.ProcessGroup]:
    """This rank's groups along the root mesh's dims that ``mesh`` does not use (e.g. TP)."""
    if mesh is None:
        return []
    root = _root_mesh(mesh)
    return [root.get_group(name) for name in other_dims(mesh)]


def check_mesh_ndim(mesh: DeviceMesh, where: str) -> None:
    """FSDP shards over a 1-D mesh, or a 2-D (replicate, shard) one for hybrid sharding."""
    if mesh.ndim not in (1, 2):
        raise config_error(
            where,
            "mesh",
            f"a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} cannot be used "
            f"({describe_mesh(mesh)}): FSDP shards over 1 or 2 dims",
            "Pass a 1-D mesh, or a 2-D (replicate, shard) mesh for hybrid sharding; slice "
            "the data-parallel dimensions off first (e.g. mesh['dp'], or "
            "mesh['dp_replicate', 'dp_shard'] for hybrid sharding next to tensor parallelism).",
        )


def check_mesh(mesh: DeviceMesh, strategy: ShardingStrategy, where: str) -> None:
    """2-D for hybrid, else 1-D; spanning the world, or sliced from a mesh that does."""
    check_mesh_ndim(mesh, where)
    hybrid = strategy in HYBRID_STRATEGIES
    used = describe_mesh(mesh)
    if hybrid and mesh.ndim != 2:
        raise config_error(
            where,
            "mesh",
            f"{strategy.name} needs a 2-D (replicate, shard) mesh, got {used}",
            "Create it with init_device_mesh(device_type, (num_nodes, devices_per_node), "
            "mesh_dim_names=('replicate', 'shard')), or slice two dims off a larger mesh "
            "(mesh['dp_replicate', 'dp_shard']).",
        )
    if not hybrid and mesh.ndim != 1:
        raise config_error(
            where,
            "mesh",
            f"{strategy.name} shards over one dimension, got {used}",
            "Pass a 1-D mesh (e.g. mesh['dp']), or use .sharding('hybrid') with a 2-D mesh.",
        )
    world = dist.get_world_size()
    root = _root_mesh(mesh)
    if root is mesh and mesh.size() != world:
        raise config_error(
            where,
            "mesh",
            f"the mesh spans {mesh.size()} ranks but the world has {world} ({used})",
            "Create the mesh over every rank that builds the model, or pass the data-parallel "
            "dims sliced from such a mesh (e.g. mesh['dp'] of a ('dp', 'tp') mesh).",
        )
    if root is not mesh and root.size() != world:
        raise config_error(
            where,
            "mesh",
            f"FSDP would shard over {used}, which spans {root.size()} ranks but the world has "
            f"{world}",
            "Create the full mesh over every rank that builds the model.",
        )


def check_placed_on_other_dims(mesh: DeviceMesh | None, model: nn.Module, where: str) -> None:
    """A data-parallel slice that does not span the world needs parameters already placed on
    the other dims, else the ranks along them would each train their own copy. Local."""
    if mesh is None or _root_mesh(mesh) is mesh or mesh.size() == dist.get_world_size():
        return
    # By dim names, not by mesh identity: torch may hand out a cached slice of an equal
    # earlier mesh as ``mesh["tp"]``, so a parameter's mesh need not share FSDP's root object.
    others = set(other_dims(mesh))
    for param in model.parameters():
        if isinstance(param, DTensor):
            placed = set(param.device_mesh.mesh_dim_names or ())
            if placed and placed <= others:
                return
    raise config_error(
        where,
        "mesh",
        f"the mesh spans {mesh.size()} ranks but the world has {dist.get_world_size()} "
        f"({describe_mesh(mesh)}), and no parameter is placed on its other dims "
        f"{other_dims(mesh)}: the ranks along them would each train their own copy",
        f"Place the parameters on {other_dims(mesh)} first (parallelize_module(model, "
        "mesh['tp'], plan) before build()), or pass a mesh over every rank.",
    )


def _checked_dims(mesh: DeviceMesh, dims: Any) -> tuple[str, ...]:
    """``dims`` as a tuple of the mesh's dim names; the fix offered is one the mesh accepts."""
    names = tuple(mesh.mesh_dim_names or ())
    shape = tuple(mesh.shape)
    given = (dims,) if isinstance(dims, str) else dims
    if not isinstance(given, tuple | list) or not all(isinstance(d, str) for d in given):
        raise config_error(
            "MeshGroups",
            "dims",
            f"expected a dim name or a tuple of dim names, got {type(dims).__name__} {dims!r}",
            f"Pass names of the mesh's dims, e.g. dims=({(names or ('dp',))[0]!r},).",
        )
    given = tuple(given)
    if not names:
        raise config_error(
            "MeshGroups",
            "dims",
            f"the mesh {shape} has no dim names, so dims {given} cannot name its dims",
            "Create the mesh with names, e.g. init_device_mesh(..., "
            "mesh_dim_names=('dp', 'tp')), then pass dims=('dp',); or pass the data-parallel "
            "slice itself, MeshGroups(mesh[...]), without dims.",
        )
    missing = [d for d in given if d not in names]
    if not given or missing:
        problem = "no dims" if not given else f"{missing} are not dims of the mesh {names} {shape}"
        raise config_error(
            "MeshGroups",
            "dims",
            problem,
            f"Pass the data-parallel dims among {names}, e.g. dims=({names[0]!r},).",
        )
    return given


@frozen(eq=False)
class MeshGroups(BaseGroupFactory):
    """A device mesh: 1-D for sharding over one group; 2-D ``(replicate, shard)`` for hybrid.

    Next to tensor parallelism pass the data-parallel slice (``mesh["dp"]``, or
    ``MeshGroups(mesh, dims=("dp",))``); precondition: the parameters are already placed on the
    other dims. Every rank of the world still builds and agrees together.

    Raises:
        ConfigurationError: not a DeviceMesh; a mesh of the wrong dimension for the strategy; a
            mesh that does not span the world and is not such a slice.

    Example:
        ```python
        mesh = init_device_mesh("cuda", (2, 8), mesh_dim_names=("replicate", "shard"))
        FullyShardBuilder().sharding("hybrid").groups(mesh)
        ```
    """

    mesh: DeviceMesh
    dims: tuple[str, ...] | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise config_error(
                "MeshGroups",
                "mesh",
                f"expected a torch DeviceMesh, got {type(self.mesh).__name__}",
                "Create one with torch.distributed.device_mesh.init_device_mesh(...).",
            )
        if self.dims is not None:
            dims = _checked_dims(self.mesh, self.dims)
            object.__setattr__(self, "mesh", self.mesh[dims if len(dims) > 1 else dims[0]])
            object.__setattr__(self, "dims", dims)
        check_mesh_ndim(self.mesh, "MeshGroups")

    @override
    def _serves(self, strategy: ShardingStrategy) -> None:
        _require_initialized("MeshGroups")
        check_mesh(self.mesh, strategy, "MeshGroups")

    @override
    def check_context(self, context: ConfigureContext) -> None:
        super().check_context(context)
        check_placed_on_other_dims(self.mesh, context.model, "MeshGroups")

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        replicate = self.mesh.get_group(0) if self.mesh.ndim == 2 else None
        return ProcessGroups(self.mesh.get_group(self.mesh.ndim - 1), replicate, self.mesh)
