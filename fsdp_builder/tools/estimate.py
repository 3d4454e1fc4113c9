"""Per-rank training memory from a unit plan, without any process group or forward.

Shard layouts are the backend object's (``Backend.kept_bytes``): FSDP1 pads a unit's flat
parameter to a multiple of the shard group, FSDP2 pads each parameter's dim 0. Buffers are on
every rank. A build's peak is not estimated here: the dry run (``fsdp_builder.tools.dryrun``,
``fsdp-builder plan ... --simulate WORLD``) measures it in the build itself.

Training estimates (:func:`training_estimate`) add gradients, optimizer states, and the
parameters and gradients gathered for compute (in the compute dtype under mixed precision); not
activations, which depend on the batch, the sequence length and activation checkpointing. The
dry run's ``--step`` measures a step with activations, where the command line can make the
model's inputs (a transformers folder); this estimate needs only the plan.
"""

from __future__ import annotations

import torch
from attrs import asdict, frozen

from fsdp_builder.backends.registry import BACKENDS as REGISTERED
from fsdp_builder.backends.registry import backend_named
from fsdp_builder.errors import ConfigurationError
from fsdp_builder.groups import AutoHybridGroups
from fsdp_builder.planning.plan import Unit, UnitPlan

BACKENDS = tuple(REGISTERED)
STRATEGIES = ("full", "grad_op", "hybrid", "none")
MIB = 1024 * 1024


def local_node_size(world_size: int) -> int:
    """Ranks per node when a single machine stands in for several (the demo's CPU ranks):
    nodes of 2 when the world is even and larger than 2, else one node."""
    return 2 if world_size % 2 == 0 and world_size > 2 else world_size


def hybrid_shard_size(world_size: int, devices_per_node: int | None = None) -> int:
    """Ranks per shard group under hybrid sharding: what ``AutoHybridGroups`` would resolve
    (the given devices per node, else the CUDA device count, else ``LOCAL_WORLD_SIZE``) when it
    divides the world, else ``local_node_size``."""
    try:
        n = AutoHybridGroups(devices_per_node=devices_per_node).resolved_devices_per_node()
    except ConfigurationError:
        return local_node_size(world_size)
    return n if n <= world_size and world_size % n == 0 else local_node_size(world_size)


def shard_size(world_size: int, strategy: str, devices_per_node: int | None = None) -> int:
    """How many ranks one parameter is split over."""
    if strategy == "none" or world_size <= 1:
        return 1
    if strategy == "hybrid":
        return hybrid_shard_size(world_size, devices_per_node)
    return world_size


# torch.optim's states per parameter, each of the parameter's dtype and shape (Adam's step
# counters are scalars and not counted).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACTIVATIONS = "not estimated (they depend on batch size, sequence length and checkpointing)"


@frozen
class TrainingEstimate:
    """Bytes one rank holds during a training step, activations excepted."""

    backend: str
    strategy: str
    shard_size: int
    optimizer: str
    param_dtype: str | None  # the mixed-precision compute dtype; None: none
    # The rank's parameter shards in the model's dtype (the full-precision master weights under
    # mixed precision).
    params: int
    buffers: int
    # Sharded like the parameters, in their dtype.
    gradients: int
    optimizer_states: int
    # Parameters all-gathered for compute, in the compute dtype: the root unit (kept gathered
    # between forward and backward) and the two largest other units (the one computing and the
    # one prefetched); every unit under grad_op, which keeps them gathered after forward.
    gathered_params: int
    # The full gradients of the largest unit before they are reduce-scattered.
    gathered_gradients: int

    @property
    def total(self) -> int:
        held = (self.params, self.buffers, self.gradients, self.optimizer_states)
        return sum(held) + self.gathered_params + self.gathered_gradients

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "total": self.total, "activations": ACTIVATIONS}


def _compute_bytes(unit: Unit, dtype: torch.dtype | None) -> int:
    """A unit's parameters unsharded, cast to ``dtype`` (floating ones only) when given."""
    if dtype is None:
        return unit.param_bytes
    return sum(
        p.numel * (dtype if p.dtype.is_floating_point else p.dtype).itemsize for p in unit.params
    )


def training_estimate(
    plan: UnitPlan,
    world_size: int,
    strategy: str = "full",
    backend: str = "fsdp1",
    optimizer: str = "adamw",
    param_dtype: str | None = None,
    devices_per_node: int | None = None,
) -> TrainingEstimate:
    """Per-rank training memory for ``plan`` (see the module docstring for what is counted)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigurationError(
            f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_STATES)}"
        )
    if param_dtype is not None and param_dtype not in PARAM_DTYPES:
        raise ConfigurationError(
            f"unknown param dtype {param_dtype!r}; expected one of {', '.join(PARAM_DTYPES)}"
        )
    shards = shard_size(world_size, strategy, devices_per_node)
    layout = backend_named(backend)
    params = sum(layout.kept_bytes(u, shards) for u in plan)
    buffers = sum(u.buffer_bytes for u in plan)
    dtype = PARAM_DTYPES[param_dtype] if param_dtype is not None else None
    mixed = dtype is not None and any(
        p.dtype.is_floating_point and p.dtype != dtype for u in plan for p in u.params
    )
    gathered = gathered_grads = 0
    if shards > 1 or mixed:
        compute = [_compute_bytes(u, dtype) for u in plan]
        if strategy == "grad_op":
            gathered = sum(compute)
        else:
            others = sorted(compute[:-1], reverse=True)
            gathered = compute[-1] + sum(others[:2])
        gathered_grads = max(compute, default=0) if shards > 1 else 0
    return TrainingEstimate(
        backend=backend,
        strategy=strategy,
        shard_size=shards,
        optimizer=optimizer,
        param_dtype=param_dtype,
        params=params,
        buffers=buffers,
        gradients=params,
        optimizer_states=OPTIMIZER_STATES[optimizer] * params,
        gathered_params=gathered,
        gathered_gradients=gathered_grads,
    )


def format_training(e: TrainingEstimate, world_size: int) -> str:
    dtype = e.param_dtype or "none"
    gathered = "every unit (grad_op)" if e.strategy == "grad_op" else "root + 2 largest units"
    rows = [
        ("parameters (sharded; the master weights under mixed precision)", e.params),
        ("buffers (every rank)", e.buffers),
        ("gradients (sharded like the parameters)", e.gradients),
        (
            f"optimizer states ({e.optimizer}: {OPTIMIZER_STATES[e.optimizer]} per parameter)",
            e.optimizer_states,
        ),
        (f"parameters gathered for compute ({gathered})", e.gathered_params),
        ("gradients of the largest unit before reduce-scatter", e.gathered_gradients),
    ]
    lines = [
        f"training memory per rank: {e.backend} {e.strategy} at world size {world_size} "
        f"(shards of {e.shard_size}), optimizer {e.optimizer}, param dtype {dtype} (MiB):"
    ]
    lines += [f"  {label:<66} {n / MIB:>12,.2f}" for label, n in rows]
    lines.append(f"  {'total':<66} {e.total / MIB:>12,.2f}")
    lines.append(f"  activations: {ACTIVATIONS}")
    return "\n".join(lines)
