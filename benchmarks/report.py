"""Turn benchmark records into medians, target checks, a markdown table and a plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
REFERENCE = "fsdp1_full"
# Builder recipe -> the plain-PyTorch baseline doing the same job (overhead target).
SAME_JOB = {
    "builder_fsdp1_reset": "fsdp1_meta",
    "builder_fsdp2_reset": "fsdp2_meta",
    "builder_fsdp2_shard_first": "fsdp2_meta",
    "builder_fsdp2_stream": "fsdp2_meta",
}
SYNC_NOTE = (
    "Sync throughput compares the time of the synchronize stage of `builder_fsdp1_bcast` "
    "(BroadcastFromRank0, summed over units, slowest rank; materializing and sharding are not "
    "counted) with the broadcasts of `broadcast_floor` (one `dist.broadcast` per tensor of the "
    "same bytes from rank 0 into receive buffers already written once, slowest rank): "
    "floor time ÷ stage time."
)
# Jobs where every rank reads the checkpoint itself: no weight may cross ranks.
RANK_LOCAL_JOBS = ("load_file", "load_dcp")
COMM_NOTE = (
    "For rank-local loads (builder recipes reading a .safetensors file or a DCP folder, and "
    "`fsdp2_dcp_load`) comm is counted, not assumed: every tensor handed to a "
    "`torch.distributed` collective during the build, per call its largest tensor argument "
    "(barriers not counted); the target counts those of floating-point tensors, where weights "
    "travel, on the rank that moved most."
)
SPEED_SIZE = 200e6  # the speed targets are stated at ~200M parameters, world size 2


Key = tuple[str, str, int]  # recipe, size label, world size


def medians(result: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    """Per recipe, size and world size: medians over the successful repeats."""
    groups: dict[Key, list[dict[str, Any]]] = {}
    for r in result["records"]:
        groups.setdefault((r["recipe"], r["size"], r["world_size"]), []).append(r)
    out: dict[Key, dict[str, Any]] = {}
    for key, recs in groups.items():
        ok = [r for r in recs if not r["error"]]
        first = recs[0]
        row: dict[str, Any] = {
            "recipe": first["recipe"],
            "family": first["family"],
            "job": first["job"],
            "description": first["description"],
            "per_unit": first["per_unit"],
            "bucket_bytes": first.get("bucket_bytes", 0),
            "size": first["size"],
            "params": first["params"],
            "model_bytes": first["model_bytes"],
            "largest_unit_bytes": first["largest_unit_bytes"],
            "world_size": first["world_size"],
            "runs": len(ok),
            "failed": len(recs) - len(ok),
            "seconds": _median(r["seconds"] for r in ok),
            "peak_bytes": _median(r["peak_bytes"] for r in ok),
            "peak_bytes_nonzero_ranks": _median(r.get("peak_bytes_nonzero_ranks") for r in ok),
            "peak_anon_bytes": _median(r.get("peak_anon_bytes") for r in ok),
            "peak_file_bytes": _median(r.get("peak_file_bytes") for r in ok),
            "comm_bytes": _median(r.get("comm_bytes") for r in ok),
            "weight_comm_bytes": _median(r.get("weight_comm_bytes") for r in ok),
            "sync_seconds": _median(_phase(r, "synchronize") for r in ok),
            "checksum": next((r["checksum"] for r in ok if r.get("checksum")), None),
        }
        out[key] = row
    return out


def _median(values: Iterable[float | int | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return statistics.median(present) if present else None


def _phase(record: dict[str, Any], name: str) -> float | None:
    times = [r["phases"][name] for r in record.get("ranks", []) if name in r.get("phases", {})]
    return max(times) if times else None


def unit_bound(row: dict[str, Any]) -> float:
    """What a per-unit build should hold at its peak: its shards plus one full unit."""
    return float(row["model_bytes"] / row["world_size"] + row["largest_unit_bytes"])


def fsdp1_unit_bound(row: dict[str, Any]) -> float:
    """FSDP1's per-unit floor: its shards plus two units (the unit and its flat copy)."""
    return unit_bound(row) + float(row["largest_unit_bytes"])


def _is_fsdp1(row: dict[str, Any]) -> bool:
    return "fsdp1" in str(row["recipe"])


