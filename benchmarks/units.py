"""Many small units: what the builder adds per unit above plain PyTorch.

A stack of ``units`` small blocks (Linear + LayerNorm), each its own wrap unit, built with
plain ``fully_shard`` / ``FullyShardedDataParallel`` and with the builders' default paths.
Plain-PyTorch parts deliberately avoid any ``fsdp_builder`` import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from benchmarks.common import Job, Outcome


@dataclass(frozen=True)
class UnitsConfig:
    units: int = 400
    dim: int = 32

    @property
    def params(self) -> int:
        return self.units * (self.dim * self.dim + 3 * self.dim)


class SmallBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class SmallStack(nn.Module):
    def __init__(self, cfg: UnitsConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SmallBlock(cfg.dim) for _ in range(cfg.units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_stack(cfg: UnitsConfig, device: str | torch.device = "meta") -> SmallStack:
    with torch.device(device):
        return SmallStack(cfg)


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def plain_fsdp2(cfg: UnitsConfig, job: Job) -> Outcome:
    """``fully_shard`` per block on meta, then ``to_empty`` and ``reset_parameters``."""
    mesh = init_device_mesh(job.device.type, (job.world_size,))
    model = make_stack(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=job.device)
    with torch.no_grad():
        for module in model.modules():
            _reset(module)
    return Outcome(module=model, comm_bytes=0)


def plain_fsdp1(cfg: UnitsConfig, job: Job) -> Outcome:
    """``FullyShardedDataParallel`` with auto-wrap and a ``param_init_fn`` per module."""
    device = job.device

    def init(module: nn.Module) -> None:
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            _reset(module)

    wrapped = FullyShardedDataParallel(
        make_stack(cfg),
        auto_wrap_policy=ModuleWrapPolicy({SmallBlock}),
        param_init_fn=init,
        device_id=device,
    )
    return Outcome(module=wrapped, comm_bytes=0)


def builder(
    cfg: UnitsConfig,
    job: Job,
    backend: str,
    materializer: str | None = None,
    library: str = "fsdp_builder",
) -> Outcome:
    """The builder's default path: only the device and the wrap policy are set (and the
    materializer named by ``materializer``, a class of the library built with its defaults,
    where given). ``library``: the package to build with (an earlier revision's copy under
    another name, for ``benchmarks.inprocess_ab``)."""
    fsdp_builder = importlib.import_module(library)

    chosen = fsdp_builder.FullyShardBuilder() if backend == "fsdp2" else fsdp_builder.FSDPBuilder()
    device = fsdp_builder.CPUDevice() if job.device.type == "cpu" else job.device
    chosen.device(device).wrap(SmallBlock)
    if materializer is not None:
        chosen.materialize(getattr(fsdp_builder, materializer)())
    module = chosen.build(make_stack(cfg))
    stages = chosen.report.stages()
    return Outcome(module=module, phases={str(s["name"]): float(s["seconds"]) for s in stages})
