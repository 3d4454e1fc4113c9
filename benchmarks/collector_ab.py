"""In-process A/B of how a build turns the cyclic collector back on: the library's way
(``pipeline._resume_collector``: the build's young objects moved to the oldest generation, then
``gc.enable``) against a plain ``gc.enable``, whose first young-generation pass then scans every
object the build allocated. The two alternate build by build in the same 2 gloo ranks (old
first in even repeats), so the machine's drift between processes does not enter; CPU is each
rank's process time over the build, summed over the ranks.

    python -m benchmarks.collector_ab [--recipes builder_fsdp2,...] [--repeats 12] [--units 400]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import quartiles_cell

SIDES = ("old", "new")


def rank(recipes: list[str], repeats: int, units: int) -> dict[str, dict[str, list[float]]]:
    """One rank: every recipe's builds, both sides alternated; CPU seconds summed over ranks."""
    from benchmarks.scaling import warmed_rank
    from benchmarks.units import UnitsConfig
    from fsdp_builder import pipeline

    library_way = pipeline._resume_collector
    found: dict[str, dict[str, list[float]]] = {}
    try:
        for name in recipes:
            run, job = warmed_rank(name, 32)
            for repeat in range(repeats):
                for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                    pipeline._resume_collector = library_way if side == "new" else gc.enable
                    gc.collect()
                    dist.barrier()
                    start = time.process_time()
                    model = run(UnitsConfig(units=units, dim=32), job)
                    dist.barrier()
                    cpu = torch.tensor([time.process_time() - start], dtype=torch.float64)
                    dist.all_reduce(cpu)
                    found.setdefault(name, {}).setdefault(side, []).append(float(cpu))
                    del model
    finally:
        pipeline._resume_collector = library_way
    return found


def render(found: dict[str, dict[str, list[float]]]) -> str:
    lines = [
        "| recipe | builds a side | new CPU s | old CPU s | new ÷ old per pair: min - q1 - "
        "**median** - q3 - max |",
        "|---|---:|---:|---:|---|",
    ]
    for name, sides in found.items():
        ratios = [n / o for n, o in zip(sides["new"], sides["old"], strict=True)]
        lines.append(
            f"| {name} | {len(ratios)} | {statistics.median(sides['new']):.3f} | "
            f"{statistics.median(sides['old']):.3f} | {quartiles_cell(ratios)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from fsdp_builder.tools.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--recipes", default="builder_fsdp2,builder_fsdp2_shard_first,builder_fsdp1")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--units", type=int, default=400)
    args = p.parse_args(argv)
    recipes = args.recipes.split(",")
    results: list[Any] = run_ranks(
        rank, 2, recipes, args.repeats, args.units, timeout=1800.0, start_method="forkserver"
    )
    print(render(results[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
