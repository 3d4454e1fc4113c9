"""Plain torch, two orders of the same work: ``fully_shard`` on every block on meta and then
``to_empty`` + ``reset_parameters`` (the batched order), against sharding and filling each block
in turn. Why the builder shards every unit before it fills the first when all are on meta.

Both orders run in the same 2 gloo ranks, alternated each repeat; each build's CPU is rank 0's
main-thread time, split into the three parts. Plain torch only: no ``fsdp_builder`` import.

    python -m benchmarks.shard_order [--units 400] [--repeats 20]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from benchmarks.harness import launch
from benchmarks.units import SmallStack, UnitsConfig, make_stack

PARTS = ("fully_shard", "to_empty", "reset_parameters")
Parts = dict[str, float]


def _reset(modules: list[nn.Module]) -> None:
    with torch.no_grad():
        for module in modules:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _timed(parts: Parts, part: str, fn: Callable[..., object], *args: object) -> None:
    start = time.thread_time()
    fn(*args)
    parts[part] = parts.get(part, 0.0) + time.thread_time() - start


def _shard(module: nn.Module, mesh: DeviceMesh) -> None:
    fully_shard(module, mesh=mesh)


def _to_empty(module: nn.Module) -> None:
    module.to_empty(device="cpu")


def batched(model: SmallStack, mesh: DeviceMesh, parts: Parts) -> None:
    """Every block sharded, then the whole model given storage and initialized."""

    def shard() -> None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    _timed(parts, "fully_shard", shard)
    _timed(parts, "to_empty", _to_empty, model)
    _timed(parts, "reset_parameters", _reset, list(model.modules()))


def per_unit(model: SmallStack, mesh: DeviceMesh, parts: Parts) -> None:
    """Each block sharded, given storage and initialized before the next; the root last."""
    for block in model.blocks:
        _timed(parts, "fully_shard", _shard, block, mesh)
        _timed(parts, "to_empty", _to_empty, block)
        _timed(parts, "reset_parameters", _reset, list(block.modules()))
    _timed(parts, "fully_shard", _shard, model, mesh)


ORDERS: dict[str, Callable[[SmallStack, DeviceMesh, Parts], None]] = {
    "batched": batched,
    "per_unit": per_unit,
}


def rank(units: int, repeats: int) -> dict[str, object]:
    """One rank: each order ``repeats`` times, alternated; per build its parts' CPU seconds, and
    the local shards each order gave from the same seed."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    builds: dict[str, list[Parts]] = {name: [] for name in ORDERS}
    shards: dict[str, list[torch.Tensor]] = {}
    for order in ORDERS.values():  # a warm-up build of each
        order(make_stack(UnitsConfig(units=4)), mesh, {})
    for repeat in range(repeats):
        names = list(ORDERS) if repeat % 2 == 0 else list(reversed(ORDERS))
        for name in names:
            model = make_stack(UnitsConfig(units=units))
            gc.collect()
            dist.barrier()
            torch.manual_seed(repeat)
            parts: Parts = {}
            ORDERS[name](model, mesh, parts)
            builds[name].append(parts)
            if repeat == 0:
                shards[name] = [_local(p).clone() for p in model.parameters()]
    dist.barrier()
    pairs = zip(shards["batched"], shards["per_unit"], strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    return {"builds": builds, "same_values": same}


def summary(builds: dict[str, list[Parts]]) -> str:
    """Medians per part, and the per-repeat ratio per_unit ÷ batched."""
    lines = ["| order | total | " + " | ".join(PARTS) + " |", "|---|---:|" + "---:|" * len(PARTS)]
    for name, runs in builds.items():
        cells = [statistics.median(sum(b.values()) for b in runs)]
        cells += [statistics.median(b[part] for b in runs) for part in PARTS]
        lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    ratios = sorted(
        sum(a.values()) / sum(b.values())
        for a, b in zip(builds["per_unit"], builds["batched"], strict=True)
    )
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    lines.append(
        f"\nper_unit ÷ batched, per repeat: min {ratios[0]:.2f}, q1 {quartiles[0]:.2f}, "
        f"**median {statistics.median(ratios):.2f}**, q3 {quartiles[2]:.2f}, max {ratios[-1]:.2f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    results = launch(rank, 2, args.units, args.repeats, timeout=1800.0, backend="gloo")
    first = results[0]
    print(f"{args.units} units, d=32, 2 gloo ranks, {args.repeats} repeats; rank 0's thread CPU s")
    print(summary(first["builds"]))
    print(f"\nthe same local shards from the same seed in both orders: {first['same_values']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
