"""What the test suite costs, file by file: CPU seconds (the pytest process and every process it
started: spawned ranks, their fork server) and wall seconds, each file in its own fresh pytest
process, one at a time.

CPU seconds are the figure to compare between machines and commits: wall time on a shared
2-core machine depends on whatever else runs. The default test command runs two files at once
(``-n 2``), so its wall time is about half the sum below when nothing else runs.

    python -m benchmarks.suite_cost --out benchmarks/results/suite_cost.md
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent


def cost(test_file: Path) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, pytest's exit code) of one file in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(test_file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done.returncode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("files", nargs="*", type=Path, help="test files (default: all)")
    args = parser.parse_args(argv)
    files = args.files or sorted((ROOT / "tests").glob("test_*.py"))
    rows = []
    for path in tqdm(files, desc="test files"):
        rows.append((path.name, *cost(path)))
    rows.sort(key=lambda r: -r[1])
    cpu_total = sum(r[1] for r in rows)
    wall_total = sum(r[2] for r in rows)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "# Test suite cost by file",
        "",
        f"`python -m benchmarks.suite_cost` at `{commit}`, {os.cpu_count()} cores; each file in "
        "its own pytest process (`-n 0`), one at a time. CPU: user + system seconds of pytest "
        "and every process it started. Sorted by CPU.",
        "",
        f"Total: {cpu_total:.0f} CPU s, {wall_total:.0f} wall s over {len(rows)} files.",
        "",
        "| file | CPU s | share | wall s | exit |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {cpu:.1f} | {100 * cpu / cpu_total:.1f} % | {wall:.1f} | {code} |"
            for name, cpu, wall, code in rows
        ),
    ]
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
