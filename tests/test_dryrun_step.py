"""The dry run's training-step peak against the measured peak of the same real step.

A small transformers Llama (the one of ``test_dryrun_memory``: about 29 M parameters,
vocabulary 4,001 so the shards are uneven) is built for real on gloo ranks and trained two
steps (forward, causal-LM loss, backward, optimizer step) on random tokens; the measured peak is
the kernel's high-water mark of the resident set (``VmHWM``) during the second step, reset by
writing 5 to ``/proc/self/clear_refs`` after the first, over the resident size before the build,
with glibc's mmap threshold fixed at 64 KiB (``mallopt(M_MMAP_THRESHOLD, 65536)``) so freed
tensors leave the resident set. A warm-up build and two steps of the same kind run first, so
lazy imports and first-call caches are not counted. The dry run builds the same builder and
model as each rank and runs the same two steps under torch's memory tracker. The expected
figures are measured, never computed by the library.

``python tests/test_dryrun_step.py`` prints the whole grid (both backends, SGD and AdamW, with
and without activation checkpointing and bf16 mixed precision, 2 and 4 ranks) for
``benchmarks/results/step_memory.md``; the test runs part of it.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from test_dryrun_memory import _resident, make_model
from torch import nn

from fsdp_builder import FSDPBuilder, FullyShardBuilder, ResetParameters, ShardingBuilder
from fsdp_builder.tools.dryrun import RankRun, simulate
from fsdp_builder.tools.launch import run_ranks

# Five real 2-rank builds and steps, each after a warm-up, then their dry runs: about two
# minutes on 2 busy cores; the hang guards leave room for a slower machine.
pytestmark = pytest.mark.timeout(600)

BATCH, SEQ = 2, 128
VOCAB = 4001
# The dry run's figure against the measured one: a figure off by 2x (or by half) fails.
TOLERANCE = 0.10


class Case(NamedTuple):
    backend: str
    optimizer: str
    checkpointing: bool
    bf16: bool
    # "default": the builder's own initializer (FSDP2: StreamInit; FSDP1: ResetParameters).
    init: str = "default"

    @property
    def label(self) -> str:
        extras = [x for x, on in (("AC", self.checkpointing), ("bf16 MP", self.bf16)) if on]
        init = [] if self.init == "default" else [f"{self.init} init"]
        return " + ".join([self.backend, self.optimizer, *extras, *init])


GRID = [
    Case(*c)
    for c in itertools.product(("fsdp2", "fsdp1"), ("sgd", "adamw"), (False, True), (False, True))
] + [
    Case("fsdp2", optimizer, True, bf16, "ResetParameters")
    for optimizer in ("sgd", "adamw")
    for bf16 in (False, True)
]
# What the suite measures each time: every option at least once, on both backends.
CHECKED = [
    Case("fsdp2", "adamw", False, False),
    Case("fsdp2", "sgd", False, True),
    Case("fsdp2", "sgd", True, False),
    Case("fsdp1", "adamw", True, False),
    Case("fsdp1", "sgd", False, True),
]


def make_builder(case: Case) -> ShardingBuilder:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    builder = (FullyShardBuilder() if case.backend == "fsdp2" else FSDPBuilder()).wrap(
        LlamaDecoderLayer
    )
    if case.checkpointing:
        builder.activation_checkpointing(LlamaDecoderLayer)
    if case.bf16:
        builder.mixed_precision(param_dtype=torch.bfloat16)
    if case.init == "ResetParameters":
        builder.materialize(ResetParameters())
    return builder


def make_optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params)  # type: ignore[arg-type]
    return torch.optim.SGD(params, lr=1e-3)  # type: ignore[arg-type]


def loss_of(model: nn.Module, generator: torch.Generator | None = None) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, clear_after_first: bool) -> None:
    generator = torch.Generator().manual_seed(dist.get_rank())
    for first in (True, False):
        loss_of(model, generator).backward()
        optimizer.step()
        optimizer.zero_grad()
        if first and clear_after_first:
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark restarts from the resident size now


def measure_step(case: Case) -> int:
    """On each rank: the resident bytes above the level before the build at the second step's
    peak (see the module docstring)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
    for measured in (False, True):
        with torch.device("meta"):
            model = make_model(torch.float32)
        gc.collect()
        dist.barrier()
        before = _resident("VmRSS:")
        built = make_builder(case).build(model)
        optimizer = make_optimizer(case.optimizer, built.parameters())
        _steps(built, optimizer, clear_after_first=measured)
        peak = _resident("VmHWM:") - before
        del built, optimizer, model
    return peak


