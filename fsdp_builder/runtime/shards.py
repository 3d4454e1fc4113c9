"""Which part of a full tensor a rank holds: the one rule every stage reads."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def chunk_size(length: int, parts: int) -> int:
    """Rows per rank in ``torch.chunk``'s layout, which ``fully_shard`` and FSDP1's flat
    parameters use: ``ceil(length / parts)``, the last ranks shorter or empty."""
    return -(-length // parts)


Box = tuple[tuple[int, ...], tuple[int, ...]]

# DTensor's computation costs about 100 µs a call (it traces on meta), as much as reading a small
# parameter; its result is a function of the layout alone, which a build meets a few times over.
_BOXES: dict[tuple[Any, ...], Box] = {}
_MAX_BOXES = 1 << 14


def local_box(tensor: DTensor) -> Box:
    """This rank's shard shape and full-tensor offsets per dim, as DTensor computes them."""
    mesh = tensor.device_mesh
    layout = (
        tuple(tensor.shape),
        tuple(tensor.placements),
        tuple(mesh.shape),
        tuple(mesh.get_coordinate() or ()),
    )
    box = _BOXES.get(layout)
    if box is None:
        shape, offsets = compute_local_shape_and_global_offset(
            tensor.shape, mesh, tensor.placements
        )
        if len(_BOXES) >= _MAX_BOXES:
            _BOXES.clear()
        box = _BOXES[layout] = (tuple(shape), tuple(offsets))
    return box


def local_slices(tensor: DTensor) -> tuple[slice, ...]:
    """The slices of the full tensor that this rank's shard of ``tensor`` holds."""
    shape, offsets = local_box(tensor)
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
