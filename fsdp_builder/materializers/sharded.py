"""Shard-first initialization: a unit is sharded on meta and each rank fills only its shards.

Both shard-first initializers run as one :class:`ShardFirstRun` and differ in their
:class:`ShardFirstInit`. Seeding per shard index makes shards differ (plain ``reset_parameters``
on a CPU mesh repeats one shard), at the cost of values that depend on the world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
    initialize_modules,
    initializer_of,
    run_initializer,
    seed_generators,
)
from fsdp_builder.materializers.shard_writes import LandedWrites, LostWrite, writes_whole_tensors
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.collectives import collective_device
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.tree import (
    allocate_unit,
    direct_states,
    has_meta_states,
    local_tensor,
    needs_materialization,
)


def shard_seed(seed: int, shard_index: int, fqn: str) -> int:
    """A 63-bit seed for one module's shard: unrelated across shard indices and modules."""
    return digest63(f"{seed}/{shard_index}/{fqn}")


def shard_index(env: Environment) -> int:
    """This rank's index in the shard group; 0 when nothing is sharded (replicas draw alike)
    or units are materialized full (every rank draws the same unit and keeps its slice)."""
    if env.options.strategy == ShardingStrategy.NO_SHARD or not env.shard_first:
        return 0
    return env.groups.rank


def fork_devices(device: torch.device) -> list[torch.device]:
    """The accelerators whose generators ``torch.random.fork_rng`` saves for ``device``."""
    return [device] if device.type == "cuda" else []