def measure_all(cases: list[Case]) -> list[int]:
    """On each rank: every case's measured peak, one after another (one start of the ranks)."""
    return [measure_step(case) for case in cases]


def dry_peaks(case: Case, world: int) -> list[RankRun]:
    def optimizer(params: object) -> torch.optim.Optimizer:
        return make_optimizer(case.optimizer, params)

    run = simulate(
        lambda: make_builder(case),
        lambda: make_model(torch.float32),
        world,
        ranks=range(world),
        step=loss_of,
        optimizer=optimizer,
    )
    assert all(r.ok and r.step_peak for r in run.runs), [(r.error, r.step_note) for r in run.runs]
    return list(run.runs)


def compare(
    cases: list[Case], world: int, timeout: float = 540
) -> list[list[tuple[int, int, RankRun]]]:
    """Per case, per rank: (dry-run step peak, measured peak, the dry run's rank)."""
    measured = run_ranks(measure_all, world, cases, timeout=timeout)
    out = []
    for i, case in enumerate(cases):
        runs = dry_peaks(case, world)
        out.append(
            [
                (int((r.step_peak or {})["total"]), per_rank[i], r)
                for r, per_rank in zip(runs, measured, strict=True)
            ]
        )
    return out


@pytest.fixture(scope="module")
def checked() -> list[list[tuple[int, int, RankRun]]]:
    return compare(CHECKED, 2)


@pytest.mark.parametrize("index", range(len(CHECKED)), ids=[c.label for c in CHECKED])
def test_step_peak_is_the_measured_one(
    index: int, checked: list[list[tuple[int, int, RankRun]]]
) -> None:
    for rank, (dry, real, run) in enumerate(checked[index]):
        assert abs(dry - real) <= TOLERANCE * real, (CHECKED[index].label, rank, dry, real)
        # The step holds at least the rank's shards and, with AdamW, two states of each.
        states = 2 if CHECKED[index].optimizer == "adamw" else 0
        assert dry >= (1 + states) * run.param_bytes, (rank, dry, run.param_bytes)


def test_the_options_change_the_measured_peak(
    checked: list[list[tuple[int, int, RankRun]]],
) -> None:
    # The grid's options are seen by the real runs, so agreeing with them means something:
    # AdamW's states and full activations cost more than SGD with bf16 or checkpointing.
    def measured(case: Case) -> int:
        return checked[CHECKED.index(case)][0][1]

    adamw = measured(Case("fsdp2", "adamw", False, False))
    sgd_bf16 = measured(Case("fsdp2", "sgd", False, True))
    sgd_ac = measured(Case("fsdp2", "sgd", True, False))
    assert adamw > 1.3 * sgd_bf16 and adamw > 1.3 * sgd_ac, (adamw, sgd_bf16, sgd_ac)


def table_rows(worlds: tuple[int, ...] = (2, 4)) -> list[str]:
    """The rows of benchmarks/results/step_memory.md."""
    lines = [
        "| case | ranks | rank | parameters (MiB) | dry run (MiB) | measured (MiB) "
        "| dry run / measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for world in worlds:
        for case, pairs in zip(GRID, compare(GRID, world, timeout=3600), strict=True):
            for rank, (dry, real, run) in enumerate(pairs):
                lines.append(
                    f"| {case.label} | {world} | {rank} | {run.param_bytes / 2**20:.2f} "
                    f"| {dry / 2**20:.2f} | {real / 2**20:.2f} | {dry / real:.3f} |"
                )
                print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    table_rows()
