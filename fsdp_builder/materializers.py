"""Materializer role: give a unit's not-yet-real states (meta device) storage and values.

Works on one unit at a time and only on the modules the unit owns: the walk stops at ignored
modules and at children that are already sharded.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs
import structlog
import torch
from attrs import frozen
from torch import nn
from typing_extensions import override

from fsdp_builder.environment import Environment
from fsdp_builder.errors import MaterializationError, config_error
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


def allocate_empty(
    modules: list[nn.Module], device: torch.device, *, only_meta: bool = True
) -> int:
    """``to_empty`` each module that owns states (only those with a state on meta unless
    ``only_meta`` is False), then re-tie parameters that were shared (``to_empty`` gives every
    module its own new tensor, which would untie them). States that were already real keep
    their values in the new storage: an initializer that does not write them (a buffer filled
    in ``__init__``) never leaves them uninitialized. Returns the bytes given storage."""
    tied = _tied_groups(modules)
    allocated = 0
    for m in modules:
        own = _direct_states(m)
        if own and (not only_meta or any(t.is_meta for t in own)):
            real = [
                (name, t)
                for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
                if not t.is_meta
            ]
            m.to_empty(device=device, recurse=False)
            with torch.no_grad():
                for name, old in real:
                    new = getattr(m, name)
                    if new is not old:
                        new.copy_(old)
            allocated += sum(t.numel() * t.element_size() for t in _direct_states(m))
    for slots in tied:
        owner, name = slots[0]
        shared = getattr(owner, name)
        for m, n in slots[1:]:
            setattr(m, n, shared)
    return allocated


# torch.nn modules that own parameters but whose initializer is private. Found by scanning every
# nn.Module subclass in torch.nn for direct parameters without ``reset_parameters``.
_PRIVATE_INITIALIZERS: dict[type[nn.Module], str] = {
    nn.MultiheadAttention: "_reset_parameters",
}

# torch.nn modules whose private initializer re-initializes their whole subtree after the children
# built themselves (nn.Transformer applies Xavier to every matrix). Without it, a Transformer
# materialized from meta would get each Linear's default init, not the distribution its
# constructor gives.
_SUBTREE_INITIALIZERS: dict[type[nn.Module], str] = {
    nn.Transformer: "_reset_parameters",
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


def subtree_initializer_of(
    module: nn.Module, owned: Iterable[nn.Module]
) -> Callable[[], object] | None:
    """A known subtree initializer of ``module``, when every module below it is in ``owned``
    (it must not touch states of nested units, which are already sharded, or ignored ones)."""
    for cls, attr in _SUBTREE_INITIALIZERS.items():
        if isinstance(module, cls):
            own = {id(m) for m in owned}
            if all(id(m) in own for m in module.modules()):
                return getattr(module, attr)
            log.debug("subtree_initializer_skipped", module_type=type(module).__name__)
    return None


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the generators an initializer draws from for tensors on ``device`` (always the
    CPU's). Cheaper than ``torch.manual_seed``, which also queues a seed, with a recorded stack
    trace, for every accelerator type that is not initialized: per module that adds up."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def derived_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed for one module, from the user's seed and the module's qualified name: the
    same on every rank and for every world size, and unrelated between modules."""
    digest = hashlib.blake2b(f"{seed}/{fqn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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


def _qualified(prefix: str, name: str) -> str:
    return ".".join(x for x in (prefix, name) if x)


class BaseMaterializer:
    """Optional base: subclasses override ``init_module`` (called per owned module in
    children-first order after storage is allocated), or ``materialize`` for full control.

    ``reinitialize``: initialize every owned module even when nothing is on meta (a deterministic
    initializer), on ``storage_device`` when it is set instead of the compute device.
    """

    reinitialize: bool = False
    storage_device: torch.device | None = None
    # Whether ``materialize`` runs collectives (the pipeline then agrees before it); a subclass
    # that only works locally sets False and saves ranks an agreement per unit.
    communicates: ClassVar[bool] = True

    def check(self, plan: UnitPlan, ignored: IgnoredStates) -> None:
        return None

    def init_module(self, module: nn.Module, fqn: str) -> None:
        raise NotImplementedError

    def init_owned(self, module: nn.Module, fqn: str, owned: list[nn.Module]) -> None:
        """``init_module`` with the unit's owned modules (for initializers that cover a
        subtree); the default ignores them."""
        self.init_module(module, fqn)

    def wants(self, module: nn.Module, owned: list[nn.Module]) -> bool:
        """Whether ``init_module`` is called for ``module``."""
        return bool(_direct_states(module)) or subtree_initializer_of(module, owned) is not None

    def materialize(self, unit: Unit, env: Environment) -> int:
        return self.materialize_modules(
            unit.module,
            unit.fqn,
            env.device,
            unit_modules(unit.module, env.ignored.modules),
            env.ignored,
        )

    def materialize_modules(
        self,
        root: nn.Module,
        root_fqn: str,
        device: torch.device,
        modules: list[nn.Module],
        ignored: IgnoredStates | None = None,
    ) -> int:
        """Give ``modules`` (the owned modules below ``root``, named from ``root_fqn``) storage
        and values; returns the bytes given storage. Real ignored parameters keep their values,
        even when their module's initializer writes them."""
        ignored = ignored or IgnoredStates()
        if not self.reinitialize and not needs_materialization(modules, ignored):
            return 0
        names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        kept = [
            (m, name, p.detach().clone())
            for m in modules
            for name, p in m.named_parameters(recurse=False)
            if p in ignored.params and not p.is_meta
        ]
        allocated = allocate_empty(
            modules, self.storage_device or device, only_meta=not self.reinitialize
        )
        # Children first: a parent's initializer may set its children's values (as
        # MultiheadAttention zeroes out_proj.bias), and must win, as at construction.
        with torch.no_grad():
            for module in reversed(modules):
                if not self.wants(module, modules):
                    continue
                fqn = _qualified(root_fqn, names.get(id(module), ""))
                try:
                    self.init_owned(module, fqn, modules)
                except MaterializationError:
                    raise
                except Exception as exc:
                    raise MaterializationError(
                        f"Initializing '{fqn or '<root>'}' ({type(module).__name__}) with "
                        f"`{type(self).__name__}` failed: {type(exc).__name__}: {exc}. Fix its "
                        "initializer or pass another materializer."
                    ) from exc
            for module, name, value in kept:
                getattr(module, name).copy_(value)
        return allocated

    def materialize_model(
        self, model: nn.Module, wrap: Any = None, device: torch.device | str = "cpu"
    ) -> nn.Module:
        """Materialize a whole unsharded ``model`` on one process, unit by unit in the order a
        build with the same ``wrap`` policy uses; the single-process reference for a build."""
        from fsdp_builder.ignored import resolve_ignored
        from fsdp_builder.plan import plan_units
        from fsdp_builder.wrap import WrapPolicy

        ignored = resolve_ignored(model)
        plan = plan_units(model, WrapPolicy.of(wrap), ignored)
        self.check(plan, ignored)
        unit_set = {u.module for u in plan}
        for unit in plan:
            # Nested units are not wrapped here, so the walk must stop at them explicitly.
            stop = set(ignored.modules) | (unit_set - {unit.module})
            self.materialize_modules(
                unit.module,
                unit.fqn,
                torch.device(device),
                unit_modules(unit.module, stop),
                ignored,
            )
        return model


def _uninitializable(plan: UnitPlan, ignored: IgnoredStates, meta_only: bool) -> list[str]:
    missing: list[str] = []
    for unit in plan:
        names = {id(m): n for n, m in unit.module.named_modules()}
        for m in unit_modules(unit.module, ignored.modules):
            own = _direct_states(m)
            if not own or (meta_only and not any(t.is_meta for t in own)):
                continue
            if initializer_of(m) is None:
                missing.append(
                    f"{_qualified(unit.fqn, names.get(id(m), '')) or '<root>'} ({type(m).__name__})"
                )
    return missing


def _run_initializer(module: nn.Module, fqn: str, owned: list[nn.Module]) -> None:
    init = initializer_of(module) if _direct_states(module) else None
    if init is not None:
        init()
    subtree = subtree_initializer_of(module, owned)
    if subtree is not None:
        subtree()
    if init is None and subtree is None:  # refused by check(); reached only when bypassed
        raise MaterializationError(
            f"'{fqn or '<root>'}' ({type(module).__name__}) has no reset_parameters(); add one."
        )


@frozen
class ResetParameters(BaseMaterializer):
    """``to_empty`` + ``reset_parameters()`` for each owned module that has states on meta
    (``nn.MultiheadAttention``'s and ``nn.Transformer``'s private initializers included).

    Modules not on meta are left as they are, so ranks that already hold real weights keep them.
    Values come from each rank's global RNG: seed every rank alike, or follow with a synchronizer.
    """

    communicates: ClassVar[bool] = False

    @override
    def check(self, plan: UnitPlan, ignored: IgnoredStates) -> None:
        missing = _uninitializable(plan, ignored, meta_only=True)
        if missing:
            raise MaterializationError(
                "`ResetParameters` cannot initialize these modules on the meta device because "
                f"they have no reset_parameters(): {', '.join(missing)}. Add a "
                "reset_parameters() method to them, or use InitFn(fn) / FromStateDict(...)."
            )

    @override
    def init_module(self, module: nn.Module, fqn: str) -> None:
        _run_initializer(module, fqn, [module])

    @override
    def init_owned(self, module: nn.Module, fqn: str, owned: list[nn.Module]) -> None:
        _run_initializer(module, fqn, owned)


def _check_callable(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not callable(value):
        raise config_error(
            type(instance).__name__,
            attribute.name,
            f"expected a callable taking a module, got {type(value).__name__} {value!r}",
            "Pass a function such as `lambda m: m.reset_parameters()`.",
        )


@frozen
class InitFn(BaseMaterializer):
    """Calls ``fn(module)`` for every module a unit owns, children first, when any of them has a
    state on meta, after storage was allocated on the compute device (the seed's
    ``param_init_fn``; ``fn`` need not call ``to_empty`` itself, tied parameters are already
    re-tied, and real states keep their values unless ``fn`` writes them).

    ``fn`` must not run collectives: the builder treats this step as local (one agreement per
    unit); write a Materializer with ``communicates = True`` for an initializer that does."""

    communicates: ClassVar[bool] = False

    fn: Callable[[nn.Module], object] = attrs.field(validator=_check_callable)

    @override
    def init_owned(self, module: nn.Module, fqn: str, owned: list[nn.Module]) -> None:
        """``init_module`` with the unit's owned modules (for initializers that cover a
        subtree); the default ignores them."""
        self.init_module(module, fqn)

    def wants(self, module: nn.Module, owned: list[nn.Module]) -> bool:
        return True

    @override
    def init_module(self, module: nn.Module, fqn: str) -> None:
        self.fn(module)


def check_seed(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: a seed is an int in [0, 2**63)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise config_error(
            type(instance).__name__,
            attribute.name,
            f"expected an int in [0, 2**63), got {value!r}",
            f"Pass a non-negative integer seed, e.g. {type(instance).__name__}(seed=0).",
        )


@frozen
class DeterministicInit(ResetParameters):
    """World-size-invariant initialization: every owned module of every unit is initialized on
    the CPU by its own initializer under an RNG seeded from ``seed`` and the module's qualified
    name, then the unit is moved and sharded as usual.

    The full weights depend only on ``seed`` and the model: bit-identical for any world size,
    sharding strategy or backend, and equal to ``DeterministicInit(seed).materialize_model(m)``
    on one process. States that are already real are re-initialized too (the seed decides).
    """

    seed: int = attrs.field(default=0, validator=check_seed)
    reinitialize: bool = attrs.field(default=True, init=False)
    # Initializing on the CPU keeps the values independent of the compute device's RNG.
    storage_device: torch.device | None = attrs.field(
        default=torch.device("cpu"), init=False, eq=False
    )

    @override
    def check(self, plan: UnitPlan, ignored: IgnoredStates) -> None:
        missing = _uninitializable(plan, ignored, meta_only=False)
        if missing:
            raise MaterializationError(
                f"`DeterministicInit` cannot initialize these modules because they have no "
                f"reset_parameters(): {', '.join(missing)}. Add a reset_parameters() method to "
                "them, or use InitFn(fn) / FromStateDict(...)."
            )

    @override
    def init_owned(self, module: nn.Module, fqn: str, owned: list[nn.Module]) -> None:
        with torch.random.fork_rng(devices=[]):
            seed_generators(derived_seed(self.seed, fqn), torch.device("cpu"))
            _run_initializer(module, fqn, owned)


@frozen
class DeferredInit(BaseMaterializer):
    """Materializes modules built under torchdistX's ``deferred_init`` by replaying their
    recorded construction. Needs the optional ``torchdistx`` package."""

    communicates: ClassVar[bool] = False

    def __attrs_post_init__(self) -> None:
        try:
            import torchdistx.deferred_init  # noqa: F401
        except ImportError as exc:
            raise config_error(
                "DeferredInit",
                "materializer",
                f"the torchdistx package does not import ({exc})",
                "Install torchdistx, or build the model on the meta device and use "
                "ResetParameters() or DeterministicInit(seed)",
            ) from exc

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        from torchdistx import deferred_init, fake

        modules = unit_modules(unit.module, env.ignored.modules)
        owned = {id(m) for m in modules}
        fakes = [t for m in modules for t in _direct_states(m) if fake.is_fake(t)]
        if not fakes:
            return 0
        deferred_init.materialize_module(unit.module, check_fn=lambda m: id(m) in owned)
        return sum(t.numel() * t.element_size() for t in fakes)


@frozen
class KeepAsIs(BaseMaterializer):
    """Materializes nothing; a model with meta states is refused before any collective."""

    communicates: ClassVar[bool] = False

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
