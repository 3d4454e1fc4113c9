"""The dry run's build peak against the measured peak of the same real build.

A small transformers Llama (about 30 M parameters, vocabulary 4,001 so the shards are uneven)
is built for real on 2 gloo ranks and, in a dry run, as each of the same 2 ranks; the real
build's peak is the kernel's high-water mark of the resident set (``VmHWM``, reset by writing
5 to ``/proc/self/clear_refs`` just before the build) over the level then, with glibc's mmap
threshold fixed at 64 KiB (``mallopt(M_MMAP_THRESHOLD, 65536)``, as ``MALLOC_MMAP_THRESHOLD_=
65536`` sets it): every tensor but the smallest is a mapping of its own, whose pages leave the
resident set when freed, so the high-water mark is the tensors' bytes. The expected figures are
measured, never computed by the library.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_builder import (
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    ResetParameters,
    ShardingBuilder,
    StreamInit,
)
from fsdp_builder.tools.dryrun import RankRun, simulate
from fsdp_builder.tools.launch import run_ranks

WORLD = 2
# The dry run's figure against the measured one: a figure off by 2x (or by half) fails.
TOLERANCE = 0.10


def llama_config(dtype: torch.dtype) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=4001, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
        dtype=dtype,
    )  # fmt: skip


def make_model(dtype: torch.dtype) -> LlamaForCausalLM:
    model = LlamaForCausalLM(llama_config(dtype))
    nn.Module.to(model, dtype)  # in place, as the model's own .to does
    return model


def make_builder(backend: str, materializer: str, folder: str | None) -> ShardingBuilder:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    builder = (FullyShardBuilder() if backend == "fsdp2" else FSDPBuilder()).wrap(LlamaDecoderLayer)
    if materializer == "checkpoint":
        assert folder is not None
        return builder.materialize(FromCheckpoint(folder))
    if materializer == "stream":
        return builder.materialize(StreamInit())
    return builder.materialize(ResetParameters())


def _resident(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def measure_build(backend: str, materializer: str, folder: str | None, dtype_name: str) -> int:
    """On each rank: the resident bytes the real build adds at its peak (see the docstring)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
    dtype = getattr(torch, dtype_name)
    # A first build of the same kind, so lazy imports and first-call caches are not counted.
    with torch.device("meta"):
        warm = make_model(dtype)
    make_builder(backend, materializer, folder).build(warm)
    del warm
    with torch.device("meta"):
        model = make_model(dtype)
    gc.collect()
    dist.barrier()
    before = _resident("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the resident size now
    built = make_builder(backend, materializer, folder).build(model)
    peak = _resident("VmHWM:") - before
    del built
    return peak


def measure_all(folders: dict[str, str]) -> dict[tuple[str, str, str], int]:
    """On each rank: every case's measured peak, one build after another (one start of the
    ranks for all of them)."""
    return {
        (b, m, d): measure_build(b, m, folders[d] if m == "checkpoint" else None, d)
        for b, m, d in CASES
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for name in ("float32", "bfloat16"):
        folder = tmp_path_factory.mktemp(f"llama_{name}")
        torch.manual_seed(0)
        make_model(getattr(torch, name)).save_pretrained(folder)
        out[name] = str(folder)
    return out


def dry_peaks(
    backend: str, materializer: str, folder: str | None, dtype: torch.dtype
) -> list[RankRun]:
    run = simulate(
        lambda: make_builder(backend, materializer, folder),
        lambda: make_model(dtype),
        WORLD,
        ranks=range(WORLD),
    )
    assert all(r.ok for r in run.runs), [r.error for r in run.runs]
    return list(run.runs)


CASES = [
    ("fsdp2", "checkpoint", "float32"),
    ("fsdp2", "checkpoint", "bfloat16"),
    ("fsdp1", "checkpoint", "float32"),
    ("fsdp1", "checkpoint", "bfloat16"),
    ("fsdp2", "stream", "float32"),
    ("fsdp2", "stream", "bfloat16"),
    ("fsdp1", "reset", "float32"),
    ("fsdp1", "reset", "bfloat16"),
]


Measured = list[dict[tuple[str, str, str], int]]


@pytest.fixture(scope="module")
def measured(folders: dict[str, str]) -> Measured:
    return run_ranks(measure_all, WORLD, folders, timeout=600)


def compare(
    case: tuple[str, str, str], folders: dict[str, str], measured: Measured
) -> list[tuple[int, int, int]]:
    """Per rank: (dry-run build peak, measured peak, the rank's parameter bytes)."""
    backend, materializer, dtype_name = case
    folder = folders[dtype_name] if materializer == "checkpoint" else None
    runs = dry_peaks(backend, materializer, folder, getattr(torch, dtype_name))
    real = [per_rank[case] for per_rank in measured]
    return [(r.build_peak or 0, m, r.param_bytes) for r, m in zip(runs, real, strict=True)]


@pytest.mark.parametrize(("backend", "materializer", "dtype_name"), CASES)
def test_build_peak_is_the_measured_one(
    backend: str, materializer: str, dtype_name: str, folders: dict[str, str], measured: Measured
) -> None:
    pairs = compare((backend, materializer, dtype_name), folders, measured)
    for rank, (dry, real, params) in enumerate(pairs):
        assert dry >= params, (rank, dry, params)
        assert abs(dry - real) <= TOLERANCE * real, (rank, dry, real)


def test_a_figure_off_by_two_fails_the_tolerance() -> None:
    # The tolerance tells a right figure from one off by the factor of the errors it guards.
    for measured in (1 << 20, 300 << 20):
        assert abs(2 * measured - measured) > TOLERANCE * measured
        assert abs(measured // 2 - measured) > TOLERANCE * measured


def table_rows(folders: dict[str, str]) -> list[str]:
    """The rows of benchmarks/results/dryrun_memory.md."""
    lines = [
        "| materializer | backend | dtype | rank | parameters (MiB) | dry run (MiB) "
        "| measured (MiB) | dry run / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    measured = run_ranks(measure_all, WORLD, folders, timeout=600)
    for backend, materializer, dtype_name in CASES:
        pairs = compare((backend, materializer, dtype_name), folders, measured)
        for rank, (dry, real, params) in enumerate(pairs):
            lines.append(
                f"| {materializer} | {backend} | {dtype_name} | {rank} | {params / 2**20:.2f} "
                f"| {dry / 2**20:.2f} | {real / 2**20:.2f} | {dry / real:.3f} |"
            )
            print(lines[-1], flush=True)
    return lines


def main(out: Callable[[list[str]], None] | None = None) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name in ("float32", "bfloat16"):
            folder = Path(tmp) / name
            torch.manual_seed(0)
            make_model(getattr(torch, name)).save_pretrained(folder)
            folders[name] = str(folder)
        lines = table_rows(folders)
    if out is not None:
        out(lines)


if __name__ == "__main__":
    main()
