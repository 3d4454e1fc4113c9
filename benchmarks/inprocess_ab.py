"""In-process A/B of the library against an earlier revision, at many small units: both
libraries and plain torch built in turn in the same 2 gloo ranks, the order rotated each repeat.

Fresh processes on a shared machine move by 10-20 % between sides (``benchmarks.against``
pairs them but cannot remove that), which hides a per-unit change of a few percent. Here the
earlier revision is taken from git (``git archive REV fsdp_builder``) and imported under another
package name (``fsdp_builder_rev``, every ``fsdp_builder`` word in its source renamed), so both
sides run in the same ranks, one build after the other; CPU is each rank's process time over a
build, summed over the ranks, and every ratio is taken within one repeat.

    python -m benchmarks.inprocess_ab REV [--recipes builder_fsdp1,...] [--repeats 12]
    python -m benchmarks.inprocess_ab REV --kind hf_load [--params 200] [--repeats 12]

``--kind hf_load`` loads a transformers Llama ``save_pretrained`` folder (``--params`` million
parameters, fp32, 200 MB shards) built on meta with ``FromCheckpoint``, held to
``from_pretrained`` on every rank + ``fully_shard`` (the "plain" side).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.against import _hf_folder, extract
from benchmarks.common import quartiles_cell

RENAMED = "fsdp_builder_rev"
# builder recipe -> (backend, materializer class or None, the plain recipe it is held to)
RECIPES: dict[str, tuple[str, str | None, str]] = {
    "builder_fsdp1": ("fsdp1", None, "plain_fsdp1"),
    "builder_fsdp2": ("fsdp2", None, "plain_fsdp2"),
    "builder_fsdp2_shard_first": ("fsdp2", "ShardFirstReset", "plain_fsdp2"),
}
SIDES = ("head", "rev", "plain")
HF_LOAD = "hf_load"


def renamed_copy(rev: str, into: Path) -> str:
    """Extract ``rev``'s library into ``into`` as the package ``fsdp_builder_rev``; its commit."""
    commit, _ = extract(rev, into)
    (into / "fsdp_builder").rename(into / RENAMED)
    word = re.compile(r"\bfsdp_builder\b")
    for path in (into / RENAMED).rglob("*.py"):
        path.write_text(word.sub(RENAMED, path.read_text()))
    return commit


def _hf_builder(folder: str, library: str) -> Any:
    from transformers import AutoConfig, LlamaForCausalLM

    lib = importlib.import_module(library)
    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))
    return lib.FullyShardBuilder().materialize(lib.FromCheckpoint(folder)).build(model)


def _hf_plain(folder: str) -> Any:
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _hf_runners(folder: str) -> dict[str, Callable[[], Any]]:
    return {
        "head": lambda: _hf_builder(folder, "fsdp_builder"),
        "rev": lambda: _hf_builder(folder, RENAMED),
        "plain": lambda: _hf_plain(folder),
    }


def _runners(name: str) -> dict[str, Callable[..., Any]]:
    from benchmarks.units import builder, plain_fsdp1, plain_fsdp2

    backend, materializer, plain = RECIPES[name]
    return {
        "head": lambda cfg, job: builder(cfg, job, backend, materializer),
        "rev": lambda cfg, job: builder(cfg, job, backend, materializer, library=RENAMED),
        "plain": plain_fsdp1 if plain == "plain_fsdp1" else plain_fsdp2,
    }


def rank(
    copy: str, recipes: list[str], repeats: int, units: int, folder: str | None = None
) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """One rank: each recipe's three sides (``folder``: the checkpoint loads), rotated per
    repeat; CPU seconds summed over ranks. Also the folder each builder side's package was
    imported from."""
    from benchmarks.scaling import quiet_cpu_job
    from benchmarks.units import UnitsConfig

    sys.path.insert(0, copy)
    job = quiet_cpu_job()
    found: dict[str, dict[str, list[float]]] = {}
    for name in recipes:
        build: dict[str, Callable[[], Any]]
        if name == HF_LOAD:
            assert folder is not None
            build = _hf_runners(folder)
            for warm_load in build.values():  # imports, first-call caches, the page cache
                warm_load()
        else:
            runners = _runners(name)
            warm = UnitsConfig(units=4, dim=32)
            for run in runners.values():  # one-time costs (imports, first-call caches) left out
                run(warm, job)
            cfg = UnitsConfig(units=units, dim=32)
            build = {side: functools.partial(run, cfg, job) for side, run in runners.items()}
        for repeat in range(repeats):
            shift = repeat % len(SIDES)
            for side in SIDES[shift:] + SIDES[:shift]:
                gc.collect()
                dist.barrier()
                start = time.process_time()
                model = build[side]()
                dist.barrier()
                cpu = torch.tensor([time.process_time() - start], dtype=torch.float64)
                dist.all_reduce(cpu)
                found.setdefault(name, {}).setdefault(side, []).append(float(cpu))
                del model
    libraries = {
        side: str(Path(importlib.import_module(package).__file__ or "").parent)
        for side, package in (("head", "fsdp_builder"), ("rev", RENAMED))
    }
    return found, libraries


def _per_repeat(a: list[float], b: list[float]) -> str:
    return quartiles_cell([x / y for x, y in zip(a, b, strict=True)])


def render(found: dict[str, dict[str, list[float]]], head: str, rev: str) -> str:
    lines = [
        f"head = {head}, rev = {rev}; per repeat: min - q1 - **median** - q3 - max",
        "",
        "| recipe | repeats | head CPU s | rev CPU s | plain CPU s | head ÷ rev | head ÷ plain "
        "| rev ÷ plain |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for name, sides in found.items():
        h, r, p = sides["head"], sides["rev"], sides["plain"]
        lines.append(
            f"| {name} | {len(h)} | {statistics.median(h):.3f} | {statistics.median(r):.3f} | "
            f"{statistics.median(p):.3f} | {_per_repeat(h, r)} | {_per_repeat(h, p)} | "
            f"{_per_repeat(r, p)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from fsdp_builder.tools.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("rev", help="the earlier revision (any git revision)")
    p.add_argument("--kind", choices=("units", HF_LOAD), default="units")
    p.add_argument("--recipes", default=",".join(RECIPES), help="with --kind units")
    p.add_argument("--params", type=int, default=200, help="hf_load model size, millions")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--units", type=int, default=400)
    args = p.parse_args(argv)
    recipes = [HF_LOAD] if args.kind == HF_LOAD else args.recipes.split(",")
    unknown = sorted(set(recipes) - set(RECIPES) - {HF_LOAD})
    if unknown:
        p.error(f"--recipes: unknown {unknown}; choose from {sorted(RECIPES)}")
    with tempfile.TemporaryDirectory(prefix="inprocess-ab-") as copy:
        commit = renamed_copy(args.rev, Path(copy))
        folder = _hf_folder(args.params, Path(copy) / "hf") if args.kind == HF_LOAD else None
        results: list[Any] = run_ranks(
            rank,
            2,
            copy,
            recipes,
            args.repeats,
            args.units,
            folder,
            timeout=3600.0,
            start_method="forkserver",
        )
    found, _ = results[0]
    print(render(found, "the working tree", commit[:12]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
