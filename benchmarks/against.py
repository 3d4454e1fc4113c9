"""Paired runs against an earlier commit: the harness's recipes with the library of the working
tree (HEAD) and with the library at git revision REV, each side in its own fresh processes,
alternated pair by pair.

    python -m benchmarks.against REV [--head REV2] [--kinds units,hf_load] [--pairs 5]
        [--out FILE.md] [--json FILE.json]

The library at REV is taken from git (``git archive REV fsdp_builder``) into a temporary folder
that goes first on ``sys.path`` of that side's processes only; the benchmark code is the working
tree's for both sides. Each pair runs one child process per side (HEAD first in even pairs, REV
first in odd ones); a child runs every recipe of a kind on freshly spawned ranks:

- ``units``: the many-small-units builds (``benchmarks.units``: the builders' default paths and
  ``ShardFirstReset``, and the plain-torch builds they are divided by);
- ``hf_load``: loading a transformers Llama ``save_pretrained`` folder
  (``benchmarks.hf_load``: the builder's ``FromCheckpoint`` and ``from_pretrained`` on every
  rank, then ``fully_shard``), ``--loads`` loads per rank process, their median kept.

Reported per recipe, as min, median and max over the pairs: builder(HEAD) ÷ builder(REV), the
same with each side first divided by its plain control of the same child (which cancels a
child's share of the machine's drift), and each side's builder ÷ plain torch measured in the
same child, by CPU seconds (the process time of
each rank over the build, summed over the ranks) and by wall seconds (the slowest rank). The
plain recipes' HEAD ÷ REV says how steady the machine was. Wall time on a shared machine swings
far more than CPU time; read the CPU columns first.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# Each builder recipe and the plain-torch recipe of the same job it is divided by.
UNITS_PLAIN = {
    "builder_fsdp1": "plain_fsdp1",
    "builder_fsdp2": "plain_fsdp2",
    "builder_fsdp2_shard_first": "plain_fsdp2",
}
UNITS_RECIPES = (
    "plain_fsdp1",
    "builder_fsdp1",
    "plain_fsdp2",
    "builder_fsdp2",
    "builder_fsdp2_shard_first",
)
HF_PLAIN = {"builder": "from_pretrained_everywhere"}
HF_RECIPES = ("from_pretrained_everywhere", "builder")
KINDS = ("units", "hf_load")


def extract(rev: str, into: Path) -> tuple[str, Path]:
    """The full commit id of ``rev`` and the folder holding its ``fsdp_builder`` package."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "fsdp_builder"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit, into


# -- inside a rank -----------------------------------------------------------------------------


def _library() -> str:
    import fsdp_builder

    return str(Path(fsdp_builder.__file__).resolve().parent)


def units_rank(name: str, units: int, dim: int) -> dict[str, Any]:
    """One rank of one many-small-units build (``benchmarks.scaling.measure_units``)."""
    from benchmarks.scaling import measure_units

    return {**measure_units(name, units, dim), "library": _library()}


def hf_rank(method: str, folder: str, loads: int) -> dict[str, Any]:
    """``loads`` loads of ``folder`` by ``method`` in this rank process (``hf_load._load``)."""
    from benchmarks.hf_load import _load

    runs = [_load(method, folder) for _ in range(loads)]
    return {"runs": runs, "library": _library()}


