"""Ignored parameters (``ignore(states=[param])``) during materialization: never sharded,
moved or synchronized, but part of the model.

- **Real**: left as the user set it (value and device); an initializer that writes it is undone.
  A loader writes the checkpoint's full value into it on every rank.
- **On meta**: given storage in place on the compute device (the same ``Parameter`` object, which
  the user, FSDP's ignored sets and optimizers hold; ``to_empty`` would make a new one, which
  FSDP1 would flatten) and its value from its module's initializer. Where that does not write it
  (CLIP's ``logit_scale``, set by the constructor from the config), the enclosing library model's
  constructor is run again on a copy whose tensors are all on meta except constants made from
  Python numbers; a value it draws at random or computes from other weights is refused.

States of ignored modules are left alone entirely and must be real before ``build()``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fsdp_builder.common.describe import listed
from fsdp_builder.errors import MaterializationError
from fsdp_builder.materializers.conventions import SETTLED_BY_CALLER, Lineage, lineages
from fsdp_builder.planning.ignored import IgnoredStates, clean_name, unsharded_class
from fsdp_builder.runtime.tree import qualified

# (owning module, name in it, the parameter)
Slot = tuple[nn.Module, str, nn.Parameter]

_CPU = torch.device("cpu")
_META = torch.device("meta")
# Constant fills of at most this many elements are real in a constructor copy (a layer scale,
# a temperature); larger ones stay on meta, as a constructor copy must cost nothing.
_CONSTANT_FILL_LIMIT = 1 << 16


def ignored_slots(modules: Sequence[nn.Module], ignored: IgnoredStates) -> list[Slot]:
    """The ignored parameters these modules register themselves, once each."""
    if not ignored.params:
        return []
    found: dict[int, Slot] = {}
    for m in modules:
        for name, p in m._parameters.items():
            if p is not None and ignored.ignores(p):
                found.setdefault(id(p), (m, name, p))
    return list(found.values())


def meta_ignored(modules: Sequence[nn.Module], ignored: IgnoredStates) -> list[nn.Parameter]:
    """The ignored parameters these modules register themselves that are on meta."""
    return [p for _, _, p in ignored_slots(modules, ignored) if p.is_meta]


def has_meta_ignored(modules: Sequence[nn.Module], ignored: IgnoredStates) -> bool:
    """Whether one of these modules registers an ignored parameter on meta."""
    return bool(meta_ignored(modules, ignored))


def give_storage_in_place(params: Sequence[nn.Parameter], device: torch.device) -> None:
    """Storage on ``device`` for these meta parameters, keeping each ``Parameter`` object (every
    slot and every set holding it sees the new storage)."""
    for p in params:
        if not p.is_meta:
            continue
        fresh = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, fresh)


def move_in_place(params: Sequence[nn.Parameter], device: torch.device) -> None:
    """Move these parameters to ``device`` keeping each object, as FSDP's own move does."""
    with torch.no_grad():
        for p in params:
            if p.device != device:
                p.data = p.to(device)


def reseat(slots: Sequence[Slot]) -> None:
    """Put each ignored parameter back in its slot where a user function replaced it (an
    ``InitFn`` calling ``to_empty``), with the replacement's storage: FSDP's ignored sets hold
    the original object."""
    for module, name, original in slots:
        now = module._parameters.get(name)
        if now is None or now is original or now.is_meta:
            continue
        torch.utils.swap_tensors(original, now)
        module._parameters[name] = original


@contextlib.contextmanager
def settling_ignored(
    modules: Sequence[nn.Module],
    ignored: IgnoredStates,
    storage: torch.device,
    device: torch.device,
    model: nn.Module,
) -> Iterator[None]:
    """Around the initialization of a unit's own ``modules`` (``model``: the whole model):
    ignored parameters on meta get storage in place on ``storage`` before it, and after it
    their module's value, or their constructor's where the initializer left them unwritten,
    then move to ``device``; real ignored parameters keep their values. The initializers are
    not refused for leaving an ignored parameter unwritten."""
    slots = ignored_slots(modules, ignored)
    if not slots:
        yield
        return
    fresh = [s for s in slots if s[2].is_meta]
    kept = [(p, p.detach().clone()) for _, _, p in slots if not p.is_meta]
    give_storage_in_place([p for _, _, p in fresh], storage)
    versions = {id(p): p._version for _, _, p in fresh}
    token = SETTLED_BY_CALLER.set(frozenset(id(p) for _, _, p in slots))
    try:
        yield
    finally:
        SETTLED_BY_CALLER.reset(token)
    with torch.no_grad():
        for p, value in kept:
            p.copy_(value)
        unwritten = [s for s in fresh if s[2]._version == versions[id(s[2])]]
        values = constructor_values(model, unwritten) if unwritten else []
        for (_, _, p), value in zip(unwritten, values, strict=True):
            p.copy_(value)
    move_in_place([p for _, _, p in fresh], device)


