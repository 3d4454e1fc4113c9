"""Dry runs of Llama-3- and Mixtral-sized builds at large world sizes
(``fsdp_builder.tools.dryrun``).

Each row is one simulated rank of the real build of a transformers ``LlamaForCausalLM`` with
Llama 3's sizes or ``MixtralForCausalLM`` with Mixtral 8x7B's, created on the meta device: FSDP2
(``fully_shard`` over all ranks), HSDP (FSDP2 over a (nodes, 8) mesh: shards within a node of 8,
replicas across nodes) and FSDP1 (``FullyShardedDataParallel``, FULL_SHARD), each with its
backend's default materializer and transformers' ``_no_split_modules`` as units; for the MoE
also FSDP2 with its 3-D expert tensors sharded on dim 1. Written to
``benchmarks/results/dryrun.md`` (Llama rows in the block ``table``, MoE rows in ``moe``):

    python -m benchmarks.dryrun_scale [--models 8b,70b,405b] [--worlds 8,64,512,1024,4096]
    python -m benchmarks.dryrun_scale --models mixtral-8x7b --block moe --max-local 1e12
    python -m benchmarks.dryrun_scale --peaks   # predicted vs measured build peaks, 2 and 4 ranks
    python -m benchmarks.dryrun_scale --timings  # the tests' large dry runs and plans, timed
    python -m benchmarks.dryrun_scale --per-rank --models 405b --worlds 1024,4096,16384
    python -m benchmarks.dryrun_scale --step --models 8b,70b,405b,mixtral-8x7b --worlds 8,512,4096

``--timings`` and ``--per-rank`` write to ``benchmarks/results/dryrun_scale.md``: how long the
dry runs and plans that the tests check (for their results only) take, and one simulated rank's
time (first and last rank, FSDP2) by world size, in wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from benchmarks.models import BenchConfig, BenchTransformer
from benchmarks.models import Block as BenchBlock
from fsdp_builder import (
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    ResetParameters,
    ShardingBuilder,
)
from fsdp_builder.tools.dryrun import RankRun, simulate
from fsdp_builder.tools.launch import run_ranks

RESULTS = Path(__file__).resolve().parent / "results" / "dryrun.md"
SCALE_RESULTS = RESULTS.parent / "dryrun_scale.md"
REPO = RESULTS.parent.parent.parent
PER_NODE = 8
# Llama 3 / 3.1 sizes (the published configs' hidden sizes, layers and heads).
LLAMA3: dict[str, dict[str, Any]] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                 num_attention_heads=128, num_key_value_heads=8),
}  # fmt: skip


# Mixtral 8x7B's published config (transformers fuses each layer's 8 experts into 3-D tensors).
MIXTRAL: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         num_local_experts=8, num_experts_per_tok=2),
}  # fmt: skip


def model_factory(size: str) -> Callable[[], nn.Module]:
    moe = size in MIXTRAL

    def make() -> nn.Module:
        if moe:
            model: nn.Module = MixtralForCausalLM(MixtralConfig(**MIXTRAL[size]))
        else:
            model = LlamaForCausalLM(LlamaConfig(vocab_size=128256, **LLAMA3[size]))
        return model.to(torch.bfloat16)

    return make


def fsdp2() -> ShardingBuilder:
    return FullyShardBuilder()


def hsdp() -> ShardingBuilder:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // PER_NODE, PER_NODE))
    return FullyShardBuilder().groups(mesh).sharding("hybrid")


def fsdp1() -> ShardingBuilder:
    return FSDPBuilder()


def fsdp2_experts_dim1() -> ShardingBuilder:
    # The fused experts' dim 0 is the expert count (8): sharded there, at most 8 ranks get rows.
    return FullyShardBuilder().shard_placement_fn(lambda p: Shard(1) if p.ndim == 3 else None)


LAYOUTS: dict[str, Callable[[], ShardingBuilder]] = {"FSDP2": fsdp2, "HSDP": hsdp, "FSDP1": fsdp1}
MOE_LAYOUTS = {**LAYOUTS, "FSDP2, experts dim 1": fsdp2_experts_dim1}


# -- the build peak predicted and measured (--peaks; the tests hold it to 10 %) ---------------

# The benchmark harness's model and a transformers Llama, large enough (about 104 and 80 MiB)
# that the build's own bytes dwarf the half MiB or so by which a process's resident size
# drifts during a build for reasons of its own (Python's and the allocator's free lists).
BENCH = BenchConfig(vocab=8192, dim=512, heads=8, layers=6)
SMALL_LLAMA: dict[str, Any] = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, vocab_size=8192,
)  # fmt: skip
TINY = dict(SMALL_LLAMA, hidden_size=64, intermediate_size=160, vocab_size=300)
# Two experts: FSDP2 gives ranks past the second no expert rows, but pads them a chunk.
SMALL_MOE = dict(SMALL_LLAMA, num_hidden_layers=2, intermediate_size=2048, num_local_experts=2)
PEAK_MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module]]] = {
    # (the measured model, a tiny one of the same classes for the warm-up build)
    "bench": (
        lambda: BenchTransformer(BENCH),
        lambda: BenchTransformer(BenchConfig(vocab=256, dim=64, heads=1, layers=2)),
    ),
    "llama": (
        lambda: LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA)),
        lambda: LlamaForCausalLM(LlamaConfig(**TINY)),
    ),
    "mixtral": (
        lambda: MixtralForCausalLM(MixtralConfig(**SMALL_MOE)),
        lambda: MixtralForCausalLM(MixtralConfig(**dict(TINY, num_local_experts=2))),
    ),
}
PEAK_BUILDERS: dict[str, Callable[[], ShardingBuilder]] = {
    "fsdp2": FullyShardBuilder,  # its default StreamInit: shards first
    "fsdp2_reset": lambda: FullyShardBuilder().materialize(ResetParameters()),  # unit by unit
    "fsdp1": FSDPBuilder,  # ResetParameters, then FSDP1 flattens and cuts each unit
}


def peak_builder(builder: str, model: str) -> ShardingBuilder:
    made = PEAK_BUILDERS[builder]()
    return made.wrap(BenchBlock) if model == "bench" else made


def fixed_mmap_threshold() -> None:
    """As the benchmark harness does, a fixed glibc mmap threshold, here 64 KiB: every tensor but
    the smallest is a mapping of its own, whose pages leave the resident set when freed."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD


