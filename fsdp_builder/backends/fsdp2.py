"""FSDP2 backend: ``fully_shard`` applied to each unit, root last (docs/migration.md maps the
options). NO_SHARD runs on a ``(replicate=N, shard=1)`` mesh; FSDP1-only options FSDP2 cannot
honour are refused, so a model never silently trains with another schedule than asked."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from attrs import frozen
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from fsdp_builder.backends.checks import (
    build_wide_error,
    called_overrides,
    check_composition,
    check_fsdp2_plan,
    check_per_unit,
    check_root_not_wrapped,
)
from fsdp_builder.backends.composing import after_shard, before_shard
from fsdp_builder.config import (
    NO_RESHARD_AFTER_FORWARD,
    ShardingOptions,
    check_reshard_after_forward,
)
from fsdp_builder.errors import config_error
from fsdp_builder.groups import ProcessGroups, check_mesh, hybrid_layout
from fsdp_builder.materializers.initializers import Materializer
from fsdp_builder.materializers.streams import StreamInit
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.plan import Unit, UnitPlan
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.shards import chunk_size
from fsdp_builder.versions import check_fully_shard

MESH_DIM_NAMES = ("replicate", "shard")
_WHERE = "FullyShardBuilder"
_RESHARD = f"{_WHERE}.reshard_after_forward"
_groups_error = partial(config_error, f"{_WHERE}.groups")


def check_fsdp1_only_options(options: ShardingOptions) -> None:
    """Refuse FSDP1-only options the user set to values FSDP2 cannot honour."""
    explicit = options.explicit
    if "limit_all_gathers" in explicit and not options.limit_all_gathers:
        raise config_error(
            f"{_WHERE}.limit_all_gathers",
            "enabled",
            "FSDP2 always limits in-flight all-gathers and cannot turn that off",
            "Drop the limit_all_gathers(False) call.",
        )
    if "use_orig_params" in explicit and not options.use_orig_params:
        raise config_error(
            f"{_WHERE}.use_orig_params",
            "enabled",
            "FSDP2 always keeps the original parameters (as DTensors); it has no flat parameters",
            "Drop the use_orig_params(False) call.",
        )
    if (
        "backward_prefetch" in explicit
        and options.backward_prefetch is not BackwardPrefetch.BACKWARD_PRE
    ):
        mode = "None" if options.backward_prefetch is None else options.backward_prefetch.name
        raise config_error(
            f"{_WHERE}.prefetch",
            "backward",
            f"FSDP2 always prefetches like BACKWARD_PRE and has no {mode} mode",
            "Use prefetch(backward=BACKWARD_PRE), or call "
            "FSDPModule.set_modules_to_backward_prefetch(...) on the built model.",
        )
    if "forward_prefetch" in explicit and options.forward_prefetch:
        raise config_error(
            f"{_WHERE}.prefetch",
            "forward",
            "FSDP2 needs the forward prefetch order given explicitly",
            "Use prefetch(forward=False) and call FSDPModule.set_modules_to_forward_prefetch(...) "
            "on the built model's units.",
        )


def check_reshard_option(options: ShardingOptions) -> None:
    """``reshard_after_forward`` set next to a strategy that says the opposite is refused."""
    value, strategy = options.reshard_after_forward, options.strategy
    explicit = {"reshard_after_forward", "strategy"} <= options.explicit
    if not explicit or value is None or strategy == ShardingStrategy.NO_SHARD:
        return
    keeps = strategy in NO_RESHARD_AFTER_FORWARD
    if keeps != (value is False):
        raise config_error(
            _RESHARD,
            "reshard_after_forward",
            f"{value!r} contradicts sharding({strategy.name}), which "
            f"{'keeps' if keeps else 'frees'} the parameters after forward",
            "Set only one of them: reshard_after_forward(...) with the default or a hybrid "
            "strategy, or sharding(...) alone.",
        )


def check_reshard_divides(value: bool | int | None, shard_size: int, what: str, where: str) -> None:
    """An int ``reshard_after_forward`` must divide the shard group (``what`` names the size)."""
    if value is None or isinstance(value, bool) or shard_size % value == 0:
        return
    divisors = [d for d in range(1, shard_size + 1) if shard_size % d == 0]
    raise config_error(
        where,
        "reshard_after_forward",
        f"{value} does not divide {what} of {shard_size} rank(s), so fully_shard cannot "
        "reshard parameters to groups of that size after forward",
        f"Pass True, False, or one of {divisors[:8]}.",
    )


# fully_shard's own defaults, shared across units as its signature shares them (it never
# changes a policy it is given).
_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


def _no_buffer_dtype() -> Exception:
    return config_error(
        f"{_WHERE}.mixed_precision",
        "buffer_dtype",
        "FSDP2 keeps buffers in their own dtype and does not cast them",
        "Drop buffer_dtype, or cast the buffers of the model yourself before build().",
    )


def mixed_precision_policy(
    policy: MixedPrecision | MixedPrecisionPolicy | None, is_root: bool
) -> MixedPrecisionPolicy:
    """One unit's MixedPrecisionPolicy: as given, or mapped from FSDP1's MixedPrecision."""
    if policy is None:
        return _NO_MIXED_PRECISION
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if policy.buffer_dtype is not None:
        raise _no_buffer_dtype()
    if policy.keep_low_precision_grads:
        raise config_error(
            f"{_WHERE}.mixed_precision",
            "keep_low_precision_grads",
            "FSDP2 always hands gradients back in the parameters' own dtype",
            "Drop keep_low_precision_grads, or set reduce_dtype to the dtype you want reduced.",
        )
    cast = policy.cast_root_forward_inputs if is_root else policy.cast_forward_inputs
    return MixedPrecisionPolicy(
        param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype, cast_forward_inputs=cast
    )


def check_offload(options: ShardingOptions) -> None:
    """Refuse pinned host memory without an accelerator."""
    offload = options.cpu_offload
    pinned = isinstance(offload, CPUOffloadPolicy) and offload.pin_memory
    if pinned and not torch.accelerator.is_available():
        raise config_error(
            f"{_WHERE}.cpu_offload",
            "pin_memory",
            "pinned memory needs an accelerator and this machine has none",
            "Pass CPUOffloadPolicy(pin_memory=False).",
        )


def offload_policy(options: ShardingOptions, device: torch.device) -> OffloadPolicy:
    offload = options.cpu_offload
    if isinstance(offload, OffloadPolicy):
        return offload
    if offload is None or not offload.offload_params or device.type == "cpu":
        # Computing on the CPU: sharded parameters already live there.
        return _NO_OFFLOAD
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def supports_ignored_params(fn: Callable[..., Any] = fully_shard) -> bool:
    """Whether this torch's ``fully_shard`` takes ``ignored_params`` (added in torch 2.7)."""
    try:
        return "ignored_params" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def ignored_params_kwargs(
    unit_module: nn.Module, ignored: frozenset[nn.Parameter], fn: Callable[..., Any] = fully_shard
) -> dict[str, Any]:
    """``{"ignored_params": ...}`` for the ignored parameters under ``unit_module``, if any."""
    mine = {p for p in unit_module.parameters() if p in ignored} if ignored else set()
    if not mine:
        return {}
    if not supports_ignored_params(fn):
        raise config_error(
            f"{_WHERE}.ignore",
            "states",
            f"this torch ({torch.__version__}) has no fully_shard(ignored_params=...)",
            "Upgrade torch to 2.7 or later, or use FSDPBuilder to ignore modules or parameters.",
        )
    return {"ignored_params": mine}


