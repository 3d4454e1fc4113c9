"""Which part of a full tensor a rank holds: the one rule every stage reads."""

from __future__ import annotations

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def chunk_size(length: int, parts: int) -> int:
    """Rows per rank in ``torch.chunk``'s layout, which ``fully_shard`` and FSDP1's flat
    parameters use: ``ceil(length / parts)``, the last ranks shorter or empty."""
    return -(-length // parts)


def local_box(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard shape and full-tensor offsets per dim, as DTensor computes them."""
    shape, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(shape), tuple(offsets)


def local_slices(tensor: DTensor) -> tuple[slice, ...]:
    """The slices of the full tensor that this rank's shard of ``tensor`` holds."""
    shape, offsets = local_box(tensor)
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
