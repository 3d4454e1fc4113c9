"""What both backends do to a unit around sharding it, in torchtitan's order: activation
checkpointing, compile, shard; with ``compile(per_unit=False)`` the sharded root last."""

from __future__ import annotations

from torch import nn

from fsdp_builder.compiling import compile_in_place
from fsdp_builder.planning.plan import Unit
from fsdp_builder.planning.wrap import checkpoint_unit
from fsdp_builder.runtime.environment import Environment


def before_shard(unit: Unit, env: Environment) -> nn.Module:
    """The module to shard for ``unit``: checkpointed and compiled as configured."""
    target = unit.module
    chosen = env.options.activation_checkpointing
    if chosen is not None:
        # Checkpoint first, then shard the wrapper: FSDP's hooks stay outside the recomputed
        # forward (FSDP1: FullyShardedDataParallel(checkpoint_wrapper(block))).
        target = checkpoint_unit(target, unit.fqn, chosen, env.ignored.modules)
    spec = env.options.compile
    if spec is not None and spec.before_shard(unit.is_root):
        target = compile_in_place(target, spec)
    return target


def after_shard(unit: Unit, env: Environment, sharded: nn.Module) -> nn.Module:
    """The sharded root compiled in place when the whole model is compiled."""
    spec = env.options.compile
    if spec is not None and spec.after_shard(unit.is_root):
        return compile_in_place(sharded, spec)
    return sharded
