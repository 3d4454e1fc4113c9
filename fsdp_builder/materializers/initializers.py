"""Materializer role: give a unit's not-yet-real states (meta device) storage and values.

Works on one unit at a time and only on the modules the unit owns: the walk stops at ignored
modules and at children that are already sharded.

The pipeline calls ``check_context(context)`` before any collective, then ``prepare(env)`` once per
build on every rank; ``prepare`` returns the build's :class:`MaterializerRun`, which holds what
the build needs between units (an open checkpoint, an agreed seed) and is closed in a ``finally``
whether the build succeeds or fails. Materializer objects stay immutable and can be shared
between builders.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import attrs
import torch
from attrs import define, frozen
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

from fsdp_builder.common.hashing import digest63
from fsdp_builder.common.hooks import DeclaredHooks
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
    lineages,
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


def unreached_subtrees(plan: UnitPlan) -> list[tuple[str, list[str]]]:
    """Registered parents whose subtree holds units of its own, with those units: what a
    materializer that does not apply subtree rules leaves at the children's own init."""
    out: list[tuple[str, list[str]]] = []
    for fqn, module in plan.root.module.named_modules():
        if not any(isinstance(module, cls) for cls in _SUBTREE_RULES):
            continue
        below = {id(m) for m in module.modules() if m is not module}
        units = [u.label for u in plan if id(u.module) in below]
        if units:
            out.append((clean_name(fqn) or "<root>", units))
    return out


def warn_unreached_subtrees(plan: UnitPlan, who: str) -> None:
    for parent, units in unreached_subtrees(plan):
        warn_user(
            f"`{who}` does not apply the subtree initializer of '{parent}' to the units below "
            f"it ({', '.join(units[:8])}{' ...' if len(units) > 8 else ''}): they keep their own "
            "modules' initialization. Use ResetParameters() or DeterministicInit(seed), which "
            "apply it, or initialize those units the way the parent would in your function."
        )


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
    return digest63(f"{seed}/{fqn}")


