"""Materializer role: give a unit's own meta states storage and values, one unit at a time.
Per-build state lives in the :class:`MaterializerRun` from ``prepare(env)``, so materializer
objects stay immutable and shareable."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import attrs
import torch
from attrs import define, frozen
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

from fsdp_builder.common.describe import listed
from fsdp_builder.common.hashing import digest63
from fsdp_builder.common.hooks import DeclaredHooks, check_role
from fsdp_builder.common.logs import warn_user
from fsdp_builder.config import ShardingOptions
from fsdp_builder.errors import MaterializationError, checked, config_error
from fsdp_builder.materializers.buffers import (
    Computed,
    compute_buffers,
    fill_buffers,
    nonpersistent_meta,
)
from fsdp_builder.materializers.conventions import (
    _SUBTREE_RULES,
    NO_LINEAGE,
    Lineage,
    ModuleInitializer,
    _direct,
    _registered,
    _unwritten,
    _version,
    initializer_of,
    library_gap_error,
    lineages,
    shallow_copy,
    torch_initializer,
    unit_lineages,
)
from fsdp_builder.materializers.ignored import (
    has_meta_ignored,
    ignored_slots,
    reseat,
    settling_ignored,
)
from fsdp_builder.planning.context import BackendCapabilities, ConfigureContext
from fsdp_builder.planning.ignored import IgnoredStates, clean_name
from fsdp_builder.planning.plan import Unit, UnitPlan
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.tree import (
    allocate_empty,
    direct_states,
    has_meta_states,
    has_states,
    module_names,
    needs_materialization,
    qualified,
    retie,
    tied_groups,
    unit_modules,
)

# The backend a single-process reference (``materialize_model``) stands for: none shards.
_REFERENCE = BackendCapabilities(
    "reference", "materialize_model", supports_shard_first=True, shard_communicates=False
)


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and ``device``'s. Not ``torch.manual_seed``: it also queues a
    seed with a recorded stack trace for every uninitialized accelerator, costly per module."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


class PrivateDraws(TorchDispatchMode):
    """On this thread, torch's random ops given no generator draw from private ones seeded by
    ``reseed``: another thread drawing from torch's process-wide generators meanwhile (a data
    loader) cannot change them, nor they its draws. A private generator gives the numbers the
    process-wide one gives after the same seed. Ops without a generator overload (none that
    draw, in torch 2.13) still draw from torch's, which the callers seed alike."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def reseed(self, seed: int) -> None:
        self.seed = seed
        for generator in self.generators.values():
            generator.manual_seed(seed)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        drawing = _with_generator(func)
        if drawing is not None and kwargs.get("generator") is None:
            device = _device_of(args, kwargs)
            if device.type in ("cpu", "cuda"):
                generator = self.generators.get(device)
                if generator is None:
                    generator = torch.Generator(device=device).manual_seed(self.seed)
                    self.generators[device] = generator
                return drawing(*args, **{**kwargs, "generator": generator})
        return func(*args, **kwargs)


_NO_OVERLOAD = object()
_OVERLOADS: dict[Any, Any] = {}


def _with_generator(func: Any) -> Any:
    """``func`` if it takes a generator, else its overload that does with the same other
    arguments (``randn`` -> ``randn.generator``), else None."""
    found = _OVERLOADS.get(func, _NO_OVERLOAD)
    if found is _NO_OVERLOAD:
        names = [a.name for a in func._schema.arguments]
        found = func if "generator" in names else None
        if found is None:
            packet = func.overloadpacket
            for overload in packet.overloads():
                other = getattr(packet, overload)
                others = [a.name for a in other._schema.arguments]
                if "generator" in others and [n for n in others if n != "generator"] == names:
                    found = other
                    break
        _OVERLOADS[func] = found
    return found


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """Where a random op draws: its ``device`` argument, else its first tensor's; a factory
    given none draws on the CPU (torch's default device is filled in above the dispatcher)."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")


def derived_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed for one module from ``seed`` and its name, the same at any world size."""
    return digest63(f"{seed}/{fqn}")


