"""Init conventions: how each module of a model gets its values, as the model's own library
would give them.

A module is initialized by, in this order of precedence:

1. an initializer registered for its class (``register_initializer``);
2. its library's model-level initializer when it sits inside a Hugging Face transformers model
   (``PreTrainedModel._init_weights(module)`` of the nearest enclosing ``PreTrainedModel``, the
   function ``Model(config)`` runs after construction; it also computes RoPE tables and
   ``position_ids``), falling back to the module's ``reset_parameters`` for what it leaves
   unwritten;
3. PyTorch's convention: ``reset_parameters()`` (or a known private initializer).

A parameter that a library model ties to another one (transformers' ``lm_head.weight`` to the
input embedding's) is never written through its target's slot, neither by its own module's
initializer nor by a model-level one that writes a child (ModernBERT's masked-LM head writes its
``decoder``): eager construction initializes every module untied and then ties, so the tied
tensor holds its source's values (the input embedding's, padding row zeroed), whichever of the
modules is initialized first. While an initializer runs, each target slot it can reach holds a
stand-in on meta, which takes those writes and is dropped.

What a module's ancestors add to it is its :class:`Lineage`: the library initializer above and the
subtree rules of registered parents (``nn.Transformer`` applies Xavier to its layers). Lineages
are computed in one walk of the model (``lineages``), once per build or check.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import attrs
import torch
from attrs import frozen
from torch import nn

from fsdp_builder.errors import MaterializationError, config_error
from fsdp_builder.runtime.tree import local_tensor

# Initializers a parent runs over its whole subtree after its children built themselves, as one
# rule per parameter below it. A parent's own initializer cannot reach layers that are units of
# their own (materialized and sharded before the parent), so the materializers apply the rule
# to each parameter below such a parent right after that parameter's own module is initialized.
SubtreeRule = Callable[[torch.Tensor], object]
ModuleInitializer = Callable[[nn.Module], object]
# A parameter's place in a module: (id(module), name).
Slot = tuple[int, str]


def _xavier_matrices(param: torch.Tensor) -> None:
    if param.dim() > 1:
        nn.init.xavier_uniform_(param)


_SUBTREE_RULES: dict[type[nn.Module], SubtreeRule] = {nn.Transformer: _xavier_matrices}


# torch.nn modules that own parameters but whose initializer is private. Found by scanning every
# nn.Module subclass in torch.nn for direct parameters without ``reset_parameters``.
def _multihead_attention(module: nn.Module) -> None:
    assert isinstance(module, nn.MultiheadAttention)
    module._reset_parameters()


_REGISTERED: dict[type[nn.Module], ModuleInitializer] = {
    nn.MultiheadAttention: _multihead_attention,
}
# What _REGISTERED answers for each concrete module type; emptied by every registration.
_REGISTERED_BY_TYPE: dict[type[nn.Module], ModuleInitializer | None] = {}


def register_subtree_rule(parent: type[nn.Module], rule: SubtreeRule) -> None:
    """Make ``ResetParameters``, ``DeterministicInit`` and ``ShardFirstReset`` call
    ``rule(param)`` on every parameter below a module of type ``parent``, after that
    parameter's own module was initialized (what ``parent``'s constructor does to its
    subtree). Registering a type again replaces its rule."""
    if not (isinstance(parent, type) and issubclass(parent, nn.Module)) or not callable(rule):
        raise config_error(
            "register_subtree_rule",
            "parent",
            f"expected an nn.Module subclass and a callable, got {parent!r} and {rule!r}",
            "Pass e.g. register_subtree_rule(MyModel, lambda p: nn.init.normal_(p, std=0.02)).",
        )
    _SUBTREE_RULES[parent] = rule


def register_initializer(module_class: type[nn.Module], init: ModuleInitializer) -> None:
    """Initialize every module of ``module_class`` (subclasses included) with ``init(module)``:
    it must give the module's own parameters and buffers their values in place (its storage
    exists, on the compute device or the CPU). Used by ``ResetParameters``, ``DeterministicInit``,
    ``ShardFirstReset`` and by the loaders to compute non-persistent buffers. Registering a
    class again replaces its initializer.

    Example:
        ```python
        register_initializer(MyNorm, lambda m: torch.nn.init.ones_(m.weight))
        ```
    """
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise config_error(
            "register_initializer",
            "module_class",
            f"expected an nn.Module subclass, got {module_class!r}",
            "Pass the class whose instances `init` initializes, e.g. "
            "register_initializer(MyNorm, lambda m: nn.init.ones_(m.weight)).",
        )
    if not callable(init):
        raise config_error(
            "register_initializer",
            "init",
            f"expected a callable taking the module, got {type(init).__name__} {init!r}",
            "Pass e.g. `lambda m: nn.init.ones_(m.weight)`.",
        )
    _REGISTERED[module_class] = init
    _REGISTERED_BY_TYPE.clear()


def _registered(module: nn.Module) -> ModuleInitializer | None:
    cls = type(module)
    if cls not in _REGISTERED_BY_TYPE:  # asked once per module of every unit: resolved per type
        _REGISTERED_BY_TYPE[cls] = next(
            (_REGISTERED[base] for base in cls.__mro__ if base in _REGISTERED), None
        )
    return _REGISTERED_BY_TYPE[cls]


def library_initializer(module: nn.Module) -> ModuleInitializer | None:
    """The model-level initializer ``module`` applies to each module below it, if it is a model
    of a library with such a convention: a Hugging Face ``PreTrainedModel``
    (``_init_weights(module)``, driven by ``module.config``). Detected without importing the
    library."""
    # Looked up on the class first: a missing attribute on an nn.Module instance goes through
    # Module.__getattr__ and an exception, once per module of every unit.
    cls = type(module)
    if not callable(getattr(cls, "_init_weights", None)) or not callable(
        getattr(cls, "post_init", None)
    ):
        return None
    init = getattr(module, "_init_weights", None)
    return init if callable(init) and hasattr(module, "config") else None


# Module id -> the tied target slots (module, name) at or below it: where an initializer run on
# that module can write a tie target.
TiedBelow = dict[int, tuple[tuple[nn.Module, str], ...]]


def _ties(model: nn.Module) -> tuple[frozenset[Slot], TiedBelow]:
    """The parameter slots that library ``model`` ties to another of its parameters
    (transformers' ``all_tied_weights_keys``, target → source) where the two are in fact one
    tensor, and for each module on the path to a target's module the target slots below it."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(keys, dict) or not keys:
        return frozenset(), {}
    found: set[Slot] = set()
    below: TiedBelow = {}
    for target, source in keys.items():
        path, _, name = str(target).rpartition(".")
        try:
            owner = model.get_submodule(path)
            tied = owner._parameters.get(name)
            if tied is None or tied is not model.get_parameter(str(source)):
                continue
        except AttributeError:  # a path a wrapper renamed: left to its own initializer
            continue
        found.add((id(owner), name))
        on_path = [model]
        for part in path.split(".") if path else ():
            on_path.append(on_path[-1].get_submodule(part))
        for module in on_path:
            below[id(module)] = (*below.get(id(module), ()), (owner, name))
    return frozenset(found), below


@frozen
class Lineage:
    """What a module's ancestors decide about its initialization: the model-level initializer
    of the nearest enclosing library model (the module itself included), the subtree rules
    of registered parents, outermost first, and the slots enclosing library models tie to
    another parameter (``_ties``), which no initializer of their module writes."""

    library_init: ModuleInitializer | None = None
    rules: tuple[SubtreeRule, ...] = ()
    tied: frozenset[Slot] = frozenset()
    # For the modules of the enclosing library models' paths to their tie targets: those targets.
    tied_below: TiedBelow = attrs.field(factory=dict, eq=False, repr=False)


NO_LINEAGE = Lineage()


def lineages(model: nn.Module) -> dict[int, Lineage]:
    """Module id → its :class:`Lineage`, for every module of ``model`` (one walk)."""
    found: dict[int, Lineage] = {}
    stack: list[tuple[nn.Module, Lineage]] = [(model, NO_LINEAGE)]
    ruled = tuple(_SUBTREE_RULES)
    while stack:
        module, inherited = stack.pop()
        found[id(module)], below = _step(module, inherited, ruled)
        # The module's own dict rather than children() (two generators per module); a child
        # registered twice under one parent gets the same lineage both times.
        stack.extend([(child, below) for child in module._modules.values() if child is not None])
    return found


def _step(
    module: nn.Module, inherited: Lineage, ruled: tuple[type[nn.Module], ...]
) -> tuple[Lineage, Lineage]:
    """A module's own lineage and the one its children inherit (``ruled``: the classes with a
    registered subtree rule, taken once per walk)."""
    model_init = library_initializer(module)
    # Most modules inherit their parent's lineage unchanged: share it rather than copy it.
    if model_init is None:
        lineage = inherited
    else:
        tied, below = _ties(module)
        if inherited.tied_below and below:
            below = {
                key: (*inherited.tied_below.get(key, ()), *slots) for key, slots in below.items()
            }
        lineage = Lineage(
            model_init, inherited.rules, inherited.tied | tied, {**inherited.tied_below, **below}
        )
    # One isinstance for the common module (no rule) instead of one per registered class.
    if not isinstance(module, ruled):
        return lineage, lineage
    own = tuple(rule for cls, rule in _SUBTREE_RULES.items() if isinstance(module, cls))
    return lineage, Lineage(
        lineage.library_init, inherited.rules + own, lineage.tied, lineage.tied_below
    )


def unit_lineages(
    model: nn.Module, root: nn.Module, root_fqn: str, modules: list[nn.Module]
) -> dict[int, Lineage]:
    """``lineages`` for one unit's ``modules`` (breadth-first from ``root``, reached from
    ``model`` by ``root_fqn``): walks the path down to the unit and the unit itself, so a build
    of N units stays linear instead of walking the whole model per unit. Falls back to the whole
    walk when ``root_fqn`` does not lead to ``root`` (a wrapper renamed the path)."""
    inherited = NO_LINEAGE
    current: nn.Module | None = model
    ruled = tuple(_SUBTREE_RULES)
    for name in root_fqn.split(".") if root_fqn else ():
        assert current is not None
        inherited = _step(current, inherited, ruled)[1]
        current = current._modules.get(name)
        if current is None:
            return lineages(model)
    if current is not root:
        return lineages(model)
    found: dict[int, Lineage] = {}
    below_of: dict[int, Lineage] = {id(root): inherited}
    owned = {id(m) for m in modules}
    for module in modules:
        parent_gives = below_of.get(id(module))
        if parent_gives is None:
            continue
        found[id(module)], below = _step(module, parent_gives, ruled)
        for child in module._modules.values():
            if child is not None and id(child) in owned:
                below_of.setdefault(id(child), below)
    return found


def torch_initializer(module: nn.Module) -> Callable[[], object] | None:
    """PyTorch's convention: ``reset_parameters`` or a registered initializer of its class."""
    registered = _registered(module)
    if registered is not None:
        return lambda: registered(module)
    # Asked of every module: one without the method would make getattr go through
    # Module.__getattr__ and raise. Only the class, the instance or a child can provide it.
    if (
        getattr(type(module), "reset_parameters", None) is None
        and "reset_parameters" not in module.__dict__
        and "reset_parameters" not in module._modules
    ):
        return None
    public = getattr(module, "reset_parameters", None)
    return public if callable(public) else None


def _direct(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in module._parameters.items() if t is not None] + [
        (n, t) for n, t in module._buffers.items() if t is not None
    ]


def _version(tensor: torch.Tensor) -> tuple[int, int]:
    """The version counters of a tensor and of its local shard (itself unless a DTensor).

    A DTensor counts a write on one of the two only: an in-place op on the DTensor bumps the
    wrapper's counter, while DTensor dispatch runs the op on the shard below autograd, where
    nothing bumps the shard's; a shard-local initializer (StreamInit) writes the shard directly
    and leaves the wrapper's counter put."""
    return int(tensor._version), int(local_tensor(tensor)._version)


def _unwritten(module: nn.Module, versions: dict[str, tuple[int, int]]) -> list[str]:
    # An in-place write bumps a version counter: "written" is decided without ever reading
    # values, so fresh (uninitialized) storage cannot fool it.
    # A state whose local shard is empty (a [1, ...] parameter on every rank past the first)
    # has nothing to write here; the rank holding its elements judges it.
    return [
        n
        for n, t in _direct(module)
        if _version(t) == versions.get(n) and local_tensor(t).numel()
    ]


# The states whose values the caller settles after the initializer ran (ignored parameters,
# by id): one the library's initializer leaves unwritten is not refused for it.
SETTLED_BY_CALLER: ContextVar[frozenset[int]] = ContextVar(
    "fsdp_builder_settled_by_caller", default=frozenset()
)


def _library_then_torch(module: nn.Module, library_init: ModuleInitializer) -> None:
    """The library's initializer; states it leaves unwritten get what the module's constructor
    gave them first (``reset_parameters``), after which the library's initializer runs again,
    as in eager construction (constructor, then the model's ``post_init``)."""
    for _, t in _direct(module):
        if getattr(t, "_is_hf_initialized", False):
            t._is_hf_initialized = False  # type: ignore[attr-defined]  # re-initialized now
    versions = {n: _version(t) for n, t in _direct(module)}
    library_init(module)
    left = _unwritten(module, versions)
    settled = SETTLED_BY_CALLER.get()
    if settled and left:
        left = [n for n in left if id(getattr(module, n)) not in settled]
    if not left:
        return
    fallback = torch_initializer(module)
    if fallback is None:
        owner = getattr(library_init, "__self__", None)
        raise MaterializationError(
            f"{type(owner).__name__ if owner is not None else 'The model'}._init_weights does not "
            f"set {', '.join(left)} of {type(module).__name__}, which has no reset_parameters(). "
            f"Register one: `register_initializer({type(module).__name__}, fn)`, or load the "
            "values with FromCheckpoint(...)."
        )
    fallback()
    library_init(module)


def _stand_in(param: torch.Tensor) -> nn.Parameter:
    """A parameter on meta of ``param``'s (global) shape and dtype: writes to it cost nothing."""
    fresh = torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")
    return nn.Parameter(fresh, requires_grad=param.requires_grad)


def _untied_while(slots: tuple[tuple[nn.Module, str], ...], init: Callable[[], Any]) -> None:
    """``init()`` with each tie target slot holding a stand-in, as if untied (eager
    construction ties after initializing): what it writes there never reaches the source.
    The tie is back when it ends, however it ends."""
    held = [(owner, name, owner._parameters[name]) for owner, name in slots]
    for owner, name, param in held:
        if param is not None:
            owner._parameters[name] = _stand_in(param)
    try:
        init()
    finally:
        for owner, name, param in held:
            owner._parameters[name] = param


def _skip() -> None:
    return None


def initializer_of(module: nn.Module, lineage: Lineage = NO_LINEAGE) -> Callable[[], Any] | None:
    """The initializer of ``module`` by its model's convention (see the module docstring), or
    None when there is none. Parameters its library model ties to another one (``Lineage.tied``)
    keep their source's values: a module that owns nothing else (an output embedding) is not
    initialized at all, and any other initializer that reaches a tie target (its module's own,
    or a model-level one writing a child) writes a stand-in instead."""
    init = _convention(module, lineage)
    if init is None or not lineage.tied:
        return init
    slots = lineage.tied_below.get(id(module))
    if not slots:
        return init
    key = id(module)
    own = [n for n, t in module._parameters.items() if t is not None and (key, n) in lineage.tied]
    if own and len(own) == len(_direct(module)):
        return _skip
    return lambda: _untied_while(slots, init)


def _convention(module: nn.Module, lineage: Lineage) -> Callable[[], Any] | None:
    registered = _registered(module)
    if registered is not None:
        return lambda: registered(module)
    library = lineage.library_init
    if library is not None:
        return lambda: _library_then_torch(module, library)
    return torch_initializer(module)
