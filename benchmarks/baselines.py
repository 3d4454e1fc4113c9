"""Plain-PyTorch baselines, written the way users write them today.

Deliberately free of any ``fsdp_builder`` import: these are what the builder is measured against.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from benchmarks.common import CollectiveBytes, Job, Outcome, Recipe
from benchmarks.models import BenchTransformer, Block, make_model, reset_module


def _fsdp1_kwargs(job: Job) -> dict[str, object]:
    # FSDP1 refuses to run on CPU unless device_id says so explicitly.
    return {"auto_wrap_policy": ModuleWrapPolicy({Block}), "device_id": job.device}


def fsdp1_full(job: Job) -> Outcome:
    """Every rank builds and initializes the whole model, then FSDP1 shards it."""
    model = make_model(job.cfg, job.device, seed=job.seed)
    return Outcome(module=FullyShardedDataParallel(model, **_fsdp1_kwargs(job)), comm_bytes=0)  # type: ignore[arg-type]


def _param_init_fn(device: torch.device) -> object:
    def init(module: nn.Module) -> None:
        # FSDP1 calls this per module of a unit; recurse=False keeps each call to its own states.
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            reset_module(module)

    return init


def fsdp1_meta(job: Job) -> Outcome:
    """The model on meta; FSDP1's ``param_init_fn`` does to_empty + reset_parameters per unit."""
    torch.manual_seed(job.seed)
    model = make_model(job.cfg, "meta", seed=job.seed)
    wrapped = FullyShardedDataParallel(
        model,
        param_init_fn=_param_init_fn(job.device),  # type: ignore[arg-type]
        **_fsdp1_kwargs(job),  # type: ignore[arg-type]
    )
    return Outcome(module=wrapped, comm_bytes=0)


def _fully_shard_meta(job: Job) -> BenchTransformer:
    mesh: DeviceMesh = init_device_mesh(job.device.type, (job.world_size,))
    model = make_model(job.cfg, "meta", seed=job.seed)
    assert isinstance(model, BenchTransformer)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=job.device)
    return model


def fsdp2_meta(job: Job) -> Outcome:
    """FSDP2 on meta, then ``to_empty`` and ``reset_parameters`` on the sharded model."""
    model = _fully_shard_meta(job)
    with torch.no_grad():
        for module in model.modules():
            reset_module(module)
    return Outcome(module=model, comm_bytes=0)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _shapes(job: Job) -> dict[str, torch.Tensor]:
    return make_model(job.cfg, "meta").state_dict()