def _named_mesh(
    groups: list[dist.ProcessGroup], device_type: str, layout: torch.Tensor
) -> DeviceMesh:
    return DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=MESH_DIM_NAMES)


def build_mesh(groups: ProcessGroups, options: ShardingOptions, device_type: str) -> DeviceMesh:
    """The mesh ``fully_shard`` runs on for these groups and strategy."""
    strategy, mesh = options.strategy, groups.mesh
    if mesh is not None:
        check_mesh(mesh, strategy, f"{_WHERE}.groups")
        if mesh.size() != groups.data_parallel_size:
            raise _groups_error(
                "mesh",
                f"the mesh spans {mesh.size()} ranks but its groups span "
                f"{groups.data_parallel_size}",
                "Return the mesh's own groups from the group factory.",
            )
    if strategy == ShardingStrategy.NO_SHARD:
        over = groups.shard_group if mesh is None else mesh.get_group(0)
        if over.size() == 1:
            if mesh is not None and mesh.ndim == 1:
                # The given mesh itself: a slice of a larger mesh (tensor parallelism on the
                # other dims) must stay one, for fully_shard and for the placement check.
                return mesh
            return DeviceMesh.from_group(over, device_type)
        # A replicate-only layout: shard dimension of size one, every rank keeps whole tensors.
        layout = torch.tensor(dist.get_process_group_ranks(over), dtype=torch.int).view(-1, 1)
        alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        assert alone is not None
        return _named_mesh([over, alone], device_type, layout)
    if mesh is not None:
        if mesh.device_type != device_type:
            raise _groups_error(
                "mesh",
                f"the mesh is for '{mesh.device_type}' devices but this rank computes on "
                f"'{device_type}'",
                "Create the mesh for the compute device type, or change the device.",
            )
        if mesh.ndim == 2 and mesh.mesh_dim_names is None:
            # fully_shard asks for named dimensions on a 2-D mesh; name the same groups.
            return _named_mesh([mesh.get_group(0), mesh.get_group(1)], device_type, mesh.mesh)
        return mesh
    if options.is_hybrid:
        if groups.replicate_group is None:
            raise _groups_error(
                "groups",
                f"{strategy.name} needs a replicate group, but the group factory gave none",
                "Use AutoHybridGroups, HybridGroups or a 2-D mesh.",
            )
        layout = hybrid_layout(groups.shard_group, groups.replicate_group, f"{_WHERE}.groups")
        return _named_mesh([groups.replicate_group, groups.shard_group], device_type, layout)
    return DeviceMesh.from_group(groups.shard_group, device_type)


