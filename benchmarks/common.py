"""What a benchmark recipe is and what it returns; plain PyTorch, shared by every recipe."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from benchmarks.models import BenchConfig


@dataclass
class Job:
    """One rank's inputs: the model config, where to compute and, for load jobs, the source."""

    cfg: BenchConfig
    rank: int
    world_size: int
    device: torch.device
    seed: int = 0
    # Rank 0's full state dict for recipes that load or broadcast it; None on other ranks.
    source: dict[str, torch.Tensor] | None = None
    # A .safetensors file of the same weights that every rank can read, for checkpoint jobs.
    checkpoint: str | None = None
    # A torch.distributed.checkpoint folder of the same weights, for DCP jobs.
    dcp: str | None = None


@dataclass
class Outcome:
    """What a recipe hands back: the sharded model (None for communication floors), the bytes
    this rank sent or received where known, and seconds of named phases it timed itself."""

    module: nn.Module | None = None
    comm_bytes: int | None = None
    phases: dict[str, float] = field(default_factory=dict)
    phase_comm_bytes: dict[str, int] = field(default_factory=dict)
    # The largest communication buffer the recipe holds at once, where it has one.
    bucket_bytes: int | None = None
    # Of comm_bytes, those of floating-point tensors (weights), where counted.
    weight_comm_bytes: int | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    family: str  # "baseline" or "builder"
    job: str  # the job it does, for pairing a builder recipe with its baseline
    run: Callable[[Job], Outcome]
    description: str
    needs_source: bool = False
    # Every rank gets ``Job.checkpoint`` (written once per size before the measurements).
    needs_checkpoint: bool = False
    # Every rank gets ``Job.dcp``, a DCP folder of the same weights (written once per size).
    needs_dcp: bool = False
    # True when the gathered weights are a pure function of (config, seed): worth a checksum.
    deterministic: bool = False
    # Whether the recipe builds the model one unit at a time (for the memory target).
    per_unit: bool = False
    # Fallback for Outcome.bucket_bytes (for the streamed-load target).
    bucket_bytes: int = 0


# Collectives that carry tensors, by their names in torch.distributed (object collectives such
# as all_gather_object call these, so their bytes are counted through them). Barriers are not.
_COLLECTIVES = (
    "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "_all_gather_base", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip


def _tensor_bytes(value: Any) -> tuple[int, int]:
    """(all bytes, floating-point bytes) of the tensors in one collective's argument."""
    if isinstance(value, torch.Tensor):
        n = value.numel() * value.element_size()
        return n, n if value.is_floating_point() else 0
    if isinstance(value, dist.P2POp):
        return _tensor_bytes(value.tensor)
    if isinstance(value, list | tuple):
        pairs = [_tensor_bytes(v) for v in value]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return 0, 0


class CollectiveBytes:
    """Counts, while active, the bytes of tensors this rank hands to ``torch.distributed``
    collectives: per call, its largest tensor argument (the buffer sent or received; the list of
    chunks for a scatter or gather root), and separately those of floating-point tensors, which
    is where weights travel. Calls made inside a counted call (all_gather_object's size exchange
    and payload are counted once, through all_gather) are not counted twice.
    """

    def __init__(self) -> None:
        self.total = 0
        self.floating = 0
        self.calls = 0
        self._depth = threading.local()
        self._saved: list[tuple[ModuleType, str, Any]] = []

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                sizes = [_tensor_bytes(a) for a in (*args, *kwargs.values())]
                self.total += max((s[0] for s in sizes), default=0)
                self.floating += max((s[1] for s in sizes), default=0)
                self.calls += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> CollectiveBytes:
        for module in (dist, c10d):
            for name in _COLLECTIVES:
                fn = getattr(module, name, None)
                if fn is not None:
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved = []


def quartiles_cell(values: Sequence[float]) -> str:
    """``min - q1 - **median** - q3 - max`` of ``values``, two decimals (a table cell)."""
    q1, median, q3 = statistics.quantiles(values, n=4)
    return f"{min(values):.2f} - {q1:.2f} - **{median:.2f}** - {q3:.2f} - {max(values):.2f}"
