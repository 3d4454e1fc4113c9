"""One build, stage by stage in data-flow order (see docs/architecture.md):

    configure ─► agree ─► groups ─► environment ─► prepare ─► per unit, bottom-up ─► finish

Configure is local and pure, so a failure there leaves the model untouched on every rank.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any, Final

import attrs
import torch.distributed as dist
from attrs import define, frozen
from torch import nn

from fsdp_builder.backends import Backend, capabilities, resolved_settings
from fsdp_builder.common.describe import describe_settings, listed
from fsdp_builder.common.hooks import check_role
from fsdp_builder.config import ShardingOptions
from fsdp_builder.devices import (
    DeviceResolver,
    InferredDevice,
    check_compute_device,
    check_single_device,
    checked_device,
)
from fsdp_builder.errors import ConfigurationError, FSDPBuilderError, MaterializationError
from fsdp_builder.groups import (
    DefaultGroups,
    GroupFactory,
    check_placed_on_other_dims,
    checked_groups,
    other_dim_groups,
)
from fsdp_builder.materializers.initializers import (
    BaseMaterializer,
    Materializer,
    MaterializerRun,
)
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.ignored import IgnoredStates, resolve_ignored
from fsdp_builder.planning.plan import Unit, UnitPlan, fingerprint_of, plan_model, plan_units
from fsdp_builder.planning.wrap import WrapPolicy
from fsdp_builder.runtime.agreement import Agreement
from fsdp_builder.runtime.collectives import GroupTimeouts
from fsdp_builder.runtime.environment import Environment, effective_strategy
from fsdp_builder.runtime.report import BuildReport, debug_enabled
from fsdp_builder.runtime.tree import has_meta_states, move_unit_states
from fsdp_builder.synchronizers import NoSync, StateSynchronizer, SyncRun, overwrites

UNIT_STEPS: Final = ("materialize", "synchronize", "shard")
SHARD_FIRST_STEPS: Final = ("shard", "materialize", "synchronize")


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
    # Seconds any one wait of the build may last (None: the process groups' own timeouts).
    timeout: float | None = None


@define
class BuildResult:
    """What one build produced on this rank."""

    environment: Environment
    report: BuildReport
    module: nn.Module


@frozen
class _Configured:
    """What the configure stage resolved, locally and without touching the model."""

    plan: UnitPlan
    ignored: IgnoredStates
    device: Any


@define
class _Runs:
    """The strategies' per-build runs."""

    materializer: MaterializerRun
    synchronizer: SyncRun

    def close(self) -> None:
        try:
            self.materializer.close()
        finally:
            self.synchronizer.close()


def plan_for(config: BuilderConfig, model: nn.Module) -> UnitPlan:
    """The unit plan ``config`` gives ``model``; needs no process group."""
    ignored = resolve_ignored(model, config.ignored_modules, config.ignored_states)
    return plan_units(model, config.wrap or WrapPolicy(), ignored)


def run_build(config: BuilderConfig, backend: Backend, model: nn.Module) -> BuildResult:
    """Shard ``model`` as ``config`` says; every rank of the build calls this together."""
    build = _Build(config, backend)
    # Python's cyclic collector paused, as torch's get/set_model_state_dict do: what a build
    # allocates lives on, and each full collection it set off would scan the whole heap.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return build.run(model)
    finally:
        build.bound.restore()
        if collecting:
            _resume_collector()


