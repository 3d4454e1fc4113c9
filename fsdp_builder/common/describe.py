"""Descriptions of a build's configuration, equal on every rank of a correct program.

Left out is what differs between ranks by design: device indexes, a group's members, the source
only rank 0 holds, addresses, ids, dict and set order, local shard sizes. Ignored states are not
described (:data:`NOT_COMPARED`): ranks may ignore different objects (PyTorch's FSDP tests do),
and the unit plan's signature compares what they decide. A strategy may define ``describe()``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

NOT_COMPARED = frozenset({"ignored_modules", "ignored_states"})


def describe(value: Any) -> str:
    """A text equal on every rank for equal configuration values."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, os.PathLike):
        # Compared like the str it stands for: two ranks that read different files differ.
        return f"{type(value).__name__}({os.fspath(value)!r})"
    if isinstance(value, torch.device):
        return f"device({value.type})"
    if isinstance(value, dist.ProcessGroup):
        return f"ProcessGroup(size={value.size()})"
    if isinstance(value, DeviceMesh):
        return f"DeviceMesh({tuple(value.shape)}, {value.mesh_dim_names})"
    if isinstance(value, torch.Tensor):
        return f"Tensor({tuple(value.shape)}, {value.dtype})"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    own = getattr(type(value), "describe", None)
    if callable(own) and not isinstance(value, Mapping):
        text = own(value)
        if isinstance(text, str):
            return text
    if isinstance(value, Mapping):
        # Sorted: equal mappings built in another order must read alike.
        items = sorted(f"{describe(k)}: {describe(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(describe(v) for v in value)) + "}"
    if isinstance(value, functools.partial):
        parts = (describe(value.func), describe(value.args), describe(value.keywords))
        return f"partial({', '.join(parts)})"
    if attrs.has(type(value)) or dataclasses.is_dataclass(value):
        names = (
            [f.name for f in attrs.fields(type(value)) if f.eq and not f.name.startswith("_")]
            if attrs.has(type(value))
            else [f.name for f in dataclasses.fields(value)]
        )
        fields = ", ".join(f"{name}={describe(getattr(value, name))}" for name in names)
        return f"{type(value).__qualname__}({fields})"
    if callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"{getattr(value, '__module__', '')}.{name}"
    return type(value).__qualname__


def listed(items: Iterable[str], shown: int = 8, sep: str = ", ") -> str:
    """The first ``shown`` distinct items, and how many more there are: how every message lists
    the states, files, units or ranks it names."""
    unique = list(dict.fromkeys(items))
    text = sep.join(unique[:shown])
    return text + (f"{sep}... ({len(unique) - shown} more)" if len(unique) > shown else "")


def describe_settings(items: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(setting, text)`` pairs for ``items``, in their order, without :data:`NOT_COMPARED`."""
    return [(name, describe(value)) for name, value in items.items() if name not in NOT_COMPARED]
