"""Many small units: the builder's per-unit cost against plain PyTorch's, and how it scales.

Each measurement builds a stack of ``units`` small blocks (``benchmarks.units``) on fresh ranks
with one of four recipes: plain ``fully_shard`` / ``FullyShardedDataParallel`` and the two
builders' default paths. Recipes are interleaved within each repeat, as in the main harness.
Per rank it records wall seconds and CPU seconds of the build (the process's CPU time, which a
busy shared machine distorts far less than wall time); the slowest rank counts.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import Job, Outcome
from benchmarks.units import UnitsConfig, builder, plain_fsdp1, plain_fsdp2

RECIPES: dict[str, tuple[str, str]] = {
    # name: (backend, family)
    "plain_fsdp2": ("fsdp2", "baseline"),
    "builder_fsdp2": ("fsdp2", "builder"),
    "plain_fsdp1": ("fsdp1", "baseline"),
    "builder_fsdp1": ("fsdp1", "builder"),
}
# Measured on request (``python -m benchmarks.against``), not in the harness's default run:
# name: (backend, family, the materializer class the builder is given).
EXTRA_RECIPES: dict[str, tuple[str, str, str]] = {
    "builder_fsdp2_shard_first": ("fsdp2", "builder", "ShardFirstReset"),
}
DEFAULT_UNITS = (400,)
FULL_UNITS = (8, 64, 400)
FULL_WORLDS = (2, 4, 8)
WARMUP_UNITS = 4


def _runner(name: str) -> Callable[[UnitsConfig, Job], Outcome]:
    if name in EXTRA_RECIPES:
        backend, _, materializer = EXTRA_RECIPES[name]
        return lambda cfg, job: builder(cfg, job, backend, materializer)
    backend, family = RECIPES[name]
    if family == "builder":
        return lambda cfg, job: builder(cfg, job, backend)
    return plain_fsdp2 if backend == "fsdp2" else plain_fsdp1


def quiet_cpu_job() -> Job:
    """Inside a rank: this rank's CPU job for the units recipes, with the library's log events
    below warnings dropped (they would be measured too)."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return Job(
        cfg=None,  # type: ignore[arg-type]  # the units recipes take their own config
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=torch.device("cpu"),
    )


def warmed_rank(name: str, dim: int) -> tuple[Callable[[UnitsConfig, Job], Outcome], Job]:
    """Inside a fresh rank: the recipe ``name`` and this rank's job, after one tiny build, so
    that one-time costs (lazy imports, first-call caches) are not measured, as in the main
    harness; every rank is past it when this returns."""
    run = _runner(name)
    job = quiet_cpu_job()
    run(UnitsConfig(units=WARMUP_UNITS, dim=dim), job)
    gc.collect()
    dist.barrier()
    return run, job


def measure_units(name: str, units: int, dim: int) -> dict[str, Any]:
    """One rank of one measurement (runs inside a fresh rank)."""
    run, job = warmed_rank(name, dim)
    wall, cpu = time.perf_counter(), time.process_time()
    model = run(UnitsConfig(units=units, dim=dim), job)
    dist.barrier()
    seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
    # A full collection after the build: the builder pauses the collector while it builds, so
    # what it defers is counted here, for both ways alike.
    collect = time.process_time()
    gc.collect()
    collect_cpu = time.process_time() - collect
    del model
    return {
        "rank": job.rank,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "collect_cpu_seconds": collect_cpu,
    }


def plan(
    units: Sequence[int], worlds: Sequence[int], repeats: int, recipes: Sequence[str]
) -> list[tuple[int, int, int, str]]:
    """(repeat, units, world, recipe) in measurement order: repeats outermost, recipes
    round-robin, rotated each repeat."""
    order = []
    for repeat in range(repeats):
        for n in units:
            for world in worlds:
                shift = repeat % len(recipes)
                for name in [*recipes[shift:], *recipes[:shift]]:
                    order.append((repeat, n, world, name))
    return order


