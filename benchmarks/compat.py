"""Compatibility matrix: a fixed, fast subset of the test suite on several torch releases.

For each release asked for, a virtual environment ``<venvs>/torch-<release>`` is created (or reused
when it already holds that release), torch is installed into it (``pip install
"torch==<release>.*"``, or a wheel given with ``--wheel``), then this checkout (``pip install
--no-deps -e .``, so a release below the declared floor stays; then the library's other
requirements) with what the subset needs from the test extra (pytest, pytest-timeout, pytest-xdist,
safetensors; with ``--full-extras`` the whole ``.[test]``, minutes more). The subset
(:data:`SUBSET`: every backend, every role and the compositions at least once) then runs there with
pytest, and the results are merged into ``benchmarks/results/compat.json`` (one record per release,
the latest run of each) and written as the table ``benchmarks/results/compat.md``: release by passed
/ failed / errors / skipped, and the first error of each failing group (a test function, all its
parameters together).

Usage, from the repository root (the venvs go outside the repository)::

    python -m benchmarks.compat --venvs ~/.cache/fsdp-builder-compat 2.7 2.8 2.13
    python -m benchmarks.compat --venvs DIR --wheel 2.7=/tmp/torch-2.7.1-...whl 2.7
    python -m benchmarks.compat --venvs DIR --list          # the subset, as pytest arguments

PyPI's Linux wheels of torch are CUDA builds (about 3 GB with their nvidia-* dependencies); they
import and run on a machine without a GPU, and the subset runs on the CPU (gloo) only. Pass
``--index-url https://download.pytorch.org/whl/cpu`` where that index is reachable to get the
much smaller CPU builds. ``--delete-after`` removes each venv once its run is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

logger = structlog.get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
JSON_PATH = RESULTS / "compat.json"
MD_PATH = RESULTS / "compat.md"

# The subset. Multi-rank test files spawn their ranks once per file and world size, so a file
# costs about as much as its spawns: the files below run their 1- and 2-rank tests (4 ranks on
# 2 cores is the slowest spawn, and under load it runs past the tests' own deadlines). Together:
# FSDP1 and FSDP2 with every strategy (hybrid over AutoHybridGroups), every materializer (reset,
# init_fn, deterministic, shard-first, init_weights, state dict, checkpoint files: safetensors
# and DCP), every synchronizer, the group factories and mesh checks, ignored states,
# fully_shard's own options, activation checkpointing, compile, tensor parallelism on one rank,
# and the version gates.
SUBSET_FILES: tuple[str, ...] = (
    "tests/test_fsdp2.py",
    "tests/test_fsdp1_multirank.py",
    "tests/test_checkpoints.py",
    "tests/test_compose.py",
    "tests/test_fsdp2_options.py",
    "tests/test_init_fidelity.py",
    "tests/test_synchronizers.py",
    "tests/test_groups.py",
    "tests/test_ignored.py",
    "tests/test_versions.py",
)
# Deselects the 4-rank tests (ids "[4-...", "...-4]", "[4]", "[w4-...", "four_ranks").
SUBSET_SELECT = "not ([4- or -4] or [4] or [w4- or four_ranks)"
SUBSET: tuple[str, ...] = (*SUBSET_FILES, "-k", SUBSET_SELECT)
# What the subset imports beyond the library's own requirements (from the test extra).
SUBSET_NEEDS: tuple[str, ...] = (
    "pytest>=7.4",
    "pytest-timeout>=2.2",
    "pytest-xdist>=3.5",  # the test configuration's addopts run the files on two workers
    "safetensors>=0.4",
)

# What the matrix covers when no release is named: every minor release from the floor candidates
# to the newest this project tests.
DEFAULT_RELEASES: tuple[str, ...] = ("2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.13")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_torch(python: Path) -> str | None:
    """The torch version importable by ``python`` (None when there is none)."""
    if not python.exists():
        return None
    done = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def same_release(version: str, release: str) -> bool:
    """``"2.8.0+cpu"`` is release ``"2.8"``."""
    return re.match(rf"{re.escape(release)}(\.|$|\+|a|b|rc)", version) is not None


def _run(cmd: Sequence[str], log: Path) -> None:
    logger.info("run", cmd=" ".join(cmd))
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(list(cmd), stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {done.returncode}; see {log}")


def prepare_venv(
    release: str,
    venvs: Path,
    wheel: str | None,
    index_url: str | None,
    log: Path,
    full_extras: bool = False,
) -> tuple[Path, str]:
    """A venv with torch ``release`` and this checkout's test extras; returns its python and
    the exact torch version. Reused when it already holds that release and the library."""
    venv = venvs / f"torch-{release}"
    python = venv_python(venv)
    version = installed_torch(python)
    if version is not None and not same_release(version, release):
        raise RuntimeError(
            f"{venv} holds torch {version}, not {release}: remove it or pass another --venvs"
        )
    if version is None:
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(venv)], log)
        pip = [str(python), "-m", "pip", "install", "-q"]
        spec = wheel or f"torch=={release}.*"
        _run([*pip, *(["--index-url", index_url] if index_url else []), spec], log)
        version = installed_torch(python)
        if version is None or not same_release(version, release):
            raise RuntimeError(f"installing {spec} into {venv} gave torch {version}")
    probe = subprocess.run(
        [str(python), "-c", "import fsdp_builder, pytest, pytest_timeout, safetensors"],
        capture_output=True,
        check=False,
        cwd=tempfile.gettempdir(),
    )
    if probe.returncode != 0:
        # torch is already there and satisfies the library's own requirement, so pip keeps it.
        # The library itself (its console script runs in the subset) and what the subset
        # imports; full_extras: the whole test extra (transformers, mkdocs, ... : minutes more).
        if full_extras:
            _run([str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"], log)
        else:
            # --no-deps: a release below the declared floor must not be upgraded by the
            # library's own requirement (what images that pin torch do); the rest by name.
            _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], log)
            _run([str(python), "-m", "pip", "install", "-q", *library_needs(), *SUBSET_NEEDS], log)
    after = installed_torch(python)
    if after != version:
        raise RuntimeError(f"installing the test extras changed torch {version} to {after}")
    return python, version


def library_needs() -> list[str]:
    """The library's requirements from setup.cfg, torch left out (the release under test)."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    needs = [line.split("#")[0].strip() for line in lines]
    return [n for n in needs if n and not re.match(r"torch\b", n)]


