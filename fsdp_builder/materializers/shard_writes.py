"""Writes through a row of a sharded parameter, made to land on the shard that owns the row.

``weight[i].zero_()`` on a DTensor sharded along rows gathers the row into a new tensor and
zeroes that copy: the shard keeps its value and nothing fails (``nn.Embedding``'s padding row,
transformers' ``_init_weights``). Under :class:`LandedWrites`, an in-place op on such a copy is
written back to the owning rank's shard; a write through a view it cannot map is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_builder.runtime.shards import local_box

_aten = torch.ops.aten
_ROW_VIEWS = (_aten.select.int, _aten.slice.Tensor)


class LostWrite(RuntimeError):
    """An in-place write into a copy of a sharded parameter that cannot be mapped back."""


def _shares_storage(a: DTensor, b: DTensor) -> bool:
    return bool(
        a.to_local().untyped_storage().data_ptr() == b.to_local().untyped_storage().data_ptr()
    )


def _sharded_dims(base: DTensor) -> list[int]:
    shape, offsets = local_box(base)
    return [
        d for d, (n, o) in enumerate(zip(shape, offsets, strict=True)) if o or n != base.shape[d]
    ]


def _write_back(copy: DTensor, base: DTensor, func: Any, args: tuple[Any, ...]) -> bool:
    """Copy ``copy`` (``func(base, *args)``) into ``base``'s shard; False if not mappable."""
    if func not in _ROW_VIEWS or copy.to_local().shape != copy.shape:
        return False  # only views whose result every rank holds whole
    dim = args[0] % base.dim() if args else 0
    if _sharded_dims(base) not in ([dim], []):
        return False
    (shape, offsets), local = local_box(base), base.to_local()
    low, count, length = offsets[dim], shape[dim], base.shape[dim]
    value = copy.to_local()
    with torch.no_grad():
        if func is _aten.select.int:
            row = args[1] % length
            if low <= row < low + count:
                local.select(dim, row - low).copy_(value)
            return True
        given: list[Any] = list(args[1:4])
        defaults: list[Any] = [None, None, 1]
        start, end, step = given + defaults[len(given) :]
        first, last, step = slice(start, end, step).indices(length)
        # The first index of the view at or after this shard's first row.
        begin = first if low <= first else first + -(-(low - first) // step) * step
        stop = min(last, low + count)
        if begin < stop:
            target = local.narrow(dim, begin - low, stop - begin)[
                (slice(None),) * dim + (slice(None, None, step),)
            ]
            source = value.narrow(dim, (begin - first) // step, target.shape[dim])
            target.copy_(source)
    return True


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[DTensor]:
    """The DTensors ``func`` writes into, by its schema."""
    found = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        found += [t for t in pytree.tree_leaves(value) if isinstance(t, DTensor)]
    return found


class LandedWrites(TorchDispatchMode):
    """Around initializers running on sharded parameters: writes through a row copy land.

    Keeps the copies it saw until it exits; enter it around one unit's (or one model's)
    initializers, not longer."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: dict[int, tuple[DTensor, DTensor, Any, tuple[Any, ...]]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not args or not isinstance(args[0], DTensor):
            return out
        base = args[0]
        if func.is_view and isinstance(out, DTensor):
            if id(base) in self.copies:
                # A view of a copy: a write into it cannot be traced to the parameter.
                self.copies[id(out)] = (out, base, None, ())
            elif not _shares_storage(out, base):
                self.copies[id(out)] = (out, base, func, args[1:])
        elif self.copies and func._schema.is_mutable:  # no copy yet: no write can miss
            for leaf in _written(func, args, kwargs):
                kept = self.copies.get(id(leaf))
                if kept is not None and kept[0] is leaf:
                    copy, source, view, view_args = kept
                    if view is None or not _write_back(copy, source, view, view_args):
                        raise LostWrite(
                            f"it runs {func} on a copy of a sharded parameter (made by "
                            f"{view or 'a view of a view'}), a write its shard would not get"
                        )
        return out

    def __exit__(self, *exc: object) -> None:
        self.copies.clear()
        super().__exit__(*exc)


__all__ = ["LandedWrites", "LostWrite"]