def buffers_to_compute(
    model: nn.Module, ignored: IgnoredStates, *, initialized: bool = True
) -> Computed:
    """The values of the model's non-persistent buffers on meta that no module initializer
    sets (all of them when ``initialized`` is False: a loader runs no initializer), computed by
    the model's whole-model initializer (see ``fsdp_builder.materializers.buffers``). Local."""
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

    ``communicates``: whether ``materialize`` runs collectives (the pipeline then agrees on the
    local steps before it); such a materializer must fail on every rank alike, or only after its
    last collective. ``shard_first``: with a backend that ``supports_shard_first``, a unit is
    sharded while still on meta and ``materialize`` then fills only the local shards.
    """

    @property
    def communicates(self) -> bool: ...

    @property
    def shard_first(self) -> bool: ...

    def check_context(self, context: ConfigureContext) -> None:
        """The configure stage's check (local and pure, before any collective): raise a
        ``ConfigurationError``/``MaterializationError`` naming the fix to refuse."""
        ...

    def prepare(self, env: Environment) -> MaterializerRun:
        """Start one build (every rank calls it, after the groups exist; may communicate)."""
        ...


def check_materializer(materializer: Materializer, context: ConfigureContext) -> None:
    """The materializer's configure check; one written against the former
    ``check(plan, ignored)`` hook is still called, with a ``DeprecationWarning``."""
    materializer.check_context(context)
    legacy = getattr(materializer, "check", None)
    if callable(legacy):
        warnings.warn(
            f"`{type(materializer).__name__}.check(plan, ignored)` is deprecated: override "
            "`check_context(context)` instead (`context.plan`, `context.ignored`).",
            DeprecationWarning,
            stacklevel=3,
        )
        legacy(context.plan, context.ignored)


def initialize_children_first(
    root: nn.Module,
    root_fqn: str,
    modules: list[nn.Module],
    init: Callable[[nn.Module, str], None],
    who: str,
    fix: str,
    names: dict[int, str] | None = None,
) -> None:
    """Call ``init(module, clean fqn)`` for ``modules`` (a unit's own, breadth-first from
    ``root``) in reverse, so children come first: a parent's initializer may set its children's
    values (as MultiheadAttention zeroes out_proj.bias) and must win, as at construction.
    Failures are re-raised naming the module, the materializer ``who`` and the ``fix``.
    ``names``: ``module_names(root)`` when the caller has it."""
    if names is None:
        names = module_names(root)
    with torch.no_grad():
        for module in reversed(modules):
            fqn = clean_name(qualified(root_fqn, names.get(id(module), "")))
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
    """The run of a materializer that keeps nothing between units but the non-persistent
    buffers computed for the build."""

    materializer: BaseMaterializer
    env: Environment
    computed: Computed

    def materialize(self, unit: Unit) -> int:
        done = self.materializer.materialize(unit, self.env)
        if self.computed:
            modules = list(unit.modules)
            done += fill_buffers(modules, self.computed, self.env.device)
        return done

    def close(self) -> None:
        self.computed.clear()


class BaseMaterializer(DeclaredHooks):
    """Optional base: subclasses override ``init_module`` (called per owned module in
    children-first order after storage is allocated), or ``materialize`` for full control, or
    ``prepare`` to keep per-build state in a run object of their own.

    ``reinitialize``: initialize every owned module even when nothing is on meta (a deterministic
    initializer), on ``storage_device`` when it is set instead of the compute device.
    """

    __slots__ = ()

    reinitialize: bool = False
    storage_device: torch.device | None = None
    # Whether ``materialize`` runs collectives (the pipeline then agrees before it); a subclass
    # that only works locally sets False and saves ranks an agreement per unit.
    communicates: ClassVar[bool] = True
    shard_first: ClassVar[bool] = False
    # Whether modules inside a library's model (transformers) are initialized by that model's
    # convention, stateless ones included (see fsdp_builder.materializers.conventions).
    library_conventions: ClassVar[bool] = False

    def check_context(self, context: ConfigureContext) -> None:
        """Accept everything; a subclass overrides it to refuse (see the protocol)."""
        return None

    def prepare(self, env: Environment) -> MaterializerRun:
        return _PerUnit(self, env, buffers_to_compute(env.plan.root.module, env.ignored))

    def init_module(self, module: nn.Module, fqn: str) -> None:
        raise NotImplementedError

    def init_owned(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        """``init_module``, given what the module's ancestors decide (its library's model-level
        initializer, registered parents' subtree rules: see
        ``register_subtree_rule``); the default ignores them."""
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
        )

    def materialize_modules(
        self,
        root: nn.Module,
        root_fqn: str,
        device: torch.device,
        modules: list[nn.Module],
        ignored: IgnoredStates | None = None,
        model: nn.Module | None = None,
    ) -> int:
        """Give ``modules`` (the owned modules below ``root``, named from ``root_fqn``) storage
        and values; returns the bytes given storage. Ignored parameters: real ones keep their
        values, ones on meta get their module's (see ``fsdp_builder.materializers.ignored``).
        ``model`` (default ``root``) is the
        whole model, whose registered parents' subtree rules apply."""
        ignored = ignored or IgnoredStates()
        if (
            not self.reinitialize
            and not needs_materialization(modules, ignored)
            and not has_meta_ignored(modules, ignored)
        ):
            return 0
        found = unit_lineages(model if model is not None else root, root, root_fqn, modules)

        def init(module: nn.Module, fqn: str) -> None:
            lineage = found.get(id(module), NO_LINEAGE)
            # A library's model-level initializer may set a child's states from its parent
            # (GPT-2 scales c_proj from its attention block), so it visits stateless modules.
            library = self.library_conventions and lineage.library_init is not None
            if library or self.wants(module, modules):
                self.init_owned(module, fqn, lineage)

        storage = self.storage_device or device
        with settling_ignored(modules, ignored, storage, device, model or root):
            allocated = allocate_empty(modules, storage, only_meta=not self.reinitialize)
            initialize_children_first(
                root,
                root_fqn,
                modules,
                init,
                type(self).__name__,
                "Fix its initializer or pass another materializer.",
            )
        return allocated

    def materialize_model(
        self, model: nn.Module, wrap: Any = None, device: torch.device | str = "cpu"
    ) -> nn.Module:
        """Materialize a whole unsharded ``model`` on one process, unit by unit in the order a
        build with the same ``wrap`` policy uses; the single-process reference for a build."""
        from fsdp_builder.planning.ignored import resolve_ignored
        from fsdp_builder.planning.plan import plan_units
        from fsdp_builder.planning.wrap import WrapPolicy

        ignored = resolve_ignored(model)
        plan = plan_units(model, WrapPolicy.of(wrap), ignored)
        check_materializer(
            self,
            ConfigureContext(
                model, plan, ignored, ShardingOptions(), _REFERENCE, torch.device(device)
            ),
        )
        plan.tie_declared()  # as a build does once its checks passed
        computed = buffers_to_compute(model, ignored)
        for unit in plan:
            modules = list(unit.modules)
            self.materialize_modules(
                unit.module, unit.fqn, torch.device(device), modules, ignored, model=model
            )
            fill_buffers(modules, computed, torch.device(device))
        return model


