"""Writes through a row of a sharded parameter, made to land on the shard that owns the row.

``weight[i].zero_()`` on a DTensor sharded along rows gathers the row into a new tensor and
zeroes that copy: the shard keeps its value and nothing fails (``nn.Embedding``'s padding row,
transformers' ``_init_weights``). Under :class:`LandedWrites`, an in-place op on such a copy is
written back to the owning rank's shard; a write through a view it cannot map is refused.

``StreamInit`` meets the same copies and answers them otherwise (``streams._ShardWatch``): its
promise is the whole tensor's stream of draws, so a module that indexes a shard is drawn again
whole. ``ShardFirstReset`` and ``InitWeights`` promise only eager's distribution, so the write is
landed where it belongs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_builder.runtime.shards import local_box

_aten = torch.ops.aten
_ROW_VIEWS = (_aten.select.int, _aten.slice.Tensor)


# torch's own initializers that write whole parameters and buffers only, through no row or
# slice of one: a unit that runs nothing else has no write to land, and skips LandedWrites'
# Python dispatch of every op. tests/test_shard_writes.py records the views each one takes.
# Conv1d's is every convolution's, BatchNorm1d's every batch and instance norm's.
WHOLE_TENSOR_INITIALIZERS = frozenset(
    {
        nn.Linear.reset_parameters,
        nn.Bilinear.reset_parameters,
        nn.Conv1d.reset_parameters,
        nn.LayerNorm.reset_parameters,
        nn.RMSNorm.reset_parameters,
        nn.GroupNorm.reset_parameters,
        nn.BatchNorm1d.reset_parameters,
    }
)


def writes_whole_tensors(init: object) -> bool:
    """Whether ``init`` (a module's initializer, or None for none) is one of torch's own that
    take no row or slice of a state: ``LandedWrites`` would have nothing to land."""
    return init is None or getattr(init, "__func__", None) in WHOLE_TENSOR_INITIALIZERS


class LostWrite(RuntimeError):
    """An in-place write into a copy of a sharded parameter that cannot be mapped back."""


def _gathered(view: DTensor, base: DTensor) -> bool:
    """Whether DTensor made ``view`` of ``base`` by gathering a dim it shards (a copy, now
    replicated there). From the placements, not storage: every rank decides alike."""
    return any(
        isinstance(b, Shard) and not isinstance(v, Shard)
        for b, v in zip(base.placements, view.placements, strict=True)
    )


def _sharded_dims(base: DTensor) -> list[int]:
    # From the placements, not this rank's box: every rank decides alike.
    return sorted({p.dim for p in base.placements if isinstance(p, Shard)})


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

    Remembers each copy while it lives (weakly), with the parameter and the view that made it.
    A copy made before its parameter was written again is stale: a write into it is refused
    rather than landing old values."""

    def __init__(self) -> None:
        super().__init__()
        # copy -> (parameter, view, its arguments); view None: a write cannot be mapped back.
        self.copies: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.recorded = False

    def _record(self, out: Any, base: DTensor, func: Any, rest: tuple[Any, ...]) -> None:
        outs = [out] if isinstance(out, DTensor) else pytree.tree_leaves(out)
        known = self.copies.get(base)
        for view in outs:
            if not isinstance(view, DTensor):
                continue
            if known is not None:
                # A view of a copy: a write into it cannot be traced to the parameter.
                self.copies[view] = (known[0], None, ())
            elif _gathered(view, base):
                # One view of one tensor maps back; a list of views (unbind, split) does not.
                self.copies[view] = (base, func if view is out else None, rest)
            else:
                continue
            self.recorded = True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            if args and isinstance(args[0], DTensor):
                self._record(out, args[0], func, args[1:])
            return out
        # Before the first copy no write can miss: most initializers make none.
        if self.recorded and func._schema.is_mutable:
            for leaf in _written(func, args, kwargs):
                kept = self.copies.get(leaf)
                if kept is not None:
                    source, view, view_args = kept
                    if view is None or not _write_back(leaf, source, view, view_args):
                        raise LostWrite(
                            f"it runs {func} on a copy of a sharded parameter (made by "
                            f"{view or 'a view of a view, or one of several views'}), a write "
                            "its shard would not get"
                        )
                else:
                    # The parameter itself written: copies made from it before are stale.
                    for copy, (source, _, _) in list(self.copies.items()):
                        if source is leaf:
                            self.copies[copy] = (source, None, ())
        return out

    def __exit__(self, *exc: object) -> None:
        self.copies = WeakIdKeyDictionary()
        self.recorded = False
        super().__exit__(*exc)


__all__ = ["WHOLE_TENSOR_INITIALIZERS", "LandedWrites", "LostWrite", "writes_whole_tensors"]
