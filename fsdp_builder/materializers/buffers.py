"""Non-persistent buffers on the meta device (RoPE tables, causal masks, ``position_ids``):
computed, never loaded, by their module's initializer run on a scratch copy on the CPU, else by
the model's ``init_weights(buffer_device=...)`` run on a meta copy of the whole model (the
initializers of diffusers' embeddings that compute theirs are in ``known_buffers``)."""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fsdp_builder.common.describe import listed
from fsdp_builder.errors import MaterializationError
from fsdp_builder.materializers.conventions import NO_LINEAGE, Lineage, initializer_of, lineages

# (id of the owning module, buffer name) → value
Computed = dict[tuple[int, str], torch.Tensor]


def nonpersistent_meta(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
    """The non-persistent buffers of these modules (direct ones) that are on the meta device."""
    return [
        (m, name)
        for m in modules
        # The module's own dict: named_buffers(recurse=False) builds a generator chain per call.
        for name, b in m._buffers.items()
        if b is not None and name in m._non_persistent_buffers_set and b.is_meta
    ]


def whole_model_initializer(model: nn.Module) -> Callable[..., Any] | None:
    init = getattr(model, "init_weights", None)
    return init if callable(init) else None


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose tensors are all on meta (real ones are not copied)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_meta:
            continue
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _by_module(owner: nn.Module, lineage: Lineage, names: list[str]) -> dict[str, torch.Tensor]:
    """The buffers ``names`` of ``owner`` from its initializer, run on a copy of ``owner`` whose
    own states are on the CPU (its children stay meta); {} when it computes none."""
    if initializer_of(owner, lineage) is None:
        return {}
    scratch = _meta_copy(owner)
    scratch.to_empty(device="cpu", recurse=False)
    init = initializer_of(scratch, lineage)
    assert init is not None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        init()
    values = {name: scratch._buffers.get(name) for name in names}
    return {n: v.detach() for n, v in values.items() if v is not None and not v.is_meta}


def whole_model_kwargs(init: Callable[..., Any], device: torch.device) -> dict[str, Any]:
    """``buffer_device=device`` for initializers that take it (by name or ``**kwargs``)."""
    params = inspect.signature(init).parameters.values()
    takes = any(
        p.name == "buffer_device" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params
    )
    return {"buffer_device": device} if takes else {}


def compute_buffers(model: nn.Module, wanted: list[tuple[nn.Module, str]]) -> Computed:
    """The values of ``wanted`` (non-persistent buffers on meta, by owner and name); raises
    MaterializationError naming the buffers no convention computes. Local: no collective."""
    if not wanted:
        return {}
    path = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def label(owner: nn.Module, name: str) -> str:
        return f"{path.get(id(owner), '?') or '<root>'}.{name}"

    computed: Computed = {}
    owners: dict[int, tuple[nn.Module, list[str]]] = {}
    for owner, name in wanted:
        owners.setdefault(id(owner), (owner, []))[1].append(name)
    rest: list[tuple[nn.Module, str]] = []
    found_lineages = lineages(model)
    for owner, names in owners.values():
        try:
            found = _by_module(owner, found_lineages.get(id(owner), NO_LINEAGE), names)
        except Exception as exc:
            raise MaterializationError(
                f"Computing the non-persistent buffers "
                f"{', '.join(label(owner, n) for n in names)} with the initializer of "
                f"{type(owner).__name__} failed: {type(exc).__name__}: {exc}. Make it work on a "
                "module whose own states are on the CPU, or register one with "
                "`fsdp_builder.register_initializer`."
            ) from exc
        computed.update({(id(owner), name): value for name, value in found.items()})
        rest += [(owner, name) for name in names if name not in found]
    if rest:
        computed.update(_by_whole_model(model, rest, [label(m, n) for m, n in rest], path))
    return computed


def _by_whole_model(
    model: nn.Module, wanted: list[tuple[nn.Module, str]], names: list[str], path: dict[int, str]
) -> Computed:
    init = whole_model_initializer(model)
    if init is None:
        raise MaterializationError(
            f"The non-persistent buffers {listed(names)} are on the meta device and no "
            "convention computes them: their modules have no initializer (reset_parameters(), "
            "a registered one, or a transformers model's _init_weights) and the model has no "
            "init_weights(buffer_device=...). Register an initializer for their module class "
            "with `fsdp_builder.register_initializer(cls, fn)`, or give the model an "
            "init_weights(buffer_device=None) as torchtitan's models have."
        )
    shadow = _meta_copy(model)
    shadow_init = whole_model_initializer(shadow)
    assert shadow_init is not None
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # initializers on meta tensors may warn; nothing real
            shadow_init(**whole_model_kwargs(shadow_init, torch.device("cpu")))
    except Exception as exc:
        raise MaterializationError(
            f"Computing the non-persistent buffers {listed(names)} with "
            f"`{type(model).__name__}.{getattr(init, '__name__', 'init')}` on a meta copy of the "
            f"model failed: {type(exc).__name__}: {exc}. Make it work on a model on the meta "
            "device (weights stay meta; buffers are created on `buffer_device`)."
        ) from exc
    by_path = dict(shadow.named_modules(remove_duplicate=False))
    computed: Computed = {}
    left = []
    for (owner, name), label in zip(wanted, names, strict=True):
        value = by_path[path[id(owner)]]._buffers.get(name)
        if value is None or value.is_meta:
            left.append(label)
        else:
            computed[(id(owner), name)] = value.detach().cpu()
    if left:
        raise MaterializationError(
            f"`{type(model).__name__}.{getattr(init, '__name__', 'init')}(buffer_device=...)` "
            f"left the non-persistent buffers {listed(left)} on the meta device. Make it "
            "compute them on `buffer_device`, or register an initializer for their module class "
            "with `fsdp_builder.register_initializer(cls, fn)`."
        )
    return computed


def fill_buffers(modules: Iterable[nn.Module], computed: Computed, device: torch.device) -> int:
    """Give these modules' computed buffers their values on ``device``; returns the bytes."""
    filled = 0
    for m in modules:
        for name in list(m._buffers):
            value = computed.get((id(m), name))
            if value is None:
                continue
            m._buffers[name] = value.to(device=device, copy=True)
            filled += value.numel() * value.element_size()
    return filled