def _uninitializable(plan: UnitPlan, ignored: IgnoredStates, meta_only: bool) -> list[str]:
    """The modules (named) that have states to initialize and no initializer. Raises the
    refusal of a library initializer that leaves a state unwritten (``_library_gaps``)."""
    # One walk of the model: every unit's own modules are below the root, each reached once
    # (a module shared by two units is named once).
    model = plan.root.module
    found = lineages(model)
    refused: list[nn.Module] = []
    gaps: list[tuple[nn.Module, list[str], ModuleInitializer]] = []
    for m in unit_modules(model, ignored.modules):
        if not (has_meta_states(m) if meta_only else has_states(m)):
            continue
        lineage = found.get(id(m), NO_LINEAGE)
        if initializer_of(m, lineage) is not None:
            left = _library_gaps(m, lineage, ignored)
            if left and lineage.library_init is not None:
                gaps.append((m, left, lineage.library_init))
            continue
        if not _only_nonpersistent_buffers(m):  # those are computed for the build
            refused.append(m)
    if not refused and not gaps:
        return []
    names = module_names(model)  # only to name what is refused
    if not refused:
        m, left, library = gaps[0]
        owner = getattr(library, "__self__", None)
        kind = type(m).__name__
        raise MaterializationError(
            f"{type(owner).__name__ if owner is not None else 'The model'}._init_weights does not "
            f"set {', '.join(left)} of {kind} ('{clean_name(names.get(id(m), '')) or '<root>'}'), "
            f"which has no reset_parameters()"
            + (f" (nor do {len(gaps) - 1} more modules' states)" if len(gaps) > 1 else "")
            + f". Register one: `register_initializer({kind}, fn)`, or load the values with "
            "FromCheckpoint(...)."
        )
    return [f"{clean_name(names.get(id(m), '')) or '<root>'} ({type(m).__name__})" for m in refused]


def _library_gaps(module: nn.Module, lineage: Lineage, ignored: IgnoredStates) -> list[str]:
    """The direct states of ``module`` that its library's model-level initializer
    (``_init_weights``) leaves unwritten where nothing else would write them (no registered
    initializer, no ``reset_parameters``): what the build refuses when it gets there, found in
    the configure stage. The initializer runs on a stand-in of the module (``_stand_in``), so
    neither the module nor its model changes; one that cannot run on the stand-in is left to
    the build."""
    library = lineage.library_init
    if library is None or _registered(module) is not None or torch_initializer(module):
        return []
    states = _direct(module)
    tied = [n for n, _ in states if (id(module), n) in lineage.tied]
    if not states or len(tied) == len(states):  # a tied-only module is not initialized at all
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