def agree_on_seed(env: Environment, seed: int | None) -> int:
    """``seed``, or else the first rank's ``torch.initial_seed()``, shared over both groups."""
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
    """What a shard-first materializer adds to :class:`ShardFirstRun`: a per-unit scope and
    how one module is initialized."""

    def scope(self, unit: Unit, modules: list[nn.Module]) -> AbstractContextManager[object]:
        """Entered around one unit's initializers, storage already given."""

    def init_module(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        """Give ``module`` (now with local storage) its values."""

    def close(self) -> None:
        """Put back whatever the scopes kept; called after success or failure."""


def runs_torch_whole_only(modules: list[nn.Module], rules: dict[int, Lineage]) -> bool:
    """Whether every initializer ``modules`` run is one of torch's own that writes whole
    states (``shard_writes.WHOLE_TENSOR_INITIALIZERS``), with no subtree rule after it: such a
    unit needs no watch of its ops (``rules``: each module's lineage)."""
    for module in modules:
        lineage = rules.get(id(module), NO_LINEAGE)
        if lineage.rules or not writes_whole_tensors(initializer_of(module, lineage)):
            return False
    return True


@contextlib.contextmanager
def _watched(
    modules: list[nn.Module],
    inner: AbstractContextManager[object],
    rules: dict[int, Lineage] | None = None,
) -> Iterator[None]:
    """``inner``, and :class:`LandedWrites` when a module has a sharded parameter (FSDP2) and
    an initializer may write through a row: with ``rules`` (each module's lineage), not when
    only torch's own whole-tensor ones run."""
    watched = any(isinstance(p, DTensor) for m in modules for p in m._parameters.values()) and (
        rules is None or not runs_torch_whole_only(modules, rules)
    )
    with inner, LandedWrites() if watched else contextlib.nullcontext():
        yield


@define
class _PerShardSeed:
    """``ShardFirstReset``: each module under a seed from (base, shard index, name)."""

    base_seed: int
    index: int
    device: torch.device
    rules: dict[int, Lineage]
    # Torch's generators, saved once per build (as StreamInit does): each module seeds them
    # itself before its initializer, so the values do not depend on when they were saved.
    held: AbstractContextManager[object] | None = attrs.field(init=False, default=None)

    def scope(self, unit: Unit, modules: list[nn.Module]) -> AbstractContextManager[object]:
        if self.held is None:
            self.held = torch.random.fork_rng(devices=fork_devices(self.device))
            self.held.__enter__()
        return _watched(modules, contextlib.nullcontext(), self.rules)

    def init_module(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        seed_generators(shard_seed(self.base_seed, self.index, fqn), self.device)
        run_initializer(module, fqn, lineage)

    def close(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.__exit__(None, None, None)


@define
class ShardFirstRun:
    """One shard-first build: per unit, local storage, then ``init.init_module`` children first
    for modules that were on meta, then computed buffers. The unit may be whole (FSDP1)."""

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
        pending = {id(m) for m in modules if has_meta_states(m)}

        def init(module: nn.Module, fqn: str) -> None:
            lineage = self.rules.get(id(module), NO_LINEAGE)
            if initializer_of(module, lineage) is None:
                return  # buffers only: to_empty gave it storage
            # A library initializer may set a child's states from a stateless parent (GPT-2's
            # c_proj); a parent with only ignored states counts as one (CLIP's projections).
            library = lineage.library_init is not None and all(
                ignored.ignores(t) for t in direct_states(module)
            )
            if id(module) in pending or (
                library and any(id(m) in pending for m in module.modules())
            ):
                self.init.init_module(module, fqn, lineage)

        with settling_ignored(modules, ignored, env.device, env.device, env.plan.root.module):
            allocate_unit(env.sharded_root(unit), modules, env.device, env.shard_specs)
            with self.init.scope(unit, modules):
                initialize_modules(
                    unit.module, unit.fqn, modules, init, self.who, self.fix, unit.fqn_of
                )
        fill_buffers(modules, self.computed, env.device)
        return sum(local_tensor(t).nbytes for m in modules for t in direct_states(m))

    def close(self) -> None:
        self.computed = {}
        self.init.close()


@frozen
class ShardFirstReset(ResetParameters):
    """``reset_parameters()`` on the local shards only, under an RNG seeded from
    ``(seed, shard index, module name)``: shards differ, replicas agree.

    ``seed=None`` shares the first rank's ``torch.initial_seed()``. Initializers must draw
    element-wise; ones needing the whole tensor (``orthogonal_``) need ``DeterministicInit``.
    A write through one row or a slice of rows (``Embedding``'s padding row) lands on the shard
    that holds it; a write through a view of such a row is refused. Indexing a row of a sharded
    parameter gathers it (a collective): with ``builder.timeout(...)`` every unit's failures
    are agreed before the next unit, so a rank that failed earlier cannot leave the others
    waiting in such a gather.
    Random buffers differ across shards: add a synchronizer if a module has them.

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
        rules = lineages(model)
        return ShardFirstRun(
            env,
            buffers_to_compute(model, env.ignored),
            rules,
            _PerShardSeed(agree_on_seed(env, self.seed), shard_index(env), env.device, rules),
            "ShardFirstReset",
            "Its initializer may need the whole tensor; use DeterministicInit(seed) for this "
            "model.",
        )


@define
class _InitWeightsRun:
    """``InitWeights``' build: storage per unit, the model's initializer once at the root."""

    env: Environment
    base_seed: int
    method: str

    def materialize(self, unit: Unit) -> int:
        env = self.env
        modules = list(unit.modules)
        fresh = [m for m in modules if has_meta_states(m)]
        # In place, so that the ignored parameter stays the one fully_shard ignores.
        give_storage_in_place([p for _, _, p in ignored_slots(modules, env.ignored)], env.device)
        allocated = allocate_unit(env.sharded_root(unit), modules, env.device, env.shard_specs)
        with torch.no_grad():
            # Defined values until the root's initializer writes them.
            for module in fresh:
                for t in direct_states(module):
                    local_tensor(t).zero_()
        if unit.is_root:
            init = getattr(unit.module, self.method)
            kwargs = whole_model_kwargs(init, env.device)
            # Ignored modules are the user's: restored whatever the model's initializer writes.
            kept = [
                (t, t.detach().clone())
                for m in env.ignored.modules
                for t in direct_states(m)
                if not t.is_meta
            ]
            seed = shard_seed(self.base_seed, shard_index(env), self.method)
            with (
                torch.no_grad(),
                _watched(
                    list(unit.module.modules()),
                    torch.random.fork_rng(devices=fork_devices(env.device)),
                ),
            ):
                seed_generators(seed, env.device)
                try:
                    init(**kwargs)
                except LostWrite as exc:
                    raise MaterializationError(
                        f"`InitWeights`: the model's {self.method}() cannot run on local shards: "
                        f"{exc}. Write whole rows or slices of rows, or use StreamInit(seed) "
                        "or DeterministicInit(seed) for this model."
                    ) from exc
                for t, value in kept:
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
    """torchtitan's convention: every unit is sharded on meta and given local storage, then
    ``model.init_weights(buffer_device=device)`` (or ``method``) runs once on the local shards.
    FSDP2 only; takes no synchronizer (it would run before the initializer).

    Each rank draws under a seed from ``(seed, shard index)``: shards differ, replicas agree,
    values depend on the world size, not on whether the model starts on meta or real (every
    state is overwritten, so every unit is sharded first). Ignored modules keep their values.
    A write through one row or a slice of rows (``Embedding``'s padding row) lands on the shard
    that holds it.

    Raises:
        MaterializationError: in the configure stage, when the model has no ``method``; during
            the build, when it writes through a view of a row copy (the shard would miss it).
        ConfigurationError: in the configure stage, with a backend that cannot shard on meta
            (``FSDPBuilder``), or with a synchronizer that gives every rank rank 0's values.

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
    # Shard first or not at all: the whole model is initialized after the last unit.
    shard_first_only: ClassVar[bool] = True

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
    "runs_torch_whole_only",
    "shard_index",
    "shard_seed",
]
