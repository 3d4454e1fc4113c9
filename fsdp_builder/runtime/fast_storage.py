"""The storage step's pieces that read private torch names, each with a public fallback (see
docs/private_names.md and benchmarks/results/private_ab.md)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# For benchmarks/results/private_ab.md only: "plain_to_empty".
AB_SWITCHES = frozenset(os.environ.get("FSDP_BUILDER_AB", "").split(","))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``to_local()``'s wrapper costs more than a small parameter's
    work); any other tensor itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local()


# The private FSDP2 names the direct way reads, by the object that holds them: the unit's
# FSDPModule, its state, a parameter group, a parameter record, a sharded parameter. Each is
# probed before use; a torch that lacks any of them takes to_empty (``has_direct_api``).
MODULE_NAMES = ("_get_fsdp_state",)
# One group per module in some torch releases, a list of groups in others.
STATE_NAMES = ("_fsdp_param_groups", "_fsdp_param_group")
GROUP_NAMES = ("fsdp_params",)
RECORD_NAMES = ("sharded_param", "reset_sharded_param", "to_sharded_dtensor")
SHARDED_NAMES = ("_local_tensor",)


def _has(obj: object, names: tuple[str, ...]) -> bool:
    # Not getattr(obj, name, None): a missing name must not read as a present None.
    return all(hasattr(obj, name) for name in names)


def fsdp2_params(root: nn.Module) -> list[Any] | None:
    """The ``FSDPParam``s of the unit ``root`` shards; None when ``root`` is not FSDP2 or this
    torch's FSDP2 names its records otherwise (then ``to_empty`` is the way)."""
    if not _has(root, MODULE_NAMES):
        return None
    state = root._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, STATE_NAMES[0], None)
    if groups is None:
        if not hasattr(state, STATE_NAMES[1]):
            return None
        single = getattr(state, STATE_NAMES[1])
        groups = [] if single is None else [single]
    if not all(_has(group, GROUP_NAMES) for group in groups):
        return None
    return [fsdp_param for group in groups for fsdp_param in group.fsdp_params]


def has_direct_api(params: list[Any]) -> bool:
    """Whether this torch's FSDP2 parameter records have all that ``give_fsdp2_shards`` and
    ``settle_fsdp2_shards`` use."""
    return all(
        _has(record, RECORD_NAMES) and _has(record.sharded_param, SHARDED_NAMES)
        for record in params[:1]
    )


def give_fsdp2_shards(params: list[Any], device: torch.device, specs: dict[Any, Any]) -> int:
    allocated = 0
    with torch.no_grad():
        for fsdp_param in params:
            param = fsdp_param.sharded_param
            meta = param._local_tensor
            if not meta.is_meta:
                continue
            local = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            spec = getattr(fsdp_param, "_sharding_spec", None)
            if spec is not None:
                fsdp_param._sharding_spec = specs.setdefault(spec, spec)
            new = fsdp_param.to_sharded_dtensor(local)
            new.requires_grad_(param.requires_grad)
            # What nn.Parameter(dtensor) does, without its detach through DTensor's dispatch.
            new._is_param = True
            if not isinstance(new, nn.Parameter):
                new = nn.Parameter(new, requires_grad=param.requires_grad)
            # As to_empty does: the Parameter object every slot and FSDP2 hold stays the same.
            torch.utils.swap_tensors(param, new)
            fsdp_param.reset_sharded_param()
            allocated += local.numel() * local.element_size()
    return allocated


def settle_fsdp2_shards(unit_root: nn.Module) -> None:
    """Point FSDP2's references at shards given storage module by module, as ``to_empty``'s
    ``_apply`` would, freeing the meta shards now; a non-FSDP2 module is left alone."""
    params = fsdp2_params(unit_root)
    with torch.no_grad():
        for fsdp_param in params or ():
            fsdp_param.reset_sharded_param()