# The probe gives the module's own states real (uninitialized) CPU storage: torch's own
# initializers skip tensors on meta (``trunc_normal_`` returns at once), so a probe on meta
# would take them for states left unwritten. Its children stay on meta (the library's
# initializer is called on this module alone). Modules owning more than this are not probed.
_PROBE_ELEMENTS = 1 << 22


def _stand_in(module: nn.Module, memo: dict[int, Any], device: str = "cpu") -> nn.Module:
    """A copy of ``module`` and its subtree whose states are new tensors (the module's own on
    ``device``, its children's on meta; a tensor shared by two places stays shared);
    everything else is the module's own."""
    if id(module) in memo:
        return cast(nn.Module, memo[id(module)])
    probe = copy.copy(module)
    memo[id(module)] = probe
    probe.__dict__["_parameters"] = {
        n: None if t is None else _like(t, memo, device) for n, t in module._parameters.items()
    }
    probe.__dict__["_buffers"] = {
        n: None if t is None else _like(t, memo, device) for n, t in module._buffers.items()
    }
    probe.__dict__["_modules"] = {
        n: None if c is None else _stand_in(c, memo, "meta") for n, c in module._modules.items()
    }
    return probe


def _like(tensor: torch.Tensor, memo: dict[int, Any], device: str) -> torch.Tensor:
    if id(tensor) not in memo:
        fresh = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=device)
        memo[id(tensor)] = (
            nn.Parameter(fresh, requires_grad=tensor.requires_grad)
            if isinstance(tensor, nn.Parameter)
            else fresh
        )
    return cast(torch.Tensor, memo[id(tensor)])


def _only_nonpersistent_buffers(module: nn.Module) -> bool:
    """The module owns nothing but non-persistent buffers (which the build computes)."""
    names = [n for n, t in module._parameters.items() if t is not None]
    names += [n for n, t in module._buffers.items() if t is not None]
    return bool(names) and all(n in module._non_persistent_buffers_set for n in names)


def run_initializer(module: nn.Module, fqn: str, lineage: Lineage = NO_LINEAGE) -> None:
    """The module's initializer by its model's convention, then its ancestors' subtree rules on
    its parameters."""
    init = initializer_of(module, lineage)
    if init is None and _only_nonpersistent_buffers(module):
        return  # its buffers are computed for the build and filled after
    if init is None:  # refused by check(); reached only when bypassed
        raise MaterializationError(
            f"'{fqn or '<root>'}' ({type(module).__name__}) has no reset_parameters(); add one."
        )
    init()
    for rule in lineage.rules:
        for name, param in module._parameters.items():
            if param is not None and (id(module), name) not in lineage.tied:
                rule(param)


_NO_INITIALIZER_FIX = (
    "Give their class a reset_parameters() method, or register one with "
    "`fsdp_builder.register_initializer(TheirClass, fn)` (fn(module) sets the module's own "
    "states in place), or load their values with FromCheckpoint(path) / FromStateDict(...)."
)


