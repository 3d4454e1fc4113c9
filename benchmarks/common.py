"""What a benchmark recipe is and what it returns; plain PyTorch, shared by every recipe."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
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
    # True when the gathered weights are a pure function of (config, seed): worth a checksum.
    deterministic: bool = False
    # Whether the recipe builds the model one unit at a time (for the memory target).
    per_unit: bool = False
    # Fallback for Outcome.bucket_bytes (for the streamed-load target).
    bucket_bytes: int = 0