def _resume_collector() -> None:
    """Turn the collector back on without the young-generation pass that the next allocation
    would set off: what the build allocated lives on with the model, and that pass would scan
    every object of it once for nothing (3-12 % of a 400-unit build's CPU). ``freeze`` then
    ``unfreeze`` moves the young objects to the oldest generation, which full collections
    still scan, as they scan everything. Skipped where the process holds frozen objects of its
    own, which ``unfreeze`` would let go."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
    gc.enable()


class _Build:
    """One run of the pipeline; lives only inside ``run_build``."""

    def __init__(self, config: BuilderConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.factory = config.groups or DefaultGroups()
        self.resolver = config.device or InferredDevice()
        self.materializer = config.materializer or backend.default_materializer()
        self.synchronizer = config.synchronizer or NoSync()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.agreement = Agreement(None)
        self.shard_first = False  # decided in the groups stage
        self.bound = GroupTimeouts(config.timeout)

    def run(self, model: nn.Module) -> BuildResult:
        started = time.perf_counter()
        configured = self.configure(model)
        configured.plan.tie_declared()  # every rank agreed: the model may change from here
        options, groups = self.create_groups(configured)
        env = Environment(
            rank=self.rank,
            world_size=dist.get_world_size(),
            groups=groups,
            device=configured.device,
            options=options,
            ignored=configured.ignored,
            plan=configured.plan,
            agreement_group=self.agreement.group,
            shard_first=self.shard_first,
            # Optional on a shard-first materializer: smaller units are filled whole first.
            whole_below=getattr(self.materializer, "whole_below", 0),
            values_from_rank0=overwrites(self.synchronizer),
        )
        self.bound.add(groups.shard_group, groups.replicate_group)
        if groups.mesh is not None:
            self.bound.add(*(groups.mesh.get_group(d) for d in range(groups.mesh.ndim)))
            # The mesh's other dims (tensor parallelism): synchronizers broadcast and compare
            # over them too.
            self.bound.add(*other_dim_groups(groups.mesh))
        backend, strategy = self.backend.name, env.strategy.name
        report = BuildReport(env.rank, env.world_size, backend, strategy, str(env.device))
        env.logger.debug(
            "build_start",
            backend=backend,
            strategy=strategy,
            units=len(env.plan),
            device=str(env.device),
            mesh=None if groups.mesh is None else tuple(groups.mesh.shape),
            model_bytes=env.plan.nbytes,
        )
        runs = self.prepare(env)
        try:
            result = self.shard_units(model, env, runs, report)
        finally:
            runs.close()
        self.agreement.finish(lambda: _check_no_meta(result))
        env.logger.info(
            "build_done",
            seconds=round(report.total_seconds, 6),
            wall_seconds=round(time.perf_counter() - started, 6),
            units=len(env.plan),
            backend=backend,
            strategy=strategy,
        )
        return BuildResult(environment=env, report=report, module=result)

    def settings(self) -> list[tuple[str, str]]:
        """The whole configuration as ranks compare it."""
        from fsdp_builder.materializers.conventions import _REGISTERED, _SUBTREE_RULES
        from fsdp_builder.sources.model_rules import registered_rules
        from fsdp_builder.sources.registry import registered_formats

        cfg = self.config
        items: dict[str, Any] = {
            "backend": self.backend.name,
            **attrs.asdict(cfg, recurse=False, filter=lambda a, _: a.name != "options"),
            "device": self.resolver,
            "groups": self.factory,
            "materializer": self.materializer,
            "synchronizer": self.synchronizer,
            **attrs.asdict(cfg.options, recurse=False),
        }
        # Process-wide registries decide values too; named by the call that fills each, so a
        # difference names the call to make on every rank.
        items.update(
            register_initializer=dict(_REGISTERED),
            register_subtree_rule=dict(_SUBTREE_RULES),
            register_format=registered_formats(),
            register_checkpoint_rules=registered_rules(),
        )
        return describe_settings(items)

    def configure(self, model: nn.Module) -> _Configured:
        """Local checks and resolution, then the agreement on them and on the model."""
        cfg = self.config
        configured: _Configured | None = None
        description: Any = None
        error: BaseException | None = None
        try:
            self.backend.check(cfg.options)
            wrap = cfg.wrap or WrapPolicy()
            planned = plan_model(model, wrap, cfg.ignored_modules, cfg.ignored_states)
            plan, ignored, managed = planned.plan, planned.ignored, list(planned.managed)
            check_single_device(managed, self.resolver.explicit)
            device = checked_device(self.resolver, self.resolver.resolve(model, managed, self.rank))
            self.check_roles(
                ConfigureContext(
                    model=model,
                    plan=plan,
                    ignored=ignored,
                    options=cfg.options,
                    backend=capabilities(self.backend),
                    device=device,
                    world_size=dist.get_world_size() if dist.is_initialized() else 1,
                )
            )
            resolved = resolved_settings(self.backend, plan, cfg.options, device)
            description = {"config": self.settings() + resolved, "plan": plan.signature()}
            configured = _Configured(plan, ignored, device)
        except Exception as exc:
            error = exc
        self.agreement = Agreement(self.factory.agreement_group(), cfg.timeout)
        self.bound.add(self.agreement.group)
        self.agreement.agree(
            "configure",
            error,
            fingerprint=fingerprint_of(description) if configured else 0,
            description=description,
        )
        assert configured is not None  # agree raised on every rank otherwise
        return configured

    def check_roles(self, context: ConfigureContext) -> None:
        """Every role's local, pure check: the groups' first (whether they can serve the
        strategy at all), then the backend's (what torch would refuse), then the others'."""
        check_role(self.factory, context, former="validate")
        self.backend.check_context(context)
        check_role(self.resolver, context)
        check_role(self.synchronizer, context)
        check_role(self.materializer, context, former="check")
        # Last: each role's own refusal says more than how two of them combine. A synchronizer
        # works per unit, which a materializer writing the whole model after the last unit
        # cannot serve.
        if getattr(self.materializer, "shard_first_only", False) and not isinstance(
            self.synchronizer, NoSync
        ):
            name = type(self.materializer).__name__
            raise ConfigurationError(
                f"`{self.backend.builder}.synchronize` got `{type(self.synchronizer).__name__}`, "
                f"which works on each unit as it is built, but `{name}` initializes the whole "
                "model on local shards after the last unit is sharded, so there is nothing to "
                f"send or compare yet. Leave the synchronizer out ({name}'s replicas already "
                "agree), or use DeterministicInit(seed) with a synchronizer."
            )

    def create_groups(self, configured: _Configured) -> tuple[ShardingOptions, Any]:
        """The factory's groups, clamped to the world, as the backend sees them (one agreement,
        which also settles whether units are sharded first)."""

        def create() -> tuple[ShardingOptions, Any]:
            groups = checked_groups(
                self.factory, self.factory.create(self.config.options.strategy, configured.device)
            )
            options, groups = effective_strategy(self.config.options, groups)
            groups = self.backend.prepare_groups(
                groups, options, configured.device, configured.plan
            )
            # MeshGroups are checked in configure; this covers a factory of one's own.
            check_placed_on_other_dims(
                groups.mesh, configured.plan.root.module, f"{self.backend.builder}.groups"
            )
            return options, groups

        wanted = self.materializer.shard_first and self.backend.supports_shard_first
        # Units are sharded on meta before being filled only when no rank holds a real managed
        # state: else a synchronizer would lack full values, and initializers on DTensors on
        # some ranks only would run collectives on those alone.
        result, any_real = self.agreement.now_asking(
            "groups", create, flag=wanted and _holds_real_states(configured)
        )
        # A materializer that initializes the whole model after the last unit overwrites every
        # real state anyway; sharding its root first too makes its draws the same whether the
        # model starts on meta or real (else the root's full states would draw under the
        # sharded units' per-rank seeds, or every rank's shards alike).
        whole_model = getattr(self.materializer, "shard_first_only", False)
        self.shard_first = wanted and (whole_model or not any_real)
        return result

    def prepare(self, env: Environment) -> _Runs:
        """Each strategy's run, under one agreement: a prepare failing on one rank stops every
        rank before any unit is touched. Both prepares run even when the first fails (a prepare
        may communicate); a started run is closed if the other failed."""
        runs: list[Any] = []
        errors: list[BaseException] = []
        expected: list[tuple[Any, type]] = [
            (self.materializer, MaterializerRun),
            (self.synchronizer, SyncRun),
        ]
        for strategy, run_type in expected:
            try:
                runs.append(_checked_run(strategy, strategy.prepare(env), run_type))
            except Exception as exc:
                errors.append(exc)
        if errors:
            for run in runs:
                run.close()
        self.agreement.agree("prepare", errors[0] if errors else None)
        return _Runs(*runs)

    def shard_units(
        self, model: nn.Module, env: Environment, runs: _Runs, report: BuildReport
    ) -> nn.Module:
        """Every unit, bottom-up; a wrapper that replaces its module takes its parent slot
        before the parent is sharded.

        When every unit is sharded on meta, all are sharded before the first is filled, the
        order plain torch takes (``fully_shard`` on each block, then ``to_empty`` and the
        initializers): the same work costs less CPU than sharding and filling unit by unit
        (``per-unit.md``). Nothing holds memory until filled, and units are still filled
        bottom-up. Else each unit runs all its steps before the next."""
        units = list(env.plan)
        results: dict[int, nn.Module] = {}
        slots = _Slots(model)
        if all(env.shard_first_for(unit) for unit in units):
            for unit in units:
                self.run_steps(unit, env, runs, report, ("shard",), results)
                slots.replace(unit.module, results.get(id(unit), unit.module))
            self.settle(None)
            for unit in units:
                self.run_steps(unit, env, runs, report, ("materialize", "synchronize"), results)
                self.settle(unit.label)
        else:
            for unit in units:
                steps = SHARD_FIRST_STEPS if env.shard_first_for(unit) else UNIT_STEPS
                self.run_steps(unit, env, runs, report, steps, results)
                slots.replace(unit.module, results.get(id(unit), unit.module))
                self.settle(unit.label)
        root = units[-1]
        return results.get(id(root), root.module)

    def run_steps(
        self,
        unit: Unit,
        env: Environment,
        runs: _Runs,
        report: BuildReport,
        names: tuple[str, ...],
        results: dict[int, nn.Module],
    ) -> None:
        """``names`` of the unit's steps, in order; its sharded module lands in ``results``
        (skipped after a local failure on this rank, which the next agreement reports)."""
        # Stage events per unit: not built for a logger that drops debug events.
        logger = env.logger.bind(unit=unit.label) if debug_enabled(env.logger) else None

        def materialize() -> None:
            with report.measure("materialize", unit.label, env.device, logger) as m:
                m.bytes = runs.materializer.materialize(unit)
            with report.measure("move", unit.label, env.device, logger) as m:
                m.bytes = move_unit_states(unit, env.device)
                managed = [(s.is_param, s.tensor) for s in unit.states if not s.ignored]
                if any(t.is_meta for _, t in managed):
                    # Else FSDP1 would give them values of its own (reset_parameters) unsaid.
                    raise _left_on_meta(self.materializer, unit, env)
                params = [t for is_param, t in managed if is_param]
                check_compute_device(params, env.device, unit.label, env.rank)

        def synchronize() -> None:
            with report.measure("synchronize", unit.label, env.device, logger) as m:
                m.comm_bytes = runs.synchronizer.synchronize(unit)

        def shard() -> None:
            with report.measure("shard", unit.label, env.device, logger) as m:
                results[id(unit)] = self.backend.shard(unit, env)
                m.bytes = unit.param_bytes

        steps: dict[str, tuple[Callable[[], None], bool]] = {
            "materialize": (materialize, self.materializer.communicates),
            "synchronize": (synchronize, self.synchronizer.communicates),
            "shard": (shard, self.backend.shard_communicates),
        }
        for name in names:
            fn, communicates = steps[name]
            self.agreement.step(name, fn, unit.label, communicates)

    def settle(self, unit: str | None) -> None:
        """With a timeout, agree on the local steps so far, so that a dead or late peer is
        named at the unit where it stopped (one tiny all-gather); otherwise local steps agree
        once, at finish."""
        if self.config.timeout is not None:
            self.agreement.settle(unit)


class _Slots:
    """Where each module sits in the model, found on the first replacement: FSDP2 shards in
    place, and then nothing needs them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.slots: dict[int, list[tuple[nn.Module, str]]] | None = None

    def replace(self, module: nn.Module, by: nn.Module) -> None:
        """Put ``by`` in every slot of ``module`` (nothing when it is ``module``)."""
        if by is module:
            return
        if self.slots is None:
            self.slots = {}
            for parent in self.model.modules():
                for name, child in parent.named_children():
                    self.slots.setdefault(id(child), []).append((parent, name))
        for parent, name in self.slots.get(id(module), []):
            setattr(parent, name, by)


