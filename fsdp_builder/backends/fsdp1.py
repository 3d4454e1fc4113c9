"""FSDP1 backend: each unit becomes a ``FullyShardedDataParallel``, with its per-unit overrides
as torch's auto-wrap gives them (build-wide arguments are refused per unit)."""

from __future__ import annotations

import difflib
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
from attrs import frozen
from torch import nn
from torch.distributed.fsdp import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

from fsdp_builder.backends.checks import (
    build_wide_error,
    called_overrides,
    check_composition,
    check_fsdp1_plan,
    check_per_unit,
    check_root_not_wrapped,
)
from fsdp_builder.backends.composing import after_shard, before_shard
from fsdp_builder.config import (
    HYBRID_STRATEGIES,
    ShardingOptions,
    to_backward_prefetch,
    to_cpu_offload,
    to_sharding_strategy,
)
from fsdp_builder.errors import ConfigurationError, config_error
from fsdp_builder.groups import ProcessGroups, hybrid_layout
from fsdp_builder.materializers.initializers import Materializer, ResetParameters
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.plan import Unit, UnitPlan
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.shards import chunk_size

_WHERE = "FSDPBuilder"


def _strict_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"expected True or False, got {type(value).__name__}")
    return value


_PER_UNIT: dict[str, Any] = {
    "sharding_strategy": to_sharding_strategy,
    "cpu_offload": to_cpu_offload,
    "backward_prefetch": to_backward_prefetch,
    "mixed_precision": lambda v: v,
    "forward_prefetch": _strict_bool,
    "limit_all_gathers": _strict_bool,
}
_BUILD_WIDE = {
    "process_group": "groups(...)",
    "device_mesh": "groups(...)",
    "device_id": "device(...)",
    "ignored_modules": "ignore(...)",
    "ignored_states": "ignore(...)",
    "param_init_fn": "materialize(InitFn(...))",
    "sync_module_states": "synchronize(BroadcastFromRank0())",
    "auto_wrap_policy": "wrap(...)",
    "use_orig_params": "use_orig_params(...)",
}


def check_fsdp2_only_options(options: ShardingOptions) -> None:
    """Refuse FSDP2's own option objects and options on an FSDP1 build."""
    if isinstance(options.mixed_precision, MixedPrecisionPolicy):
        raise config_error(
            f"{_WHERE}.mixed_precision",
            "policy",
            "MixedPrecisionPolicy is fully_shard's (FSDP2); FullyShardedDataParallel takes "
            "MixedPrecision, whose casting defaults differ",
            "Pass torch.distributed.fsdp.MixedPrecision(param_dtype=..., reduce_dtype=...), or "
            "use FullyShardBuilder.",
        )
    if isinstance(options.cpu_offload, OffloadPolicy):
        raise config_error(
            f"{_WHERE}.cpu_offload",
            "offload",
            f"{type(options.cpu_offload).__name__} is fully_shard's (FSDP2)",
            "Pass CPUOffload(offload_params=True) or True, or use FullyShardBuilder.",
        )
    for name, fix in (
        ("reshard_after_forward", "sharding('full') or sharding('grad_op')"),
        ("shard_placement_fn", "FullyShardBuilder"),
    ):
        if getattr(options, name) is not None:
            raise config_error(
                f"{_WHERE}.{name}",
                name,
                "FullyShardedDataParallel has no such argument",
                f"Use {fix}.",
            )


def check_fsdp1_offload(offload: Any, where: str, unit: str | None = None) -> None:
    """FSDP1's parameter offload moves shards between the CPU and an accelerator; without one
    the build succeeds and the first forward or state_dict raises torch's own error."""
    if not isinstance(offload, CPUOffload) or not offload.offload_params:
        return
    if torch.accelerator.is_available():
        return
    of_unit = "" if unit is None else f" for unit '{unit}'"
    raise config_error(
        where,
        "offload_params",
        f"CPUOffload(offload_params=True){of_unit} moves parameters between an accelerator and "
        "the CPU, and this machine has no accelerator (FullyShardedDataParallel would fail at "
        "the first forward or state_dict)",
        "Drop cpu_offload(...) (on the CPU the parameters already live in host memory), or run "
        "on a machine with a GPU.",
    )


