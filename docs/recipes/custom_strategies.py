"""Your own Materializer, GroupFactory and StateSynchronizer, by subclassing the base classes.

    torchrun --nproc-per-node 2 docs/recipes/custom_strategies.py

- ``NameSeededInit(BaseMaterializer)``: ``init_module`` fills each module's own parameters from a
  generator seeded by the parameter's name, so every rank (and every world size) draws the same
  values without any communication.
- ``OwnGroup(BaseGroupFactory)``: ``create`` makes a new process group of all ranks, so the
  sharded model's collectives run on a communicator of their own.
- ``ChecksumReplicas(BaseSynchronizer)``: ``synchronize`` all-gathers one checksum per unit and
  raises ``StateMismatchError`` on every rank when ranks hold different values.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import ShardingStrategy

from fsdp_builder import (
    BaseGroupFactory,
    BaseMaterializer,
    BaseSynchronizer,
    ConfigurationError,
    Environment,
    FSDPBuilder,
    ProcessGroups,
    StateMismatchError,
    Unit,
)
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.tools.launch import end_process_group


class NameSeededInit(BaseMaterializer):
    """N(0, std) weights from a per-name seed; biases zero; norm weights one."""

    def __init__(self, seed: int = 0, std: float = 0.02) -> None:
        self.seed, self.std = seed, std
        self.initialized: list[str] = []

    def init_module(self, module: nn.Module, fqn: str) -> None:
        # Called under torch.no_grad(), storage already on the compute device.
        for name, param in module.named_parameters(recurse=False):
            full_name = f"{fqn}.{name}" if fqn else name
            if name == "bias":
                param.zero_()
            elif isinstance(module, nn.LayerNorm):
                param.fill_(1.0)
            else:
                gen = torch.Generator().manual_seed(self.seed + zlib.crc32(full_name.encode()))
                param.copy_(torch.randn(param.shape, generator=gen) * self.std)
        self.initialized.append(fqn or "<root>")


class OwnGroup(BaseGroupFactory):
    """Shard over a new group of all ranks."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None

    def check_context(self, context: ConfigureContext) -> None:
        # Local and before any collective: refuse what this factory cannot serve.
        strategy = context.options.strategy
        if "HYBRID" in strategy.name:
            raise ConfigurationError(f"OwnGroup cannot serve {strategy.name}: no replicate group")

    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        # Collective: every rank creates the same group, in the same order.
        self.group = dist.new_group(ranks=list(range(dist.get_world_size())))
        return ProcessGroups(shard_group=self.group)


class ChecksumReplicas(BaseSynchronizer):
    """Before each unit is sharded, compare its values across the shard group."""

    def __init__(self) -> None:
        self.checked: list[str] = []

    def synchronize(self, unit: Unit, env: Environment) -> int:
        prefix = f"{unit.fqn}." if unit.fqn else ""
        own = {info.name.removeprefix(prefix) for info in unit.params}
        states = [p for n, p in unit.module.named_parameters() if n in own]
        local = torch.stack([p.detach().double().sum() for p in states]).sum().reshape(1)
        group = env.groups.shard_group
        sums = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sums, local.to(env.device), group=group)
        if any(not torch.equal(s.cpu(), sums[0].cpu()) for s in sums):
            # Every rank sees the same gathered sums, so every rank raises alike.
            raise StateMismatchError(f"unit {unit.label}: ranks differ: {sums}")
        self.checked.append(unit.label)
        return len(sums) * local.element_size()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


def build_and_run() -> dict[str, object]:
    """Build with the three strategies on the ranks of the current process group."""
    with torch.device("meta"):
        model = nn.Sequential(Block(16), Block(16), nn.Linear(16, 4))
    materializer, groups, check = NameSeededInit(seed=0), OwnGroup(), ChecksumReplicas()
    builder = (
        FSDPBuilder()
        .device("cpu")
        .wrap(Block)
        .groups(groups)
        .materialize(materializer)
        .synchronize(check)
    )
    sharded = builder.build(model)
    assert builder.environment.groups.shard_group is groups.group
    out = sharded(torch.ones(2, 16))
    return {
        "initialized": materializer.initialized,
        "checked": check.checked,
        "output": float(out.sum()),
    }


def main() -> None:
    dist.init_process_group("gloo")  # torchrun's environment
    try:
        result = build_and_run()
        if dist.get_rank() == 0:
            for key, value in result.items():
                print(f"{key}: {value}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process_group()  # see its docstring: a clean exit on CPU ranks
