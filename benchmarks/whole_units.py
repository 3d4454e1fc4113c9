"""Where ``StreamInit``'s ``whole_below`` should sit: FSDP2 builds of a stack of small blocks
(Linear + LayerNorm of one width) on fresh ranks, with every unit filled whole and then sharded,
with every unit filled shard by shard (``whole_below=0``), and the plain way (``fully_shard`` on
meta, ``to_empty``, ``reset_parameters``). CPU seconds per unit, the median of a few builds per
launch, of the build alone and of the build and one full collection after it (the builder pauses
Python's cyclic collector during a build: the collection it defers is counted in the second);
the widths span both sides of the crossover.

Usage: ``python -m benchmarks.whole_units [--dims 32,128,256,512,1024] [--units 40]``
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch.distributed as dist

from benchmarks.common import Job
from benchmarks.units import SmallBlock, UnitsConfig, make_stack, plain_fsdp2

VARIANTS = ("plain", "whole", "shards")


def _build(variant: str, cfg: UnitsConfig, job: Job) -> Any:
    if variant == "plain":
        return plain_fsdp2(cfg, job).module
    import fsdp_builder as fb

    below = 2**62 if variant == "whole" else 0
    builder = fb.FullyShardBuilder().device(fb.CPUDevice()).wrap(SmallBlock)
    return builder.materialize(fb.StreamInit(seed=0, whole_below=below)).build(make_stack(cfg))


def measure(variant: str, units: int, dim: int, builds: int) -> tuple[float, float]:
    """One rank: median CPU seconds per unit over ``builds`` builds, after a warm-up build, of
    the build and of the build and a full collection."""
    from benchmarks.scaling import quiet_cpu_job

    job = quiet_cpu_job()
    _build(variant, UnitsConfig(units=2, dim=dim), job)
    times, collected = [], []
    for _ in range(builds):
        gc.collect()
        dist.barrier()
        start = time.process_time()
        model = _build(variant, UnitsConfig(units=units, dim=dim), job)
        times.append((time.process_time() - start) / units)
        gc.collect()
        collected.append((time.process_time() - start) / units)
        del model
    return statistics.median(times), statistics.median(collected)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="32,128,256,512,1024")
    p.add_argument("--units", type=int, default=40)
    p.add_argument("--builds", type=int, default=5, help="builds per launch (median taken)")
    p.add_argument("--repeats", type=int, default=2, help="launches per variant and width")
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    from fsdp_builder.tools.launch import run_ranks

    print("µs per unit, build alone / build and a full collection:\n")
    print("| width | unit (KiB) | plain | whole | shards | whole ÷ shards |")
    print("|---:|---:|---:|---:|---:|---:|")
    for dim in (int(d) for d in args.dims.split(",")):
        got: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            order = VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3]
            for variant in order:
                ranks = run_ranks(
                    measure, args.world_size, variant, args.units, dim, args.builds, timeout=600
                )
                got[variant].append((max(r[0] for r in ranks), max(r[1] for r in ranks)))
        med = {
            v: [statistics.median(x[i] for x in t) * 1e6 for i in (0, 1)] for v, t in got.items()
        }
        cells = [" / ".join(f"{x:,.0f}" for x in med[v]) for v in VARIANTS]
        ratio = " / ".join(f"{w / s:.2f}" for w, s in zip(med["whole"], med["shards"], strict=True))
        kib = (dim * dim + 3 * dim) * 4 / 1024  # one block: Linear and LayerNorm
        print(f"| {dim} | {kib:,.0f} | {' | '.join(cells)} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
