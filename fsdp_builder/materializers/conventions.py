"""Init conventions: each module gets the values its own library would give it, from, in order:

1. an initializer registered for its class (``register_initializer``);
2. the enclosing transformers model's ``_init_weights(module)`` (what ``Model(config)`` runs),
   falling back to ``reset_parameters`` for what it leaves unwritten;
3. ``reset_parameters()`` (or a known private initializer).

A parametrized tensor (``weight_norm``'s ``parametrizations.weight.original0/1``) gets what
construction gives it: the module's own initializer writes the plain tensor, on a stand-in of
the module before it was parametrized, and the parametrizations' ``right_inverse`` turns it into
the originals, as ``register_parametrization`` does. (A later ``_init_weights`` write to
``conv.weight`` goes to a computed tensor, in eager too, and changes nothing.)

A tie target (``lm_head.weight``) is never written through its slot: eager construction
initializes untied and then ties, so it keeps its source's values. While an initializer runs,
each reachable target slot holds a meta stand-in that takes those writes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextvars import ContextVar
from functools import partial
from typing import Any, cast

import attrs
import torch
from attrs import frozen
from torch import nn
from torch.nn.utils import parametrize

from fsdp_builder.errors import MaterializationError, config_error
from fsdp_builder.materializers.known_buffers import KNOWN_BY_NAME
from fsdp_builder.runtime.tree import local_tensor

# A parent's whole-subtree initializer as a per-parameter rule: the parent's own initializer
# cannot reach layers that are units of their own (materialized and sharded before it).
SubtreeRule = Callable[[torch.Tensor], object]
ModuleInitializer = Callable[[nn.Module], object]
# (id(module), name)
Slot = tuple[int, str]


def _xavier_matrices(param: torch.Tensor) -> None:
    if param.dim() > 1:
        nn.init.xavier_uniform_(param)


_SUBTREE_RULES: dict[type[nn.Module], SubtreeRule] = {nn.Transformer: _xavier_matrices}


# torch.nn modules with parameters whose initializer is private (found by scanning torch.nn).
def _multihead_attention(module: nn.Module) -> None:
    assert isinstance(module, nn.MultiheadAttention)
    module._reset_parameters()


def _parametrization_list(module: nn.Module) -> None:
    """Reached only without the module it belongs to (see ``initializer_of``)."""
    raise MaterializationError(
        f"{type(module).__name__} holds the original tensors of a parametrization and is "
        "initialized by the module it parametrizes, which was not found above it. Register an "
        f"initializer: `register_initializer({type(module).__name__}, fn)`, or load the values "
        "with FromCheckpoint(...)."
    )


_REGISTERED: dict[type[nn.Module], ModuleInitializer] = {
    nn.MultiheadAttention: _multihead_attention,
    # Registered so that no _init_weights is asked for its originals: its owner sets them.
    parametrize.ParametrizationList: _parametrization_list,
}
# What _REGISTERED answers for each concrete module type; emptied by every registration.
_REGISTERED_BY_TYPE: dict[type[nn.Module], ModuleInitializer | None] = {}


def register_subtree_rule(parent: type[nn.Module], rule: SubtreeRule) -> None:
    """Call ``rule(param)`` on every parameter below a ``parent`` after its own module was
    initialized, as ``parent``'s constructor does. Registering again replaces the rule."""
    if not (isinstance(parent, type) and issubclass(parent, nn.Module)) or not callable(rule):
        raise config_error(
            "register_subtree_rule",
            "parent",
            f"expected an nn.Module subclass and a callable, got {parent!r} and {rule!r}",
            "Pass e.g. register_subtree_rule(MyModel, lambda p: nn.init.normal_(p, std=0.02)).",
        )
    _SUBTREE_RULES[parent] = rule


def register_initializer(module_class: type[nn.Module], init: ModuleInitializer) -> None:
    """Initialize every ``module_class`` (subclasses included) with ``init(module)``, which
    writes the module's own states in place (storage exists). Registering again replaces it.

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
        ) or _known_by_name(cls)
    return _REGISTERED_BY_TYPE[cls]


def _known_by_name(cls: type[nn.Module]) -> ModuleInitializer | None:
    """An initializer the library knows for a class of another library (diffusers' positional
    embeddings), by the class's module and name: that library is not imported to register it.
    One registered for the class takes precedence."""
    return next(
        (
            KNOWN_BY_NAME[key]
            for base in cls.__mro__
            if (key := f"{base.__module__}.{base.__qualname__}") in KNOWN_BY_NAME
        ),
        None,
    )


def library_initializer(module: nn.Module) -> ModuleInitializer | None:
    """A transformers ``PreTrainedModel``'s ``_init_weights``, detected without importing it."""
    # On the class first: a missing instance attribute costs Module.__getattr__ and an exception.
    cls = type(module)
    if not callable(getattr(cls, "_init_weights", None)) or not callable(
        getattr(cls, "post_init", None)
    ):
        return None
    init = getattr(module, "_init_weights", None)
    return init if callable(init) and hasattr(module, "config") else None


