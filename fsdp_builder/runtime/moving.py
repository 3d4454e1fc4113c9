"""The per-unit move step: a unit's CPU states go to the compute device before sharding.

As FSDP does: only states on the CPU move (a state on another GPU is left for the compute device
check to report), ignored states stay, and already-sharded children are not entered.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from fsdp_builder.planning.ignored import IgnoredStates, is_wrapped

CPU = torch.device("cpu")


def move_unit_states(module: nn.Module, ignored: IgnoredStates, device: torch.device) -> int:
    """Move the unit's own CPU parameters (and their grads) and buffers to ``device``.
    Returns the bytes moved."""
    if device == CPU:
        return 0
    ignored_buffers = {id(b) for b in ignored.buffers}
    params: list[nn.Parameter] = []
    buffers: list[torch.Tensor] = []
    queue = collections.deque([module])
    while queue:
        current = queue.popleft()
        params += [p for p in current.parameters(recurse=False) if p.device == CPU]
        buffers += [b for b in current.buffers(recurse=False) if b.device == CPU]
        queue.extend(c for c in current.children() if not is_wrapped(c))
    moved = 0
    with torch.no_grad():
        for p in params:
            if p in ignored.params:
                continue
            # Swap .data, as nn.Module._apply does, so optimizers and ties keep the same object.
            p.data = p.to(device)
            if p.grad is not None:
                p.grad.data = p.grad.to(device)
            moved += p.numel() * p.element_size()
        for b in buffers:
            if id(b) in ignored_buffers:
                continue
            b.data = b.to(device)
            moved += b.numel() * b.element_size()
    return moved
