"""Where the rank-local load's time goes beyond the same load written by hand: the builder's
``FromCheckpoint`` with its NaN/inf check (the default), the same without it
(``nonfinite="ignore"``), and ``fsdp2_file_slices`` (FSDP2 on meta, ``to_empty``, each rank
copying its rows from the file), interleaved build by build in the same 2 gloo ranks (order
reversed every other repeat). Every large tensor is its own mapping, as in the harness, so each
build faults in fresh pages. Per build: CPU of the rank that used most, wall of the slowest.

    python -m benchmarks.load_gap [--params 200000000] [--repeats 14]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

WAYS = ("check", "no_check", "by_hand")


def _ways() -> dict[str, Callable[[Any], Any]]:
    import fsdp_builder
    from benchmarks import baselines, recipes

    def build(job: Any, **options: Any) -> Any:
        return recipes._build(job, "fsdp2", fsdp_builder.FromCheckpoint(job.checkpoint, **options))

    return {
        "check": build,
        "no_check": lambda job: build(job, nonfinite="ignore"),
        "by_hand": baselines.fsdp2_file_slices,
    }


def rank(path: str, params: int, repeats: int) -> dict[str, list[list[float]]]:
    from benchmarks.common import Job
    from benchmarks.harness import _fixed_malloc_threshold
    from benchmarks.models import BenchConfig

    _fixed_malloc_threshold()  # every large tensor its own mapping, as in the harness
    torch.set_num_threads(1)
    ways = _ways()
    job = Job(
        cfg=BenchConfig.for_params(params),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=torch.device("cpu"),
        checkpoint=path,
    )
    for way in ways.values():  # warm-up: lazy imports, first-call caches
        way(job)
    found: dict[str, list[list[float]]] = {}
    for repeat in range(repeats):
        for name in WAYS if repeat % 2 == 0 else WAYS[::-1]:
            gc.collect()
            dist.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            outcome = ways[name](job)
            spent = torch.tensor(
                [time.process_time() - cpu, time.perf_counter() - wall], dtype=torch.float64
            )
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            found.setdefault(name, []).append(spent.tolist())
            del outcome
    return found


def render(found: dict[str, list[list[float]]]) -> str:
    median = statistics.median
    lines = [
        "| way | builds | CPU s (busiest rank) | wall s (slowest rank) | ÷ by hand, CPU, paired "
        "median | ÷ by hand, wall, paired median |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    hand = found["by_hand"]
    for name in WAYS:
        runs = found[name]
        cpu = median(a[0] / b[0] for a, b in zip(runs, hand, strict=True))
        wall = median(a[1] / b[1] for a, b in zip(runs, hand, strict=True))
        lines.append(
            f"| {name} | {len(runs)} | {median(r[0] for r in runs):.3f} | "
            f"{median(r[1] for r in runs):.3f} | {cpu:.2f} | {wall:.2f} |"
        )
    check = median(a[0] / b[0] for a, b in zip(found["check"], found["no_check"], strict=True))
    lines.append(f"\ncheck ÷ no_check, CPU, paired median: {check:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from safetensors.torch import save_file

    from benchmarks.harness import make_source
    from benchmarks.models import BenchConfig
    from fsdp_builder.tools.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--params", type=int, default=200_000_000)
    p.add_argument("--repeats", type=int, default=14)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "model.safetensors")
        save_file(make_source(BenchConfig.for_params(args.params), seed=0), path)
        results = run_ranks(
            rank, 2, path, args.params, args.repeats, timeout=1800.0, start_method="forkserver"
        )
    print(render(results[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