def fsdp2_load_bcast(job: Job) -> Outcome:
    """FSDP2 on meta, then rank 0's full state dict via ``set_model_state_dict`` with
    ``broadcast_from_rank0=True`` (every full tensor goes to every rank)."""
    model = _fully_shard_meta(job)
    full: dict[str, Any] = dict(job.source) if job.rank == 0 and job.source is not None else {}
    set_model_state_dict(
        model,
        full,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    return Outcome(module=model, comm_bytes=_nbytes(_shapes(job)))


def fsdp2_load_distribute(job: Job) -> Outcome:
    """FSDP2 on meta, then every parameter from rank 0's full state dict through torch's
    ``distribute_tensor(..., src_data_rank=0)`` (one scatter per tensor), copied into the local
    shard; buffers broadcast. The plain-torch form of the builder's load from rank 0."""
    from torch.distributed.tensor import distribute_tensor

    model = _fully_shard_meta(job)
    full = job.source if job.rank == 0 else None
    moved = 0
    with torch.no_grad():
        for name, state in [*model.named_parameters(), *model.named_buffers()]:
            # Other ranks pass a tensor of the full shape: distribute_tensor reads only rank 0's.
            src = full[name] if full is not None else torch.empty(state.shape, dtype=state.dtype)
            if isinstance(state, DTensor):
                part = distribute_tensor(src, state.device_mesh, state.placements, src_data_rank=0)
                state.to_local().copy_(part.to_local())
                moved += state.to_local().numel() * state.element_size()
            else:
                state.copy_(src)
                dist.broadcast(state, src=0)
                moved += state.numel() * state.element_size()
    return Outcome(module=model, comm_bytes=moved)


def fsdp2_file_bcast(job: Job) -> Outcome:
    """What Accelerate and Lightning do with a safetensors checkpoint: rank 0 reads it with
    ``safetensors.torch.load_file``, then ``set_model_state_dict(broadcast_from_rank0=True)``
    into an FSDP2 model on meta (the read is part of the job)."""
    from safetensors.torch import load_file

    assert job.checkpoint is not None
    model = _fully_shard_meta(job)
    full: dict[str, Any] = load_file(job.checkpoint) if job.rank == 0 else {}
    set_model_state_dict(
        model,
        full,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    return Outcome(module=model, comm_bytes=_nbytes(_shapes(job)))


def fsdp2_dcp_load(job: Job) -> Outcome:
    """What torchtitan does on resume: FSDP2 on meta, ``to_empty``, then ``dcp.load`` of the
    sharded model state dict from a DCP folder (each rank reads its own shards), then
    ``set_model_state_dict``. Comm: bytes of the collectives it makes, counted."""
    import torch.distributed.checkpoint as dcp

    assert job.dcp is not None
    with CollectiveBytes() as counted:
        model = _fully_shard_meta(job)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=job.dcp)
        set_model_state_dict(model, state)
    return Outcome(module=model, comm_bytes=counted.total, weight_comm_bytes=counted.floating)


def _own_rows(job: Job, rows: int) -> slice:
    """The rows of a ``rows``-row tensor that ``fully_shard`` keeps on this rank: ``ceil(rows /
    W)`` per rank, the last ranks shorter or empty."""
    per = -(-rows // job.world_size)
    start = min(job.rank * per, rows)
    return slice(start, min(start + per, rows))


def fsdp2_file_slices(job: Job) -> Outcome:
    """The rank-local load written by hand: FSDP2 on meta, ``to_empty``, then each rank copies
    its own rows of every parameter from the .safetensors file (``safe_open(...).get_slice``)
    into its local shard, with no communication. (The bench model has no buffers; were one
    added, it would stay unwritten here and the smoke run's checksum check would say so.)"""
    from safetensors import safe_open

    assert job.checkpoint is not None
    model = _fully_shard_meta(job)
    with torch.no_grad(), safe_open(job.checkpoint, framework="pt", device="cpu") as handle:
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor)
            local = param.to_local()
            if local.numel():
                piece = handle.get_slice(name)
                local.copy_(piece[_own_rows(job, piece.get_shape()[0])])
    return Outcome(module=model, comm_bytes=0)


def read_floor(job: Job) -> Outcome:
    """Each rank reads its dim-0 slices of every tensor from the safetensors file into tensors
    of its own, with no model and no communication (the floor of a rank-local load)."""
    from safetensors import safe_open

    assert job.checkpoint is not None
    kept: dict[str, torch.Tensor] = {}
    with safe_open(job.checkpoint, framework="pt", device="cpu") as handle:
        for name in handle.keys():
            piece = handle.get_slice(name)
            rows_read = piece[_own_rows(job, piece.get_shape()[0])]
            # Into storage of its own, as a model's shard: a slice may view the file's mapping.
            kept[name] = torch.empty_like(rows_read, device=job.device).copy_(rows_read)
    outcome = Outcome(comm_bytes=0)
    del kept  # held until every slice was read, so the peak counts them all
    return outcome


def broadcast_floor(job: Job) -> Outcome:
    """The same bytes as the model, one ``dist.broadcast`` per tensor from rank 0.

    Its "synchronize" phase times the broadcasts alone, into receive buffers already written
    once, as a synchronizer finds them after materialization.
    """
    if job.rank == 0:
        assert job.source is not None
        tensors = job.source
    else:
        tensors = {
            k: torch.zeros(v.shape, dtype=v.dtype, device=job.device)
            for k, v in _shapes(job).items()
        }
    dist.barrier()
    start = time.perf_counter()
    for t in tensors.values():
        dist.broadcast(t, src=0)
    elapsed = time.perf_counter() - start
    return Outcome(
        comm_bytes=_nbytes(tensors),
        phases={"synchronize": elapsed},
        phase_comm_bytes={"broadcast": _nbytes(tensors)},
    )


def scatter_floor(job: Job) -> Outcome:
    """Each rank gets only its dim-0 shard of every tensor, one ``dist.scatter`` per tensor
    (shards padded to equal size, as FSDP2 lays them out)."""
    world, rank = job.world_size, job.rank
    sent = 0
    received = 0
    shards: dict[str, torch.Tensor] = {}  # what this rank keeps, as a loaded model would
    for name, meta in _shapes(job).items():
        rows = meta.shape[0]
        per = -(-rows // world)
        out = torch.empty((per, *meta.shape[1:]), dtype=meta.dtype, device=job.device)
        chunks: list[torch.Tensor] | None = None
        if rank == 0:
            assert job.source is not None
            full = job.source[name]
            chunks = []
            for r in range(world):
                part = full[r * per : (r + 1) * per]
                if part.shape[0] < per:
                    padded = torch.zeros_like(out)
                    padded[: part.shape[0]] = part
                    part = padded
                chunks.append(part.contiguous())
            sent += sum(c.numel() * c.element_size() for c in chunks[1:])
        else:
            received += out.numel() * out.element_size()
        dist.scatter(out, chunks, src=0)
        shards[name] = out
    outcome = Outcome(comm_bytes=sent if rank == 0 else received)
    del shards  # held until every shard has arrived, so the peak counts them all
    return outcome


BASELINES: tuple[Recipe, ...] = (
    Recipe(
        "fsdp1_full",
        "baseline",
        "init",
        fsdp1_full,
        "FSDP1, full model built on every rank",
        deterministic=True,
    ),
    Recipe(
        "fsdp1_meta",
        "baseline",
        "init",
        fsdp1_meta,
        "FSDP1 on meta, param_init_fn: to_empty + reset_parameters",
        per_unit=True,
    ),
    Recipe(
        "fsdp2_meta",
        "baseline",
        "init",
        fsdp2_meta,
        "FSDP2 on meta, then to_empty + reset_parameters",
    ),
    Recipe(
        "fsdp2_load_bcast",
        "baseline",
        "load",
        fsdp2_load_bcast,
        "FSDP2 + set_model_state_dict(broadcast_from_rank0=True)",
        needs_source=True,
        deterministic=True,
    ),
    Recipe(
        "fsdp2_load_distribute",
        "baseline",
        "load",
        fsdp2_load_distribute,
        "FSDP2 + distribute_tensor(src_data_rank=0) per parameter from rank 0's state dict",
        needs_source=True,
        deterministic=True,
    ),
    Recipe(
        "fsdp2_file_bcast",
        "baseline",
        "load_file",
        fsdp2_file_bcast,
        "FSDP2 + rank 0 load_file(.safetensors) + set_model_state_dict(broadcast_from_rank0)",
        needs_checkpoint=True,
        deterministic=True,
    ),
    Recipe(
        "fsdp2_dcp_load",
        "baseline",
        "load_dcp",
        fsdp2_dcp_load,
        "FSDP2 on meta + to_empty + dcp.load(sharded state dict) from a DCP folder (torchtitan)",
        needs_dcp=True,
        deterministic=True,
    ),
    Recipe(
        "fsdp2_file_slices",
        "baseline",
        "load_file",
        fsdp2_file_slices,
        "FSDP2 on meta + to_empty + each rank copies its rows from the .safetensors file "
        "(rank-local load by hand)",
        needs_checkpoint=True,
        deterministic=True,
    ),
    Recipe(
        "read_floor",
        "baseline",
        "load_file",
        read_floor,
        "each rank reads its own dim-0 slices of the .safetensors file (rank-local read floor)",
        needs_checkpoint=True,
    ),
    Recipe(
        "broadcast_floor",
        "baseline",
        "sync",
        broadcast_floor,
        "raw dist.broadcast of the model's bytes (sync floor)",
        needs_source=True,
    ),
    Recipe(
        "scatter_floor",
        "baseline",
        "load",
        scatter_floor,
        "plain dist.scatter of the same shards (load floor)",
        needs_source=True,
    ),
)
