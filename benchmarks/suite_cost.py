"""What the test suite costs, file by file: CPU seconds (the pytest process and every process it
started: spawned ranks, their fork server) and wall seconds, each file in its own fresh pytest
process, one at a time.

CPU seconds are the figure to compare between machines and commits: wall time on a shared
2-core machine depends on whatever else runs. The default test command runs two files at once
(``-n 2``), so its wall time is about half the sum below when nothing else runs.

    python -m benchmarks.suite_cost --out benchmarks/results/suite_cost.md

``--whole``: the default test command (``pytest -q``, two workers) once per way, alternated: as it
is, and with ``FSDP_BUILDER_RANK_SLOTS`` empty (its launches not sharing the cores). While it
runs, the processes it started are sampled every 0.1 s: how many are running or waiting for a
core (state R), against the machine's cores.

    python -m benchmarks.suite_cost --whole --repeats 2 --out-whole FILE.md

``--whole --against REV``: the default test command as it is, in this checkout and in a
worktree of git revision REV (its tests and its library: that tree first on ``PYTHONPATH``),
alternated; the before/after of a change to how the suite runs.

    python -m benchmarks.suite_cost --whole --against REV --repeats 1 --out-whole FILE.md
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
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


def _descendants(root: int) -> list[tuple[str, int]]:
    """The state (R, S, D, ...) of each of ``root``'s descendant processes, with the child of
    ``root`` it descends from (a test worker), read from /proc."""
    parents: dict[int, int] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: split after its last ")".
        fields = stat[stat.rindex(")") + 2 :].split()
        states[int(entry)], parents[int(entry)] = fields[0], int(fields[1])
    found: list[tuple[str, int]] = []
    frontier = {pid: pid for pid, parent in parents.items() if parent == root}
    while frontier:
        found += [(states[pid], top) for pid, top in frontier.items()]
        frontier = {pid: frontier[parent] for pid, parent in parents.items() if parent in frontier}
    return found


def whole(shared: bool, root: Path = ROOT) -> dict[str, float]:
    """One run of the default test command in ``root``; ``shared``: launches share the cores
    (the default)."""
    env = dict(os.environ, PYTHONPATH=str(root))
    if not shared:
        env["FSDP_BUILDER_RANK_SLOTS"] = ""
    else:
        env.pop("FSDP_BUILDER_RANK_SLOTS", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    running: list[int] = []
    # Samples above the cores with processes of both workers running: what sharing the cores
    # prevents (one test's launch of more ranks than cores is above them on its own).
    shared_over = 0
    cores = os.cpu_count() or 1
    while proc.poll() is None:
        busy = [top for state, top in _descendants(proc.pid) if state == "R"]
        running.append(len(busy))
        shared_over += len(busy) > cores and len(set(busy)) > 1
        time.sleep(0.1)  # a sampling period, not a synchronization
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "exit": float(proc.returncode),
        "wall": wall,
        "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "running_mean": sum(running) / max(len(running), 1),
        "running_max": float(max(running, default=0)),
        "over_cores": sum(n > cores for n in running) / max(len(running), 1),
        "over_cores_shared": shared_over / max(len(running), 1),
    }


def _short(rev: str) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def main_whole(repeats: int, out: Path | None, against: str | None = None) -> None:
    runs: list[tuple[str, dict[str, float]]] = []
    commit = _short("HEAD")
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "tree"
        if against is not None:
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(other), against],
                cwd=ROOT, check=True, capture_output=True,
            )  # fmt: skip
        try:
            for repeat in tqdm(range(repeats), desc="whole suite"):
                ways = (
                    [("shared", True, ROOT), ("not shared", False, ROOT)]
                    if against is None
                    else [(f"`{commit}`", True, ROOT), (f"`{_short(against)}`", True, other)]
                )
                for name, shared, root in ways if repeat % 2 == 0 else ways[::-1]:
                    runs.append((name, whole(shared, root)))
        finally:
            if against is not None:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False
                )
    given = f" --against {against}" if against else ""
    lines = [
        f"`python -m benchmarks.suite_cost --whole{given} --repeats {repeats}` at `{commit}`, "
        f"{os.cpu_count()} cores. Running: processes the command started that were running or "
        "waiting for a core, sampled every 0.1 s.",
        "",
        "| run | exit | wall s | CPU s | running, mean | running, max | samples above the cores "
        "| samples above the cores with both workers' processes running |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {r['exit']:.0f} | {r['wall']:.0f} | {r['cpu']:.0f} | "
            f"{r['running_mean']:.2f} | {r['running_max']:.0f} | {100 * r['over_cores']:.0f} % | "
            f"{100 * r['over_cores_shared']:.0f} % |"
            for name, r in runs
        ),
    ]
    text = "\n".join(lines) + "\n"
    if out is not None:
        out.write_text(text)
    sys.stdout.write(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("files", nargs="*", type=Path, help="test files (default: all)")
    parser.add_argument("--whole", action="store_true", help="the whole command, both ways")
    parser.add_argument("--repeats", type=int, default=2, help="--whole runs per way")
    parser.add_argument("--out-whole", type=Path, default=None, help="--whole's table")
    parser.add_argument("--against", default=None, help="--whole: this tree against REV's")
    args = parser.parse_args(argv)
    if args.whole:
        main_whole(args.repeats, args.out_whole, args.against)
        return
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