def buffers_to_compute(
    model: nn.Module, ignored: IgnoredStates, *, initialized: bool = True
) -> Computed:
    """The model's non-persistent meta buffers that no module initializer sets (all of them
    when ``initialized`` is False: a loader runs none), computed by the whole-model one."""
    modules = [m for m in model.modules() if m not in ignored.modules]
    candidates = nonpersistent_meta(modules)
    if not candidates:
        return {}
    found = lineages(model) if initialized else {}
    wanted = [
        (m, name)
        for m, name in candidates
        if not initialized or initializer_of(m, found.get(id(m), NO_LINEAGE)) is None
    ]
    return compute_buffers(model, wanted)


@runtime_checkable
class MaterializerRun(Protocol):
    """One build's materialization: called per unit, closed once."""

    def materialize(self, unit: Unit) -> int:
        """Give the unit's own modules storage and values; return the bytes given storage."""
        ...

    def close(self) -> None:
        """Release what the build held; called on every rank, after success or failure."""
        ...


@runtime_checkable
class Materializer(Protocol):
    """Turns a unit's meta states into real ones on ``env.device``.

    ``communicates``: ``materialize`` runs collectives, so it must fail on every rank alike or
    only after its last collective. ``shard_first``: units are sharded on meta and
    ``materialize`` fills only the local shards (where the backend ``supports_shard_first``),
    but units under an optional ``whole_below`` (parameter bytes), filled whole first.
    """

    @property
    def communicates(self) -> bool: ...

    @property
    def shard_first(self) -> bool: ...

    def check_context(self, context: ConfigureContext) -> None:
        """Local, pure check before any collective; raise naming the fix to refuse."""
        ...

    def prepare(self, env: Environment) -> MaterializerRun:
        """Start one build on every rank, after the groups exist; may communicate."""
        ...


def placed_states(context: ConfigureContext) -> list[tuple[str, torch.Tensor]]:
    """The states the units own that are DTensors before the build (tensor parallelism on
    other mesh dims), by name; children sharded before the build are no unit's."""
    return [
        (state.name, t)
        for unit in context.plan
        for state in unit.owned
        if isinstance(t := state.tensor, DTensor)
    ]


def names_below(root: nn.Module, root_fqn: str, modules: list[nn.Module]) -> dict[int, str]:
    """Module id -> clean name of ``modules``, found below ``root`` (a unit's ``fqn_of`` has
    them without a walk)."""
    names = module_names(root)
    return {id(m): clean_name(qualified(root_fqn, names.get(id(m), ""))) for m in modules}


def initialize_modules(
    root: nn.Module,
    root_fqn: str,
    modules: list[nn.Module],
    init: Callable[[nn.Module, str], None],
    who: str,
    fix: str,
    fqns: Mapping[int, str] | None = None,
    parents_first: bool = False,
) -> None:
    """``init(module, fqn)`` over breadth-first ``modules``, children first unless ``parents_first``
    (a parent may set its children's values and must win, as at construction). ``fqns``: each
    module's clean name by id (a unit's ``fqn_of``); by default, named below ``root``."""
    if fqns is None:
        fqns = names_below(root, root_fqn, modules)
    with torch.no_grad():
        for module in modules if parents_first else reversed(modules):
            fqn = fqns[id(module)]
            try:
                init(module, fqn)
            except MaterializationError:
                raise
            except Exception as exc:
                raise MaterializationError(
                    f"Initializing '{fqn or '<root>'}' ({type(module).__name__}) with `{who}` "
                    f"failed: {type(exc).__name__}: {exc}. {fix}"
                ) from exc


@define
class _PerUnit:
    """A run that keeps only the build's computed non-persistent buffers between units."""

    materializer: BaseMaterializer
    env: Environment
    computed: Computed

    def materialize(self, unit: Unit) -> int:
        done = self.materializer.materialize(unit, self.env)
        if self.computed:
            done += fill_buffers(list(unit.modules), self.computed, self.env.device)
        return done

    def close(self) -> None:
        self.computed.clear()


