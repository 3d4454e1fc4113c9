"""The builders: fluent configuration, then ``build(model)`` runs the init pipeline.

Data flow: resolve the environment locally → ranks agree → create groups → for each unit,
bottom-up: materialize → move → synchronize → shard → the wrapper the user trains with.

Builders are single-use: ``build`` may be called once (the environment and report belong to that
build); ``clone()`` gives an unbuilt builder with the same configuration. Each configuration call
may be made once; a second call for the same role or option is an error, so a typo never silently
overrides an earlier choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeVar

import attrs
import structlog
import torch
import torch.distributed as dist
from attrs import define, frozen
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

from fsdp_builder.agreement import agree
from fsdp_builder.backends import Backend
from fsdp_builder.backends.fsdp1 import FSDP1Backend
from fsdp_builder.backends.fsdp2 import FullyShardBackend
from fsdp_builder.config import ShardingOptions
from fsdp_builder.devices import (
    DeviceResolver,
    ExplicitDevice,
    InferredDevice,
    check_compute_device,
    check_single_device,
)
from fsdp_builder.environment import Environment, effective_strategy
from fsdp_builder.errors import ConfigurationError, FSDPBuilderError, config_error
from fsdp_builder.groups import DefaultGroups, GivenGroup, GroupFactory, HybridGroups, MeshGroups
from fsdp_builder.ignored import (
    IgnoredStates,
    buffer_dtypes,
    managed_params,
    resolve_ignored,
    validate_ignore_arguments,
)
from fsdp_builder.materializers import Materializer, ResetParameters
from fsdp_builder.moving import move_unit_states
from fsdp_builder.plan import Unit, UnitPlan, fingerprint_of, plan_units
from fsdp_builder.report import BuildReport
from fsdp_builder.synchronizers import Chain, NoSync, StateSynchronizer
from fsdp_builder.wrap import WrapPolicy

log = structlog.get_logger(__name__)

B = TypeVar("B", bound="ShardingBuilder")
T = TypeVar("T")


def _require(where: str, value: Any, protocol: type, fix: str) -> None:
    if not isinstance(value, protocol):
        raise config_error(
            f"ShardingBuilder.{where}",
            where,
            f"{type(value).__name__} does not implement {protocol.__name__}",
            fix,
        )


def _as_group_factory(value: Any) -> GroupFactory:
    if isinstance(value, DeviceMesh):
        return MeshGroups(value)
    if isinstance(value, dist.ProcessGroup):
        return GivenGroup(value)
    if isinstance(value, tuple):
        if len(value) != 2:
            raise config_error(
                "ShardingBuilder.groups",
                "groups",
                f"a tuple of {len(value)} items was given",
                "Pass (shard_group, replicate_group) for hybrid sharding.",
            )
        return HybridGroups(*value)
    _require(
        "groups",
        value,
        GroupFactory,
        "Pass a GroupFactory, a ProcessGroup, a DeviceMesh or a (shard, replicate) tuple.",
    )
    return value


@frozen
class BuilderConfig:
    """Everything configured on a builder; None means 'the default'."""

    device: DeviceResolver | None = None
    groups: GroupFactory | None = None
    materializer: Materializer | None = None
    synchronizer: StateSynchronizer | None = None
    wrap: WrapPolicy | None = None
    ignored_modules: tuple[nn.Module, ...] | None = None
    ignored_states: tuple[Any, ...] | None = None
    options: ShardingOptions = attrs.field(factory=ShardingOptions)


@define
class BuildResult:
    """What one build produced on this rank."""

    environment: Environment
    report: BuildReport
    module: nn.Module


class ShardingBuilder:
    """Fluent configuration shared by every backend; subclasses choose the backend."""

    backend_name = "abstract"

    def __init__(self) -> None:
        self._config = BuilderConfig()
        self._result: BuildResult | None = None

    # -- configuration -------------------------------------------------------------------

    def _set(self: B, field: str, value: Any) -> B:
        if getattr(self._config, field) is not None:
            raise ConfigurationError(
                f"`{type(self).__name__}.{field}` was already set to "
                f"{getattr(self._config, field)!r}. Each role is set once; use clone() and "
                "configure the copy to try another choice."
            )
        self._config = attrs.evolve(self._config, **{field: value})
        return self

    def _option(self: B, **changes: Any) -> B:
        again = sorted(set(changes) & self._config.options.explicit)
        if again:
            raise ConfigurationError(
                f"`{type(self).__name__}` option(s) {again} were already set. Each option is set "
                "once; use clone() and configure the copy to try another value."
            )
        self._config = attrs.evolve(self._config, options=self._config.options.set(**changes))
        return self

    def device(self: B, resolver: DeviceResolver | int | str | torch.device) -> B:
        """Which device this rank computes on (a DeviceResolver, or a device for ExplicitDevice)."""
        chosen = (
            ExplicitDevice(resolver) if isinstance(resolver, int | str | torch.device) else resolver
        )
        _require("device", chosen, DeviceResolver, "Pass a DeviceResolver or a device.")
        return self._set("device", chosen)

    def groups(
        self: B, factory: GroupFactory | dist.ProcessGroup | DeviceMesh | tuple[Any, ...]
    ) -> B:
        """Which groups shard (and replicate): a GroupFactory, a group, a mesh or a pair."""
        return self._set("groups", _as_group_factory(factory))

    def materialize(self: B, materializer: Materializer) -> B:
        """How meta states become real (default: ResetParameters())."""
        _require("materialize", materializer, Materializer, "Pass e.g. ResetParameters().")
        return self._set("materializer", materializer)

    def synchronize(self: B, *synchronizers: StateSynchronizer) -> B:
        """How ranks end with the same values; several run in order (default: NoSync())."""
        if not synchronizers:
            raise config_error(
                "ShardingBuilder.synchronize",
                "synchronizers",
                "none were given",
                "Pass at least one, e.g. BroadcastFromRank0().",
            )
        for s in synchronizers:
            _require("synchronize", s, StateSynchronizer, "Pass e.g. BroadcastFromRank0().")
        chosen = synchronizers[0] if len(synchronizers) == 1 else Chain(synchronizers)
        return self._set("synchronizer", chosen)

    def wrap(self: B, policy: Any) -> B:
        """Which modules become units: classes, a ``(module, fqn) -> bool`` or a torch policy."""
        return self._set("wrap", WrapPolicy.of(policy))

    def ignore(
        self: B, modules: Iterable[nn.Module] | None = None, states: Iterable[Any] | None = None
    ) -> B:
        """Leave modules (whole subtrees) or parameters out of sharding."""
        module_list, state_list = validate_ignore_arguments(modules, states)
        if self._config.ignored_modules is not None or self._config.ignored_states is not None:
            raise ConfigurationError(
                f"`{type(self).__name__}.ignore` was already called. Pass every ignored module "
                "or parameter in one call."
            )
        self._config = attrs.evolve(
            self._config,
            ignored_modules=tuple(module_list) if modules is not None else None,
            ignored_states=tuple(state_list) if states is not None else None,
        )
        return self

    def sharding(self: B, strategy: ShardingStrategy | str) -> B:
        """FULL_SHARD (default), SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD, or their short names."""
        return self._option(strategy=strategy)

    def mixed_precision(
        self: B,
        policy: MixedPrecision | None = None,
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
    ) -> B:
        """A torch MixedPrecision, or its dtypes as keywords."""
        if policy is not None and any(
            d is not None for d in (param_dtype, reduce_dtype, buffer_dtype)
        ):
            raise config_error(
                "ShardingBuilder.mixed_precision",
                "policy",
                "both a policy and keyword dtypes were given",
                "Pass either MixedPrecision(...) or the dtypes as keywords.",
            )
        if policy is None:
            policy = MixedPrecision(
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype
            )
        return self._option(mixed_precision=policy)

    def cpu_offload(self: B, offload: CPUOffload | bool = True) -> B:
        """Keep sharded parameters on the CPU between uses."""
        return self._option(cpu_offload=offload)

    def prefetch(
        self: B,
        backward: BackwardPrefetch | str | None = BackwardPrefetch.BACKWARD_PRE,
        forward: bool = False,
    ) -> B:
        """Backward prefetch mode (or None) and forward prefetch."""
        return self._option(backward_prefetch=backward, forward_prefetch=forward)

    def limit_all_gathers(self: B, enabled: bool = True) -> B:
        return self._option(limit_all_gathers=enabled)

    def use_orig_params(self: B, enabled: bool = True) -> B:
        return self._option(use_orig_params=enabled)

    def clone(self: B) -> B:
        """An unbuilt builder with the same configuration."""
        twin = type(self)()
        twin._config = self._config
        return twin

    @property
    def config(self) -> BuilderConfig:
        return self._config

    # -- results -------------------------------------------------------------------------

    def _built(self) -> BuildResult:
        if self._result is None:
            raise ConfigurationError(
                f"`{type(self).__name__}` has not built a model yet; call build(model) first."
            )
        return self._result

    @property
    def environment(self) -> Environment:
        return self._built().environment

    @property
    def report(self) -> BuildReport:
        return self._built().report

    @property
    def plan(self) -> UnitPlan:
        return self._built().environment.plan

    # -- building ------------------------------------------------------------------------

    def _backend(self) -> Backend:
        raise NotImplementedError

    def plan_for(self, model: nn.Module) -> UnitPlan:
        """The unit plan this builder would use for ``model``; needs no process group."""
        cfg = self._config
        ignored = resolve_ignored(model, cfg.ignored_modules, cfg.ignored_states)
        return plan_units(model, cfg.wrap or WrapPolicy(), ignored)

    def build(self, model: nn.Module) -> nn.Module:
        """Shard ``model``; every rank of the group calls this with the same model.

        Preconditions: the default process group is initialized; the model is an nn.Module.
        """
        if self._result is not None:
            raise ConfigurationError(
                f"`{type(self).__name__}.build` was already called; a builder builds once. Use "
                "builder.clone().build(other_model) for another model."
            )
        if not isinstance(model, nn.Module):
            raise config_error(
                f"{type(self).__name__}.build",
                "model",
                f"expected an nn.Module, got {type(model).__name__}",
                "Pass the model to shard.",
            )
        self._result = _Pipeline(self._config, self._backend()).run(model)
        return self._result.module


class FSDPBuilder(ShardingBuilder):
    """Builds ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1) models."""

    backend_name = "fsdp1"

    def _backend(self) -> Backend:
        return FSDP1Backend()


class FullyShardBuilder(ShardingBuilder):
    """Builds ``torch.distributed.fsdp.fully_shard`` (FSDP2) models; see
    ``fsdp_builder.backends.fsdp2`` for how each option maps and which ones are refused."""

    backend_name = "fsdp2"

    def _backend(self) -> Backend:
        return FullyShardBackend()


def _parent_slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            slots.setdefault(id(child), []).append((parent, name))
    return slots


class _Pipeline:
    """One run of the init pipeline; lives only inside ``build``."""

    def __init__(self, config: BuilderConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.factory = config.groups or DefaultGroups()
        self.group: dist.ProcessGroup | None = None
        # A local step's failure, held until the next agreement (see _step).
        self.pending: tuple[str, BaseException] | None = None

    def _local(self, stage: str, fn: Callable[[], T], unit: str | None = None) -> T:
        """Run a step, then agree on its outcome across ranks. A step that communicates must
        fail on every rank alike, or only after its last collective."""
        error: BaseException | None = None
        result: T | None = None
        try:
            result = fn()
        except Exception as exc:  # any rank's failure must reach every rank
            error = exc
        agree(stage, error, unit=unit, group=self.group)
        return result  # type: ignore[return-value]

    def _flush(self, unit: str) -> None:
        """Agree on the local steps run since the last agreement."""
        stage, error = self.pending or ("unit", None)
        self.pending = None
        agree(stage, error, unit=unit, group=self.group)

    def _step(self, stage: str, fn: Callable[[], T], unit: str, communicates: bool) -> T | None:
        """Run one per-unit step. A step that communicates is preceded by an agreement on the
        local steps before it; a local step only records its failure (and the rank skips its
        next local steps), so ranks agree once per unit unless a strategy communicates."""
        if communicates:
            self._flush(unit)
            return self._local(stage, fn, unit)
        if self.pending is not None:
            return None
        try:
            return fn()
        except Exception as exc:
            self.pending = (stage, exc)
            return None

    def run(self, model: nn.Module) -> BuildResult:
        started = time.perf_counter()
        cfg = self.config
        options = cfg.options
        resolver = cfg.device or InferredDevice()
        materializer = cfg.materializer or ResetParameters()
        synchronizer = cfg.synchronizer or NoSync()
        rank = dist.get_rank() if dist.is_initialized() else 0

        # Local resolution: pure, so a failure leaves the model untouched on every rank.
        prepared: tuple[Any, ...] | None = None
        description: Any = None
        error: BaseException | None = None
        try:
            self.factory.validate(options.strategy)
            self.backend.check(options)
            ignored = resolve_ignored(model, cfg.ignored_modules, cfg.ignored_states)
            plan = plan_units(model, cfg.wrap or WrapPolicy(), ignored)
            _check_ignored_real(model, ignored)
            managed = list(managed_params(model, ignored))
            check_single_device(managed, resolver.explicit)
            device = resolver.resolve(model, managed, rank)
            materializer.check(plan, ignored)
            description = plan.describe()
            prepared = (ignored, plan, device)
        except Exception as exc:
            error = exc
        self.group = self.factory.agreement_group()
        agree(
            "configure",
            error,
            group=self.group,
            fingerprint=fingerprint_of(description) if prepared else 0,
            description=description,
        )
        assert prepared is not None
        ignored, plan, device = prepared

        groups = self._local("groups", lambda: self.factory.create(options.strategy, device))
        options, groups = effective_strategy(options, groups)
        prepare_groups = getattr(self.backend, "prepare_groups", None)
        if callable(prepare_groups):
            # The backend's view of the groups (FSDP2: the mesh), resolved once per build.
            groups = self._local("groups", partial(prepare_groups, groups, options, device))
        env = Environment(
            rank=rank,
            world_size=dist.get_world_size(),
            groups=groups,
            device=device,
            options=options,
            ignored=ignored,
            plan=plan,
            backend=self.backend.name,
            agreement_group=self.group,
            buffer_dtypes=buffer_dtypes(model),
        )
        for strategy in (materializer, synchronizer):
            prepare: Callable[[Environment], object] | None = getattr(strategy, "prepare", None)
            if callable(prepare):
                self._local(f"prepare {type(strategy).__name__}", partial(prepare, env))
        report = BuildReport(
            rank=rank,
            world_size=env.world_size,
            backend=self.backend.name,
            strategy=options.strategy.name,
            device=str(device),
        )
        logger = log.bind(rank=rank, world_size=env.world_size)
        logger.debug(
            "build_start",
            backend=self.backend.name,
            strategy=options.strategy.name,
            units=len(plan),
            device=str(device),
            model_bytes=plan.nbytes,
        )
        slots = _parent_slots(model)
        result: nn.Module = model
        for unit in plan:
            result = self._unit(
                unit, env, report, logger.bind(unit=unit.label), slots, materializer, synchronizer
            )
        self._local("finish", lambda: _check_no_meta(result))
        logger.info(
            "build_done",
            seconds=round(report.total_seconds, 6),
            wall_seconds=round(time.perf_counter() - started, 6),
            units=len(plan),
            backend=self.backend.name,
            strategy=options.strategy.name,
        )
        return BuildResult(environment=env, report=report, module=result)

    def _unit(
        self,
        unit: Unit,
        env: Environment,
        report: BuildReport,
        logger: Any,
        slots: dict[int, list[tuple[nn.Module, str]]],
        materializer: Materializer,
        synchronizer: StateSynchronizer,
    ) -> nn.Module:
        shard_first = bool(getattr(materializer, "shard_first", False)) and bool(
            getattr(self.backend, "supports_shard_first", False)
        )

        def materialize_and_move() -> None:
            with report.measure("materialize", unit.label, env.device, logger) as m:
                m.bytes = materializer.materialize(unit, env)
            with report.measure("move", unit.label, env.device, logger) as m:
                m.bytes = move_unit_states(unit.module, env.ignored, env.device)
                check_compute_device(
                    managed_params(unit.module, env.ignored), env.device, unit.label, env.rank
                )

        def synchronize() -> None:
            with report.measure("synchronize", unit.label, env.device, logger) as m:
                m.comm_bytes = synchronizer.synchronize(unit, env)

        def shard() -> nn.Module:
            with report.measure("shard", unit.label, env.device, logger) as m:
                wrapped = self.backend.shard(unit, env)
                m.bytes = unit.param_bytes
            return wrapped

        # A strategy without `communicates = False` is assumed to communicate: it then runs
        # under its own agreement and must fail on every rank alike, or only after its last
        # collective.
        steps: list[tuple[str, Callable[[], Any], bool]] = [
            ("materialize", materialize_and_move, _communicates(materializer)),
            ("synchronize", synchronize, _communicates(synchronizer)),
            ("shard", shard, bool(getattr(self.backend, "shard_communicates", True))),
        ]
        if shard_first:
            # Shard the unit while it is still on meta, then give only the local shards values.
            steps = [steps[2], steps[0], steps[1]]
        outcomes = {stage: self._step(stage, fn, unit.label, comm) for stage, fn, comm in steps}
        self._flush(unit.label)
        wrapped = outcomes["shard"]
        assert isinstance(wrapped, nn.Module)  # every step ran: the agreement raised otherwise
        if wrapped is not unit.module:
            for parent, name in slots.get(id(unit.module), []):
                setattr(parent, name, wrapped)
        return wrapped


def _check_ignored_real(model: nn.Module, ignored: IgnoredStates) -> None:
    """Ignored states are never materialized: on meta they would be left so; say it now, while
    the model is untouched."""
    buffers = {id(b) for b in ignored.buffers}
    left = [n for n, p in model.named_parameters() if p in ignored.params and p.is_meta]
    left += [n for n, b in model.named_buffers() if id(b) in buffers and b.is_meta]
    if left:
        raise ConfigurationError(
            f"Ignored states are on the meta device: {', '.join(left[:8])}"
            f"{' ...' if len(left) > 8 else ''}. The builder leaves ignored states as they are: "
            "give them real values before build(), or stop ignoring them."
        )


def _communicates(strategy: object) -> bool:
    return bool(getattr(strategy, "communicates", True))


def _check_no_meta(model: nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise FSDPBuilderError(
            f"After the build these states are still on the meta device: {', '.join(left[:8])}"
            f"{' ...' if len(left) > 8 else ''}. They belong to ignored modules or a materializer "
            "skipped them: materialize them yourself or stop ignoring them."
        )
