"""One rank's reads of a safetensors folder, alone: each tensor's rows of rank ``r`` of ``W``
(the fully_shard layout) read into prefaulted tensors, by three ways, each in its own fresh
process, alternated:

- ``source``: the library's safetensors source (``read_into``: a copy from safe_open's mapping
  by ``get_slice``, the mapping's pages dropped after each run of rows);
- ``preadv``: positional reads of the rows' bytes straight into the tensor, at the offsets the
  file's header gives (written here, the floor of a rank-local read);
- ``pread_backend``: ``safe_open(..., backend="pread").get_slice(key)[rows]`` (safetensors
  0.8), then a copy into the tensor.

Per process: the median over ``--reads`` reads (after one unrecorded) of the reads' CPU and
wall seconds. ``source`` and ``preadv`` read only the rows' bytes; ``pread_backend`` reads each
whole tensor for any slice of it.

    python -m benchmarks.read_rows FOLDER [--pairs 3] [--reads 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WAYS = ("source", "preadv", "pread_backend")


def _rows(n: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-n // world)
    first = min(n, rank * per)
    return first, min(n, first + per)


def _where(path: Path, key: str, handles: dict[str, Any]) -> tuple[int, int]:
    """The open descriptor of ``path`` and the first byte of ``key`` in it (from the header)."""
    if str(path) not in handles:
        fd = os.open(path, os.O_RDONLY)
        length = int.from_bytes(os.pread(fd, 8, 0), "little")
        header = json.loads(os.pread(fd, length, 8))
        handles[str(path)] = (fd, 8 + length, header)
    fd, start, header = handles[str(path)]
    return fd, start + header[key]["data_offsets"][0]


def one_process(folder: Path, way: str, reads: int, world: int) -> dict[str, Any]:
    import torch
    from safetensors import safe_open

    import fsdp_builder.sources.hf_safetensors as hf

    index = next(folder.glob("*.index.json"))
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]

    def once(rank: int) -> tuple[float, float]:
        source = hf.open_index(index)
        jobs = []
        for key, meta in source.tensors().items():
            if meta.shape:
                first, stop = _rows(meta.shape[0], rank, world)
                out = torch.zeros((stop - first, *meta.shape[1:]), dtype=meta.dtype)
                jobs.append((key, first, stop, out))
        handles: dict[str, Any] = {}
        wall, cpu = time.perf_counter(), time.process_time()
        for key, first, stop, out in jobs:
            if way == "preadv":
                fd, begin = _where(folder / weight_map[key], key, handles)
                row = out[0].nbytes if len(out) else 0
                view = out.reshape(-1).view(torch.uint8).numpy().data
                done = 0
                while done < len(view):
                    done += os.preadv(fd, [view[done:]], begin + first * row + done)
            elif way == "pread_backend":
                name = weight_map[key]
                if name not in handles:
                    handles[name] = safe_open(str(folder / name), framework="pt", backend="pread")
                out.copy_(handles[name].get_slice(key)[first:stop])
            else:
                source.read_into(key, (slice(first, stop),), out)
        took = time.perf_counter() - wall, time.process_time() - cpu
        for handle in handles.values():
            if isinstance(handle, tuple):
                os.close(handle[0])
        source.close()
        return took

    once(0)
    got = [once(i % world) for i in range(reads)]
    return {
        "way": way,
        "seconds": statistics.median(g[0] for g in got),
        "cpu_seconds": statistics.median(g[1] for g in got),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--reads", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.folder, args.child, args.reads, args.world)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    for pair in range(args.pairs):
        for way in WAYS if pair % 2 == 0 else tuple(reversed(WAYS)):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.read_rows", str(args.folder), "--child", way,
                 "--reads", str(args.reads), "--world", str(args.world)],
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            runs[way].append(json.loads(out.strip().splitlines()[-1]))
    print("| way | CPU s, min\u2013median\u2013max | wall s, min\u2013median\u2013max |")
    print("|---|---|---|")
    for way, got in runs.items():
        cells = []
        for k in ("cpu_seconds", "seconds"):
            v = sorted(r[k] for r in got)
            cells.append(f"{v[0]:.3f}\u2013**{statistics.median(v):.3f}**\u2013{v[-1]:.3f}")
        print(f"| {way} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