_PER_UNIT_NAMES = ("reshard_after_forward", "mp_policy", "offload_policy", "shard_placement_fn")
# FSDP1 argument names a per-unit override may use by habit, and what fully_shard calls them.
_FSDP1_NAMES = {
    "mixed_precision": "mp_policy=MixedPrecisionPolicy(...)",
    "cpu_offload": "offload_policy=CPUOffloadPolicy(...)",
    "sharding_strategy": "reshard_after_forward=True/False",
}


def _check_override(name: str, value: Any, label: str) -> None:
    where = f"{_WHERE}.per_unit"
    expected = {"mp_policy": MixedPrecisionPolicy, "offload_policy": OffloadPolicy}.get(name)
    if name == "reshard_after_forward":
        check_reshard_after_forward(value, "per_unit")
    elif expected is not None:
        if not isinstance(value, expected):
            raise config_error(
                where,
                name,
                f"expected {expected.__name__} for unit '{label}', got {type(value).__name__}",
                f"Pass a torch.distributed.fsdp.{expected.__name__}.",
            )
        if isinstance(value, OffloadPolicy):
            check_offload(ShardingOptions(cpu_offload=value))
    elif name == "shard_placement_fn":
        if value is not None and not callable(value):
            raise config_error(
                where, name, f"expected a callable for unit '{label}'", "Pass a function or None."
            )
    elif name in ("mesh", "ignored_params"):
        fix = "groups(...)" if name == "mesh" else "ignore(...)"
        raise build_wide_error(_WHERE, name, label, fix)
    else:
        close = difflib.get_close_matches(name, _PER_UNIT_NAMES, n=1)
        hint = _FSDP1_NAMES.get(name) or (f"'{close[0]}'" if close else None)
        raise config_error(
            where,
            name,
            f"'{name}' is not an argument fully_shard takes per unit (unit '{label}')",
            f"Use {hint}." if hint else f"Use one of {', '.join(_PER_UNIT_NAMES)}.",
        )


def unit_fully_shard_overrides(unit: Unit, options: ShardingOptions) -> dict[str, Any]:
    """The checked ``fully_shard`` arguments this unit overrides (CustomPolicy, per_unit)."""
    overrides = called_overrides(unit, options, _WHERE)
    for name, value in overrides.items():
        _check_override(name, value, unit.label)
    return overrides