# -- one side's child process ------------------------------------------------------------------


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Every recipe of ``spec["kind"]`` on fresh ranks, in the order given."""
    import multiprocessing as mp

    from fsdp_builder.tools.launch import run_ranks

    # Ranks fork from a server that has imported these once (as the harness's do), so a rank
    # starts in well under a second; what each build imports lazily, its warm-up pays.
    preload = ["torch", "torch.distributed.fsdp", "fsdp_builder", "benchmarks.scaling"]
    if spec["kind"] == "hf_load":
        preload += ["transformers", "benchmarks.hf_load"]
    mp.set_forkserver_preload(preload)
    records = []
    for name in spec["recipes"]:
        if spec["kind"] == "units":
            ranks = run_ranks(
                units_rank,
                spec["world"],
                name,
                spec["units"],
                spec["dim"],
                timeout=spec["timeout"],
                start_method=spec.get("start", "forkserver"),
            )
            cpu = sum(r["cpu_seconds"] for r in ranks)
            wall = max(r["seconds"] for r in ranks)
        else:
            ranks = run_ranks(
                hf_rank,
                spec["world"],
                name,
                spec["folder"],
                spec["loads"],
                timeout=spec["timeout"],
                start_method=spec.get("start", "forkserver"),
            )
            # Per load, the ranks' CPU summed and the slowest rank's wall; the median load kept.
            per_load = list(zip(*(r["runs"] for r in ranks), strict=True))
            cpu = statistics.median(sum(x["cpu_seconds"] for x in load) for load in per_load)
            wall = statistics.median(max(x["seconds"] for x in load) for load in per_load)
        records.append(
            {
                "recipe": name,
                "cpu_seconds": cpu,
                "seconds": wall,
                "libraries": sorted({r["library"] for r in ranks}),
            }
        )
    return {"library": _library(), "records": records}


def _run_child(side: str, lib: Path | None, spec: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """One side's child process: what it measured, and its own library path."""
    out = scratch / f"child-{side}-{time.monotonic_ns()}.json"
    env = dict(os.environ)
    paths = [str(lib)] if lib is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    args = [sys.executable, "-m", "benchmarks.against", "--child", json.dumps(spec), str(out)]
    if lib is not None:
        args += ["--lib", str(lib)]
    started = time.perf_counter()
    # Run from the scratch folder: the forkserver puts its working folder first on sys.path (and
    # takes no sys.path from its parent), so run from the repository its ranks would import the
    # working tree's library whatever PYTHONPATH says.
    done = subprocess.run(
        args,
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=spec["timeout"] * (len(spec["recipes"]) + 1),
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {side} child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["process_seconds"] = time.perf_counter() - started
    return result


# -- the report ----------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _fmt(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "-"
    return f"{spread['min']:.2f}\u2013**{spread['median']:.2f}**\u2013{spread['max']:.2f}"


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (kind, recipe): HEAD ÷ REV per pair, each side's builder ÷ plain per child."""
    by: dict[tuple[str, str, int, str], dict[str, Any]] = {}
    for r in records:
        by[(r["kind"], r["recipe"], r["pair"], r["side"])] = r
    rows = []
    for kind, recipe in sorted({(k, n) for k, n, _, _ in by}, key=lambda kn: kn[0]):
        pairs = sorted({p for k, n, p, _ in by if (k, n) == (kind, recipe)})
        plain = (UNITS_PLAIN if kind == "units" else HF_PLAIN).get(recipe)
        row: dict[str, Any] = {"kind": kind, "recipe": recipe, "plain": plain}
        for measure in ("cpu_seconds", "seconds"):
            head_rev = []
            # HEAD ÷ REV with each side divided by its own plain control first: a child that
            # ran on a slower machine moment moves its control too, and cancels out.
            head_rev_controlled = []
            over_plain: dict[str, list[float]] = {"head": [], "rev": []}
            for p in pairs:
                head, rev = by.get((kind, recipe, p, "head")), by.get((kind, recipe, p, "rev"))
                if head and rev:
                    head_rev.append(head[measure] / rev[measure])
                ratios = {}
                for side, mine in (("head", head), ("rev", rev)):
                    base = by.get((kind, plain, p, side)) if plain else None
                    if mine and base:
                        ratios[side] = mine[measure] / base[measure]
                        over_plain[side].append(ratios[side])
                if len(ratios) == 2:
                    head_rev_controlled.append(ratios["head"] / ratios["rev"])
            row[f"head_rev_{measure}"] = _spread(head_rev)
            row[f"head_rev_controlled_{measure}"] = _spread(head_rev_controlled)
            for side, values in over_plain.items():
                row[f"{side}_plain_{measure}"] = _spread(values)
            for side in ("head", "rev"):
                row[f"{side}_{measure}"] = _spread(
                    [
                        by[(kind, recipe, p, side)][measure]
                        for p in pairs
                        if (kind, recipe, p, side) in by
                    ]
                )
        rows.append(row)
    return rows


def render(result: dict[str, Any]) -> str:
    s = result["settings"]
    head = f"HEAD {result['head'][:7]}"
    if result["head_library"] == "the working tree":
        head = f"The working tree (HEAD {result['head'][:7]})"
    lines = [
        f"# {head} against {result['rev'][:7]}",
        "",
        f"`{result['command']}`: {s['pairs']} pair(s) of fresh child processes, alternated "
        f"(HEAD first in even pairs), {s['world']} gloo ranks; CPU = each rank's process time "
        "over the build, summed over the ranks; wall = the slowest rank. "
        "min\u2013**median**\u2013max over the pairs.",
        "",
        "| kind | recipe | HEAD ÷ REV, CPU | HEAD ÷ REV, CPU, each ÷ its plain | HEAD ÷ REV, "
        "wall | HEAD ÷ plain, CPU | REV ÷ plain, CPU | HEAD ÷ plain, wall | REV ÷ plain, wall "
        "| plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['kind']} | {r['recipe']} | {_fmt(r['head_rev_cpu_seconds'])} | "
            f"{_fmt(r['head_rev_controlled_cpu_seconds'])} | "
            f"{_fmt(r['head_rev_seconds'])} | {_fmt(r['head_plain_cpu_seconds'])} | "
            f"{_fmt(r['rev_plain_cpu_seconds'])} | {_fmt(r['head_plain_seconds'])} | "
            f"{_fmt(r['rev_plain_seconds'])} | {r['plain'] or '(plain torch)'} |"
        )
    lines += [
        "",
        "Seconds (median over the pairs):",
        "",
        "| kind | recipe | HEAD CPU s | REV CPU s | HEAD wall s | REV wall s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        cells = [
            f"{r[k]['median']:.3f}" if r[k] else "-"
            for k in ("head_cpu_seconds", "rev_cpu_seconds", "head_seconds", "rev_seconds")
        ]
        lines.append(f"| {r['kind']} | {r['recipe']} | " + " | ".join(cells) + " |")
    m = result["machine"]
    lines += [
        "",
        f"Settings: {json.dumps(s)}. Machine: {m['cpu_count']} CPU cores, torch {m['torch']}, "
        f"load average {m['loadavg_start']} at the start, {m['loadavg_end']} at the end.",
        "",
    ]
    return "\n".join(lines)


# -- the parent ----------------------------------------------------------------------------------


def _hf_folder(params: int, into: Path) -> str:
    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.hf_load import config_for

    torch.manual_seed(0)
    model = LlamaForCausalLM(config_for(params))
    model.save_pretrained(into, max_shard_size="200MB")
    del model
    os.sync()  # written back now, not during the first measurements
    return str(into)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.against", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("rev", help="the git revision to compare the working tree with")
    p.add_argument(
        "--head",
        help="a git revision to take the HEAD side's library from instead of the working tree "
        "(which may hold edits in progress)",
    )
    p.add_argument("--kinds", default=",".join(KINDS), help="units, hf_load (comma-separated)")
    p.add_argument("--pairs", type=int, default=5, help="pairs of child processes per kind")
    p.add_argument("--world", type=int, default=2, help="ranks (gloo)")
    p.add_argument("--units", type=int, default=400, help="units of the many-small-units build")
    p.add_argument("--dim", type=int, default=32, help="width of each small unit")
    p.add_argument("--recipes", help="units recipes, comma-separated (default: all five)")
    p.add_argument("--hf-recipes", help="hf_load recipes, comma-separated (default: both)")
    p.add_argument("--params", type=int, default=200, help="hf_load model size, millions")
    p.add_argument("--loads", type=int, default=3, help="hf_load loads per rank process")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per rank launch")
    p.add_argument("--out", type=Path, help="markdown report (default: print only)")
    p.add_argument("--json", type=Path, help="JSON records and summary")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(argv) if argv is not None else sys.argv[1:]
    args = build_parser().parse_args(raw)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or args.pairs < 1:
        print(
            f"--kinds takes {', '.join(KINDS)} (got {unknown}); --pairs at least 1", file=sys.stderr
        )
        return 2
    recipes = {
        "units": args.recipes.split(",") if args.recipes else list(UNITS_RECIPES),
        "hf_load": args.hf_recipes.split(",") if args.hf_recipes else list(HF_RECIPES),
    }
    import torch

    machine = {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg_start": round(os.getloadavg()[0], 2),
    }
    records: list[dict[str, Any]] = []
    children: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fsdp-against-") as tmp:
        scratch = Path(tmp)
        commit, lib = extract(args.rev, scratch / "rev")
        if args.head is not None:
            head, head_lib = extract(args.head, scratch / "head")
        else:
            head_lib = None
            head = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        folder = _hf_folder(args.params, scratch / "hf") if "hf_load" in kinds else None
        for kind in kinds:
            names = recipes[kind]
            for pair in range(args.pairs):
                sides = ("head", "rev") if pair % 2 == 0 else ("rev", "head")
                # The recipes rotate each pair, so none always runs first in its child.
                shift = pair % len(names)
                spec = {
                    "kind": kind,
                    "recipes": [*names[shift:], *names[:shift]],
                    "world": args.world,
                    "units": args.units,
                    "dim": args.dim,
                    "folder": folder,
                    "loads": args.loads,
                    "timeout": args.timeout,
                }
                for side in sides:
                    got = _run_child(side, lib if side == "rev" else head_lib, spec, scratch)
                    children.append(
                        {
                            "kind": kind,
                            "pair": pair,
                            "side": side,
                            "library": got["library"],
                            "process_seconds": got["process_seconds"],
                        }
                    )
                    for r in got["records"]:
                        records.append({**r, "kind": kind, "pair": pair, "side": side})
                    print(
                        kind,
                        pair,
                        side,
                        [(r["recipe"], round(r["cpu_seconds"], 3)) for r in got["records"]],
                        flush=True,
                    )
    machine["loadavg_end"] = round(os.getloadavg()[0], 2)
    result = {
        "command": "python -m benchmarks.against " + " ".join(raw),
        "head": head,
        "rev": commit,
        "rev_library": str(lib),
        "repo_library": str(REPO / "fsdp_builder"),
        "head_library": str(head_lib) if head_lib is not None else "the working tree",
        "settings": {
            "pairs": args.pairs,
            "world": args.world,
            "kinds": kinds,
            "units": args.units,
            "dim": args.dim,
            "params": args.params,
            "loads": args.loads,
        },
        "machine": machine,
        "children": children,
        "records": records,
        "rows": summarize(records),
    }
    text = render(result)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _child_main(argv: list[str]) -> int:
    spec, out = json.loads(argv[0]), Path(argv[1])
    if argv[2:4] and argv[2] == "--lib":
        # Ahead of the working tree, which `python -m` put first; spawned ranks inherit sys.path.
        sys.path.insert(0, argv[3])
    out.write_text(json.dumps(_child(spec)))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        raise SystemExit(_child_main(sys.argv[2:]))
    raise SystemExit(main())
