"""The per-unit move step: as FSDP does, only a unit's non-ignored CPU states move (a state on
another GPU is left for the compute device check to report)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fsdp_builder.planning.ignored import IgnoredStates

CPU = torch.device("cpu")


def move_unit_states(
    modules: Sequence[nn.Module], ignored: IgnoredStates, device: torch.device
) -> int:
    """Move the CPU states (and grads) ``modules`` register to ``device``; returns bytes moved."""
    if device == CPU:
        return 0
    ignored_buffers = {id(b) for b in ignored.buffers}
    params = {id(p): p for m in modules for p in m._parameters.values() if p is not None}
    buffers = {id(b): b for m in modules for b in m._buffers.values() if b is not None}
    moved = 0
    with torch.no_grad():
        for p in params.values():
            if p.device != CPU or p in ignored.params:
                continue
            # Swap .data, as nn.Module._apply does, so optimizers and ties keep the same object.
            p.data = p.to(device)
            if p.grad is not None:
                p.grad.data = p.grad.to(device)
            moved += p.numel() * p.element_size()
        for b in buffers.values():
            if b.device != CPU or id(b) in ignored_buffers:
                continue
            b.data = b.to(device)
            moved += b.numel() * b.element_size()
    return moved
