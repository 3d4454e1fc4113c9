"""Planted faults for the conformance judge: wrong results it must report wrong.

A few cells of the matrix (``conformance.py``) run once, honestly; each fault then changes one
thing in a copy of the ranks' results, as a defect of the library would, and the judge
(:func:`conformance.judge`, :func:`conformance.judge_across`) must call the result wrong. The
honest results must still pass, so a judge that rejects everything fails too.

``python tests/judge_faults.py --out benchmarks/results/judge_faults.md`` writes the table of
fault, cell and verdict.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from conformance import (
    Cell,
    Drawn,
    Expected,
    anchors,
    eager,
    expected,
    judge,
    judge_across,
    rank_cells,
    real_states,
    reference_step,
    states_of,
    variant,
    write_checkpoints,
)

Results = list[dict[str, Any]]  # one cell's result per rank, as ``run_cell`` returns it


def _cell(materializer: str, synchronizer: str, state: str, backend: str = "fsdp2") -> Cell:
    return Cell(backend, materializer, synchronizer, state, "default", 2, "net", "none")


RESET = _cell("ResetParameters", "none", "meta")
DETERMINISTIC = _cell("DeterministicInit", "none", "meta")
STREAM = _cell("StreamInit", "none", "meta", backend="fsdp1")
LOAD = _cell("FromCheckpoint", "none", "meta")
BROADCAST = _cell("KeepAsIs", "BroadcastFromRank0", "differ")
APART = _cell("KeepAsIs", "none", "differ")
REFUSED = _cell("KeepAsIs", "none", "meta")
CELLS = [RESET, DETERMINISTIC, STREAM, LOAD, BROADCAST, APART, REFUSED]
ANCHORS = [c for c in anchors() if c.model == "net" and c.ignore == "none"]


class Fault(NamedTuple):
    """``plant`` changes the results in place. A fault in the built states (``before_step``)
    is carried through the training step as plain PyTorch takes it, so the step agrees with
    the planted states and only the check that the fault is aimed at can see it."""

    name: str
    cell: Cell
    plant: Callable[[Cell, Expected, Results], None]
    before_step: bool = True


def _drawn_names(want: Expected) -> list[str]:
    return [n for n, v in want.values[0].items() if isinstance(v, Drawn)]


def _rows(value: torch.Tensor, rank: int, world: int) -> slice:
    """The dim-0 rows ``fully_shard`` gives ``rank`` (``torch.chunk``'s split)."""
    sizes = [len(c) for c in value.chunk(world)] + [0] * world
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def zeros(cell: Cell, want: Expected, ranks: Results) -> None:
    for result in ranks:
        for name in _drawn_names(want):
            result["full"][name] = torch.zeros_like(result["full"][name])


def scaled(cell: Cell, want: Expected, ranks: Results) -> None:
    for result in ranks:
        for name in _drawn_names(want):
            result["full"][name] = result["full"][name] * 3


def another_seed(cell: Cell, want: Expected, ranks: Results) -> None:
    other = states_of(eager(variant(cell), 999))
    for result in ranks:
        for name in _drawn_names(want):
            result["full"][name] = other[name].clone()


def shards_swapped(cell: Cell, want: Expected, ranks: Results) -> None:
    """One drawn weight with its two halves of rows exchanged: the same numbers, drawn for
    the other shard, as a world-size- or backend-dependent stream would give them."""
    name = "blocks.0.lin.weight"
    for result in ranks:
        value = result["full"][name]
        result["full"][name] = torch.cat([value[4:], value[:4]])


def bfloat16(cell: Cell, want: Expected, ranks: Results) -> None:
    for result in ranks:
        result["full"]["odd.weight"] = result["full"]["odd.weight"].to(torch.bfloat16)


def norm_defaults(cell: Cell, want: Expected, ranks: Results) -> None:
    for result in ranks:
        full = result["full"]
        full["bn.running_mean"] = torch.zeros_like(full["bn.running_mean"])
        full["bn.running_var"] = torch.ones_like(full["bn.running_var"])
        full["bn.num_batches_tracked"] = torch.zeros_like(full["bn.num_batches_tracked"])


def _own(cell: Cell, rank: int) -> dict[str, torch.Tensor]:
    mine = real_states(cell, rank)
    return {n: v for n, v in mine.items() if v is not None}


def buffers_skipped(cell: Cell, want: Expected, ranks: Results) -> None:
    own = _own(cell, 1)
    for name in ("bn.running_mean", "bn.running_var"):
        ranks[1]["full"][name] = own[name].clone()


def one_tensor_skipped(cell: Cell, want: Expected, ranks: Results) -> None:
    """``odd.weight`` not sent: its full value holds rank 1's own rows where rank 1 shards it."""
    own = _own(cell, 1)["odd.weight"]
    rows = _rows(own, 1, cell.world)
    for result in ranks:
        result["full"]["odd.weight"][rows] = own[rows]


def one_rank_skipped(cell: Cell, want: Expected, ranks: Results) -> None:
    """Rank 1 never received: its rows of every parameter and its buffers are its own."""
    own = _own(cell, 1)
    buffers = {n for n, _ in eager("net1", 0).named_buffers()}
    for name, value in own.items():
        if name in buffers:
            ranks[1]["full"][name] = value.clone()
        elif value.dim() > 0:
            rows = _rows(value, 1, cell.world)
            for result in ranks:
                result["full"][name][rows] = value[rows]


def tie_broken(cell: Cell, want: Expected, ranks: Results) -> None:
    for result in ranks:
        result["full"]["head.weight"] = result["full"]["embed.weight"].clone()


def replica_differs(cell: Cell, want: Expected, ranks: Results) -> None:
    ranks[1]["full"]["blocks.1.lin.weight"] = ranks[1]["full"]["blocks.1.lin.weight"] + 1e-3


def shard_differs(cell: Cell, want: Expected, ranks: Results) -> None:
    name = sorted(ranks[1]["local"])[0]
    shard, plain = ranks[1]["local"][name]
    changed = shard.clone()
    changed.view(-1)[0] += 1
    ranks[1]["local"][name] = (changed, plain)


def step_off(cell: Cell, want: Expected, ranks: Results) -> None:
    for result in ranks:
        result["post"]["blocks.0.lin.weight"][0, 0] += 1e-3


def loss_off(cell: Cell, want: Expected, ranks: Results) -> None:
    for result in ranks:
        result["loss"] += 0.1


def wrong_type(cell: Cell, want: Expected, ranks: Results) -> None:
    for result in ranks:
        result["error"] = "RuntimeError: " + result["error"].partition(": ")[2]


def model_changed(cell: Cell, want: Expected, ranks: Results) -> None:
    ranks[1]["untouched"] = False


def after_collective(cell: Cell, want: Expected, ranks: Results) -> None:
    ranks[0]["collectives"] = ["broadcast"]


def one_rank_built(cell: Cell, want: Expected, ranks: Results) -> None:
    ranks[1].update(error=None, untouched=False, collectives=[])


FAULTS = [
    Fault("random draws replaced by zeros", RESET, zeros),
    Fault("random draws from a wrong distribution (3x the scale)", RESET, scaled),
    Fault("DeterministicInit draws from another seed", DETERMINISTIC, another_seed),
    Fault("DeterministicInit values that depend on the world size", DETERMINISTIC, shards_swapped),
    Fault("StreamInit values that depend on the backend", STREAM, shards_swapped),
    Fault("a state returned in another dtype (bf16)", LOAD, bfloat16),
    Fault("BatchNorm statistics left at their defaults", LOAD, norm_defaults),
    Fault("a synchronizer that skips buffers", BROADCAST, buffers_skipped),
    Fault("a synchronizer that skips one tensor", BROADCAST, one_tensor_skipped),
    Fault("a synchronizer that skips one rank", BROADCAST, one_rank_skipped),
    Fault("a tie broken", LOAD, tie_broken),
    Fault("one rank's replica of a parameter different", DETERMINISTIC, replica_differs),
    Fault("one rank's local shard different", APART, shard_differs),
    Fault("a post-step parameter off by 1e-3", RESET, step_off, before_step=False),
    Fault("the training step's loss not plain PyTorch's", LOAD, loss_off, before_step=False),
    Fault("a refusal of the wrong type", REFUSED, wrong_type),
    Fault("a refusal after the model changed", REFUSED, model_changed),
    Fault("a refusal after a collective outside the agreement", REFUSED, after_collective),
    Fault("a refusal on one rank while the other builds", REFUSED, one_rank_built),
]


def honest_results(folder: Path, timeout: float = 600) -> dict[Cell, Results]:
    """Every cell of :data:`CELLS` and :data:`ANCHORS`, run once (one spawn per world size)."""
    from isolated import Spawns, values

    paths = write_checkpoints(folder)
    spawns = Spawns(rank_cells, timeout=timeout)
    out = {}
    for world in (1, 2):
        cells = [c for c in CELLS + ANCHORS if c.world == world]
        ran = spawns(world, [(c, expected(c).local) for c in cells], paths)
        for c in cells:
            out[c] = values(ran, c.key)
    return out


def verdict(fault: Fault, honest: dict[Cell, Results]) -> str | None:
    """The judge's verdict on the fault's cell once the fault is planted (None: judged right)."""
    want = expected(fault.cell)
    planted = copy.deepcopy(honest[fault.cell])
    fault.plant(fault.cell, want, planted)
    if fault.before_step and not want.refusals:
        for result, (loss, after) in zip(planted, reference_step(fault.cell, planted), strict=True):
            result.update(loss=loss, post=after)
    found = judge(fault.cell, want, planted)
    if found is not None:
        return found
    judged: dict[Cell, tuple[Expected, Results | None]] = {
        c: (expected(c), planted if c == fault.cell else results) for c, results in honest.items()
    }
    return judge_across(judged).get(fault.cell)


def table(honest: dict[Cell, Results]) -> str:
    lines = [
        "# The conformance judge against planted faults",
        "",
        "`python tests/judge_faults.py` (the same faults run in the default test command, "
        "`tests/test_judge_faults.py`). Each fault changes one thing in a copy of honest "
        "results of one cell, as a defect of the library would; the judge must report it. "
        "The honest results of every cell are judged right.",
        "",
        "| fault | cell | judge's verdict |",
        "|---|---|---|",
    ]
    for fault in FAULTS:
        found = verdict(fault, honest)
        shown = "**accepted (missed)**" if found is None else found.replace("|", "\\|")
        lines.append(f"| {fault.name} | `{fault.cell.key}` | {shown} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse
    import sys
    import tempfile

    parser = argparse.ArgumentParser(description="Feed the conformance judge planted faults.")
    parser.add_argument("--out", type=Path, default=None, help="write the table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        text = table(honest_results(Path(folder)))
    if args.out is not None:
        args.out.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