def check_placements(
    plan: UnitPlan, options: ShardingOptions, shard_size: int = 0
) -> dict[str, int]:
    """What ``fully_shard`` refuses of ``shard_placement_fn``'s answers (the build's or a unit's):
    a raise, anything but ``Shard(dim)`` or None, a dim the parameter lacks and, given the shard
    group's size, an uneven split of a dim other than 0 (torch splits only dim 0 unevenly).
    Returns the dim each parameter a placement function answered for is split along."""
    where = f"{_WHERE}.shard_placement_fn"
    answers: dict[str, int] = {}
    if options.shard_placement_fn is None and options.per_unit is None:
        if not any("shard_placement_fn" in unit.overrides for unit in plan):
            return answers  # the default path: no unit's overrides are worked out again
    for unit in plan:
        fn = unit_fully_shard_overrides(unit, options).get(
            "shard_placement_fn", options.shard_placement_fn
        )
        if fn is None:
            continue
        for info in unit.params:
            what = f"'{info.name}' (shape {list(info.shape)}, unit '{unit.label}')"
            try:
                placement = fn(plan.root.module.get_parameter(info.name))
            except Exception as exc:
                raise config_error(
                    where,
                    "fn",
                    f"it raised for {what}: {type(exc).__name__}: {exc}",
                    "Make it return Shard(dim) or None for every parameter.",
                ) from exc
            if placement is None:
                answers[info.name] = 0  # fully_shard's default
                continue
            ndim = len(info.shape)
            if not isinstance(placement, Shard) or not -ndim <= placement.dim < ndim:
                raise config_error(
                    where,
                    "fn",
                    f"it returned {placement!r} for {what}",
                    f"Return None (dim 0) or Shard(dim) with {-ndim} <= dim < {ndim}.",
                )
            size = info.shape[placement.dim]
            if shard_size and placement.dim % ndim and size % shard_size:
                raise config_error(
                    where,
                    "fn",
                    f"it places {what} on {placement!r}, but fully_shard splits a dim other "
                    f"than 0 only evenly and {size} is not a multiple of the shard group's "
                    f"{shard_size} ranks",
                    "Return Shard(0) or None for it (dim 0 may split unevenly), or a dim whose "
                    "size the shard group divides.",
                )
            answers[info.name] = placement.dim % ndim
    return answers


def fully_shard_kwargs(unit: Unit, env: Environment) -> dict[str, Any]:
    """The ``fully_shard`` arguments for one unit of this environment."""
    opts = env.options
    # The same for every unit but the root: worked out once per build and kind of unit.
    memo = getattr(env, "memo", None)
    key = ("fully_shard_kwargs", unit.is_root)
    shared = None if memo is None else memo.get(key)
    if shared is None:
        shared = _shared_kwargs(env, unit.is_root)
        if memo is not None:
            memo[key] = shared
    kwargs = dict(shared)
    if env.ignored.params:
        kwargs.update(ignored_params_kwargs(unit.module, env.ignored.params))
    kwargs.update(unit_fully_shard_overrides(unit, opts))
    return kwargs


def _shared_kwargs(env: Environment, is_root: bool) -> dict[str, Any]:
    opts = env.options
    if "reshard_after_forward" in opts.explicit and opts.reshard_after_forward is not None:
        reshard: bool | int = opts.reshard_after_forward
    elif is_root:
        reshard = False
    else:
        reshard = opts.strategy not in NO_RESHARD_AFTER_FORWARD
    kwargs: dict[str, Any] = {
        "mesh": env.groups.mesh,
        "reshard_after_forward": reshard,
        "mp_policy": mixed_precision_policy(opts.mixed_precision, is_root),
        "offload_policy": offload_policy(opts, env.device),
    }
    if opts.shard_placement_fn is not None:
        kwargs["shard_placement_fn"] = opts.shard_placement_fn
    return kwargs