def run_units(
    order: Sequence[tuple[int, int, int, str]],
    launch: Callable[..., list[Any]],
    done: Callable[[str, float | None, str | None], None],
    dim: int = 32,
) -> list[dict[str, Any]]:
    """Every measurement of ``order``; ``launch(fn, world, *args)`` runs fresh ranks and
    ``done(label, seconds, error)`` reports progress."""
    records: list[dict[str, Any]] = []
    for repeat, n, world, name in order:
        backend, family = RECIPES[name]
        record: dict[str, Any] = {
            "recipe": name,
            "backend": backend,
            "family": family,
            "units": n,
            "dim": dim,
            "world_size": world,
            "repeat": repeat,
        }
        try:
            ranks = launch(measure_units, world, name, n, dim)
            record.update(
                seconds=max(r["seconds"] for r in ranks),
                cpu_seconds=max(r["cpu_seconds"] for r in ranks),
                collect_cpu_seconds=max(r["collect_cpu_seconds"] for r in ranks),
                ranks=ranks,
                error=None,
            )
        except Exception as exc:  # a failed measurement is a result too
            record.update(
                seconds=None,
                cpu_seconds=None,
                collect_cpu_seconds=None,
                ranks=[],
                error=str(exc)[-2000:],
            )
        records.append(record)
        done(f"units {name} n{n} w{world}", record["seconds"], record["error"])
    return records


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def medians(records: Sequence[dict[str, Any]]) -> dict[tuple[str, int, int], dict[str, Any]]:
    """Per (recipe, units, world): median wall and CPU seconds over the repeats."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["recipe"], r["units"], r["world_size"]), []).append(r)
    return {
        key: {
            "seconds": _median([r["seconds"] for r in recs]),
            "cpu_seconds": _median([r["cpu_seconds"] for r in recs]),
            "with_collect": _median(
                [_sum(r["cpu_seconds"], r.get("collect_cpu_seconds")) for r in recs]
            ),
            "runs": sum(1 for r in recs if not r["error"]),
        }
        for key, recs in groups.items()
    }


def ratios(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Builder ÷ plain per backend, units and world: of the median wall and CPU seconds."""
    rows = medians(records)
    out = []
    for (name, n, world), row in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        backend, family = RECIPES[name]
        if family != "builder":
            continue
        plain = rows.get((f"plain_{backend}", n, world))
        if plain is None:
            continue
        out.append(
            {
                "backend": backend,
                "units": n,
                "world_size": world,
                "builder_seconds": row["seconds"],
                "plain_seconds": plain["seconds"],
                "wall_ratio": _div(row["seconds"], plain["seconds"]),
                "builder_cpu_seconds": row["cpu_seconds"],
                "plain_cpu_seconds": plain["cpu_seconds"],
                "cpu_ratio": _div(row["cpu_seconds"], plain["cpu_seconds"]),
                "collect_ratio": _div(row["with_collect"], plain["with_collect"]),
            }
        )
    return out


def _sum(a: float | None, b: float | None) -> float | None:
    return a + b if a is not None and b is not None else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratios_table(records: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| backend | units | W | builder s | plain s | wall ratio | builder CPU s | plain CPU s "
        "| CPU ratio | CPU ratio, with a full collection after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ratios(records):
        lines.append(
            f"| {r['backend']} | {r['units']} | {r['world_size']} | "
            f"{_fmt(r['builder_seconds'])} | {_fmt(r['plain_seconds'])} | "
            f"{_fmt(r['wall_ratio'])} | {_fmt(r['builder_cpu_seconds'])} | "
            f"{_fmt(r['plain_cpu_seconds'])} | {_fmt(r['cpu_ratio'])} | "
            f"{_fmt(r['collect_ratio'])} |"
        )
    return "\n".join(lines)


def render_plots(records: Sequence[dict[str, Any]], path: Path) -> None:
    """Time per unit and total time against unit count (smallest world) and against world size
    (largest unit count), builders and plain torch on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = medians(records)
    units = sorted({n for _, n, _ in rows})
    worlds = sorted({w for _, _, w in rows})
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    axes_by = {
        "units": (axes[0][0], axes[1][0], units, worlds[0]),
        "world": (axes[0][1], axes[1][1], worlds, units[-1]),
    }
    for axis, (per_unit, total, xs, fixed) in axes_by.items():
        for name, (_, family) in RECIPES.items():
            points = []
            for x in xs:
                key = (name, x, fixed) if axis == "units" else (name, fixed, x)
                row = rows.get(key)
                if row and row["seconds"] is not None:
                    points.append((x, row["seconds"], row["seconds"] / key[1]))
            if not points:
                continue
            style = "--" if family == "baseline" else "-"
            xs_seen = [p[0] for p in points]
            per_unit.plot(xs_seen, [p[2] * 1e3 for p in points], style, marker="o", label=name)
            total.plot(xs_seen, [p[1] for p in points], style, marker="o", label=name)
        label = "units" if axis == "units" else "world size (ranks, gloo)"
        where = f"world size {fixed}" if axis == "units" else f"{fixed} units"
        for ax, what in ((per_unit, "ms per unit"), (total, "total s")):
            ax.set_xlabel(label)
            ax.set_ylabel(what)
            ax.set_title(f"{what}, {where}")
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
