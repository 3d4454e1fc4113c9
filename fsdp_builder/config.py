"""Sharding options shared by every backend, as one validated, immutable object."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

import attrs
import torch
from attrs import frozen
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)

from fsdp_builder.compiling import CompileSpec
from fsdp_builder.errors import config_error, require_bool

_STRATEGY_ALIASES: dict[str, ShardingStrategy] = {
    "full": ShardingStrategy.FULL_SHARD,
    "grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
    "hybrid_zero2": ShardingStrategy._HYBRID_SHARD_ZERO2,
    "none": ShardingStrategy.NO_SHARD,
}

HYBRID_STRATEGIES = frozenset({ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2})
NO_RESHARD_AFTER_FORWARD = frozenset(
    {ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2}
)


def to_sharding_strategy(value: ShardingStrategy | str) -> ShardingStrategy:
    """Accept a ShardingStrategy, its name (any case) or a short alias (`full`, `grad_op`...)."""
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, str):
        key = value.strip()
        if key.lower() in _STRATEGY_ALIASES:
            return _STRATEGY_ALIASES[key.lower()]
        if key.upper() in ShardingStrategy.__members__:
            return ShardingStrategy[key.upper()]
    names = sorted(list(_STRATEGY_ALIASES) + [s.name for s in ShardingStrategy])
    raise config_error(
        "ShardingBuilder.sharding",
        "strategy",
        f"{value!r} is not a sharding strategy",
        f"Pass a torch.distributed.fsdp.ShardingStrategy or one of {names}.",
    )


CheckpointPredicate: TypeAlias = Callable[[nn.Module, str], bool]
PerUnitFn: TypeAlias = Callable[[nn.Module, str], "Mapping[str, Any] | None"]


def to_cpu_offload(
    value: CPUOffload | OffloadPolicy | bool | None,
) -> CPUOffload | OffloadPolicy | None:
    """FSDP1's CPUOffload, FSDP2's OffloadPolicy / CPUOffloadPolicy (kept as given), or a bool."""
    if value is None or isinstance(value, CPUOffload | OffloadPolicy):
        return value
    if isinstance(value, bool):
        return CPUOffload(offload_params=value)
    raise config_error(
        "ShardingBuilder.cpu_offload",
        "offload",
        f"expected a bool or a torch.distributed.fsdp CPUOffload / OffloadPolicy, "
        f"got {type(value).__name__}",
        "Pass CPUOffload(offload_params=True), CPUOffloadPolicy(...) (FSDP2) or True.",
    )


def to_backward_prefetch(value: BackwardPrefetch | str | None) -> BackwardPrefetch | None:
    if value is None or isinstance(value, BackwardPrefetch):
        return value
    if isinstance(value, str) and value.upper() in BackwardPrefetch.__members__:
        return BackwardPrefetch[value.upper()]
    raise config_error(
        "ShardingBuilder.prefetch",
        "backward",
        f"{value!r} is not a backward prefetch mode",
        f"Pass None or one of {sorted(BackwardPrefetch.__members__)}.",
    )


def _to_names(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


_DTYPE_NAMES: dict[str, torch.dtype] = {
    name: dtype
    for dtype, names in (
        (torch.bfloat16, ("bf16", "bfloat16")),
        (torch.float16, ("fp16", "float16", "half")),
        (torch.float32, ("fp32", "float32", "float")),
        (torch.float64, ("fp64", "float64", "double")),
    )
    for name in names
}


def to_dtype(value: Any, argument: str) -> Any:
    """A floating ``torch.dtype`` from a dtype or its name (``"bf16"``...); None stays None."""
    if value is None:
        return None
    dtype = value
    if isinstance(value, str):
        dtype = _DTYPE_NAMES.get(value.strip().lower().removeprefix("torch."))
        if dtype is None:
            raise config_error(
                "ShardingBuilder.mixed_precision",
                argument,
                f"{value!r} is not a floating dtype name",
                f"Pass a torch dtype such as torch.bfloat16, or one of {sorted(_DTYPE_NAMES)}.",
            )
    if not isinstance(dtype, torch.dtype):
        raise config_error(
            "ShardingBuilder.mixed_precision",
            argument,
            f"expected a torch.dtype or a dtype name, got {type(value).__name__} {value!r}",
            "Pass e.g. torch.bfloat16 or 'bf16'.",
        )
    if not dtype.is_floating_point:
        raise config_error(
            "ShardingBuilder.mixed_precision",
            argument,
            f"{dtype} is not a floating-point dtype",
            "Mixed precision computes in a floating dtype: pass torch.bfloat16, torch.float16 "
            "or torch.float32.",
        )
    return dtype


def _check_mixed_precision(_inst: Any, _attr: Any, value: Any) -> None:
    if value is not None and not isinstance(value, MixedPrecision | MixedPrecisionPolicy):
        raise config_error(
            "ShardingBuilder.mixed_precision",
            "policy",
            f"expected torch.distributed.fsdp.MixedPrecision or MixedPrecisionPolicy, got "
            f"{type(value).__name__}",
            "Pass MixedPrecision(param_dtype=..., reduce_dtype=...), MixedPrecisionPolicy(...) "
            "(FSDP2) or keyword dtypes.",
        )
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
        field = getattr(value, name, None)
        if field is not None and not isinstance(field, torch.dtype):
            raise config_error(
                "ShardingBuilder.mixed_precision",
                name,
                f"the {type(value).__name__} holds {field!r}, not a torch.dtype",
                f"Build it with a torch dtype ({name}=torch.bfloat16), or pass the dtypes as "
                f"keywords, which also take names: mixed_precision({name}='bf16').",
            )


def check_reshard_after_forward(value: Any, where: str = "reshard_after_forward") -> None:
    """``fully_shard``'s ``reshard_after_forward``: a bool, or a positive int (a group size)."""
    if isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return
    raise config_error(
        f"FullyShardBuilder.{where}",
        "reshard_after_forward",
        f"expected a bool or a positive int, got {value!r}",
        "Pass True, False, or a factor of the shard group size.",
    )


