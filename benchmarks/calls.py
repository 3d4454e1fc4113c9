"""Many small units, counted instead of timed: function calls per build stage.

A build of 400 small units costs a few hundred milliseconds of Python around torch's own work,
and on a shared machine its time swings by more than that between runs. The number of Python
and C function calls a build makes hardly moves, so it tells whether a change removed work
even where the timings cannot. Each recipe of ``benchmarks.scaling`` runs on fresh ranks (a
small warm-up build, then one counted build); rank 0's calls are split by the stage they ran
in: FSDP2's ``fully_shard`` (torch's, on both paths), the builder's configure, prepare and
final check, the model's construction, and everything else (the per-unit steps; plain torch's
``to_empty`` and ``reset_parameters``; with FSDP1, ``FullyShardedDataParallel`` itself, inside
which plain FSDP1 also initializes, so only its totals compare).

Usage: ``python -m benchmarks.calls [--units 400] [--recipes plain_fsdp2,builder_fsdp2,...]``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch.distributed as dist

from benchmarks.harness import launch
from benchmarks.scaling import RECIPES, warmed_rank
from benchmarks.units import UnitsConfig

STAGES = ("fully_shard", "make_stack", "configure", "prepare", "groups", "finish", "other")


def _label(owner: Any, attr: str, stage: str, stack: list[str]) -> None:
    """Calls made inside ``owner.attr`` count for ``stage``."""
    original: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        stack.append(stage)
        try:
            return original(*args, **kwargs)
        finally:
            stack.pop()

    setattr(owner, attr, counted)


def count_calls(name: str, units: int, dim: int) -> dict[str, int]:
    """One rank of one count (runs inside a fresh rank): calls per stage of one build."""
    import benchmarks.units as plain
    import fsdp_builder.backends.fsdp2 as fsdp2
    import fsdp_builder.pipeline as pipeline
    import fsdp_builder.runtime.agreement as agreement

    stack = ["other"]
    _label(pipeline._Build, "configure", "configure", stack)
    _label(pipeline._Build, "prepare", "prepare", stack)
    _label(pipeline._Build, "create_groups", "groups", stack)
    _label(agreement.Agreement, "finish", "finish", stack)
    _label(plain, "make_stack", "make_stack", stack)
    for module in (plain, fsdp2):
        _label(module, "fully_shard", "fully_shard", stack)
    run, job = warmed_rank(name, dim)
    counts: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event in ("call", "c_call"):
            counts[stack[-1]] += 1

    sys.setprofile(profile)
    try:
        run(UnitsConfig(units=units, dim=dim), job)
    finally:
        sys.setprofile(None)
    dist.barrier()
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=400)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    print(f"{args.units} units, d={args.dim}, {args.world_size} gloo ranks; rank 0's calls")
    print("| recipe | total | " + " | ".join(STAGES) + " |")
    print("|---|---:|" + "---:|" * len(STAGES))
    for name in args.recipes.split(","):
        ranks = launch(
            count_calls,
            args.world_size,
            name,
            args.units,
            args.dim,
            timeout=args.timeout,
            backend="gloo",
        )
        counts = ranks[0]
        cells = " | ".join(f"{counts.get(stage, 0):,}" for stage in STAGES)
        print(f"| {name} | {sum(counts.values()):,} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
