"""The builders: fluent configuration, then ``build(model)`` runs ``fsdp_builder.pipeline``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from typing_extensions import override

from fsdp_builder.backends import Backend
from fsdp_builder.backends.fsdp1 import FSDP1Backend
from fsdp_builder.backends.fsdp2 import FullyShardBackend
from fsdp_builder.backends.registry import backend_named
from fsdp_builder.compiling import CompileSpec
from fsdp_builder.config import PerUnitFn, ShardingOptions, to_dtype
from fsdp_builder.devices import DeviceResolver, ExplicitDevice
from fsdp_builder.errors import ConfigurationError, config_error, require_bool
from fsdp_builder.groups import GivenGroup, GroupFactory, HybridGroups, MeshGroups
from fsdp_builder.materializers.initializers import Materializer
from fsdp_builder.pipeline import BuilderConfig, BuildResult, plan_for, run_build
from fsdp_builder.planning.ignored import validate_ignore_arguments
from fsdp_builder.planning.plan import UnitPlan
from fsdp_builder.planning.wrap import WrapPolicy, checkpoint_predicate
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.report import BuildReport
from fsdp_builder.synchronizers import Chain, StateSynchronizer

B = TypeVar("B", bound="ShardingBuilder")

# About 31 years: far beyond any wait, far below what timedelta and the groups' milliseconds hold.
_LONGEST_TIMEOUT = 1e9


def _require(where: str, value: Any, protocol: type, fix: str) -> None:
    """Refuse a class given for an instance, or an object lacking ``protocol``'s members."""
    if isinstance(value, type):
        raise config_error(
            f"ShardingBuilder.{where}",
            where,
            f"the class {value.__name__} was given where an instance is expected",
            f"Did you mean `{value.__name__}()`?",
        )
    if not isinstance(value, protocol):
        members = getattr(protocol, "__protocol_attrs__", None) or vars(protocol)
        missing = sorted(m for m in members if not m.startswith("_") and not hasattr(value, m))
        raise config_error(
            f"ShardingBuilder.{where}",
            where,
            f"{type(value).__name__} does not implement {protocol.__name__}"
            + (f" (it lacks {', '.join(missing)})" if missing else ""),
            fix,
        )