@frozen
class ResetParameters(BaseMaterializer):
    """``to_empty`` + each owned module's initializer for modules that have states on meta:
    ``reset_parameters()`` (``nn.MultiheadAttention``'s and ``nn.Transformer``'s private
    initializers included), a registered one (``register_initializer``), or, inside a Hugging
    Face transformers model, the model's own ``_init_weights`` (what ``Model(config)`` gives,
    RoPE tables and ``position_ids`` included).

    Modules not on meta are left as they are, so ranks that already hold real weights keep them.
    Values come from each rank's global RNG: seed every rank alike, or follow with a synchronizer.

    Raises:
        MaterializationError: in the configure stage, on every rank, naming every module on meta
            that has no ``reset_parameters()`` (before any collective, model untouched); during
            the build, naming the module whose initializer failed.

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
        missing = _uninitializable(context.plan, context.ignored, meta_only=True)
        if missing:
            raise MaterializationError(
                f"`{type(self).__name__}` cannot initialize these modules on the meta device "
                f"because they have no initializer: {', '.join(missing)}. {_NO_INITIALIZER_FIX}"
            )

    @override
    def init_module(self, module: nn.Module, fqn: str) -> None:
        run_initializer(module, fqn)

    @override
    def init_owned(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        run_initializer(module, fqn, lineage)


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
    """Calls ``fn(module)`` with the contract of FSDP1's ``param_init_fn``: for each module of a
    unit, breadth-first from the unit's root (parents first, the order FSDP1 uses), while its
    states are still on the meta device. ``fn`` gives them storage and values, typically
    ``module.to_empty(device=..., recurse=False)`` then ``module.reset_parameters()`` when the
    module has meta states. Any ``param_init_fn`` that works with
    ``FullyShardedDataParallel(param_init_fn=fn)`` gives the same weights here (same order, same
    RNG draws); parameters tied within a unit are re-tied afterwards.

    ``allocate=True`` is the convenience form: the builder allocates storage on the compute
    device first (tied parameters re-tied) and calls ``fn`` children first, so ``fn`` only
    writes values.

    Either way, a state left on meta, or given storage that ``fn`` never writes, is a
    MaterializationError naming it. Writes are seen as they happen (every in-place or ``out=``
    operation, ``.data`` included, and states given new storage), never by reading values:
    fresh memory may hold anything, NaN included. A state is "never written" only if its
    values would be used: with a synchronizer that gives every rank rank 0's values
    (``BroadcastFromRank0``), only rank 0's states are judged, so FSDP1's pattern of
    ``to_empty`` on ranks other than 0 with ``sync_module_states`` builds. ``fn`` must not run
    collectives: this step is local (one agreement per unit).

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

    fn: Callable[[nn.Module], object] = attrs.field(validator=_check_callable)
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
        warn_unreached_subtrees(context.plan, "InitFn")

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        modules = list(unit.modules)
        # Rank 0's values reach every rank when the synchronizer overwrites: only they count.
        judge = not env.values_from_rank0 or env.rank == 0
        return self._materialize(unit.module, unit.fqn, env.device, modules, env.ignored, judge)

    @override
    def materialize_modules(
        self,
        root: nn.Module,
        root_fqn: str,
        device: torch.device,
        modules: list[nn.Module],
        ignored: IgnoredStates | None = None,
        model: nn.Module | None = None,
    ) -> int:
        return self._materialize(root, root_fqn, device, modules, ignored or IgnoredStates())

    def _materialize(
        self,
        root: nn.Module,
        root_fqn: str,
        device: torch.device,
        modules: list[nn.Module],
        ignored: IgnoredStates,
        judge_unwritten: bool = True,
    ) -> int:
        if not needs_materialization(modules, ignored) and not has_meta_ignored(modules, ignored):
            return 0
        pending = [(m, n, t) for m in modules for n, t in _named_direct(m) if t.is_meta]
        # fn may give an ignored parameter a new object (to_empty): put the one FSDP ignores back.
        ignored_meta = [s for s in ignored_slots(modules, ignored) if s[2].is_meta]
        names = module_names(root)

        def fqn_of(module: nn.Module, name: str = "") -> str:
            return clean_name(qualified(qualified(root_fqn, names.get(id(module), "")), name))

        if self.allocate:
            allocate_empty(modules, device)
        given = {(id(m), n): _storage_key(getattr(m, n)) for m, n, _ in pending}
        writes = WriteWatch()
        if self.allocate:

            def call(module: nn.Module, _fqn: str) -> None:
                with writes:
                    self.fn(module)

            initialize_children_first(
                root,
                root_fqn,
                modules,
                call,
                "InitFn",
                "Fix the function, or pass another materializer.",
            )
        else:
            tied = tied_groups(modules)
            with torch.no_grad(), writes:
                for module in modules:  # breadth-first, parents first: FSDP1's order
                    try:
                        self.fn(module)
                    except Exception as exc:
                        raise MaterializationError(
                            f"Initializing '{fqn_of(module) or '<root>'}' "
                            f"({type(module).__name__}) with `InitFn` failed: "
                            f"{type(exc).__name__}: {exc}. Fix the function, or pass another "
                            "materializer."
                        ) from exc
            retie(tied)
        reseat(ignored_meta)
        left = [fqn_of(m, n) for m, n, _ in pending if getattr(m, n).is_meta]
        unwritten = [
            fqn_of(m, n)
            for m, n, _ in pending
            if judge_unwritten and writes.unwritten(getattr(m, n), given[(id(m), n)])
        ]
        if left or unwritten:
            problems = []
            if left:
                problems.append(f"still on the meta device: {', '.join(left[:8])}")
            if unwritten:
                problems.append(f"given storage but never written: {', '.join(unwritten[:8])}")
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
    """The address of the tensor's storage, to tell storages apart within one process (never
    compared across ranks); None where there is none to judge (meta, empty, a tensor subclass
    such as DTensor whose storage is not its own)."""
    if tensor.is_meta or tensor.numel() == 0 or type(tensor) not in (torch.Tensor, nn.Parameter):
        return None
    return int(tensor.untyped_storage().data_ptr())


