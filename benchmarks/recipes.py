"""Builder recipes: the baselines' jobs done with ``fsdp_builder``, plus the builder's own.

Recipes whose classes this version of the library does not have yet are skipped with a note.
"""

from __future__ import annotations

import importlib
from typing import Any

import fsdp_builder
from benchmarks.common import CollectiveBytes, Job, Outcome, Recipe
from benchmarks.models import Block, make_model

# Where a class may live when the package does not export it (yet).
_SUBMODULES = ("fsdp_builder.materializers.sharded", "fsdp_builder.materializers.loading")


def _find(name: str) -> Any | None:
    found = getattr(fsdp_builder, name, None)
    for module_name in _SUBMODULES:
        if found is not None:
            break
        try:
            found = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            continue
    return found


def _has(*names: str) -> list[str]:
    """The names this version of fsdp_builder lacks."""
    return [n for n in names if _find(n) is None]


def _cls(name: str) -> Any:
    found = _find(name)
    assert found is not None, name
    return found


def _build(job: Job, backend: str, materializer: Any, *synchronizers: Any) -> Outcome:
    builder = _cls("FullyShardBuilder")() if backend == "fsdp2" else fsdp_builder.FSDPBuilder()
    device: Any = fsdp_builder.CPUDevice() if job.device.type == "cpu" else job.device
    builder.device(device).wrap(Block).sharding("full").materialize(materializer)
    if synchronizers:
        builder.synchronize(*synchronizers)
    module = builder.build(make_model(job.cfg, "meta", seed=job.seed))
    stages = builder.report.stages()
    comm = sum(int(s["comm_bytes"]) for s in stages)
    # The report counts synchronizer traffic; a loading materializer's is not reported.
    loads = not _has("FromStateDict") and isinstance(materializer, _cls("FromStateDict"))
    return Outcome(
        module=module,
        comm_bytes=None if loads and comm == 0 else comm,
        phases={str(s["name"]): float(s["seconds"]) for s in stages},
        phase_comm_bytes={str(s["name"]): int(s["comm_bytes"]) for s in stages},
        bucket_bytes=getattr(materializer, "bucket_bytes", None),
    )


def fsdp1_reset(job: Job) -> Outcome:
    return _build(job, "fsdp1", fsdp_builder.ResetParameters())


def fsdp2_reset(job: Job) -> Outcome:
    return _build(job, "fsdp2", fsdp_builder.ResetParameters())


def fsdp2_stream(job: Job) -> Outcome:
    return _build(job, "fsdp2", _cls("StreamInit")(seed=job.seed))


def fsdp2_shard_first(job: Job) -> Outcome:
    return _build(job, "fsdp2", _cls("ShardFirstReset")(seed=job.seed))


def fsdp1_deterministic(job: Job) -> Outcome:
    return _build(job, "fsdp1", _cls("DeterministicInit")(seed=job.seed))


def fsdp2_deterministic(job: Job) -> Outcome:
    return _build(job, "fsdp2", _cls("DeterministicInit")(seed=job.seed))


def fsdp1_broadcast(job: Job) -> Outcome:
    return _build(job, "fsdp1", fsdp_builder.ResetParameters(), _cls("BroadcastFromRank0")())


def fsdp2_load(job: Job) -> Outcome:
    source = job.source if job.rank == 0 else None
    return _build(job, "fsdp2", _cls("FromStateDict")(source))


def _checkpoint(job: Job, backend: str, path: str | None) -> Outcome:
    assert path is not None
    # The builder's report counts synchronizer traffic only; count every collective instead.
    with CollectiveBytes() as counted:
        outcome = _build(job, backend, _cls("FromCheckpoint")(path))
    outcome.comm_bytes = counted.total
    outcome.weight_comm_bytes = counted.floating
    return outcome


def fsdp2_checkpoint(job: Job) -> Outcome:
    return _checkpoint(job, "fsdp2", job.checkpoint)


def fsdp1_checkpoint(job: Job) -> Outcome:
    return _checkpoint(job, "fsdp1", job.checkpoint)


def fsdp2_dcp(job: Job) -> Outcome:
    return _checkpoint(job, "fsdp2", job.dcp)