def _closest_size(rows: dict[Key, dict[str, Any]], world: int) -> str | None:
    sizes = {(row["size"], row["params"]) for row in rows.values() if row["world_size"] == world}
    if not sizes:
        return None
    label, params = min(sizes, key=lambda s: abs(math.log(s[1] / SPEED_SIZE)))
    return label if 0.5 <= params / SPEED_SIZE <= 2 else None


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it is met."""
    rows = medians(result)
    out: list[dict[str, Any]] = []

    def add(target: str, where: str, value: float | None, op: str, limit: float) -> None:
        checks = (
            {"≤": value <= limit, "≥": value >= limit, "=": value == limit}
            if value is not None
            else {}
        )
        met = checks.get(op)
        out.append(
            {
                "target": target,
                "where": where,
                "measured": value,
                "op": op,
                "threshold": limit,
                "met": met,
            }
        )

    def get(recipe: str, size: str, world: int) -> dict[str, Any] | None:
        row = rows.get((recipe, size, world))
        return row if row and row["seconds"] is not None else None

    sizes = sorted({(r["params"], r["size"], r["world_size"]) for r in rows.values()})
    for _, size, world in sizes:
        where = f"{size}, W={world}"
        for builder, baseline in SAME_JOB.items():
            b, p = get(builder, size, world), get(baseline, size, world)
            if b and p:
                add(
                    f"overhead: {builder} ÷ {baseline} time",
                    where,
                    b["seconds"] / p["seconds"],
                    "≤",
                    1.05,
                )
        for row in rows.values():
            if (row["size"], row["world_size"]) != (size, world) or row["peak_bytes"] is None:
                continue
            if row["family"] == "builder" and row["per_unit"] and row["job"] == "init":
                add(
                    f"memory: {row['recipe']} peak ÷ (model/W + largest unit)",
                    where,
                    row["peak_bytes"] / unit_bound(row),
                    "≤",
                    1.15,
                )
        full = get(REFERENCE, size, world)
        if full and full["peak_bytes"] is not None:
            expected = full["model_bytes"] * (1 + 1 / world)
            out.append(
                {
                    "target": f"memory: {REFERENCE} peak ÷ (model + model/W), expected ≈ 1",
                    "where": where,
                    "measured": full["peak_bytes"] / expected,
                    "op": "≈",
                    "threshold": 1.0,
                    "met": None,
                }
            )
        for row in rows.values():
            if (row["size"], row["world_size"]) != (size, world) or row["seconds"] is None:
                continue
            if row["family"] != "builder" or row["job"] not in RANK_LOCAL_JOBS:
                continue
            add(
                f"rank-local load: {row['recipe']} weight bytes sent between ranks (counted)",
                where,
                row["weight_comm_bytes"],
                "=",
                0,
            )
            # No communication bucket is used when every rank reads its own shards. FSDP1's
            # own per-unit floor is two units: it concatenates a unit into a flat parameter
            # before cutting its shard, as in its own param_init_fn path.
            if _is_fsdp1(row):
                bound, label = fsdp1_unit_bound(row), "two largest units"
            else:
                bound, label = unit_bound(row), "largest unit"
            for key, what in (("peak_bytes", "peak"), ("peak_anon_bytes", "anonymous peak")):
                if row.get(key) is not None:
                    add(
                        f"rank-local load: {row['recipe']} {what} ÷ (model/W + {label})",
                        where,
                        row[key] / bound,
                        "≤",
                        1.0,
                    )
        load = get("builder_fsdp2_load", size, world)
        if load and load["peak_bytes_nonzero_ranks"] is not None:
            bucket = float(load.get("bucket_bytes") or 0)
            add(
                "streamed load: non-zero ranks' peak ÷ (shards + unit + bucket)",
                where,
                load["peak_bytes_nonzero_ranks"] / (unit_bound(load) + bucket),
                "≤",
                1.0,
            )
        # The builder's synchronize stage alone (SYNC_NOTE), not its whole build: materializing
        # and sharding are not part of the job the floor does.
        sync, floor = get("builder_fsdp1_bcast", size, world), get("broadcast_floor", size, world)
        if sync and floor and sync["sync_seconds"] and floor["sync_seconds"]:
            add(
                "sync throughput: builder broadcast ÷ raw dist.broadcast",
                where,
                floor["sync_seconds"] / sync["sync_seconds"],
                "≥",
                0.9,
            )

    for world in sorted({r["world_size"] for r in rows.values()}):
        size = _closest_size(rows, world)
        if size is None:
            continue
        where = f"{size}, W={world}"
        load, bcast = get("builder_fsdp2_load", size, world), get("fsdp2_load_bcast", size, world)
        scatter = get("scatter_floor", size, world)
        if load and bcast:
            add(
                "load from rank 0: set_model_state_dict(broadcast) ÷ builder time",
                where,
                bcast["seconds"] / load["seconds"],
                "≥",
                2.5,
            )
        if load and scatter:
            add(
                "load from rank 0: builder ÷ plain dist.scatter time",
                where,
                load["seconds"] / scatter["seconds"],
                "≤",
                1.3,
            )
        local, file_bcast = (
            get("builder_fsdp2_checkpoint", size, world),
            get("fsdp2_file_bcast", size, world),
        )
        read = get("read_floor", size, world)
        if local and file_bcast and local["seconds"]:
            add(
                "rank-local checkpoint load: load_file + set_model_state_dict(broadcast) ÷ builder",
                where,
                file_bcast["seconds"] / local["seconds"],
                "≥",
                2.5,
            )
        if local and read and read["seconds"]:
            add(
                "rank-local checkpoint load: builder ÷ each rank reading its slices (floor)",
                where,
                local["seconds"] / read["seconds"],
                "≤",
                1.2,
            )
        by_hand = get("fsdp2_file_slices", size, world)
        if local and by_hand and by_hand["seconds"]:
            add(
                "overhead: builder_fsdp2_checkpoint ÷ fsdp2_file_slices (the same rank-local "
                "load by hand) time",
                where,
                local["seconds"] / by_hand["seconds"],
                "≤",
                1.05,
            )
        dcp_builder, dcp_plain = (
            get("builder_fsdp2_dcp", size, world),
            get("fsdp2_dcp_load", size, world),
        )
        if dcp_builder and dcp_plain and dcp_plain["seconds"]:
            add(
                "DCP load: builder_fsdp2_dcp ÷ fsdp2_dcp_load (plain dcp.load) time",
                where,
                dcp_builder["seconds"] / dcp_plain["seconds"],
                "≤",
                1.1,
            )
        full = get(REFERENCE, size, world)
        built = [
            r
            for r in rows.values()
            if (r["size"], r["world_size"]) == (size, world)
            and r["family"] == "builder"
            and r["job"] == "init"
            and r["seconds"] is not None
        ]
        if full and built:
            best = min(built, key=lambda r: r["seconds"])
            add(
                f"speed: {REFERENCE} ÷ best builder init ({best['recipe']}) time",
                where,
                full["seconds"] / best["seconds"],
                "≥",
                2.0,
            )
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _fmt_comm(value: float | None) -> str:
    """MiB, or bytes where fewer than half a MiB moved (so a few bytes do not read as 0)."""
    if value is None:
        return "-"
    return f"{value / MIB:.0f}" if value == 0 or value >= MIB / 2 else f"{value:.0f} B"


def targets_table(result: dict[str, Any]) -> str:
    lines = ["| target | where | measured | target | met |", "|---|---|---:|:---:|:---:|"]
    for t in targets(result):
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(
            f"| {t['target']} | {t['where']} | {_fmt(t['measured'])} | "
            f"{t['op']} {t['threshold']:g} | {met} |"
        )
    return "\n".join(lines)


def compact_targets_table(result: dict[str, Any]) -> str:
    """One row per target, one column per place it was measured (size, world size)."""
    found = targets(result)
    wheres = list(dict.fromkeys(t["where"] for t in found))
    rows: dict[str, dict[str, Any]] = {}
    for t in found:
        rows.setdefault(t["target"], {"op": t["op"], "threshold": t["threshold"]})[t["where"]] = t
    lines = [
        "| target | " + " | ".join(wheres) + " | target |",
        "|---|" + "---:|" * len(wheres) + ":---:|",
    ]
    for name, row in rows.items():
        cells = []
        for where in wheres:
            hit = row.get(where)
            if hit is None:
                cells.append("")
                continue
            mark = {True: " ✓", False: " ✗", None: ""}[hit["met"]]
            cells.append(f"{_fmt(hit['measured'])}{mark}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['op']} {row['threshold']:g} |")
    return "\n".join(lines)


def medians_table(result: dict[str, Any]) -> str:
    rows = medians(result)
    lines = [
        "| W | size | recipe | time (s) | time ÷ fsdp1_full | peak MiB | "
        "peak ÷ (model/W + unit) | anon peak MiB | anon ÷ (model/W + unit) | file peak MiB | "
        "comm MiB | checksum |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = sorted(
        rows.values(),
        key=lambda r: (r["world_size"], r["params"], r["family"] != "baseline", r["recipe"]),
    )
    for r in order:
        ref = rows.get((REFERENCE, r["size"], r["world_size"]))
        rel = (
            r["seconds"] / ref["seconds"]
            if ref and ref["seconds"] and r["seconds"] is not None
            else None
        )
        peak, anon, file = r["peak_bytes"], r["peak_anon_bytes"], r["peak_file_bytes"]
        name = r["recipe"] if r["family"] == "baseline" else f"**{r['recipe']}**"
        if r["failed"]:
            name += f" ({r['failed']} failed)"
        lines.append(
            f"| {r['world_size']} | {r['size']} ({r['params'] / 1e6:.0f}M) | {name} | "
            f"{_fmt(r['seconds'])} | {_fmt(rel)} | {_fmt(None if peak is None else peak / MIB, 0)}"
            f" | {_fmt(None if peak is None else peak / unit_bound(r))} | "
            f"{_fmt(None if anon is None else anon / MIB, 0)} | "
            f"{_fmt(None if anon is None else anon / unit_bound(r))} | "
            f"{_fmt(None if file is None else file / MIB, 0)} | "
            f"{_fmt_comm(r['comm_bytes'])} | "
            f"{r['checksum'] or ''} |"
        )
    return "\n".join(lines)


def recipes_list(result: dict[str, Any]) -> str:
    return "\n".join(
        f"- `{name}` ({info['family']}, job: {info['job']}): {info['description']}"
        for name, info in result["recipes"].items()
    )


def warnings_list(result: dict[str, Any], shown: int = 12) -> list[str]:
    """One line per distinct warning, most frequent first: how many measurements raised it and
    the first one that did."""
    found = result.get("warnings", {})
    lines = [
        f"- {text} ({info['count']} measurement(s), first: {info['first']})"
        for text, info in list(found.items())[:shown]
    ]
    if len(found) > shown:
        lines.append(f"- ... and {len(found) - shown} more (all in the JSON records)")
    return lines


UNITS_TARGET = 1.10


def units_section(result: dict[str, Any]) -> str:
    from benchmarks.scaling import ratios_table

    return ratios_table(result["units"]["records"])


def console_summary(result: dict[str, Any]) -> str:
    """What the command prints after the progress bar: the targets, then the warnings the
    ranks and the harness raised during the run."""
    s = result["settings"]
    parts = [
        "",
        f"Targets ({s['wall_seconds']:.0f} s in all; ✓ met, ✗ not met):",
        "",
        compact_targets_table(result),
    ]
    if not result["records"]:
        parts = [""]  # only the many-small-units case ran
    if result.get("units", {}).get("records"):
        title = "Many small units, builder ÷ plain torch (medians):"
        parts += ["", title, "", units_section(result)]
    found = warnings_list(result)
    if found:
        parts += ["", "Warnings during the run (held back from the progress bar):", *found]
    return "\n".join(parts) + "\n"


def _scope(result: dict[str, Any]) -> str:
    """What the run measured: model sizes and world sizes, or (only the many-small-units case
    ran) unit counts and world sizes."""
    s = result["settings"]
    if result["records"]:
        return f"sizes {', '.join(s['sizes'])}; world sizes {', '.join(map(str, s['world_sizes']))}"
    units = result.get("units", {}).get("records", [])
    counts = sorted({r["units"] for r in units})
    worlds = sorted({r["world_size"] for r in units})
    return (
        f"many small units only: {', '.join(map(str, counts))} units; world sizes "
        f"{', '.join(map(str, worlds))}"
    )


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    s = result["settings"]
    parts = [
        "# Benchmark results",
        "",
        f"{m['cpu']}, {m['cpu_count']} cores, {m['memory_bytes'] / 2**30:.0f} GiB; "
        f"torch {m['torch']}, {m['backend']}; {_scope(result)}; median of {s['repeats']} "
        f"interleaved repeat(s); {s['wall_seconds']:.0f} s in all; {result['created']}; load "
        f"average {m.get('loadavg_start', '?')} before, {m.get('loadavg_end', '?')} after; "
        f"malloc: {s.get('malloc', 'glibc default')}.",
    ]
    if result["records"]:
        parts += _model_sections(result)
    if result.get("units", {}).get("records"):
        parts += _units_sections(result)
    if result["notes"]:
        parts += ["", "## Notes", "", *(f"- {n}" for n in result["notes"])]
    if result.get("warnings"):
        parts += ["", "## Warnings", "", *warnings_list(result)]
    return "\n".join(parts) + "\n"


def _model_sections(result: dict[str, Any]) -> list[str]:
    return [
        "",
        "## Targets",
        "",
        f"✓ met, ✗ not met. {SYNC_NOTE} {COMM_NOTE}",
        "",
        compact_targets_table(result),
        "",
        targets_table(result),
        "",
        "## Medians",
        "",
        "Time: build start to sharded model ready (after a barrier), slowest rank. Peak: memory "
        "above the rank's pre-build baseline, largest rank. Comm: bytes rank 0 sent or "
        "received where known. Equal checksums mean bit-identical gathered weights. Builder "
        "recipes in bold.",
        "",
        medians_table(result),
        "",
        "## Recipes",
        "",
        recipes_list(result),
    ]


def _units_sections(result: dict[str, Any]) -> list[str]:
    return [
        "",
        "## Many small units",
        "",
        f"A stack of {result['units']['block']} (d={result['units']['dim']}), default "
        "builder path (no `.materialize`, report on) against plain torch: `fully_shard` per "
        "block on meta + `to_empty` + `reset_parameters` (FSDP2), `FullyShardedDataParallel` "
        "with auto-wrap and `param_init_fn` (FSDP1). Wall: slowest rank's build time; CPU: "
        "slowest rank's process CPU time, which other load on the machine distorts less. "
        f"Target: builder ÷ plain ≤ {UNITS_TARGET:g}.",
        "",
        units_section(result),
    ]


def render_plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = medians(result)
    worlds = sorted({r["world_size"] for r in rows.values()})
    recipes = list(result["recipes"])
    palette = [*(f"C{i}" for i in range(10)), "black", "gold", "navy", "lime"]
    colors = {name: palette[i % len(palette)] for i, name in enumerate(recipes)}
    fig, axes = plt.subplots(len(worlds), 2, figsize=(15, 4.8 * len(worlds)), squeeze=False)
    for (ax_t, ax_m), world in zip(axes, worlds, strict=True):
        for name in recipes:
            pts = sorted(
                (r["params"] / 1e6, r["seconds"], r["peak_bytes"])
                for r in rows.values()
                if r["recipe"] == name and r["world_size"] == world and r["seconds"] is not None
            )
            if not pts:
                continue
            family = result["recipes"][name]["family"]
            style = {
                "linestyle": "--" if family == "baseline" else "-",
                "marker": "s" if family == "baseline" else "o",
                "color": colors[name],
                "label": name,
            }
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], **style)
            ax_m.plot([p[0] for p in pts], [p[2] / MIB for p in pts], **style)
        bound = sorted(
            {
                (r["params"] / 1e6, unit_bound(r) / MIB)
                for r in rows.values()
                if r["world_size"] == world
            }
        )
        ax_m.plot(
            [b[0] for b in bound],
            [b[1] for b in bound],
            ":",
            color="black",
            label="model/W + largest unit",
        )
        ax_t.set_title(f"time to sharded model, world size {world}")
        ax_t.set_ylabel("seconds (median)")
        ax_m.set_title(f"peak memory above baseline per rank, world size {world}")
        ax_m.set_ylabel("MiB (median of max over ranks)")
        for ax in (ax_t, ax_m):
            ax.set_xlabel("model parameters (millions)")
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
    handles, labels = axes[0][1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=9, frameon=False)
    fig.suptitle(
        f"fsdp_builder vs plain PyTorch (dashed): {result['machine']['cpu_count']} CPU cores, "
        f"{result['machine']['backend']}, torch {result['torch_version']}"
    )
    fig.tight_layout(rect=(0, 0, 0.82, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