def _resident(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def measured_peak(builder: str, model: str) -> int:
    """Resident bytes the real build adds at its peak: the kernel's high-water mark, reset just
    before the build, over the level then. A tiny build of the same classes runs first, so lazy
    imports and first-call caches are not counted. Collective (a barrier)."""
    measured, warm_up = PEAK_MODELS[model]
    with torch.device("meta"):
        tiny = warm_up()
    peak_builder(builder, model).build(tiny)
    with torch.device("meta"):
        meta = measured()
    del tiny
    gc.collect()
    dist.barrier()
    before = _resident("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    built = peak_builder(builder, model).build(meta)
    peak = _resident("VmHWM:") - before
    del built
    return peak


def _measured_peaks() -> dict[tuple[str, str], int]:
    fixed_mmap_threshold()
    return {(b, m): measured_peak(b, m) for m in PEAK_MODELS for b in PEAK_BUILDERS}


def peak_rows(worlds: list[int]) -> list[str]:
    """Predicted (dry run) and measured (real gloo build) build peak of every rank."""
    lines = [
        "| model | builder | world | predicted, per rank (MiB) | measured, per rank (MiB) "
        "| largest difference |",
        "|---|---|---|---|---|---|",
    ]
    for world in worlds:
        measured = run_ranks(_measured_peaks, world, timeout=600)
        for (builder, model), factories in (
            ((b, m), PEAK_MODELS[m]) for m in PEAK_MODELS for b in PEAK_BUILDERS
        ):
            make = partial(peak_builder, builder, model)
            runs = simulate(make, factories[0], world, ranks=range(world)).runs
            real = [ranks[(builder, model)] for ranks in measured]
            worst = max(abs((r.build_peak or 0) - m) / m for r, m in zip(runs, real, strict=True))
            lines.append(
                f"| {model} | {builder} | {world} | "
                + " / ".join(f"{(r.build_peak or 0) / 2**20:.2f}" for r in runs)
                + " | "
                + " / ".join(f"{m / 2**20:.2f}" for m in real)
                + f" | {worst:.1%} |"
            )
            print(lines[-1], flush=True)
    return lines


# Hugging Face's shard size for these checkpoints.
FILE_BYTES = 5 * 10**9
_ST_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def sparse_checkpoint(folder: Path, model: nn.Module) -> Path:
    """A Hugging Face safetensors folder with the model's names, shapes and dtypes whose data
    are holes (sparse files): valid headers, nothing on disk. A dry run records its reads and
    makes none, so it needs no more."""
    folder.mkdir(parents=True, exist_ok=True)
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in model.state_dict().items():
        if size and size + tensor.nbytes > FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append((name, tensor))
        size += tensor.nbytes
    weight_map: dict[str, str] = {}
    for i, entries in enumerate(files):
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, tensor in entries:
            header[name] = {
                "dtype": _ST_NAMES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + tensor.nbytes],
            }
            offset += tensor.nbytes
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
    index = {"metadata": {"total_size": sum(t.nbytes for t in model.state_dict().values())}}
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def read_rows(size: str, make: Callable[[], nn.Module], world: int, folder: Path) -> list[str]:
    """The read plan of a FromCheckpoint load of ``folder`` for each layout at ``world``."""
    lines = []
    for layout, builder in LAYOUTS.items():

        def loading(builder: Callable[[], ShardingBuilder] = builder) -> ShardingBuilder:
            return builder().materialize(FromCheckpoint(folder))

        ranks = (0, world // 2 - 1, world - 1)
        started = time.perf_counter()
        run = simulate(loading, make, world, ranks=ranks)
        seconds = time.perf_counter() - started
        failed = next((r for r in run.runs if not r.ok), None)
        if failed is not None:
            lines.append(f"| {size} | {layout} | {world} | {failed.error_type}: {failed.error} |")
            continue
        per_rank = " / ".join(gib(r.read_bytes) for r in run.runs)
        reads = " / ".join(str(len(r.reads)) for r in run.runs)
        files = " / ".join(str(len({x.file for x in r.reads})) for r in run.runs)
        balance = run.read_balance or 0.0
        lines.append(
            f"| {size} | {layout} | {world} | {per_rank} | {reads} | {files} | {balance:.3f} "
            f"| {seconds:.1f} |"
        )
        print(lines[-1], flush=True)
    return lines


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:,.3f}"


def row(size: str, layout: str, world: int, runs: tuple[RankRun, ...], seconds: float) -> str:
    failed = next((r for r in runs if not r.ok), None)
    if failed is not None:
        error = f"{failed.error_type}: {failed.error}"
        return f"| {size} | {layout} | {world} | {error} | | | | | | | {seconds:.1f} |"
    first, last = runs[0], runs[-1]
    largest = max((s.nbytes for s in first.shards), default=0)
    last_bytes = gib(last.param_bytes) if last is not first else "-"
    last_peak = gib(last.build_peak) if last is not first else "-"
    return (
        f"| {size} | {layout} | {world} | {first.shard_size} | {gib(first.param_bytes)} | "
        f"{last_bytes} | {largest / 2**20:,.1f} | {gib(first.largest_unit_bytes)} | "
        f"{gib(first.build_peak)} | {last_peak} | {seconds:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="8b,70b,405b")
    parser.add_argument("--worlds", default="8,64,512,1024,4096")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--reads",
        default="",
        help="MODEL@WORLD,...: also the read plans of FromCheckpoint loads of a sparse "
        "safetensors folder with the model's layout (e.g. 405b@1024)",
    )
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/dryrun_checkpoints"))
    parser.add_argument("--block", default="table", help="the results block the rows replace")
    parser.add_argument(
        "--peaks", action="store_true", help="only the predicted and measured peaks at 2 and 4"
    )
    parser.add_argument(
        "--max-local",
        type=float,
        default=3e9,
        help="skip FSDP2/HSDP cells whose rank holds more parameter elements than this, except "
        "at 1024 ranks (the default materializer's block draws take about 0.6 ms per 64 Ki "
        "elements of the rank's shard in a dry run)",
    )
    parser.add_argument(
        "--timings",
        action="store_true",
        help="only the tests' large dry runs and plans, timed (benchmarks/results/dryrun_scale.md)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each timed piece of work")
    parser.add_argument(
        "--per-rank",
        action="store_true",
        help="only one FSDP2 rank's time (first and last rank) for --models at --worlds "
        "(benchmarks/results/dryrun_scale.md, the block --block, default per_rank)",
    )
    parser.add_argument(
        "--step",
        action="store_true",
        help="only rank 0's build and training-step peak, FSDP2 and HSDP, for --models at "
        "--worlds (the block step of benchmarks/results/dryrun.md)",
    )
    args = parser.parse_args()
    if args.step:
        models = [m for m in args.models.split(",") if m]
        worlds = [int(w) for w in args.worlds.split(",")]
        write_block(args.out, "step", step_rows(models, worlds))
        return
    if args.timings or args.per_rank:
        out = SCALE_RESULTS if args.out == RESULTS else args.out
        if args.timings:
            write_block(out, "timings", timing_rows(args.repeats))
        if args.per_rank:
            models = [m for m in args.models.split(",") if m]
            worlds = [int(w) for w in args.worlds.split(",")]
            block = "per_rank" if args.block == "table" else args.block
            write_block(out, block, per_rank_rows(models, worlds))
        return
    if args.peaks:
        write_block(args.out, "peaks", peak_rows([2, 4]))
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    lines = [
        "| model | layout | world | shard group | params, rank 0 (GiB) | params, last rank (GiB) "
        "| largest shard, rank 0 (MiB) | largest unit, full (GiB) | build peak, rank 0 (GiB) "
        "| build peak, last rank (GiB) | dry run (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    built: list[str] = []
    for size in [m for m in args.models.split(",") if m]:
        make = model_factory(size)
        started = time.perf_counter()
        with torch.device("meta"):
            numel = sum(p.numel() for p in make().parameters())
        construct = time.perf_counter() - started
        built.append(f"{size} {numel / 1e9:.2f} G parameters in {construct:.2f} s")
        print(built[-1], flush=True)
        for layout, builder in (MOE_LAYOUTS if size in MIXTRAL else LAYOUTS).items():
            for world in worlds:
                local = numel / (PER_NODE if layout == "HSDP" else world)
                if layout != "FSDP1" and local > args.max_local and world != 1024:
                    lines.append(
                        f"| {size} | {layout} | {world} | not run: {local / 1e9:.1f} G elements "
                        f"per rank, about {local / 65536 * 6e-4:.0f} s | | | | | | | |"
                    )
                    print(lines[-1], flush=True)
                    continue
                started = time.perf_counter()
                # Rank 0 holds the most (torch.chunk gives the last ranks the remainder); a
                # forced slow cell simulates rank 0 alone.
                ranks = (0,) if local > args.max_local else (0, world - 1)
                runs = simulate(builder, make, world, ranks=ranks).runs
                seconds = time.perf_counter() - started
                lines.append(row(size, layout, world, runs, seconds))
                print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"models built on meta: {', '.join(built)}")
    if built:
        write_block(args.out, args.block, lines)
    if args.reads:
        reads = [
            "| model | layout | world | read per rank, ranks 0 / W/2-1 / W-1 (GiB) | reads "
            "| files | balance (max/mean) | dry run (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for cell in args.reads.split(","):
            size, _, world = cell.partition("@")
            make = model_factory(size)
            with torch.device("meta"):
                folder = sparse_checkpoint(args.scratch / size, make())
            reads += read_rows(size, make, int(world), folder)
        write_block(args.out, "reads", reads)


# -- how long the tests' large dry runs and plans take (--timings) ----------------------------

# tests/test_dryrun.py's transformers Llama.
TEST_LLAMA: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300,
)  # fmt: skip
# tests/test_plan_cli.py's Llama-2 7B, from docs/recipes/llama_model.py, planned at 64 ranks.
LLAMA_7B = """
from llama_model import ModelArgs, Transformer


def make():
    return Transformer(
        ModelArgs(
            dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256,
            max_seq_len=4096,
        )
    )
"""


def timed(work: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of ``work()``, CPU counted in this process and its children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu += after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    return wall, cpu


def _test_llama() -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(**TEST_LLAMA))


def _plan_7b() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        shutil.copy(REPO / "docs" / "recipes" / "llama_model.py", folder / "llama_model.py")
        (folder / "mymodel.py").write_text(textwrap.dedent(LLAMA_7B))
        subprocess.run(
            [sys.executable, "-m", "fsdp_builder", "plan", "mymodel:make", "--wrap",
             "TransformerBlock", "--world-size", "64", "--param-dtype", "bf16", "--json"],
            capture_output=True, check=True, cwd=folder, timeout=600,
        )  # fmt: skip


def timing_rows(repeats: int) -> list[str]:
    """The work of the tests that once held it to a wall-clock bound, timed here instead."""
    work: dict[str, Callable[[], object]] = {
        "tests/test_dryrun.py: tiny transformers Llama, FSDP2, ranks 0 and 1023 of 1,024": (
            lambda: simulate(FullyShardBuilder, _test_llama, 1024, ranks=(0, 1023))
        ),
        "tests/test_dryrun.py: tiny transformers Llama, FSDP1, ranks 0 and 1023 of 1,024": (
            lambda: simulate(FSDPBuilder, _test_llama, 1024, ranks=(0, 1023))
        ),
        "tests/test_plan_cli.py: `fsdp-builder plan` of a Llama-2 7B at 64 ranks (a process)": (
            _plan_7b
        ),
    }
    lines = [
        "| work | wall (s), min / median / max | CPU (s), min / median / max |",
        "|---|---|---|",
    ]
    for name, job in work.items():
        times = [timed(job) for _ in range(repeats)]
        walls, cpus = sorted(t[0] for t in times), sorted(t[1] for t in times)
        lines.append(
            f"| {name} | {walls[0]:.1f} / {walls[len(walls) // 2]:.1f} / {walls[-1]:.1f} "
            f"| {cpus[0]:.1f} / {cpus[len(cpus) // 2]:.1f} / {cpus[-1]:.1f} |"
        )
        print(lines[-1], flush=True)
    return lines


def _simulate_into(
    runs: list[RankRun], make: Callable[[], nn.Module], world: int, rank: int
) -> None:
    runs.extend(simulate(fsdp2, make, world, ranks=(rank,)).runs)


def per_rank_rows(models: list[str], worlds: list[int]) -> list[str]:
    """One simulated rank's time, FSDP2 with its default materializer, the first and the last
    rank each simulated alone (the model made on meta for each, as the dry run does)."""
    lines = [
        "| model | layout | world | rank | wall (s) | CPU (s) | params, rank (GiB) "
        "| build peak, rank (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in models:
        make = model_factory(size)
        for world in worlds:
            for rank in (0, world - 1):
                made: list[RankRun] = []
                wall, cpu = timed(partial(_simulate_into, made, make, world, rank))
                (run,) = made
                if not run.ok:
                    lines.append(
                        f"| {size} | FSDP2 | {world} | {rank} | {wall:.1f} | {cpu:.1f} "
                        f"| {run.error_type}: {run.error} | |"
                    )
                else:
                    lines.append(
                        f"| {size} | FSDP2 | {world} | {rank} | {wall:.1f} | {cpu:.1f} "
                        f"| {gib(run.param_bytes)} | {gib(run.build_peak)} |"
                    )
                print(lines[-1], flush=True)
                gc.collect()
    return lines


# -- the first training step's peak per rank (--step) -----------------------------------------

STEP_BATCH, STEP_SEQ = 1, 4096


def _step_builder(layout: str, block: type[nn.Module]) -> ShardingBuilder:
    # ResetParameters: a FakeTensor draws nothing, so the build costs no time per element; its
    # build peak holds one unit in full beside the shards (the most any materializer holds).
    return LAYOUTS[layout]().activation_checkpointing(block).materialize(ResetParameters())


def step_rows(models: list[str], worlds: list[int]) -> list[str]:
    """Rank 0's build and training-step peak (AdamW, activation checkpointing of every decoder
    layer, bf16 parameters, a causal-LM loss on STEP_BATCH x STEP_SEQ tokens)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    lines = [
        "| model | layout | world | params (GiB) | build peak (GiB) | step peak (GiB) "
        "| parameters | gradients | optimizer state | activations | gathered + comm. "
        "| temporaries | dry run (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # World by world, so the cheap rows come first; HSDP's rank holds the same at any world
    # (a shard group of PER_NODE), so it runs at one world size.
    cells = [
        (world, size, layout)
        for world in worlds
        for size in models
        for layout in ("FSDP2", "HSDP")
        if layout == "FSDP2"
        or (world > PER_NODE and world == min(w for w in worlds if w > PER_NODE))
    ]
    for world, size, layout in cells:
        make = model_factory(size)
        block = MixtralDecoderLayer if size in MIXTRAL else LlamaDecoderLayer
        vocab = MIXTRAL[size]["vocab_size"] if size in MIXTRAL else 128256

        def step(model: nn.Module, vocab: int = vocab) -> torch.Tensor:
            ids = torch.randint(0, vocab, (STEP_BATCH, STEP_SEQ))
            loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
            return loss

        started = time.perf_counter()
        run = simulate(partial(_step_builder, layout, block), make, world, step=step)
        seconds = time.perf_counter() - started
        r = run.runs[0]
        head = f"| {size} | {layout} | {world} |"
        if not r.ok or r.step_peak is None:
            why = r.error if not r.ok else r.step_note
            lines.append(f"{head} not simulated: {why} | | | | | | | | | {seconds:.1f} |")
        else:
            p = r.step_peak
            gathered = p.get("gathered parameters", 0) + p.get("communication buffers", 0)
            parts = [
                p.get("parameters", 0), p.get("gradients", 0), p.get("optimizer state", 0),
                p.get("activations", 0), gathered, p.get("temporaries", 0),
            ]  # fmt: skip
            lines.append(
                f"{head} {gib(r.param_bytes)} | {gib(r.build_peak)} | {gib(p['total'])} | "
                + " | ".join(gib(x) for x in parts)
                + f" | {seconds:.1f} |"
            )
        print(lines[-1], flush=True)
    return lines


def write_block(out: Path, name: str, lines: list[str]) -> None:
    """Replace the lines between ``<!-- name -->`` and ``<!-- /name -->`` in ``out``, keeping
    the text around them (what the numbers mean)."""
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    block = f"{begin}\n<!-- generated {stamp} on {machine} -->\n" + "\n".join(lines) + f"\n{end}"
    old = out.read_text() if out.exists() else "# Dry runs at scale\n"
    if begin not in old:
        old += f"\n{begin}{end}\n"
    head, _, rest = old.partition(begin)
    _, _, tail = rest.partition(end)
    out.write_text(head + block + tail)


if __name__ == "__main__":
    main()
