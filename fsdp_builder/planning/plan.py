"""The unit plan: which wrap units a model splits into, bottom-up, root last. Needs no process
group, so a meta model's plan can be printed and checked on a laptop."""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

import attrs
import torch
from attrs import frozen
from torch import nn

from fsdp_builder.common.hashing import digest63
from fsdp_builder.errors import PlanError
from fsdp_builder.planning.ignored import (
    SHARDED,
    IgnoredStates,
    NamedModules,
    check_ignored_real,
    clean_child,
    clean_name,
    managed_params,
    resolve_ignored,
)
from fsdp_builder.planning.ties import DeclaredTie, declared_ties, held
from fsdp_builder.planning.wrap import WrapPolicy


class TensorInfo(NamedTuple):
    """One parameter or buffer a unit owns directly. A tuple: a plan makes one per state."""

    name: str  # fully-qualified, relative to the root
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    # Recorded so the backends' checks need no walk (not in the signature ranks compare).
    contiguous: bool
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class UnitState(NamedTuple):
    """One slot of a unit's modules holding a parameter or buffer (a tied parameter has a slot
    per name). The tensor is read from the slot: a build replaces it (storage, FSDP2's
    DTensors, loaders), so none is kept here. A tuple: a plan makes one per slot."""

    module: nn.Module
    local: str  # the attribute name on ``module``
    name: str  # clean, relative to the root: the state-dict key
    is_param: bool
    persistent: bool  # in the state dict (a parameter always is)
    ignored: bool  # an ignored parameter, or a state of an ignored module below the unit

    @property
    def tensor(self) -> torch.Tensor:
        held = self.module._parameters if self.is_param else self.module._buffers
        return held[self.local]  # type: ignore[return-value]


@frozen(eq=False)
class Unit:
    """A wrap unit: a module and the states it owns, not counting nested units or ignored ones."""

    fqn: str  # "" for the root
    module: nn.Module = attrs.field(repr=False)
    # Breadth-first from ``module``. Stages walk these, never the tree, which FSDP1's wrappers
    # change during the build.
    modules: tuple[nn.Module, ...] = attrs.field(repr=False)
    params: tuple[TensorInfo, ...]
    buffers: tuple[TensorInfo, ...]
    is_root: bool
    # The clean name of each of ``modules``.
    fqns: tuple[str, ...] = attrs.field(default=(), repr=False)
    # Every slot of ``modules`` and of the ignored modules below them, module by module as
    # ``modules`` (parameters, then buffers): the one name -> tensor view every stage reads.
    states: tuple[UnitState, ...] = attrs.field(default=(), repr=False)
    # The slot of each of ``params + buffers``, in that order and by the same names.
    owned: tuple[UnitState, ...] = attrs.field(default=(), repr=False)
    # The wrap policy's own arguments for this unit (a torch CustomPolicy's kwargs dict).
    overrides: Mapping[str, Any] = attrs.field(factory=dict, repr=False)

    @property
    def label(self) -> str:
        return self.fqn or "<root>"

    @functools.cached_property
    def fqn_of(self) -> dict[int, str]:
        """Module id -> clean name, for each of ``modules``."""
        return {id(m): fqn for m, fqn in zip(self.modules, self.fqns, strict=True)}

    # Sizes are read several times per unit during a build (stage records, shard-first
    # choice): summed once per unit, the plan being immutable.
    @functools.cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @functools.cached_property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @functools.cached_property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return self.param_bytes + self.buffer_bytes


@frozen
class UnitPlan:
    """The ordered units (bottom-up, root last). ``ties``: pairs the model declares tied but
    holds as two meta parameters, planned as tied; ``tie_declared`` ties them."""

    units: tuple[Unit, ...]
    ties: tuple[DeclaredTie, ...] = attrs.field(default=(), repr=False, eq=False)

    def __iter__(self) -> Iterator[Unit]:
        return iter(self.units)

    def __len__(self) -> int:
        return len(self.units)

    @property
    def root(self) -> Unit:
        return self.units[-1]

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def largest_unit_bytes(self) -> int:
        return max((u.nbytes for u in self.units), default=0)

    def signature(self) -> list[tuple[str, tuple[tuple[str, tuple[int, ...], str], ...]]]:
        """Names, shapes and dtypes per unit: what ranks compare to know they built one model."""
        return [
            (u.fqn, tuple((t.name, t.shape, str(t.dtype)) for t in u.params + u.buffers))
            for u in self.units
        ]

    def fingerprint(self) -> int:
        """A 63-bit digest of :meth:`signature`, equal on ranks that built the same model."""
        return fingerprint_of(self.signature())

    def tie_declared(self) -> None:
        """Tie the pairs of ``ties`` in the model. Precondition: every rank agreed on the plan."""
        for tie in self.ties:
            tie.tie()

    def format(self) -> str:
        lines = [f"{'unit':<40} {'params':>12} {'bytes':>14} {'buffers':>8}"]
        for u in self.units:
            lines.append(f"{u.label:<40} {u.numel:>12,} {u.nbytes:>14,} {len(u.buffers):>8}")
        lines.append(f"{'total':<40} {self.numel:>12,} {self.nbytes:>14,}")
        return "\n".join(lines)