def _holds_real_states(configured: _Configured) -> bool:
    """Whether this rank holds a managed state that is not on meta."""
    return any(not s.ignored and not s.tensor.is_meta for u in configured.plan for s in u.states)


def _checked_run(strategy: object, run: Any, run_type: type) -> Any:
    if not isinstance(run, run_type):
        raise ConfigurationError(
            f"`{type(strategy).__name__}.prepare(env)` returned {type(run).__name__}, not a "
            f"{run_type.__name__}. Return an object with the {run_type.__name__} methods (the "
            "Base* classes' prepare returns one that calls your per-unit method)."
        )
    return run


def _left_on_meta(materializer: Materializer, unit: Unit, env: Environment) -> MaterializationError:
    left = [s.name for s in unit.states if not s.ignored and s.tensor.is_meta]
    fix = "fix its materialize()"
    if isinstance(materializer, BaseMaterializer) and type(materializer).wants is not (
        BaseMaterializer.wants
    ):
        # Only modules its `wants` visits (and those below them) are given storage.
        fix = (
            "its `wants` skipped their modules, and no module it visits is above them: let "
            "`wants` return True for them, or write them from an ancestor's init_module"
        )
    return MaterializationError(
        f"`{type(materializer).__name__}` left states of unit '{unit.label}' on the meta device "
        f"on rank {env.rank}: {listed(left)}. A "
        f"materializer gives every state of its unit storage and values: {fix}, "
        "or use a ready-made one such as ResetParameters()."
    )


def _check_no_meta(model: nn.Module) -> None:
    # Names only when something is left: naming walks FSDP1's name-cleaning overrides per unit.
    if not any(has_meta_states(m) for m in model.modules()):
        return
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise FSDPBuilderError(
            f"After the build these states are still on the meta device: {listed(left)}. "
            "They belong to ignored modules or a materializer "
            "skipped them: materialize them yourself or stop ignoring them."
        )
