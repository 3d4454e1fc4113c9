"""Per-rank memory estimates from a unit plan, without any process group.

The numbers follow each backend's shard layout: FSDP1 flattens a unit's parameters into one
tensor padded to a multiple of the shard group size; FSDP2 shards every parameter along dim 0,
padding that dim. Buffers are replicated on every rank. Build peaks are the states held at the
worst moment of a build, not counting allocator slack or communication buffers.
"""

from __future__ import annotations

import torch
from attrs import frozen

from fsdp_builder.errors import ConfigurationError
from fsdp_builder.groups import AutoHybridGroups
from fsdp_builder.plan import Unit, UnitPlan

BACKENDS = ("fsdp1", "fsdp2")
STRATEGIES = ("full", "grad_op", "hybrid", "none")


def local_node_size(world_size: int) -> int:
    """Ranks per node when a single machine stands in for several (the demo's CPU ranks):
    nodes of 2 when the world is even and larger than 2, else one node."""
    return 2 if world_size % 2 == 0 and world_size > 2 else world_size


def hybrid_shard_size(world_size: int, devices_per_node: int | None = None) -> int:
    """Ranks per shard group under hybrid sharding: what ``AutoHybridGroups`` would resolve
    (the given devices per node, else the CUDA device count, else ``LOCAL_WORLD_SIZE``) when it
    divides the world, else ``local_node_size``."""
    try:
        n = AutoHybridGroups(devices_per_node=devices_per_node).resolved_devices_per_node()
    except ConfigurationError:
        return local_node_size(world_size)
    return n if n <= world_size and world_size % n == 0 else local_node_size(world_size)


def shard_size(world_size: int, strategy: str, devices_per_node: int | None = None) -> int:
    """How many ranks one parameter is split over."""
    if strategy == "none" or world_size <= 1:
        return 1
    if strategy == "hybrid":
        return hybrid_shard_size(world_size, devices_per_node)
    return world_size


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def unit_shard_bytes(unit: Unit, shards: int, backend: str) -> int:
    """Parameter bytes of one unit that a rank keeps."""
    if shards <= 1:
        return unit.param_bytes
    if backend == "fsdp1":
        # One flat parameter per unit (per dtype), padded to a multiple of the shard count.
        by_dtype: dict[torch.dtype, int] = {}
        for p in unit.params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel
        return sum(_ceil_div(n, shards) * d.itemsize for d, n in by_dtype.items())
    total = 0
    for p in unit.params:
        rows = p.shape[0] if p.shape else 1
        per_row = p.numel // rows if rows else 0
        total += _ceil_div(rows, shards) * per_row * p.dtype.itemsize
    return total


def sharded_bytes(
    plan: UnitPlan,
    world_size: int,
    strategy: str,
    backend: str = "fsdp2",
    devices_per_node: int | None = None,
) -> int:
    """States a rank keeps after the build: its parameter shards plus every buffer."""
    shards = shard_size(world_size, strategy, devices_per_node)
    return sum(unit_shard_bytes(u, shards, backend) + u.buffer_bytes for u in plan)


@frozen
class Estimate:
    backend: str
    strategy: str
    shard_size: int
    after_build: int
    # Per-unit build (materialize a full unit, then shard it): the worst unit's moment.
    per_unit_peak: int
    # Shard on meta first, then give only the local shards storage (FSDP2 only).
    shard_first_peak: int | None
    # The whole model materialized on every rank before sharding.
    full_model_peak: int


def estimate(
    plan: UnitPlan,
    world_size: int,
    strategy: str,
    backend: str,
    devices_per_node: int | None = None,
) -> Estimate:
    shards = shard_size(world_size, strategy, devices_per_node)
    kept = [unit_shard_bytes(u, shards, backend) + u.buffer_bytes for u in plan]
    after = sum(kept)
    # While unit k is sharded the rank holds the shards of units before it, unit k in full and
    # the backend's working copy: FSDP1 concatenates the unit into a flat tensor (a second full
    # copy) before cutting its shard; FSDP2 copies out only the local shard of each parameter.
    peak = 0
    done = 0
    extras = [
        u.param_bytes if backend == "fsdp1" else (k if shards > 1 else 0)
        for u, k in zip(plan, kept, strict=True)
    ]
    for unit, own, extra in zip(plan, kept, extras, strict=True):
        peak = max(peak, done + unit.nbytes + extra)
        done += own
    full_peak = plan.nbytes + max(extras, default=0)
    return Estimate(
        backend=backend,
        strategy=strategy,
        shard_size=shards,
        after_build=after,
        per_unit_peak=peak,
        shard_first_peak=after if backend == "fsdp2" else None,
        full_model_peak=max(full_peak, peak),
    )


def estimates(
    plan: UnitPlan, world_size: int, devices_per_node: int | None = None
) -> list[Estimate]:
    return [
        estimate(plan, world_size, strategy, backend, devices_per_node)
        for backend in BACKENDS
        for strategy in STRATEGIES
    ]


def build_peak_bytes(plan: UnitPlan, world_size: int, strategy: str, per_unit: bool) -> int:
    """Peak during an FSDP2 build: per unit, or with the whole model materialized first."""
    e = estimate(plan, world_size, strategy, "fsdp2")
    return e.per_unit_peak if per_unit else e.full_model_peak


def format_estimates(plan: UnitPlan, world_size: int, devices_per_node: int | None = None) -> str:
    mib = 1024 * 1024
    hybrid = hybrid_shard_size(world_size, devices_per_node)
    lines = [
        f"estimated per-rank memory at world size {world_size} (MiB); hybrid: shard groups of "
        f"{hybrid}, {world_size // hybrid} replica(s):",
        f"  {'backend':<8} {'strategy':<9} {'shards':>6} {'after build':>12} "
        f"{'peak per-unit':>14} {'peak shard-first':>17} {'peak full model':>16}",
    ]
    for e in estimates(plan, world_size, devices_per_node):
        first = "-" if e.shard_first_peak is None else f"{e.shard_first_peak / mib:.2f}"
        lines.append(
            f"  {e.backend:<8} {e.strategy:<9} {e.shard_size:>6} {e.after_build / mib:>12.2f} "
            f"{e.per_unit_peak / mib:>14.2f} {first:>17} {e.full_model_peak / mib:>16.2f}"
        )
    lines.append(
        f"largest unit: {plan.largest_unit_bytes / mib:.2f} MiB; model: {plan.nbytes / mib:.2f} "
        "MiB. Peaks count states only (no allocator slack or communication buffers)."
    )
    return "\n".join(lines)
