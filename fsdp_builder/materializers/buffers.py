"""Non-persistent buffers on the meta device (RoPE tables, causal masks): computed the way the
model defines them, never loaded.

A non-persistent buffer is in no state dict: its value is a function of the model's
configuration. When its module has an initializer (``reset_parameters``) that initializer gives
it its value with the module. Otherwise the model's whole-model initializer does: torchtitan's
convention is ``model.init_weights(buffer_device=...)``. The builder runs that initializer once
per build on a copy of the model whose every tensor is on the meta device, where weight
initialization costs nothing and only the buffers it computes come out real, and keeps those
buffers (on the CPU) to fill each unit's after the unit is materialized.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fsdp_builder.errors import MaterializationError

# Names of whole-model initializers, in the order they are looked for on the model's root.
WHOLE_MODEL_INITIALIZERS = ("init_weights",)

# (id of the owning module, buffer name) → value
Computed = dict[tuple[int, str], torch.Tensor]


def nonpersistent_meta(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
    """The non-persistent buffers of these modules (direct ones) that are on the meta device."""
    return [
        (m, name)
        for m in modules
        for name, b in m.named_buffers(recurse=False)
        if name in m._non_persistent_buffers_set and b.is_meta
    ]


def whole_model_initializer(model: nn.Module) -> Callable[..., Any] | None:
    for name in WHOLE_MODEL_INITIALIZERS:
        init = getattr(model, name, None)
        if callable(init):
            return init
    return None


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose tensors are all on meta (real ones are not copied)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_meta:
            continue
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def compute_buffers(model: nn.Module, wanted: list[tuple[nn.Module, str]]) -> Computed:
    """The values of ``wanted`` (non-persistent buffers on meta, by owner and name), from the
    model's whole-model initializer run on a meta copy; raises MaterializationError naming the
    buffers it cannot compute and the fix. Local: no collective."""
    if not wanted:
        return {}
    path = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    names = [f"{path.get(id(m), '?') or '<root>'}.{n}" for m, n in wanted]
    init = whole_model_initializer(model)
    if init is None:
        raise MaterializationError(
            f"The non-persistent buffers {', '.join(names[:8])} are on the meta device and "
            "neither their modules (no reset_parameters()) nor the model (no "
            f"{' / '.join(WHOLE_MODEL_INITIALIZERS)}(buffer_device=...)) can compute them. Give "
            "their module a reset_parameters() that sets them, or the model an "
            "init_weights(buffer_device=None) as torchtitan's models have."
        )
    shadow = _meta_copy(model)
    shadow_init = whole_model_initializer(shadow)
    assert shadow_init is not None
    kwargs = {}
    if "buffer_device" in inspect.signature(shadow_init).parameters:
        kwargs["buffer_device"] = torch.device("cpu")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # initializers on meta tensors may warn; nothing real
            shadow_init(**kwargs)
    except Exception as exc:
        raise MaterializationError(
            f"Computing the non-persistent buffers {', '.join(names[:8])} with "
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
            f"left the non-persistent buffers {', '.join(left[:8])} on the meta device. Make it "
            "compute them on `buffer_device`."
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
