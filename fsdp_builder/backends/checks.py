"""Configure-stage checks of what torch would refuse at shard time, read from the unit plan.
Local and pure, so every rank raises the same error before the first collective."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_builder.common.describe import listed
from fsdp_builder.compiling import check_units
from fsdp_builder.config import ShardingOptions
from fsdp_builder.errors import ConfigurationError, config_error
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.ignored import clean_name, is_wrapped
from fsdp_builder.planning.plan import Unit, UnitPlan
from fsdp_builder.planning.wrap import block_like_classes, unit_overrides

_SHOWN = 6


def check_root_not_wrapped(plan: UnitPlan, builder: str) -> None:
    """Refuse a model already sharded at its root (sharded children keep their units)."""
    root = plan.root.module
    if not is_wrapped(root):
        return
    how = (
        "FullyShardedDataParallel"
        if isinstance(root, torch.distributed.fsdp.FullyShardedDataParallel)
        else "fully_shard"
    )
    raise ConfigurationError(
        f"`{builder}.build` got a model that is already sharded at its root: "
        f"{type(root).__name__} was wrapped by {how}. Pass the model before it was sharded "
        "(sharded children are fine: they keep their own units), or use the sharded model as "
        "it is."
    )


def check_fsdp1_plan(plan: UnitPlan, options: ShardingOptions) -> None:
    """What FSDP1's FlatParameter refuses: non-floating or scalar parameters, mixed dtypes and
    (without ``use_orig_params``) mixed ``requires_grad`` in a unit."""
    where = "FSDPBuilder"
    integers: list[str] = []
    scalars: list[str] = []
    dtypes: dict[Unit, dict[torch.dtype, str]] = {}
    grads: dict[Unit, dict[bool, str]] = {}
    for unit in plan:
        for info in unit.params:
            name = info.name
            if not info.dtype.is_floating_point and not info.dtype.is_complex:
                integers.append(f"'{name}' ({info.dtype}, unit '{unit.label}')")
                continue
            if not info.shape:
                scalars.append(f"'{name}' (unit '{unit.label}')")
            dtypes.setdefault(unit, {}).setdefault(info.dtype, name)
            grads.setdefault(unit, {}).setdefault(info.requires_grad, name)
    if integers:
        raise ConfigurationError(
            f"`{where}.build`: FullyShardedDataParallel flattens each unit's parameters into one "
            f"floating-point FlatParameter and cannot shard non-floating parameters: "
            f"{listed(integers, _SHOWN)}. Register them as buffers "
            "(`module.register_buffer(...)`), "
            "ignore their modules with `.ignore([...])`, or use FullyShardBuilder."
        )
    if scalars:
        # Torch finds these only when it wraps their unit, after the units below were wrapped.
        raise ConfigurationError(
            f"`{where}.build`: FullyShardedDataParallel refuses scalar (0-dim) parameters: "
            f"{listed(scalars, _SHOWN)}. Make each a 1-D tensor of one element (e.g. "
            "`nn.Parameter(torch.ones(1))`), or leave it out with `.ignore(states=[...])`."
        )
    for unit, by_dtype in dtypes.items():
        if len(by_dtype) > 1:
            found = [f"'{name}' is {dtype}" for dtype, name in by_dtype.items()]
            raise ConfigurationError(
                f"`{where}.build`: unit '{unit.label}' holds parameters of several dtypes "
                f"({listed(found, _SHOWN)}); FullyShardedDataParallel flattens a unit into one "
                "FlatParameter of one dtype. Cast the model to one dtype before build() (use "
                "mixed_precision(...) for low-precision compute), or make the odd modules units "
                "of their own with `.wrap(...)`."
            )
    if options.use_orig_params:
        return
    for unit, by_grad in grads.items():
        if len(by_grad) > 1:
            raise ConfigurationError(
                f"`{where}.build`: unit '{unit.label}' mixes parameters that require grad "
                f"('{by_grad[True]}') and frozen ones ('{by_grad[False]}'); without "
                "use_orig_params FullyShardedDataParallel flattens a unit into one FlatParameter "
                "with one requires_grad. Call `.use_orig_params(True)`, or make the frozen "
                "modules units of their own with `.wrap(...)`."
            )


def check_fsdp2_plan(plan: UnitPlan) -> None:
    """What ``fully_shard`` refuses: scalar (0-dim) and non-contiguous parameters."""
    where = "FullyShardBuilder"
    scalars: list[str] = []
    odd: dict[str, Unit] = {}
    for unit in plan:
        for info in unit.params:
            if not info.shape:
                scalars.append(f"'{info.name}' (unit '{unit.label}')")
            elif not info.contiguous:
                odd[info.name] = unit
    # The strides a message shows are read from the tensors only when one is refused.
    by_name: dict[str, nn.Parameter] = {}
    for name, param in plan.root.module.named_parameters(remove_duplicate=False) if odd else ():
        by_name.setdefault(clean_name(name), param)
    strided = [
        f"'{name}' (shape {list(p.shape)}, stride {list(p.stride())}, unit '{unit.label}')"
        for name, unit in odd.items()
        if (p := by_name.get(name)) is not None
    ]
    if scalars:
        raise ConfigurationError(
            f"`{where}.build`: fully_shard shards parameters along dim 0 and refuses scalar "
            f"(0-dim) parameters: {listed(scalars, _SHOWN)}. Make each a 1-D tensor of one element "
            "(e.g. `nn.Parameter(torch.ones(1))`), or leave it out with "
            "`.ignore(states=[...])`."
        )
    if strided:
        raise ConfigurationError(
            f"`{where}.build`: fully_shard refuses non-contiguous parameters: "
            f"{listed(strided, _SHOWN)}. Make them contiguous before build() (e.g. "
            "`module.weight = nn.Parameter(module.weight.detach().contiguous())`)."
        )


def called_overrides(unit: Unit, options: ShardingOptions, where: str) -> dict[str, Any]:
    """The unit's overrides, with an exception of the user's function named with the unit."""
    try:
        return unit_overrides(unit.module, unit.fqn, unit.overrides, options.per_unit, where)
    except ConfigurationError:
        raise
    except Exception as exc:
        raise config_error(
            f"{where}.per_unit",
            "fn",
            f"the function raised {type(exc).__name__}: {exc} for unit '{unit.label}' "
            f"({type(unit.module).__name__})",
            "Make it return a dict of arguments, or None, for every unit of the plan (it is "
            "called with each unit's module and its name, '' for the root).",
        ) from exc


def build_wide_error(where: str, name: str, label: str, fix: str) -> Exception:
    """The refusal of a per-unit override of ``name``, which a build sets for every unit."""
    return config_error(
        f"{where}.per_unit",
        name,
        f"'{name}' is the same for every unit of a build and cannot be overridden (unit '{label}')",
        f"Set it for the whole model with {fix}.",
    )


def check_per_unit(
    plan: UnitPlan, options: ShardingOptions, checked: Callable[[Unit], object]
) -> None:
    """Run ``checked`` on every unit now, before the units before it change."""
    if options.per_unit is None and not any(unit.overrides for unit in plan):
        return
    for unit in plan:
        checked(unit)


def check_composition(context: ConfigureContext) -> None:
    """``compile(per_unit=True)`` needs units below the root; checkpointing must choose some."""
    options = context.options
    where = context.backend.builder
    if options.compile is not None:
        check_units(options.compile, len(context.plan), f"{where}.compile")
    chosen = options.activation_checkpointing
    if chosen is None:
        return
    for fqn, module in _modules_to_checkpoint(context.model, context.ignored.modules):
        try:
            if chosen(module, fqn):
                return
        except Exception as exc:
            raise config_error(
                f"{where}.activation_checkpointing",
                "policy",
                f"the predicate raised {type(exc).__name__}: {exc} for '{fqn or '<root>'}' "
                f"({type(module).__name__})",
                "Make it return True or False for every module of the model.",
            ) from exc
    blocks = block_like_classes(context.model)[:6]
    hint = (
        f"Classes of {type(context.model).__name__} that look like blocks: {', '.join(blocks)}; "
        f"pass those, e.g. `.activation_checkpointing({blocks[0]})`"
        if blocks
        else "Pass a module class the model contains, or a callable (module, fqn) -> bool"
    )
    classes = getattr(chosen, "classes", None)
    given = (
        f"no module is a {' or '.join(c.__name__ for c in classes)}"
        if isinstance(classes, tuple)
        else f"the predicate {getattr(chosen, '__name__', type(chosen).__name__)} is false for "
        "every module"
    )
    raise config_error(
        f"{where}.activation_checkpointing",
        "policy",
        f"it chooses no module of {type(context.model).__name__} ({given}), so nothing would "
        "be checkpointed",
        f"{hint}; or drop the activation_checkpointing(...) call.",
    )


def _modules_to_checkpoint(
    model: nn.Module, stop: frozenset[nn.Module]
) -> Iterator[tuple[str, nn.Module]]:
    """The modules ``checkpoint_unit`` may wrap: all but ignored subtrees and sharded ones."""
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        fqn, module = stack.pop()
        yield clean_name(fqn), module
        for name, child in module.named_children():
            if child not in stop and not is_wrapped(child):
                stack.append((f"{fqn}.{name}" if fqn else name, child))


__all__ = [
    "called_overrides",
    "check_composition",
    "check_fsdp1_plan",
    "check_fsdp2_plan",
    "check_per_unit",
    "check_root_not_wrapped",
]
