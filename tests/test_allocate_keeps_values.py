"""Giving a module storage keeps the values of its states that were already real."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_builder.runtime.tree import allocate_empty


class _Holder(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.register_buffer("scale", torch.empty(3, device="meta"))


def test_a_real_dtensor_parameter_keeps_its_values_when_its_module_gets_storage(
    world1: None,
) -> None:
    mesh = init_device_mesh("cpu", (1,))
    values = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    module = _Holder(distribute_tensor(values.clone(), mesh, [Shard(0)]))
    param = module.weight

    allocate_empty([module], torch.device("cpu"), only_meta=False)

    assert module.weight is param  # a DTensor Parameter is swapped in place, not replaced
    assert torch.equal(module.weight.full_tensor(), values)  # type: ignore[attr-defined]
    assert not module.scale.is_meta


def test_a_real_plain_parameter_keeps_its_values_next_to_a_meta_buffer() -> None:
    values = torch.randn(4, 3)
    module = _Holder(values.clone())
    version = module.weight._version

    allocate_empty([module], torch.device("cpu"), only_meta=False)

    assert torch.equal(module.weight.detach(), values)
    # Keeping a value is no write: what judges "written" by version counters sees none.
    assert module.weight._version == version
    assert module.scale.shape == (3,) and not module.scale.is_meta
