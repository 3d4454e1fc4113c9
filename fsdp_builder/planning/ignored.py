"""Which modules, parameters and buffers the sharding must leave alone, by FSDP's rules."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import attrs
import torch
from attrs import frozen
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY as _REGISTRY_KEY
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from fsdp_builder.common.describe import listed
from fsdp_builder.common.logs import warn_user
from fsdp_builder.errors import ConfigurationError, config_error

# The sharding wrappers whose subtrees a plan leaves alone (``isinstance`` inline in the walks).
SHARDED = (FullyShardedDataParallel, FSDPModule)

# Where FSDP1, checkpoint_wrapper and torch.compile's OptimizedModule hold the wrapped module.
WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# Any of them in a name, found in one call (clean_name runs per state and module).
_ANY_WRAPPER = re.compile("|".join(re.escape(name) for name in sorted(WRAPPER_NAMES)))


# ``list(root.named_modules())``, taken once per plan: each walk costs a generator per module.
NamedModules: TypeAlias = Sequence[tuple[str, nn.Module]]


def clean_name(name: str) -> str:
    """The name without the parts wrappers insert (as FSDP's ``clean_tensor_name``, plus
    ``_orig_mod``), so seeds and state-dict keys do not change when wrappers are added."""
    if _ANY_WRAPPER.search(name) is None:
        return name  # the common case: no split and join
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def clean_child(fqn: str, part: str) -> str:
    """``clean_name`` of ``fqn`` + "." + ``part`` for a clean ``fqn``: a walk that names as it
    goes needs no search per name."""
    if part in WRAPPER_NAMES:
        return fqn
    return f"{fqn}.{part}" if fqn else part


def is_wrapped(module: nn.Module) -> bool:
    """True for a module some sharding wrapper already manages (FSDP1 instance or fully_shard)."""
    return isinstance(module, SHARDED)


def unsharded_class(module: nn.Module) -> type[nn.Module]:
    """The model's own class of ``module``: fully_shard swaps in a subclass of it."""
    return next(
        c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, SHARDED)
    )


def is_replicated(module: nn.Module) -> bool:
    """True under torch's composable ``replicate`` (DDP), whose subtree FSDP ignores."""
    # Where torch's contract keeps it (``_get_registry`` reads it with getattr, which for a
    # module without one goes through Module.__getattr__ and raises: asked of every module).
    registry = module.__dict__.get(_REGISTRY_KEY)
    return registry is not None and "replicate" in registry


def _is_flattened(param: nn.Parameter) -> bool:
    return bool(getattr(param, "_is_flat_param", False) or getattr(param, "_fsdp_flattened", False))