# Module id -> the tie target slots at or below it.
TiedBelow = dict[int, tuple[tuple[nn.Module, str], ...]]


def _ties(model: nn.Module) -> tuple[frozenset[Slot], TiedBelow]:
    """The slots ``model`` ties (``all_tied_weights_keys``) that are in fact one tensor with
    their source, and for each module on the path to one, the target slots below it."""
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
    """What a module's ancestors decide: the nearest library model's initializer, registered
    parents' subtree rules (outermost first), and the tied slots no initializer writes."""

    library_init: ModuleInitializer | None = None
    rules: tuple[SubtreeRule, ...] = ()
    tied: frozenset[Slot] = frozenset()
    tied_below: TiedBelow = attrs.field(factory=dict, eq=False, repr=False)
    # The nearest parametrized module above (its ParametrizationLists are initialized by it).
    parametrized: nn.Module | None = attrs.field(default=None, eq=False, repr=False)


NO_LINEAGE = Lineage()


def lineages(model: nn.Module) -> dict[int, Lineage]:
    """Module id → its :class:`Lineage`, for every module of ``model`` (one walk)."""
    found: dict[int, Lineage] = {}
    stack: list[tuple[nn.Module, Lineage]] = [(model, NO_LINEAGE)]
    ruled = tuple(_SUBTREE_RULES)
    adds: dict[type, bool] = {}
    while stack:
        module, inherited = stack.pop()
        if _may_add(module, ruled, adds):
            found[id(module)], below = _step(module, inherited, ruled)
        else:
            found[id(module)] = below = inherited
        # The module's own dict rather than children(): two generators per module.
        stack.extend([(child, below) for child in module._modules.values() if child is not None])
    return found


def _may_add(module: nn.Module, ruled: tuple[type[nn.Module], ...], adds: dict[type, bool]) -> bool:
    """Whether ``module`` may change the lineage it inherits (else ``_step`` passes it on as
    it is): by its class (a library model, a registered parent; ``adds`` remembers classes
    within one walk) or a parametrization. Most modules do not, and are asked cheaply."""
    cls = type(module)
    by_class = adds.get(cls)
    if by_class is None:
        by_class = adds[cls] = issubclass(cls, ruled) or (
            callable(getattr(cls, "_init_weights", None))
            and callable(getattr(cls, "post_init", None))
        )
    return by_class or "parametrizations" in module._modules


def _step(
    module: nn.Module, inherited: Lineage, ruled: tuple[type[nn.Module], ...]
) -> tuple[Lineage, Lineage]:
    """A module's own lineage and the one its children inherit."""
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
            model_init,
            inherited.rules,
            inherited.tied | tied,
            {**inherited.tied_below, **below},
            inherited.parametrized,
        )
    children = lineage
    if _parametrizations(module) is not None:
        children = attrs.evolve(lineage, parametrized=module)
    # One isinstance for the common module (no rule) instead of one per registered class.
    if not isinstance(module, ruled):
        return lineage, children
    own = tuple(rule for cls, rule in _SUBTREE_RULES.items() if isinstance(module, cls))
    return lineage, attrs.evolve(children, rules=inherited.rules + own)


def unit_lineages(
    model: nn.Module, root: nn.Module, root_fqn: str, modules: list[nn.Module]
) -> dict[int, Lineage]:
    """``lineages`` for one unit, walking only the path to it so a build stays linear in units;
    the whole walk when ``root_fqn`` does not lead to ``root`` (a wrapper renamed it)."""
    inherited = NO_LINEAGE
    current: nn.Module | None = model
    ruled = tuple(_SUBTREE_RULES)
    for name in root_fqn.split(".") if root_fqn else ():
        if current is None:
            break
        inherited = _step(current, inherited, ruled)[1]
        current = current._modules.get(name)
    if current is not root:
        return lineages(model)
    found: dict[int, Lineage] = {}
    below_of: dict[int, Lineage] = {id(root): inherited}
    owned = {id(m) for m in modules}
    adds: dict[type, bool] = {}
    for module in modules:
        parent_gives = below_of.get(id(module))
        if parent_gives is None:
            continue
        if _may_add(module, ruled, adds):
            found[id(module)], below = _step(module, parent_gives, ruled)
        else:
            found[id(module)] = below = parent_gives
        for child in module._modules.values():
            if child is not None and id(child) in owned:
                below_of.setdefault(id(child), below)
    return found