class ShardingBuilder:
    """Fluent configuration shared by every backend; subclasses choose the backend.

    Each role and option is set once, so a typo never silently overrides an earlier choice: a
    second call raises ConfigurationError (configure a ``clone()`` instead). A builder builds once.
    """

    def __init__(self) -> None:
        self._config = BuilderConfig()
        self._result: BuildResult | None = None

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
        """Which device this rank computes on: a DeviceResolver, or a device (ExplicitDevice).

        Raises:
            ConfigurationError: not a resolver or device; a CUDA device without CUDA.

        Example:
            ```python
            FSDPBuilder().device(LocalRankDevice())   # or .device("cuda:0"), .device(CPUDevice())
            ```
        """
        if isinstance(resolver, int | str | torch.device):
            resolver = ExplicitDevice(resolver)
        _require("device", resolver, DeviceResolver, "Pass a DeviceResolver or a device.")
        return self._set("device", resolver)

    def groups(
        self: B, factory: GroupFactory | dist.ProcessGroup | DeviceMesh | tuple[Any, ...]
    ) -> B:
        """Which groups shard (and replicate): a GroupFactory, a group, a mesh or a pair.

        Raises:
            ConfigurationError: not a factory, group, mesh or pair.

        Example:
            ```python
            FullyShardBuilder().groups(init_device_mesh("cuda", (2, 8))).sharding("hybrid")
            ```
        """
        if isinstance(factory, DeviceMesh):
            factory = MeshGroups(factory)
        elif isinstance(factory, dist.ProcessGroup):
            factory = GivenGroup(factory)
        elif isinstance(factory, tuple):
            if len(factory) != 2:
                raise config_error(
                    "ShardingBuilder.groups",
                    "groups",
                    f"a tuple of {len(factory)} items was given",
                    "Pass (shard_group, replicate_group) for hybrid sharding.",
                )
            factory = HybridGroups(*factory)
        _require(
            "groups",
            factory,
            GroupFactory,
            "Pass a GroupFactory, a ProcessGroup, a DeviceMesh or a (shard, replicate) tuple.",
        )
        return self._set("groups", factory)

    def materialize(self: B, materializer: Materializer) -> B:
        """How meta states become real (default: ``StreamInit()``; FSDPBuilder:
        ``ResetParameters()``).

        Raises:
            ConfigurationError: not a Materializer (the missing hooks are named).

        Example:
            ```python
            FSDPBuilder().materialize(DeterministicInit(seed=0))
            ```
        """
        _require("materialize", materializer, Materializer, "Pass e.g. ResetParameters().")
        return self._set("materializer", materializer)

    def synchronize(self: B, *synchronizers: StateSynchronizer) -> B:
        """How ranks end with the same values; several run in order (default: NoSync()).

        Raises:
            ConfigurationError: none given, or one is not a StateSynchronizer.

        Example:
            ```python
            FSDPBuilder().synchronize(BroadcastFromRank0(), VerifyReplicas())
            ```
        """
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

    def wrap(self: B, *policy: Any) -> B:
        """Which modules become units: module classes, a ``(module, fqn) -> bool``, a torch
        policy or ``NoSplitModules()`` (unset: a transformers model's ``_no_split_modules``).

        Raises:
            ConfigurationError: not module classes, a two-argument predicate or a torch policy;
                at build, classes the model has none of.

        Example:
            ```python
            FSDPBuilder().wrap(LlamaDecoderLayer, nn.Embedding)
            FSDPBuilder().wrap(lambda module, fqn: fqn.startswith("layers."))
            ```
        """
        return self._set("wrap", WrapPolicy.of(policy[0] if len(policy) == 1 else policy))

    def ignore(
        self: B, modules: Iterable[nn.Module] | None = None, states: Iterable[Any] | None = None
    ) -> B:
        """Leave modules (whole subtrees) or parameters unsharded, unmoved and unsynchronized,
        all in one call. Precondition: their states are real, or materialized with their module.

        Raises:
            ConfigurationError: both arguments; a mix of modules and parameters; a sharded wrapper.

        Example:
            ```python
            FSDPBuilder().ignore(modules=[model.frozen_encoder])
            ```
        """
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
        """FULL_SHARD (default), SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD, or their short names.

        Raises:
            ConfigurationError: not a strategy or a known name.

        Example:
            ```python
            FSDPBuilder().sharding("grad_op")   # or ShardingStrategy.SHARD_GRAD_OP
            ```
        """
        return self._option(strategy=strategy)

    def mixed_precision(
        self: B,
        policy: MixedPrecision | MixedPrecisionPolicy | None = None,
        *,
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        buffer_dtype: torch.dtype | str | None = None,
        output_dtype: torch.dtype | str | None = None,
        cast_forward_inputs: bool | None = None,
    ) -> B:
        """A MixedPrecision (FullyShardBuilder: also a MixedPrecisionPolicy), or its fields as
        keywords; dtypes may be names (``"bf16"``, ``"float32"``...).

        Raises:
            ConfigurationError: a policy and keywords together; a dtype that is not floating.

        Example:
            ```python
            FullyShardBuilder().mixed_precision(param_dtype="bf16", reduce_dtype=torch.float32)
            ```
        """
        if cast_forward_inputs is not None:
            require_bool(
                cast_forward_inputs, "ShardingBuilder.mixed_precision", "cast_forward_inputs"
            )
        keywords = {
            "param_dtype": to_dtype(param_dtype, "param_dtype"),
            "reduce_dtype": to_dtype(reduce_dtype, "reduce_dtype"),
            "buffer_dtype": to_dtype(buffer_dtype, "buffer_dtype"),
            "output_dtype": to_dtype(output_dtype, "output_dtype"),
            "cast_forward_inputs": cast_forward_inputs,
        }
        given = {k: v for k, v in keywords.items() if v is not None}
        if policy is not None and given:
            raise config_error(
                "ShardingBuilder.mixed_precision",
                "policy",
                "both a policy and keyword dtypes were given",
                "Pass either a policy object or the dtypes as keywords.",
            )
        if policy is None:
            policy = self._backend().keyword_mixed_precision(given)
        self._backend().check(ShardingOptions(mixed_precision=policy))
        return self._option(mixed_precision=policy)

    def cpu_offload(self: B, offload: CPUOffload | OffloadPolicy | bool = True) -> B:
        """Keep sharded parameters on the CPU between uses (FSDP2 also takes an OffloadPolicy).

        Raises:
            ConfigurationError: not a bool, a CPUOffload or an OffloadPolicy the backend takes.

        Example:
            ```python
            FullyShardBuilder().cpu_offload(CPUOffloadPolicy(pin_memory=True))
            ```
        """
        self._backend().check(ShardingOptions(cpu_offload=offload))
        return self._option(cpu_offload=offload)

    def per_unit(self: B, fn: PerUnitFn) -> B:
        """Per-unit overrides: ``fn(module, fqn)`` returns the backend's own arguments for that
        unit, or None. Precondition: ``fn`` is pure (it is called more than once).

        Raises:
            ConfigurationError: ``fn`` is not callable; at build, ``fn`` raising or returning
                arguments a unit cannot take.

        Example:
            ```python
            FullyShardBuilder().per_unit(lambda m, fqn: {"reshard_after_forward": fqn != "out"})
            ```
        """
        if not callable(fn):
            raise config_error(
                f"{type(self).__name__}.per_unit",
                "fn",
                f"expected a callable (module, fqn) -> dict | None, got {type(fn).__name__}",
                'Pass e.g. lambda module, fqn: {"reshard_after_forward": False} if ... else None.',
            )
        return self._option(per_unit=fn)

    def activation_checkpointing(self: B, policy: Any) -> B:
        """Wrap the outermost modules ``policy`` chooses (module classes or a ``(module, fqn) ->
        bool``) in torch's non-reentrant ``checkpoint_wrapper``; state-dict keys stay the same.

        Raises:
            ConfigurationError: not module classes or a ``(module, fqn)`` predicate; at build, a
                policy choosing no module.

        Example:
            ```python
            FullyShardBuilder().wrap(Block).activation_checkpointing(Block)
            ```
        """
        return self._option(activation_checkpointing=checkpoint_predicate(policy))

    def compile(self: B, per_unit: bool = True, **torch_compile_kwargs: Any) -> B:
        """``module.compile(**torch_compile_kwargs)`` in place: each unit below the root before
        it is sharded (``per_unit=True``), or the sharded root (``per_unit=False``).

        Raises:
            ConfigurationError: a keyword torch.compile does not take; ``mode`` with ``options``;
                at build, ``per_unit=True`` with no unit below the root.

        Example:
            ```python
            FullyShardBuilder().wrap(Block).compile(backend="inductor")
            ```
        """
        return self._option(compile=CompileSpec(per_unit, torch_compile_kwargs))

    def prefetch(
        self: B,
        backward: BackwardPrefetch | str | None = BackwardPrefetch.BACKWARD_PRE,
        forward: bool = False,
    ) -> B:
        """Backward prefetch mode (or None) and forward prefetch; FullyShardBuilder takes only
        BACKWARD_PRE and ``forward=False``.

        Raises:
            ConfigurationError: an unknown mode, or one the backend cannot honour.

        Example:
            ```python
            FSDPBuilder().prefetch(backward="backward_post", forward=True)
            ```
        """
        return self._option(backward_prefetch=backward, forward_prefetch=forward)

    def limit_all_gathers(self: B, enabled: bool = True) -> B:
        """FSDP1's ``limit_all_gathers`` (FSDP2 always limits them; False is refused there).

        Raises:
            ConfigurationError: not a bool; False on FullyShardBuilder.

        Example:
            ```python
            FSDPBuilder().limit_all_gathers(False)
            ```
        """
        return self._option(limit_all_gathers=enabled)

    def use_orig_params(self: B, enabled: bool = True) -> B:
        """FSDP1's ``use_orig_params`` (FSDP2 always keeps them; False is refused there).

        Raises:
            ConfigurationError: not a bool; False on FullyShardBuilder.

        Example:
            ```python
            FSDPBuilder().use_orig_params()  # needed by torch.compile, mixed requires_grad
            ```
        """
        return self._option(use_orig_params=enabled)

    def timeout(self: B, seconds: float) -> B:
        """Bound every wait of the build: a collective not done within ``seconds`` raises
        ``CommunicationError`` on every surviving rank (unset: the process groups' timeouts).

        Raises:
            ConfigurationError: not a positive, finite number of seconds.

        Example:
            ```python
            FSDPBuilder().timeout(120)
            ```
        """
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise config_error(
                "ShardingBuilder.timeout",
                "seconds",
                f"expected a positive number of seconds, got {seconds!r}",
                "Pass e.g. .timeout(120).",
            )
        if not seconds <= _LONGEST_TIMEOUT:
            # Process groups hold timeouts as integer milliseconds: infinity or a huge value
            # would overflow on every rank at the first bounded wait.
            raise config_error(
                "ShardingBuilder.timeout",
                "seconds",
                f"{seconds!r} is not a bound (at most {_LONGEST_TIMEOUT:.0e} seconds)",
                "For no bound, leave .timeout(...) out: the process groups' own timeouts then "
                "apply. Otherwise pass a finite number of seconds, e.g. .timeout(3600).",
            )
        return self._set("timeout", float(seconds))

    def clone(self: B) -> B:
        """An unbuilt builder with the same configuration.

        Example:
            ```python
            other = builder.clone().build(second_model)
            ```
        """
        twin = type(self)()
        twin._config = self._config
        return twin

    @property
    def config(self) -> BuilderConfig:
        return self._config

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
        return self.environment.plan

    def _backend(self) -> Backend:
        raise NotImplementedError

    def plan_for(self, model: nn.Module) -> UnitPlan:
        """The unit plan this builder would use for ``model``; needs no process group."""
        return plan_for(self._config, model)

    def build(self, model: nn.Module) -> nn.Module:
        """Shard ``model``; every rank of the group calls this with the same model.

        Precondition: the default process group is initialized.

        Raises:
            ConfigurationError: a bad configuration or model, on every rank before any collective,
                model untouched.
            RankDisagreementError: some ranks failed a step, or configured or built differently.
            CommunicationError: a peer died or did not arrive within ``timeout``.
            MaterializationError: a materializer could not give states values.
            StateMismatchError: ``VerifyReplicas`` found ranks holding different values.

        Example:
            ```python
            sharded = FSDPBuilder().wrap(Block).build(model)
            ```
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
        self._result = run_build(self._config, self._backend(), model)
        return self._result.module


class FSDPBuilder(ShardingBuilder):
    """Builds ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1) models."""

    @override
    def _backend(self) -> Backend:
        return FSDP1Backend()


class FullyShardBuilder(ShardingBuilder):
    """Builds ``torch.distributed.fsdp.fully_shard`` (FSDP2) models."""

    def reshard_after_forward(self: B, value: bool | int) -> B:
        """``fully_shard``'s ``reshard_after_forward`` for every unit, the root included: True,
        False, or the group size to reshard to (unset: it follows the strategy).

        Raises:
            ConfigurationError: not a bool or a positive int; one contradicting an explicit
                ``.sharding(...)``.

        Example:
            ```python
            FullyShardBuilder().reshard_after_forward(8)   # reshard to groups of 8 after forward
            ```
        """
        return self._option(reshard_after_forward=value)

    def shard_placement_fn(self: B, fn: Callable[[nn.Parameter], Any]) -> B:
        """``fully_shard``'s ``shard_placement_fn`` (a ``Shard(dim)`` or None per parameter).

        Raises:
            ConfigurationError: not callable; in build, before any unit is sharded, an answer
                ``fully_shard`` would refuse (a raise, not a ``Shard``, a dim the parameter
                lacks, an uneven split of a dim other than 0).

        Example:
            ```python
            FullyShardBuilder().shard_placement_fn(lambda p: Shard(1) if p.ndim > 1 else None)
            ```
        """
        return self._option(shard_placement_fn=fn)

    @override
    def _backend(self) -> Backend:
        return FullyShardBackend()


def builder_for(backend: str) -> ShardingBuilder:
    """A new builder for the backend called ``backend`` (``"fsdp1"``, ``"fsdp2"``)."""
    return _BUILDERS[backend_named(backend, "builder_for").name]()


_BUILDERS: dict[str, type[ShardingBuilder]] = {
    cls()._backend().name: cls for cls in (FSDPBuilder, FullyShardBuilder)
}