@frozen
class IgnoredStates:
    """The resolved ignored sets for one root module (identity-based)."""

    modules: frozenset[nn.Module] = attrs.field(factory=frozenset)
    params: frozenset[nn.Parameter] = attrs.field(factory=frozenset)
    buffer_names: frozenset[str] = attrs.field(factory=frozenset)

    @property
    def buffers(self) -> frozenset[torch.Tensor]:
        return frozenset(b for m in self.modules for b in m.buffers())

    def ignores(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is an ignored parameter. Hashing a tensor is a Python call, made
        only when something is ignored: this runs for every parameter of every unit."""
        return param in self.params if self.params else False


def _check_uniform(states: list[Any], as_states: bool) -> None:
    types = sorted({type(s).__name__ for s in states})
    modules = all(isinstance(s, nn.Module) for s in states)
    if as_states and not modules and not all(isinstance(s, nn.Parameter) for s in states):
        raise config_error(
            "ShardingBuilder.ignore",
            "states",
            f"expected all nn.Parameter or all nn.Module, got a mix of types {types}",
            "Ignore modules and parameters in separate builds, or list the modules only.",
        )
    if not as_states and not modules:
        raise config_error(
            "ShardingBuilder.ignore",
            "modules",
            f"expected nn.Module elements, got types {types}",
            "Pass modules as `modules=` or parameters as `states=`.",
        )


def _as_list(value: Iterable[Any] | None, argument: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, nn.Module | torch.Tensor) or not isinstance(value, Iterable):
        raise config_error(
            "ShardingBuilder.ignore",
            argument,
            f"expected an iterable, got {type(value).__name__}",
            f"Wrap a single item in a list: `{argument}=[item]`.",
        )
    return list(value)


def validate_ignore_arguments(
    modules: Iterable[nn.Module] | None, states: Iterable[Any] | None
) -> tuple[list[Any], list[Any]]:
    """Check the user's ignore arguments; needs no model. Returns them as lists."""
    if modules is not None and states is not None:
        raise config_error(
            "ShardingBuilder.ignore",
            "modules",
            "both `modules` and `states` were given",
            "Pass only `states=` (it accepts modules or parameters).",
        )
    module_list = _as_list(modules, "modules")
    state_list = _as_list(states, "states")
    _check_uniform(state_list, as_states=True)
    _check_uniform(module_list, as_states=False)
    for m in module_list + state_list:
        if isinstance(m, nn.Module) and is_wrapped(m):
            raise config_error(
                "ShardingBuilder.ignore",
                "modules",
                f"{type(m).__name__} is already a sharded wrapper",
                "Ignore the module it wraps, or leave it out: wrapped modules keep their rules.",
            )
    return module_list, state_list


def _check_in_model(root: nn.Module, modules: list[Any], params: list[nn.Parameter]) -> None:
    """An ignored module or parameter that is not part of ``root`` would be ignored silently:
    it is almost always one of another model (a copy, a model built twice)."""
    if not modules and not params:
        return
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    outside = [
        f"{type(m).__name__} module {i}" for i, m in enumerate(modules) if id(m) not in names
    ]
    if params:
        param_ids = {id(p) for _, p in root.named_parameters(remove_duplicate=False)}
        outside += [
            f"parameter {i} of shape {list(p.shape)}"
            for i, p in enumerate(params)
            if id(p) not in param_ids
        ]
    if outside:
        raise config_error(
            "ShardingBuilder.ignore",
            "states" if params else "modules",
            f"{len(outside)} ignored item(s) are not part of the model being built "
            f"({type(root).__name__}): {listed(outside)}"
            " (counted in the order given)",
            "Pass modules or parameters of the model you build (e.g. `ignore([model.head])` on "
            "the same model object `build(model)` gets, not on a copy).",
        )


def resolve_ignored(
    root: nn.Module,
    modules: Iterable[nn.Module] | None = None,
    states: Iterable[Any] | None = None,
    named: NamedModules | None = None,
) -> IgnoredStates:
    """Expand the user's ignore arguments over ``root``. Pure: no process group, no mutation."""
    module_list, state_list = validate_ignore_arguments(modules, states)
    params: list[nn.Parameter] = []
    if state_list and isinstance(state_list[0], nn.Parameter):
        params = state_list
    elif state_list:
        module_list = state_list

    _check_in_model(root, module_list, params)
    every = [m for _, m in (root.named_modules() if named is None else named)]
    wrapped_states = [m for m in every if isinstance(m, FullyShardedDataParallel)]
    roots = module_list + [m for m in every if is_replicated(m)]
    ignored_modules = {
        child
        for m in roots
        for child in m.modules()
        if not isinstance(child, FullyShardedDataParallel)
    }
    if root in ignored_modules:
        warn_user(
            f"The root module ({type(root).__name__}) is ignored: nothing of the model will be "
            "sharded. Ignore its children instead if that was not the intent."
        )
    ignored_modules.update(m for w in wrapped_states for m in getattr(w, "_ignored_modules", ()))

    ignored_params = {p for m in ignored_modules for p in m.parameters() if not _is_flattened(p)}
    ignored_params.update(p for p in params if not _is_flattened(p))
    ignored_params.update(p for w in wrapped_states for p in getattr(w, "_ignored_params", ()))

    ignored_buffers = {id(b) for m in ignored_modules for b in m.buffers()}
    buffer_names = (
        {clean_name(name) for name, buf in root.named_buffers() if id(buf) in ignored_buffers}
        if ignored_buffers
        else set()
    )
    buffer_names.update(n for w in wrapped_states for n in getattr(w, "_ignored_buffer_names", ()))
    return IgnoredStates(
        frozenset(ignored_modules), frozenset(ignored_params), frozenset(buffer_names)
    )


def managed_params(
    module: nn.Module, ignored: IgnoredStates, named: NamedModules | None = None
) -> list[nn.Parameter]:
    """Parameters of ``module`` the sharding manages (not ignored, not flattened), each once."""
    # Each module's own dict, deduplicated by id: parameters() hashes every tensor (a Python
    # call each) through a generator chain per module.
    seen: set[int] = set()
    found: list[nn.Parameter] = []
    ignored_params = ignored.params
    for _, m in module.named_modules() if named is None else named:
        for p in m._parameters.values():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if not (ignored_params and p in ignored_params) and not _is_flattened(p):
                found.append(p)
    return found


def check_ignored_real(model: nn.Module, ignored: IgnoredStates) -> None:
    """Refuse ignored modules with states on meta: they are never materialized, as in FSDP."""
    if not ignored.modules:
        return
    buffers = {id(b) for b in ignored.buffers}
    in_modules = {id(p) for m in ignored.modules for p in m.parameters(recurse=False)}
    left = [n for n, p in model.named_parameters() if id(p) in in_modules and p.is_meta]
    left += [n for n, b in model.named_buffers() if id(b) in buffers and b.is_meta]
    if left:
        raise ConfigurationError(
            f"Ignored states are on the meta device: {listed(left)}. The "
            "builder leaves ignored modules as they "
            "are: give them real values before build() (e.g. `module.to_empty(device=...)` "
            "and its initializer), or stop ignoring them (parameters ignored with "
            "`ignore(states=[param])` are materialized with their module)."
        )