_CANDIDATES: tuple[tuple[Recipe, tuple[str, ...]], ...] = (
    (
        Recipe(
            "builder_fsdp1_reset",
            "builder",
            "init",
            fsdp1_reset,
            "FSDPBuilder, per-unit ResetParameters from meta",
            per_unit=True,
        ),
        (),
    ),
    (
        Recipe(
            "builder_fsdp2_reset",
            "builder",
            "init",
            fsdp2_reset,
            "FullyShardBuilder, per-unit ResetParameters from meta",
            per_unit=True,
        ),
        ("FullyShardBuilder",),
    ),
    (
        Recipe(
            "builder_fsdp2_shard_first",
            "builder",
            "init",
            fsdp2_shard_first,
            "FullyShardBuilder, ShardFirstReset: shard on meta, initialize local shards only",
            per_unit=True,
        ),
        ("FullyShardBuilder", "ShardFirstReset"),
    ),
    (
        Recipe(
            "builder_fsdp2_stream",
            "builder",
            "init",
            fsdp2_stream,
            "FullyShardBuilder, StreamInit (its default): shard on meta, fill local shards with "
            "world-size-invariant values",
            per_unit=True,
        ),
        ("FullyShardBuilder", "StreamInit"),
    ),
    (
        Recipe(
            "builder_fsdp1_det",
            "builder",
            "init",
            fsdp1_deterministic,
            "FSDPBuilder, per-unit DeterministicInit",
            deterministic=True,
            per_unit=True,
        ),
        ("DeterministicInit",),
    ),
    (
        Recipe(
            "builder_fsdp2_det",
            "builder",
            "init",
            fsdp2_deterministic,
            "FullyShardBuilder, per-unit DeterministicInit",
            deterministic=True,
            per_unit=True,
        ),
        ("FullyShardBuilder", "DeterministicInit"),
    ),
    (
        Recipe(
            "builder_fsdp2_load",
            "builder",
            "load",
            fsdp2_load,
            "FullyShardBuilder, FromStateDict streamed (scattered) from rank 0",
            needs_source=True,
            deterministic=True,
            per_unit=True,
        ),
        ("FullyShardBuilder", "FromStateDict"),
    ),
    (
        Recipe(
            "builder_fsdp2_checkpoint",
            "builder",
            "load_file",
            fsdp2_checkpoint,
            "FullyShardBuilder, FromCheckpoint: each rank reads its own rows of the .safetensors",
            needs_checkpoint=True,
            deterministic=True,
            per_unit=True,
        ),
        ("FullyShardBuilder", "FromCheckpoint"),
    ),
    (
        Recipe(
            "builder_fsdp1_checkpoint",
            "builder",
            "load_file",
            fsdp1_checkpoint,
            "FSDPBuilder, FromCheckpoint: each rank reads one unit at a time, FSDP1 cuts its shard",
            needs_checkpoint=True,
            deterministic=True,
            per_unit=True,
        ),
        ("FromCheckpoint",),
    ),
    (
        Recipe(
            "builder_fsdp2_dcp",
            "builder",
            "load_dcp",
            fsdp2_dcp,
            "FullyShardBuilder, FromCheckpoint(DCP folder): each rank loads its own shards, "
            "unit by unit",
            needs_dcp=True,
            deterministic=True,
            per_unit=True,
        ),
        ("FullyShardBuilder", "FromCheckpoint"),
    ),
    (
        Recipe(
            "builder_fsdp1_bcast",
            "builder",
            "sync",
            fsdp1_broadcast,
            "FSDPBuilder, ResetParameters + BroadcastFromRank0",
            per_unit=True,
        ),
        ("BroadcastFromRank0",),
    ),
)


def builder_recipes() -> tuple[list[Recipe], list[str]]:
    """The recipes this version of the library supports, and a note for each one skipped."""
    found: list[Recipe] = []
    notes: list[str] = []
    for recipe, needs in _CANDIDATES:
        missing = _has(*needs)
        if missing:
            notes.append(f"{recipe.name}: skipped, fsdp_builder has no {', '.join(missing)} yet")
        else:
            found.append(recipe)
    return found, notes
