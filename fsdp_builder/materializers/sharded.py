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
  sizes; for world-size-invariant weights use ``StreamInit`` (``streams.py``: shard-local too,
  from block-seeded streams) or ``DeterministicInit``, which materializes each unit in full and
  lets ``fully_shard`` slice it (one full unit at a time per rank).

Both shard-first initializers run as one :class:`ShardFirstRun`; what differs between them is
their :class:`ShardFirstInit` (the scope a unit initializes in, and how one module is).
- ``collectives.scatter_unit_state`` fills the local shards from full tensors held by one rank,
  which sends each rank only its slices; other ranks never hold a full tensor of a sharded
  parameter. ``FromStateDict`` uses it when the backend shards first.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import ClassVar, Protocol

import attrs
import torch
import torch.distributed as dist
from attrs import define, frozen
from torch import nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.tensor import DTensor
from typing_extensions import override

from fsdp_builder.common.hashing import digest63
from fsdp_builder.errors import MaterializationError, config_error
from fsdp_builder.materializers.buffers import Computed, fill_buffers, whole_model_kwargs
from fsdp_builder.materializers.conventions import NO_LINEAGE, Lineage, lineages
from fsdp_builder.materializers.ignored import (
    give_storage_in_place,
    has_meta_ignored,
    ignored_slots,
    settling_ignored,
)
from fsdp_builder.materializers.initializers import (
    BaseMaterializer,
    MaterializerRun,
    ResetParameters,
    buffers_to_compute,
    check_seed,
    initialize_children_first,
    initializer_of,
    run_initializer,
    seed_generators,
)
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.collectives import collective_device
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.tree import (
    allocate_unit,
    direct_states,
    has_meta_states,
    local_tensor,
    module_names,
    needs_materialization,
)


def shard_seed(seed: int, shard_index: int, fqn: str) -> int:
    """A 63-bit seed for one module's shard: unrelated across shard indices and modules."""
    return digest63(f"{seed}/{shard_index}/{fqn}")


def shard_index(env: Environment) -> int:
    """Which shard this rank holds: its rank in the shard group. 0 when nothing is sharded, so
    that replicas (hybrid or NO_SHARD) draw the same values, and when units are materialized
    full before sharding (FSDP1, or a synchronizer that sends rank 0's values): every rank then
    draws the same full unit and keeps its own slice, so a synchronizer sees one value."""
    if env.options.strategy == ShardingStrategy.NO_SHARD or not env.shards_first:
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
        for t in direct_states(m):
            local = local_tensor(t)
            total += local.numel() * local.element_size()
    return total


def fork_devices(device: torch.device) -> list[torch.device]:
    """The accelerators whose generators ``torch.random.fork_rng`` saves for ``device``."""
    return [device] if device.type == "cuda" else []


def agree_on_seed(env: Environment, seed: int | None) -> int:
    """The base seed every rank of the build uses: ``seed``, or else the first rank's
    ``torch.initial_seed()`` shared over the shard group, then over the replicate group."""
    base = seed if seed is not None else torch.initial_seed() % 2**63
    value = torch.tensor([base], dtype=torch.int64)
    for group in (env.groups.shard_group, env.groups.replicate_group):
        if group is None or group.size() == 1:
            continue
        buf = value.to(collective_device(group))
        dist.broadcast(buf, group=group, group_src=0)
        value = buf.cpu()
    return int(value.item())


