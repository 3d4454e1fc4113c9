"""The per-unit move step: a unit's CPU states go to the compute device before sharding.

As FSDP does: only states on the CPU move (a state on another GPU is left for the compute device
check to report), ignored states stay; only the unit's own modules are walked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fsdp_builder.planning.ignored import IgnoredStates

CPU = torch.device("cpu")


def move_unit_states(
    modules: Sequence[nn.Module], ignored: IgnoredStates, device: torch.device
) -> int:
    """Move the CPU parameters (and their grads) and buffers ``modules`` register themselves
    (a unit's ``Unit.modules``) to ``device``. Returns the bytes moved."""
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