def unit_modules(root: nn.Module, stop: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules breadth-first from ``root``, stopping at ``stop`` and sharded children."""
    stops = set(stop)
    order: list[nn.Module] = [root]
    seen = {id(root)}
    queue = collections.deque([root])
    while queue:
        # The module's own dict: children() is two generators and a set per module.
        for child in queue.popleft()._modules.values():
            if child is None or id(child) in seen or child in stops or isinstance(child, SHARDED):
                continue
            seen.add(id(child))
            order.append(child)
            queue.append(child)
    return order


def fingerprint_of(description: object) -> int:
    """A 63-bit digest of a description (see ``UnitPlan.signature``)."""
    return digest63(repr(description))


def _info(name: str, t: torch.Tensor) -> TensorInfo:
    """``t``'s record under ``name`` (clean)."""
    return _new_info((name, tuple(t.shape), t.dtype, t.numel(), t.is_contiguous(), t.requires_grad))


# The plan's records, made through tuple.__new__: a NamedTuple's own __new__ is a Python frame
# more, once per parameter and slot of the model.
_Make = Callable[[tuple[Any, ...]], Any]
_new_info = cast(_Make, functools.partial(tuple.__new__, TensorInfo))
_new_state = cast(_Make, functools.partial(tuple.__new__, UnitState))


_DEPTH = operator.itemgetter(0)


def _post_order(model: nn.Module, stop: frozenset[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The modules below ``model``, children first, each once, by name; not entering ``stop``
    or sharded modules. A loop over each module's own dict, not a generator per module."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    # (name, module, its children still to visit)
    stack = [("", model, iter(model._modules.items()))]
    while stack:
        fqn, _, children = stack[-1]
        for name, child in children:
            if child is None or child in stop or id(child) in seen or isinstance(child, SHARDED):
                continue
            seen.add(id(child))
            stack.append((f"{fqn}.{name}" if fqn else name, child, iter(child._modules.items())))
            break
        else:
            done = stack.pop()
            if stack:
                order.append((done[0], done[1]))
    return order


def plan_units(
    model: nn.Module, wrap: WrapPolicy, ignored: IgnoredStates, named: NamedModules | None = None
) -> UnitPlan:
    """Split ``model`` into units, bottom-up: modules ``wrap`` chooses, then the root. Each owns
    its subtree's states minus nested units and ignored ones; the model is left as it was.

    Raises:
        PlanError: a parameter is reachable from two units.
    """
    if named is None:
        named = list(model.named_modules())
    ties = declared_ties(model, ignored, named)
    with held(ties):
        plan = _plan_units(model, wrap, ignored, named)
    return UnitPlan(plan.units, ties)


def _plan_units(
    model: nn.Module, wrap: WrapPolicy, ignored: IgnoredStates, named: NamedModules
) -> UnitPlan:
    chosen = wrap.select(model, ignored.modules, named)
    overrides = wrap.overrides(model, ignored.modules)
    # Names cleaned for the unit roots only: the walk passes every module.
    unit_roots = [
        (clean_name(fqn), m) for fqn, m in _post_order(model, ignored.modules) if m in chosen
    ]
    unit_roots.append(("", model))
    unit_set = {m for _, m in unit_roots}
    ignored_params = ignored.params  # read in place: ``ignores`` is a call per parameter

    # Keyed by id: a tensor's own __hash__ is a Python call, once per parameter and lookup.
    owner_of: dict[int, list[tuple[str, str]]] = {}
    # A buffer registered under several modules is owned (and counted) once, by the first unit.
    seen_buffers: set[int] = set()
    units: list[Unit] = []
    for unit_fqn, unit_module in unit_roots:
        params: list[TensorInfo] = []
        buffers: list[TensorInfo] = []
        # The slot of each of params, and of buffers.
        param_slots: list[UnitState] = []
        buffer_slots: list[UnitState] = []
        # Module id -> its clean name, the last alias as named_modules(remove_duplicate=False)
        # has it; walked into ignored modules too, for the names of their states. Clean as
        # built (``clean_child``).
        paths: dict[int, str] = {}
        # Each module walked with its depth, in the order walked (depth first, pre-order).
        walked: list[tuple[int, nn.Module]] = []
        stack: list[tuple[str, nn.Module, bool, int]] = [(unit_fqn, unit_module, False, 0)]
        while stack:
            fqn, module, inside, depth = stack.pop()
            paths[id(module)] = fqn
            walked.append((depth, module))
            # The module's own dicts: named_parameters(recurse=False) is a generator chain.
            for pname, p in module._parameters.items() if not inside else ():
                if p is None or (ignored_params and p in ignored_params):
                    continue
                name = clean_child(fqn, pname)
                owners = owner_of.setdefault(id(p), [])
                owners.append((unit_fqn, name))
                if len(owners) == 1:
                    params.append(_info(name, p))
                    param_slots.append(_new_state((module, pname, name, True, True, False)))
            transient = module._non_persistent_buffers_set
            for bname, b in module._buffers.items() if not inside else ():
                if b is not None and id(b) not in seen_buffers:
                    seen_buffers.add(id(b))
                    name = clean_child(fqn, bname)
                    buffers.append(_info(name, b))
                    kept = bname not in transient
                    buffer_slots.append(_new_state((module, bname, name, False, kept, False)))
            for cname, child in reversed(module._modules.items()):
                if child is not None and child not in unit_set and not isinstance(child, SHARDED):
                    path = clean_child(fqn, cname)
                    stack.append((path, child, inside or child in ignored.modules, depth + 1))
        if len(walked) == len(paths):
            # A tree: its pre-order sorted by depth (stably) is its breadth-first order.
            in_order = [m for _, m in sorted(walked, key=_DEPTH)]
        else:  # a module reached twice: the breadth-first walk names it where it meets it
            in_order = unit_modules(unit_module, unit_set)
        modules, fqns, states = _states(in_order, paths, ignored)
        units.append(
            Unit(
                fqn=unit_fqn,
                module=unit_module,
                modules=tuple(modules),
                params=tuple(params),
                buffers=tuple(buffers),
                is_root=unit_module is model,
                overrides=overrides.get(unit_module, {}),
                fqns=tuple(fqns),
                states=tuple(states),
                owned=(*param_slots, *buffer_slots),
            )
        )

    split = {
        p: owners
        for p, owners in owner_of.items()
        if len(owners) > 1 and len({unit for unit, _ in owners}) > 1
    }
    if split:
        details = "; ".join(
            " and ".join(f"'{name}' (unit '{unit or '<root>'}')" for unit, name in owners)
            for owners in split.values()
        )
        raise PlanError(
            f"Tied parameters are split across wrap units: {details}. A shared parameter must "
            "live in one unit: change the wrap policy so the modules sharing it are wrapped "
            "together (e.g. do not wrap them separately and let their common parent own them)."
        )
    return UnitPlan(tuple(units))


def _states(
    walked: list[nn.Module], paths: dict[int, str], ignored: IgnoredStates
) -> tuple[list[nn.Module], list[str], list[UnitState]]:
    """A unit's modules, their clean names (``paths``), and every slot of ``walked`` (a unit's
    walk, ignored modules below its first included), module by module: parameters, then
    buffers."""
    modules: list[nn.Module] = []
    fqns: list[str] = []
    states: list[UnitState] = []
    # Read in place: ``ignored.ignores`` is a call per parameter.
    ignored_params = ignored.params
    for i, m in enumerate(walked):
        fqn = paths[id(m)]
        inside = i > 0 and m in ignored.modules
        if not inside:
            modules.append(m)
            fqns.append(fqn)
        base = f"{fqn}." if fqn else ""  # a state's own name is never a wrapper's
        for local, p in m._parameters.items():
            if p is not None:
                left = inside or (bool(ignored_params) and p in ignored_params)
                states.append(_new_state((m, local, base + local, True, True, left)))
        transient = m._non_persistent_buffers_set
        for local, b in m._buffers.items():
            if b is not None:
                kept = local not in transient
                states.append(_new_state((m, local, base + local, False, kept, inside)))
    return modules, fqns, states


@frozen
class PlannedModel:
    """What the build knows of the model before it changes."""

    ignored: IgnoredStates
    plan: UnitPlan
    managed: tuple[nn.Parameter, ...]


def plan_model(
    model: nn.Module,
    wrap: WrapPolicy,
    ignored_modules: Iterable[nn.Module] | None = None,
    ignored_states: Iterable[Any] | None = None,
) -> PlannedModel:
    """Resolve what is ignored, plan the units and check the ignored states are real, in one
    walk of the model (local, the model untouched)."""
    named = list(model.named_modules())
    ignored = resolve_ignored(model, ignored_modules, ignored_states, named)
    plan = plan_units(model, wrap, ignored, named)
    check_ignored_real(model, ignored)
    return PlannedModel(ignored, plan, tuple(managed_params(model, ignored, named)))
