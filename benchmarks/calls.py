"""Many small units, counted (and, with ``--cpu``, timed on the CPU): function calls per build
stage.

A build of 400 small units costs a few hundred milliseconds of Python around torch's own work,
and on a shared machine its time swings by more than that between runs. The number of Python
and C function calls a build makes hardly moves, so it tells whether a change removed work
even where the timings cannot. Each recipe of ``benchmarks.scaling`` runs on fresh ranks (a
small warm-up build, then one counted build); rank 0's calls are split by the stage they ran
in: FSDP2's ``fully_shard`` (torch's, on both paths), the builder's configure, prepare and
final check, the model's construction, and everything else (the per-unit steps; plain torch's
``to_empty`` and ``reset_parameters``; with FSDP1, ``FullyShardedDataParallel`` itself, inside
which plain FSDP1 also initializes, so only its totals compare).

``--cpu N`` also times each stage: the CPU seconds of rank 0's main thread in it (a collective
waits off the CPU, so a slower peer does not count; what gloo's own threads spend on a
collective is not counted either), medians of N builds in the same ranks after the counted one,
each after a garbage collection, with no profiler attached.

Usage: ``python -m benchmarks.calls [--units 400] [--recipes plain_fsdp2,builder_fsdp2,...]
[--cpu 5]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch.distributed as dist

from benchmarks.harness import launch
from benchmarks.scaling import RECIPES, warmed_rank
from benchmarks.units import UnitsConfig

STAGES = ("fully_shard", "make_stack", "configure", "prepare", "groups", "finish", "other")


class Stages:
    """The stage a rank is in (its innermost labelled call), and the thread CPU seconds spent in
    each stage, its labelled callees excluded."""

    def __init__(self) -> None:
        self.stack = ["other"]
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._since = time.thread_time()

    def restart(self) -> None:
        self.seconds.clear()
        self._since = time.thread_time()

    def settle(self) -> None:
        """Charge the time since the last change to the current stage."""
        now = time.thread_time()
        self.seconds[self.stack[-1]] += now - self._since
        self._since = now

    def enter(self, stage: str) -> None:
        self.settle()
        self.stack.append(stage)

    def leave(self) -> None:
        self.settle()
        self.stack.pop()


def _label(owner: Any, attr: str, stage: str, stages: Stages) -> None:
    """Calls made inside ``owner.attr`` count for ``stage``."""
    original: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        stages.enter(stage)
        try:
            return original(*args, **kwargs)
        finally:
            stages.leave()

    setattr(owner, attr, counted)


def _labelled() -> Stages:
    import benchmarks.units as plain
    import fsdp_builder.backends.fsdp2 as fsdp2
    import fsdp_builder.pipeline as pipeline
    import fsdp_builder.runtime.agreement as agreement

    stages = Stages()
    _label(pipeline._Build, "configure", "configure", stages)
    _label(pipeline._Build, "prepare", "prepare", stages)
    _label(pipeline._Build, "create_groups", "groups", stages)
    _label(agreement.Agreement, "finish", "finish", stages)
    _label(plain, "make_stack", "make_stack", stages)
    for module in (plain, fsdp2):
        _label(module, "fully_shard", "fully_shard", stages)
    return stages


def count_calls(name: str, units: int, dim: int, timed_builds: int = 0) -> dict[str, Any]:
    """One rank of one count (runs inside a fresh rank): calls per stage of one build; with
    ``timed_builds``, under ``"cpu_seconds"`` also each stage's thread CPU seconds in each of
    that many further builds (no profiler attached)."""
    stages = _labelled()
    run, job = warmed_rank(name, dim)
    counts: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event in ("call", "c_call"):
            counts[stages.stack[-1]] += 1

    sys.setprofile(profile)
    try:
        run(UnitsConfig(units=units, dim=dim), job)
    finally:
        sys.setprofile(None)
    dist.barrier()
    result: dict[str, Any] = dict(counts)
    if timed_builds:
        timed = []
        for _ in range(timed_builds):
            # The previous build is garbage now: collected here, not inside the next one.
            gc.collect()
            dist.barrier()
            stages.restart()
            run(UnitsConfig(units=units, dim=dim), job)
            stages.settle()
            timed.append(dict(stages.seconds))
        dist.barrier()
        result["cpu_seconds"] = timed
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=400)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--cpu", type=int, default=0, metavar="N", help="also time each stage over N builds"
    )
    args = parser.parse_args(argv)
    print(f"{args.units} units, d={args.dim}, {args.world_size} gloo ranks; rank 0's calls")
    print("| recipe | total | " + " | ".join(STAGES) + " |")
    print("|---|---:|" + "---:|" * len(STAGES))
    timed: dict[str, list[dict[str, float]]] = {}
    for name in args.recipes.split(","):
        ranks = launch(
            count_calls,
            args.world_size,
            name,
            args.units,
            args.dim,
            args.cpu,
            timeout=args.timeout,
            backend="gloo",
        )
        counts = dict(ranks[0])
        timed[name] = counts.pop("cpu_seconds", [])
        cells = " | ".join(f"{counts.get(stage, 0):,}" for stage in STAGES)
        print(f"| {name} | {sum(counts.values()):,} | {cells} |")
    if args.cpu:
        print(f"\nRank 0's thread CPU seconds per stage, medians of {args.cpu} builds")
        print("| recipe | total | " + " | ".join(STAGES) + " |")
        print("|---|---:|" + "---:|" * len(STAGES))
        for name, builds in timed.items():
            totals = statistics.median(sum(b.values()) for b in builds)
            cells = " | ".join(
                f"{statistics.median(b.get(stage, 0.0) for b in builds):.3f}" for stage in STAGES
            )
            print(f"| {name} | {totals:.3f} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