def fsdp1_unit_overrides(unit: Unit, options: ShardingOptions) -> dict[str, Any]:
    """The checked ``FullyShardedDataParallel`` arguments this unit overrides."""
    checked: dict[str, Any] = {}
    per_unit_error = partial(config_error, f"{_WHERE}.per_unit")
    for name, value in called_overrides(unit, options, _WHERE).items():
        if name in _BUILD_WIDE:
            raise build_wide_error(_WHERE, name, unit.label, _BUILD_WIDE[name])
        if name not in _PER_UNIT:
            close = difflib.get_close_matches(name, _PER_UNIT, n=1)
            raise per_unit_error(
                name,
                f"'{name}' is not an argument FullyShardedDataParallel takes per unit "
                f"(unit '{unit.label}')",
                f"Did you mean '{close[0]}'?" if close else f"Use one of {sorted(_PER_UNIT)}.",
            )
        if name == "mixed_precision" and not (value is None or isinstance(value, MixedPrecision)):
            raise per_unit_error(
                name,
                f"expected MixedPrecision or None for unit '{unit.label}', "
                f"got {type(value).__name__}",
                "Pass torch.distributed.fsdp.MixedPrecision(...).",
            )
        try:
            checked[name] = _PER_UNIT[name](value)
        except ConfigurationError as exc:
            raise per_unit_error(
                name,
                f"{value!r} for unit '{unit.label}' is not valid: {exc}",
                f"Return what FullyShardedDataParallel's {name} takes.",
            ) from exc
    if isinstance(checked.get("cpu_offload"), OffloadPolicy):
        raise per_unit_error(
            "cpu_offload",
            f"{type(checked['cpu_offload']).__name__} for unit '{unit.label}' is fully_shard's "
            "(FSDP2)",
            "Return CPUOffload(offload_params=True) or a bool.",
        )
    check_fsdp1_offload(checked.get("cpu_offload"), f"{_WHERE}.per_unit", unit.label)
    strategy = checked.get("sharding_strategy")
    if strategy is not None and (strategy in HYBRID_STRATEGIES) != options.is_hybrid:
        raise per_unit_error(
            "sharding_strategy",
            f"unit '{unit.label}' asks for {strategy.name} but the build uses "
            f"{options.strategy.name}: hybrid and non-hybrid units need different groups",
            "Keep per-unit strategies hybrid (or not) like the build's sharding(...).",
        )
    return checked


def fsdp1_kwargs(env: Environment, unit: Unit | None = None) -> dict[str, Any]:
    """FullyShardedDataParallel's arguments (with ``unit``'s overrides, if given). States are
    already materialized and synchronized, so FSDP's own steps for those stay off."""
    memo = getattr(env, "memo", None)
    base = None if memo is None else memo.get(_BUILD_WIDE_KWARGS)
    if base is None:
        base = _build_wide_kwargs(env)
        if memo is not None:
            memo[_BUILD_WIDE_KWARGS] = base
    # Each unit its own dict and lists: torch keeps what it is given.
    kwargs = {k: list(v) if isinstance(v, list) else v for k, v in base.items()}
    if unit is not None:
        kwargs.update(fsdp1_unit_overrides(unit, env.options))
    return kwargs


_BUILD_WIDE_KWARGS = "fsdp1_kwargs"


