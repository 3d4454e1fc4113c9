"""A unit that mixes modules already real with modules on meta: the materializers that
initialize only what is on meta leave the real ones' values as they are (as FSDP1's
``param_init_fn`` does), on both backends. FSDP1's default once reset them: a real BatchNorm's
statistics and a real Linear's weights came back at their initializers' values."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_builder as fb


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.real = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)


def _mixed() -> tuple[Mixed, dict[str, torch.Tensor]]:
    """On meta but for ``real`` and ``norm``, which hold trained-looking values; those values."""
    with torch.device("meta"):
        model = Mixed()
    model.real = nn.Linear(8, 8)
    model.norm = nn.BatchNorm1d(8)
    with torch.no_grad():
        model.real.weight.fill_(7.0)
        model.norm(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 3 + 1)
    kept = {n: t.detach().clone() for n, t in model.state_dict().items() if not t.is_meta}
    return model, kept


def _full(model: nn.Module, backend: str) -> dict[str, torch.Tensor]:
    if backend == "fsdp1":
        with FSDP.summon_full_params(model, writeback=False):
            return {
                n.replace("_fsdp_wrapped_module.", ""): t.detach().clone()
                for n, t in model.state_dict().items()
            }
    return {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
        for n, t in model.state_dict().items()
    }


@pytest.mark.parametrize(
    "builder, materializer",
    [
        ("fsdp1", None),
        ("fsdp1", fb.ResetParameters()),
        ("fsdp2", None),
        ("fsdp2", fb.ResetParameters()),
        ("fsdp2", fb.StreamInit(whole_below=0)),
    ],
    ids=["fsdp1-default", "fsdp1-ResetParameters", "fsdp2-default", "fsdp2-Reset", "fsdp2-Stream"],
)
def test_real_states_in_a_unit_with_meta_ones_keep_their_values(
    world1: None, builder: str, materializer: fb.ResetParameters | None
) -> None:
    model, kept = _mixed()
    b = fb.FSDPBuilder() if builder == "fsdp1" else fb.FullyShardBuilder()
    b = b.device(fb.CPUDevice())
    if materializer is not None:
        b = b.materialize(materializer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one rank: FSDP1's NO_SHARD notice
        full = _full(b.build(model), builder)
    assert set(kept) == {n for n in full if n.startswith(("real.", "norm."))}
    for name, value in kept.items():
        assert torch.equal(full[name], value), name
    assert not torch.equal(full["lin.weight"], torch.zeros(8, 8))  # initialized, not left empty