def torch_initializer(module: nn.Module) -> Callable[[], object] | None:
    """PyTorch's convention: ``reset_parameters`` or a registered initializer of its class."""
    registered = _registered(module)
    if registered is not None:
        return lambda: registered(module)
    # Asked of every module: a missing method would cost Module.__getattr__ and an exception.
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
    """The version counters of a tensor and of its local shard. A DTensor counts a write on one
    only: an op on the DTensor bumps the wrapper's; a shard write (StreamInit), the shard's."""
    return int(tensor._version), int(local_tensor(tensor)._version)


def _unwritten(module: nn.Module, versions: dict[str, tuple[int, int]]) -> list[str]:
    # Version counters, never values, so fresh storage cannot fool it. An empty local shard is
    # judged by the rank holding its elements.
    return [
        n for n, t in _direct(module) if _version(t) == versions.get(n) and local_tensor(t).numel()
    ]


# Ids of states the caller settles afterwards (ignored parameters): not refused as unwritten.
SETTLED_BY_CALLER: ContextVar[frozenset[int]] = ContextVar(
    "fsdp_builder_settled_by_caller", default=frozenset()
)


def _library_then_torch(module: nn.Module, library_init: ModuleInitializer) -> None:
    """The library's initializer; if it leaves states unwritten, ``reset_parameters`` then the
    library's again, as eager construction does (constructor, then ``post_init``)."""
    for _, t in _direct(module):
        if getattr(t, "_is_hf_initialized", False):
            t._is_hf_initialized = False  # type: ignore[attr-defined]  # re-initialized now
    versions = {n: _version(t) for n, t in _direct(module)}
    library_init(module)
    settled = SETTLED_BY_CALLER.get()
    left = [n for n in _unwritten(module, versions) if id(getattr(module, n)) not in settled]
    if not left:
        return
    fallback = torch_initializer(module)
    if fallback is None:
        raise library_gap_error(library_init, module, left)
    fallback()
    library_init(module)


def library_gap_error(
    library: ModuleInitializer, module: nn.Module, left: list[str], where: str = "", more: int = 0
) -> MaterializationError:
    """The error for states ``left`` that ``library`` leaves unwritten and nothing else writes."""
    owner = getattr(library, "__self__", None)
    kind = type(module).__name__
    return MaterializationError(
        f"{type(owner).__name__ if owner is not None else 'The model'}._init_weights does not "
        f"set {', '.join(left)} of {kind}{where}, which has no reset_parameters()"
        + (f" (nor do {more} more modules' states)" if more else "")
        + f". Register one: `register_initializer({kind}, fn)`, or load the values with "
        "FromCheckpoint(...)."
    )


def _untied_while(slots: tuple[tuple[nn.Module, str], ...], init: Callable[[], Any]) -> None:
    """``init()`` with each tie target slot holding a meta stand-in; the tie is restored after."""
    held = [(owner, name, owner._parameters[name]) for owner, name in slots]
    for owner, name, param in held:
        if param is not None:
            fresh = torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")
            owner._parameters[name] = nn.Parameter(fresh, requires_grad=param.requires_grad)
    try:
        init()
    finally:
        for owner, name, param in held:
            owner._parameters[name] = param


def initializer_of(module: nn.Module, lineage: Lineage = NO_LINEAGE) -> Callable[[], Any] | None:
    """The initializer of ``module`` by its model's convention, or None. A module owning only
    tie targets is skipped; other initializers reaching a tie target write a stand-in."""
    library = lineage.library_init
    init: Callable[[], Any] | None
    if _registered(module) is _parametrization_list and lineage.parametrized is not None:
        owner = lineage.parametrized
        plists = _parametrizations(owner) or {}
        name = next((n for n, p in plists.items() if p is module), None)
        if name is not None:
            return partial(_init_parametrized, owner, name, library)
    if library is not None and _registered(module) is None:
        init = partial(_library_then_torch, module, library)
    else:
        init = torch_initializer(module)
    slots = lineage.tied_below.get(id(module)) if lineage.tied else None
    if init is None or not slots:
        return init
    tied = lineage.tied
    own = [n for n, t in module._parameters.items() if t is not None and (id(module), n) in tied]
    if own and len(own) == len(_direct(module)):
        return lambda: None
    return partial(_untied_while, slots, init)