class ShardFirstInit(Protocol):
    """What a shard-first materializer adds to :class:`ShardFirstRun`: the scope a unit's
    initializers run in (StreamInit's streamed ``torch.nn.init``), and how one module's
    initializer is run (under which seed)."""

    def scope(
        self, unit: Unit, modules: list[nn.Module], names: dict[int, str]
    ) -> AbstractContextManager[object]:
        """Entered around the initializers of one unit's ``modules`` (storage already given;
        ``names``: ``module_names(unit.module)``)."""
        ...

    def init_module(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        """Give ``module`` (on meta before this unit, now with local storage) its values."""
        ...

    def close(self) -> None:
        """The build is over (or failed): put back whatever the scopes kept for the build."""
        ...


def run_seeded(
    module: nn.Module, fqn: str, lineage: Lineage, seed: int, device: torch.device
) -> None:
    """The module's initializer under a generator seeded with ``seed`` (restored after)."""
    with torch.random.fork_rng(devices=fork_devices(device)):
        seed_generators(seed, device)
        run_initializer(module, fqn, lineage)


@define
class _PerShardSeed:
    """``ShardFirstReset``'s initialization: each module under a seed from the base seed, the
    shard index and its name."""

    base_seed: int
    index: int
    device: torch.device

    def scope(
        self, unit: Unit, modules: list[nn.Module], names: dict[int, str]
    ) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def init_module(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        run_seeded(module, fqn, lineage, shard_seed(self.base_seed, self.index, fqn), self.device)

    def close(self) -> None:
        pass


@define
class ShardFirstRun:
    """One build of a shard-first materializer: per unit, local storage for the unit's own
    modules, then, children first, ``init.init_module`` for each module that was on meta and
    has an initializer (inside ``init.scope``), then the computed non-persistent buffers. The
    unit may be sharded (FSDP2: DTensors whose local shards are the only storage) or whole
    (FSDP1, which cannot shard on meta)."""

    env: Environment
    computed: Computed
    rules: dict[int, Lineage]
    init: ShardFirstInit
    who: str
    fix: str

    def materialize(self, unit: Unit) -> int:
        env = self.env
        modules = list(unit.modules)
        ignored = env.ignored
        if not needs_materialization(modules, ignored) and not has_meta_ignored(modules, ignored):
            return 0
        # Only modules that were on meta are initialized; real ones keep their values.
        pending = {id(m) for m in modules if has_meta_states(m)}
        settling = settling_ignored(modules, ignored, env.device, env.device, env.plan.root.module)
        rules = self.rules

        def init(module: nn.Module, fqn: str) -> None:
            lineage = rules.get(id(module), NO_LINEAGE)
            if initializer_of(module, lineage) is None:
                return  # buffers only: to_empty gave it storage
            # A library's model-level initializer may set a child's states from a stateless
            # parent (GPT-2 scales c_proj from its attention block, T5 its q/k/v/o); a parent
            # whose own states are all ignored counts as one (CLIP sets its projections).
            library = lineage.library_init is not None and all(
                ignored.ignores(t) for t in direct_states(module)
            )
            if id(module) in pending or (
                library and any(id(m) in pending for m in module.modules())
            ):
                self.init.init_module(module, fqn, lineage)

        names = module_names(unit.module)  # one walk for the scope and the initializers
        with settling:
            allocate_unit(unit.module, modules, env.device, env.shard_specs)
            with self.init.scope(unit, modules, names):
                initialize_children_first(
                    unit.module, unit.fqn, modules, init, self.who, self.fix, names=names
                )
        fill_buffers(modules, self.computed, env.device)
        return _owned_bytes(modules)

    def close(self) -> None:
        self.computed = {}
        self.init.close()


@frozen
class ShardFirstReset(ResetParameters):
    """``reset_parameters()`` on the local shards only (shard-first), under an RNG seeded from
    ``(seed, shard index, module name)`` so shards differ and replicas agree.

    ``seed=None`` takes ``torch.initial_seed()`` of the first rank of each group (shared in
    ``prepare``). Initializers must draw element-wise (uniform, normal, Kaiming, Xavier,
    constants): ones that need the whole tensor at once (``orthogonal_``, ``eye_``) do not work
    on a shard; use ``DeterministicInit`` for those. With a backend that cannot shard first the
    same seeding applies to the full unit, of which each rank keeps its own slice.
    Random buffers would differ across shard indices: add a synchronizer if a module has them.

    Raises:
        ConfigurationError: ``seed`` is not an int in ``[0, 2**63)``.
        MaterializationError: in the configure stage, naming modules on meta without an
            initializer; during the build, an initializer that needs the whole tensor.

    Example:
        ```python
        FullyShardBuilder().wrap(Block).materialize(ShardFirstReset(seed=0)).build(model)
        ```
    """

    seed: int | None = attrs.field(default=None, validator=attrs.validators.optional(check_seed))
    shard_first: ClassVar[bool] = True

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        """Share the base seed over the build's groups (collective)."""
        model = env.plan.root.module
        computed = buffers_to_compute(model, env.ignored)
        return ShardFirstRun(
            env,
            computed,
            lineages(model),
            _PerShardSeed(agree_on_seed(env, self.seed), shard_index(env), env.device),
            "ShardFirstReset",
            "Its initializer may need the whole tensor; use DeterministicInit(seed) for this "
            "model.",
        )


@define
class _InitWeightsRun:
    """One build of ``InitWeights``: storage per unit as it comes, the model's initializer once
    at the root, when every unit has its local storage."""

    env: Environment
    base_seed: int
    method: str

    def materialize(self, unit: Unit) -> int:
        env = self.env
        modules = list(unit.modules)
        fresh = [m for m in modules if has_meta_states(m)]
        # In place, so that the ignored parameter stays the one fully_shard ignores.
        give_storage_in_place([p for _, _, p in ignored_slots(modules, env.ignored)], env.device)
        allocated = allocate_unit(unit.module, modules, env.device, env.shard_specs)
        with torch.no_grad():
            # Defined values until the root's initializer writes them (a synchronizer may look).
            for module in fresh:
                for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                    local = t.to_local() if isinstance(t, DTensor) else t
                    local.zero_()
        if unit.is_root:
            init = getattr(unit.module, self.method)
            kwargs = whole_model_kwargs(init, env.device)
            # Ignored modules are the user's and stay as they were (their states are real: one
            # on meta is refused in configure), whatever the model's initializer writes.
            kept = {
                id(t): (t, t.detach().clone())
                for m in env.ignored.modules
                for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
                if not t.is_meta
            }
            with (
                torch.no_grad(),
                torch.random.fork_rng(devices=fork_devices(env.device)),
            ):
                seed_generators(
                    shard_seed(self.base_seed, shard_index(env), self.method), env.device
                )
                init(**kwargs)
                for t, value in kept.values():
                    t.copy_(value)
        return allocated

    def close(self) -> None:
        return None


def _check_method(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise config_error(
            type(instance).__name__,
            attribute.name,
            f"expected the name of the model's initializer method, got {value!r}",
            "Pass e.g. InitWeights(method='init_weights').",
        )


@frozen
class InitWeights(BaseMaterializer):
    """torchtitan's convention: every unit is sharded on meta and given local storage, then the
    model's own whole-model initializer runs once, ``model.init_weights(buffer_device=device)``
    (``method`` names another), on the local shards (DTensors) of every unit, with the
    non-persistent buffers it computes. FSDP2 (``FullyShardBuilder``) only: FSDP1's flat
    parameters cannot be written through the model's modules.

    Shards differ across ranks: each rank draws under a seed from ``(seed, shard index)``, so
    the full weight is not one shard repeated (what plain ``fully_shard`` + ``init_weights``
    gives on a CPU mesh), and replicas of a shard (hybrid) agree. Like ``ShardFirstReset``, the
    values depend on the world size; for world-size-invariant weights use ``DeterministicInit``.
    It takes no synchronizer: those work unit by unit, before the initializer has run.
    States of ignored modules keep the values they had (the user's, as in plain FSDP), whatever
    the model's initializer writes into them.

    Raises:
        MaterializationError: in the configure stage, when the model has no ``method``.
        ConfigurationError: in the configure stage, with a backend that cannot shard on meta
            (``FSDPBuilder``), or with a synchronizer that gives every rank rank 0's values
            (they would have to be sent before sharding, when nothing is initialized yet).

    Example:
        ```python
        with torch.device("meta"):
            model = Transformer(model_args)  # torchtitan-style: init_weights(buffer_device)
        FullyShardBuilder().wrap(TransformerBlock).materialize(InitWeights(seed=0)).build(model)
        ```
    """

    method: str = attrs.field(default="init_weights", validator=_check_method)
    seed: int | None = attrs.field(default=None, validator=attrs.validators.optional(check_seed))
    communicates: ClassVar[bool] = False  # only prepare() communicates
    shard_first: ClassVar[bool] = True
    # The model's initializer runs once, after the last unit was sharded: no unit is ever full.
    needs_shard_first: ClassVar[bool] = True

    @override
    def check_context(self, context: ConfigureContext) -> None:
        if not context.backend.supports_shard_first:
            raise config_error(
                "InitWeights",
                "materializer",
                f"{context.backend.builder} cannot shard a unit on meta, so the model's "
                "initializer would write its flattened parameters",
                "Use FullyShardBuilder, or DeterministicInit(seed) / InitFn(fn) with "
                f"{context.backend.builder}.",
            )
        model = context.plan.root.module
        if not callable(getattr(model, self.method, None)):
            raise MaterializationError(
                f"`InitWeights` needs the model's whole-model initializer, but "
                f"{type(model).__name__} has no method `{self.method}`. Pass "
                "InitWeights(method=...) naming it, or use ResetParameters() / "
                "DeterministicInit(seed) for models initialized module by module."
            )

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        return _InitWeightsRun(env, agree_on_seed(env, self.seed), self.method)


__all__ = [
    "InitWeights",
    "ShardFirstInit",
    "ShardFirstReset",
    "ShardFirstRun",
    "local_bytes",
    "run_seeded",
    "shard_index",
    "shard_seed",
]
