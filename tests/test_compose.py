"""Composition with torch.compile, activation checkpointing and tensor parallelism: each built
model against the same calls written out by hand (torchtitan's order: TP, activation
checkpointing, compile, ``fully_shard`` per unit, root last), compared on settings and losses.

Compile runs with the ``eager`` / ``aot_eager`` backends, which need no C compiler."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_builder import ConfigurationError, CPUDevice, FullyShardBuilder
from fsdp_builder.launch import run_ranks

DIM = 8
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.proj(x)).mean(-1, keepdim=True)


def new_net() -> Net:
    torch.manual_seed(0)
    return Net()


CLEAN_KEYS = list(new_net().state_dict())


def train(model: nn.Module, rank: int = 0, steps: int = STEPS) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, DIM, generator=gen), torch.randn(4, 1, generator=gen)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def settings(model: nn.Module) -> dict[str, Any]:
    """Structure, which modules are compiled and with what, FSDP units and their policies,
    parameter placements and state-dict keys."""
    compiled = {}
    for fqn, module in model.named_modules():
        impl = getattr(module, "_compiled_call_impl", None)
        if impl is not None:
            compiled[fqn] = type(module).__name__
    units = {}
    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            assert group is not None
            units[fqn] = (group.mp_policy, group.post_forward_mesh_info is not None)
    return {
        "structure": [(n, type(m).__name__) for n, m in model.named_modules()],
        "compiled": compiled,
        "units": units,
        "placements": {n: tuple(cast(DTensor, p).placements) for n, p in model.named_parameters()},
        "keys": list(model.state_dict()),
    }


# -- compile: scenarios --------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    # name: (compile kwargs, per_unit, activation checkpointing)
    "units_aot_eager": ({"backend": "aot_eager"}, True, False),
    "units_checkpointed": ({"backend": "aot_eager", "fullgraph": True}, True, True),
    "whole_model_eager": ({"backend": "eager", "dynamic": False}, False, False),
}


def built(name: str) -> nn.Module:
    kwargs, per_unit, checkpoint = SCENARIOS[name]
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block)
    if checkpoint:
        builder.activation_checkpointing(Block)
    builder.compile(per_unit=per_unit, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one rank: NO_SHARD
        return builder.build(new_net())


def by_hand(name: str, mesh: DeviceMesh) -> nn.Module:
    kwargs, per_unit, checkpoint = SCENARIOS[name]
    model = new_net()
    for i, block in enumerate(model.blocks):
        if checkpoint:
            block = model.blocks[i] = checkpoint_wrapper(block)
        if per_unit:
            block.compile(**kwargs)
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    if not per_unit:
        model.compile(**kwargs)
    return model


def compare(name: str, mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    torch._dynamo.reset()
    mine = built(name)
    hand = by_hand(name, mesh)
    return {
        "settings": (settings(mine), settings(hand)),
        "losses": (train(mine, rank), train(hand, rank)),
    }


def check(result: dict[str, Any], name: str) -> None:
    mine, hand = result["settings"]
    assert mine == hand
    assert mine["keys"] == CLEAN_KEYS
    assert mine["compiled"], name
    losses, hand_losses = result["losses"]
    assert losses == pytest.approx(hand_losses, abs=1e-5, rel=0)


@pytest.fixture
def mesh1(world1: None) -> Iterator[DeviceMesh]:
    yield init_device_mesh("cpu", (1,))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compile_matches_plain_calls(name: str, mesh1: DeviceMesh) -> None:
    result = compare(name, mesh1, 0)
    check(result, name)
    compiled = result["settings"][0]["compiled"]
    if SCENARIOS[name][1]:
        expected = "FSDPCheckpointWrapper" if SCENARIOS[name][2] else "FSDPBlock"
        assert compiled == {"blocks.0": expected, "blocks.1": expected}
    else:
        assert compiled == {"": "FSDPNet"}


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda b: b.compile(backend="eager", nonsense=1),
            r"takes no argument\(s\) \['nonsense'\]",
        ),
        (lambda b: b.compile(mode="default", options={"x": 1}), r"either mode or options"),
        (lambda b: b.compile(per_unit="yes"), r"per_unit.*expected a bool"),
        (lambda b: b.compile().compile(), r"already set"),
    ],
)
def test_compile_arguments_are_checked(call: Callable[[Any], Any], pattern: str) -> None:
    with pytest.raises(ConfigurationError, match=pattern):
        call(FullyShardBuilder())


def test_per_unit_compile_without_units_is_refused(world1: None) -> None:
    builder = FullyShardBuilder().device(CPUDevice()).compile(backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ConfigurationError, match=r"only the root.*per_unit=False"):
            builder.build(new_net())


# -- two ranks: one spawn for every compile scenario ---------------------------------------------


def compile_rank_main(world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out = {name: compare(name, mesh, dist.get_rank()) for name in SCENARIOS}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(compile_rank_main, 2, 2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compile_on_two_ranks_matches_plain_calls(
    name: str, two_ranks: list[dict[str, Any]]
) -> None:
    for result in two_ranks:
        check(result[name], name)
