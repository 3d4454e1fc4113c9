"""Which part of a full tensor a rank holds (``fsdp_builder.runtime.shards``), against the pieces
``torch.chunk`` cuts, as ``fully_shard`` lays them out, on every rank of a 2 x 2 mesh."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from fsdp_builder.materializers.checkpoints import local_index
from fsdp_builder.runtime.shards import chunk_size, local_slices

FULL = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)


def piece(
    full: torch.Tensor, placements: tuple[Placement, ...], coord: tuple[int, ...]
) -> torch.Tensor:
    """What torch.chunk gives this mesh coordinate: each mesh dim cuts the previous piece."""
    out = full
    for placement, index in zip(placements, coord, strict=True):
        if isinstance(placement, Shard):
            chunks = torch.chunk(out, 2, dim=placement.dim)
            out = chunks[index] if index < len(chunks) else out.narrow(placement.dim, 0, 0)
    return out


@pytest.fixture
def fake_rank() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


PLACEMENTS = [
    (Shard(0), Shard(0)),  # one dim sharded twice (7 rows: 4 + 3, then 2 + 2 and 2 + 1)
    (Shard(0), Shard(1)),
    (Replicate(), Shard(0)),  # hybrid sharding
    (Shard(1), Replicate()),
]


@pytest.mark.parametrize("placements", PLACEMENTS, ids=str)
@pytest.mark.parametrize("rank", range(4))
def test_each_rank_holds_the_piece_torch_chunk_cuts(
    fake_rank: None, placements: tuple[Placement, ...], rank: int
) -> None:
    dist.init_process_group("fake", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2))
    coord = (rank // 2, rank % 2)
    expected = piece(FULL, placements, coord)
    local = torch.empty(expected.shape)
    dtensor = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=FULL.shape, stride=FULL.stride()
    )
    assert torch.equal(FULL[local_slices(dtensor)], expected)
    assert torch.equal(FULL[local_index(dtensor)], expected)


def test_chunk_size_is_torch_chunks_first_piece() -> None:
    for length in range(0, 12):
        for parts in range(1, 6):
            chunks = torch.chunk(torch.empty(length), parts) if length else ()
            assert chunk_size(length, parts) == (len(chunks[0]) if chunks else 0)


def test_each_rank_of_one_process_gets_its_own_piece_for_a_layout_seen_before() -> None:
    """The shard layout is computed once per layout; a layout seen on another coordinate or mesh
    shape must not hand back that coordinate's piece."""
    placements = (Shard(0), Shard(0))
    for shape in ((2, 2), (4,), (2, 2)):
        for rank in range(4):
            dist.init_process_group("fake", rank=rank, world_size=4)
            try:
                mesh = init_device_mesh("cpu", shape)
                place = placements[: len(shape)]
                coord = (rank // 2, rank % 2) if len(shape) == 2 else (rank,)
                expected = (
                    piece(FULL, place, coord) if len(shape) == 2 else torch.chunk(FULL, 4)[rank]
                )
                dtensor = DTensor.from_local(
                    torch.empty(expected.shape),
                    mesh,
                    place,
                    run_check=False,
                    shape=FULL.shape,
                    stride=FULL.stride(),
                )
                assert torch.equal(FULL[local_slices(dtensor)], expected)
            finally:
                dist.destroy_process_group()
