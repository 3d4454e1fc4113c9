"""Walking a unit's own modules and giving their states storage.

A unit owns the modules below its root down to (not into) ignored modules and already-sharded
children; these helpers are what every materializer, synchronizer and loader walks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_builder.planning.ignored import IgnoredStates, clean_name
from fsdp_builder.planning.plan import unit_modules as unit_modules
from fsdp_builder.runtime.pages import prefault as _madvise_prefault

# Switches for the A/B of benchmarks/results/private_ab.md only (comma-separated):
# "plain_to_empty" gives FSDP2 units storage through to_empty, "no_madvise" skips prefault.
_AB = frozenset(os.environ.get("FSDP_BUILDER_AB", "").split(","))


def prefault(tensor: torch.Tensor) -> None:
    if "no_madvise" not in _AB:
        _madvise_prefault(tensor)


def qualified(prefix: str, name: str) -> str:
    """``prefix.name`` without empty parts (the root's name is "")."""
    return ".".join(x for x in (prefix, name) if x)


def module_names(root: nn.Module) -> dict[int, str]:
    """Module id → name relative to ``root`` (every alias of a shared module kept)."""
    return {id(m): n for n, m in root.named_modules(remove_duplicate=False)}


def owned_states(root: nn.Module, root_fqn: str) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Clean fully-qualified name → (owning module, local name, tensor) for every parameter and
    buffer below ``root``, named as the plan names them (no wrapper prefixes such as
    ``_checkpoint_wrapped_module``)."""
    found: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        base = qualified(root_fqn, prefix)
        named = [*module._parameters.items(), *module._buffers.items()]
        for name, t in named:
            if t is not None:
                found.setdefault(clean_name(qualified(base, name)), (module, name, t))
    return found


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (as FSDP holds it; ``to_local()`` goes through a compiled-function
    wrapper that costs more than the work on a small parameter); any other tensor itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local()


def direct_states(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``module`` registers itself (not its children's). Read from
    the module's own dicts: ``parameters(recurse=False)`` builds a generator chain per call,
    which adds up at several calls per module per unit."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    for t in (*module._parameters.values(), *module._buffers.values()):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            found.append(t)
    return found


def has_states(module: nn.Module) -> bool:
    """Whether ``module`` registers a parameter or buffer itself (read in place, as
    :func:`has_meta_states`)."""
    for states in (module._parameters, module._buffers):
        for t in states.values():
            if t is not None:
                return True
    return False


def has_meta_states(module: nn.Module) -> bool:
    """Whether a parameter or buffer ``module`` registers itself is on the meta device. Read in
    place from the module's own dicts (asked of every module of every unit, and of the whole
    model after the build): no list per module, no generator per state."""
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
    """Storage on ``device`` for the states of each module that owns states (only those with a
    state on meta unless ``only_meta`` is False), as ``to_empty(recurse=False)`` gives it, then
    re-tie parameters that were shared (each slot gets its own new tensor, which would untie
    them). States that were already real keep their values: an initializer that does not write
    them (a buffer filled in ``__init__``) never leaves them uninitialized. Returns the bytes
    given storage.

    A module whose real states are already on ``device`` and whose meta states are plain
    parameters and tensors gets storage for its meta states alone, each made directly (what
    ``to_empty`` makes, without its per-tensor dispatch from meta); its real states, such as
    FSDP2 shards given storage before, stay as they are. Any other module goes through
    ``to_empty`` itself."""
    tied = tied_groups(modules)
    allocated = 0
    # Each meta parameter (kept, so its id stays its own) with its replacement, for tied slots.
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
    """Whether the module's meta states can get storage one by one, as ``to_empty`` would give
    them: its real states are on ``device``, its meta parameters plain ``Parameter``s without a
    gradient, its meta buffers plain tensors, and torch does not swap tensors on conversion."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return False
    for p in module._parameters.values():
        if p is None:
            continue
        if p.is_meta:
            if type(p) is not nn.Parameter or p.grad is not None:
                return False
        elif p.device != device:
            return False
    for b in module._buffers.values():
        if b is None:
            continue
        if b.is_meta:
            if type(b) is not torch.Tensor:
                return False
        elif b.device != device:
            return False
    return True


