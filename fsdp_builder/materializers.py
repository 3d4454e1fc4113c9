"""Materializer role: give a unit's not-yet-real states (meta device) storage and values.

Works on one unit at a time and only on the modules the unit owns: the walk stops at ignored
modules and at children that are already sharded.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

import structlog
import torch
from attrs import frozen
from torch import nn
from typing_extensions import override

from fsdp_builder.environment import Environment
from fsdp_builder.errors import MaterializationError
from fsdp_builder.ignored import IgnoredStates, is_wrapped
from fsdp_builder.plan import Unit, UnitPlan

log = structlog.get_logger(__name__)


def unit_modules(root: nn.Module, ignored_modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The unit's own modules, breadth-first from ``root``, stopping at ignored modules and at
    already-sharded children (which were materialized with their own unit)."""
    stop = set(ignored_modules)
    order: list[nn.Module] = [root]
    seen = {id(root)}
    queue = collections.deque([root])
    while queue:
        for child in queue.popleft().children():
            if id(child) in seen or child in stop or is_wrapped(child):
                continue
            seen.add(id(child))
            order.append(child)
            queue.append(child)
    return order


def _direct_states(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def needs_materialization(modules: Iterable[nn.Module], ignored: IgnoredStates) -> bool:
    """True when a managed parameter or a buffer of these modules is on the meta device."""
    for m in modules:
        if any(p.is_meta for p in m.parameters(recurse=False) if p not in ignored.params):
            return True
        if any(b.is_meta for b in m.buffers(recurse=False)):
            return True
    return False


def _tied_groups(modules: list[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    by_param: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in modules:
        for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
            if p is not None:
                by_param.setdefault(id(p), []).append((m, name))
    return [slots for slots in by_param.values() if len(slots) > 1]


def allocate_empty(modules: list[nn.Module], device: torch.device) -> None:
    """``to_empty`` each module that owns states, then re-tie parameters that were shared
    (``to_empty`` gives every module its own new tensor, which would untie them)."""
    tied = _tied_groups(modules)
    for m in modules:
        if _direct_states(m) and any(t.is_meta for t in _direct_states(m)):
            m.to_empty(device=device, recurse=False)
    for slots in tied:
        owner, name = slots[0]
        shared = getattr(owner, name)
        for m, n in slots[1:]:
            setattr(m, n, shared)


# torch.nn modules that own parameters but whose initializer is private.
_PRIVATE_INITIALIZERS: dict[type[nn.Module], str] = {
    nn.MultiheadAttention: "_reset_parameters",
}


def initializer_of(module: nn.Module) -> Callable[[], object] | None:
    """The module's parameter initializer: ``reset_parameters`` or a known private one."""
    public = getattr(module, "reset_parameters", None)
    if callable(public):
        return public
    for cls, attr in _PRIVATE_INITIALIZERS.items():
        if isinstance(module, cls):
            return getattr(module, attr)
    return None


@runtime_checkable
class Materializer(Protocol):
    """Turns a unit's meta states into real ones on ``env.device``."""

    def check(self, plan: UnitPlan, ignored: IgnoredStates) -> None:
        """Local validation of the whole model before any collective; raise to refuse."""
        ...

    def materialize(self, unit: Unit, env: Environment) -> int:
        """Materialize the unit's own modules; return the bytes given storage.

        Optional extras the pipeline looks for: ``prepare(env)`` (called once on every rank
        after the groups exist; may communicate) and ``shard_first: bool`` (with a backend that
        ``supports_shard_first``, ``materialize`` is called after the unit is sharded on meta,
        to initialize only the local shards). A materializer that communicates must fail on
        every rank alike, or only after its last collective.
        """
        ...


class BaseMaterializer:
    """Optional base: subclasses override ``init_module`` (called per owned module in
    children-first order after storage is allocated), or ``materialize`` for full control."""

    def check(self, plan: UnitPlan, ignored: IgnoredStates) -> None:
        return None

    def init_module(self, module: nn.Module, fqn: str) -> None:
        raise NotImplementedError

    def materialize(self, unit: Unit, env: Environment) -> int:
        modules = unit_modules(unit.module, env.ignored.modules)
        if not needs_materialization(modules, env.ignored):
            return 0
        names = {id(m): n for n, m in unit.module.named_modules()}
        allocate_empty(modules, env.device)
        # Children first: a parent's initializer may set its children's values (as
        # MultiheadAttention zeroes out_proj.bias), and must win, as at construction.
        with torch.no_grad():
            for module in reversed(modules):
                if not _direct_states(module):
                    continue
                fqn = ".".join(x for x in (unit.fqn, names.get(id(module), "")) if x)
                try:
                    self.init_module(module, fqn)
                except MaterializationError:
                    raise
                except Exception as exc:
                    raise MaterializationError(
                        f"Initializing '{fqn or '<root>'}' ({type(module).__name__}) failed: "
                        f"{type(exc).__name__}: {exc}. Fix its initializer or pass another "
                        "materializer."
                    ) from exc
        return unit.nbytes


def _uninitializable(plan: UnitPlan, ignored: IgnoredStates) -> list[str]:
    missing: list[str] = []
    for unit in plan:
        names = {id(m): n for n, m in unit.module.named_modules()}
        for m in unit_modules(unit.module, ignored.modules):
            own = _direct_states(m)
            if own and any(t.is_meta for t in own) and initializer_of(m) is None:
                fqn = ".".join(x for x in (unit.fqn, names.get(id(m), "")) if x) or "<root>"
                missing.append(f"{fqn} ({type(m).__name__})")
    return missing


@frozen
class ResetParameters(BaseMaterializer):
    """``to_empty`` + ``reset_parameters()`` for each owned module that has states on meta.

    Modules not on meta are left as they are, so ranks that already hold real weights keep them.
    """

    @override
    def check(self, plan: UnitPlan, ignored: IgnoredStates) -> None:
        missing = _uninitializable(plan, ignored)
        if missing:
            raise MaterializationError(
                "`ResetParameters` cannot initialize these modules on the meta device because "
                f"they have no reset_parameters(): {', '.join(missing)}. Add a "
                "reset_parameters() method to them, or use InitFn(fn) / FromStateDict(...)."
            )

    @override
    def init_module(self, module: nn.Module, fqn: str) -> None:
        init = initializer_of(module)
        if init is None:  # buffers-only module checked out above
            raise MaterializationError(
                f"'{fqn}' ({type(module).__name__}) has no reset_parameters(); add one."
            )
        init()


@frozen
class KeepAsIs(BaseMaterializer):
    """Materializes nothing; a model with meta states is refused before any collective."""

    @override
    def check(self, plan: UnitPlan, ignored: IgnoredStates) -> None:
        meta = [
            t.name for u in plan for t in u.params + u.buffers if _is_meta(u.module, t.name, u.fqn)
        ]
        if meta:
            raise MaterializationError(
                f"`KeepAsIs` got states on the meta device: {', '.join(meta[:8])}"
                f"{' ...' if len(meta) > 8 else ''}. Pass a materializer such as "
                "ResetParameters() or build the model on a real device."
            )

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        return 0


def _is_meta(unit_module: nn.Module, name: str, unit_fqn: str) -> bool:
    rel = name[len(unit_fqn) + 1 :] if unit_fqn else name
    try:
        return bool(unit_module.get_parameter(rel).is_meta)
    except AttributeError:
        try:
            return bool(unit_module.get_buffer(rel).is_meta)
        except AttributeError:
            return False