def run_subset(python: Path, tests: Sequence[str], timeout: float, log: Path) -> dict[str, Any]:
    """pytest on ``tests`` with ``python``; the JUnit report parsed into a record."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *tests,
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        with log.open("a") as out:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                code: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # An interrupted pytest still writes the report of the tests it finished.
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                code = None
        seconds = time.monotonic() - start
        record = parse_junit(junit) if junit.exists() else _empty()
    record["seconds"] = round(seconds, 1)
    record["exit_code"] = code
    if code is None:
        record["note"] = f"stopped after {timeout:.0f} s: counts of the tests finished by then"
    return record


def _empty() -> dict[str, Any]:
    return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "groups": {}, "skips": {}}


def _first_line(element: ET.Element) -> str:
    """The exception line of a failure: its message, else the last ``E`` line of the trace."""
    message = (element.get("message") or "").strip()
    if not message:
        lines = [ln[1:].strip() for ln in (element.text or "").splitlines() if ln.startswith("E ")]
        message = lines[0] if lines else (element.text or "").strip()
    message = message.splitlines()[0] if message else "(no message)"
    return message[:300]


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts, and per failing group (file::function) how many failed and the first error."""
    record = _empty()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        group = f"{module}::{name.split('[', 1)[0]}"
        outcome = "passed"
        detail: ET.Element | None = None
        for tag, kind in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                outcome, detail = kind, found
                break
        record[outcome] += 1
        if outcome in ("failed", "errors") and detail is not None:
            entry = record["groups"].setdefault(group, {"count": 0, "first": _first_line(detail)})
            entry["count"] += 1
        elif outcome == "skipped" and detail is not None:
            reason = _first_line(detail)
            record["skips"][reason] = record["skips"].get(reason, 0) + 1
    return record