def _empty_as(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # torch.empty from the shape is what empty_like gives a contiguous tensor, without the
    # dispatch from meta; other layouts keep empty_like's strides.
    if t.is_contiguous():
        fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
    else:
        fresh = torch.empty_like(t, device=device)
    prefault(fresh)
    return fresh


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
    # Aliases of the old storage: to_empty may give the same object new storage (``.data`` set
    # in place, or ``swap_tensors`` for a DTensor), so the object itself cannot be kept as the
    # source of its values.
    real = [
        (name, t.detach())
        for name, t in [*module._parameters.items(), *module._buffers.items()]
        if t is not None and not t.is_meta
    ]
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for name, old in real:
            getattr(module, name).copy_(old)
    return sum(t.numel() * t.element_size() for t in direct_states(module))


def allocate_unit(
    root: nn.Module, modules: list[nn.Module], device: torch.device, specs: dict[Any, Any]
) -> int:
    """``allocate_empty`` for the owned ``modules`` of a unit whose ``root`` may be an FSDP2
    module sharded on meta. Its parameters get their local shards directly (``to_empty`` would
    create each one through DTensor's dispatch, the larger part of a small unit's cost), keep
    their identity, and FSDP2 points at the new shards, as after ``to_empty`` on the FSDP
    module. Equal sharding specs are shared through ``specs`` (one dict per build), as
    DTensor's cached propagation shares them between ``to_empty``'s tensors: a build keeps one
    per distinct layout, not one per parameter. Returns the bytes given storage on this rank."""
    params = fsdp2_params(root)
    if params is None:
        return allocate_empty(modules, device)
    if "plain_to_empty" in _AB:
        return _to_empty_unit(root, modules, device)
    if params and not hasattr(params[0], _FSDP_PARAM_API):
        # A torch whose FSDP2 names these differently: to_empty, then FSDP2 pointed at the new
        # shards as its own _apply would.
        allocated = allocate_empty(modules, device)
        settle_fsdp2_shards(root)
        return allocated
    allocated = _give_fsdp2_shards(params, device, specs)
    if any(t.is_meta for m in modules for t in direct_states(m)):
        # Buffers, and parameters FSDP2 does not manage. A module that goes through to_empty
        # (its real states are elsewhere, e.g. shards offloaded to the CPU) gets new FSDP2
        # parameters too: point FSDP2 at whatever it holds now.
        allocated += allocate_empty(modules, device)
        settle_fsdp2_shards(root)
    return allocated


def _to_empty_unit(root: nn.Module, modules: list[nn.Module], device: torch.device) -> int:
    # to_empty(recurse=False) on each owned module with a meta state, the FSDP2 root last: its
    # to_empty (FSDPModule._apply) points FSDP2 at the new shards.
    tied = tied_groups(modules)
    allocated = 0
    for m in reversed(modules):
        if m is root or any(t.is_meta for t in direct_states(m)):
            _to_empty_keeping_values(m, device)
            allocated += sum(
                local_tensor(t).numel() * t.element_size() for t in direct_states(m)
            )
    retie(tied)
    return allocated


def fsdp2_params(root: nn.Module) -> list[Any] | None:
    """The FSDP2 parameters (``FSDPParam``) of the unit ``root`` shards; None when ``root`` is not
    an FSDP2 module."""
    get_state = getattr(root, "_get_fsdp_state", None)
    if get_state is None:
        return None
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per module
        single = getattr(state, "_fsdp_param_group", None)
        groups = [] if single is None else [single]
    return [fsdp_param for group in groups for fsdp_param in group.fsdp_params]


# The method of FSDP2's per-parameter record the direct path needs (looked up on the first).
_FSDP_PARAM_API = "to_sharded_dtensor"


def _give_fsdp2_shards(params: list[Any], device: torch.device, specs: dict[Any, Any]) -> int:
    allocated = 0
    with torch.no_grad():
        for fsdp_param in params:
            param = fsdp_param.sharded_param
            meta = param._local_tensor
            if not meta.is_meta:
                continue
            local = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            prefault(local)
            spec = getattr(fsdp_param, "_sharding_spec", None)
            if spec is not None:
                fsdp_param._sharding_spec = specs.setdefault(spec, spec)
            new = fsdp_param.to_sharded_dtensor(local)
            new.requires_grad_(param.requires_grad)
            # What nn.Parameter(dtensor) does, without its detach through DTensor's dispatch
            # (the new DTensor has no history and no other owner); the slow way if that ever
            # stops making a Parameter.
            new._is_param = True
            if not isinstance(new, nn.Parameter):
                new = nn.Parameter(new, requires_grad=param.requires_grad)
            # As to_empty does for tensor subclasses: the Parameter object stays the one every
            # slot (tied ones included) and FSDP2 hold.
            torch.utils.swap_tensors(param, new)
            fsdp_param.reset_sharded_param()
            allocated += local.numel() * local.element_size()
    return allocated


def settle_fsdp2_shards(unit_root: nn.Module) -> None:
    """After the DTensor parameters of an FSDP2 unit got storage module by module (not through
    ``to_empty`` on the FSDP module, whose ``_apply`` does this), point FSDP2's own references
    at the new shards, as that ``_apply`` does: the meta shards and their specs are freed now,
    not at the first forward, and the unit is in the state plain ``to_empty`` leaves it in.
    A module that is not an FSDP2 unit is left alone."""
    params = fsdp2_params(unit_root)
    with torch.no_grad():
        for fsdp_param in params or ():
            fsdp_param.reset_sharded_param()


def retie(tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Make every slot of each group hold its first slot's parameter again (``to_empty`` gives
    each module a new tensor of its own, which unties them)."""
    for slots in tied:
        owner, name = slots[0]
        shared = getattr(owner, name)
        for m, n in slots[1:]:
            setattr(m, n, shared)