def _check_reshard(_inst: Any, _attr: Any, value: Any) -> None:
    if value is not None:
        check_reshard_after_forward(value)


def _check_callable(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not callable(value):
        raise config_error(
            f"ShardingBuilder.{attr.name}",
            attr.name,
            f"expected a callable, got {type(value).__name__}",
            "Pass a function.",
        )


def _check_bool(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    require_bool(value, f"ShardingBuilder.{attr.name}", attr.name)


@frozen
class ShardingOptions:
    """What FSDP's init steps store, validated once; ``explicit`` names the options the user
    set, so a backend refuses only those it cannot honour."""

    strategy: ShardingStrategy = attrs.field(
        default=ShardingStrategy.FULL_SHARD, converter=to_sharding_strategy
    )
    mixed_precision: MixedPrecision | MixedPrecisionPolicy | None = attrs.field(
        default=None, validator=_check_mixed_precision
    )
    cpu_offload: CPUOffload | OffloadPolicy | None = attrs.field(
        default=None, converter=to_cpu_offload
    )
    backward_prefetch: BackwardPrefetch | None = attrs.field(
        default=BackwardPrefetch.BACKWARD_PRE, converter=to_backward_prefetch
    )
    forward_prefetch: bool = attrs.field(default=False, validator=_check_bool)
    limit_all_gathers: bool = attrs.field(default=True, validator=_check_bool)
    use_orig_params: bool = attrs.field(default=False, validator=_check_bool)
    # FSDP2 only (``fully_shard``'s own arguments); None: derived from the strategy / torch's.
    reshard_after_forward: bool | int | None = attrs.field(default=None, validator=_check_reshard)
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = attrs.field(
        default=None, validator=_check_callable
    )
    per_unit: PerUnitFn | None = attrs.field(default=None, validator=_check_callable)
    activation_checkpointing: CheckpointPredicate | None = attrs.field(
        default=None, validator=_check_callable
    )
    compile: CompileSpec | None = attrs.field(default=None)
    explicit: frozenset[str] = attrs.field(default=frozenset(), converter=_to_names)

    @property
    def is_hybrid(self) -> bool:
        return self.strategy in HYBRID_STRATEGIES

    def set(self, **changes: Any) -> ShardingOptions:
        """A copy with ``changes`` applied and recorded as explicit."""
        return attrs.evolve(self, explicit=self.explicit.union(changes), **changes)