def _build_wide_kwargs(env: Environment) -> dict[str, Any]:
    """The arguments every unit of the build shares (once per build: the ignored-states sets
    walk every ignored module)."""
    opts = env.options
    kwargs: dict[str, Any] = {
        "sharding_strategy": opts.strategy,
        "cpu_offload": opts.cpu_offload,
        "backward_prefetch": opts.backward_prefetch,
        "mixed_precision": opts.mixed_precision,
        "device_id": env.device,
        "sync_module_states": False,
        "forward_prefetch": opts.forward_prefetch,
        "limit_all_gathers": opts.limit_all_gathers,
        "use_orig_params": opts.use_orig_params,
    }
    groups = env.groups
    if groups.mesh is not None and (groups.mesh.ndim == 2) == opts.is_hybrid:
        kwargs["device_mesh"] = groups.mesh
    elif opts.is_hybrid and groups.replicate_group is not None:
        kwargs["process_group"] = (groups.shard_group, groups.replicate_group)
    else:
        kwargs["process_group"] = groups.shard_group
    ignored = env.ignored
    # As FSDP1's auto-wrap passes them: modules (their buffers too), or every ignored parameter
    # as states when some are ignored one by one (torch takes only one of the two arguments).
    in_modules = {p for m in ignored.modules for p in m.parameters(recurse=False)}
    if ignored.params and not ignored.params <= in_modules:
        kwargs["ignored_states"] = list(ignored.params)
    elif ignored.modules:
        kwargs["ignored_modules"] = list(ignored.modules)
    return kwargs


@frozen
class FSDP1Backend:
    """Wraps each unit with torch's FullyShardedDataParallel."""

    name: str = attrs.field(default="fsdp1", init=False)
    builder: str = attrs.field(default=_WHERE, init=False)
    # FullyShardedDataParallel flattens a whole unit: it cannot shard a unit still on meta.
    supports_shard_first: ClassVar[bool] = False
    # FullyShardedDataParallel's constructor runs no collectives once states are in place.
    shard_communicates: ClassVar[bool] = False

    def default_materializer(self) -> Materializer:
        """``ResetParameters()``, as FSDP1's ``param_init_fn`` would, per rank."""
        return ResetParameters()

    def check(self, options: ShardingOptions) -> None:
        check_fsdp2_only_options(options)

    def check_context(self, context: ConfigureContext) -> None:
        """Refuse now, locally, what FullyShardedDataParallel would refuse at shard time (or
        fail at in the first forward: offload on a machine without an accelerator)."""
        check_fsdp1_offload(context.options.cpu_offload, f"{_WHERE}.cpu_offload")
        check_root_not_wrapped(context.plan, _WHERE)
        check_fsdp1_plan(context.plan, context.options)
        check_per_unit(
            context.plan, context.options, lambda u: fsdp1_unit_overrides(u, context.options)
        )
        check_composition(context)

    def keyword_mixed_precision(self, given: dict[str, Any]) -> MixedPrecision:
        if "output_dtype" in given:
            raise config_error(
                f"{_WHERE}.mixed_precision",
                "output_dtype",
                "FullyShardedDataParallel's MixedPrecision has no output dtype",
                "Cast the model's output yourself, or use FullyShardBuilder.",
            )
        return MixedPrecision(**given)

    def kept_bytes(self, unit: Unit, shards: int) -> int:
        """One flat parameter per unit (per dtype), padded to a multiple of the shard count."""
        if shards <= 1:
            return unit.param_bytes
        by_dtype: dict[torch.dtype, int] = {}
        for p in unit.params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel
        return sum(chunk_size(n, shards) * d.itemsize for d, n in by_dtype.items())

    def prepare_groups(
        self, groups: ProcessGroups, options: ShardingOptions, device: torch.device, plan: UnitPlan
    ) -> ProcessGroups:
        """The groups as given; a hybrid pair must form a (replicate, shard) grid, else torch
        would average each shard with other shards' positions (collective over the pair)."""
        if options.is_hybrid and groups.mesh is None and groups.replicate_group is not None:
            hybrid_layout(groups.shard_group, groups.replicate_group, f"{_WHERE}.groups")
        return groups

    def shard(self, unit: Unit, env: Environment) -> nn.Module:
        kwargs = fsdp1_kwargs(env, unit)
        target = before_shard(unit, env)
        return after_shard(unit, env, FullyShardedDataParallel(target, **kwargs))