def _parametrizations(module: nn.Module) -> dict[str, Any] | None:
    """The ParametrizationList of each parametrized tensor of ``module``, or None."""
    found = module._modules.get("parametrizations")  # the dict: no Module.__getattr__ miss
    if found is None or not parametrize.is_parametrized(module):
        return None
    return dict(found._modules.items())


def shallow_copy(module: nn.Module) -> nn.Module:
    """``copy.copy(module)``, a parametrized module too: its class refuses ``copy.copy``
    (torch's ``__getstate__`` allows only ``state_dict()``), so its ``__dict__`` is copied."""
    if _parametrizations(module) is None:
        return copy.copy(module)
    probe: nn.Module = type(module).__new__(type(module))
    probe.__dict__.update(module.__dict__)
    return probe


def _originals(plist: Any) -> list[torch.Tensor]:
    """A ParametrizationList's original tensors, in the order its first step takes them."""
    if plist.is_tensor:
        return [plist.original]
    return [getattr(plist, f"original{i}") for i in range(plist.ntensors)]


def _unparametrized_meta(plist: Any) -> torch.Tensor:
    """What ``plist`` computes from its originals, on meta: the plain tensor's shape and dtype."""
    metas = [torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for t in _originals(plist)]
    steps = list(plist.children())
    with torch.no_grad():
        value = steps[0](*metas)
        for step in steps[1:]:
            value = step(value)
    return cast(torch.Tensor, value)


def _fresh(template: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``like``'s shape and dtype on ``template``'s (local) device, a
    Parameter when ``template`` is one."""
    out = torch.empty(tuple(like.shape), dtype=like.dtype, device=local_tensor(template).device)
    if isinstance(template, nn.Parameter):
        return nn.Parameter(out, requires_grad=template.requires_grad)
    return out


def _class_before_parametrizations(module: nn.Module) -> Any:
    """The class ``module`` had before ``register_parametrization`` derived one from it, also
    when ``fully_shard`` derived another from that (torch's own lookup takes the first base)."""
    for cls in type(module).__mro__:
        if cls.__module__ == parametrize.__name__ and cls.__name__.startswith("Parametrized"):
            return cls.__bases__[0]
    return parametrize.type_before_parametrizations(module)


def _init_parametrized(owner: nn.Module, name: str, library: ModuleInitializer | None) -> None:
    """Set the originals of ``owner``'s parametrized tensor ``name`` as construction does: the
    module's initializer writes plain tensors on a stand-in of ``owner`` as it was before it was
    parametrized (its other states fresh, so nothing real is written twice), and the
    parametrizations' ``right_inverse``, last registered first, gives the originals."""
    plists = _parametrizations(owner) or {}
    plist = plists[name]
    before = _class_before_parametrizations(owner)
    # Not copy.copy: a parametrized module refuses to be copied (its class's __getstate__).
    probe: nn.Module = before.__new__(before)
    probe.__dict__.update(owner.__dict__)
    states: dict[str, torch.Tensor | None] = {
        n: None if t is None else _fresh(t, t) for n, t in owner._parameters.items()
    }
    for tensor_name, other in plists.items():
        states[tensor_name] = _fresh(_originals(other)[0], _unparametrized_meta(other))
    probe.__dict__["_parameters"] = states
    probe.__dict__["_modules"] = {
        k: m for k, m in owner._modules.items() if k != "parametrizations"
    }
    plain = cast(torch.Tensor, states[name])
    written = plain._version
    own = torch_initializer(probe)
    if own is not None:
        own()
    elif library is not None:
        library(probe)
    if plain._version == written:
        raise MaterializationError(
            f"The original tensors of the parametrized {before.__name__}.{name} are set from "
            f"its plain value, which neither {before.__name__}'s reset_parameters() nor its "
            "model's _init_weights writes. Register an initializer: "
            f"`register_initializer({before.__name__}, fn)`, or load the values with "
            "FromCheckpoint(...)."
        )
    value: Any = plain.detach()
    for step in reversed(list(plist.children())):
        if hasattr(step, "right_inverse"):
            try:
                value = step.right_inverse(value)
            except NotImplementedError:  # torch's rule: the identity then
                pass
    values = [value] if isinstance(value, torch.Tensor) else list(value)
    for target, full in zip(_originals(plist), values, strict=True):
        _write(target, full)


def _write(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``target``, into this rank's part when ``target`` is sharded."""
    from torch.distributed.tensor import DTensor

    from fsdp_builder.runtime.shards import local_slices

    if isinstance(target, DTensor):
        local_tensor(target).copy_(full[local_slices(target)])
    else:
        target.copy_(full)