@frozen
class FullyShardBackend:
    """Shards each unit in place with ``fully_shard`` (FSDP2); a unit may be sharded on meta."""

    name: str = attrs.field(default="fsdp2", init=False)
    builder: str = attrs.field(default=_WHERE, init=False)
    supports_shard_first: ClassVar[bool] = True
    # fully_shard only lays out shards; its collectives start with the first forward.
    shard_communicates: ClassVar[bool] = False

    def default_materializer(self) -> Materializer:
        """``StreamInit()``: each rank fills its shards (small units whole), equal at any world
        size."""
        return StreamInit()

    def check(self, options: ShardingOptions) -> None:
        check_fsdp1_only_options(options)
        check_reshard_option(options)
        check_offload(options)
        # The root and the other units take the same dtype fields: checked once, before any
        # collective.
        mixed_precision_policy(options.mixed_precision, is_root=True)

    def check_context(self, context: ConfigureContext) -> None:
        """Refuse now, locally, what fully_shard would refuse at shard time."""
        options = context.options
        check_fully_shard(options.strategy, context.device, context.ignored.params)
        check_root_not_wrapped(context.plan, _WHERE)
        check_fsdp2_plan(context.plan)
        check_placements(context.plan, options)  # the even split: once the groups exist
        # The shard group spans the world or a divisor of it: a size that does not divide the
        # world cannot divide the group (the exact group is checked once it exists).
        size, world = context.world_size, "the world size"
        check_reshard_divides(options.reshard_after_forward, size, world, _RESHARD)

        def per_unit(unit: Unit) -> None:
            value = unit_fully_shard_overrides(unit, options).get("reshard_after_forward")
            check_reshard_divides(value, size, world, f"{_WHERE}.per_unit")

        check_per_unit(context.plan, options, per_unit)
        check_composition(context)

    def resolved_settings(self, plan: UnitPlan, options: ShardingOptions) -> list[tuple[str, str]]:
        """``shard_placement_fn``'s answers, which ranks must share: a weight split along
        different dims on two ranks gathers into one rank's rows and the other's columns."""
        return [
            (f"shard_placement_fn({name!r})", f"Shard(dim={dim})")
            for name, dim in check_placements(plan, options).items()
        ]

    def keyword_mixed_precision(self, given: dict[str, Any]) -> MixedPrecisionPolicy:
        """MixedPrecisionPolicy with fully_shard's defaults (inputs cast)."""
        if "buffer_dtype" in given:
            raise _no_buffer_dtype()
        return MixedPrecisionPolicy(**given)

    def kept_bytes(self, unit: Unit, shards: int) -> int:
        """Every parameter split along dim 0, that dim padded to a multiple of the shards."""
        if shards <= 1:
            return unit.param_bytes
        total = 0
        for p in unit.params:
            rows = p.shape[0] if p.shape else 1
            per_row = p.numel // rows if rows else 0
            total += chunk_size(rows, shards) * per_row * p.dtype.itemsize
        return total

    def prepare_groups(
        self, groups: ProcessGroups, options: ShardingOptions, device: torch.device, plan: UnitPlan
    ) -> ProcessGroups:
        """The groups with the mesh ``fully_shard`` runs on; collective."""
        mesh = build_mesh(groups, options, device.type)
        shard = mesh.shape[-1]
        if "reshard_after_forward" in options.explicit:
            check_reshard_divides(options.reshard_after_forward, shard, "the shard group", _RESHARD)
        if shard > 1:
            check_placements(plan, options, shard)
        return attrs.evolve(groups, mesh=mesh)

    def shard(self, unit: Unit, env: Environment) -> nn.Module:
        kwargs = fully_shard_kwargs(unit, env)
        target = before_shard(unit, env)
        fully_shard(target, **kwargs)
        if target is not unit.module:
            env.sharded_roots[id(unit.module)] = target
        target = after_shard(unit, env, target)
        env.logger.debug(
            "fully_shard",
            unit=unit.label,
            reshard_after_forward=kwargs["reshard_after_forward"],
            ignored=len(kwargs.get("ignored_params", ())),
        )
        # In place: the module (or its checkpoint wrapper) keeps the slot in the parent.
        return target


__all__ = [
    "FullyShardBackend",
    "build_mesh",
    "check_fsdp1_only_options",
    "check_offload",
    "check_placements",
    "check_reshard_divides",
    "check_reshard_option",
    "fully_shard_kwargs",
    "ignored_params_kwargs",
    "mixed_precision_policy",
    "supports_ignored_params",
    "unit_fully_shard_overrides",
]
