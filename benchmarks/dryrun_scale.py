"""Dry runs of Llama-3-sized builds at large world sizes (``fsdp_builder.tools.dryrun``).

Each row is one simulated rank of the real build of a transformers ``LlamaForCausalLM`` with
Llama 3's sizes, created on the meta device: FSDP2 (``fully_shard`` over all ranks), HSDP
(FSDP2 over a (nodes, 8) mesh: shards within a node of 8, replicas across nodes) and FSDP1
(``FullyShardedDataParallel``, FULL_SHARD), each with its backend's default materializer and
transformers' ``_no_split_modules`` as units. Written to ``benchmarks/results/dryrun.md``:

    python benchmarks/dryrun_scale.py [--models 8b,70b,405b] [--worlds 8,64,512,1024,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_builder import FromCheckpoint, FSDPBuilder, FullyShardBuilder, ShardingBuilder
from fsdp_builder.tools.dryrun import RankRun, simulate

RESULTS = Path(__file__).resolve().parent / "results" / "dryrun.md"
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


def model_factory(size: str) -> Callable[[], nn.Module]:
    config = LlamaConfig(vocab_size=128256, **LLAMA3[size])

    def make() -> nn.Module:
        model: nn.Module = LlamaForCausalLM(config)
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


LAYOUTS: dict[str, Callable[[], ShardingBuilder]] = {"FSDP2": fsdp2, "HSDP": hsdp, "FSDP1": fsdp1}


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
        return f"| {size} | {layout} | {world} | {error} | | | | | | {seconds:.1f} |"
    first, last = runs[0], runs[-1]
    largest = max((s.nbytes for s in first.shards), default=0)
    last_bytes = gib(last.param_bytes) if last is not first else "-"
    return (
        f"| {size} | {layout} | {world} | {first.shard_size} | {gib(first.param_bytes)} | "
        f"{last_bytes} | {largest / 2**20:,.1f} | {gib(first.largest_unit_bytes)} | "
        f"{gib(first.build_peak)} | {seconds:.1f} |"
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
    parser.add_argument(
        "--max-local",
        type=float,
        default=3e9,
        help="skip FSDP2/HSDP cells whose rank holds more parameter elements than this, except "
        "at 1024 ranks (the default materializer's block draws take about 0.6 ms per 64 Ki "
        "elements of the rank's shard in a dry run)",
    )
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    lines = [
        "| model | layout | world | shard group | params, rank 0 (GiB) | params, last rank (GiB) "
        "| largest shard, rank 0 (MiB) | largest unit, full (GiB) | build peak, estimate (GiB) "
        "| dry run (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
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
        for layout, builder in LAYOUTS.items():
            for world in worlds:
                local = numel / (PER_NODE if layout == "HSDP" else world)
                if layout != "FSDP1" and local > args.max_local and world != 1024:
                    lines.append(
                        f"| {size} | {layout} | {world} | not run: {local / 1e9:.1f} G elements "
                        f"per rank, about {local / 65536 * 6e-4:.0f} s | | | | | | |"
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
        write_block(args.out, "table", lines)
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