class WriteWatch(TorchDispatchMode):
    """Records, while active, which storages were written (by any operation that mutates an
    argument: in-place ops, ``out=``, ``copy_``, ``set_``) and which were freshly allocated by an
    ``empty`` operation and not written since. It never reads a value, so what fresh memory
    happens to hold (NaN under ``torch.use_deterministic_algorithms``, garbage otherwise) cannot
    change its verdict."""

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
        """Whether ``tensor``, which had storage ``given`` before the watch (None: none of its
        own), holds storage nobody wrote: the storage it was given, or an ``empty`` one made
        while watching."""
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
    """World-size-invariant initialization: every owned module of every unit is initialized on
    the CPU by its own initializer under an RNG seeded from ``seed`` and the module's qualified
    name, then the unit is moved and sharded as usual.

    The full weights depend only on ``seed`` and the model: bit-identical for any world size,
    sharding strategy or backend, and equal to ``DeterministicInit(seed).materialize_model(m)``
    on one process. States that are already real are re-initialized too (the seed decides).

    Raises:
        ConfigurationError: ``seed`` is not an int in ``[0, 2**63)``.
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
        missing = _uninitializable(context.plan, context.ignored, meta_only=False)
        if missing:
            raise MaterializationError(
                "`DeterministicInit` cannot initialize these modules because they have no "
                f"initializer: {', '.join(missing)}. {_NO_INITIALIZER_FIX}"
            )

    @override
    def init_owned(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        with torch.random.fork_rng(devices=[]):
            seed_generators(derived_seed(self.seed, fqn), torch.device("cpu"))
            run_initializer(module, fqn, lineage)


@frozen
class DeferredInit(BaseMaterializer):
    """Materializes modules built under torchdistX's ``deferred_init`` by replaying their
    recorded construction. Needs the optional ``torchdistx`` package.

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

        modules = list(unit.modules)
        owned = {id(m) for m in modules}
        fakes = [t for m in modules for t in direct_states(m) if fake.is_fake(t)]
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
        meta = [
            t.name for u in plan for t in u.params + u.buffers if _is_meta(u.module, t.name, u.fqn)
        ]
        if any(p.is_meta for p in ignored.params):  # materialized by the others, not here
            meta += [
                clean_name(n)
                for n, p in plan.root.module.named_parameters()
                if p.is_meta and ignored.ignores(p)
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
