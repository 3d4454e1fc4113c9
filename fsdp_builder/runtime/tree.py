"""Walking a unit's own modules, giving their states storage and moving them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_builder.planning.ignored import IgnoredStates
from fsdp_builder.planning.plan import Unit
from fsdp_builder.planning.plan import unit_modules as unit_modules
from fsdp_builder.runtime.fast_storage import (
    AB_SWITCHES,
    fsdp2_params,
    give_fsdp2_shards,
    has_direct_api,
    local_tensor,
    settle_fsdp2_shards,
)

CPU = torch.device("cpu")


def move_unit_states(unit: Unit, device: torch.device) -> int:
    """The move step: as FSDP does, only the unit's managed CPU states (and grads) move to
    ``device`` (a state on another GPU is left for the compute device check to report).
    Returns the bytes moved."""
    if device == CPU:
        return 0
    moved = 0
    seen: set[int] = set()  # a tied parameter's slots hold one tensor
    with torch.no_grad():
        for state in unit.states:
            t = state.tensor
            if state.ignored or t.device != CPU or id(t) in seen:
                continue
            seen.add(id(t))
            # Swap .data, as nn.Module._apply does, so optimizers and ties keep the same object.
            t.data = t.to(device)
            if t.grad is not None:
                t.grad.data = t.grad.to(device)
            moved += t.numel() * t.element_size()
    return moved


def qualified(prefix: str, name: str) -> str:
    """``prefix.name`` without empty parts (the root's name is "")."""
    return ".".join(x for x in (prefix, name) if x)


def module_names(root: nn.Module) -> dict[int, str]:
    """Module id → name relative to ``root`` (every alias of a shared module kept)."""
    return {id(m): n for n, m in root.named_modules(remove_duplicate=False)}


def direct_states(module: nn.Module) -> list[torch.Tensor]:
    """The states ``module`` registers itself, each once. Read from its own dicts:
    ``parameters(recurse=False)`` builds a generator chain per call, several per module."""
    states = (*module._parameters.values(), *module._buffers.values())
    return list({id(t): t for t in states if t is not None}.values())


def has_states(module: nn.Module) -> bool:
    """Whether ``module`` registers a parameter or buffer itself."""
    return any(t is not None for d in (module._parameters, module._buffers) for t in d.values())


def has_meta_states(module: nn.Module) -> bool:
    """Whether a state ``module`` registers itself is on meta; read in place (asked of every
    module): no list per module, no generator per state."""
    for states in (module._parameters, module._buffers):
        for t in states.values():
            if t is not None and t.is_meta:
                return True
    return False


def needs_materialization(modules: Iterable[nn.Module], ignored: IgnoredStates) -> bool:
    """True when a managed parameter or a buffer of these modules is on the meta device."""
    for m in modules:
        params = (p for p in m._parameters.values() if p is not None)
        if any(p.is_meta for p in params if not ignored.ignores(p)):
            return True
        if any(b.is_meta for b in m._buffers.values() if b is not None):
            return True
    return False


def tied_groups(modules: list[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) slots of each parameter registered more than once."""
    by_param: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in modules:
        for name, p in m._parameters.items():
            if p is not None:
                by_param.setdefault(id(p), []).append((m, name))
    return [slots for slots in by_param.values() if len(slots) > 1]


def allocate_empty(
    modules: list[nn.Module], device: torch.device, *, only_meta: bool = True
) -> int:
    """``to_empty(recurse=False)`` on ``modules`` (those with a meta state, or all unless
    ``only_meta``), keeping real values and ties; returns the bytes given storage."""
    tied = tied_groups(modules)
    allocated = 0
    # Each meta parameter (kept so its id stays unique) with its replacement, for tied slots.
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for m in modules:
        own = direct_states(m)
        if not own or (only_meta and not any(t.is_meta for t in own)):
            continue
        if only_meta and _meta_states_alone(m, device):
            allocated += _allocate_meta_states(m, device, made)
        else:
            allocated += _to_empty_keeping_values(m, device)
    retie(tied)
    return allocated


def _meta_states_alone(module: nn.Module, device: torch.device) -> bool:
    """Whether the module's meta states can get storage one by one as ``to_empty`` would."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return False
    for states, kind in ((module._parameters, nn.Parameter), (module._buffers, torch.Tensor)):
        for t in states.values():
            if t is None:
                continue
            if t.is_meta:
                if type(t) is not kind or (kind is nn.Parameter and t.grad is not None):
                    return False
            elif t.device != device:
                return False
    return True


def _empty_as(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # torch.empty skips empty_like's dispatch from meta; other layouts keep its strides.
    if t.is_contiguous():
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return torch.empty_like(t, device=device)


def _allocate_meta_states(
    module: nn.Module, device: torch.device, made: dict[int, tuple[nn.Parameter, nn.Parameter]]
) -> int:
    allocated = 0
    params = module._parameters
    for name, p in params.items():
        if p is not None and p.is_meta:
            if id(p) in made:
                new = made[id(p)][1]
            else:
                # A new Parameter, as to_empty makes for a tensor it cannot convert in place.
                new = nn.Parameter(_empty_as(p, device), requires_grad=p.requires_grad)
                made[id(p)] = (p, new)
                allocated += new.numel() * new.element_size()
            params[name] = new
    buffers = module._buffers
    for name, b in buffers.items():
        if b is not None and b.is_meta:
            buffers[name] = fresh = _empty_as(b, device)
            allocated += fresh.numel() * fresh.element_size()
    return allocated


def _to_empty_keeping_values(module: nn.Module, device: torch.device) -> int:
    # Aliases: to_empty may give the same object new storage (``.data``, ``swap_tensors``).
    real = [
        (name, t.detach())
        for name, t in [*module._parameters.items(), *module._buffers.items()]
        if t is not None and not t.is_meta
    ]
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for name, old in real:
            # Through .data: keeping a value is no write for the version-counter detectors.
            getattr(module, name).data.copy_(old)
    return sum(t.numel() * t.element_size() for t in direct_states(module))


def allocate_unit(
    root: nn.Module, modules: list[nn.Module], device: torch.device, specs: dict[Any, Any]
) -> int:
    """``allocate_empty`` for a unit whose ``root`` may be FSDP2-sharded on meta: local shards
    are made directly (DTensor's dispatch is most of a small unit's cost), sharing ``specs``."""
    if not isinstance(root, FSDPModule):
        return allocate_empty(modules, device)
    params = fsdp2_params(root)
    # Without the direct API (a torch whose FSDP2 names these differently) all goes to to_empty.
    if params is None or not has_direct_api(params) or "plain_to_empty" in AB_SWITCHES:
        return _to_empty_unit(root, modules, device)
    allocated = give_fsdp2_shards(params, device, specs)
    if any(t.is_meta for m in modules for t in direct_states(m)):
        # Buffers and unmanaged parameters; to_empty may also replace FSDP2 parameters (shards
        # offloaded to the CPU), so FSDP2 is pointed at what it holds now.
        allocated += allocate_empty(modules, device)
        settle_fsdp2_shards(root)
    return allocated


def _to_empty_unit(root: nn.Module, modules: list[nn.Module], device: torch.device) -> int:
    # The FSDP2 root last: its to_empty (FSDPModule._apply) points FSDP2 at the new shards.
    tied = tied_groups(modules)
    allocated = 0
    for m in reversed(modules):
        if m is root or any(t.is_meta for t in direct_states(m)):
            _to_empty_keeping_values(m, device)
            allocated += sum(local_tensor(t).numel() * t.element_size() for t in direct_states(m))
    if not any(m is root for m in modules):  # a wrapper (checkpointing) holds FSDP2's records
        _to_empty_keeping_values(root, device)
    retie(tied)
    return allocated


def retie(tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Make every slot of each group hold its first slot's parameter again."""
    for slots in tied:
        owner, name = slots[0]
        shared = getattr(owner, name)
        for m, n in slots[1:]:
            setattr(m, n, shared)