# The public factory functions that take ``device=`` (those a ``torch.device`` context redirects,
# less the sparse, nested and quantized ones).
_FACTORIES: frozenset[Callable[..., Any]] = frozenset(
    getattr(torch, name)
    for name in (
        "empty empty_strided empty_permuted zeros ones full eye arange linspace logspace rand "
        "randn randint randperm tril_indices triu_indices tensor as_tensor asarray scalar_tensor "
        "bartlett_window blackman_window hamming_window hann_window kaiser_window"
    ).split()
)
_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor})
_FILLS = frozenset({torch.full, torch.ones, torch.zeros})


def _fill_numel(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The element count a constant fill asks for; a large number when it cannot be told."""
    size: Any = kwargs.get("size")
    if size is None and args:
        first = args[0]
        if isinstance(first, tuple | list | torch.Size):
            size = first
        elif func is not torch.full:
            size = args
    try:
        return math.prod(int(s) for s in size)
    except (TypeError, ValueError):
        return _CONSTANT_FILL_LIMIT + 1


class _ConstantsOnly(TorchFunctionMode):
    """Factory calls that name no device make constants from Python numbers (and small constant
    fills) on the CPU and everything else on meta: a constructor run under it allocates nothing
    of size but keeps the constants it sets."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is None and func in _FACTORIES:
            constant = func in _FROM_DATA or (
                func in _FILLS and _fill_numel(func, args, kwargs) <= _CONSTANT_FILL_LIMIT
            )
            kwargs["device"] = _CPU if constant else _META
        return func(*args, **kwargs)


def constructor_values(model: nn.Module, slots: Sequence[Slot]) -> list[torch.Tensor]:
    """The value the constructor of each slot's enclosing library model (a transformers
    ``PreTrainedModel``, built from its config) gives the slot's parameter; raises a
    MaterializationError naming those it cannot give."""
    found = lineages(model)
    paths = {id(m): clean_name(n) for n, m in model.named_modules(remove_duplicate=False)}
    built: dict[int, tuple[dict[int, str], nn.Module | Exception]] = {}
    values: list[torch.Tensor] = []
    refused: list[str] = []
    for module, name, _ in slots:
        label = qualified(paths.get(id(module), ""), name)
        owner = getattr(found.get(id(module), Lineage()).library_init, "__self__", None)
        library = owner if isinstance(owner, nn.Module) and hasattr(owner, "config") else None
        if library is None:
            refused.append(
                f"'{label}' ({type(module).__name__} is in no transformers model, whose "
                "constructor could give it)"
            )
            continue
        if id(library) not in built:
            built[id(library)] = _construct(library)
        inside, copy_of = built[id(library)]
        if isinstance(copy_of, Exception):
            refused.append(
                f"'{label}' (constructing {type(library).__name__} from its config failed: "
                f"{type(copy_of).__name__}: {copy_of})"
            )
            continue
        try:
            value = copy_of.get_submodule(inside[id(module)])._parameters.get(name)
        except (AttributeError, KeyError):
            value = None
        if value is None or value.is_meta:
            refused.append(
                f"'{label}' ({type(library).__name__}'s constructor draws it at random or "
                "computes it from other tensors)"
            )
            continue
        values.append(value.detach())
    if refused:
        raise MaterializationError(
            "Ignored parameters on the meta device were left without values: "
            f"{listed(refused)}. Their module's initializer does not set them, and the "
            "model's constructor gives them no constant. Give them real values before build(), "
            "register an initializer that sets them "
            "(`fsdp_builder.register_initializer(TheirModuleClass, fn)`), or load them with "
            "FromCheckpoint(...) / FromStateDict(...)."
        )
    return values


def _construct(library: nn.Module) -> tuple[dict[int, str], nn.Module | Exception]:
    """``library``'s module names by id, and ``Model(config)`` of its class under
    ``_ConstantsOnly`` (or what that raised)."""
    inside = {id(m): clean_name(n) for n, m in library.named_modules(remove_duplicate=False)}
    config = copy.deepcopy(vars(library).get("config"))
    try:
        with torch.no_grad(), warnings.catch_warnings(), _ConstantsOnly():
            warnings.simplefilter("ignore")
            return inside, unsharded_class(library)(config)
    except Exception as exc:
        return inside, exc


__all__ = [
    "constructor_values",
    "give_storage_in_place",
    "has_meta_ignored",
    "ignored_slots",
    "meta_ignored",
    "move_in_place",
    "reseat",
    "settling_ignored",
]
