"""The move step: a unit's managed CPU states go to the compute device, each storage once;
ignored states stay where they are, and tied parameters stay one object."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_builder import WrapPolicy, plan_units, resolve_ignored
from fsdp_builder.runtime.tree import move_unit_states


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)
        self.aside = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(3))


def test_managed_states_move_once_and_ignored_ones_stay() -> None:
    model = Tied()
    model.norm.weight.grad = torch.ones(4)
    ignored = resolve_ignored(model, [model.aside])
    (root,) = plan_units(model, WrapPolicy(), ignored).units
    tied = model.embed.weight
    grad = model.norm.weight.grad.data_ptr()
    states = model.state_dict(keep_vars=True).values()
    storages = {id(t): t.untyped_storage().data_ptr() for t in states}
    # "cpu:0" stands in for a GPU: a device other than the plain CPU is a move (a copy).
    moved = move_unit_states(root, torch.device("cpu", 0))
    assert moved == 4 * (10 * 4 + 4 + 4 + 3)  # the tied weight counted once
    assert model.embed.weight is tied is model.head.weight
    now = {id(t): t.untyped_storage().data_ptr() for t in states}
    copied = {k for k in storages if now.get(k) != storages[k]}
    assert copied == {id(t) for t in (tied, model.norm.weight, model.norm.bias, model.scale)}
    assert model.norm.weight.grad is not None and model.norm.weight.grad.data_ptr() != grad
    assert move_unit_states(root, torch.device("cpu")) == 0
