"""What both backends do to a unit around sharding it, in torchtitan's order: (tensor
parallelism, applied by the user before the build) → activation checkpointing → compile →
shard; with ``compile(per_unit=False)`` the sharded root is compiled last."""

from __future__ import annotations

from torch import nn

from fsdp_builder.compiling import check_units, compile_in_place
from fsdp_builder.groups import check_placed_on_other_dims
from fsdp_builder.planning.plan import Unit
from fsdp_builder.planning.wrap import checkpoint_unit
from fsdp_builder.runtime.environment import Environment


def before_shard(unit: Unit, env: Environment, where: str) -> nn.Module:
    """The module to shard for ``unit``: checkpointed and compiled as configured (in place
    where torch allows, so state-dict keys stay the model's). ``where`` names the builder in
    errors."""
    if unit is env.plan.units[0]:
        # Before the first unit changes: a sub-mesh needs the model placed on its other dims.
        check_placed_on_other_dims(env.groups.mesh, env.plan.root.module, f"{where}.groups")
    target = unit.module
    chosen = env.options.activation_checkpointing
    if chosen is not None:
        # Checkpoint first, then shard the wrapper: FSDP's hooks stay outside the recomputed
        # forward (FSDP1: FullyShardedDataParallel(checkpoint_wrapper(block))).
        target = checkpoint_unit(target, unit.fqn, chosen, env.ignored.modules)
    spec = env.options.compile
    if spec is not None and spec.before_shard(unit.is_root):
        target = compile_in_place(target, spec)
    elif spec is not None and unit.is_root:
        check_units(spec, len(env.plan), f"{where}.compile")
    return target


def after_shard(unit: Unit, env: Environment, sharded: nn.Module) -> nn.Module:
    """The sharded root compiled in place when the whole model is compiled."""
    spec = env.options.compile
    if spec is not None and spec.after_shard(unit.is_root):
        return compile_in_place(sharded, spec)
    return sharded