def load_results(path: Path = JSON_PATH) -> dict[str, Any]:
    if path.exists():
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    return {"subset": list(SUBSET), "releases": {}}


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


def _status(record: dict[str, Any]) -> str:
    if record.get("install_error"):
        return "not installed"
    bad = record["failed"] + record["errors"]
    if bad:
        return "red"
    code = record.get("exit_code")
    if code is None or code == 2:  # past the time limit, or interrupted: not every test ran
        return "incomplete"
    return "green" if code == 0 and record["passed"] > 0 else "red"


def render(results: dict[str, Any]) -> str:
    """The markdown table of every recorded release, oldest first."""
    releases = sorted(results["releases"].items(), key=lambda kv: _release_key(kv[0]))
    lines = [
        "## Compatibility matrix",
        "",
        "Produced by `python -m benchmarks.compat` (see `docs/torch_versions.md`): a venv per "
        "torch release, this checkout, and the fixed subset of the suite below, on the CPU "
        "(gloo). The latest run of each release; its records are in "
        "`benchmarks/results/compat.json`.",
        "",
        "Subset: `pytest " + " ".join(_quoted(SUBSET)) + "`.",
        "",
        "| torch | result | passed | failed | errors | skipped | time (s) | run on |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for release, rec in releases:
        if rec.get("install_error"):
            lines.append(f"| {release} | not installed | | | | | | {rec.get('date', '')} |")
            continue
        lines.append(
            f"| {rec['torch']} | {_status(rec)} | {rec['passed']} | {rec['failed']} | "
            f"{rec['errors']} | {rec['skipped']} | {rec['seconds']:.0f} | {rec.get('date', '')} |"
        )
    notes = [(r, rec["note"]) for r, rec in releases if rec.get("note")]
    subset = list(SUBSET)
    notes += [
        (r, "ran another selection: `pytest " + " ".join(_quoted(rec["tests"])) + "`")
        for r, rec in releases
        if rec.get("tests") and rec["tests"] != subset
    ]
    if notes:
        lines += [""] + [f"- torch {release}: {note}" for release, note in notes]
    failing = [(r, rec) for r, rec in releases if rec.get("groups") or rec.get("install_error")]
    if failing:
        lines += ["", "### First error of each failing group", ""]
        for release, rec in failing:
            lines += [f"#### torch {rec.get('torch', release)}", ""]
            if rec.get("install_error"):
                lines += [f"- could not install: {rec['install_error']}", ""]
                continue
            lines += ["| group | failed + errors | first error |", "|---|---:|---|"]
            for group, entry in sorted(rec["groups"].items()):
                first = entry["first"].replace("|", "\\|")
                lines.append(f"| `{group}` | {entry['count']} | {first} |")
            lines.append("")
    skipped = [(r, rec) for r, rec in releases if rec.get("skips")]
    if skipped:
        lines += ["", "### Skips", ""]
        for release, rec in skipped:
            lines += [f"#### torch {rec.get('torch', release)}", ""]
            for reason, count in sorted(rec["skips"].items()):
                lines.append(f"- {count}: {reason}")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _quoted(args: Sequence[str]) -> list[str]:
    return [f"'{a}'" if " " in a else a for a in args]


def write(results: dict[str, Any], json_path: Path = JSON_PATH, md_path: Path = MD_PATH) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    md_path.write_text(render(results))


def _record(release: str, record: dict[str, Any]) -> None:
    """Store one release's record, re-reading the file first (runs of other releases may have
    written theirs meanwhile)."""
    results = load_results()
    results["subset"] = list(SUBSET)
    results["releases"][release] = record
    write(results)


def _parse_pairs(items: Sequence[str], option: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items:
        release, sep, path = item.partition("=")
        if not sep or not path:
            raise SystemExit(f"{option} takes RELEASE=PATH, got {item!r}")
        pairs[release] = path
    return pairs


def given_python(release: str, path: str) -> tuple[Path, str]:
    """An interpreter given with --python, checked to hold torch ``release``."""
    python = Path(path)
    version = installed_torch(python)
    if version is None or not same_release(version, release):
        raise RuntimeError(f"{python} has torch {version}, not {release}")
    return python, version


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compat", description=__doc__)
    parser.add_argument(
        "releases", nargs="*", help=f"torch releases (default: {' '.join(DEFAULT_RELEASES)})"
    )
    parser.add_argument(
        "--venvs",
        type=Path,
        default=Path(
            os.environ.get("FSDP_BUILDER_COMPAT_VENVS", "~/.cache/fsdp-builder-compat")
        ).expanduser(),
        help="folder of the per-release venvs, outside the repository "
        "(default: $FSDP_BUILDER_COMPAT_VENVS or ~/.cache/fsdp-builder-compat)",
    )
    parser.add_argument("--wheel", action="append", default=[], help="RELEASE=PATH of a wheel")
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        help="RELEASE=PATH of an interpreter that already has that torch and the subset's "
        "packages (e.g. this checkout's own .venv): used as it is, nothing installed",
    )
    parser.add_argument("--index-url", help="package index for torch (e.g. PyTorch's CPU index)")
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds per release (default 600)"
    )
    parser.add_argument("--tests", nargs="+", help="pytest arguments instead of the subset")
    parser.add_argument(
        "--full-extras",
        action="store_true",
        help="install the whole test extra (pip install -e '.[test]') instead of what the "
        "subset needs",
    )
    parser.add_argument("--delete-after", action="store_true", help="remove each venv after")
    parser.add_argument("--list", action="store_true", help="print the subset and exit")
    parser.add_argument(
        "--render", action="store_true", help="rewrite compat.md from compat.json and exit"
    )
    args = parser.parse_args(argv)
    tests = tuple(args.tests or SUBSET)
    if args.list:
        print(" ".join(_quoted(tests)))
        return 0
    if args.render:
        write(load_results())
        return 0
    venvs: Path = args.venvs.resolve()
    if venvs == ROOT or ROOT in venvs.parents:
        raise SystemExit(f"--venvs {venvs} is inside the repository; put the venvs elsewhere")
    venvs.mkdir(parents=True, exist_ok=True)
    wheels = _parse_pairs(args.wheel, "--wheel")
    pythons = _parse_pairs(args.python, "--python")
    status = 0
    for release in args.releases or DEFAULT_RELEASES:
        log = venvs / f"torch-{release}.log"
        log.write_text("")
        stamp = time.strftime("%Y-%m-%d", time.gmtime())
        print(f"== torch {release}: preparing {venvs / f'torch-{release}'}", flush=True)
        try:
            if release in pythons:
                python, version = given_python(release, pythons[release])
            else:
                python, version = prepare_venv(
                    release, venvs, wheels.get(release), args.index_url, log, args.full_extras
                )
        except RuntimeError as exc:
            print(f"== torch {release}: {exc}", flush=True)
            _record(release, {"install_error": str(exc), "date": stamp})
            status = 1
            continue
        print(f"== torch {version}: running the subset (log: {log})", flush=True)
        record = run_subset(python, tests, args.timeout, log)
        record.update(
            torch=version, date=stamp, python=platform.python_version(), tests=list(tests)
        )
        _record(release, record)
        print(
            f"== torch {version}: {_status(record)}: {record['passed']} passed, "
            f"{record['failed']} failed, {record['errors']} errors, {record['skipped']} skipped "
            f"in {record['seconds']:.0f} s",
            flush=True,
        )
        if _status(record) != "green":
            status = 1
        if args.delete_after:
            shutil.rmtree(venvs / f"torch-{release}", ignore_errors=True)
    print(f"== table: {MD_PATH.relative_to(ROOT)}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
