"""Per-rank memory estimates from a unit plan, without any process group."""

from __future__ import annotations

from fsdp_builder.plan import UnitPlan


def sharded_bytes(plan: UnitPlan, world_size: int, strategy: str) -> int:
    """Parameter bytes a rank keeps after the build (buffers are replicated)."""
    params = sum(u.param_bytes for u in plan)
    buffers = sum(u.buffer_bytes for u in plan)
    if strategy == "none" or world_size <= 1:
        return params + buffers
    if strategy == "hybrid":
        shard = 2 if world_size % 2 == 0 and world_size > 2 else world_size
        return -(-params // shard) + buffers
    return -(-params // world_size) + buffers


def build_peak_bytes(plan: UnitPlan, world_size: int, strategy: str, per_unit: bool) -> int:
    """Peak during the build: a per-unit build holds its shards plus one full unit; a build
    that materializes the whole model first holds the model plus its shards."""
    kept = sharded_bytes(plan, world_size, strategy)
    return kept + (plan.largest_unit_bytes if per_unit else plan.nbytes)


def format_estimates(plan: UnitPlan, world_size: int) -> str:
    mib = 1024 * 1024
    lines = [
        f"estimated per-rank memory at world size {world_size} (MiB):",
        f"  {'backend':<8} {'strategy':<9} {'after build':>12} {'build peak':>11}",
    ]
    for backend in ("fsdp1", "fsdp2"):
        for strategy in ("full", "grad_op", "hybrid", "none"):
            kept = sharded_bytes(plan, world_size, strategy)
            peak = build_peak_bytes(plan, world_size, strategy, per_unit=True)
            lines.append(f"  {backend:<8} {strategy:<9} {kept / mib:>12.2f} {peak / mib:>11.2f}")
    return "\n".join(lines)