class BaseMaterializer(DeclaredHooks):
    """Optional base: override ``init_module`` (per owned module, children first, after
    storage is allocated), ``materialize`` for full control, or ``prepare`` for per-build state.

    ``reinitialize``: initialize every owned module even when nothing is on meta, on
    ``storage_device`` when set.
    """

    __slots__ = ()

    reinitialize: bool = False
    storage_device: torch.device | None = None
    # A local subclass sets False and saves ranks an agreement per unit.
    communicates: ClassVar[bool] = True
    shard_first: ClassVar[bool] = False
    library_conventions: ClassVar[bool] = False

    def check_context(self, context: ConfigureContext) -> None:
        """Accept everything; a subclass overrides it to refuse (see the protocol)."""
        return None

    def prepare(self, env: Environment) -> MaterializerRun:
        return _PerUnit(self, env, buffers_to_compute(env.plan.root.module, env.ignored))

    def init_module(self, module: nn.Module, fqn: str) -> None:
        raise NotImplementedError

    def init_owned(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        """``init_module`` given the ancestors' ``lineage``; the default ignores it."""
        self.init_module(module, fqn)

    def wants(self, module: nn.Module, owned: list[nn.Module]) -> bool:
        """Whether ``init_module`` is called for ``module``."""
        return has_states(module)

    def materialize(self, unit: Unit, env: Environment) -> int:
        return self.materialize_modules(
            unit.module,
            unit.fqn,
            env.device,
            list(unit.modules),
            env.ignored,
            model=env.plan.root.module,
            fqns=unit.fqn_of,
        )

    def materialize_modules(
        self,
        root: nn.Module,
        root_fqn: str,
        device: torch.device,
        modules: list[nn.Module],
        ignored: IgnoredStates | None = None,
        model: nn.Module | None = None,
        *,
        fqns: Mapping[int, str] | None = None,
    ) -> int:
        """Give ``modules`` (owned, below ``root``) storage and values; returns the bytes given
        storage. ``model`` (default ``root``) is the whole model, for subtree rules; ``fqns``:
        the modules' names (a unit's ``fqn_of``), else found below ``root``."""
        ignored = ignored or IgnoredStates()
        if (
            not self.reinitialize
            and not needs_materialization(modules, ignored)
            and not has_meta_ignored(modules, ignored)
        ):
            return 0
        found = unit_lineages(model if model is not None else root, root, root_fqn, modules)

        def visits(module: nn.Module) -> bool:
            # A library's model-level initializer may set a child's states from its parent
            # (GPT-2 scales c_proj from its attention block), so it visits stateless modules.
            lineage = found.get(id(module), NO_LINEAGE)
            return (self.library_conventions and lineage.library_init is not None) or self.wants(
                module, modules
            )

        # A `wants` of one's own may skip modules: only what a visit can write gets storage, so
        # a skipped module keeps its meta states (refused at the unit), not uninitialized memory.
        visited: set[int] | None = None
        if type(self).wants is not BaseMaterializer.wants:
            visited = {id(m) for m in modules if visits(m)}

        def init(module: nn.Module, fqn: str) -> None:
            wanted = visits(module) if visited is None else id(module) in visited
            if wanted:
                self.init_owned(module, fqn, found.get(id(module), NO_LINEAGE))

        storage = self.storage_device or device
        given = modules if visited is None else _written_by_visits(modules, visited)
        # States already real keep their values (the contract, as FSDP1's param_init_fn leaves
        # modules not on meta alone): a unit can mix them with meta ones, and an initializer
        # run for the unit (a real module's own, or a parent's that sets its children) would
        # overwrite them. Only such mixed units pay for the copies.
        kept = [] if self.reinitialize else _real_states(modules, ignored)
        with settling_ignored(modules, ignored, storage, device, model or root):
            allocated = allocate_empty(given, storage, only_meta=not self.reinitialize)
            initialize_modules(
                root,
                root_fqn,
                modules,
                init,
                type(self).__name__,
                "Fix its initializer or pass another materializer.",
                fqns,
            )
            with torch.no_grad():
                for state, value in kept:
                    state.data.copy_(value)  # through .data: no write for version watchers
        return allocated

    def materialize_model(
        self, model: nn.Module, wrap: Any = None, device: torch.device | str = "cpu"
    ) -> nn.Module:
        """Materialize an unsharded ``model`` in one process, in the unit order of a build
        with the same ``wrap``: the single-process reference."""
        from fsdp_builder.planning.ignored import resolve_ignored
        from fsdp_builder.planning.plan import plan_units
        from fsdp_builder.planning.wrap import WrapPolicy

        ignored = resolve_ignored(model)
        plan = plan_units(model, WrapPolicy.of(wrap), ignored)
        device = torch.device(device)
        context = ConfigureContext(model, plan, ignored, ShardingOptions(), _REFERENCE, device)
        check_role(self, context, former="check")
        plan.tie_declared()  # as a build does once its checks passed
        computed = buffers_to_compute(model, ignored)
        for unit in plan:
            modules = list(unit.modules)
            self.materialize_modules(
                unit.module, unit.fqn, device, modules, ignored, model=model, fqns=unit.fqn_of
            )
            fill_buffers(modules, computed, device)
        return model


def _real_states(
    modules: list[nn.Module], ignored: IgnoredStates
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each managed state of ``modules`` that is already real, with a copy of its value; none
    when every state is on meta (the common case: a unit built on meta)."""
    states = [t for m in modules for t in direct_states(m) if not ignored.ignores(t)]
    if all(t.is_meta for t in states):
        return []
    seen: set[int] = set()
    kept = []
    for t in states:
        if not t.is_meta and id(t) not in seen:
            seen.add(id(t))
            kept.append((t, t.detach().clone()))
    return kept


def _written_by_visits(modules: list[nn.Module], visited: set[int]) -> list[nn.Module]:
    """The ``modules`` a visit may write: those visited, those below one (a parent's initializer
    may set its children's states), and those sharing a state with either (ties)."""
    covered = set(visited)
    for m in modules:  # breadth-first: a parent comes before its children
        if id(m) in covered:
            covered.update(id(c) for c in m.children())
    shared = {id(t) for m in modules if id(m) in covered for t in direct_states(m)}
    return [
        m for m in modules if id(m) in covered or any(id(t) in shared for t in direct_states(m))
    ]


def _uninitializable(plan: UnitPlan, ignored: IgnoredStates, meta_only: bool) -> list[str]:
    """Named modules with states to initialize and no initializer; raises if a library
    initializer leaves a state unwritten."""
    model = plan.root.module
    found = lineages(model)
    refused: list[nn.Module] = []
    gaps: list[tuple[nn.Module, list[str], ModuleInitializer]] = []
    seen: set[int] = set()  # a module shared by two units is named once
    for m in (m for unit in plan for m in unit.modules):
        if id(m) in seen or not (has_meta_states(m) if meta_only else has_states(m)):
            continue
        seen.add(id(m))
        lineage = found.get(id(m), NO_LINEAGE)
        if initializer_of(m, lineage) is None:
            if not _only_nonpersistent_buffers(m):  # those are computed for the build
                refused.append(m)
        elif lineage.library_init is not None and (left := _library_gaps(m, lineage, ignored)):
            gaps.append((m, left, lineage.library_init))
    if not refused and not gaps:
        return []
    # Named in the order of one walk of the model (the units hold the same modules).
    place = {id(m): i for i, m in enumerate(unit_modules(model, ignored.modules))}
    refused.sort(key=lambda m: place.get(id(m), len(place)))
    gaps.sort(key=lambda gap: place.get(id(gap[0]), len(place)))
    names = module_names(model)  # only to name what is refused

    def name(m: nn.Module) -> str:
        return clean_name(names.get(id(m), "")) or "<root>"

    if not refused:
        m, left, library = gaps[0]
        raise library_gap_error(library, m, left, f" ('{name(m)}')", len(gaps) - 1)
    return [f"{name(m)} ({type(m).__name__})" for m in refused]


def _library_gaps(module: nn.Module, lineage: Lineage, ignored: IgnoredStates) -> list[str]:
    """Direct states that the library's ``_init_weights`` leaves unwritten and nothing else
    writes, run on a stand-in (the model does not change); one that fails is left to the build."""
    library = lineage.library_init
    if library is None or _registered(module) is not None or torch_initializer(module):
        return []
    states = _direct(module)
    if all((id(module), n) in lineage.tied for n, _ in states):  # tied-only: not initialized
        return []
    settled = {id(p) for p in ignored.params}  # ignored parameters keep their own values
    if sum(t.numel() for _, t in states) > _PROBE_ELEMENTS:
        return []  # too large to probe on real storage: the build checks it
    probe = _stand_in(module, {})
    versions = {n: _version(t) for n, t in _direct(probe)}
    try:
        with torch.no_grad():
            library(probe)
    except Exception:
        return []
    own = dict(states)
    return [n for n in _unwritten(probe, versions) if id(own.get(n)) not in settled]


# The probe needs real CPU storage: torch's initializers skip meta tensors (``trunc_normal_``
# returns at once), so on meta they would look unwritten. Larger modules are not probed.
_PROBE_ELEMENTS = 1 << 22


def _stand_in(module: nn.Module, memo: dict[int, Any], device: str = "cpu") -> nn.Module:
    """A shallow copy of ``module``'s subtree, fresh states: its own on ``device``, others meta."""
    if id(module) in memo:
        return cast(nn.Module, memo[id(module)])
    probe = shallow_copy(module)
    memo[id(module)] = probe
    for key in ("_parameters", "_buffers"):
        states = getattr(module, key).items()
        probe.__dict__[key] = {n: None if t is None else _like(t, memo, device) for n, t in states}
    probe.__dict__["_modules"] = {
        n: None if c is None else _stand_in(c, memo, "meta") for n, c in module._modules.items()
    }
    return probe


def _like(tensor: torch.Tensor, memo: dict[int, Any], device: str) -> torch.Tensor:
    if id(tensor) not in memo:
        fresh = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=device)
        if isinstance(tensor, nn.Parameter):
            fresh = nn.Parameter(fresh, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fresh
    return cast(torch.Tensor, memo[id(tensor)])


def _only_nonpersistent_buffers(module: nn.Module) -> bool:
    """The module owns nothing but non-persistent buffers (which the build computes)."""
    names = [n for n, _ in _direct(module)]
    return bool(names) and all(n in module._non_persistent_buffers_set for n in names)


def run_initializer(module: nn.Module, fqn: str, lineage: Lineage = NO_LINEAGE) -> None:
    """The module's initializer, then its ancestors' subtree rules on its parameters."""
    init = initializer_of(module, lineage)
    if init is None and _only_nonpersistent_buffers(module):
        return  # its buffers are computed for the build and filled after
    if init is None:  # refused in configure; reached only when bypassed
        raise MaterializationError(
            f"'{fqn or '<root>'}' ({type(module).__name__}) has no reset_parameters(); add one."
        )
    init()
    for rule in lineage.rules:
        for name, param in module._parameters.items():
            if param is not None and (id(module), name) not in lineage.tied:
                rule(param)


@frozen
class ResetParameters(BaseMaterializer):
    """``to_empty`` + each meta module's initializer: ``reset_parameters()``, a registered one,
    or a transformers model's ``_init_weights`` (what ``Model(config)`` gives).

    Modules not on meta keep their values. Values come from each rank's global RNG: seed every
    rank alike, or follow with a synchronizer.

    Raises:
        MaterializationError: in configure, naming every meta module without an initializer;
            during the build, naming the module whose initializer failed.

    Example:
        ```python
        with torch.device("meta"):
            model = Transformer(cfg)
        FSDPBuilder().wrap(Block).materialize(ResetParameters()).build(model)
        ```
    """

    communicates: ClassVar[bool] = False
    library_conventions: ClassVar[bool] = True

    @override
    def check_context(self, context: ConfigureContext) -> None:
        # A reinitializing subclass (DeterministicInit) initializes real modules too.
        meta_only = not self.reinitialize
        missing = _uninitializable(context.plan, context.ignored, meta_only)
        if missing:
            raise MaterializationError(
                f"`{type(self).__name__}` cannot initialize these modules"
                f"{' on the meta device' if meta_only else ''} because they have no initializer: "
                f"{', '.join(missing)}. Give their class a reset_parameters() method, or register "
                "one with `fsdp_builder.register_initializer(TheirClass, fn)` (fn(module) sets the "
                "module's own states in place), or load their values with FromCheckpoint(path) / "
                "FromStateDict(...)."
            )

    @override
    def init_module(self, module: nn.Module, fqn: str) -> None:
        run_initializer(module, fqn)

    @override
    def init_owned(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        run_initializer(module, fqn, lineage)


@frozen
class InitFn(BaseMaterializer):
    """Calls ``fn(module)`` with FSDP1's ``param_init_fn`` contract: per module of a unit,
    parents first, while its states are on meta; ``fn`` gives them storage and values. The same
    ``fn`` gives the same weights as FSDP1; ties within a unit are restored afterwards.

    ``allocate=True``: the builder allocates storage first and calls ``fn`` children first, so
    ``fn`` only writes values. ``fn`` must not run collectives.

    A state left on meta, or given storage ``fn`` never writes (writes are watched, values never
    read), is an error; with ``BroadcastFromRank0`` only rank 0's states are judged.

    Raises:
        ConfigurationError: ``fn`` is not callable.
        MaterializationError: ``fn`` failed on a module, or left a state on meta or unwritten
            (naming the states).

    Example:
        ```python
        def param_init_fn(module):  # as for FullyShardedDataParallel(param_init_fn=...)
            if any(t.is_meta for t in module.parameters(recurse=False)):
                module.to_empty(device="cpu", recurse=False)
                module.reset_parameters()

        FSDPBuilder().wrap(Block).materialize(InitFn(param_init_fn)).build(model)
        ```
    """

    communicates: ClassVar[bool] = False

    fn: Callable[[nn.Module], object] = attrs.field(
        validator=checked(
            attrs.validators.is_callable(),
            "a callable taking a module",
            "Pass a function such as `lambda m: m.reset_parameters()`.",
        )
    )
    allocate: bool = attrs.field(
        default=False,
        validator=checked(
            attrs.validators.instance_of(bool),
            "True or False",
            "Pass allocate=True to have the builder allocate storage before fn writes values, "
            "or leave it out (fn allocates, as FSDP1's param_init_fn does).",
        ),
    )

    @override
    def check_context(self, context: ConfigureContext) -> None:
        """Warn for each registered parent whose subtree holds units of its own, naming them."""
        plan = context.plan
        for fqn, module in plan.root.module.named_modules():
            if not any(isinstance(module, cls) for cls in _SUBTREE_RULES):
                continue
            below = {id(m) for m in module.modules() if m is not module}
            units = [u.label for u in plan if id(u.module) in below]
            if units:
                warn_user(
                    f"`InitFn` does not apply the subtree initializer of "
                    f"'{clean_name(fqn) or '<root>'}' to the units below it "
                    f"({listed(units)}): they keep their "
                    "own modules' initialization. Use ResetParameters() or DeterministicInit(seed)"
                    ", which apply it, or initialize those units the way the parent would in your "
                    "function."
                )

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        return self.materialize_modules(
            unit.module,
            unit.fqn,
            env.device,
            list(unit.modules),
            env.ignored,
            fqns=unit.fqn_of,
            # When the synchronizer overwrites with rank 0's values, only they count.
            judge_unwritten=not env.values_from_rank0 or env.rank == 0,
        )

    @override
    def materialize_modules(
        self,
        root: nn.Module,
        root_fqn: str,
        device: torch.device,
        modules: list[nn.Module],
        ignored: IgnoredStates | None = None,
        model: nn.Module | None = None,
        *,
        fqns: Mapping[int, str] | None = None,
        judge_unwritten: bool = True,
    ) -> int:
        ignored = ignored or IgnoredStates()
        if not needs_materialization(modules, ignored) and not has_meta_ignored(modules, ignored):
            return 0
        pending = [(m, n, t) for m in modules for n, t in _named_direct(m) if t.is_meta]
        # fn may replace an ignored parameter (to_empty): put back the one FSDP ignores.
        ignored_meta = [s for s in ignored_slots(modules, ignored) if s[2].is_meta]
        named = fqns if fqns is not None else names_below(root, root_fqn, modules)

        def fqn_of(module: nn.Module, name: str) -> str:
            return qualified(named[id(module)], name)

        if self.allocate:
            allocate_empty(modules, device)
        given = {(id(m), n): _storage_key(getattr(m, n)) for m, n, _ in pending}
        writes = WriteWatch()

        def call(module: nn.Module, _fqn: str) -> None:
            with writes:
                self.fn(module)

        tied = [] if self.allocate else tied_groups(modules)
        initialize_modules(
            root,
            root_fqn,
            modules,
            call,
            "InitFn",
            "Fix the function, or pass another materializer.",
            named,
            parents_first=not self.allocate,  # FSDP1's order, unless fn only writes values
        )
        retie(tied)
        reseat(ignored_meta)
        left = [fqn_of(m, n) for m, n, _ in pending if getattr(m, n).is_meta]
        unwritten = [
            fqn_of(m, n)
            for m, n, _ in pending
            if judge_unwritten and writes.unwritten(getattr(m, n), given[(id(m), n)])
        ]
        problems = [f"still on the meta device: {listed(left)}"] if left else []
        if unwritten:
            problems.append(f"given storage but never written: {listed(unwritten)}")
        if problems:
            fix = (
                "With InitFn(fn, allocate=True), fn must write every parameter and buffer of "
                "the module it is given."
                if self.allocate
                else "fn must give every meta state of the module it is given storage and "
                "values, e.g. `module.to_empty(device=..., recurse=False)` then "
                "`module.reset_parameters()`, as FSDP1's param_init_fn does; or use "
                "InitFn(fn, allocate=True) to have the builder allocate the storage."
            )
            raise MaterializationError(
                f"`InitFn` left states of unit '{root_fqn or '<root>'}' "
                f"{'; '.join(problems)}. {fix}"
            )
        return sum(t.numel() * t.element_size() for _, _, t in pending)


def _named_direct(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


_ALLOCATORS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The storage address (local only); None where there is none to judge (meta, empty, a
    subclass such as DTensor whose storage is not its own)."""
    if tensor.is_meta or tensor.numel() == 0 or type(tensor) not in (torch.Tensor, nn.Parameter):
        return None
    return int(tensor.untyped_storage().data_ptr())


class WriteWatch(TorchDispatchMode):
    """Records which storages an op mutated and which ``empty`` ops made and nobody wrote since.
    Never reads values: fresh memory may hold anything (NaN under deterministic algorithms)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()
        self.fresh: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for tensor in value if isinstance(value, list | tuple) else [value]:
                self._mark(tensor, self.written, self.fresh)
        if func.overloadpacket.__name__ in _ALLOCATORS:
            self._mark(out, self.fresh, self.written)
        return out

    @staticmethod
    def _mark(tensor: Any, add: set[int], drop: set[int]) -> None:
        key = _storage_key(tensor) if isinstance(tensor, torch.Tensor) else None
        if key is not None:
            add.add(key)
            drop.discard(key)

    def unwritten(self, tensor: torch.Tensor, given: int | None) -> bool:
        """Whether ``tensor`` (storage ``given`` before the watch) holds storage nobody wrote."""
        key = _storage_key(tensor)
        if key is None:
            return False
        if key == given:
            return key not in self.written
        return key in self.fresh


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
    """World-size-invariant initialization: each owned module, real states included, is
    initialized on the CPU under an RNG seeded from ``seed`` and its qualified name, so the full
    weights are bit-identical for any world size, sharding or backend.

    Raises:
        ConfigurationError: ``seed`` is not an int in ``[0, 2**63)``; in configure, states
            placed before the build (tensor parallelism: use ``StreamInit(seed)``).
        MaterializationError: in the configure stage, naming every module with states and no
            initializer.

    Example:
        ```python
        # The same full weights at world size 1, 8 or 512, on FSDP1 or FSDP2.
        FullyShardBuilder().wrap(Block).materialize(DeterministicInit(seed=0)).build(model)
        ```
    """

    seed: int = attrs.field(default=0, validator=check_seed)
    reinitialize: bool = attrs.field(default=True, init=False)
    # Initializing on the CPU keeps the values independent of the compute device's RNG.
    storage_device: torch.device | None = attrs.field(
        default=torch.device("cpu"), init=False, eq=False
    )

    @override
    def check_context(self, context: ConfigureContext) -> None:
        placed = [name for name, _ in placed_states(context)]
        if placed:
            raise config_error(
                type(self).__name__,
                "model",
                "these states are DTensors placed before the build (tensor parallelism): "
                f"{listed([repr(n) for n in placed])}; on them torch's initializers draw per "
                "shard, so the full weights would depend on the layout",
                "Use StreamInit(seed), whose full weights are the same with tensor parallelism "
                "too, or initialize the model before placing it",
            )
        super().check_context(context)

    @override
    def init_owned(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        seed = derived_seed(self.seed, fqn)
        with torch.random.fork_rng(devices=[]), PrivateDraws(seed):
            seed_generators(seed, torch.device("cpu"))
            run_initializer(module, fqn, lineage)


@frozen
class DeferredInit(BaseMaterializer):
    """Replays the construction of modules built under torchdistX's ``deferred_init``.

    Raises:
        ConfigurationError: at construction, when ``torchdistx`` does not import.

    Example:
        ```python
        from torchdistx.deferred_init import deferred_init

        model = deferred_init(Transformer, cfg)
        FSDPBuilder().wrap(Block).materialize(DeferredInit()).build(model)
        ```
    """

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

        owned = {id(m) for m in unit.modules}
        fakes = [t for m in unit.modules for t in direct_states(m) if fake.is_fake(t)]
        if not fakes:
            return 0
        deferred_init.materialize_module(unit.module, check_fn=lambda m: id(m) in owned)
        return sum(t.numel() * t.element_size() for t in fakes)


@frozen
class KeepAsIs(BaseMaterializer):
    """Materializes nothing; a model with meta states is refused before any collective.

    Raises:
        MaterializationError: in the configure stage, naming the states still on meta.

    Example:
        ```python
        model = Transformer(cfg)  # real weights, the same on every rank (or synchronized)
        FSDPBuilder().materialize(KeepAsIs()).synchronize(VerifyReplicas()).build(model)
        ```
    """

    communicates: ClassVar[bool] = False

    @override
    def check_context(self, context: ConfigureContext) -> None:
        plan, ignored = context.plan, context.ignored
        meta = [state.name for u in plan for state in u.owned if state.tensor.is_meta]
        if any(p.is_meta for p in ignored.params):  # materialized by the others, not here
            meta += [
                clean_name(n)
                for n, p in plan.root.module.named_parameters()
                if p.is_meta and ignored.ignores(p)
            ]
        if meta:
            raise MaterializationError(
                f"`KeepAsIs` got states on the meta device: {listed(meta)}. Pass a "
                "materializer such as "
                "ResetParameters() or build the model on a real device."
            )

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        return 0
