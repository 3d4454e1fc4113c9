"""A before/after table of the many-small-units runs in one folder (``ab.md`` there).

The folder holds the JSON records of alternating runs, ``before1.json``, ``after1.json``, ...
(``python -m benchmarks.harness --units-only --json ...``). Each build's CPU time is divided by
the plain build's of the same repeat (the machine's speed swings between runs, less within one
repeat); medians over every build of a side. Usage: ``python -m benchmarks.units_ab FOLDER``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def side_rows(folder: Path, side: str, backend: str) -> str | None:
    """The table row of one side and backend; None when the folder has fewer than two builds
    of it (a re-measurement has only an "after" side)."""
    builder_cpu: list[float] = []
    plain_cpu: list[float] = []
    builder_wall: list[float] = []
    plain_wall: list[float] = []
    paired: list[float] = []
    for path in sorted(folder.glob(f"{side}[0-9]*.json")):
        by_repeat: dict[int, dict[str, Any]] = {}
        for record in json.loads(path.read_text())["units"]["records"]:
            if record["backend"] == backend and not record.get("error"):
                by_repeat.setdefault(record["repeat"], {})[record["family"]] = record
        for families in by_repeat.values():
            if "builder" in families and "baseline" in families:
                built, plain = families["builder"], families["baseline"]
                builder_cpu.append(built["cpu_seconds"])
                plain_cpu.append(plain["cpu_seconds"])
                builder_wall.append(built["seconds"])
                plain_wall.append(plain["seconds"])
                paired.append(built["cpu_seconds"] / plain["cpu_seconds"])
    if len(paired) < 2:
        return None
    median = statistics.median
    low, _, high = statistics.quantiles(paired, n=4)
    return (
        f"| {backend} | {side} | {len(paired)} | {median(builder_wall):.2f} | "
        f"{median(plain_wall):.2f} | {median(builder_cpu):.2f} | {median(plain_cpu):.2f} | "
        f"{median(builder_cpu) / median(plain_cpu):.2f} | {median(paired):.2f} | "
        f"{low:.2f}\u2013{high:.2f} |"
    )


def main() -> None:
    folder = Path(sys.argv[1])
    print(
        "| backend | code | builds | builder wall s | plain wall s | builder CPU s | plain CPU s "
        "| CPU ratio of medians | median paired CPU ratio | paired ratio, middle half |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for backend in ("fsdp1", "fsdp2"):
        for side in ("after", "before"):
            row = side_rows(folder, side, backend)
            if row is not None:
                print(row)


if __name__ == "__main__":
    main()
